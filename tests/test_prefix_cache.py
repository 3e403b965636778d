"""The prefix cache (`medusa.decoding.prefix_cache`) on the engine: a hit prefills only the rest of a prompt and
decodes what a whole prefill decodes (bit for bit with batch invariance), the feature head's state after a hit
is the one a whole prefill leaves, and eviction is LRU over blocks no request holds."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from medusa.decoding.target import invariant
from medusa.decoding.trees.dynamic_tree import TreeShape
from medusa.decoding.engine import Engine
from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
from medusa.decoding.proposers.feature_proposer import FeatureProposer
from medusa.decoding.prefix_cache import PrefixCache, block_bytes
from medusa.decoding.target.transformer import Transformer
from medusa.errors import MedusaError

V = 13
B = 4  # tokens per block: small, so short prompts span several


@pytest.fixture(scope="module")
def small():
    model = tiny_model("llama", seed=3, vocab=V)
    return model, Engine(Transformer(model), eos_token_ids=None)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g).tolist()


def keeping(batch, cache: PrefixCache) -> None:
    """The batch keeps what it computes in `cache` (as the server's hook does)."""
    batch.retain = lambda b, slots, ids, leaving: [cache.store(b, s) for s in slots]


def run(engine, batch, out) -> dict:
    got = {f.id: f.tokens for f in out.finished}
    while batch.n:
        out = engine.step(batch)
        got.update({f.id: f.tokens for f in out.finished})
    return got


def test_a_hit_prefills_only_the_rest_and_decodes_as_a_whole_prefill(small):
    model, engine = small
    system = tokens(23, seed=1)
    first, second = system + tokens(6, seed=2), system + tokens(9, seed=3)
    batch = engine.new_batch(2, 96, 12)
    cache = PrefixCache(batch, 1 << 20, block=B)
    keeping(batch, cache)
    assert run(engine, batch, engine.add(batch, ["a"], [first], 12))["a"] == engine.generate([first], 12).outputs[0].tokens
    hit = cache.lookup(second, lease="b")
    assert hit.tokens == 20  # the shared 23 tokens, block-aligned
    cache.restore(batch, batch.n, second, hit)
    passes = engine.model.passes
    got = run(engine, batch, engine.add(batch, ["b"], [second], 12, start=[hit.tokens]))
    assert engine.model.passes - passes == 1 + 11  # one prefill pass (12 tokens), then the decode steps
    assert got["b"] == engine.generate([second], 12).outputs[0].tokens
    # Nothing past the prompt's last token is ever served: the rest always has a token to run.
    assert cache.lookup(first[:24]).tokens == 20 and cache.lookup(first[:25]).tokens == 24
    assert cache.stats.hits == 3 and cache.stats.lookups == 3


def test_rows_with_different_hits_join_in_one_add(small):
    model, engine = small
    base = tokens(30, seed=4)
    prompts = [base[:9], base + [1, 2], tokens(7, seed=5), base[:17] + [3]]
    batch = engine.new_batch(4, 96, 8)
    cache = PrefixCache(batch, 1 << 20, block=B)
    keeping(batch, cache)
    run(engine, batch, engine.add(batch, ["warm"], [base], 8))
    hits = [cache.lookup(p) for p in prompts]
    assert [h.tokens for h in hits] == [8, 28, 0, 16]
    order = sorted(range(4), key=lambda i: hits[i].tokens)
    for slot, i in enumerate(order):
        cache.restore(batch, slot, prompts[i], hits[i])
    got = run(engine, batch, engine.add(batch, order, [prompts[i] for i in order], 8,
                                        start=[hits[i].tokens for i in order]))
    assert [got[i] for i in range(4)] == [o.tokens for o in engine.generate(prompts, 8).outputs]
    with pytest.raises(MedusaError, match="at least one token"):
        engine.add(batch, ["x"], [[1, 2]], 4, start=[2])


def test_a_chunked_prompt_starts_after_its_hit(small):
    model, engine = small
    long = tokens(50, seed=6)
    batch = engine.new_batch(2, 128, 8)
    cache = PrefixCache(batch, 1 << 20, block=B)
    keeping(batch, cache)
    run(engine, batch, engine.add(batch, ["a"], [long[:40]], 8))
    hit = cache.lookup(long)
    cache.restore(batch, batch.cache.rows - 1, long, hit)
    engine.begin(batch, "b", long, 8, start=hit.tokens)
    assert hit.tokens == 40 and batch.pending.left == 10
    while engine.advance(batch, 4):
        pass
    assert run(engine, batch, engine.join(batch))["b"] == engine.generate([long], 8).outputs[0].tokens


def test_a_hit_leaves_the_feature_state_a_whole_prefill_leaves(small):
    model, engine = small
    c = model.config
    head = FeatureHead(FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size), model)
    proposer = FeatureProposer(head, engine.model, TreeShape(6, 3, 3))
    system = tokens(26, seed=7)
    prompt = system + tokens(5, seed=8)
    states = []
    for cached in (False, True):
        batch = engine.new_batch(2, 96, 10)
        proposer.attach(batch)
        cache = PrefixCache(batch, 1 << 20, block=B)
        assert cache.feats is not None and cache.block_bytes == block_bytes(batch, B)
        start = 0
        if cached:
            keeping(batch, cache)
            run(engine, batch, engine.add(batch, ["warm"], [system + [0]], 4))
            hit = cache.lookup(prompt)
            cache.restore(batch, 0, prompt, hit)
            start = hit.tokens
            assert start == 24
        out = engine.add(batch, ["p"], [prompt], 10, start=[start])
        state = batch.aux["feature"]
        states.append((state.feats[0, : len(prompt)].clone(), state.seq[0, : len(prompt)].clone(),
                       int(state.feat_len[0])))
        got = {f.id: f.tokens for f in out.finished}
        fills = []
        original = proposer._fill_features
        proposer._fill_features = lambda *a: fills.append(1) or original(*a)
        try:
            while batch.n:
                got.update({f.id: f.tokens for f in engine.step(batch, proposer).finished})
        finally:
            del proposer._fill_features
        assert not fills  # every prompt position's features were at hand: no second target pass
        assert got["p"] == engine.generate([prompt], 10).outputs[0].tokens
    (whole, seq0, n0), (hit, seq1, n1) = states
    assert n0 == n1 == len(prompt) and torch.equal(seq0, seq1)
    torch.testing.assert_close(hit, whole, rtol=1e-5, atol=1e-5)


def test_with_batch_invariance_a_hit_is_bit_identical(monkeypatch, one_thread):
    """fp32 on in-order kernels (where the machine's own would round by shape): the K/V a hit restores plus
    the rest's prefill equal a whole prefill's bit for bit, and so do the logits of every step."""
    from test_invariant import InOrder, projections

    if projections(torch.float32) is not None:
        pytest.skip(f"batch invariance unavailable here: {projections(torch.float32)}")
    monkeypatch.setattr(invariant, "torch", InOrder())
    model = tiny_model(seed=5, vocab=V)
    tr = Transformer(model)
    tr.invariant = True
    engine = Engine(tr, eos_token_ids=None)
    system = tokens(37, seed=9)
    prompt = system + tokens(6, seed=10)
    kv, logits = [], []
    for cached in (False, True):
        batch = engine.new_batch(2, 128, 6)
        cache = PrefixCache(batch, 1 << 20, block=16)
        start = 0
        if cached:
            keeping(batch, cache)
            run(engine, batch, engine.add(batch, ["warm"], [system + tokens(20, seed=11)], 3))
            hit = cache.lookup(prompt)
            cache.restore(batch, 0, prompt, hit)
            start = hit.tokens
            assert start == 32
        engine.add(batch, ["p"], [prompt], 6, start=[start])
        kv.append(batch.cache.data[:, :, 0, :, : len(prompt)].clone())
        logits.append(engine.model.lm_head(batch.hidden[:1]).clone())
    assert torch.equal(kv[0], kv[1])
    assert torch.equal(logits[0], logits[1])


def filled(engine, cache: PrefixCache, prompt: list[int]) -> None:
    """Prefill `prompt` in a batch of its own and keep its blocks."""
    batch = engine.new_batch(1, 64, 2)
    keeping(batch, cache)
    run(engine, batch, engine.add(batch, ["x"], [prompt], 1))


def test_eviction_is_lru_over_blocks_no_request_holds(small):
    model, engine = small
    probe = engine.new_batch(1, 64, 2)
    cache = PrefixCache(probe, 3 * block_bytes(probe, B), block=B)
    assert cache.capacity == 3
    a, b, c = tokens(9, seed=12), tokens(9, seed=13), tokens(9, seed=14)
    filled(engine, cache, a)  # 2 blocks (8 of 9 tokens)
    held = cache.lookup(a + [0], lease="req-a")
    assert held.tokens == 8 and cache.used_blocks == 2
    filled(engine, cache, b)  # 1 block fits; the second would need a held block: none is evicted
    assert cache.stats.evictions == 0 and cache.used_blocks == 3
    assert cache.lookup(a + [0]).tokens == 8 and cache.lookup(b + [0]).tokens == 4
    held_slots = cache.held()
    filled(engine, cache, c)  # b's block is the only unheld one: it goes, a's stay
    assert cache.stats.evictions == 1 and cache.held() == held_slots
    assert cache.lookup(b + [0]).tokens == 0 and cache.lookup(a + [0]).tokens == 8
    assert cache.lookup(c + [0]).tokens == 4
    cache.release("req-a")
    cache.lookup(c + [0])  # c used last: a's leaf block, then a's first, are the least recently used
    filled(engine, cache, b)
    assert cache.lookup(b + [0]).tokens == 8 and cache.lookup(c + [0]).tokens == 4
    assert cache.lookup(a + [0]).tokens == 0 and cache.stats.evictions == 3


def test_a_budget_without_room_for_a_block_is_refused(small):
    model, engine = small
    batch = engine.new_batch(1, 64, 2)
    with pytest.raises(MedusaError, match="holds no block"):
        PrefixCache(batch, block_bytes(batch, B) - 1, block=B)
