"""Dynamic speculation: per engine step, choose the heads' tree verification (Medusa or feature heads: mode
"heads"), draft-model chains or plain decoding.

Speculation pays when the target pass is memory- or overhead-bound (small batches): checking a tree of
candidates costs little more than one token. As the running batch grows the pass becomes compute-bound,
extra tree tokens cost real time, and plain decoding wins. Two signals decide:

- load (running rows + queued requests) against high/low watermarks, with hysteresis so the mode does not
  flap when load hovers at one level; defaults may come from the evaluator's cost model;
- the acceptance gate (`medusa.runtime.gate`, shared with `--mode auto`), per batch-size bucket: speculation pays
  when the tokens per row-step it yields (tau) exceed the measured cost of its step relative to a plain
  one; when it measurably does not, speculation pauses in that bucket (and larger ones) and is retried
  later with back-off. So a poorly predicted workload, or a batch size past the crossover the watermarks
  did not catch, falls back to plain decoding by measurement.

Defaults for the watermarks and trees come, in this order, from a cost-model file (`cost_model`), from
this machine's calibrated pass-cost curve and the heads' eval.json (`calibrate: true`, the plans of
`--mode auto`), or from the config's own keys.

The policy is the engine's step policy (`medusa.decoding.engine.StepPolicy`, as `--mode auto` is): the scheduler
tells it how many requests wait (`waiting`) and runs each step through `Engine.policy_step`, which asks it for
the step's proposer (`choose`) and reports the step back (`observe`, with `StepOutput.tau`). A proposer that
raises before its step commits anything is dropped for that step, which is redone plainly (`recover`).

Cost-model JSON read here (written by `medusa eval`, alone or as the "cost_model" key of its report.json;
other keys are ignored):
    {"recommendation": {"1": "heads", "2": "heads", "8": "plain", ...},
     "best_tree": {"1": "tree-32", "4": "tree-16", ...}}      # optional; values: tree names/paths or sizes
Speculation switches off at the smallest batch size recommended "plain" (high watermark) and back on at the
largest speculative batch size below it (low watermark); the kind (heads/draft) follows the
recommendation for the current batch size. Files written before the heads' mode was named `heads` say
`medusa`; it is read as `heads`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from medusa.decoding.engine import StepPolicy
from medusa.decoding.proposers import Proposer
from medusa.decoding.trees.tree import DEFAULT_TREE
from medusa.errors import MedusaError
from medusa.io import read_json
from medusa.runtime.gate import AcceptanceGate, bucket

if TYPE_CHECKING:
    from medusa.runtime.auto import Plan

from medusa.serve.config import PolicyConfig

log = logging.getLogger("medusa.serve.policy")
# The policy's modes, named as everywhere (`medusa.runtime.proposers`): the runtime's own heads (or retrieval
# alone), a draft model, or none.
MODES = ("heads", "draft", "plain")
SPECULATIVE = MODES[:2]


@dataclass(frozen=True)
class Decision:
    mode: str  # "heads", "draft" or "plain"
    tree: str | None  # the heads' tree name for mode "heads"
    reason: str


@dataclass
class CostModel:
    recommendation: dict[int, str]
    best_tree: dict[int, str]

    @classmethod
    def load(cls, path: str) -> "CostModel":
        data = read_json(path, "policy.cost_model")
        if isinstance(data, dict) and "recommendation" not in data and isinstance(data.get("cost_model"), dict):
            data = data["cost_model"]  # a whole `medusa eval` report.json
        rec = data.get("recommendation") if isinstance(data, dict) else None
        if not isinstance(rec, dict) or not rec:
            raise MedusaError(f"policy.cost_model: {path} has no 'recommendation' mapping "
                              "(batch size -> heads|draft|plain)")
        rec = {b: "heads" if v == "medusa" else v for b, v in rec.items()}  # the earlier name of heads
        return cls(_by_batch(rec, path, "recommendation", values=MODES),
                   _by_batch(data.get("best_tree") or {}, path, "best_tree"))


    @classmethod
    def from_plans(cls, plans: "list[Plan]") -> "CostModel":
        """The auto mode's per-batch-size plans (this machine's calibrated curve and the heads' accuracy)
        as a cost model: speculate with the planned tree where it predicts a gain, plain elsewhere."""
        rec = {p.batch: "heads" if p.tree is not None else "plain" for p in plans}
        return cls(rec, {p.batch: p.tree.name for p in plans if p.tree is not None})


def _by_batch(raw: dict, path: str, key: str, values: tuple[str, ...] | None = None) -> dict[int, str]:
    out = {}
    for b, v in raw.items():
        try:
            size = int(b)
        except (TypeError, ValueError):
            raise MedusaError(f"policy.cost_model: {path}: {key} key {b!r} is not a batch size") from None
        if isinstance(v, int):
            v = f"tree-{v}"  # a tree given by its node count means the shipped tree of that size
        if not isinstance(v, str) or (values and v not in values):
            allowed = "|".join(values) if values else "a tree name"
            raise MedusaError(f"policy.cost_model: {path}: {key}[{b}] = {v!r}, expected {allowed}")
        out[size] = v
    return out


def _floor_lookup(table: dict[int, str], n: int) -> str:
    """The entry of the largest key <= n (the smallest key when n is below all of them)."""
    keys = sorted(table)
    best = keys[0]
    for k in keys:
        if k <= n:
            best = k
    return table[best]


class SpeculationPolicy(StepPolicy):
    def __init__(self, cfg: PolicyConfig, has_heads: bool, has_draft: bool, calibrated: CostModel | None = None,
                 default_trees: dict[int, str] | None = None):
        """`has_heads`: the runtime has heads of its own (Medusa or feature heads; mode "heads" drafts with
        them). `calibrated`: the cost model of this machine's calibration, used when no cost_model file is
        set. `default_trees`: the heads' trees when the config names none. The proposers come with `serve`."""
        self.cfg = cfg
        self.has = {"heads": has_heads, "draft": has_draft}
        self.high, self.low = cfg.high_watermark, cfg.low_watermark
        self.trees = dict(cfg.trees or default_trees or {1: DEFAULT_TREE})
        self.kind_by_batch: dict[int, str] = {1: "heads" if has_heads else "draft"}
        if cfg.cost_model:
            self._apply_cost_model(CostModel.load(cfg.cost_model))
        elif calibrated is not None:
            self._apply_cost_model(calibrated)
        if cfg.mode in SPECULATIVE and not self.has[cfg.mode]:
            need = "heads (--heads)" if cfg.mode == "heads" else "a draft model (--draft)"
            raise MedusaError(f"policy.mode {cfg.mode!r} needs {need}")
        self.spec_on = True
        self.gate = AcceptanceGate(cfg.window, cfg.min_tau, cfg.retry_after_steps)
        self.last: Decision | None = None
        self.heads: dict[str, Proposer] = {}  # the heads' proposer per tree name
        self.draft: Proposer | None = None
        self.max_tree_size = 1
        self.queued = 0  # requests waiting when the next step is chosen
        self.chosen: tuple[Decision, Proposer | None] = (Decision("plain", None, "no step yet"), None)
        self.failures = 0  # proposers that raised (their steps were redone plainly)

    # ---- the engine's step policy ---------------------------------------------------------------------
    def serve(self, heads: dict[str, Proposer], draft: Proposer | None) -> None:
        """The proposers the decisions name: the heads' per tree name, and the draft model's."""
        self.heads, self.draft = dict(heads), draft
        self.max_tree_size = max([p.span for p in self.heads.values()]
                                 + ([draft.span] if draft is not None else []), default=1)

    def attach(self, batch) -> None:
        """Per-row proposer state a new batch needs before its first prefill (feature heads keep the
        prompts' features then, and every step's after)."""
        for proposer in [*self.heads.values(), self.draft]:
            if proposer is not None:
                proposer.attach(batch)

    def waiting(self, queued: int) -> None:
        """How many requests wait for a row: load for the next `choose`."""
        self.queued = queued

    def proposer_for(self, decision: Decision) -> Proposer | None:
        if decision.mode == "heads":
            return self.heads.get(decision.tree)
        return self.draft if decision.mode == "draft" else None

    def choose(self, rows: int) -> Proposer | None:
        """The step's proposer: the decision's, unless it is missing (then plain); `chosen` keeps both."""
        decision = self.decide(rows, self.queued)
        proposer = self.proposer_for(decision)
        if proposer is None and decision.mode != "plain":
            decision = Decision("plain", None, f"{decision.mode} unavailable")
        self.chosen = (decision, proposer)
        return proposer

    def recover(self, proposer: Proposer, exc: Exception) -> bool:
        decision = self.chosen[0]
        self.failures += 1
        n = self.failures
        log.error("%s proposal failed (%d so far): %s: %s; this step decodes without speculation",
                  decision.mode, n, type(exc).__name__, exc, exc_info=exc if n & (n - 1) == 0 else None)
        self.chosen = (Decision("plain", None, f"{decision.mode} failed"), None)
        return True

    def _apply_cost_model(self, cm: CostModel) -> None:
        sizes = sorted(cm.recommendation)
        plain_at = [b for b in sizes if cm.recommendation[b] == "plain"]
        self.high = plain_at[0] if plain_at else 1 << 30
        below = [b for b in sizes if b < self.high and cm.recommendation[b] != "plain"]
        self.low = below[-1] if below else -1  # -1: speculation never switches on
        self.kind_by_batch = {b: k for b, k in cm.recommendation.items() if k != "plain"} or self.kind_by_batch
        if cm.best_tree:
            self.trees = dict(cm.best_tree)

    @property
    def can_speculate(self) -> bool:
        return self.has["heads"] or self.has["draft"]

    def _kind(self, n: int) -> str:
        kind = _floor_lookup(self.kind_by_batch, n)
        if not self.has[kind]:
            kind = "draft" if kind == "heads" else "heads"
        return kind

    def _decision(self, mode: str, n: int, reason: str) -> Decision:
        return Decision(mode, _floor_lookup(self.trees, n) if mode == "heads" else None, reason)

    def decide(self, running: int, queued: int) -> Decision:
        """The mode of the next step for a batch of `running` rows with `queued` requests waiting."""
        self.gate.tick()
        mode = self.cfg.mode
        if mode != "dynamic":
            decision = self._decision(mode, running, "fixed")
        elif not self.can_speculate:
            decision = Decision("plain", None, "no proposer")
        else:
            load = running + queued
            if self.spec_on and load >= self.high:
                self.spec_on = False
            elif not self.spec_on and load <= self.low:
                self.spec_on = True
            if not self.spec_on:
                decision = Decision("plain", None, f"load {load} >= {self.high}, waiting for <= {self.low}")
            elif self.gate.paused(running):
                decision = Decision("plain", None, f"acceptance gate, batch bucket {bucket(running)}")
            elif self.gate.needs_plain_probe(running):
                # One plain step per new bucket measures the cost a speculative step has to beat.
                decision = Decision("plain", None, f"probing plain step cost at bucket {bucket(running)}")
            else:
                decision = self._decision(self._kind(running), running, f"load {load}")
        if self.last is None or (decision.mode, decision.tree) != (self.last.mode, self.last.tree):
            log.info("speculation: %s%s (%s)", decision.mode,
                     f" {decision.tree}" if decision.tree else "", decision.reason)
        self.last = decision
        return decision

    def observe(self, rows: int, speculative: bool, tau: float, seconds: float, overhead: float = 0.0) -> None:
        """Feed back a finished step: its batch size, speculative or not, tokens per row (tau), duration,
        and the time choosing it took."""
        if self.cfg.mode != "dynamic":
            return
        paused = self.gate.observe(rows, speculative, tau, seconds, overhead)
        if paused:
            log.info(paused)
