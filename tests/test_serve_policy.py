"""The speculation policy and the server config, without a model."""

from __future__ import annotations

import json

import pytest

from medusa.errors import MedusaError
from medusa.runtime.gate import AcceptanceGate
from medusa.serve.config import PolicyConfig, load_config
from medusa.serve.policy import SpeculationPolicy


def policy(has_heads: bool = True, has_draft: bool = False, warm: bool = True, **kw) -> SpeculationPolicy:
    """A policy; `warm` feeds it the gate's plain probe steps in every batch bucket, as if it had already
    timed them."""
    p = SpeculationPolicy(PolicyConfig(**kw), has_heads, has_draft)
    if warm:
        for n in (1, 2, 4, 8, 16, 32, 64, 128):
            for _ in range(AcceptanceGate.PLAIN_PROBES):
                p.observe(n, False, 1.0, 0.01)
    return p


def modes(p: SpeculationPolicy, loads: list[int]) -> list[str]:
    return [p.decide(n, 0).mode for n in loads]


def test_hysteresis_between_watermarks():
    p = policy(high_watermark=8, low_watermark=4)
    # Rising load: on until 8; falling: stays off until 4; in the band the current state holds.
    assert modes(p, [1, 5, 7, 8, 7, 5, 4, 6, 7, 9]) == \
        ["heads"] * 3 + ["plain"] * 3 + ["heads"] * 3 + ["plain"]


def test_queued_requests_count_as_load():
    p = policy(high_watermark=8, low_watermark=4)
    assert p.decide(2, 10).mode == "plain"
    assert p.decide(2, 3).mode == "plain"  # load 5 is inside the band: still off
    assert p.decide(2, 0).mode == "heads"


def test_tree_follows_batch_size():
    p = policy(high_watermark=100, low_watermark=50, trees={1: "tree-64", 4: "tree-16", 16: "tree-8"})
    assert [p.decide(n, 0).tree for n in (1, 3, 4, 15, 16, 40)] == \
        ["tree-64", "tree-64", "tree-16", "tree-16", "tree-8", "tree-8"]


def test_trees_default_to_the_heads_own_unless_the_config_names_them():
    feature = {1: "dynamic-16x5x4"}
    p = SpeculationPolicy(PolicyConfig(mode="heads"), True, False, default_trees=feature)
    assert p.decide(1, 0).tree == "dynamic-16x5x4"
    assert SpeculationPolicy(PolicyConfig(mode="heads"), True, False).decide(1, 0).tree == "tree-8"
    named = SpeculationPolicy(PolicyConfig(mode="heads", trees={1: "dynamic-8x3"}), True, False,
                              default_trees=feature)
    assert named.decide(1, 0).tree == "dynamic-8x3"


def test_acceptance_gate_pauses_and_retries_with_backoff():
    p = policy(window=4, min_tau=2.0, retry_after_steps=10)
    for _ in range(4):
        d = p.decide(1, 0)
        assert d.mode == "heads"
        p.observe(1, d.mode != "plain", 1.1, 0.01)  # poor acceptance
    assert modes(p, [1] * 9) == ["plain"] * 9
    for _ in range(4):  # retried after the pause, still poor
        d = p.decide(1, 0)
        assert d.mode == "heads"
        p.observe(1, d.mode != "plain", 1.2, 0.01)
    # Second failure in a row: the pause doubles.
    assert modes(p, [1] * 19) == ["plain"] * 19
    assert p.decide(1, 0).mode == "heads"


def test_gate_waits_for_evidence_at_batch_size_one():
    """One row's tau per step is noisy (often 1, sometimes 3-4): a short run of misses is not proof."""
    p = policy(window=16, min_tau=1.3, retry_after_steps=10)
    for _ in range(4):
        p.observe(1, p.decide(1, 0).mode != "plain", 1.0, 0.01)
    assert p.decide(1, 0).mode == "heads"
    for tau in [1.0, 3.0, 1.0, 2.0, 1.0, 1.0, 4.0, 1.0]:
        p.observe(1, p.decide(1, 0).mode != "plain", tau, 0.01)
    assert p.decide(1, 0).mode == "heads"
    for _ in range(16):  # a whole window at tau 1: now the evidence is there
        d = p.decide(1, 0)
        if d.mode != "heads":
            break
        p.observe(1, d.mode != "plain", 1.0, 0.01)
    assert p.decide(1, 0).mode == "plain"


def test_one_slow_first_step_does_not_close_the_gate():
    """The first step at a new shape pays kernel set-up; the cost ratio must not carry that for long."""
    p = policy(window=16, min_tau=1.3, retry_after_steps=10)  # plain steps: 10 ms
    p.observe(1, p.decide(1, 0).mode != "plain", 1.5, 0.300)
    for i in range(20):
        d = p.decide(1, 0)
        assert d.mode == "heads", i
        p.observe(1, d.mode != "plain", 1.5 + (i % 2), 0.012)


def test_acceptance_gate_is_per_batch_bucket():
    p = policy(window=4, min_tau=1.5, retry_after_steps=50)
    for _ in range(4):
        p.observe(2, p.decide(2, 0).mode != "plain", 1.0, 0.01)
    assert p.decide(2, 0).mode == "plain"
    assert p.decide(1, 0).mode == "heads"  # a smaller bucket keeps its own record
    assert p.decide(4, 0).mode == "plain"  # a larger one inherits the failure


def test_gate_uses_the_measured_cost_of_a_speculative_step():
    """tau 2.0 clears min_tau 1.3 but not a speculative step that costs 3x a plain one."""
    p = policy(window=2, min_tau=1.3, retry_after_steps=50)
    p = policy(window=4, min_tau=1.3, retry_after_steps=50, warm=False)
    first = p.decide(4, 0)
    assert first.mode == "plain" and "probing" in first.reason  # a new bucket measures plain cost first
    p.observe(4, first.mode != "plain", 1.0, 0.010)
    for _ in range(3):
        d = p.decide(4, 0)
        assert d.mode == "heads"
        p.observe(4, d.mode != "plain", 2.0, 0.030)
    p.observe(4, p.decide(4, 0).mode != "plain", 2.0, 0.030)
    assert p.decide(4, 0).mode == "plain" and p.decide(8, 0).mode == "plain"  # larger buckets too
    assert p.decide(2, 0).mode == "plain"  # bucket 2 not probed yet
    # A cheap speculative step with the same tau keeps speculation on.
    q = policy(window=4, min_tau=1.3, retry_after_steps=50)
    for _ in range(8):
        q.observe(4, q.decide(4, 0).mode != "plain", 2.0, 0.015)
    assert q.decide(4, 0).mode == "heads"


def test_fixed_modes_ignore_load_and_acceptance():
    on = policy(mode="heads", window=1, min_tau=3.0)
    d = on.decide(64, 100)
    on.observe(64, d.mode != "plain", 1.0, 1.0)
    assert d.mode == "heads" and on.decide(64, 100).mode == "heads"
    assert policy(mode="plain").decide(1, 0).mode == "plain"


def test_the_policy_is_a_step_policy_choosing_its_own_proposers():
    """`choose` names the decision's proposer (plain when it is missing) and `recover` drops a failing one."""
    from types import SimpleNamespace

    p = policy(mode="heads", trees={1: "tree-8", 4: "tree-16"})
    heads = SimpleNamespace(span=9)  # the KV slots a step needs past a row's length (`Proposer.span`)
    p.serve({"tree-8": heads}, None)
    assert p.max_tree_size == 9
    assert p.choose(1) is heads and p.chosen == (p.last, heads)
    assert p.choose(4) is None and p.chosen[0].mode == "plain" and "unavailable" in p.chosen[0].reason
    p.choose(1)
    assert p.recover(heads, RuntimeError("boom")) and p.failures == 1
    assert p.chosen[0].mode == "plain" and p.chosen[0].reason == "heads failed" and p.chosen[1] is None


def test_without_any_proposer_dynamic_is_plain_and_fixed_is_an_error():
    assert policy(has_heads=False).decide(1, 0).mode == "plain"
    with pytest.raises(MedusaError, match="policy.mode 'heads' needs heads"):
        policy(has_heads=False, mode="heads")
    assert policy(has_heads=False, has_draft=True).decide(1, 0).mode == "draft"


def test_cost_model_sets_watermarks_kinds_and_trees(tmp_path):
    """(A file written before the heads' mode was named `heads` says `medusa`: read as heads.)"""
    f = tmp_path / "cost.json"
    f.write_text(json.dumps({"recommendation": {"1": "medusa", "2": "heads", "4": "draft", "8": "plain",
                                                "16": "plain"},
                             "best_tree": {"1": 64, "2": "tree-32"}, "other": {"ignored": True}}))
    p = policy(has_draft=True, cost_model=str(f))
    assert (p.high, p.low) == (8, 4)
    got = [(d.mode, d.tree) for d in (p.decide(n, 0) for n in (1, 2, 4, 8, 6, 4))]
    assert got == [("heads", "tree-64"), ("heads", "tree-32"), ("draft", None), ("plain", None),
                   ("plain", None), ("draft", None)]
    # Without a draft model the speculative kind falls back to the heads.
    assert policy(cost_model=str(f)).decide(4, 0).mode == "heads"


def test_cost_model_inside_an_eval_report(tmp_path):
    f = tmp_path / "report.json"
    f.write_text(json.dumps({"results": [], "cost_model": {"recommendation": {"1": "heads", "4": "plain"},
                                                           "best_tree": {"1": "tree-16"}}}))
    p = policy(cost_model=str(f))
    assert (p.high, p.low, p.decide(1, 0).tree) == (4, 1, "tree-16")


def test_cost_model_that_never_speculates(tmp_path):
    f = tmp_path / "cost.json"
    f.write_text(json.dumps({"recommendation": {"1": "plain", "8": "plain"}}))
    p = policy(cost_model=str(f))
    assert modes(p, [1, 1, 1]) == ["plain"] * 3


@pytest.mark.parametrize("content, words", [
    ("{", "not valid JSON"),
    ('{"best_tree": {}}', "no 'recommendation'"),
    ('{"recommendation": {"one": "heads"}}', "not a batch size"),
    ('{"recommendation": {"1": "turbo"}}', "expected heads|draft|plain"),
])
def test_bad_cost_model_names_the_problem(tmp_path, content, words):
    f = tmp_path / "cost.json"
    f.write_text(content)
    with pytest.raises(MedusaError, match="policy.cost_model") as exc:
        policy(cost_model=str(f))
    assert words in str(exc.value)


def test_missing_cost_model_file():
    with pytest.raises(MedusaError, match="does not exist"):
        policy(cost_model="/no/such/cost.json")


@pytest.mark.parametrize("yaml_text, key", [
    ("max_batch: 0\n", "max_batch"),
    ("prot: 80\n", "prot"),
    ("policy:\n  mode: sometimes\n", "policy.mode"),
    ("policy:\n  low_watermark: 9\n  high_watermark: 3\n", "low_watermark"),
    ("queue_timeout_s: -1\n", "queue_timeout_s"),
    ("- just\n- a list\n", "mapping"),
])
def test_bad_config_names_the_key(tmp_path, yaml_text, key):
    f = tmp_path / "serve.yaml"
    f.write_text(yaml_text)
    with pytest.raises(MedusaError) as exc:
        load_config(str(f))
    assert key in str(exc.value)


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("port: 9000\nmax_batch: 4\n")
    cfg = load_config(str(f), {"port": 9100, "model": None})
    assert (cfg.port, cfg.max_batch, cfg.model) == (9100, 4, "default")


def test_shipped_configs_are_valid():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parent.parent / "configs" / "serve").glob("*.yaml"))
    assert files
    for f in files:
        load_config(str(f))


def test_engine_threads_leave_a_core(monkeypatch):
    import torch

    from medusa.serve.cli import set_engine_threads

    before = torch.get_num_threads()
    try:
        set_engine_threads(load_config(None, {"threads": 1, "device": "cpu"}))
        assert torch.get_num_threads() == 1
        monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(3)), raising=False)
        set_engine_threads(load_config(None, {"device": "cpu"}))
        assert torch.get_num_threads() == 2  # three cores: two for the engine, one for HTTP and clients
    finally:
        torch.set_num_threads(before)
    with pytest.raises(MedusaError, match="threads"):
        load_config(None, {"threads": 0})


def test_calibrated_plans_set_watermarks_and_trees():
    """The auto mode's plans (speculate with a tree at 1-2 rows, plain from 4) become the dynamic
    policy's defaults when no cost-model file is given."""
    from medusa.runtime.auto import Plan
    from medusa.decoding.trees.tree import Tree
    from medusa.serve.policy import CostModel

    big, small = Tree([[0], [1], [0, 0]], name="auto-3"), Tree([[0]], name="auto-1")
    plans = [Plan(1, big, 1.4, 1.6, ""), Plan(2, small, 1.1, 1.3, ""), Plan(4, None, 1.0, 1.0, ""),
             Plan(8, None, 1.0, 1.0, "")]
    p = SpeculationPolicy(PolicyConfig(), has_heads=True, has_draft=False, calibrated=CostModel.from_plans(plans))
    for n in (1, 2, 4, 8):
        p.observe(n, False, 1.0, 0.01)
    assert (p.high, p.low) == (4, 2)
    assert [p.decide(n, 0).tree for n in (1, 2)] == ["auto-3", "auto-1"]
    assert p.decide(4, 0).mode == "plain"
    # A cost-model file, when given, decides instead.
    assert SpeculationPolicy(PolicyConfig(), True, False, calibrated=None).high == PolicyConfig().high_watermark


def test_every_response_outcome_has_a_series_from_the_start():
    from medusa.serve.errors import BY_CODE, OUTCOMES, outcome_of
    from medusa.serve.metrics import Metrics

    labels = {outcome_of(s, c) for s in range(200, 600) for c in (None, *(code for _, code in BY_CODE))}
    assert labels == set(OUTCOMES)
    text = Metrics().render().decode()
    assert all(f'outcome="{o}"' in text for o in OUTCOMES)


def test_the_heads_earlier_mode_name_is_read(caplog):
    from medusa.runtime.proposers import _renamed

    _renamed.cache_clear()
    with caplog.at_level("WARNING", logger="medusa"):
        assert PolicyConfig(mode="medusa").mode == "heads"
    assert any("'medusa' is spelled 'heads' now" in r.getMessage() for r in caplog.records)
