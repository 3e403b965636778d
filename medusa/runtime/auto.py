"""`--mode auto`: speculate only where this machine's measured pass costs say it pays, and only while the
steps themselves confirm it.

The prediction: for a batch of B rows, a tree of N nodes is expected to yield tau tokens per row-step
(from the heads' held-out rank accuracies, eval.json) and to cost ratio(B, N) one-token passes plus the
heads (from the calibrated curve, `medusa.runtime.calibrate`). Its predicted speedup over plain decoding is

    S = tau / (ratio(B, N) + heads_ms(B) / pass_ms(B, 1))

Candidates are the heads' own trees and greedy trees of every budget on the curve (so a machine where a
16-token pass costs 1.1 one-token passes gets a large tree, and one where 3 tokens already cost 2x gets a
chain or nothing). The best candidate is used when S clears MARGIN; otherwise plain decoding. Then the
acceptance gate (`medusa.runtime.gate`) times every step: a prediction that measures as a loss switches itself off.

The heads' accuracies are measured on held-out text like their training data; on other text they accept
less. `Realised` follows how much of the expected gain (tau - 1) the recent speculative steps delivered,
and plans weigh every tree's gain by it (tau' = 1 + realised * (tau - 1)): text the heads know little gets
the smaller trees (or plain decoding) that its acceptance can pay for, before the gate has to pause a loss.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from medusa.runtime.calibrate import Calibration
from medusa.runtime.gate import AcceptanceGate
from medusa.decoding.engine import StepPolicy
from medusa.decoding.proposers import Proposer
from medusa.decoding.trees.tree import Tree, build_tree, expected_tau

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch
    from medusa.decoding.proposers.feature_heads import FeatureHead
    from medusa.decoding.proposers.heads import MedusaHeads

# Predicted speedups below this are not worth the risk of being wrong: the curve and the accuracies are
# estimates, and a near-tie gains nothing a user would notice.
MARGIN = 1.05
BUDGETS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 63]


@dataclass(frozen=True)
class Plan:
    """What auto mode does at one batch size, and why."""

    batch: int
    tree: Tree | None  # None: plain decoding
    speedup: float  # predicted, over plain decoding
    tau: float  # expected tokens per row-step
    reason: str

    def to_dict(self) -> dict:
        return {"batch_size": self.batch, "mode": "speculative" if self.tree is not None else "plain",
                "tree": self.tree.name if self.tree is not None else None,
                "tree_size": self.tree.size if self.tree is not None else 1,
                "predicted_speedup": round(self.speedup, 3), "expected_tau": round(self.tau, 3),
                "reason": self.reason}


class Realised:
    """The share of the expected gain the recent speculative steps delivered: sum(measured tau - 1) over
    sum(expected tau - 1), each step weighed by its rows, for the last WINDOW steps, rounded to STEP (so
    plans, cached per value, change only on a real shift) and kept within [LOW, 1]. 1 until MIN_ROWS
    row-steps were seen (8 steps of one row, one step of 8 rows: a step's tau is already the mean over its
    rows, so a batch learns what its text delivers as soon as it has as many samples): never more than 1,
    since text that beats the heads' held-out accuracy is served well by the plan the accuracy gives."""

    WINDOW, MIN_ROWS, STEP, LOW = 32, 8, 0.1, 0.2

    def __init__(self) -> None:
        self.gains: deque[tuple[float, float, int]] = deque(maxlen=self.WINDOW)  # row-weighted (m, e), rows
        self.total = [0.0, 0.0]  # (measured, expected) row-weighted gains over every speculative step

    def add(self, measured_tau: float, expected_tau: float, rows: int = 1) -> None:
        """One speculative step of `rows` rows: its mean tau per row, and the tau its plan expected."""
        if expected_tau > 1:
            measured, expected = rows * (measured_tau - 1), rows * (expected_tau - 1)
            self.gains.append((measured, expected, rows))
            self.total[0] += measured
            self.total[1] += expected

    def scale(self) -> float:
        if sum(r for _, _, r in self.gains) < self.MIN_ROWS:
            return 1.0
        return self.rounded(sum(m for m, _, _ in self.gains) / sum(e for _, e, _ in self.gains))

    @classmethod
    def rounded(cls, share: float) -> float:
        """A share as plans are weighed by it: within [LOW, 1], to STEP."""
        return round(min(max(share, cls.LOW), 1.0) / cls.STEP) * cls.STEP

    def overall(self) -> float | None:
        """The share delivered over every speculative step so far (unrounded; None before any)."""
        return self.total[0] / self.total[1] if self.total[1] > 0 else None


def weighed(tau: float, realised: float) -> float:
    """An expected tau with its gain weighed by the realised share."""
    return 1 + realised * (tau - 1)


def read_accuracy(heads: "MedusaHeads | FeatureHead") -> list[list[float]] | None:
    """Heads' (Medusa or feature) held-out rank accuracies, from the eval.json next to them; None when they
    were not measured."""
    directory = heads.directory
    path = Path(directory) / "eval.json" if directory is not None else None
    if path is None or not path.is_file():
        return None
    try:
        acc = json.loads(path.read_text()).get("rank_accuracy")
    except (ValueError, AttributeError):
        return None
    return acc if isinstance(acc, list) and acc and all(isinstance(a, list) and a for a in acc) else None


def realised_note(realised: float) -> str:
    return f" ({realised:.0%} of its gain realised lately)" if realised < 1 else ""


def candidate_trees(accuracy: list[list[float]], named: list[Tree], num_heads: int,
                    max_topk: int | None = None) -> list[Tree]:
    """The heads' own trees plus a greedy tree for every budget: the curve decides which size pays."""
    acc = [row[:max_topk] if max_topk else row for row in accuracy[:num_heads]]
    built = [build_tree(acc, n, name=f"auto-{n}") for n in BUDGETS]
    usable = [t for t in named if t.depth <= num_heads and (not max_topk or t.topk <= max_topk)]
    return usable + [t for t in built if t.size > 1]


def plan(cal: Calibration, accuracy: list[list[float]], trees: list[Tree], batch: int,
         realised: float = 1.0) -> Plan:
    """The best predicted tree for `batch` rows, or plain decoding when none clears MARGIN. `realised`
    weighs each tree's expected gain (`Realised`); the plan's tau is the heads' own expectation."""
    one = cal.ms(batch, 1)
    heads = cal.heads(batch) / one
    best: Plan | None = None
    for tree in trees:
        tau = expected_tau(tree.nodes, accuracy)
        cost = cal.ratio(batch, tree.size) + heads
        speedup = weighed(tau, realised) / cost
        if best is None or speedup > best.speedup:
            best = Plan(batch, tree, speedup, tau, f"tau {tau:.2f} expected{realised_note(realised)}, a "
                                                   f"{tree.size}-token pass costs {cost:.2f} plain steps")
    if best is None:
        return Plan(batch, None, 1.0, 1.0, "no candidate trees")
    if best.speedup < MARGIN:
        return Plan(batch, None, 1.0, 1.0, f"best tree {best.tree.name} predicts {best.speedup:.2f}x "
                                           f"(< {MARGIN}x): {best.reason}")
    return best


class AutoSpeculation(StepPolicy):
    """The engine's per-step choice in auto mode: the plan for the current number of rows, unless the
    acceptance gate has measured speculation losing there."""

    def __init__(self, plans: Callable[[int], Plan], make_proposer: Callable[[Tree], Proposer],
                 max_tree_size: int, predicted: bool = True, gate: AcceptanceGate | None = None,
                 attach: Callable[["Batch"], None] | None = None,
                 plain_scale: Callable[[int, int], float] | None = None):
        """`plans(rows, realised=...)`: the plan for a number of rows, `realised` (< 1, passed only then) weighing
        the expected gains (`Realised`); `predicted`: the plans come from a prediction (False: a fixed tree,
        judged by the gate alone, and never weighed);
        `attach`: sets up the per-row state the planned proposers share, before a batch's prefill;
        `plain_scale`: the calibrated ratio of plain steps between batch sizes, so a batch's tail borrows
        its plain reference (`AcceptanceGate`; ignored when `gate` is given)."""
        self._plans = plans
        self._attach = attach
        self.predicted = predicted
        self._make = make_proposer
        self._proposers: dict[str, Proposer] = {}
        self.max_tree_size = max_tree_size
        # Short pauses: a generation's acceptance dips and recovers with its text (a table, a list of names),
        # so a window that failed says little about the next one, and a 64-step pause measured 13% below the
        # same tree run fixed (AVX2 kernels, bs 1); a setting that keeps failing still backs off to 256 steps.
        self.gate = gate or AcceptanceGate(window=16, min_tau=1.0, retry_after_steps=16, plain_scale=plain_scale)
        self.steps = {"plain": 0, "speculative": 0}
        self.realised = Realised()
        self._chosen: Plan | None = None  # the plan of the step in flight (None: a plain step)
        self.events: list[str] = []
        self.choosing_seconds = 0.0  # time spent choosing steps (planning, building proposers)

    def plan(self, rows: int, realised: float | None = None) -> Plan:
        """The plan for `rows` rows, weighed by the gain realised lately (predicted plans only), or by a
        given `realised` share (`Realised.rounded` applies)."""
        if not self.predicted:
            realised = 1.0
        realised = self.realised.scale() if realised is None else Realised.rounded(realised)
        return self._plans(rows, realised=realised) if realised < 1 else self._plans(rows)

    def attach(self, batch: "Batch") -> None:
        if self._attach is not None:
            self._attach(batch)

    def choose(self, rows: int) -> Proposer | None:
        self.gate.tick()
        self._chosen = None
        if self.gate.paused(rows) or self.gate.needs_plain_probe(rows):
            return None  # no plan needed: a paused or probing step is plain whatever the plan says
        p = self.plan(rows)
        if p.tree is None:
            return None
        self._chosen = p
        return self.make_proposer(p.tree)

    def make_proposer(self, tree: Tree) -> Proposer:
        """The proposer auto mode runs for a planned `tree` (made once per tree name)."""
        if tree.name not in self._proposers:
            self._proposers[tree.name] = self._make(tree)
        return self._proposers[tree.name]

    def observe(self, rows: int, speculative: bool, tau: float, seconds: float, overhead: float = 0.0) -> None:
        self.steps["speculative" if speculative else "plain"] += 1
        self.choosing_seconds += overhead
        if speculative and self._chosen is not None:
            self.realised.add(tau, self._chosen.tau, rows)
        event = self.gate.observe(rows, speculative, tau, seconds, overhead)
        if event:
            self.events.append(event)


def describe_auto(rt, auto, batch_size: int) -> str:
    """One line: the machine, and what auto mode will do at this batch size and why."""
    where = rt.machine.describe()
    if auto is None:
        return f"medusa: auto mode on {where}: plain decoding (no heads for this model, retrieval off)"
    p = auto.plan(batch_size)
    heads = ("retrieval" if rt.feature is None and rt.heads is None
             else "feature heads and retrieval" if rt.feature is not None and rt.retrieval
             else "feature heads" if rt.feature is not None else "Medusa heads")
    what = f"{heads} with {p.tree.name} ({p.tree.size} tokens per pass)" if p.tree is not None else "plain decoding"
    return f"medusa: auto mode on {where}, batch size {batch_size}: {what}; {p.reason}"
