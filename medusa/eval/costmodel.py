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

from medusa.errors import MedusaError
from medusa.runtime.timing import Latency, heads_ms

# The speculative methods the cost model predicts. The recommendation (which the server's policy reads)
# chooses among RECOMMENDABLE only: the server speculates with the runtime's heads ("heads") or a draft.
# ("heads" here: Medusa heads over static trees, the evaluator's `heads` method; reports written before the
# heads' mode was named `heads` say "medusa", and are read as such.)
SPECULATIVE = ("heads", "feature", "draft")
RECOMMENDABLE = ("heads", "draft")

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


# ---- predictions ------------------------------------------------------------------------------------


def medusa_speedup(target: Latency, heads: dict[int, float], batch: int, tree_size: int, tau: float) -> float:
    return tau * target(batch, 1) / (target(batch, tree_size) + heads_ms(heads, batch))


def feature_speedup(target: Latency, drafting: dict, batch: int, shape: dict, tau: float) -> float:
    """A feature head's dynamic tree: a catch-up head pass, depth-1 expansions, then the target verifies
    nodes+1 tokens. `drafting` = {"catch_up": ms, "expand": ms, "host": ms} timed at `batch` rows (`host`:
    the draft step's work beyond its passes; 0 in reports from before it was timed)."""
    return tau * target(batch, 1) / (target(batch, shape["nodes"] + 1) + drafting_ms(drafting, shape["depth"]))


def drafting_ms(t: dict, depth: int) -> float:
    """A feature head's whole draft step from its timings {catch_up, expand, host} (`host`: 0 where not timed)."""
    return t["catch_up"] + (depth - 1) * t["expand"] + t.get("host", 0.0)


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
    model["acceptance"] = {"heads": {tree: {"tau", "tree_size"}}, "draft": {"k", "tau", "alpha"},
                           "feature": {"tau", "nodes", "depth"}?}
    model["latency_ms"]["feature_draft"] = {B: {"catch_up", "expand", "host"}}? (a feature head's draft step)
    Adds "predicted", "analytic", "recommendation", "best_tree", "best_k" and "crossover".
    """
    lat = model["latency_ms"]
    target = Latency.from_dict(lat["target"])
    draft = Latency.from_dict(lat["draft"]) if lat.get("draft") else None
    heads = {int(b): ms for b, ms in (lat.get("heads") or {}).items()}
    acc = model.get("acceptance", {})
    trees = acc.get("heads") or acc.get("medusa") or {}
    dacc = acc.get("draft")
    facc, fdraft = acc.get("feature"), lat.get("feature_draft") or {}
    predicted, analytic, rec, best_tree, best_ks = {}, {}, {}, {}, {}
    for b in batch_sizes:
        row: dict = {"plain": 1.0}
        options = {name: medusa_speedup(target, heads, b, t["tree_size"], t["tau"]) for name, t in trees.items()}
        if options:
            name = max(options, key=options.get)
            row["heads"], row["heads_tree"] = options[name], name
            row["heads_by_tree"] = options
            best_tree[str(b)] = name
        if draft is not None and dacc:
            row["draft"] = draft_speedup(target, draft, b, dacc["k"], dacc["tau"])
            # Best K from the analytic acceptance with the measured latencies (tau only known at one K).
            by_k = {k: expected_accepted(dacc["alpha"], k) * target(b, 1) / draft_step_ms(target, draft, b, k)
                    for k in range(1, 9)}
            best_ks[str(b)] = max(by_k, key=by_k.get)
            c = draft(b, 1) / target(b, 1)
            analytic[str(b)] = {"c": c, "speedup": analytic_speedup(dacc["alpha"], dacc["k"], c)}
        if facc and str(b) in fdraft:
            row["feature"] = feature_speedup(target, fdraft[str(b)], b, facc, facc["tau"])
        predicted[str(b)] = row
        choice = max(RECOMMENDABLE, key=lambda m: row.get(m, 0.0))
        rec[str(b)] = choice if pays(row.get(choice, 0.0)) else "plain"
    model.update(predicted=predicted, analytic=analytic, recommendation=rec, best_tree=best_tree,
                 best_k=best_ks, crossover={kind: crossover_of(predicted, kind) for kind in SPECULATIVE})
    return model


def crossover_of(predicted: dict, kind: str) -> int | None:
    """The crossover of one method's predictions (None where it was not predicted, or pays everywhere)."""
    speedups = {int(b): r[kind] for b, r in predicted.items() if kind in r}
    return crossover(speedups) if speedups else None
