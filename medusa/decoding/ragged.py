"""Per-row caches that proposers keep beside the target's (a draft model's, a feature head's).

Each row's entries stay exact as long as the tokens they were computed from are unchanged, so a cache is
brought up to date by finding how much of it is still valid (`common_prefix`) and feeding each row the
positions it lacks (`catch_up`), all rows in one right-padded block.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from medusa.decoding.transformer import KVCache

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch


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
