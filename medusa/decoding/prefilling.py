"""How rows enter a batch: `Engine.add` prefills whole prompts and decides each row's first token;
`Engine.begin`, then chunks carried by `Engine.step` (or run by `Engine.advance`), then `Engine.join` do the
same for a long prompt a chunk at a time, so the running rows are not stalled. `Prefilling` is the part of
`medusa.decoding.engine.Engine` that does it; the speculative step itself is in engine.py.
"""

from __future__ import annotations

from typing import Hashable

import torch
from torch.nn.utils.rnn import pad_sequence

from medusa.errors import MedusaError
from medusa.decoding.batch import Batch, Prefill
from medusa.decoding.outputs import StepOutput, token_logprobs
from medusa.decoding.sampling import GREEDY, SamplingParams
from medusa.decoding.target.transformer import PassInputs, Transformer, causal
from medusa.decoding.verifier import argmax, sample_from

# Rows prefilled together are right-padded to the longest; when that would add more than this share of padding
# tokens, they go as one unpadded sequence of parts instead (per-row attention, shared linear layers).
PACK_PADDING = 0.05


class Prefilling:
    """Prompt prefill for an engine of target `model` stopping at `eos` [E] long."""

    model: Transformer
    eos: torch.Tensor

    @torch.inference_mode()
    def add(self, batch: Batch, ids: list[Hashable], prompts: list[list[int]],
            max_new_tokens: int | list[int], sampling: list[SamplingParams] | None = None,
            logprobs: list[int | None] | None = None, start: list[int] | None = None) -> StepOutput:
        """Prefill new rows (one pass, right-padded or unpadded: `_prefill`) and decide each row's first token.

        `logprobs[i]`: None, or k (0..MAX_TOP_LOGPROBS) to get row i's log-probabilities in every
        StepOutput (the emitted token's and the k most likely).
        `start[i]` (default 0): the first start[i] < len(prompts[i]) positions of row i (slot batch.n + i)
        are in place already, as a prefill of them leaves them (the K/V, `batch.seq`, proposer state: a
        prefix cache's `restore`); only the rest is prefilled, one pass per run of rows with equal starts."""
        if not prompts:
            none = torch.zeros(0, dtype=torch.long)
            return StepOutput([], torch.zeros(0, 1, dtype=torch.long), none, [], accepted=none)
        if len(prompts) > batch.free:
            raise MedusaError(f"batch has room for {batch.free} more rows, {len(prompts)} requested")
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        batch.check(prompts, limits, logprobs or [])
        k = len(prompts)
        starts = [0] * k if start is None else list(start)
        if len(starts) != k or any(not 0 <= s < len(p) for s, p in zip(starts, prompts)):
            raise MedusaError(f"start positions {starts} must leave each prompt at least one token to prefill")
        dev = self.model.device
        last = []
        a = 0
        while a < k:  # one pass per run of rows with the same start
            b = a + 1
            while b < k and starts[b] == starts[a]:
                b += 1
            s = starts[a]
            part = [p[s:] for p in prompts[a:b]]
            tokens = torch.zeros(b - a, max(len(p) for p in part), dtype=torch.long, device=dev)
            for i, p in enumerate(part):
                tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
            plen = torch.tensor([len(p) for p in part], device=dev)
            hidden = self._prefill(batch, slice(batch.n + a, batch.n + b), tokens, plen, s)
            last.append(hidden[torch.arange(b - a, device=dev), plen - 1])
            a = b
        if batch.retain is not None:
            batch.retain(batch, list(range(batch.n, batch.n + k)), list(ids), False)
        return self._join(batch, ids, torch.cat(last) if len(last) > 1 else last[0], limits,
                          sampling or [GREEDY] * k, logprobs or [None] * k)

    def begin(self, batch: Batch, id: Hashable, prompt: list[int], max_new_tokens: int,
              sampling: SamplingParams = GREEDY, logprobs: int | None = None, start: int = 0) -> Prefill:
        """Start prefilling one prompt in chunks (`advance`), in the batch's top slot (`batch.cache.rows - 1`):
        the batch's steps go on meanwhile. One such prompt per batch at a time. `start`: positions of the
        prompt already in place in that slot (as `add` takes them); chunks begin after them."""
        if batch.pending is not None:
            raise MedusaError(f"batch is already prefilling request {batch.pending.id!r} in chunks")
        if batch.free < 1:
            raise MedusaError("batch has no free row")
        batch.check([prompt], [max_new_tokens], [logprobs])
        if not 0 <= start < len(prompt):
            raise MedusaError(f"start position {start} must leave the prompt at least one token to prefill")
        slot = batch.cache.rows - 1
        batch.cache.lens[slot] = start
        batch.pending = Prefill(id, list(prompt), max_new_tokens, sampling, logprobs, slot, done=start)
        return batch.pending

    @torch.inference_mode()
    def advance(self, batch: Batch, tokens: int) -> int:
        """Prefill the next at most `tokens` prompt tokens of the batch's pending prompt in a pass of its own
        (`step(..., prefill=N)` shares the running rows' pass instead); returns the prompt tokens still to
        go. Once none are, `join` brings the row in."""
        chunk = self._chunk(batch, tokens)
        hidden = self.model(chunk.tokens, chunk.positions, batch.cache, chunk.rows, chunk.mask)
        batch.stats.forward_passes += 1
        self._chunk_done(batch, chunk, hidden)
        return batch.pending.left

    def join(self, batch: Batch) -> StepOutput:
        """The pending prompt, now all in the cache, joins the active rows in slot n and gets its first
        token (`add`'s output)."""
        pf = batch.pending
        if pf is None or pf.left:
            raise MedusaError("no prompt is fully prefilled and waiting to join")
        if batch.retain is not None:
            batch.retain(batch, [pf.slot], [pf.id], False)
        if pf.slot != batch.n:
            batch.move_rows([pf.slot], [batch.n])
        batch.pending = None
        return self._join(batch, [pf.id], pf.last, [pf.max_new], [pf.sampling], [pf.logprobs])

    def abandon(self, batch: Batch) -> Prefill | None:
        """Give up the prompt being prefilled in chunks (its request was cancelled): its slot is free again."""
        pf, batch.pending = batch.pending, None
        return pf

    def _chunk(self, batch: Batch, tokens: int) -> PassInputs:
        """The pending prompt's next chunk of at most `tokens` tokens, as a pass part of its own row."""
        pf = batch.pending
        if pf is None:
            raise MedusaError("no prompt is being prefilled in chunks")
        if tokens <= 0:
            raise MedusaError(f"a prefill chunk needs at least one token, got {tokens}")
        if not pf.left:
            raise MedusaError(f"the prompt of request {pf.id!r} is all prefilled: join it")
        dev = self.model.device
        c = min(tokens, pf.left)
        chunk = torch.tensor([pf.prompt[pf.done: pf.done + c]], dtype=torch.long, device=dev)
        return PassInputs(chunk, torch.arange(pf.done, pf.done + c, device=dev)[None], slice(pf.slot, pf.slot + 1),
                          causal(c, dev))

    def _chunk_done(self, batch: Batch, chunk: PassInputs, hidden: torch.Tensor) -> None:
        """The chunk went through the target (hidden [1, c, H]): the pending prompt moves on."""
        pf, c = batch.pending, chunk.tokens.shape[1]
        self._prefilled(batch, chunk.rows, chunk.tokens, torch.tensor([c], device=hidden.device), hidden, pf.done)
        pf.done += c
        pf.last = hidden[:, c - 1]

    def _prefill(self, batch: Batch, rows: slice, tokens: torch.Tensor, lengths: torch.Tensor,
                 start: int) -> torch.Tensor:
        """One causal pass of prompt tokens [k, T] (right-padded; `lengths` [k]) at positions start.. of
        `rows`, after the `start` tokens their cache holds; returns hidden [k, T, H]."""
        k, t = tokens.shape
        batch.cache.lens[rows] = start
        sizes = lengths.tolist()
        if k > 1 and k * t > (1 + PACK_PADDING) * sum(sizes) and self.model.fuses_parts:
            hidden = self._packed(batch, rows, tokens, sizes, start)
        else:
            positions = (start + torch.arange(t, device=tokens.device)).expand(k, t)
            hidden = self.model(tokens, positions, batch.cache, rows, causal(t, tokens.device))
        batch.stats.forward_passes += 1
        self._prefilled(batch, rows, tokens, lengths, hidden, start)
        return hidden

    def _packed(self, batch: Batch, rows: slice, tokens: torch.Tensor, sizes: list[int], start: int) -> torch.Tensor:
        """`_prefill`'s pass with the padding left out: each row a part of its own length, so the linear
        layers run over the prompts' tokens only (`Transformer.forward_parts`); -> hidden [k, T, H], zero
        past each row's length."""
        dev = tokens.device
        parts = [PassInputs(tokens[i:i + 1, :n], start + torch.arange(n, device=dev)[None],
                            slice(rows.start + i, rows.start + i + 1), causal(n, dev)) for i, n in enumerate(sizes)]
        return pad_sequence([h[0] for h in self.model.forward_parts(batch.cache, parts)], batch_first=True)

    @staticmethod
    def _prefilled(batch: Batch, rows: slice, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor,
                   start: int) -> None:
        """Prompt tokens [k, T] at positions start.. of `rows` went through the target: the rows' lengths,
        their record of tokens and every proposer's state follow."""
        for state in list(batch.aux.values()):
            state.prefilled(rows, tokens, lengths, hidden, start)
        batch.cache.lens[rows] = start + lengths
        batch.seq[rows, start: start + tokens.shape[1]] = tokens

    def _join(self, batch: Batch, ids: list[Hashable], last: torch.Tensor, limits: list[int],
              sampling: list[SamplingParams], logprobs: list[int | None]) -> StepOutput:
        """Prefilled rows in slots [n, n + k) (`last` [k, H]: their prompts' last hidden states) become
        active: each row's first token is decided and emitted."""
        dev = self.model.device
        k = len(ids)
        rows = slice(batch.n, batch.n + k)
        batch.n += k
        batch.ids.extend(ids)
        batch.hidden[rows] = last
        batch.sampling.set(rows, sampling)
        for i, top in zip(ids, logprobs):
            if top is not None:
                batch.logprobs[i] = top
        logits = self.model.lm_head(last)
        if batch.sampling.any_sampling(rows):
            p = batch.sampling.probs(logits[:, None], rows)[:, 0]
            first = torch.zeros(k, dtype=torch.long, device=dev)  # output position 0
            batch.root[rows] = sample_from(p, batch.sampling.uniform_at(rows, first))
        else:
            batch.root[rows] = argmax(logits)
        batch.out_len[rows] = 0
        batch.max_new[rows] = torch.tensor(limits, device=dev)
        # A copy: rows that finish here are removed in `emit`, which compacts batch.root in place; a view
        # would then show a finished row the first token of the row moved into its slot.
        new = batch.root[rows, None].clone()
        lp = None
        if batch.logprobs and any(i in batch.logprobs for i in ids):
            lp = token_logprobs(logits[:, None], new, batch.logprobs_k())
        return batch.emit(self.eos, rows, new, torch.ones(k, dtype=torch.long, device=dev), lp)  # accepted: 0
