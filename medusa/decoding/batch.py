"""`Batch`: the decoding state of the sequences one engine steps together, and `Prefill`, a long prompt on its
way into a batch one chunk at a time.

Rows are slots of one KV cache. The active rows occupy slots [0, n) and every step runs over exactly that
view; a finished row's slot is filled by moving the last rows down. A prompt being prefilled in chunks
(`Engine.begin`, then chunks carried by `Engine.step` or run by `Engine.advance`) sits in the cache's top
slot, outside the active view, so the running rows' steps never see it; once all of it is in, `Engine.join`
moves it into slot n, where it joins the batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from medusa.decoding.outputs import MAX_TOP_LOGPROBS, Finished, Stats, StepOutput, TokenLogprobs
from medusa.decoding.proposers import RowState
from medusa.decoding.sampling import RowSampling, SamplingParams
from medusa.decoding.target.transformer import Transformer
from medusa.errors import MedusaError


@dataclass
class Prefill:
    """A prompt being prefilled chunk by chunk into slot `slot` (the batch's top slot); `done` of its tokens
    are in the cache. What it joins the batch with once its last chunk ran: `max_new`, `sampling`, `logprobs`
    (as `Engine.add` takes them)."""

    id: Hashable
    prompt: list[int]
    max_new: int
    sampling: SamplingParams
    logprobs: int | None
    slot: int
    done: int = 0
    last: torch.Tensor | None = None  # [1, H] the hidden state of the last prompt token prefilled

    @property
    def left(self) -> int:
        """Prompt tokens not yet in the cache."""
        return len(self.prompt) - self.done


class Batch:
    """Decoding state of up to `rows` sequences: cache, pending root token and its hidden state, outputs."""

    def __init__(self, model: Transformer, rows: int, capacity: int, max_new_tokens: int):
        dev = model.device
        self.cache = model.new_cache(rows, capacity)
        self.n = 0
        self.ids: list[Hashable] = []
        self.root = torch.zeros(rows, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(rows, model.config.hidden_size, dtype=model.dtype, device=dev)
        self.out = torch.zeros(rows, max_new_tokens + 1, dtype=torch.long, device=dev)
        self.out_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.max_new = torch.zeros(rows, dtype=torch.long, device=dev)
        # Every row's committed tokens (prompt, then output; the pending root is not included): what
        # context-based proposers read (prompt lookup) and what a draft model catches up on.
        self.seq = torch.zeros(rows, capacity, dtype=torch.long, device=dev)
        # Per-row state that proposers keep beside the batch (a draft model's KV cache, a feature head's
        # features, retrieval's automata), by proposer kind.
        self.aux: dict[str, RowState] = {}
        self.sampling = RowSampling(rows, dev)
        self.stats = Stats()
        # Request id -> top-k of the rows that asked for log-probabilities. Empty in the common case, so
        # a step pays one dict check for the feature.
        self.logprobs: dict[Hashable, int] = {}
        self.pending: Prefill | None = None  # a prompt being prefilled in chunks, in the top slot
        # A prefix cache's hook (`medusa.decoding.prefix_cache`), None by default: called as
        # retain(batch, slots, ids, leaving) with rows whose committed positions' K/V it may keep: new rows
        # once their prompts are prefilled (leaving False), rows about to leave the batch (True, before
        # `remove` moves other rows into their slots).
        self.retain: Callable[["Batch", list[int], list[Hashable], bool], None] | None = None

    @property
    def seq_len(self) -> torch.Tensor:
        """[n] committed length of each active row (= its KV cache length)."""
        return self.cache.lens[: self.n]

    @property
    def free(self) -> int:
        """Slots a new row can take (the top slot is taken while a prompt is prefilled in chunks)."""
        return self.cache.rows - self.n - (self.pending is not None)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Row src[i] moves into slot dst[i]: its cache, outputs and every proposer's state for it."""
        self.cache.move_rows(src, dst)
        for state in (self.sampling, *self.aux.values()):
            state.move_rows(src, dst)
        s, d = torch.tensor(src, device=self.root.device), torch.tensor(dst, device=self.root.device)
        for t in (self.root, self.hidden, self.out, self.out_len, self.max_new, self.seq):
            t[d] = t[s]

    def remove(self, ids: list[Hashable]) -> list[Finished]:
        """Drop rows (finished, cancelled) and close the gap by moving the last rows into their slots."""
        slots = sorted(self.ids.index(i) for i in ids)
        if self.retain is not None and slots:
            self.retain(self, slots, [self.ids[s] for s in slots], True)
        gone = set(slots)
        done = [Finished(self.ids[s], self.out[s, : int(self.out_len[s])].tolist(), "") for s in slots]
        keep_n = self.n - len(slots)
        holes = [s for s in slots if s < keep_n]
        movers = [s for s in range(keep_n, self.n) if s not in gone]
        if holes:
            self.move_rows(movers, holes)
            for s, d in zip(movers, holes):
                self.ids[d] = self.ids[s]
        del self.ids[keep_n:]
        self.n = keep_n
        for f in done:
            self.logprobs.pop(f.id, None)
        return done

    @contextmanager
    def undone_on_failure(self, ids: list[Hashable]):
        """A failed admission of rows `ids` leaves the batch as it was: new rows go after the first n0, and
        only they can finish inside the admission, so cutting the batch back to n0 rows undoes it."""
        n0 = self.n
        try:
            yield
        except BaseException:
            for i in ids:
                self.logprobs.pop(i, None)
            del self.ids[n0:]
            self.n = n0
            raise

    def check(self, prompts: list[list[int]], limits: list[int], logprobs: list[int | None]) -> None:
        """Refuse, by name, prompts and limits this batch cannot take."""
        for i, (p, m) in enumerate(zip(prompts, limits)):
            if not p:
                raise MedusaError(f"prompt {i} is empty")
            if m <= 0:
                raise MedusaError(f"max_new_tokens must be positive, got {m}")
            if m > self.out.shape[1] - 1:
                raise MedusaError(f"max_new_tokens {m} exceeds this batch's limit {self.out.shape[1] - 1}")
        for k in logprobs:
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise MedusaError(f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {k}")

    def logprobs_k(self) -> int | None:
        """The largest top-k asked for by an active row, or None when no row asked for log-probabilities."""
        if not self.logprobs:
            return None
        return max(self.logprobs.values())

    def emit(self, eos: torch.Tensor, rows: slice, new: torch.Tensor, count: torch.Tensor,
             logprobs: TokenLogprobs | None = None, accepted: torch.Tensor | None = None, width: int = 0) -> StepOutput:
        """Append new tokens [n, m] (the first count [n] of each row) to each row's output, cut at an EOS
        (`eos` [E]) or the row's max tokens, and retire the rows that finished.

        `accepted` [n] (candidates accepted per row; None after a prefill) goes into the acceptance histogram
        (`width` bins) and the output. The counts, the finish flags and `accepted` reach the host in one read,
        one wait for the device."""
        j = torch.arange(new.shape[1], device=new.device)
        is_eos = torch.isin(new, eos) & (j < count[:, None])
        hit = is_eos.any(1)
        count = torch.where(hit, is_eos.long().argmax(1) + 1, count)
        count = torch.minimum(count, self.max_new[rows] - self.out_len[rows])
        out = self.out[rows]
        idx = (self.out_len[rows, None] + j).clamp(max=out.shape[1] - 1)
        keep = j < count[:, None]
        out.scatter_(1, idx, torch.where(keep, new, out.gather(1, idx)))
        self.out_len[rows] += count
        length = self.out_len[rows] >= self.max_new[rows]
        read = [count, hit.long(), length.long()] + ([accepted] if accepted is not None else [])
        host = torch.stack(read).tolist()
        self.sampling.emitted(rows, host[0])
        self.stats.new_tokens += sum(host[0])
        if accepted is not None:
            self.stats.add_hist(host[3], width)
        ids = self.ids[rows]
        finished = []
        done = [r for r, (h, full) in enumerate(zip(host[1], host[2])) if h or full]
        if done:
            reason = {ids[r]: "stop" if host[1][r] else "length" for r in done}
            finished = self.remove([ids[r] for r in done])
            for f in finished:
                f.reason = reason[f.id]
        accepted_list = host[3] if accepted is not None else [0] * len(host[0])
        if accepted is None:
            accepted = torch.zeros_like(count)
        return StepOutput(ids, new, count, finished, logprobs, accepted, host[0], accepted_list)
