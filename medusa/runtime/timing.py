"""Timing the target's forward pass and the heads' proposal, and the latency model fitted to the timings.

    latency(B, T) = a + b * B + c * B * T        (ms; weights read once, per-row overhead, per-token compute)

Calibration (`medusa.runtime.calibrate`) stores these timings per machine; the evaluator's cost model and the
server's policy read them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from medusa.decoding.proposers.feature_proposer import DraftBlock, HeadRunner
from medusa.decoding.target.transformer import causal
from medusa.errors import MedusaError

@dataclass
class LatencyFit:
    """latency(B, T) = a + b*B + c*B*T in ms, fitted to a measured grid."""

    a: float
    b: float
    c: float
    max_rel_error: float = 0.0

    def __call__(self, batch: int, tokens: int) -> float:
        return max(self.a + self.b * batch + self.c * batch * tokens, 1e-6)

    @classmethod
    def fit(cls, grid: list[tuple[int, int, float]]) -> "LatencyFit":
        """Least squares in relative error (small decode passes and large passes count alike), with every
        coefficient kept >= 0: a term that noise drives negative is dropped and the rest refitted."""
        if len(grid) < 3:
            raise MedusaError(f"need at least 3 latency measurements to fit, got {len(grid)}")
        x = torch.tensor([[1.0, b, b * t] for b, t, _ in grid], dtype=torch.float64)
        y = torch.tensor([ms for _, _, ms in grid], dtype=torch.float64)
        w = 1 / y
        active = [0, 1, 2]
        coef = torch.zeros(3, dtype=torch.float64)
        while active:
            sol = torch.linalg.lstsq(x[:, active] * w[:, None], (y * w)[:, None]).solution[:, 0]
            coef.zero_()
            coef[active] = sol
            if (sol >= 0).all():
                break
            active.pop(int(sol.argmin()))
        fit = cls(*(float(v) for v in coef))
        fit.max_rel_error = max(abs(fit(b, t) - ms) / ms for b, t, ms in grid)
        return fit

    def to_dict(self) -> dict:
        return {"a_ms": self.a, "b_ms_per_row": self.b, "c_ms_per_token": self.c,
                "max_rel_error": self.max_rel_error}

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyFit":
        return cls(d["a_ms"], d["b_ms_per_row"], d["c_ms_per_token"], d.get("max_rel_error", 0.0))


class Latency:
    """Measured grid with the fit as fallback: exact where measured, smooth elsewhere."""

    def __init__(self, grid: list[tuple[int, int, float]]):
        self.grid = {(int(b), int(t)): float(ms) for b, t, ms in grid}
        self.fit = LatencyFit.fit(grid)

    def __call__(self, batch: int, tokens: int) -> float:
        return self.grid.get((batch, tokens)) or self.fit(batch, tokens)

    def to_dict(self) -> dict:
        return {"grid": [[b, t, ms] for (b, t), ms in sorted(self.grid.items())], "fit": self.fit.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Latency":
        return cls([tuple(x) for x in d["grid"]])


@torch.inference_mode()
def measure_forward(model, batch_sizes: list[int], tokens: list[int], prefix: int = 256,
                    repeats: int = 5, progress=None, stop_ratio: float | None = None,
                    head: torch.nn.Module | None = None) -> list[tuple[int, int, float]]:
    """Fastest ms of one forward pass (plus `head`, by default the model's lm_head, on every token:
    verification needs all logits) for each (B, T), rows holding `prefix` cached tokens. A draft that
    scores a reduced vocabulary passes its own head (`DraftModel.head`).

    Per batch size the T sweep runs `repeats` times over and each point keeps its fastest time, so a
    burst of other work on the machine inflates one round of one point, not a whole stretch of the curve.
    With `stop_ratio`, the sweep (T in increasing order) ends after the first point that costs more than
    that many one-token passes: no speculation can recover a step that dear."""
    out = []
    head = head if head is not None else model.lm_head
    tokens = sorted(set(tokens))
    for b in batch_sizes:
        cache = model.new_cache(b, prefix + max(tokens))
        passes = {t: _forward_pass(model, head, cache, b, t, prefix) for t in tokens}
        best: dict[int, float] = {}
        remaining = list(tokens)
        while remaining:
            todo = _sweep(passes, best, remaining, repeats, model.device, stop_ratio)
            remaining = remaining[len(todo):]
            # A cut made on one burst-inflated first sample is undone once the fastest time disagrees.
            if stop_ratio is None or best[todo[-1]] > stop_ratio * best[tokens[0]]:
                break
        out.extend((b, t, best[t]) for t in sorted(best))
        if progress is not None:
            progress.update(len(tokens))
    return out


def _sweep(passes: dict, best: dict[int, float], todo: list[int], repeats: int, device,
           stop_ratio: float | None) -> list[int]:
    """`repeats` rounds over `todo`, keeping each point's fastest time; with `stop_ratio`, the first round
    cuts the sweep after the first point that dear. Returns the points measured."""
    for r in range(max(repeats, 1)):
        for t in todo:
            if r == 0:
                passes[t]()  # warm-up: the first call at a shape picks kernels and allocates
            best[t] = min(best.get(t, float("inf")), _time_ms(passes[t], device))
        if r == 0 and stop_ratio is not None:
            first = best[min(best)]
            over = [t for t in todo if best[t] > stop_ratio * first]
            todo = todo[: todo.index(over[0]) + 1] if over else todo
    return todo


def _forward_pass(model, head, cache, b: int, t: int, prefix: int):
    ids = torch.randint(0, model.config.vocab_size, (b, t), device=model.device)
    pos = prefix + torch.arange(t, device=model.device).expand(b, t)
    mask = causal(t, model.device)

    def once():
        cache.lens[:] = prefix
        head(model(ids, pos, cache, slice(0, b), mask))

    return once


@torch.inference_mode()
def target_pass_ms(model, rows: int, tokens: int = 1, prefix: int = 256, repeats: int = 1) -> float:
    """Fastest ms of one target pass (with its lm_head) over `tokens` per row for `rows` rows after a
    `prefix`-token cache, timed now: what a live measurement of something else is compared against."""
    cache = model.new_cache(rows, prefix + tokens)
    return _fastest_ms(_forward_pass(model, model.lm_head, cache, rows, tokens, prefix), repeats, model.device)


@torch.inference_mode()
def draft_step_ms(engine, proposer, rows: int, prefix: int = 256, steps: int = 6) -> float:
    """Median ms of `proposer`'s whole draft phase (its passes and all the host work around them: inputs,
    expansion, the choice of nodes, grafting) over the engine steps of `rows` rows decoding 2 * `steps` tokens
    after a `prefix`-token prompt of random tokens. The first step (the proposer's set-up, catching up on the whole
    prompt) is left out. A median, not the fastest: host work varies from step to step and the planner needs
    what a typical step spends."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, engine.model.config.vocab_size, (rows, prefix), generator=g).tolist()
    times: list[float] = []
    draft = proposer.draft
    device = engine.model.device

    def timed(batch):
        out = None

        def once():
            nonlocal out
            out = draft(batch)

        times.append(_time_ms(once, device))
        return out

    proposer.draft = timed  # this proposer only (an instance attribute), undone below
    try:
        engine.generate(prompts, 2 * steps, proposer)
    finally:
        del proposer.draft
    if len(times) < 2:
        raise MedusaError(f"timing a draft step: the generation ran {len(times)} step(s), too few to time")
    return statistics.median(times[1:])


@torch.inference_mode()
def measure_heads(heads, hidden_size: int, batch_sizes: list[int], topk: int, dtype, device,
                  repeats: int = 5, projection=None) -> dict[int, float]:
    """Fastest ms of what a Medusa proposer runs per step (all heads, their top-k over the candidate
    vocabulary through the engine's `projection`), per batch size."""
    out = {}
    for b in batch_sizes:
        h = torch.randn(b, hidden_size, dtype=dtype, device=device)
        out[b] = _fastest_ms(lambda: heads.top_tokens(h, topk, heads.config.num_heads, projection), repeats, device)
    return out


def _time_ms(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


def _fastest_ms(fn, repeats: int, device) -> float:
    """The fastest of `repeats` timings: other work on the machine only ever adds time, so the minimum is
    the least disturbed estimate of the pass's own cost (a median still carries contention spikes)."""
    fn()  # warm-up
    return min(_time_ms(fn, device) for _ in range(max(repeats, 1)))


def heads_ms(heads: dict[int, float], batch: int) -> float:
    """Heads latency at `batch`, interpolated linearly in B between measured sizes."""
    if not heads:
        return 0.0
    sizes = sorted(heads)
    if batch in heads:
        return heads[batch]
    lo = max([s for s in sizes if s < batch], default=sizes[0])
    hi = min([s for s in sizes if s > batch], default=sizes[-1])
    if lo == hi:
        return heads[lo] * batch / lo
    return heads[lo] + (heads[hi] - heads[lo]) * (batch - lo) / (hi - lo)


def draft_pass_ms(runner: HeadRunner, rows: int, tokens: int, prefix: int = 256, repeats: int = 5) -> float:
    """Fastest ms of one head pass over `tokens` entries per row for `rows` rows after a `prefix`-entry
    cache, with its draft-vocabulary log-softmax and top-k: one draft step's cost."""
    dev = runner.device
    cache = runner.new_cache(rows, prefix + tokens + 1)
    cache.lens[:rows] = prefix
    h = runner.config.hidden_size
    emb = torch.randn(rows, tokens, h, dtype=runner.dtype, device=dev)
    x = torch.randn(rows, tokens, h, dtype=runner.dtype, device=dev)
    pos = torch.full((rows, tokens), prefix, device=dev)
    vis = torch.ones(rows, tokens, tokens, dtype=torch.bool, device=dev)
    best = float("inf")
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            out = runner(emb, x, cache, DraftBlock(pos, slice(0, rows), 0, vis))
            torch.log_softmax(runner.logits(out).float(), -1).topk(min(4, runner.vocab), -1)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i:
                best = min(best, (time.perf_counter() - t0) * 1000)
    return best
