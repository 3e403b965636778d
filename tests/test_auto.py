"""dtype by hardware, the calibrated pass-cost curve, auto mode's decision and its switch-off by measurement."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import mixed_prompts, random_heads, tiny_model

from medusa.decoding.target import hardware
from medusa.runtime import calibrate
from medusa.runtime.auto import MARGIN, AutoSpeculation, Plan, candidate_trees, plan
from medusa.runtime.calibrate import Calibration, load_or_measure
from medusa.decoding.engine import Engine, StepPolicy
from medusa.errors import MedusaError
from medusa.runtime.gate import AcceptanceGate
from medusa.decoding.target.hardware import Machine, auto_dtype, resolve_dtype, short_dtype
from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.decoding.proposers import MedusaProposer
from medusa.runtime import Runtime
from medusa.decoding.target.transformer import Transformer
from medusa.decoding.trees.tree import Tree, expected_tau

# ---- dtype by hardware ------------------------------------------------------------------------------


@pytest.mark.parametrize("m,want", [
    (Machine("cpu", "AMD EPYC (Zen 5)", "AVX512", True, 2), "bf16"),
    (Machine("cpu", "AMD EPYC (Zen 2)", "AVX2", False, 2), "fp32"),
    (Machine("cpu", "Intel Xeon (Sapphire Rapids)", "AVX512", True, 8), "bf16"),
    (Machine("cuda", "NVIDIA H100", "9.0", True, 8), "bf16"),
    (Machine("cuda", "Tesla V100", "7.0", False, 8), "fp32"),
])
def test_auto_dtype_follows_native_bf16(m, want):
    name, why = auto_dtype(m)
    assert name == want and why


@pytest.mark.parametrize("flags,onednn,want", [
    ({"avx2", "avx512f", "avx512_bf16"}, True, True),   # Zen 4/5, Cooper Lake
    ({"avx2", "avx512f", "amx_bf16"}, True, True),      # Sapphire Rapids
    ({"avx2", "avx512f"}, True, False),                 # Skylake-X: oneDNN would emulate bf16
    ({"avx2"}, False, False),                           # Zen 2 / Zen 3: no bf16 kernels at all
    (set(), True, True),                                # flags unreadable: oneDNN's word
])
def test_native_bf16_detection(monkeypatch, flags, onednn, want):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(hardware, "onednn_bf16", lambda: onednn)
    assert hardware.cpu_native_bf16() is want
    assert resolve_dtype("auto", "cpu").name == ("bf16" if want else "fp32")


@pytest.mark.parametrize("spelling,short", [("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"),
                                            ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"),
                                            ("fp32", "fp32"), ("float32", "fp32"), ("torch.float32", "fp32"),
                                            (torch.bfloat16, "bf16")])
def test_dtype_spellings(spelling, short):
    assert short_dtype(spelling) == short
    assert resolve_dtype(spelling).reason == "requested"


def test_unknown_dtype_names_the_flag():
    with pytest.raises(MedusaError, match="--dtype.*'int8'"):
        short_dtype("int8")


# ---- the decision -----------------------------------------------------------------------------------

ACC = [[0.6, 0.15, 0.05], [0.45, 0.12, 0.04], [0.35, 0.1, 0.03], [0.3, 0.08, 0.02]]


def curve(ratio_of_tokens, batch_sizes=(1, 2, 4), one_ms=10.0, heads_ms=0.0) -> Calibration:
    grid = {(b, t): one_ms * b ** 0.5 * ratio_of_tokens(b, t) for b in batch_sizes for t in calibrate.TOKENS}
    return Calibration({}, grid, {b: heads_ms for b in batch_sizes})


def trees():
    return candidate_trees(ACC, [], num_heads=4)


def test_flat_curve_picks_a_large_tree():
    """Memory-bound passes (a 64-token pass costs 1.1 one-token passes): the most accepting tree wins."""
    cal = curve(lambda b, t: 1.0 + 0.1 * (t - 1) / 63)
    p = plan(cal, ACC, trees(), 1)
    assert p.tree is not None and p.tree.size >= 16
    assert p.speedup == pytest.approx(expected_tau(p.tree.nodes, ACC) / cal.ratio(1, p.tree.size))
    assert p.speedup == max(expected_tau(t.nodes, ACC) / cal.ratio(1, t.size) for t in trees())


def test_steep_curve_picks_plain_everywhere():
    """Every extra token costs a full pass (emulated bf16): no tree can pay, at any batch size."""
    cal = curve(lambda b, t: float(t))
    for b in (1, 2, 3, 4, 16):
        p = plan(cal, ACC, trees(), b)
        assert p.tree is None and "<" in p.reason


def test_moderate_curve_picks_a_small_tree_and_heads_cost_counts():
    cal = curve(lambda b, t: 1.0 + 0.15 * (t - 1) * b)
    small = plan(cal, ACC, trees(), 1)
    assert small.tree is not None and 2 <= small.tree.size <= 16
    # At batch 4 each extra token costs 4x as much: a smaller tree (or none) is chosen.
    assert plan(cal, ACC, trees(), 4).tree is None or plan(cal, ACC, trees(), 4).tree.size < small.tree.size
    # Heads that cost as much as the pass itself eat the gain.
    dear = curve(lambda b, t: 1.0 + 0.15 * (t - 1) * b, heads_ms=50.0)
    assert plan(dear, ACC, trees(), 1).tree is None


def test_margin_keeps_near_ties_plain():
    weak = [[0.05], [0.01]]
    cal = curve(lambda b, t: 1.0 + 0.01 * (t - 1))
    p = plan(cal, weak, candidate_trees(weak, [], num_heads=2), 1)
    assert p.tree is None  # tau 1.05 at best: not worth it
    assert MARGIN > 1.0


def test_calibration_interpolates_and_errs_against_speculation():
    cal = Calibration({}, {(1, 1): 10.0, (1, 4): 13.0, (1, 8): 20.0, (4, 1): 20.0, (4, 4): 40.0})
    assert cal.ms(1, 6) == pytest.approx(16.5)  # linear between measured T
    assert cal.ratio(1, 4) == pytest.approx(1.3)
    # Batch 2 was not measured: batch 4's curve (dearer per token) is read, scaled to batch 2's one-token
    # cost where that is known, here not: batch 4's own.
    assert cal.ratio(2, 4) == pytest.approx(2.0)


# ---- switch-off by measurement -----------------------------------------------------------------------


class _Marker:
    name, tree = "marker", Tree([[0]], name="one")


def auto_with(tree: Tree) -> AutoSpeculation:
    plans = lambda rows: Plan(rows, tree, 1.5, 1.6, "test")  # noqa: E731
    return AutoSpeculation(plans, lambda t: _Marker(), tree.size,
                           gate=AcceptanceGate(window=8, min_tau=1.0, retry_after_steps=20))


def test_auto_switches_off_when_speculation_measures_as_a_loss():
    auto = auto_with(Tree([[0], [0, 0]], name="t3"))
    assert auto.choose(1) is None  # the first step of a batch size measures the plain cost
    auto.observe(1, False, 1.0, 0.010)
    for _ in range(8):  # tau 1.2 but each speculative step costs 2 plain steps: a loss
        p = auto.choose(1)
        if p is None:
            break
        auto.observe(1, True, 1.2, 0.020)
    assert auto.choose(1) is None and auto.events and "paused" in auto.events[0]


def test_auto_keeps_speculating_when_it_pays():
    auto = auto_with(Tree([[0], [0, 0]], name="t3"))
    plain = 0
    for i in range(40):
        p = auto.choose(1)
        plain += p is None
        auto.observe(1, p is not None, 1.0 + (i % 3) if p is not None else 1.0, 0.011 if p is not None else 0.010)
    # Plain steps only to time the reference: one first, one after the 4th and one after the 8th speculative.
    assert not auto.events and plain == AcceptanceGate.PLAIN_PROBES


PLAIN_MS = {1: 8.0, 2: 9.0, 4: 10.0}  # a plain step's cost per bucket, as a calibrated curve gives it


def tail_gate(scaled: bool = True) -> AcceptanceGate:
    """A gate that has timed bucket 4 in full: PLAIN_PROBES plain steps and 12 speculative ones."""
    scale = (lambda b, ref: PLAIN_MS[b] / PLAIN_MS[ref]) if scaled else None
    gate = AcceptanceGate(window=8, min_tau=1.0, retry_after_steps=20, plain_scale=scale)
    for _ in range(40):
        gate.tick()
        if gate.needs_plain_probe(4):
            gate.observe(4, False, 1.0, PLAIN_MS[4] / 1000)
        else:
            gate.observe(4, True, 2.0, 1.2 * PLAIN_MS[4] / 1000)
    assert gate.records[4].plain_steps() == AcceptanceGate.PLAIN_PROBES
    return gate


def tail_steps(gate: AcceptanceGate, rows: int, steps: int, tau: float, cost: float) -> list[str]:
    """`steps` decided steps at `rows` rows: "p" a plain probe, "P" paused, "S" speculative (taking `cost`
    plain steps of that bucket's calibrated cost, accepting `tau`)."""
    seen = []
    for _ in range(steps):
        gate.tick()
        if gate.paused(rows):
            seen.append("P")
        elif gate.needs_plain_probe(rows):
            seen.append("p")
            gate.observe(rows, False, 1.0, PLAIN_MS[rows] / 1000)
        else:
            seen.append("S")
            gate.observe(rows, True, tau, cost * PLAIN_MS[rows] / 1000)
    return seen


def test_a_batch_tail_borrows_its_plain_reference_instead_of_probing():
    # Rows finish: 2 rows left. The bucket speculates at once, its plain cost carried over from bucket 4 by
    # the curve, and times plain steps of its own only after BORROWED_PROBE_EVERY speculative ones.
    seen = tail_steps(tail_gate(), 2, 20, tau=2.0, cost=1.2)
    every = AcceptanceGate.BORROWED_PROBE_EVERY
    assert seen[:every] == ["S"] * every and seen[every] == "p"
    # Without the curve, the tail's first step is a probe, as before.
    assert tail_steps(tail_gate(scaled=False), 2, 1, tau=2.0, cost=1.2) == ["p"]


def test_a_borrowed_reference_still_pauses_a_losing_tail():
    # tau 1.3 where a speculative step costs 2 plain steps of the tail's own cost, known only as bucket 4's
    # measured plain cost scaled by the curve: paused within the gate's evidence, without a probe.
    gate = tail_gate()
    assert gate.cost_ratio(2) is None  # nothing speculative timed at 2 rows yet
    seen = tail_steps(gate, 2, 12, tau=1.3, cost=2.0)
    assert gate.cost_ratio(2) == pytest.approx(2.0)
    assert "p" not in seen and seen.index("P") == AcceptanceGate.MIN_EVIDENCE


# ---- calibration cache --------------------------------------------------------------------------------


def tiny_runtime(dtype=torch.float32) -> Runtime:
    model = tiny_model("llama", seed=3).to(dtype)
    tr = Transformer(model)
    heads = MedusaHeads(HeadsConfig(model.config.hidden_size, model.config.vocab_size, 3, 1)).attach(model)
    return Runtime(model, None, tr, Engine(tr, None), heads)


def test_calibration_is_measured_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "TOKENS", [1, 2, 4, 8, 16])
    monkeypatch.setattr(calibrate, "REPEATS", 2)
    rt = tiny_runtime()
    first = load_or_measure(rt, [1, 2], progress=False)
    assert first.path.is_file() and first.batch_sizes() == [1, 2] and set(first.heads_ms) == {1, 2}
    assert all(first.grid[(b, 1)] > 0 for b in (1, 2))
    # Monotone in T, and each sweep reached a pass STOP_RATIO times dearer or the end of TOKENS.
    for b in (1, 2):
        ts = first.tokens(b)
        assert all(first.grid[(b, x)] <= first.grid[(b, y)] for x, y in zip(ts, ts[1:]))
        assert ts[-1] == calibrate.TOKENS[-1] or first.ratio(b, ts[-1]) > calibrate.STOP_RATIO

    def no_measuring(*a, **k):
        raise AssertionError("the cached curve should have been reused")

    monkeypatch.setattr(calibrate, "measure_forward", no_measuring)
    again = load_or_measure(tiny_runtime(), [1, 2], progress=False)
    assert again.grid == first.grid and again.path == first.path
    # Another dtype is another machine state: a file of its own.
    assert calibrate.calibration_path(calibrate.calibration_key(tiny_runtime(torch.bfloat16))) != first.path
    invariant = tiny_runtime()
    invariant.model.invariant = True  # batch-invariant attention has pass costs of its own
    assert calibrate.calibration_path(calibrate.calibration_key(invariant)) != first.path
    data = json.loads(first.path.read_text())
    assert data["key"]["dtype"] == "fp32" and data["key"]["machine"]["device"] == "cpu"


def test_a_curve_measured_on_a_busier_machine_is_measured_again(tmp_path, monkeypatch, capsys):
    """A cached one-token pass far slower than one timed now marks a curve measured under load: it is
    measured again, once per process. A cached pass faster than now (this machine is the busier one now)
    keeps the cached curve."""
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "TOKENS", [1, 2, 4])
    monkeypatch.setattr(calibrate, "REPEATS", 1)
    monkeypatch.setattr(calibrate, "_trusted", set())
    rt = tiny_runtime()
    path = calibrate.calibration_path(calibrate.calibration_key(rt))
    path.parent.mkdir(parents=True, exist_ok=True)
    busy = Calibration(calibrate.calibration_key(rt), {(1, 1): 1e6, (1, 2): 1.01e6, (1, 4): 1.02e6}, {1: 1.0}, path)
    path.write_text(json.dumps(busy.to_dict()))
    again = load_or_measure(rt, [1], progress=False)
    assert again.grid[(1, 1)] < 1e5 and "measured on a busier machine" in capsys.readouterr().err
    assert json.loads(path.read_text())["grid"] == again.to_dict()["grid"]  # the new curve replaced the file

    quiet = Calibration(busy.key, {(1, 1): 1e-6, (1, 2): 2e-6, (1, 4): 3e-6}, {1: 1e-6}, path)
    path.write_text(json.dumps(quiet.to_dict()))
    monkeypatch.setattr(calibrate, "_trusted", set())
    monkeypatch.setattr(calibrate, "measure_forward", lambda *a, **k: pytest.fail("a quieter curve is kept"))
    assert load_or_measure(rt, [1], progress=False).grid == quiet.grid
    assert "busier" not in capsys.readouterr().err


# ---- auto mode decodes exactly what plain decoding does ----------------------------------------------


class Alternating(StepPolicy):
    """A step policy that flips between plain decoding and two trees: every switch must be lossless."""

    def __init__(self, proposers):
        self.proposers, self.i = proposers, 0
        self.max_tree_size = max(p.tree.size for p in proposers)
        self.seen: list[int] = []

    def choose(self, rows):
        self.i += 1
        return [None, *self.proposers][self.i % (len(self.proposers) + 1)]

    def observe(self, rows, speculative, tau, seconds, overhead=0.0):
        self.seen.append(rows)


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_policy_switching_per_step_is_token_identical(batch_size):
    model = tiny_model("llama", seed=21)
    heads = random_heads(model, num_heads=3)
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(batch_size, seed=batch_size)
    plain = engine.generate(prompts, 30)
    policy = Alternating([MedusaProposer(heads, Tree([[0], [1], [0, 0]])),
                          MedusaProposer(heads, Tree([[0], [0, 0], [0, 0, 0], [1]]))])
    mixed = engine.generate(prompts, 30, policy=policy)
    assert [o.tokens for o in mixed.outputs] == [o.tokens for o in plain.outputs]
    assert mixed.mode == "auto" and len(policy.seen) == mixed.stats.steps


def test_the_pause_doubles_on_each_failure_up_to_16_times():
    """A bucket that keeps failing pauses for retry_after_steps x 1, 2, 4, 8, 16, 16, ...: the cap the
    documentation promises."""
    gate = AcceptanceGate(window=4, min_tau=2.0, retry_after_steps=10)
    pauses = []
    for _ in range(7):
        while gate.paused(8):
            gate.tick()
        for _ in range(4):  # a full window of steps that accept nothing at 8 rows
            gate.tick()
            gate.observe(8, True, 1.0, 0.01)
        rec = gate.record(8)
        pauses.append(rec.paused_until - gate.step)
    assert pauses == [10, 20, 40, 80, 160, 160, 160]


# ---- planning costs count, and planning times nothing ------------------------------------------------


class StepClock:
    """A clock the engine reads step times from: each target step costs `step` seconds, each call of the
    planner `plan` seconds (the step times the gate hears are then exact, whatever else runs)."""

    def __init__(self, engine: Engine, step: float):
        self.now = 0.0
        real = engine.step

        def step_and_tick(*a, **k):
            self.now += step
            return real(*a, **k)

        engine.step = step_and_tick
        engine.clock = lambda: self.now


@pytest.mark.parametrize("slow", ["every call", "once per batch size"])
def test_slow_planning_closes_the_gate_at_any_batch_size(slow):
    """Speculative steps as fast as plain ones but a planner that costs 0.5 s, on every call or once per
    number of rows (as rows finish): the gate counts the planning and falls back to plain decoding within a
    few steps; the same planner at no cost keeps speculating. Either way the output is plain decoding's."""
    model = tiny_model("llama", seed=21)
    heads = random_heads(model, num_heads=3)
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(6, seed=4)
    plain = engine.generate(prompts, 24)
    tree = Tree([[0], [1], [0, 0]], name="t4")
    for cost in (0.5, 0.0):
        clock = StepClock(engine, step=0.01)
        planned: set[int] = set()

        def plans(rows, realised=1.0, cost=cost, clock=clock, planned=planned):
            if slow == "every call" or rows not in planned:
                clock.now += cost
            planned.add(rows)
            return Plan(rows, tree, 1.5, 1.6, "test")

        auto = AutoSpeculation(plans, lambda t: MedusaProposer(heads, t), tree.size,
                               gate=AcceptanceGate(window=8, min_tau=1.0, retry_after_steps=1000))
        out = engine.generate(prompts, 24, policy=auto)
        assert [o.tokens for o in out.outputs] == [o.tokens for o in plain.outputs]
        if cost:
            assert auto.events and "paused" in auto.events[0]
            # plain probes, at most MIN_EVIDENCE speculative steps, then plain to the end
            assert auto.steps["speculative"] <= AcceptanceGate.MIN_EVIDENCE
            assert auto.choosing_seconds == pytest.approx(cost * (auto.steps["speculative"] if slow == "every call"
                                                                  else len(planned)))
        else:
            assert not auto.events and auto.steps["speculative"] > auto.steps["plain"]


def test_feature_planning_reads_the_curve_and_times_nothing(tmp_path, monkeypatch):
    """Auto mode with a feature head measures the head's draft passes with the target's curve, once per
    machine; planning for every batch size a generation passes through then runs no pass at all."""
    from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
    from medusa.runtime import feature, timing

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "TOKENS", [1, 2, 4, 8, 16])
    monkeypatch.setattr(calibrate, "REPEATS", 1)
    rt = tiny_runtime()
    c = rt.hf_model.config
    rt.feature = FeatureHead(FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size), rt.hf_model)
    rt.feature.directory = tmp_path
    (tmp_path / "eval.json").write_text(json.dumps({"rank_accuracy": [[0.7, 0.1, 0.05]] * 6}))
    auto = rt.auto(8, progress=False)
    cal = load_or_measure(rt, [1, 2, 4, 8], progress=False)
    drafted = cal.drafts[calibrate.draft_key(rt.feature)]
    assert {b for b, _ in drafted} == {1, 2, 4, 8} and {t for _, t in drafted} == set(calibrate.DRAFT_TOKENS)
    # The host work of whole draft steps, per batch size, for the proposer auto mode runs (retrieval grafted).
    hosted = cal.host[calibrate.host_key(rt)]
    assert calibrate.host_key(rt).endswith("+retrieval") and set(hosted) == {1, 2, 4, 8}
    assert all(f >= 0 and p >= 0 for f, p in hosted.values())

    def no_timing(*a, **k):
        raise AssertionError("planning timed a pass")

    monkeypatch.setattr(timing, "draft_pass_ms", no_timing)
    monkeypatch.setattr(timing, "draft_step_ms", no_timing)
    monkeypatch.setattr(timing, "target_pass_ms", no_timing)
    monkeypatch.setattr(calibrate, "measure_forward", no_timing)
    passes = rt.model.passes
    plans = [auto.plan(rows) for rows in range(8, 0, -1)]
    assert rt.model.passes == passes and all(p.batch == rows for p, rows in zip(plans, range(8, 0, -1)))
    # A second runtime of the same machine reads the drafts from the file, measuring nothing.
    again = tiny_runtime()
    again.feature = rt.feature
    assert feature.feature_auto(again, 8, progress=False).plan(5).reason == auto.plan(5).reason
    # Draft costs between measured batch sizes are interpolated in B.
    key = calibrate.draft_key(rt.feature)
    assert min(drafted[(4, 2)], drafted[(8, 2)]) <= cal.draft_ms(key, 6, 2) <= max(drafted[(4, 2)], drafted[(8, 2)])


# ---- the gain realised lately -------------------------------------------------------------------------


def test_realised_share_of_the_expected_gain():
    from medusa.runtime.auto import Realised

    r = Realised()
    for _ in range(Realised.MIN_ROWS - 1):
        r.add(2.0, 3.0)
    assert r.scale() == 1.0  # too few row-steps to judge
    r.add(2.0, 3.0)
    assert r.scale() == pytest.approx(0.5)  # half of the expected gain (tau - 1) delivered
    for _ in range(Realised.WINDOW):
        r.add(4.0, 3.0)  # more than expected: never planned above the heads' own accuracy
    assert r.scale() == 1.0
    for _ in range(Realised.WINDOW):
        r.add(1.0, 3.0)  # nothing accepted: the floor, not zero (plans stay comparable)
    assert r.scale() == pytest.approx(Realised.LOW)


def test_a_batch_judges_the_realised_share_by_its_row_steps():
    from medusa.runtime.auto import Realised

    r = Realised()
    r.add(1.5, 3.0, rows=Realised.MIN_ROWS // 2)
    assert r.scale() == 1.0  # half the evidence
    r.add(1.5, 3.0, rows=Realised.MIN_ROWS // 2)
    assert r.scale() == pytest.approx(0.2) and r.overall() == pytest.approx(0.25)  # two steps of 4 rows: enough
    # Steps weigh by their rows: one of 6 rows that delivered everything, one of 2 rows that delivered nothing.
    r = Realised()
    r.add(3.0, 3.0, rows=6)
    r.add(1.0, 3.0, rows=2)
    assert r.scale() == pytest.approx(0.8) and r.overall() == pytest.approx(0.75)


def test_a_draft_steps_host_work_is_priced_in_the_feature_plan():
    """Calibration.drafting: head passes plus the host work measured around them, per expansion; the plan
    picks a shallower tree, then none, as that work grows."""
    from medusa.runtime.feature import plan_shape

    acc = [[0.8, 0.1], [0.7, 0.1], [0.6, 0.1], [0.5, 0.1], [0.4, 0.1]]
    cal = curve(lambda b, t: 1.0 + 0.02 * (t - 1))
    cal.drafts = {"head": {(1, t): 0.05 for t in calibrate.DRAFT_TOKENS}}
    assert cal.drafting("head", "head+retrieval", 1, 3, 4) == pytest.approx(0.15 / 10)  # nothing measured: passes only
    cal.host = {"head+retrieval": {1: (0.5, 1.0)}}
    assert cal.drafting("head", "head+retrieval", 1, 3, 4) == pytest.approx((0.15 + 0.5 + 2.0) / 10)
    depth = []
    for host in [(0.0, 0.0), (0.0, 2.0), (30.0, 30.0)]:  # ms: fixed, per expansion (a plain step: 10 ms)
        cal.host = {"head+retrieval": {1: host}}
        p, shape = plan_shape(cal, acc, 1, functools.partial(cal.drafting, "head", "head+retrieval"))
        depth.append(shape.depth if shape is not None else 0)
        assert (shape is None) == (p.tree is None)
    assert depth[0] > depth[1] > 0 == depth[2]


def test_plans_shrink_when_the_heads_deliver_less_than_expected():
    cal = curve(lambda b, t: 1.0 + 0.08 * (t - 1))
    full = plan(cal, ACC, trees(), 1)
    half = plan(cal, ACC, trees(), 1, realised=0.5)
    assert full.tree is not None and half.tree is not None
    assert half.tree.size < full.tree.size and half.tau < full.tau  # the plan keeps the heads' own tau
    assert "50% of its gain realised" in half.reason
    assert plan(cal, ACC, trees(), 1, realised=0.2).tree is None  # a fifth of the gain pays for no tree here


def test_auto_mode_replans_from_what_its_steps_deliver():
    from medusa.runtime.auto import Realised

    cal = curve(lambda b, t: 1.0 + 0.08 * (t - 1))
    calls = []

    def plans(rows, realised=1.0):
        calls.append(realised)
        return plan(cal, ACC, trees(), rows, realised)

    auto = AutoSpeculation(plans, lambda t: _Marker(), 64, gate=AcceptanceGate(window=64, retry_after_steps=20))
    first = auto.plan(1).tree
    sizes = []
    for _ in range(40):
        p = auto.choose(1)
        if p is None:
            auto.observe(1, False, 1.0, 0.010)
            continue
        sizes.append(auto._chosen.tree.size)
        auto.observe(1, True, 1 + 0.5 * (auto._chosen.tau - 1), 0.010)  # half the expected gain, and cheap
    assert sizes[0] == first.size and sizes[-1] < first.size
    assert auto.realised.scale() == pytest.approx(0.5) and 0.5 in calls
    assert auto.realised.overall() == pytest.approx(0.5)  # over the whole run: what the evaluator predicts with
    # A share given from outside (the evaluator's, from a run) is rounded and bounded as the steps' own is.
    assert auto.plan(1, realised=0.04).tree is None and calls[-1] == pytest.approx(Realised.LOW)
    assert auto.plan(1, realised=1.3).tree.size == first.size
