"""Every method's speedup at every batch size, predicted from its run at one batch size and the latency curve.

A run of B rows costs its prefill, then `steps` decoding steps:

    time(B) = prefill(B) + steps(B) * step(B)

Plain decoding is measured at every batch size; its step is the target's one-token pass L(B, 1) plus what
the engine spends around it (sampling, bookkeeping, the host's share):

    overhead(B) = step_plain(B) - L(B, 1)

A speculative method is measured at the smallest batch size b0 only. There it gives its tau (folded into
`steps`: steps_m(B) = steps_plain(B) * steps_m(b0) / steps_plain(b0)), the tokens per row in its
verification pass T (a tree's nodes + 1, averaged over its steps: a dynamic or merged tree varies) and the
rest of its step, `extra`, which is what is left once its verification pass, its draft passes and the
engine's overhead are taken out:

    extra = step_m(b0) - L(b0, T) - draft(b0) - overhead(b0)
    step_m(B) = L(B, T) + draft(B) + overhead(B) + extra

`draft(B)` is the method's measured drafting curve (Medusa heads, the draft model's passes, a feature head's
catch-up and expansion passes) where it has one, else 0 (the text lookups cost host time, inside `extra`).
L(B, T) comes from the calibrated grid, interpolated in T between measured points, the fitted
a + b*B + c*B*T elsewhere. prefill(B) is the fit at the run's mean prompt length, once per batch.

    S_m(B) = time_plain(B) / time_m(B)

Auto mode plans a tree per batch size (or plain decoding), weighing each tree's expected gain by the share
its recent steps delivered (`medusa.runtime.auto.Realised`). Its prediction follows the plan it makes with
the share its run at b0 delivered: the planned tree's tokens and draft passes at each size, scaled by the
share of speculative steps that run measured (the gate runs some steps plainly), and its tau moved as the
planned tau moves; plain (1.0) where it plans plain.

At b0 this reproduces the measured speedup (up to the prefill estimate); every other batch size is a
prediction. Its assumptions, which the measured columns beside it test: tau and tree size do not depend on
the batch for fixed trees (auto mode's follow its plan), and the method's host-side extra does not grow
with the batch.
"""

from __future__ import annotations

from medusa.runtime.timing import Latency


def latency_at(target: Latency, batch: int, tokens: float) -> float:
    """L(batch, tokens) for a fractional token count: linear between the measured points around it at
    this batch size, the fit where there are none on both sides."""
    ts = sorted(t for b, t in target.grid if b == batch)
    lo = max((t for t in ts if t <= tokens), default=None)
    hi = min((t for t in ts if t >= tokens), default=None)
    if lo is None or hi is None:
        return target.fit(batch, tokens)
    if lo == hi:
        return target.grid[(batch, lo)]
    w = (tokens - lo) / (hi - lo)
    return (1 - w) * target.grid[(batch, lo)] + w * target.grid[(batch, hi)]


def prefill_ms(target: Latency, run: dict, batch: int) -> float:
    """The run's prefill passes: one per batch, at its mean prompt length."""
    batches = max(run.get("batches") or 1, 1)
    mean_prompt = (run.get("prompt_tokens") or 0) / (batches * batch)
    return batches * target.fit(batch, mean_prompt) if mean_prompt else 0.0


def step_ms(target: Latency, run: dict, batch: int) -> float:
    """Mean time of one decoding step of a run: its time less the prefill, over its steps."""
    return (1000 * run["seconds"] - prefill_ms(target, run, batch)) / max(run["steps"], 1)


def predict_runs(target: Latency, plain: dict[int, dict], method: dict, drafting: dict[int, float] | None,
                 batch_sizes: list[int]) -> dict[int, float]:
    """Predicted speedup over plain at each batch size in `batch_sizes` that plain was measured at.

    plain: {B: run}, method: {"batch": b0, "run": run, "tokens_per_pass": T}, a run being a summary row
    (seconds, steps, batches, prompt_tokens); drafting: {B: ms of the method's draft passes per step}.
    A method that plans per batch size (auto mode) adds "plan": {B: {"tokens": T, "steps": steps relative
    to b0's, "draft": ms} or None where it plans plain decoding (predicted 1.0: it does not pay there)}."""
    b0, run, tokens = method["batch"], method["run"], method["tokens_per_pass"]
    if b0 not in plain:
        return {}
    plan = method.get("plan")
    drafting = drafting or {}
    if plan is not None and plan.get(b0) is not None:
        drafting = {b: p["draft"] for b, p in plan.items() if p is not None}

    def overhead(b: int) -> float:
        return step_ms(target, plain[b], b) - target(b, 1)

    extra = (step_ms(target, run, b0) - latency_at(target, b0, tokens) - drafting.get(b0, 0.0)
             - overhead(b0))
    ratio = run["steps"] / max(plain[b0]["steps"], 1)
    out = {}
    for b in batch_sizes:
        if b not in plain:
            continue
        t, steps = tokens, ratio
        if plan is not None:
            if plan.get(b) is None:
                out[b] = 1.0
                continue
            t, steps = plan[b]["tokens"], ratio * plan[b]["steps"]
        step = max(latency_at(target, b, t) + drafting.get(b, 0.0) + overhead(b) + extra, 1e-6)
        time_m = prefill_ms(target, plain[b], b) + steps * plain[b]["steps"] * step
        out[b] = 1000 * plain[b]["seconds"] / time_m
    return out


def planned(plans: dict[int, dict | None], b0: int, tau: float, tokens: float) -> dict[int, dict | None]:
    """A per-batch-size plan ({B: {"tokens", "tau", "draft"} as planned, or None for plain decoding}) scaled
    to what the run at b0 measured: a gate that runs some steps plainly makes fewer and smaller trees than
    planned, in the same share at every size; the measured tau moves with the planned one."""
    p0 = plans.get(b0)
    if p0 is None or p0["tokens"] <= 1:
        return {b: None for b in plans}
    # The speculative share of the steps (tree sizes scale with it); at most all of them: the run's first
    # steps, before its realised share was known, may have planned larger trees than the weighed plan.
    share = min((tokens - 1) / (p0["tokens"] - 1), 1.0)
    out: dict[int, dict | None] = {}
    for b, p in plans.items():
        if p is None:
            out[b] = None
            continue
        gain = (p["tau"] - 1) / (p0["tau"] - 1) if p0["tau"] > 1 else 1.0
        out[b] = {"tokens": 1 + share * (p["tokens"] - 1), "steps": tau / (1 + (tau - 1) * gain),
                  "draft": share * p["draft"]}
    return out
