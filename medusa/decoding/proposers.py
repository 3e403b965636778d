"""Proposers: where the candidate tokens of a verification pass come from.

Every proposer implements `Proposer`, the whole contract the engine, auto mode and the server rely on. A
static proposer owns a fixed tree and, each step, fills its non-root nodes with tokens for every active row
(`propose`); a per-row tree proposer grows a different tree per row (`owns_step`, `draft`). Per-row state a
proposer keeps beside a batch (a draft model's cache, a feature head's features, retrieval's automata) is a
`RowState` in `batch.aux`. The engine does the rest (one target pass, verification, cache commit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from medusa.errors import MedusaError
from medusa.decoding.heads import MedusaHeads
from medusa.decoding.tree import DEFAULT_TREE, Tree, load_tree

if TYPE_CHECKING:
    from medusa.decoding.dynamic_tree import RowTrees
    from medusa.decoding.batch import Batch
    from medusa.decoding.verifier import Verdict


@dataclass
class Proposal:
    """One step's candidates for the batch's n active rows, in tree node order.

    tokens: [n, tree.size - 1] long
    probs:  [n, tree.size - 1, V] float or None: the distribution each token was drawn from, when the
            proposer sampled its drafts (None: deterministic picks, point masses to the verifier)
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> "Proposal":
        return Proposal(self.tokens.to(device), None if self.probs is None else self.probs.to(device))


class Proposer:
    """What every proposer is.

    name:       what reports and metrics call it
    tree:       static proposers: the tree every row's candidates fill; per-row tree proposers: a stand-in
                with the largest size and depth they ever propose (caches and histograms are sized by it)
    owns_step:  False: the engine asks `propose` for candidates filling `tree`; True: it asks `draft` for a
                tree per row (`medusa.decoding.dynamic_tree.RowTrees`)
    attach:     set up per-row state beside a new batch (a `RowState` in `batch.aux`), before any row is
                prefilled, so the state sees the prompts; stateless proposers need nothing
    """

    name: str = "proposer"
    tree: Tree
    owns_step: bool = False

    def attach(self, batch: "Batch") -> None:
        """Per-row state for `batch`, made before its rows are prefilled (default: none)."""

    def propose(self, batch: "Batch") -> Proposal:
        """Candidates for the batch's active rows, filling `tree` (static proposers)."""
        raise NotImplementedError(f"{self.name} drafts a tree per row: the engine calls draft()")

    def draft(self, batch: "Batch") -> "RowTrees":
        """One tree per active row (proposers with `owns_step`)."""
        raise NotImplementedError(f"{self.name} fills one static tree: the engine calls propose()")


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


class MedusaProposer(Proposer):
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
    def propose(self, batch: "Batch") -> Proposal:
        hidden = batch.hidden[: batch.n]
        top = self.heads.top_tokens(hidden, self.tree.topk, self.tree.depth, self.projection)  # [D, n, k]
        flat = top.permute(1, 0, 2).reshape(hidden.shape[0], -1)
        return Proposal(flat[:, self.tree.buffers(hidden.device).cand_index])
