"""Proposers: where the candidate tokens of a verification pass come from.

A proposer owns a fixed tree shape and, each step, fills its non-root nodes with tokens for every active
row. The engine does the rest (one target pass, verification, cache commit), whatever the proposer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from .errors import MedusaError
from .heads import MedusaHeads
from .tree import Tree, load_tree

if TYPE_CHECKING:
    from .engine import Batch


class Proposer(Protocol):
    name: str
    tree: Tree

    def propose(self, batch: "Batch") -> torch.Tensor:
        """Candidate tokens [n, tree.size - 1] for the batch's active rows, in tree node order."""
        ...


class MedusaProposer:
    """Each head's top-k on the hidden state that produced the root, arranged as the tree says."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, tree: Tree | str = "tree-16", projection: torch.nn.Module | None = None):
        self.heads = heads
        self.projection = projection  # the engine's (possibly packed) lm_head, for shared-projection heads
        self.tree = load_tree(tree) if isinstance(tree, str) else tree
        self.tree.check_heads(heads.config.num_heads)
        if self.tree.topk > heads.config.vocab_size:
            raise MedusaError(f"tree {self.tree.name!r} asks for each head's top-{self.tree.topk} tokens but the "
                              f"vocabulary has only {heads.config.vocab_size}")

    @torch.inference_mode()
    def propose(self, batch: "Batch") -> torch.Tensor:
        hidden = batch.hidden[: batch.n]
        logits = self.heads(hidden, self.projection, self.tree.depth)  # [D, n, V]
        top = logits.topk(self.tree.topk, dim=-1).indices  # [D, n, k]
        flat = top.permute(1, 0, 2).reshape(hidden.shape[0], -1)
        return flat[:, self.tree.buffers(hidden.device).cand_index]
