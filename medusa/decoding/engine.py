"""The decoding loop shared by the CLI, the evaluator and the server.

A `Batch` (`medusa.decoding.batch`) holds up to `rows` sequences in one KV cache. `Engine.add` prefills new
rows and decides their first token; `Engine.begin`, then chunks carried by `Engine.step` (or `Engine.advance`),
then `Engine.join` do the same for a long prompt a chunk at a time, so the running rows are not stalled. Each `Engine.step` runs one target pass
over every active row: the pending root token plus the proposer's candidate tree (just the root for plain
decoding), verifies, commits the accepted entries of each row, and retires rows that are done. Rows have
their own lengths and accept different numbers of tokens; nothing in the step loops over rows in Python.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable

import torch

from medusa.errors import MedusaError
from medusa.decoding.batch import Batch, Prefill
from medusa.decoding.proposers import Proposer
from medusa.decoding.sampling import GREEDY, SamplingParams, argmax, sample_from
from medusa.decoding.transformer import Transformer, cache_capacity, causal
from medusa.decoding.tree import ROOT_ONLY
from medusa.decoding.outputs import Finished, Generation, StepOutput, TokenLogprobs, token_logprobs
from medusa.decoding.verifier import Candidates, GreedyVerifier, SamplingVerifier, Verdict


class StepPolicy:
    """Chooses each step's proposer (None: plain) and hears back how the step went (auto mode, the server's
    policy). `max_tree_size`: the largest tree it may choose (caches are sized by it)."""

    max_tree_size: int

    def attach(self, batch: "Batch") -> None:
        """Per-row state of the proposers it may choose, set up before the batch's rows are prefilled."""

    def choose(self, rows: int) -> Proposer | None:
        raise NotImplementedError

    def observe(self, rows: int, speculative: bool, tau: float, seconds: float, overhead: float = 0.0) -> None:
        """How a step with `rows` rows went: speculative or plain, its tokens per row (`StepOutput.tau`),
        its duration, and `overhead`: the time `choose` took for it (planning, building a proposer), a cost
        of the step too."""

    def recover(self, proposer: Proposer, exc: Exception) -> bool:
        """The chosen proposer raised before its step committed anything: True redoes the step without it
        (lossless; the step then counts as plain), False lets the error through (default)."""
        return False


class Engine:
    def __init__(self, model: Transformer, eos_token_ids: list[int] | int | None, verifier=None):
        self.model = model
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or [])
        self.eos = torch.tensor(eos, dtype=torch.long, device=model.device)
        self.verifier = verifier or GreedyVerifier()
        self.sampler = SamplingVerifier()
        self.clock = time.perf_counter  # what a policy's step times are read from (seconds)

    def new_batch(self, rows: int, capacity: int, max_new_tokens: int) -> Batch:
        return Batch(self.model, rows, capacity, max_new_tokens)

    @torch.inference_mode()
    def add(self, batch: Batch, ids: list[Hashable], prompts: list[list[int]],
            max_new_tokens: int | list[int], sampling: list[SamplingParams] | None = None,
            logprobs: list[int | None] | None = None, start: list[int] | None = None) -> StepOutput:
        """Prefill new rows (right-padded into one pass) and decide each row's first token.

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
        part = self._chunk(batch, tokens)
        hidden = self.model(*part[:2], batch.cache, *part[2:])
        batch.stats.forward_passes += 1
        self._chunk_done(batch, part, hidden)
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

    def _chunk(self, batch: Batch, tokens: int) -> tuple[torch.Tensor, torch.Tensor, slice, torch.Tensor]:
        """The pass part (tokens, positions, rows, block mask) of the pending prompt's next chunk."""
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
        return chunk, torch.arange(pf.done, pf.done + c, device=dev)[None], slice(pf.slot, pf.slot + 1), causal(c, dev)

    def _chunk_done(self, batch: Batch, part: tuple, hidden: torch.Tensor) -> None:
        pf, c = batch.pending, part[0].shape[1]
        self._prefilled(batch, part[2], part[0], torch.tensor([c], device=hidden.device), hidden, pf.done)
        pf.done += c
        pf.last = hidden[:, c - 1]

    def _prefill(self, batch: Batch, rows: slice, tokens: torch.Tensor, lengths: torch.Tensor,
                 start: int) -> torch.Tensor:
        """One causal pass of prompt tokens [k, T] (right-padded; `lengths` [k]) at positions start.. of
        `rows`, after the `start` tokens their cache holds; returns hidden [k, T, H]."""
        k, t = tokens.shape
        batch.cache.lens[rows] = start
        positions = (start + torch.arange(t, device=tokens.device)).expand(k, t)
        hidden = self.model(tokens, positions, batch.cache, rows, causal(t, tokens.device))
        batch.stats.forward_passes += 1
        self._prefilled(batch, rows, tokens, lengths, hidden, start)
        return hidden

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
        # A copy: rows that finish here are removed in _emit, which compacts batch.root in place; a view
        # would then show a finished row the first token of the row moved into its slot.
        new = batch.root[rows, None].clone()
        lp = None
        if batch.logprobs and any(i in batch.logprobs for i in ids):
            lp = token_logprobs(logits[:, None], new, batch.logprobs_k())
        return self._emit(batch, rows, new, torch.ones(k, dtype=torch.long, device=dev), lp)  # accepted: 0

    @torch.inference_mode()
    def step(self, batch: Batch, proposer: Proposer | None = None, prefill: int = 0) -> StepOutput:
        """One verification pass over all active rows: the pending roots, the proposer's candidates (one
        tree for every row, or a tree per row from a proposer with `owns_step`), verification, commit.

        `prefill`: the pass also carries the next at most this many tokens of the prompt being prefilled in
        chunks (one read of the weights for both); once that prompt is all in, `join` brings it in."""
        n = batch.n
        rows = slice(0, n)
        # Read before any of this step's work is queued: on a GPU the host then waits for nothing.
        sampled = batch.sampling.any_sampling(rows)
        tokens = batch.root[rows, None]
        per_row = proposer is not None and proposer.owns_step
        if per_row:  # medusa.decoding.dynamic_tree: a tree per row, grown from the proposer's confidence
            trees = proposer.draft(batch)
            tokens = torch.cat([tokens, trees.tokens.to(tokens.device)], dim=1)
            cand, depth, mask = trees.candidates(tokens), trees.depth, trees.mask
        else:
            tree = proposer.tree if proposer is not None else ROOT_ONLY
            buf = tree.buffers(self.model.device)
            probs = None
            if tree.size > 1:
                proposal = proposer.propose(batch)
                tokens, probs = torch.cat([tokens, proposal.tokens], dim=1), proposal.probs
            cand, depth, mask = Candidates.shared(tokens, buf, probs), buf.depth, buf.mask
        positions = batch.cache.lens[rows, None] + depth
        if prefill and batch.pending is not None and batch.pending.left:
            chunk = self._chunk(batch, prefill)
            hidden, chunk_hidden = self.model.forward_parts(batch.cache, [(tokens, positions, rows, mask), chunk])
            self._chunk_done(batch, chunk, chunk_hidden)
        else:
            hidden = self.model(tokens, positions, batch.cache, rows, mask)
        logits = self.model.lm_head(hidden)
        if sampled:
            verdict = self.sampler.verify(batch.sampling.probs(logits, rows), cand, batch.sampling, rows)
        else:
            verdict = self.verifier.verify(logits, cand)
        for state in list(batch.aux.values()):
            state.committed(batch.cache.lens[rows], hidden, tokens, verdict)
        new = self._commit(batch, rows, tokens, hidden, verdict)
        lp = None
        if batch.logprobs:  # the logits that decided each emitted token: those of the nodes on its path
            at = verdict.path[:, : new.shape[1]]
            lp = token_logprobs(logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])), new,
                                batch.logprobs_k())
        width = (proposer.tree.depth if proposer is not None else 0) + 1
        return self._emit(batch, rows, new, verdict.accepted + 1, lp, verdict.accepted, width)

    @staticmethod
    def _commit(batch: Batch, rows: slice, tokens: torch.Tensor, hidden: torch.Tensor,
                verdict: Verdict) -> torch.Tensor:
        """Keep each row's accepted path (cache entries, committed tokens, the last node's hidden state),
        set its next root; returns the new output tokens [n, D+1] (the first accepted + 1 valid)."""
        accepted = verdict.accepted
        committed = tokens.gather(1, verdict.path)  # root + accepted candidates (+ junk past accepted+1)
        lens = batch.cache.lens[rows, None]
        idx = lens + torch.arange(committed.shape[1], device=lens.device)  # < capacity: the pass fitted
        seq = batch.seq[rows]
        valid = idx - lens <= accepted[:, None]
        seq.scatter_(1, idx, torch.where(valid, committed, seq.gather(1, idx)))
        batch.cache.commit(rows, verdict.path, accepted + 1)
        last = verdict.path.gather(1, accepted[:, None])[:, 0]
        batch.hidden[rows] = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        batch.root[rows] = verdict.next_token
        # New output tokens: the accepted candidates followed by the target's own next token.
        new = torch.cat([committed[:, 1:], verdict.next_token[:, None]], dim=1)
        new.scatter_(1, accepted[:, None], verdict.next_token[:, None])
        batch.stats.forward_passes += 1
        batch.stats.steps += 1
        batch.stats.row_steps += hidden.shape[0]
        batch.stats.verified_tokens += tokens.numel()
        return new

    def _emit(self, batch: Batch, rows: slice, new: torch.Tensor, count: torch.Tensor,
              logprobs: TokenLogprobs | None = None, accepted: torch.Tensor | None = None,
              width: int = 0) -> StepOutput:
        """Append new tokens to each row's output, cut at EOS / max tokens, retire finished rows.

        `accepted` (candidates accepted per row; None after a prefill) goes into the acceptance histogram
        (`width` bins) and the output. The counts, the finish flags and `accepted` reach the host in one
        read, one wait for the device."""
        j = torch.arange(new.shape[1], device=new.device)
        is_eos = torch.isin(new, self.eos) & (j < count[:, None])
        hit = is_eos.any(1)
        count = torch.where(hit, is_eos.long().argmax(1) + 1, count)
        count = torch.minimum(count, batch.max_new[rows] - batch.out_len[rows])
        out = batch.out[rows]
        idx = (batch.out_len[rows, None] + j).clamp(max=out.shape[1] - 1)
        keep = j < count[:, None]
        out.scatter_(1, idx, torch.where(keep, new, out.gather(1, idx)))
        batch.out_len[rows] += count
        length = batch.out_len[rows] >= batch.max_new[rows]
        read = [count, hit.long(), length.long()] + ([accepted] if accepted is not None else [])
        host = torch.stack(read).tolist()
        batch.sampling.emitted(rows, host[0])
        batch.stats.new_tokens += sum(host[0])
        if accepted is not None:
            batch.stats.add_hist(host[3], width)
        ids = batch.ids[rows]
        finished = []
        done = [r for r, (h, full) in enumerate(zip(host[1], host[2])) if h or full]
        if done:
            reason = {ids[r]: "stop" if host[1][r] else "length" for r in done}
            finished = batch.remove([ids[r] for r in done])
            for f in finished:
                f.reason = reason[f.id]
        accepted_list = host[3] if accepted is not None else [0] * len(host[0])
        if accepted is None:
            accepted = torch.zeros_like(count)
        return StepOutput(ids, new, count, finished, logprobs, accepted, host[0], accepted_list)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, proposer: Proposer | None = None,
                 sampling: SamplingParams | list[SamplingParams] | None = None,
                 policy: "StepPolicy | None" = None,
                 on_finish: Callable[[Finished], None] | None = None, seed: int | None = None,
                 on_step: Callable[[StepOutput], None] | None = None) -> Generation:
        """Decode a fixed set of prompts to completion (the CLI's and the evaluator's entry point).

        With a `policy` (auto mode) the proposer is chosen per step for the current number of rows, and
        every step's tokens per row and duration are fed back to it. `on_finish` hears of each row as it
        finishes (id: its prompt's index), e.g. to time requests; `on_step` of every verification step (its
        rows' ids and accepted counts, e.g. to count acceptance per request). `seed` seeds the generator that
        sampled rows without a seed of their own share."""
        if max_new_tokens <= 0:
            raise MedusaError(f"--max-new-tokens must be positive, got {max_new_tokens}")
        if not prompts:
            raise MedusaError("no prompts given")
        extra = policy.max_tree_size if policy is not None else proposer.tree.size if proposer is not None else 1
        capacity = cache_capacity(max(len(p) for p in prompts), max_new_tokens, extra)
        batch = self.new_batch(len(prompts), capacity, max_new_tokens)
        if seed is not None:
            batch.sampling.shared.manual_seed(seed)
        start = time.perf_counter()
        results: dict[Any, Finished] = {}
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        for source in (proposer, policy):
            if source is not None:
                source.attach(batch)  # before the prefill, so per-row proposer state sees the prompts
        out = self.add(batch, list(range(len(prompts))), prompts, max_new_tokens, sampling)
        while True:
            for f in out.finished:
                results[f.id] = f
                if on_finish is not None:
                    on_finish(f)
            if not batch.n:
                break
            out = self.policy_step(batch, proposer, policy)
            if on_step is not None:
                on_step(out)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        mode = "auto" if policy is not None else proposer.name if proposer is not None else "plain"
        return Generation([results[i] for i in range(len(prompts))], batch.stats, seconds, mode)

    def policy_step(self, batch: Batch, proposer: Proposer | None = None, policy: "StepPolicy | None" = None,
                    prefill: int = 0) -> StepOutput:
        """One step with `proposer`, or, given a `policy`, with the proposer it chooses for this many rows,
        timed and reported back to it (`prefill`: see `step`)."""
        if policy is None:
            return self.step(batch, proposer, prefill)
        rows, steps = batch.n, batch.stats.steps
        chose = self.clock()
        chosen = policy.choose(rows)
        start = self.clock()
        try:
            out = self.step(batch, chosen, prefill)  # its host counts were read once the device finished
        except Exception as exc:
            if chosen is None or batch.stats.steps != steps or not policy.recover(chosen, exc):
                raise
            chosen = None
            out = self.step(batch, None, prefill)
        policy.observe(rows, chosen is not None, out.tau, self.clock() - start, start - chose)
        return out
