"""Prompt lookup (n-gram) proposer: copy what followed the last occurrence of the current suffix.

No model at all: for each row, the last `g` tokens of its context (committed tokens plus the pending root)
are searched for earlier in the same context, longest n-gram first (`max_ngram` down to `min_ngram`); the
`k` tokens after the most recent match become the candidate chain. It pays off when the output repeats the
prompt (summaries, code edits, extraction) and costs almost nothing when it does not. All rows are matched
at once with tensor ops over `batch.seq`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from medusa.errors import MedusaError
from medusa.decoding.proposers import StaticProposer, context
from medusa.decoding.trees.tree import chain

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch


class LookupProposer(StaticProposer):
    name = "lookup"

    def __init__(self, k: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if k < 1:
            raise MedusaError(f"lookup k must be >= 1, got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise MedusaError(f"lookup n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self.tree = chain(k)

    @torch.inference_mode()
    def fill(self, batch: "Batch") -> torch.Tensor:
        ctx = context(batch)
        return propose_from(ctx, batch.cache.lens[: batch.n] + 1, self.k, self.max_ngram, self.min_ngram)


def propose_from(ctx: torch.Tensor, ctx_len: torch.Tensor, k: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """Candidates [n, k] for contexts ctx[r, :ctx_len[r]] (right-padded).

    Rows with no match propose their last token repeated: never accepted unless it is right, and
    verification makes any proposal safe.
    """
    n, width = ctx.shape
    dev = ctx.device
    ar = torch.arange(n, device=dev)
    last_tok = ctx[ar, ctx_len - 1]
    start = torch.full((n,), -1, dtype=torch.long, device=dev)  # where the copied continuation begins
    for g in range(max_ngram, min_ngram - 1, -1):
        if width <= g:
            continue
        pos = torch.arange(width - g + 1, device=dev)
        suffix_idx = (ctx_len[:, None] - g + torch.arange(g, device=dev)).clamp(min=0)
        suffix = ctx.gather(1, suffix_idx)  # [n, g]
        windows = ctx.unfold(1, g, 1)  # [n, width-g+1, g]
        hit = (windows == suffix[:, None, :]).all(-1)
        # An earlier occurrence with at least one token after it, inside the row's real context.
        hit &= (pos[None, :] + g < ctx_len[:, None]) & (ctx_len[:, None] > g)
        latest = torch.where(hit, pos[None, :], -1).max(1).values
        found = (start < 0) & (latest >= 0)
        start = torch.where(found, latest + g, start)
    idx = start[:, None] + torch.arange(k, device=dev)
    ok = (start[:, None] >= 0) & (idx < ctx_len[:, None])
    copied = ctx.gather(1, idx.clamp(0, width - 1))
    return torch.where(ok, copied, last_tok[:, None])
