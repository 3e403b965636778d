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

from typing import TYPE_CHECKING

import torch

from medusa.errors import MedusaError
from medusa.decoding.heads import MedusaHeads
from medusa.decoding.tree import DEFAULT_TREE, Tree, load_tree
from medusa.decoding.verifier import RowTrees

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch
    from medusa.decoding.dynamic_tree import Growth
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
    its draft is the best `max_nodes - 1` of them. `medusa.decoding.retrieval.MergedProposer` grafts
    retrieval's branches onto that pool before the cut."""

    def grow(self, batch: "Batch") -> "Growth":
        """The step's whole pool of drafted nodes for the active rows (`medusa.decoding.dynamic_tree.Growth`)."""
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
