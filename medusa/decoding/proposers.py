"""Proposers: where the candidate tokens of a verification pass come from.

A proposer owns a fixed tree shape and, each step, fills its non-root nodes with tokens for every active
row. The engine does the rest (one target pass, verification, cache commit), whatever the proposer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from medusa.errors import MedusaError
from medusa.decoding.heads import MedusaHeads
from medusa.decoding.tree import DEFAULT_TREE, Tree, load_tree

if TYPE_CHECKING:
    from medusa.decoding.engine import Batch


class Proposer(Protocol):
    name: str
    tree: Tree

    def propose(self, batch: "Batch") -> torch.Tensor:
        """Candidate tokens [n, tree.size - 1] for the batch's active rows, in tree node order."""
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
    def propose(self, batch: "Batch") -> torch.Tensor:
        hidden = batch.hidden[: batch.n]
        top = self.heads.top_tokens(hidden, self.tree.topk, self.tree.depth, self.projection)  # [D, n, k]
        flat = top.permute(1, 0, 2).reshape(hidden.shape[0], -1)
        return flat[:, self.tree.buffers(hidden.device).cand_index]
