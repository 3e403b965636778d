"""Every proposer spec builds its proposer on a tiny random model; bad specs say what was wrong in one line."""

import pytest
import torch

from conftest import accepted_drafts, mixed_prompts, tiny_model
from medusa.decoding.proposers.draft import DraftModel, DraftProposer
from medusa.decoding.trees.dynamic_tree import MedusaDynamicProposer, TreeShape
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
from medusa.decoding.proposers.feature_proposer import FeatureProposer
from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.decoding.proposers.lookup import LookupProposer
from medusa.decoding.proposers import MedusaProposer
from medusa.decoding.target.transformer import Transformer
from medusa.errors import MedusaError
from medusa.runtime import Runtime
from medusa.runtime.proposers import MODES, ProposerSpec, build_proposer


V = 13  # a small vocabulary: the text repeats itself and random drafts are accepted, so decoding tests test them


def tiny_runtime(heads: bool = True) -> Runtime:
    model = tiny_model(vocab=V)
    medusa = None
    if heads:
        torch.manual_seed(0)
        medusa = MedusaHeads(HeadsConfig(model.config.hidden_size, model.config.vocab_size, 4, 1)).attach(model)
    transformer = Transformer(model)
    return Runtime(model, None, transformer, Engine(transformer, eos_token_ids=None), medusa)


@pytest.fixture(scope="module")
def rt():
    return tiny_runtime()


@pytest.fixture(scope="module")
def feature_dir(rt, tmp_path_factory):
    d = tmp_path_factory.mktemp("feature")
    c = rt.hf_model.config
    FeatureHead(FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size), rt.hf_model).save(d)
    return d


def test_plain_is_no_proposer(rt):
    assert build_proposer(rt, "plain") is None


def test_medusa_static_chain_and_dynamic_trees(rt):
    p = build_proposer(rt, "heads")
    assert isinstance(p, MedusaProposer) and p.tree.name == "tree-8"
    assert build_proposer(rt, "heads", "tree-16").tree.name == "tree-16"
    chain = build_proposer(rt, "heads", "chain-3")
    assert chain.tree.nodes == [(0,), (0, 0), (0, 0, 0)]
    assert build_proposer(rt, "heads", [[0], [1]]).tree.size == 3
    dyn = build_proposer(rt, "heads", "dynamic-8x3")
    assert isinstance(dyn, MedusaDynamicProposer) and dyn.depth == 3
    assert isinstance(rt.proposer("heads", "chain-2"), MedusaProposer)


def test_feature_heads_from_a_directory(rt, feature_dir):
    p = build_proposer(rt, f"feature:{feature_dir}", "dynamic-6x3")
    assert isinstance(p, FeatureProposer) and p.shape == TreeShape(6, 3, 6)


def test_draft_and_lookup(rt):
    draft = build_proposer(rt, "draft:layers:1", k=3)
    assert isinstance(draft, DraftProposer) and draft.tree.size == 4 and len(draft.transformer.layers) == 1
    assert isinstance(draft.model, DraftModel) and draft.model.vocab is None
    lookup = build_proposer(rt, "lookup:5")
    assert isinstance(lookup, LookupProposer) and lookup.k == 5
    assert build_proposer(rt, "lookup").k == 8


def test_built_proposers_decode_like_plain(rt, feature_dir):
    prompts = mixed_prompts(3, vocab=V, seed=7)
    plain = rt.engine.generate(prompts, 10)
    for spec, tree in [("heads", "chain-3"), ("heads", "dynamic-6x2"), ("draft:layers:1", None), ("lookup:4", None),
                       (f"feature:{feature_dir}", "dynamic-6x3")]:
        gen = rt.engine.generate(prompts, 10, build_proposer(rt, spec, tree))
        assert [o.tokens for o in gen.outputs] == [o.tokens for o in plain.outputs], spec
        assert accepted_drafts(gen.stats) > 0, spec  # its drafts were accepted


@pytest.mark.parametrize("text, kind, arg, retrieval", [
    ("plain", "plain", None, False), ("heads+retrieval", "heads", None, True),
    ("feature:/a/b+retrieval", "feature", "/a/b", True), ("draft:layers:2", "draft", "layers:2", False),
    ("lookup:5", "lookup", "5", False), ("retrieval", "retrieval", None, False), ("retrieval:8", "retrieval", "8", False),
])
def test_specs_parse_once_and_print_back(text, kind, arg, retrieval):
    spec = ProposerSpec.parse(text)
    assert (spec.kind, spec.arg, spec.retrieval) == (kind, arg, retrieval)
    assert str(spec) == text and ProposerSpec.parse(spec) is spec and spec.mode in MODES


@pytest.mark.parametrize("old, new", [("suffix", "retrieval"), ("suffix:8", "retrieval:8"),
                                      ("medusa+suffix", "heads+retrieval"), ("feature:/a/b+suffix", "feature:/a/b+retrieval"),
                                      ("medusa", "heads"), ("medusa+retrieval", "heads+retrieval")])
def test_earlier_spellings_are_read_with_one_warning(old, new, caplog):
    from medusa.runtime.proposers import _renamed

    _renamed.cache_clear()
    with caplog.at_level("WARNING", logger="medusa"):
        spec = ProposerSpec.parse(old, key="--mode")
        assert str(ProposerSpec.parse(old, key="--mode")) == new
    assert str(spec) == new
    assert [r.getMessage() for r in caplog.records].count(
        f"--mode: {old!r} is spelled {new!r} now; read as such") == 1


@pytest.mark.parametrize("text, match", [
    ("retrieval+retrieval", "retrieval merges into dynamic trees"), ("draft+retrieval", "retrieval merges"),
    ("lookup:", "nothing after ':'"), ("retrieval:x", "retrieval:N with an integer N"), ("auto", "unknown proposer 'auto'"),
])
def test_bad_spec_text_names_the_flag(text, match):
    with pytest.raises(MedusaError, match=match) as err:
        ProposerSpec.parse(text, key="methods[0].method")
    assert str(err.value).startswith("methods[0].method: ")


@pytest.mark.parametrize("spec, tree, match", [
    ("beam", None, "unknown proposer 'beam'"),
    ("plain:x", None, "plain takes no argument"),
    ("lookup:many", None, "lookup:N with an integer N"),
    ("draft:layers:x", None, "--draft"),
    ("draft:layers:9", None, "--layers"),
    ("heads", "tree-5", "--tree: 'tree-5'"),
    ("heads", "chain-17", "chain depth must be 1..16"),
])
def test_bad_specs_say_what_was_wrong(rt, spec, tree, match):
    with pytest.raises(MedusaError, match=match) as err:
        build_proposer(rt, spec, tree)
    assert "\n" not in str(err.value)


def test_heads_without_heads_and_a_draft_of_another_vocabulary(rt, monkeypatch):
    with pytest.raises(MedusaError, match="needs heads"):
        build_proposer(tiny_runtime(heads=False), "heads")
    from medusa.decoding.proposers import draft

    other = Transformer(tiny_model(vocab=101))
    monkeypatch.setattr(draft, "load_draft", lambda spec, target: DraftModel.of(other))
    with pytest.raises(MedusaError, match="--draft: elsewhere has a vocabulary of 101"):
        build_proposer(rt, "draft:elsewhere")
