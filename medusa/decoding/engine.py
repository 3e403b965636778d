"""The decoding loop shared by the CLI, the evaluator and the server.

A `Batch` (`medusa.decoding.batch`) holds up to `rows` sequences in one KV cache. Rows enter it by prefill
(`medusa.decoding.prefilling`: `Engine.add`, or `begin`, chunks, `join` for a long prompt, so the running
rows are not stalled). Each `Engine.step` is one speculative step over every active row, in four phases:

    draft        each row's candidate tree from the proposer (`RowTrees`; plain decoding: the root alone)
    verify_pass  one target pass over each row's pending root and candidates (`VerifyPass`)
    accept       each row's longest accepted path and the target's own next token (`Verdict`)
    commit       keep that path: cache entries, tokens, the next root, every proposer's per-row state

then the step is counted and the new tokens are emitted, retiring rows that are done
(`Batch.emit`). Rows have their own lengths and accept different numbers of tokens;
nothing in the step loops over rows in Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from medusa.errors import MedusaError
from medusa.decoding.batch import Batch
from medusa.decoding.outputs import Finished, Generation, Stats, StepOutput, TokenLogprobs, token_logprobs
from medusa.decoding.prefilling import Prefilling
from medusa.decoding.proposers import Proposer
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.target.transformer import PassInputs, Transformer, cache_capacity
from medusa.decoding.trees.tree import ROOT_ONLY
from medusa.decoding.verifier import RowTrees, Verdict, Verifier


class StepPolicy:
    """Chooses each step's proposer (None: plain) and hears back how the step went (auto mode, the server's
    policy). `max_tree_size`: the largest `Proposer.span` it may choose (caches are sized by it)."""

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


@dataclass
class VerifyPass:
    """One target pass over every active row's tree.

    rows:   slice, the active rows [0, n)
    tokens: [n, T] long, each row's pending root, then its candidates in node order
    hidden: [n, T, H], the target's last hidden state at each node
    logits: [n, T, V], the target's logits at each node
    """

    rows: slice
    tokens: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor


class Engine(Prefilling):
    def __init__(self, model: Transformer, eos_token_ids: list[int] | int | None):
        self.model = model
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or [])
        self.eos = torch.tensor(eos, dtype=torch.long, device=model.device)
        self.verifier = Verifier()
        self.clock = time.perf_counter  # what a policy's step times are read from (seconds)

    def new_batch(self, rows: int, capacity: int, max_new_tokens: int) -> Batch:
        return Batch(self.model, rows, capacity, max_new_tokens)

    @torch.inference_mode()
    def step(self, batch: Batch, proposer: Proposer | None = None, prefill: int = 0) -> StepOutput:
        """One speculative step over all active rows: `draft`, `verify_pass`, `accept`, `commit`, then the
        new tokens are emitted. `proposer` None: plain decoding.

        `prefill`: the pass also carries the next at most this many tokens of the prompt being prefilled in
        chunks (one read of the weights for both); once that prompt is all in, `join` brings it in."""
        # Read before any of this step's work is queued: on a GPU the host then waits for nothing.
        sampled = batch.sampling.any_sampling(slice(0, batch.n))
        trees = self.draft(batch, proposer)
        ran = self.verify_pass(batch, trees, prefill)
        verdict = self.accept(batch, trees, ran, sampled)
        new = self.commit(batch, ran, verdict)
        counted(batch.stats, ran)
        lp = self._logprobs(batch, ran, verdict, new) if batch.logprobs else None
        width = (proposer.max_depth if proposer is not None else 0) + 1  # acceptance histogram bins
        return batch.emit(self.eos, ran.rows, new, verdict.accepted + 1, lp, verdict.accepted, width)

    def draft(self, batch: Batch, proposer: Proposer | None) -> RowTrees:
        """Each active row's candidate tree: the proposer's draft, or the root alone (plain decoding)."""
        if proposer is None:
            roots = batch.root[: batch.n, None]
            return RowTrees.shared(roots[:, :0], ROOT_ONLY.buffers(roots.device))
        return proposer.draft(batch)

    def verify_pass(self, batch: Batch, trees: RowTrees, prefill: int = 0) -> VerifyPass:
        """One target pass over every active row's pending root and candidates, each node at its row's
        length plus its depth, seeing its ancestors (`trees.mask`). With `prefill`, the pass also carries
        the next chunk of the prompt being prefilled (`step`)."""
        rows = slice(0, batch.n)
        roots = batch.root[rows, None]
        tokens = torch.cat([roots, trees.tokens.to(roots.device)], dim=1) if trees.tokens.shape[1] else roots
        part = PassInputs(tokens, batch.cache.lens[rows, None] + trees.node_depth, rows, trees.mask)
        carry = prefill and batch.pending is not None and batch.pending.left
        if carry and self.model.fuses_parts:
            chunk = self._chunk(batch, prefill)
            hidden, chunk_hidden = self.model.forward_parts(batch.cache, [part, chunk])
            self._chunk_done(batch, chunk, chunk_hidden)
        else:
            if carry:  # taps on the target's layers keep one pass's outputs: the chunk goes first, alone
                self.advance(batch, prefill)
            hidden = self.model(part.tokens, part.positions, batch.cache, rows, part.mask)
        return VerifyPass(rows, tokens, hidden, self.model.lm_head(hidden))

    def accept(self, batch: Batch, trees: RowTrees, ran: VerifyPass, sampled: bool) -> Verdict:
        """Each row's longest accepted path and the target's token after it: greedy rows keep what matches
        the target's argmax; with `sampled` rows present, every row follows its own acceptance rule
        (`Verifier`; greedy rows reduce to the greedy rule)."""
        return self.verifier.verify(ran.logits, trees.candidates(ran.tokens), batch.sampling if sampled else None,
                                    ran.rows)

    @staticmethod
    def commit(batch: Batch, ran: VerifyPass, verdict: Verdict) -> torch.Tensor:
        """Keep each row's accepted path (cache entries, committed tokens, the last node's hidden state), set
        its next root, and tell every proposer's per-row state; returns the new output tokens [n, D+1]
        (the first accepted + 1 valid)."""
        rows, tokens, hidden = ran.rows, ran.tokens, ran.hidden
        for state in list(batch.aux.values()):
            state.committed(batch.cache.lens[rows], hidden, tokens, verdict)
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
        return new

    @staticmethod
    def _logprobs(batch: Batch, ran: VerifyPass, verdict: Verdict, new: torch.Tensor) -> TokenLogprobs:
        """The log-probabilities of new tokens [n, m]: from the logits that decided each one, those of the
        nodes on its row's path."""
        at = verdict.path[:, : new.shape[1]]
        logits = ran.logits.gather(1, at[..., None].expand(-1, -1, ran.logits.shape[-1]))
        return token_logprobs(logits, new, batch.logprobs_k())

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
        extra = policy.max_tree_size if policy is not None else proposer.span if proposer is not None else 1
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


def counted(stats: Stats, ran: VerifyPass) -> None:
    """A verification pass ran: one forward pass, one step, its rows' row-steps and verified tokens."""
    stats.forward_passes += 1
    stats.steps += 1
    stats.row_steps += ran.tokens.shape[0]
    stats.verified_tokens += ran.tokens.numel()
