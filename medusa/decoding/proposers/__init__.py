"""Proposers: where the candidate tokens of a verification pass come from.

Every proposer implements `Proposer`, the whole contract the engine, auto mode and the server rely on: each
step the engine asks it to `draft` a candidate tree per active row (`medusa.decoding.verifier.RowTrees`), and
reads `max_nodes` and `max_depth` to size caches and statistics. Two bases fill in `draft` for the usual
kinds: a `StaticProposer` owns one fixed tree and only `fill`s its nodes with tokens for every row (the tree's
precomputed buffers are shared by every row: no per-row tree work); a `GrowingProposer` grows a pool of
scored nodes per row (`grow`) and keeps the best `max_nodes - 1` of them (retrieval grafts onto that pool).
Per-row state a proposer keeps beside a batch (a draft model's cache, a feature head's features,
retrieval's automata) is a `RowState` in `batch.aux`. The engine does the rest (one target pass,
verification, cache commit).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from medusa.errors import MedusaError
from medusa.decoding.proposers.heads import MedusaHeads
from medusa.decoding.target.transformer import KVCache
from medusa.decoding.trees.tree import DEFAULT_TREE, Tree, load_tree
from medusa.decoding.verifier import RowTrees

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch
    from medusa.decoding.trees.dynamic_tree import Growth
    from medusa.decoding.verifier import Verdict


class Proposer:
    """What every proposer is.

    name:       what reports and metrics call it
    max_nodes:  the most tokens per row one of its verification passes holds, root included (caches are
                sized by `span`, the larger of it and max_depth + 1)
    max_depth:  the deepest candidate it proposes (acceptance histograms are sized by it)
    tree:       what plans and reports name it by: a static proposer's own tree; for one that builds its
                trees per step, a stand-in of the same size and depth, never verified
    attach:     set up per-row state beside a new batch (a `RowState` in `batch.aux`), before any row is
                prefilled, so the state sees the prompts; stateless proposers need nothing
    draft:      the step's candidate trees for the batch's active rows, one per row
    """

    name: str = "proposer"
    max_nodes: int
    max_depth: int
    tree: Tree

    @property
    def span(self) -> int:
        """KV slots one step needs past a row's length: its pass (`max_nodes`) or its longest path, root
        included (`max_depth` + 1: a grafted branch can be deeper than the tree has nodes), whichever is
        more. Caches are sized by it."""
        return max(self.max_nodes, self.max_depth + 1)

    def attach(self, batch: "Batch") -> None:
        """Per-row state for `batch`, made before its rows are prefilled (default: none)."""

    def draft(self, batch: "Batch") -> RowTrees:
        """One candidate tree per active row (rows [0, batch.n)), at most `max_nodes` nodes, `max_depth` deep."""
        raise NotImplementedError


class StaticProposer(Proposer):
    """A proposer of one fixed `tree`, the same for every row: it gives each row's candidate tokens in the
    tree's node order (`fill`), and the rows share the tree's precomputed buffers."""

    @property
    def max_nodes(self) -> int:
        return self.tree.size

    @property
    def max_depth(self) -> int:
        return self.tree.depth

    def fill(self, batch: "Batch") -> torch.Tensor:
        """The candidate of each non-root node for every active row: [n, tree.size - 1] long."""
        raise NotImplementedError

    def draft(self, batch: "Batch") -> RowTrees:
        if self.tree.size == 1:  # the root alone: nothing to fill
            tokens = batch.root[: batch.n, None][:, :0]
        else:
            tokens = self.fill(batch).to(batch.root.device)
        return RowTrees.shared(tokens, self.tree.buffers(tokens.device))


class GrowingProposer(Proposer):
    """A proposer that grows a tree per row: every step it generates a pool of scored nodes (`grow`), and
    its draft is the best `max_nodes - 1` of them. `medusa.decoding.proposers.retrieval.MergedProposer` grafts
    retrieval's branches onto that pool before the cut."""

    def grow(self, batch: "Batch") -> "Growth":
        """The step's whole pool of drafted nodes for the active rows (`medusa.decoding.trees.dynamic_tree.Growth`)."""
        raise NotImplementedError

    @torch.inference_mode()
    def draft(self, batch: "Batch") -> RowTrees:
        grown = self.grow(batch)
        return grown.pool.trees(self.max_nodes - 1, grown.depth, grown.proposal)


class RowState:
    """Per-row proposer state kept in `batch.aux`: it follows rows when the batch closes gaps, and hears of
    every prefill and every verification pass, speculative or not (defaults: nothing to do)."""

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Row src[i] moved into slot dst[i]."""

    def prefilled(self, rows: slice, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor,
                  start: int = 0) -> None:
        """Prompt tokens [k, T] (lengths [k]) at positions start.. of `rows` went through the target: hidden
        [k, T, H]. A whole prompt comes at start 0; a long one comes in chunks, in order."""

    def committed(self, lens: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor, verdict: "Verdict") -> None:
        """A verification pass over tokens [n, T] (cache lengths lens [n] before it) gave hidden [n, T, H];
        `verdict` says what each row kept."""


class MedusaProposer(StaticProposer):
    """Each head's top-k on the hidden state that produced the root, arranged as the tree says."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, tree: Tree | str = DEFAULT_TREE, projection: torch.nn.Module | None = None):
        self.heads = heads
        self.projection = projection  # the engine's (possibly packed) lm_head, for shared-projection heads
        self.tree = load_tree(tree, heads_dir=heads.directory) if isinstance(tree, str) else tree
        self.tree.check_heads(heads.config.num_heads)
        vocab = heads.config.candidates or heads.config.vocab_size
        if self.tree.topk > vocab:
            raise MedusaError(f"tree {self.tree.name!r} asks for each head's top-{self.tree.topk} tokens but the "
                              f"heads can propose only {vocab}")

    @torch.inference_mode()
    def fill(self, batch: "Batch") -> torch.Tensor:
        hidden = batch.hidden[: batch.n]
        top = self.heads.top_tokens(hidden, self.tree.topk, self.tree.depth, self.projection)  # [D, n, k]
        flat = top.permute(1, 0, 2).reshape(hidden.shape[0], -1)
        return flat[:, self.tree.buffers(hidden.device).cand_index]


# ---- per-row caches a proposer keeps beside the target's (a draft model's, a feature head's) -----------------
# Each row's entries stay exact as long as the tokens they were computed from are unchanged, so a cache is
# brought up to date by finding how much of it is still valid (`common_prefix`) and feeding each row the
# positions it lacks (`catch_up`), all rows in one right-padded block.

def common_prefix(cached: torch.Tensor, ctx: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Per row, the length of the common prefix of `cached` and `ctx` [n, W], at most `limit` [n]."""
    pos = torch.arange(ctx.shape[1], device=ctx.device)
    differs = (cached != ctx) | (pos[None, :] >= limit[:, None])
    return torch.where(differs.any(1), differs.long().argmax(1), limit)


def catch_up(cache: KVCache, rows: slice, upto: torch.Tensor, last: torch.Tensor | None,
             run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """Feed each row its positions [cache.lens, upto) in blocks that fit the cache.

    `run(lens [n], j [t])` computes the entries of positions lens + j (causal within the block; a row's
    entries past upto are scratch) and returns their outputs [n, t, h]. Returns each row's output at
    position upto - 1, or its row of `last` [n, h] when it had nothing to feed (None: nothing returned)."""
    ar = torch.arange(upto.shape[0], device=upto.device)
    while True:
        lens = cache.lens[rows]
        todo = upto - lens
        most = int(todo.max())
        if most <= 0:
            return last
        t = min(most, cache.capacity - int(lens.max()))
        out = run(lens, torch.arange(t, device=upto.device))
        count = todo.clamp(min=0, max=t)
        if last is not None:
            done = (count > 0) & (count == todo)
            last = torch.where(done[:, None], out[ar, (count - 1).clamp(min=0)], last)
        cache.lens[rows] = lens + count


@contextmanager
def rewound(cache: KVCache, rows: slice, to: torch.Tensor) -> Iterator[None]:
    """The cache's lengths of `rows` set to `to` [n] inside the block and restored after it: for re-running
    committed positions [to, lens) over the same tokens (same K/V entries; those past lens are scratch)."""
    saved = cache.lens[rows].clone()
    cache.lens[rows] = to
    try:
        yield
    finally:
        cache.lens[rows] = saved


def context(batch: "Batch") -> torch.Tensor:
    """[n, W] each active row's committed tokens, then its pending root (at index cache length); W is the
    longest row's length + 1, shorter rows right-padded with whatever `batch.seq` holds there."""
    n = batch.n
    lens = batch.cache.lens[:n]
    ctx = batch.seq[:n, : int(lens.max()) + 1].clone()
    ctx.scatter_(1, lens[:, None], batch.root[:n, None])
    return ctx


def aux_state(batch: "Batch", key: str, fits: Callable[[Any], bool], make: Callable[[], Any]) -> Any:
    """The per-row proposer state kept at `batch.aux[key]`, made anew when the one there does not fit."""
    state = batch.aux.get(key)
    if not fits(state):
        with torch.inference_mode(False):  # normal tensors: rows are moved outside inference mode too
            state = make()
        batch.aux[key] = state
    return state
