"""Proposers: where the candidate tokens of a verification pass come from.

A proposer owns a fixed tree shape and, each step, fills its non-root nodes with tokens for every active
row. The engine does the rest (one target pass, verification, cache commit), whatever the proposer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from medusa.errors import MedusaError
from medusa.decoding.heads import MedusaHeads
from medusa.decoding.tree import DEFAULT_TREE, Tree, load_tree

if TYPE_CHECKING:
    from medusa.decoding.engine import Batch


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


class Proposer(Protocol):
    name: str
    tree: Tree

    def propose(self, batch: "Batch") -> Proposal:
        """Candidates for the batch's active rows."""
        ...


class MedusaProposer:
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
