"""Cost model: the analytic formula, the latency fit, predictions and the crossover command."""

import json

import pytest

from medusa.cli import main
from medusa.eval.costmodel import (alpha_from_acceptance, analytic_speedup, crossover, expected_accepted, pays,
                                   predict)
from medusa.runtime.timing import Latency, LatencyFit
from medusa.errors import MedusaError


def test_expected_accepted_matches_the_series():
    for alpha in (0.0, 0.3, 0.8, 0.999):
        for k in (0, 1, 4, 7):
            assert expected_accepted(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))
    assert expected_accepted(1.0, 5) == 6.0


# (alpha, K, E = 1 + alpha + ... + alpha^K, break-even cost c* = (E - 1) / K), worked out by hand.
BREAK_EVEN = [(0.6, 4, 2.3056, 0.3264), (0.8, 2, 2.44, 0.72), (0.3, 1, 1.3, 0.3),
              (0.95, 7, 6.73159137421875, 0.8187987677455357)]


@pytest.mark.parametrize("alpha, k, e, c_star", BREAK_EVEN)
def test_speculation_pays_exactly_when_the_formula_says(alpha, k, e, c_star):
    assert expected_accepted(alpha, k) == pytest.approx(e)
    assert analytic_speedup(alpha, k, c_star) == pytest.approx(1.0)
    assert pays(analytic_speedup(alpha, k, c_star * 0.99))
    assert not pays(analytic_speedup(alpha, k, c_star * 1.01))
    assert analytic_speedup(alpha, k, 0.0) == pytest.approx(e)


def test_never_pays_with_zero_acceptance():
    assert not pays(analytic_speedup(0.0, 4, 0.0))  # E = 1, no cost: exactly break-even, not a win
    assert all(not pays(analytic_speedup(0.0, k, 0.1)) for k in range(1, 9))


def test_alpha_reproduces_the_measured_expectation():
    acc = [0.8, 0.6, 0.5, 0.4]
    measured = 1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.5 + 0.8 * 0.6 * 0.5 * 0.4
    assert expected_accepted(alpha_from_acceptance(acc), 4) == pytest.approx(measured, rel=1e-6)
    assert alpha_from_acceptance([]) == 0.0


def test_latency_fit_recovers_a_linear_model():
    truth = LatencyFit(5.0, 0.5, 0.02)
    grid = [(b, t, truth(b, t)) for b in (1, 2, 4, 8) for t in (1, 4, 16)]
    fit = LatencyFit.fit(grid)
    assert (fit.a, fit.b, fit.c) == pytest.approx((5.0, 0.5, 0.02), rel=1e-6)
    assert fit.max_rel_error < 1e-6
    lat = Latency(grid)
    assert lat(2, 4) == truth(2, 4) and lat(32, 2) == pytest.approx(truth(32, 2))
    with pytest.raises(MedusaError, match="at least 3"):
        LatencyFit.fit(grid[:2])


def synthetic_model():
    """Target: 40 ms fixed + compute that grows with B*T; speculation must stop paying at large B."""
    target = LatencyFit(40.0, 0.1, 0.6)
    draft = LatencyFit(8.0, 0.05, 0.1)
    sizes, tokens = [1, 2, 4, 8, 16, 32, 64], [1, 2, 3, 5, 9, 17]
    return {"latency_ms": {"target": Latency([(b, t, target(b, t)) for b in sizes for t in tokens]).to_dict(),
                           "draft": Latency([(b, t, draft(b, t)) for b in sizes for t in (1, 2, 4)]).to_dict(),
                           "heads": {str(b): 0.5 + 0.05 * b for b in sizes}},
            "acceptance": {"heads": {"tree-16": {"tau": 2.6, "tree_size": 17},
                                      "tree-8": {"tau": 2.3, "tree_size": 9}},
                           "draft": {"k": 4, "tau": 2.4, "alpha": alpha_from_acceptance([0.6, 0.5, 0.45, 0.4])}}}, sizes


def test_predictions_and_crossover():
    model, sizes = synthetic_model()
    out = predict(model, sizes)
    for b in sizes:
        row = out["predicted"][str(b)]
        t1 = 40.0 + 0.1 * b + 0.6 * b
        t17 = 40.0 + 0.1 * b + 0.6 * b * 17
        by_tree = row["heads_by_tree"]
        assert by_tree["tree-16"] == pytest.approx(2.6 * t1 / (t17 + 0.5 + 0.05 * b))
        assert row["heads"] == max(by_tree.values()) and out["best_tree"][str(b)] == row["heads_tree"]
        rec = out["recommendation"][str(b)]
        best = max(row.get("heads", 0), row.get("draft", 0))
        assert (rec == "plain") == (best <= 1.0)
    assert out["recommendation"]["1"] == "heads" and out["recommendation"]["64"] == "plain"
    cross = out["crossover"]["heads"]
    assert cross is not None and out["predicted"][str(cross)]["heads"] <= 1.0
    before = [b for b in sizes if b < cross]
    assert all(out["predicted"][str(b)]["heads"] > 1.0 for b in before)
    # The smaller tree wins once verification costs real compute.
    assert out["best_tree"]["1"] == "tree-16" and out["best_tree"][str(sizes[-1])] == "tree-8"


def test_feature_head_prediction_and_crossover():
    """A feature head's dynamic tree of 4 nodes, depth 2: one catch-up pass, one expansion, a 5-token
    verification. Hand-worked at B = 1 and 64; predicted beside Medusa, never the server's recommendation."""
    model, sizes = synthetic_model()
    model["acceptance"]["feature"] = {"tau": 1.9, "nodes": 4, "depth": 2}
    model["latency_ms"]["feature_draft"] = {str(b): {"catch_up": 2.0 + 0.1 * b, "expand": 1.0 + 0.1 * b}
                                            for b in sizes}
    out = predict(model, sizes)
    t1, t5 = 40.0 + 0.1 + 0.6, 40.0 + 0.1 + 0.6 * 5
    assert out["predicted"]["1"]["feature"] == pytest.approx(1.9 * t1 / (t5 + 2.1 + 1.1))
    t1, t5 = 40.0 + 6.4 + 0.6 * 64, 40.0 + 6.4 + 0.6 * 64 * 5
    assert out["predicted"]["64"]["feature"] == pytest.approx(1.9 * t1 / (t5 + 8.4 + 7.4))
    cross = out["crossover"]["feature"]
    assert cross is not None and out["predicted"][str(cross)]["feature"] <= 1.0
    assert all(out["predicted"][str(b)]["feature"] > 1.0 for b in sizes if b < cross)
    assert set(out["recommendation"].values()) <= {"heads", "draft", "plain"}
    del model["latency_ms"]["feature_draft"]
    assert "feature" not in predict(model, sizes)["predicted"]["1"]


def test_crossover_helper():
    assert crossover({1: 1.8, 4: 1.2, 8: 0.9, 16: 1.1}) == 8
    assert crossover({1: 1.5, 2: 1.01}) is None
    assert crossover({1: 1.0}) == 1


def test_cli_scalar_inputs(capsys):
    # alpha 0.8, K 4: E = 3.3616; c* = 0.5904. Draft at 0.5x pays at B=1, at 0.7x it does not.
    rc = main(["crossover", "--target-ms", "10,10", "--draft-ms", "5,7", "--alpha", "0.8", "--k", "4",
               "--batch-sizes", "1,8", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["batch_size"]: r for r in data["rows"]}
    assert rows[1]["draft"] == pytest.approx(3.3616 / 3.0) and rows[1]["regime"] == "draft"
    assert rows[8]["draft"] == pytest.approx(3.3616 / 3.8) and rows[8]["regime"] == "plain"
    assert data["crossover"]["draft"] == 8


def test_cli_picks_the_best_k_and_prints_a_table(capsys):
    assert main(["crossover", "--target-ms", "20", "--draft-ms", "1", "--alpha", "0.9", "--k", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert "regime" in out and " draft" in out and "pays at every batch size" in out


def test_cli_reads_a_cost_model(tmp_path, capsys):
    model, sizes = synthetic_model()
    path = tmp_path / "cm.json"
    path.write_text(json.dumps({"cost_model": predict(model, sizes)}))
    assert main(["crossover", "--cost-model", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["batch_size"] for r in data["rows"]] == sizes
    assert data["rows"][0]["regime"] == "heads" and data["rows"][-1]["regime"] == "plain"


@pytest.mark.parametrize("argv, message", [
    (["--target-ms", "10"], "missing --draft-ms, --alpha, --k"),
    (["--target-ms", "10", "--draft-ms", "1", "--alpha", "1.5", "--k", "4"], "--alpha"),
    (["--target-ms", "10,20", "--draft-ms", "1", "--alpha", "0.5", "--k", "4", "--batch-sizes", "1,2,4"],
     "--target-ms: 2 values for 3 batch sizes"),
    (["--target-ms", "0", "--draft-ms", "1", "--alpha", "0.5", "--k", "4"], "must be positive"),
    (["--cost-model", "/no/such.json"], "--cost-model"),
])
def test_cli_bad_input(capsys, argv, message):
    rc = main(["crossover", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_latency_fit_keeps_coefficients_non_negative():
    # Noisy timings in which the per-token slope looks negative: the fit must not predict cheaper big passes.
    grid = [(1, 1, 20.0), (1, 2, 19.0), (1, 4, 18.5), (2, 1, 22.0), (2, 2, 21.5), (2, 4, 21.0)]
    fit = LatencyFit.fit(grid)
    assert min(fit.a, fit.b, fit.c) >= 0
    assert fit(64, 64) >= fit(1, 1)


def test_measured_speedups_decide_where_they_exist():
    from medusa.eval.cost_inputs import apply_measurements

    model = {"recommendation": {"1": "plain", "2": "plain", "64": "heads"}, "best_tree": {"1": "tree-16"}}
    results = [
        {"method": "plain", "kind": "plain", "batch_size": 1, "speedup_vs_plain": 1.0},
        {"method": "heads:tree-8", "kind": "heads", "batch_size": 1, "speedup_vs_plain": 1.19, "tree": "tree-8"},
        {"method": "draft", "kind": "draft", "batch_size": 1, "speedup_vs_plain": 0.87},
        {"method": "heads:tree-8", "kind": "heads", "batch_size": 2, "speedup_vs_plain": 0.96, "tree": "tree-8"},
        {"method": "hf", "kind": "hf", "batch_size": 2, "speedup_vs_plain": 1.5},  # an anchor, not a mode
    ]
    out = apply_measurements(model, results)
    assert out["recommendation"] == {"1": "heads", "2": "plain", "64": "heads"}
    assert out["best_tree"]["1"] == "tree-8"
    assert out["recommendation_source"] == {"1": "measured", "2": "measured", "64": "predicted"}
    assert out["predicted_recommendation"] == {"1": "plain", "2": "plain", "64": "heads"}
    assert out["fastest"]["1"]["measured"] == "heads:tree-8" and out["fastest"]["2"]["measured"] == "plain"


def test_the_recommendation_weighs_every_method_the_engine_ran():
    from medusa.eval.cost_inputs import apply_measurements

    # Lookup and the feature head are neither Medusa nor a draft, yet they can be the fastest: the fastest
    # method is named, and the server's mode for it is its own proposer ("heads").
    model = {"recommendation": {"1": "plain", "4": "plain"}, "best_tree": {},
             "predicted_by_method": {"1": {"lookup": 1.3, "feature:planned": 1.5}, "4": {"lookup": 0.9}}}
    results = [
        {"method": "plain", "kind": "plain", "batch_size": 1, "speedup_vs_plain": 1.0},
        {"method": "lookup", "kind": "lookup", "batch_size": 1, "speedup_vs_plain": 1.2},
        {"method": "feature:planned", "kind": "feature", "batch_size": 1, "speedup_vs_plain": 1.4},
        {"method": "draft", "kind": "draft", "batch_size": 1, "speedup_vs_plain": 1.1},
        {"method": "plain", "kind": "plain", "batch_size": 4, "speedup_vs_plain": 1.0},
        {"method": "draft", "kind": "draft", "batch_size": 4, "speedup_vs_plain": 1.05},
        {"method": "lookup", "kind": "lookup", "batch_size": 4, "speedup_vs_plain": 0.97},
    ]
    out = apply_measurements(model, results)
    assert out["fastest"]["1"] == {"measured": "feature:planned", "measured_speedup": 1.4,
                                   "predicted": "feature:planned", "predicted_speedup": 1.5}
    assert out["fastest"]["4"]["measured"] == "draft" and out["fastest"]["4"]["predicted"] == "plain"
    assert out["recommendation"] == {"1": "heads", "4": "draft"}
    assert out["predicted_recommendation"] == {"1": "heads", "4": "plain"}


def test_each_method_is_predicted_from_its_run_at_the_smallest_batch():
    """A synthetic machine that follows the step model exactly: runs generated from it at every batch size,
    the prediction from the batch-1 run alone must give every other size's speedup, and the crossover."""
    from medusa.eval.step_model import predict_runs
    from medusa.runtime.timing import Latency

    def lat(b, t):
        return 10 + 1.0 * b + 0.5 * b * t

    sizes = [1, 2, 4, 8, 16, 32]
    target = Latency([(b, t, lat(b, t)) for b in sizes for t in (1, 2, 4, 8, 16, 32)])
    prompt, steps_plain, tau, nodes, extra = 20, 64, 2.0, 9.5, 3.0  # a fractional tree: a dynamic one
    drafting = {b: 1 + 0.2 * b for b in sizes}

    def run(b, step, steps):
        prefill = lat(b, prompt)
        return {"seconds": (prefill + steps * step) / 1000, "steps": steps, "batches": 1,
                "prompt_tokens": prompt * b}

    overhead = {b: 2 + 0.1 * b for b in sizes}
    plain = {b: run(b, lat(b, 1) + overhead[b], steps_plain) for b in sizes}

    def spec_step(b):  # nodes between grid points: the grid is linear in T, so interpolation is exact
        return lat(b, nodes) + drafting[b] + overhead[b] + extra

    truth = {b: plain[b]["seconds"] / run(b, spec_step(b), steps_plain / tau)["seconds"] for b in sizes}
    got = predict_runs(target, plain, {"batch": 1, "run": run(1, spec_step(1), steps_plain / tau),
                                       "tokens_per_pass": nodes}, drafting, sizes)
    assert set(got) == set(sizes)
    for b in sizes:
        assert abs(got[b] - truth[b]) < 1e-9 * truth[b], (b, got[b], truth[b])
    assert got[1] > 1 > got[32]  # pays alone, not in a big batch
    # Without the method's draft curve its batch-1 draft cost stays in `extra`, constant: a worse guess
    # than the curve, but still anchored at batch 1.
    flat = predict_runs(target, plain, {"batch": 1, "run": run(1, spec_step(1), steps_plain / tau),
                                        "tokens_per_pass": nodes}, None, sizes)
    assert abs(flat[1] - truth[1]) < 1e-9 and flat[32] > truth[32]


def test_auto_mode_is_predicted_by_its_plan_at_each_batch_size():
    from medusa.eval.step_model import planned, predict_runs
    from medusa.runtime.timing import Latency

    sizes = [1, 2, 4, 8]
    target = Latency([(b, t, 10 + b + 0.5 * b * t) for b in sizes for t in (1, 2, 4, 8, 16, 32)])
    plain = {b: {"seconds": (64 * (11 + 1.5 * b)) / 1000, "steps": 64, "batches": 1, "prompt_tokens": 0}
             for b in sizes}
    # Planned: a 16-node tree alone, 8 nodes at 2 rows, a chain of 2 at 4, plain decoding at 8.
    plans = {1: {"tokens": 17, "tau": 3.0, "draft": 2.0}, 2: {"tokens": 9, "tau": 2.5, "draft": 2.0},
             4: {"tokens": 3, "tau": 1.8, "draft": 1.0}, 8: None}
    # The run at batch 1 measured half its steps speculative (trees of 17 tokens in half the steps) and tau 2.
    scaled = planned(plans, 1, tau=2.0, tokens=9.0)
    assert scaled[8] is None and scaled[1]["tokens"] == 9.0 and scaled[1]["steps"] == 1.0
    assert scaled[2]["tokens"] == 5.0 and abs(scaled[2]["steps"] - 2.0 / 1.75) < 1e-12  # tau 1 + 1 * 0.75
    run = {"seconds": plain[1]["seconds"] * 0.6, "steps": 32, "batches": 1, "prompt_tokens": 0}
    got = predict_runs(target, plain, {"batch": 1, "run": run, "tokens_per_pass": 9.0, "plan": scaled}, None, sizes)
    assert abs(got[1] - 1 / 0.6) < 1e-9  # the anchor reproduces its measurement
    assert got[8] == 1.0  # planned plain: it does not pay there
    assert got[1] > got[2] > got[4]
    # Plans weighed by a realised share smaller than the run's first steps assumed: the run at batch 1 used
    # trees of 9 tokens on average where the weighed plan has 5: every step counts as speculative, no more.
    weighed = {1: {"tokens": 5, "tau": 2.0, "draft": 1.0}, 2: {"tokens": 3, "tau": 1.6, "draft": 1.0}, 4: None,
               8: None}
    scaled = planned(weighed, 1, tau=2.0, tokens=9.0)
    assert scaled[1]["tokens"] == 5.0 and scaled[2]["tokens"] == 3.0 and scaled[4] is None


def test_cli_reads_an_evaluations_own_predictions(tmp_path, capsys):
    model, sizes = synthetic_model()
    model = predict(model, sizes)
    model["predicted_by_method"] = {str(b): {"lookup": 1.4 / b, "feature:planned": 2.0 / b} for b in sizes}
    model["crossover_by_method"] = {"lookup": 2, "feature:planned": 2}
    model["fastest"] = {str(b): {"predicted": "feature:planned" if b == 1 else "plain"} for b in sizes}
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"cost_model": model}))
    assert main(["crossover", "--cost-model", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["crossover"] == {"lookup": 2, "feature:planned": 2}
    assert data["rows"][0]["methods"] == {"lookup": 1.4, "feature:planned": 2.0}
    assert data["rows"][0]["fastest"] == "feature:planned" and data["rows"][1]["fastest"] == "plain"
    assert main(["crossover", "--cost-model", str(path)]) == 0
    assert "feature:planned stops paying at batch size 2" in capsys.readouterr().out
