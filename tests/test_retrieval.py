"""Retrieval drafts (the text's own earlier continuations): scored branches, grafted onto head trees,
lossless alone and merged, batched, with rows joining and leaving, greedy and sampled."""


import pytest
import torch

from conftest import accepted_drafts, mixed_prompts, random_heads, tiny_model
from medusa.decoding.trees.dynamic_tree import NEG, MedusaDynamicProposer, Pool
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
from medusa.decoding.trees.dynamic_tree import TreeShape
from medusa.decoding.proposers.feature_proposer import FeatureProposer
from medusa.decoding.proposers.retrieval import (
    ACCEPT, MATCH_BUCKETS, Chains, MergedProposer, Retriever, RetrievalProposer, graft, match_bucket, token_scores)
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.target.transformer import Transformer
from medusa.errors import MedusaError

V = 13  # a small vocabulary: random models repeat themselves, so the text holds matches


@pytest.fixture(scope="module")
def small():
    model = tiny_model("llama", seed=2, vocab=V)
    return model, Engine(Transformer(model), eos_token_ids=None)


def test_scores_fall_along_a_branch_and_rise_with_the_match():
    assert [match_bucket(m) for m in (1, 2, 3, 4, 5, 6, 11, 12, 16, 400)] == [0, 1, 2, 3, 3, 4, 5, 6, 7, 7]
    s = token_scores(5, True, 6)
    assert all(a > b for a, b in zip(s, s[1:]))
    assert token_scores(12, True, 1)[0] > token_scores(2, True, 1)[0] > token_scores(2, False, 1)[0]
    assert len(ACCEPT) == len(MATCH_BUCKETS) and all(0 < p < 1 for row in ACCEPT for p in row)


def _head_pool() -> Pool:
    """One row, depth-1 nodes 5 (score -1) and 6 (-2), node 5's child 7 (-3)."""
    pool = Pool([], [], [], [])
    pool.add(torch.tensor([[5, 6]]), torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1, -1]]), 1)
    pool.add(torch.tensor([[7]]), torch.tensor([[-3.0]]), torch.tensor([[0]]), 2)
    return pool


def test_graft_shares_the_head_nodes_it_meets_and_extends_past_them():
    pool = _head_pool()
    chains = Chains(torch.tensor([[[5, 7, 9], [8, 0, 0]]]),
                    torch.tensor([[[-0.5, -0.6, -0.7], [-4.0, NEG, NEG]]]))
    graft(pool, chains)
    tok, score, par, dep = pool.flat(1, torch.device("cpu"))
    live = score[0] > NEG
    assert tok[0][live].tolist() == [5, 6, 7, 9, 8]
    assert score[0][live].tolist() == pytest.approx([-0.5, -2.0, -0.6, -0.7, -4.0])  # met nodes keep the higher
    assert par[0][live].tolist() == [-1, -1, 0, 2, -1] and dep[0][live].tolist() == [1, 1, 2, 3, 1]
    trees = pool.trees(4, 3)
    # The 4 best: 5, 7 (under 5), 9 (under 7), then 6; the weaker retrieval branch 8 is cut.
    assert trees.tokens[0].tolist() == [5, 6, 7, 9]
    assert trees.parent[0].tolist() == [0, 0, 0, 1, 3]
    assert trees.path_len[0].tolist() == [0, 1, 1, 2, 3]


def test_graft_leaves_rows_without_drafts_as_they_were():
    pool = _head_pool()
    before = pool.trees(3, 2)
    pool = _head_pool()
    graft(pool, Chains(torch.zeros(1, 2, 4, dtype=torch.long), torch.full((1, 2, 4), NEG)))
    after = pool.trees(3, 4)
    assert after.tokens.tolist() == before.tokens.tolist() and after.parent.tolist() == before.parent.tolist()


def feature_head(model, seed=0):
    torch.manual_seed(seed)
    c = model.config
    return FeatureHead(FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size), model)


def proposers(model, engine):
    heads = random_heads(model, num_heads=4)
    return {
        "retrieval": RetrievalProposer(8, Retriever(3, 6)),
        "medusa-dynamic+retrieval": MergedProposer(MedusaDynamicProposer(heads, 8, 3, 3), Retriever(3, 6)),
        "feature+retrieval": MergedProposer(FeatureProposer(feature_head(model), engine.model, TreeShape(8, 3, 3)),
                                         Retriever(3, 6)),
        # Its paths (retrieval's, 6 deep) are longer than its pass (the head's one node + the root): the
        # cache must hold the longest path past a row's length, not only the pass.
        "feature-1x1+retrieval": MergedProposer(FeatureProposer(feature_head(model), engine.model, TreeShape(1, 1, 1)),
                                             Retriever(3, 6)),
    }


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_output_is_plain_decodings_batched(small, batch_size):
    model, engine = small
    prompts = mixed_prompts(batch_size, vocab=V, seed=30 + batch_size)
    plain = engine.generate(prompts, 32)
    for name, proposer in proposers(model, engine).items():
        spec = engine.generate(prompts, 32, proposer)
        assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs], name
        assert spec.stats.forward_passes < plain.stats.forward_passes, name  # drafts were accepted


def test_merged_trees_accept_more_than_the_heads_alone(small):
    model, engine = small
    prompts = mixed_prompts(8, vocab=V, seed=38)
    heads = random_heads(model, num_heads=4)
    alone = engine.generate(prompts, 32, MedusaDynamicProposer(heads, 8, 3, 3))
    merged = engine.generate(prompts, 32, MergedProposer(MedusaDynamicProposer(heads, 8, 3, 3), Retriever(3, 6)))
    assert merged.stats.forward_passes < alone.stats.forward_passes


def test_rows_joining_and_leaving_keep_their_own_text(small):
    """A batch that rows leave (at their own lengths) and join (into freed slots, reusing no id)."""
    model, engine = small
    prompts = mixed_prompts(6, vocab=V, seed=7)
    limits = [9, 30, 14, 30, 21, 30]
    solo = [engine.generate([p], m).outputs[0].tokens for p, m in zip(prompts, limits)]
    proposer = proposers(model, engine)["feature+retrieval"]
    batch = engine.new_batch(3, 128, 32)
    proposer.attach(batch)
    waiting = list(range(6))
    got: dict[int, list[int]] = {}

    def admit():
        take = waiting[: batch.free]
        del waiting[: len(take)]
        if take:
            finish(engine.add(batch, take, [prompts[i] for i in take], [limits[i] for i in take]))

    def finish(out):
        for f in out.finished:
            got[f.id] = f.tokens

    admit()
    while batch.n or waiting:
        finish(engine.step(batch, proposer))
        admit()
    assert [got[i] for i in range(6)] == solo
    assert accepted_drafts(batch.stats) > 0  # drafts were accepted


def test_rejection_sampling_stays_exact_with_merged_trees():
    """Seeded rows, verified by matching keyed samples; unseeded rows, verified by rejection deep in such trees:
    `test_sampling_deep.py`."""
    from test_sampling import V as SV, chi_square_pvalue, seeded_rows, small_model

    model = small_model()
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2]  # repeats: retrieval drafts after most first tokens
    params = SamplingParams(temperature=1.0, acceptance="rejection")

    def dist(seq):
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([seq])).logits[0, -1].double(), -1)

    p1 = dist(prompt)
    expected = torch.stack([p1[a] * dist(prompt + [a]) for a in range(SV)]).flatten()
    head = FeatureHead(FeatureHeadConfig(model.config.hidden_size, SV, SV), model)
    for proposer in (RetrievalProposer(6, Retriever(3, 4)),
                     MergedProposer(FeatureProposer(head, engine.model, TreeShape(4, 2, 2), sample_chain=False),
                                    Retriever(3, 4))):
        n = 4000
        gen = engine.generate([prompt] * n, 2, proposer, seeded_rows(params, n))
        pairs = torch.tensor([o.tokens[0] * SV + o.tokens[1] for o in gen.outputs])
        counts = torch.bincount(pairs, minlength=SV * SV).double()
        assert chi_square_pvalue(counts, expected) > 1e-3, proposer.name
        assert gen.stats.accept_hist[1] > 0, proposer.name  # drafts were accepted: acceptance was exercised


def test_sampled_chain_rows_keep_the_heads_chain(small):
    """Rows drafting a sampled chain get no retrieval nodes; greedy rows beside them do."""
    model, engine = small
    prompts = mixed_prompts(2, vocab=V, seed=4)
    inner = FeatureProposer(feature_head(model), engine.model, TreeShape(8, 3, 3))
    merged = MergedProposer(inner, Retriever(3, 6))
    batch = engine.new_batch(2, 128, 40)
    merged.attach(batch)
    batch.sampling.shared.manual_seed(3)  # unseeded: a seeded row is verified by matching, drafted greedily
    engine.add(batch, [0, 1], prompts, 40, [SamplingParams(), SamplingParams(temperature=1.0)])
    deepest = 0
    while batch.n == 2 and deepest <= inner.shape.depth:
        trees = merged.draft(batch)
        assert int((trees.path_len[1] > 0).sum()) <= inner.shape.depth  # the sampled row: its chain alone
        deepest = max(deepest, int(trees.path_len[0].max()))
        engine.step(batch, merged)
    assert deepest > inner.shape.depth  # the greedy row got a retrieval branch deeper than the head drafts


def test_bad_settings_are_clear_errors(small):
    with pytest.raises(MedusaError, match="branches, depth and min_match"):
        Retriever(0, 4)
    with pytest.raises(MedusaError, match="do not fit"):
        RetrievalProposer(40, Retriever(2, 8))


def test_a_datastore_of_earlier_outputs_is_drafted_from(small, tmp_path):
    """Retrieval over a corpus that holds what the rows will write: more accepted, output unchanged."""
    from medusa.decoding.proposers.suffix import Datastore
    from medusa.decoding.proposers.retrieval import load_datastore as load

    model, engine = small
    prompts = mixed_prompts(4, vocab=V, seed=50)
    plain = engine.generate(prompts, 24)
    Datastore.build([p + o.tokens for p, o in zip(prompts, plain.outputs)]).save(tmp_path / "store")
    store = load(tmp_path / "store", V)
    alone = engine.generate(prompts, 24, RetrievalProposer(8, Retriever(3, 6)))
    both = engine.generate(prompts, 24, RetrievalProposer(8, Retriever(3, 6, store=store)))
    assert [o.tokens for o in both.outputs] == [o.tokens for o in plain.outputs]
    assert both.stats.forward_passes < alone.stats.forward_passes
    with pytest.raises(MedusaError, match="outside the model's vocabulary of 5: it was built for another"):
        load(tmp_path / "store", 5)


def test_datastore_cli_builds_from_a_text_file(tmp_path, capsys):
    import json

    from medusa.cli import main
    from medusa.decoding.proposers.suffix import Datastore

    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"text": f"Line {i}: the quick brown fox jumps."}) for i in range(5)))
    assert main(["datastore", "build", "--from", str(texts), "--out", str(tmp_path / "ds")]) == 0
    assert "5 sequences" in capsys.readouterr().out
    info = json.loads((tmp_path / "ds" / "datastore.json").read_text())
    assert info["sequences"] == 5 and info["tokens"] > 5 * 8
    store = Datastore.load(tmp_path / "ds")
    assert store.match(store.text[:6].tolist()).length == 6  # its own text is found
    assert main(["datastore", "build", "--from", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "x")]) == 2
    assert "--from: " in capsys.readouterr().err


def test_auto_mode_without_heads_drafts_from_the_text(small):
    """No heads: auto mode is retrieval alone, judged by measurement (no prediction), and lossless;
    `retrieval=False` leaves plain decoding."""
    from medusa.runtime import Runtime
    from medusa.runtime.auto import AutoSpeculation

    model, engine = small
    rt = Runtime(model, None, engine.model, engine, None)
    auto = rt.auto(4, progress=False)
    assert isinstance(auto, AutoSpeculation) and not auto.predicted
    assert auto.plan(1).tree is None or auto.plan(1).tree.name.startswith("retrieval:")
    prompts = mixed_prompts(4, vocab=V, seed=60)
    assert ([o.tokens for o in engine.generate(prompts, 24, policy=auto).outputs]
            == [o.tokens for o in engine.generate(prompts, 24).outputs])
    assert Runtime(model, None, engine.model, engine, None, retrieval=False).auto(4, progress=False) is None
