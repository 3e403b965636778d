"""The decoding driver the evaluator and `medusa bench` time: prompts fed to the engine's step API in
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
from medusa.decoding.transformer import cache_capacity


@dataclass
class RunResult:
    outputs: list[list[int]]
    seconds: float
    request_seconds: list[float]     # time until each request finished
    new_tokens: int
    accept_hist: list[int] = field(default_factory=list)
    row_steps: int = 0
    forward_passes: int = 0

    @property
    def stats(self) -> Stats:
        return Stats(forward_passes=self.forward_passes, row_steps=self.row_steps, new_tokens=self.new_tokens,
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
    """Decode `prompts` in consecutive batches of `batch` rows with the step API, timing each request.
    `sampling(i)` gives request i's SamplingParams (None: greedy); a `policy` (auto mode) picks every
    step's proposer and hears how the step went."""
    outputs: dict[int, list[int]] = {}
    finish: dict[int, float] = {}
    run = RunResult([], 0.0, [], 0)
    extra = policy.max_tree_size if policy is not None else proposer.tree.size if proposer is not None else 1
    for start, chunk in chunks(prompts, batch):
        b = engine.new_batch(len(chunk), cache_capacity(max(len(p) for p in chunk), max_new, extra), max_new)
        t0 = time.perf_counter()
        for source in (proposer, policy):
            if hasattr(source, "attach"):
                source.attach(b)  # before the prefill, so per-row proposer state sees the prompts
        ids = list(range(start, start + len(chunk)))
        params = [sampling(i) for i in ids] if sampling is not None else None
        done = list(engine.add(b, ids, chunk, max_new, params).finished)
        for f in done:
            finish[f.id] = time.perf_counter() - t0
        while b.n:
            for f in engine.policy_step(b, proposer, policy).finished:
                done.append(f)
                finish[f.id] = time.perf_counter() - t0  # since its own batch started
        sync(engine.model.device)
        run.seconds += time.perf_counter() - t0
        outputs.update((f.id, f.tokens) for f in done)
        _merge(run, b.stats)
    order = range(len(prompts))
    run.outputs, run.request_seconds = [outputs[i] for i in order], [finish[i] for i in order]
    run.new_tokens = sum(len(o) for o in run.outputs)
    return run


def _merge(run: RunResult, stats: Stats) -> None:
    hist = run.accept_hist
    hist += [0] * (len(stats.accept_hist) - len(hist))
    for a, c in enumerate(stats.accept_hist):
        hist[a] += c
    run.row_steps += stats.row_steps
    run.forward_passes += stats.forward_passes
