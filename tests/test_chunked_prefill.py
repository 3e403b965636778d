"""Chunked prefill (`Engine.begin`, chunks carried by `Engine.step` or in `Engine.advance`, `Engine.join`): a
long prompt enters a running batch a chunk at a time, in the cache's top slot, and decodes exactly as it would
alone, whatever the proposer and whatever the rows around it do meanwhile."""

from __future__ import annotations

import pytest
import torch

from conftest import random_heads, tiny_model
from medusa.decoding.proposers.draft import DraftProposer
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
from medusa.decoding.trees.dynamic_tree import TreeShape
from medusa.decoding.proposers.feature_proposer import FeatureProposer
from medusa.decoding.proposers.lookup import LookupProposer
from medusa.decoding.proposers import MedusaProposer
from medusa.decoding.proposers.retrieval import MergedProposer, Retriever
from medusa.decoding.trees.tree import load_tree
from medusa.decoding.target.transformer import Transformer
from medusa.errors import MedusaError

V = 13  # a small vocabulary: drafts are accepted often enough that rows move at different speeds


@pytest.fixture(scope="module")
def small():
    model = tiny_model("llama", seed=3, vocab=V)
    return model, Engine(Transformer(model), eos_token_ids=None)


def prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of 3 to 60 tokens: short ones join whole, long ones in chunks."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (3 + (17 * i + 5) % 58,), generator=g).tolist() for i in range(count)]


def make(name: str, model, engine):
    torch.manual_seed(0)
    c = model.config
    if name == "plain":
        return None
    if name == "medusa":
        return MedusaProposer(random_heads(model, num_heads=4), load_tree("tree-8"))
    if name == "feature+retrieval":
        head = FeatureHead(FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size), model)
        return MergedProposer(FeatureProposer(head, engine.model, TreeShape(8, 3, 3)), Retriever(3, 6))
    if name == "eagle3":  # fused features of two target layers, kept by taps on those layers
        cfg = FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size, style="eagle3", feature_layers=[1, 2])
        return FeatureProposer(FeatureHead(cfg, model), engine.model, TreeShape(8, 3, 3))
    if name == "draft":
        return DraftProposer(Transformer(tiny_model("llama", seed=5, vocab=V)), k=3)
    return LookupProposer(k=4)


@pytest.mark.parametrize("name", ["plain", "medusa", "feature+retrieval", "eagle3", "draft", "lookup"])
@pytest.mark.parametrize("chunk, fused", [(1, True), (7, True), (32, True), (7, False)])
def test_chunked_rows_decode_as_they_would_alone(small, name, chunk, fused):
    """Rows join (short prompts whole, long ones `chunk` tokens per step: in the running rows' pass when
    `fused`, else in a pass of their own), leave at their own lengths and decode speculatively meanwhile:
    every row's tokens equal its solo greedy decoding (fp32)."""
    model, engine = small
    if name == "eagle3":  # its taps stay on the target's layers: a target of its own
        model = tiny_model("llama", seed=3, vocab=V)
        engine = Engine(Transformer(model), eos_token_ids=None)
    ps = prompts(7, seed=chunk)
    limits = [5, 20, 9, 20, 14, 20, 11]
    solo = [engine.generate([p], m).outputs[0].tokens for p, m in zip(ps, limits)]
    proposer = make(name, model, engine)
    batch = engine.new_batch(3, 128, 24)
    if proposer is not None:
        proposer.attach(batch)
    waiting, got, chunks = list(range(len(ps))), {}, 0

    def finish(out):
        for f in out.finished:
            got[f.id] = f.tokens

    while batch.n or waiting or batch.pending:
        carried = fused and batch.n and batch.pending is not None
        if batch.pending is not None and not carried:
            engine.advance(batch, chunk)
            chunks += 1
        elif waiting and batch.free and batch.pending is None:
            i = waiting.pop(0)
            if len(ps[i]) > chunk:
                engine.begin(batch, i, ps[i], limits[i])
            else:
                finish(engine.add(batch, [i], [ps[i]], limits[i]))
        if batch.n:
            finish(engine.step(batch, proposer, prefill=chunk if carried else 0))
            chunks += bool(carried)
        if batch.pending is not None and batch.pending.left == 0:
            finish(engine.join(batch))
    assert [got[i] for i in range(len(ps))] == solo
    assert chunks >= sum(-(-len(p) // chunk) for p in ps if len(p) > chunk)


def test_features_of_a_chunked_prompt_are_the_whole_prompts(small):
    """The feature head keeps every chunk's features: the same as a whole prefill gives."""
    model, engine = small
    c = model.config
    head = FeatureHead(FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size), model)
    p = prompts(2, seed=4)[1]
    states = []
    for chunked in (False, True):
        batch = engine.new_batch(2, 96, 8)
        FeatureProposer(head, engine.model, TreeShape(4, 2, 2)).attach(batch)
        engine.add(batch, ["other"], [[1, 2, 3]], 8)
        if chunked:
            engine.begin(batch, "long", p, 8)
            while engine.advance(batch, 9):
                pass
            engine.join(batch)
        else:
            engine.add(batch, ["long"], [p], 8)
        states.append(batch.aux["feature"])
        assert batch.ids == ["other", "long"]
    whole, parts = states
    assert int(parts.feat_len[1]) == int(whole.feat_len[1]) == len(p)
    torch.testing.assert_close(parts.feats[1, : len(p)], whole.feats[1, : len(p)], rtol=1e-4, atol=1e-4)


def test_the_pending_slot_is_outside_the_active_rows(small):
    model, engine = small
    batch = engine.new_batch(3, 96, 8)
    engine.add(batch, ["a", "b"], [[1, 2], [3, 4, 5]], 8)
    engine.begin(batch, "long", list(range(1, 13)) * 3, 8)
    assert batch.free == 0 and batch.pending.slot == 2
    with pytest.raises(MedusaError, match="room for 0"):
        engine.add(batch, ["c"], [[1]], 8)
    with pytest.raises(MedusaError, match="already prefilling"):
        engine.begin(batch, "other", [1, 2], 8)
    assert engine.advance(batch, 10) == 26
    with pytest.raises(MedusaError, match="fully prefilled"):
        engine.join(batch)
    batch.remove(["a"])  # a row leaves mid-prefill: the pending prompt's slot is not touched
    engine.step(batch)
    assert batch.pending.done == 10 and int(batch.cache.lens[2]) == 10
    assert engine.abandon(batch).id == "long" and batch.pending is None and batch.free == 2
    with pytest.raises(MedusaError, match="no prompt"):
        engine.advance(batch, 4)
    with pytest.raises(MedusaError, match="empty"):
        engine.begin(batch, "empty", [], 8)


def test_a_fused_pass_gives_each_part_what_its_own_pass_gives(small):
    """`forward_parts` (decode rows with their tree, a prompt chunk) = one `forward` per part: hidden states
    and the K/V each part writes (fp32)."""
    from medusa.decoding.target.transformer import PassInputs, causal

    model, engine = small
    tr = engine.model
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, V, (4, 10), generator=g)
    parts = [PassInputs(toks[:3, :5], torch.arange(5).expand(3, 5), slice(0, 3), causal(5, "cpu")),
             PassInputs(toks[3:, :10], torch.arange(10)[None], slice(3, 4), causal(10, "cpu"))]
    cache = tr.new_cache(4, 32)
    alone = [tr(p.tokens, p.positions, cache, p.rows, p.mask) for p in parts]
    kv = cache.data.clone()
    cache.data.zero_()
    fused = tr.forward_parts(cache, parts)
    for a, f in zip(alone, fused):
        assert torch.equal(a, f)
    assert torch.equal(cache.data, kv)


def test_prompts_of_unequal_lengths_prefill_without_padding(small, monkeypatch):
    """Rows added together whose right-padding would be mostly padding go as one unpadded pass of parts
    (`PACK_PADDING`); prompts of equal length keep the single padded pass. Either way every row decodes as it
    does alone, speculative or not (fp32)."""
    model, engine = small
    calls = []
    fused = Transformer.forward_parts
    monkeypatch.setattr(Transformer, "forward_parts", lambda self, cache, parts: calls.append(len(parts)) or
                        fused(self, cache, parts))
    g = torch.Generator().manual_seed(9)
    uneven = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 41, 17)]
    even = [torch.randint(0, V, (20,), generator=g).tolist() for _ in range(3)]
    for ps, packed in ((uneven, [3]), (even, [])):
        solo = [engine.generate([p], 12).outputs[0].tokens for p in ps]
        for name in ("plain", "feature+retrieval"):
            calls.clear()
            out = engine.generate(ps, 12, make(name, model, engine))
            assert [o.tokens for o in out.outputs] == solo
            assert calls == packed
