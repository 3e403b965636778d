"""The decoding driver the evaluator and `medusa bench` time: prompts decoded by `Engine.generate` in
consecutive batches, with the time until each request finished and the acceptance counts of every batch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from medusa.decoding.engine import Engine, StepPolicy
from medusa.decoding.outputs import Stats
from medusa.decoding.proposers import Proposer
from medusa.decoding.sampling import SamplingParams
from medusa.eval.kinds import generate_tracked


@dataclass
class RunResult:
    outputs: list[list[int]]
    seconds: float
    request_seconds: list[float]     # time until each request finished
    new_tokens: int
    accept_hist: list[int] = field(default_factory=list)
    row_steps: int = 0
    forward_passes: int = 0
    steps: int = 0                   # verification steps, summed over the batches
    verified_tokens: int = 0         # tokens verified per row-step, summed (Stats.verified_tokens)
    batches: int = 0
    prompt_tokens: int = 0
    request_steps: list[int] = field(default_factory=list)  # per request: verification steps it took part in
    request_made: list[int] = field(default_factory=list)   # per request: tokens those steps produced
    realised: float | None = None    # auto mode: share of its plans' expected gain its steps delivered

    @property
    def stats(self) -> Stats:
        return Stats(forward_passes=self.forward_passes, steps=self.steps, row_steps=self.row_steps,
                     verified_tokens=self.verified_tokens, new_tokens=self.new_tokens,
                     accept_hist=list(self.accept_hist))


def prompts_for_batch(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """The prompt list cycled up to a whole number of batches, so every batch runs full."""
    count = -(-len(prompts) // batch) * batch
    return [prompts[i % len(prompts)] for i in range(count)]


def chunks(prompts: list[list[int]], batch: int) -> Iterator[tuple[int, list[list[int]]]]:
    """(index of the first prompt, prompts) of each consecutive batch."""
    for start in range(0, len(prompts), batch):
        yield start, prompts[start: start + batch]


def sync(device: torch.device) -> None:
    """Wait for queued device work, so a timer read next covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_engine(engine: Engine, prompts: list[list[int]], batch: int, max_new: int, proposer: Proposer | None = None,
               sampling: Callable[[int], SamplingParams | None] | None = None,
               policy: StepPolicy | None = None) -> RunResult:
    """Decode `prompts` in consecutive batches of `batch` rows, timing each request.
    `sampling(i)` gives request i's SamplingParams (None: greedy); a `policy` (auto mode) picks every
    step's proposer and hears how the step went."""
    outputs: list[list[int]] = []
    finish: list[float] = []
    run = RunResult([], 0.0, [], 0)
    for start, chunk in chunks(prompts, batch):
        params = [sampling(i) for i in range(start, start + len(chunk))] if sampling is not None else None
        seconds = [0.0] * len(chunk)
        t0 = time.perf_counter()

        def finished(f, seconds=seconds, t0=t0) -> None:
            seconds[f.id] = time.perf_counter() - t0  # since its own batch started

        gen, steps, made = generate_tracked(engine, chunk, max_new, proposer, params, policy, finished)
        run.request_steps += steps
        run.request_made += made
        run.seconds += gen.seconds
        run.batches += 1
        run.prompt_tokens += sum(len(p) for p in chunk)
        outputs += [f.tokens for f in gen.outputs]
        finish += seconds
        _merge(run, gen.stats)
    run.outputs, run.request_seconds = outputs, finish
    run.new_tokens = sum(len(o) for o in run.outputs)
    return run


def _merge(run: RunResult, stats: Stats) -> None:
    hist = run.accept_hist
    hist += [0] * (len(stats.accept_hist) - len(hist))
    for a, c in enumerate(stats.accept_hist):
        hist[a] += c
    run.row_steps += stats.row_steps
    run.steps += stats.steps
    run.verified_tokens += stats.verified_tokens
    run.forward_passes += stats.forward_passes
