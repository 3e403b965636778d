"""Sparse candidate trees: from a list of top-k index paths to the tensors one verification pass needs.

A tree is a set of paths such as [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]: path [i, j] means
"head 1's i-th best token, then head 2's j-th best token after it". Node 0 is the root, the token the
target itself chose last step; node n (n >= 1) is paths[n-1]. Everything is built once per tree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from medusa.errors import MedusaError
from medusa.io import ASSETS

# Trees built from the shipped heads' eval.json live with those heads, so the two are replaced together
# (`medusa export --to-shipped`); hand-made trees (`prior-*`) depend on no heads and live apart.
CONFIG_DIR = ASSETS / "heads" / "trees"
HAND_MADE_DIR = ASSETS / "trees"
# The fastest shipped tree at batch size 1 on the reference CPU, where a pass over 16 nodes already costs
# ~1.5 plain steps; on a GPU a larger tree (tree-32/64) is nearly free and accepts more.
DEFAULT_TREE = "tree-8"


@dataclass(frozen=True)
class TreeBuffers:
    """Per-tree tensors, on one device.

    mask:        [T, T] bool, node i may attend to node j (j is i or an ancestor of i)
    node_depth:  [T] long, each node's depth: its position offset after the committed prefix
    cand_index:  [T-1] long, index into the heads' flattened top-k ([num_heads * topk]) per non-root node
    leaf_paths:  [P, D+1] long, root-to-leaf node indices, padded by repeating the leaf (D: the tree's depth)
    path_len:    [P] long, number of non-root nodes on each path
    children:    [T, C] long, each node's children in rank order, padded with -1
    parent:      [T] long, each node's parent (the root is its own)
    """

    mask: torch.Tensor
    node_depth: torch.Tensor
    cand_index: torch.Tensor
    leaf_paths: torch.Tensor
    path_len: torch.Tensor
    children: torch.Tensor
    parent: torch.Tensor


class Tree:
    def __init__(self, paths: list[list[int]] | list[tuple[int, ...]], name: str = "custom"):
        self.name = name
        nodes = sorted({tuple(int(i) for i in p) for p in paths}, key=lambda p: (len(p), p))
        for p in nodes:
            if len(p) == 0:
                raise MedusaError(f"tree {name!r}: empty path (the root is implicit)")
            if min(p) < 0:
                raise MedusaError(f"tree {name!r}: negative top-k index in path {list(p)}")
            if len(p) > 1 and p[:-1] not in nodes:
                raise MedusaError(f"tree {name!r}: path {list(p)} has no parent {list(p[:-1])} in the tree")
        self.nodes: list[tuple[int, ...]] = nodes
        self.depth = max((len(p) for p in nodes), default=0)
        self.topk = max((p[-1] for p in nodes), default=-1) + 1
        self._buffers: dict[torch.device, TreeBuffers] = {}

    @property
    def size(self) -> int:
        """Tokens per row in one verification pass (root included)."""
        return len(self.nodes) + 1

    def __repr__(self) -> str:
        return f"Tree({self.name!r}, nodes={len(self.nodes)}, depth={self.depth}, topk={self.topk})"

    def check_heads(self, num_heads: int) -> None:
        if self.depth > num_heads:
            raise MedusaError(f"tree {self.name!r} is {self.depth} deep but the heads checkpoint has only "
                              f"{num_heads} heads; use a shallower tree or more heads")

    def buffers(self, device: torch.device | str = "cpu") -> TreeBuffers:
        device = torch.device(device)
        if device not in self._buffers:
            self._buffers[device] = self._build(device)
        return self._buffers[device]

    def _build(self, device: torch.device) -> TreeBuffers:
        index = {p: i + 1 for i, p in enumerate(self.nodes)}
        index[()] = 0
        t = self.size
        mask = torch.zeros(t, t, dtype=torch.bool)
        depth = torch.zeros(t, dtype=torch.long)
        mask[0, 0] = True
        for p, i in index.items():
            depth[i] = len(p)
            for k in range(len(p) + 1):  # the node itself and every ancestor, root included
                mask[i, index[p[:k]]] = True
        cand_index = torch.tensor([(len(p) - 1) * max(self.topk, 1) + p[-1] for p in self.nodes], dtype=torch.long)
        leaves = [p for p in self.nodes if not any(q[:-1] == p for q in self.nodes if len(q) == len(p) + 1)]
        leaves = leaves or [()]
        paths = torch.zeros(len(leaves), self.depth + 1, dtype=torch.long)
        for r, leaf in enumerate(leaves):
            chain = [index[leaf[:k]] for k in range(len(leaf) + 1)]
            chain += [chain[-1]] * (self.depth + 1 - len(chain))
            paths[r] = torch.tensor(chain)
        path_len = torch.tensor([len(leaf) for leaf in leaves], dtype=torch.long)
        kids: list[list[int]] = [[] for _ in range(t)]
        for p, i in index.items():
            if p:
                kids[index[p[:-1]]].append(i)  # nodes are sorted, so children come in rank order
        width = max(1, max(len(k) for k in kids))
        children = torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.long)
        parent = torch.tensor([index[p[:-1]] if p else 0 for p in [()] + self.nodes], dtype=torch.long)
        return TreeBuffers(*(x.to(device) for x in (mask, depth, cand_index, paths, path_len, children, parent)))


def chain(k: int) -> Tree:
    """A single path of k nodes: what a draft model proposes."""
    return Tree([[0] * d for d in range(1, k + 1)], name=f"chain-{k}")


ROOT_ONLY = Tree([], name="none")


def build_tree(accuracy: list[list[float]], budget: int, name: str | None = None) -> Tree:
    """Greedy construction: repeatedly add the node that adds the most expected accepted length.

    accuracy[k][r] is the probability that head k's rank-r token is the right one given its prefix was
    accepted. A node's value is the product of the accuracies along its path, so adding the best frontier
    node each time gives the budget-limited tree with the largest expected acceptance.
    """
    chosen: dict[tuple[int, ...], float] = {}
    frontier = {(r,): accuracy[0][r] for r in range(len(accuracy[0]))}
    while len(chosen) < budget and frontier:
        best = max(frontier, key=lambda p: (frontier[p], [-i for i in p]))
        chosen[best] = frontier.pop(best)
        k = len(best)
        if k < len(accuracy):
            for r in range(len(accuracy[k])):
                frontier[best + (r,)] = chosen[best] * accuracy[k][r]
    return Tree([list(p) for p in chosen], name=name or f"greedy-{budget}")


def tree_dirs(heads_dir: str | Path | None = None) -> list[Path]:
    """Where tree names are looked up, in order: the heads' own `trees/`, the shipped heads' trees, the
    hand-made ones."""
    own = [Path(heads_dir) / "trees"] if heads_dir is not None else []
    return own + [CONFIG_DIR, HAND_MADE_DIR]


MAX_CHAIN = 16


def load_tree(spec: "str | Path | list | Tree", heads_dir: str | Path | None = None) -> Tree:
    """The one place a tree spec is read (`--tree`, the server's `policy.trees`, the evaluator's methods):

    - a Tree (returned as it is) or a list of top-k index paths;
    - `chain-K`: the heads' top-1 tokens only, K deep (1..16): what pays when the heads are weak or a
      tree costs too much;
    - a YAML/JSON file holding a list of paths (key `paths`, or the list itself);
    - a name such as `tree-16`, looked up first in `heads_dir/trees/` (the trees built for those heads),
      then among the shipped trees.
    """
    if isinstance(spec, Tree):
        return spec
    if isinstance(spec, list):
        return Tree(spec)
    m = re.fullmatch(r"chain-(\d+)", str(spec))
    if m:
        if not 1 <= int(m.group(1)) <= MAX_CHAIN:
            raise MedusaError(f"--tree: {spec}: chain depth must be 1..{MAX_CHAIN}")
        return chain(int(m.group(1)))
    path = Path(spec)
    if not path.exists():
        dirs = tree_dirs(heads_dir)
        named = next((d / f"{spec}.yaml" for d in dirs if (d / f"{spec}.yaml").exists()), None)
        if named is None:
            names = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
            raise MedusaError(f"--tree: {spec!r} is neither a file nor a known tree ({', '.join(names)}, "
                              f"chain-K)")
        path = named
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise MedusaError(f"--tree: {path} is not valid YAML/JSON: {exc}") from None
    paths = data.get("paths") if isinstance(data, dict) else data
    if not isinstance(paths, list) or not all(isinstance(p, list) and all(isinstance(i, int) for i in p)
                                              for p in paths):
        raise MedusaError(f"--tree: {path} must hold a list of integer paths (key 'paths')")
    return Tree(paths, name=path.stem)


def expected_tau(paths: "list[tuple[int, ...]] | list[list[int]]", rank_accuracy: list[list[float]]) -> float:
    """1 + sum over tree nodes of the product of the rank accuracies along the node's path: the expected
    accepted length per pass if heads' hits are independent (ranks or depths not measured count as 0)."""
    def hit(k: int, r: int) -> float:
        return rank_accuracy[k][r] if k < len(rank_accuracy) and r < len(rank_accuracy[k]) else 0.0

    total = 1.0
    for path in paths:
        p = 1.0
        for k, r in enumerate(path):
            p *= hit(k, r)
        total += p
    return total
