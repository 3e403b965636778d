"""The server drafting with feature heads (EAGLE-style), with Medusa heads over dynamic trees and with retrieval
alone (no heads): under the dynamic policy, with log-probabilities, the trees each kind of head takes, and no
second prefill."""

from __future__ import annotations

import httpx
import pytest

from medusa.decoding.proposers.feature_proposer import FeatureProposer
from medusa.decoding.proposers import StaticProposer
from medusa.errors import MedusaError
from medusa.serve.app import create_app
from medusa.serve.config import PolicyConfig, ServeConfig
from test_feature_heads import random_head
from test_serve import _metric, alone, check_concurrent_streams, client, serve, tiny_runtime

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# calibrate: false: the trees named here, not this machine's plans. Speculation comes back at 4 rows, so the
# tail of the 16 streams has several speculative steps after each batch bucket's plain probe step.
DYNAMIC = {"mode": "dynamic", "high_watermark": 6, "low_watermark": 4, "min_tau": 1.0, "calibrate": False,
           "trees": {1: "dynamic-8x3", 2: "dynamic-4x2x2"}}


@pytest.fixture(scope="module")
def feature_rt(tokenizer):
    """The tiny random runtime with a random feature head instead of Medusa heads."""
    rt = tiny_runtime(tokenizer, seed=3, heads=False)
    rt.feature = random_head(rt.hf_model, seed=3)
    return rt


@pytest.fixture
def fill_calls(monkeypatch):
    """Counts the proposer's extra target passes over positions whose features it never saw."""
    calls = []
    original = FeatureProposer._fill_features
    monkeypatch.setattr(FeatureProposer, "_fill_features", lambda self, *a: calls.append(1) or original(self, *a))
    return calls


def test_feature_heads_under_the_dynamic_policy(feature_rt, tokenizer, fill_calls):
    """Concurrent streams over more requests than rows: the policy switches between the feature heads and
    plain decoding with load, every greedy output equals its prompt decoded alone, and the features of
    prompts and of plain steps were kept as they were computed (no second pass over any of them)."""
    with serve(feature_rt, policy=DYNAMIC, max_queue=64) as url:
        check_concurrent_streams(url, feature_rt, tokenizer, 16)
    assert not fill_calls


def test_logprobs_with_feature_heads_drafting(feature_rt):
    """A request for log-probabilities keeps speculation on; they equal plain decoding's."""
    kw = dict(model="default", prompt="Describe a quiet harbour town at dusk", max_tokens=12, logprobs=3)
    with serve(feature_rt, policy={"mode": "heads", "trees": {1: "dynamic-8x3"}}) as url:
        spec = client(url).completions.create(**kw).choices[0].logprobs
        steps = _metric(httpx.get(url + "/metrics", timeout=10).text, 'medusa_steps_total{mode="heads"}')
    with serve(feature_rt, policy={"mode": "plain"}) as url:
        plain = client(url).completions.create(**kw).choices[0].logprobs
    assert steps > 0
    assert spec.tokens == plain.tokens
    assert spec.token_logprobs == pytest.approx(plain.token_logprobs, abs=1e-5)
    assert [sorted(t) for t in spec.top_logprobs] == [sorted(t) for t in plain.top_logprobs]


def test_trees_for_each_kind_of_head(feature_rt, rt):
    """Feature heads default to a dynamic tree and refuse static ones, naming the key; Medusa heads take
    dynamic trees by name beside static ones."""
    server = create_app(ServeConfig(dtype="fp32", policy={"mode": "heads", "calibrate": False}),
                        feature_rt).state.server
    assert list(server.policy.heads) == ["dynamic-16x5x8"]
    with pytest.raises(MedusaError, match="policy.trees: feature heads grow dynamic trees"):
        create_app(ServeConfig(dtype="fp32", policy={"trees": {1: "tree-8"}, "calibrate": False}),
                   feature_rt)
    server = create_app(ServeConfig(dtype="fp32", policy={"trees": {1: "tree-8", 4: "dynamic-8x3"},
                                                                "calibrate": False}), rt).state.server
    assert sorted(server.policy.heads) == ["dynamic-8x3", "tree-8"]
    # one tree for every row (a static proposer) and a tree per row (the heads' dynamic tree, retrieval grafted)
    assert isinstance(server.policy.heads["tree-8"], StaticProposer)
    assert not isinstance(server.policy.heads["dynamic-8x3"], StaticProposer)
    with pytest.raises(MedusaError, match="policy.trees"):
        create_app(ServeConfig(dtype="fp32", policy={"trees": {1: "dynamic-99x2"}, "calibrate": False}), rt)


def test_medusa_heads_over_a_dynamic_tree_match_decoding_alone(rt, tokenizer):
    prompts = [("Name a fruit", 9), ("Describe a quiet harbour town at dusk", 17), ("Hi", 5)]
    with serve(rt, policy={"mode": "heads", "trees": {1: "dynamic-8x3"}}) as url:
        c = client(url)
        got = [c.completions.create(model="default", prompt=p, max_tokens=m).choices[0].text for p, m in prompts]
        steps = _metric(httpx.get(url + "/metrics", timeout=10).text, 'medusa_steps_total{mode="heads"}')
    assert got == [alone(rt, tokenizer(p)["input_ids"], m)[0] for p, m in prompts]
    assert steps > 0


def test_retrieval_alone_without_heads(tokenizer):
    """A model without heads still speculates: retrieval trees (`retrieval:N`, named as the mode, the default
    without heads; the old spellings `suffix-N` and `suffix:N` are read as such), every greedy stream equal to its prompt
    decoded alone; a heads' tree name is refused, naming the key."""
    bare = tiny_runtime(tokenizer, seed=4, heads=False)
    server = create_app(ServeConfig(dtype="fp32", policy={"mode": "heads"}), bare).state.server
    assert list(server.policy.heads) == ["retrieval:16"]
    assert PolicyConfig(trees={1: "suffix-8"}).trees == {1: "retrieval:8"}
    assert PolicyConfig(trees={1: "suffix:8"}).trees == {1: "retrieval:8"}
    with serve(bare, policy={"mode": "heads", "trees": {1: "suffix-8"}}, max_queue=64) as url:
        check_concurrent_streams(url, bare, tokenizer, 8)
        steps = _metric(httpx.get(url + "/metrics", timeout=10).text, 'medusa_steps_total{mode="heads"}')
    assert steps > 0
    with pytest.raises(MedusaError, match="policy.trees: 'tree-8': without heads the trees are retrieval's"):
        create_app(ServeConfig(dtype="fp32", policy={"trees": {1: "tree-8"}, "calibrate": False}), bare)
