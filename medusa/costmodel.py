"""When does speculation pay? Forward-latency measurements, a fitted latency model and speedup predictions.

Measured side: the latency of one forward pass of the target (and of the draft) over a grid of batch size B
x tokens per row T, on a prefix of fixed length, plus the Medusa heads' cost per batch size. A fitted model

    latency(B, T) = a + b * B + c * B * T        (ms; weights read once, per-row overhead, per-token compute)

smooths the grid and extrapolates. With the acceptance measured by the evaluator (tau = tokens per
verification step) the predicted speedup of a method at batch size B is

    S(B) = tau * latency_target(B, 1) / step_time(B)

with step_time = latency_target(B, tree size) + heads(B) for Medusa and
latency_target(B, K+1) + latency_draft(B, 2) + (K-1) * latency_draft(B, 1) for a draft model (one catch-up
block of about two tokens, then K-1 single-token steps).

Analytic side (the textbook model, verification assumed as cheap as one decoding step):

    S = E / (1 + K * c),   E = (1 - alpha^(K+1)) / (1 - alpha),   c = c_draft / c_target

The crossover is the smallest batch size at which the predicted speedup is no longer above 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .errors import MedusaError

# ---- analytic model ---------------------------------------------------------------------------------


def expected_accepted(alpha: float, k: int) -> float:
    """E[tokens per step] for a K-token chain whose tokens are each accepted with probability alpha."""
    if not 0 <= alpha <= 1:
        raise MedusaError(f"--alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise MedusaError(f"--k must be >= 0, got {k}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def analytic_speedup(alpha: float, k: int, c: float) -> float:
    """S = E / (1 + K c): speedup of draft speculation over plain decoding."""
    if c < 0:
        raise MedusaError(f"draft/target cost ratio must be >= 0, got {c}")
    return expected_accepted(alpha, k) / (1 + k * c)


def pays(speedup: float) -> bool:
    """Speculation is worth it only when it is strictly faster than plain decoding."""
    return speedup > 1.0


def best_k(alpha: float, c: float, ks: range | list[int] = range(1, 9)) -> tuple[int, float]:
    """The K with the largest analytic speedup (the smallest K on ties)."""
    return max(((k, analytic_speedup(alpha, k, c)) for k in ks), key=lambda kv: (kv[1], -kv[0]))


def alpha_from_acceptance(acceptance_by_head: list[float]) -> float:
    """One per-token acceptance rate that reproduces the measured chain's E[accepted] (its geometric mean
    would overweight the rarely reached deep positions, so match the expectation instead)."""
    if not acceptance_by_head:
        return 0.0
    k = len(acceptance_by_head)
    run, target = 1.0, 1.0
    for a in acceptance_by_head:
        run *= a
        target += run
    lo, hi = 0.0, 1.0
    for _ in range(60):  # E(alpha) is increasing: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted(mid, k) < target else (lo, mid)
    return (lo + hi) / 2


# ---- latency model ----------------------------------------------------------------------------------


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
                    repeats: int = 5, progress=None, stop_ratio: float | None = None) -> list[tuple[int, int, float]]:
    """Fastest ms of one forward pass (plus the lm_head on every token: verification needs all logits)
    for each (B, T), rows holding `prefix` cached tokens.

    Per batch size the T sweep runs `repeats` times over and each point keeps its fastest time, so a
    burst of other work on the machine inflates one round of one point, not a whole stretch of the curve.
    With `stop_ratio`, the sweep (T in increasing order) ends after the first point that costs more than
    that many one-token passes: no speculation can recover a step that dear."""
    out = []
    head = getattr(model, "draft_head", None) or model.lm_head  # a draft may score a reduced vocabulary
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
    mask = torch.ones(t, t, dtype=torch.bool, device=model.device).tril()

    def once():
        cache.lens[:] = prefix
        head(model(ids, pos, cache, slice(0, b), mask))

    return once


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


# ---- predictions ------------------------------------------------------------------------------------


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


def medusa_speedup(target: Latency, heads: dict[int, float], batch: int, tree_size: int, tau: float) -> float:
    return tau * target(batch, 1) / (target(batch, tree_size) + heads_ms(heads, batch))


def draft_step_ms(target: Latency, draft: Latency, batch: int, k: int) -> float:
    return target(batch, k + 1) + draft(batch, 2) + (k - 1) * draft(batch, 1)


def draft_speedup(target: Latency, draft: Latency, batch: int, k: int, tau: float) -> float:
    return tau * target(batch, 1) / draft_step_ms(target, draft, batch, k)


def crossover(speedups: dict[int, float]) -> int | None:
    """Smallest batch size at which speculation no longer pays; None if it pays at every size."""
    for b in sorted(speedups):
        if not pays(speedups[b]):
            return b
    return None


def predict(model: dict, batch_sizes: list[int]) -> dict:
    """Fill a cost-model dict's predictions from its latencies and acceptance.

    model["latency_ms"] = {"target": Latency dict, "draft": Latency dict?, "heads": {B: ms}?}
    model["acceptance"] = {"medusa": {tree: {"tau", "tree_size"}}, "draft": {"k", "tau", "alpha"}}
    Adds "predicted", "analytic", "recommendation", "best_tree", "best_k" and "crossover".
    """
    lat = model["latency_ms"]
    target = Latency.from_dict(lat["target"])
    draft = Latency.from_dict(lat["draft"]) if lat.get("draft") else None
    heads = {int(b): ms for b, ms in (lat.get("heads") or {}).items()}
    acc = model.get("acceptance", {})
    trees = acc.get("medusa") or {}
    dacc = acc.get("draft")
    predicted, analytic, rec, best_tree, best_ks = {}, {}, {}, {}, {}
    for b in batch_sizes:
        row: dict = {"plain": 1.0}
        options = {name: medusa_speedup(target, heads, b, t["tree_size"], t["tau"]) for name, t in trees.items()}
        if options:
            name = max(options, key=options.get)
            row["medusa"], row["medusa_tree"] = options[name], name
            row["medusa_by_tree"] = options
            best_tree[str(b)] = name
        if draft is not None and dacc:
            row["draft"] = draft_speedup(target, draft, b, dacc["k"], dacc["tau"])
            # Best K from the analytic acceptance with the measured latencies (tau only known at one K).
            by_k = {k: expected_accepted(dacc["alpha"], k) * target(b, 1) / draft_step_ms(target, draft, b, k)
                    for k in range(1, 9)}
            best_ks[str(b)] = max(by_k, key=by_k.get)
            c = draft(b, 1) / target(b, 1)
            analytic[str(b)] = {"c": c, "speedup": analytic_speedup(dacc["alpha"], dacc["k"], c)}
        predicted[str(b)] = row
        choice = max(("medusa", "draft"), key=lambda m: row.get(m, 0.0))
        rec[str(b)] = choice if pays(row.get(choice, 0.0)) else "plain"
    model.update(predicted=predicted, analytic=analytic, recommendation=rec, best_tree=best_tree,
                 best_k=best_ks, crossover={
                     "medusa": crossover({int(b): r["medusa"] for b, r in predicted.items() if "medusa" in r})
                     if trees else None,
                     "draft": crossover({int(b): r["draft"] for b, r in predicted.items() if "draft" in r})
                     if draft is not None and dacc else None})
    return model
