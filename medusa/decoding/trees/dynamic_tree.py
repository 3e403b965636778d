"""Dynamic draft trees (EAGLE-2): a different tree per row and per step, verified in one target pass.

A static tree (`medusa.decoding.trees.tree.Tree`) has one shape for every row and every step. A dynamic tree is grown
from the proposer's own confidence: each draft step expands the top-k children of the frontier, every node is
scored by the sum of log-probabilities along its path, the k best become the next frontier, and after D
steps the N best nodes overall are verified. Scores only fall along a path (ties broken towards the
shallower node), so a kept node's parent is always kept and the selection is a tree.

Shapes differ by row, so the tree tensors carry a row dimension (`medusa.decoding.verifier.RowTrees`, what
every proposer's `draft` returns; a static tree's are views of its `TreeBuffers`). Every row has the same
number of nodes T, so the target pass stays one dense [B, T] block with a [B, T, T] mask. Rows may hold
*dead* nodes (padding: a row drafting a sampled chain shorter than the others); a dead node sits at depth 1,
sees only the root and itself, and is on no path and in no child list, so it can never be accepted.

Proposers that grow such trees are `medusa.decoding.proposers.GrowingProposer`s: `grow` gives a step's
`Growth` (the scored pool), `draft` keeps its N best nodes; per-row state that must follow what each step
commits (a feature head's features) is a `RowState` in `batch.aux` and hears of every step, speculative or
not (`committed`). Also here: the shapes a planner weighs (`shape_candidates`) and a shape's expected tokens
per step from a head's per-depth rank accuracies (`expected_tau_dynamic`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from medusa.decoding.proposers import GrowingProposer
from medusa.decoding.trees.tree import Tree, build_tree, expected_tau
from medusa.decoding.verifier import RowTrees
from medusa.errors import MedusaError

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch

NEG = float("-inf")
# Children per expansion when a name leaves it out. Wider frontiers give the N-best selection more to choose
# from: on the shipped feature head, top-8 expansions of a 16-node tree accepted 0.1 more tokens per step than
# top-4 (docs/feature-heads.md), for a draft pass over 8 entries instead of 4.
DEFAULT_TOPK = 8


def row_trees(tokens: torch.Tensor, parent: torch.Tensor, live: torch.Tensor, depth_bound: int,
              proposal: torch.Tensor | None = None) -> RowTrees:
    """Tree tensors from each node's parent.

    tokens [n, T-1], parent [n, T] (node indices; every live node's parent comes before it and is live;
    parent[:, 0] = 0), live [n, T] bool (live[:, 0] True). Dead nodes get parent 0 and depth 1.
    """
    n, t = parent.shape
    dev = parent.device
    idx = torch.arange(t, device=dev)
    parent = torch.where(live, parent, 0)
    parent[:, 0] = 0
    # Depth and ancestor sets by repeated parent lookups (D is small).
    node_depth = torch.zeros(n, t, dtype=torch.long, device=dev)
    anc = torch.eye(t, dtype=torch.bool, device=dev).expand(n, t, t).clone()
    cur = idx.expand(n, t).clone()
    rows = torch.arange(n, device=dev)[:, None]
    for _ in range(depth_bound):
        up = parent.gather(1, cur)
        moved = cur != 0
        node_depth += moved.long()
        anc[rows, idx[None, :].expand(n, t), up] = True
        cur = up
    node_depth = torch.where(live, node_depth, 1)
    node_depth[:, 0] = 0
    # node_paths[b, i, k] = the ancestor of i at depth k (k <= node_depth[i]), then i repeated.
    at_depth = node_depth[:, :, None] == torch.arange(depth_bound + 1, device=dev)  # [n, T(j), D+1]
    node_paths = torch.einsum("bij,bjk->bik", (anc & live[:, None, :]).long(), at_depth.long() * idx[None, :, None])
    beyond = torch.arange(depth_bound + 1, device=dev)[None, None, :] > node_depth[:, :, None]
    node_paths = torch.where(beyond, idx[None, :, None].expand_as(node_paths), node_paths)
    path_len = torch.where(live, node_depth, 0)
    node_paths = torch.where(live[:, :, None], node_paths, 0)
    node_paths[:, 0] = 0
    # Children in index order (nodes are ordered by rank within their parent).
    is_child = (parent[:, :, None] == idx[None, None, :]) & live[:, :, None] & (idx[None, :, None] > 0)  # [n,i,p]
    rank = (is_child.long().cumsum(1) * is_child.long()).sum(-1) - 1  # [n, i]
    width = max(1, int(is_child.sum(1).max()))
    children = torch.full((n, t, width), -1, dtype=torch.long, device=dev)
    has = rank >= 0
    b_idx = rows.expand(n, t)[has]
    children[b_idx, parent[has], rank[has]] = idx[None, :].expand(n, t)[has]
    return RowTrees(tokens, anc, node_depth, node_paths, path_len, children, parent, proposal)


def select_nodes(pool_score: torch.Tensor, pool_parent: torch.Tensor, pool_depth: torch.Tensor,
                 num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `num_nodes` best pool entries of each row as tree nodes.

    pool_score [n, P] (cumulative log-prob; -inf: never select), pool_parent [n, P] (pool index, -1 for
    the root), pool_depth [n, P] (>= 1). Returns (pool index of node i+1 [n, N], parent node index of
    node i+1 [n, N]; 0 = root); nodes are ordered by depth, then by pool index, so parents come first.
    """
    n, p = pool_score.shape
    dev = pool_score.device
    # Ties towards shallower nodes, then earlier ones: a child never outranks its parent.
    key = pool_score - 1e-4 * pool_depth.float()
    chosen = key.topk(num_nodes, dim=1).indices
    order = (pool_depth.gather(1, chosen) * p + chosen).argsort(1)
    chosen = chosen.gather(1, order)
    node_of = torch.full((n, p), -1, dtype=torch.long, device=dev)
    node_of.scatter_(1, chosen, torch.arange(1, num_nodes + 1, device=dev).expand(n, num_nodes))
    par_pool = pool_parent.gather(1, chosen)
    par_node = torch.where(par_pool >= 0, node_of.gather(1, par_pool.clamp(min=0)), 0)
    return chosen, par_node.clamp(min=0)


def pool_size(depth: int, topk: int) -> int:
    """Nodes a dynamic draft generates to choose from: top-k at the first step, then the top-k children
    of each of the k frontier nodes at every later one."""
    return topk + (depth - 1) * topk * topk


def stand_in_tree(nodes: int, depth: int, name: str) -> Tree:
    """A static tree with `nodes` nodes and depth `depth`, never verified: what plans and reports name a
    proposer by when its real trees are grown per step (`Proposer.tree`; sizes are `max_nodes`, `max_depth`)."""
    paths = [[0] * d for d in range(1, depth + 1)] + [[i] for i in range(1, nodes - depth + 1)]
    return Tree(paths, name=name)


# ---- naming a dynamic tree: dynamic-N, dynamic-NxD or dynamic-NxDxK ----------------------------------

DYNAMIC = "dynamic-"


def is_dynamic(name: object) -> bool:
    """Whether a tree name (`--tree`, `policy.trees`) names a dynamic tree."""
    return str(name).startswith(DYNAMIC)


@dataclass(frozen=True)
class TreeShape:
    """A dynamic tree's budget: `nodes` candidates, `depth` draft steps, `topk` children per expansion."""

    nodes: int = 16
    depth: int = 5
    topk: int = DEFAULT_TOPK

    @property
    def name(self) -> str:
        """The name of its stand-in tree (what reports, metrics and plans call it)."""
        return f"{DYNAMIC}{self.nodes}x{self.depth}"

    @property
    def full_name(self) -> str:
        """The name that parses back to this shape, top-k included."""
        return f"{self.name}x{self.topk}"

    def stand_in(self, name: str | None = None) -> Tree:
        return stand_in_tree(self.nodes, self.depth, name or self.name)

    def check(self) -> "TreeShape":
        if self.nodes < 1 or self.depth < 1 or self.topk < 1:
            raise MedusaError(f"dynamic tree needs nodes, depth and topk >= 1, got {self}")
        if pool_size(self.depth, self.topk) < self.nodes:
            raise MedusaError(f"a dynamic tree of depth {self.depth} and top-{self.topk} generates fewer than "
                              f"{self.nodes} nodes")
        if self.nodes < self.depth:
            raise MedusaError(f"{self.nodes} nodes cannot make a tree {self.depth} deep")
        return self


def parse_shape(name: str, topk: int = DEFAULT_TOPK) -> TreeShape:
    """`dynamic-N` (depth and top-k chosen for N) or `dynamic-NxD` (top-`topk`, at most N) or `dynamic-NxDxK`."""
    expected = f"--tree: {name!r}: expected {DYNAMIC}N, {DYNAMIC}NxD or {DYNAMIC}NxDxK"
    try:
        parts = [int(p) for p in str(name).removeprefix(DYNAMIC).split("x")] if is_dynamic(name) else []
    except ValueError:
        raise MedusaError(expected) from None
    if len(parts) == 1:
        n = parts[0]
        return TreeShape(n, max(1, min(6, n // 2 if n > 2 else n)), max(1, min(topk, n))).check()
    if len(parts) == 2:
        return TreeShape(parts[0], parts[1], max(1, min(topk, parts[0]))).check()
    if len(parts) == 3:
        return TreeShape(*parts).check()
    raise MedusaError(expected)


# ---- growing a dynamic tree ----------------------------------------------------------------------


@dataclass
class Pool:
    """Every node a dynamic draft generated, per row: P entries, later cut to the N best."""

    tokens: list[torch.Tensor]   # each [n, m] long
    scores: list[torch.Tensor]   # each [n, m] cumulative log-prob
    parents: list[torch.Tensor]  # each [n, m] pool index of the parent (-1: root)
    depths: list[int | torch.Tensor]  # each block's depth, or [n, m] long per entry

    def add(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
            depth: int | torch.Tensor) -> int:
        """Append entries; returns the pool index of the first one."""
        start = sum(t.shape[1] for t in self.tokens)
        self.tokens.append(tokens)
        self.scores.append(scores)
        self.parents.append(parents)
        self.depths.append(depth)
        return start

    def flat(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pool as one block (tokens, scores, parents, depths, each [n, P]); later edits of these
        tensors edit the pool. `n` and `device` size an empty pool."""
        if not self.tokens:
            empty = torch.zeros(n, 0, dtype=torch.long, device=device)
            self.add(empty, torch.zeros(n, 0, device=device), empty.clone(), empty.clone())
        if len(self.tokens) > 1 or isinstance(self.depths[0], int):
            dep = torch.cat([torch.full_like(t, d) if isinstance(d, int) else d
                             for t, d in zip(self.tokens, self.depths)], 1)
            self.tokens[:] = [torch.cat(self.tokens, 1)]
            self.scores[:] = [torch.cat(self.scores, 1)]
            self.parents[:] = [torch.cat(self.parents, 1)]
            self.depths[:] = [dep]
        return self.tokens[0], self.scores[0], self.parents[0], self.depths[0]

    def trees(self, num_nodes: int, depth_bound: int,
              proposal: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> RowTrees:
        """The `num_nodes` best entries per row as trees. `proposal(chosen, tokens)` ([n, N] pool indices
        and their tokens -> [n, N, V]) gives the distribution each kept node was drawn from."""
        tok, score, par, dep = self.flat(0, torch.device("cpu"))
        if tok.shape[1] < num_nodes:  # too few drafts (retrieval that found nothing): dead padding
            pad = torch.zeros(tok.shape[0], num_nodes - tok.shape[1], dtype=torch.long, device=tok.device)
            self.add(pad, torch.full(pad.shape, NEG, device=tok.device), pad - 1, pad + 1)
            tok, score, par, dep = self.flat(0, tok.device)
        chosen, parent = select_nodes(score, par, dep, num_nodes)
        live = torch.cat([torch.ones_like(chosen[:, :1], dtype=torch.bool), score.gather(1, chosen) > NEG], 1)
        parent = torch.cat([torch.zeros_like(parent[:, :1]), parent], 1)
        kept = tok.gather(1, chosen)
        q = proposal(chosen, kept) if proposal is not None else None
        return row_trees(kept, parent, live, depth_bound, q)


@dataclass
class Growth:
    """A tree proposer's step before the cut to N nodes (`grow`): what retrieval grafts onto.

    pool:     every generated node
    depth:    the deepest node's depth
    proposal: `Pool.trees`' proposal function (sampled chains), or None: point masses
    sampled:  [n] bool, rows whose tree is a sampled chain (None: no such rows)
    """

    pool: Pool
    depth: int
    proposal: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    sampled: torch.Tensor | None = None


def expand(logp: torch.Tensor, parent_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                           torch.Tensor]:
    """Top-k children of each frontier node: logp [n, F, V] -> (token index [n, F*k], cumulative score
    [n, F*k], frontier slot of the parent [n, F*k])."""
    n, f, _ = logp.shape
    top = logp.topk(k, dim=-1)
    scores = parent_scores[:, :, None] + top.values
    slot = torch.arange(f, device=logp.device)[None, :, None].expand(n, f, k)
    return top.indices.reshape(n, -1), scores.reshape(n, -1), slot.reshape(n, -1)


# ---- Medusa heads growing a dynamic tree -----------------------------------------------------------


class MedusaDynamicProposer(GrowingProposer):
    """Medusa heads with a per-row dynamic tree: head d's top-k log-probabilities at the root's hidden state
    score depth d+1 (they do not depend on the parent, so a row's tree is the N most probable paths
    through its own top-k lists). Trees adapt to each row's confidence, where a static tree follows the
    heads' average accuracy."""

    name = "medusa-dynamic"

    def __init__(self, heads, nodes: int, depth: int, topk: int, projection: torch.nn.Module | None = None):
        if depth > heads.config.num_heads:
            raise MedusaError(f"a dynamic tree {depth} deep needs {depth} heads, these have {heads.config.num_heads}")
        if nodes < depth or topk < 1 or pool_size(depth, topk) < nodes:
            raise MedusaError(f"no dynamic tree of {nodes} nodes, depth {depth} and top-{topk}")
        self.heads, self.projection = heads, projection
        self.nodes, self.depth, self.topk = nodes, depth, topk
        self.max_nodes, self.max_depth = nodes + 1, depth
        self.tree = TreeShape(nodes, depth, topk).stand_in()

    def _log_probs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's top-k (log-prob [D, n, k], token id [D, n, k]) over its candidate vocabulary."""
        ids = self.heads.candidate_ids
        logits = self.heads.candidate_logits(hidden, self.depth, self.projection)
        top = torch.log_softmax(logits.float(), -1).topk(self.topk, -1)
        tok = top.indices if ids is None else ids[top.indices]
        return top.values, tok

    @torch.inference_mode()
    def grow(self, batch: "Batch") -> Growth:
        n, k = batch.n, self.topk
        lp, tok = self._log_probs(batch.hidden[:n])
        dev = lp.device
        pool = Pool([], [], [], [])
        start = pool.add(tok[0], lp[0], torch.full_like(tok[0], -1), 1)
        front_pool, front_score = start + torch.arange(k, device=dev).expand(n, k), lp[0]
        for d in range(1, self.depth):
            scores = (front_score[:, :, None] + lp[d][:, None, :]).reshape(n, -1)
            slot = torch.arange(k, device=dev)[None, :, None].expand(n, k, k).reshape(n, -1)
            start = pool.add(tok[d].repeat(1, k), scores, front_pool.gather(1, slot), d + 1)
            best = scores.topk(k, -1).indices
            front_pool, front_score = start + best, scores.gather(1, best)
        return Growth(pool, self.depth)


def shape_candidates(max_nodes: int = 64, max_depth: int = 8, topk: int = DEFAULT_TOPK) -> list[TreeShape]:
    sizes = [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64]
    out = []
    for depth in range(1, max_depth + 1):
        for n in sizes:
            if n <= max_nodes and n >= depth and pool_size(depth, topk) >= n:
                out.append(TreeShape(n, depth, min(topk, n)))
    return out


def expected_tau_dynamic(shape: TreeShape, accuracy: list[list[float]]) -> float:
    """Expected tokens per step of a `shape` tree from per-draft-step rank accuracies (eval.json), taken
    as the best static tree of that budget: a dynamic tree, chosen per row, does at least as well (on the
    shipped head's held-out texts it measured the same, within 0.01). accuracy[j][r]: the rank-r token at
    depth j + 1 is right given the path to it was accepted (`medusa.train.feature_eval.evaluate_head`
    counts it along the accepted paths); accuracies counted over every position instead (eval.json of
    heads evaluated before that) treat the depths as independent and come out lower."""
    return _expected_tau_dynamic(shape, tuple(tuple(row[: shape.topk]) for row in accuracy[: shape.depth]))


@functools.lru_cache(maxsize=4096)
def _expected_tau_dynamic(shape: TreeShape, acc: tuple[tuple[float, ...], ...]) -> float:
    # Cached: every new auto-mode planner (one per request or run) weighs the same ~100 shapes, and
    # building their trees costs more than a whole speculative step.
    if not acc:
        return 1.0
    rows = [list(r) for r in acc]
    return expected_tau(build_tree(rows, shape.nodes).nodes, rows)
