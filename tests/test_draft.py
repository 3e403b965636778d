"""Draft-model speculative decoding: token-identical to plain greedy decoding, batched and ragged."""

import pytest
import torch

from conftest import hf_greedy, mixed_prompts, tiny_model
from medusa.decoding.proposers.draft import DraftProposer, load_draft, save_truncated, truncated_model
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.decoding.target.transformer import Transformer

MAX_NEW = 24


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama")
    return model, Engine(Transformer(model), eos_token_ids=None)


def drafts(model):
    """A truncated copy of the target, an unrelated random model, and the target itself (perfect draft)."""
    return {"truncated": Transformer(truncated_model(model, 1)),
            "unrelated": Transformer(tiny_model("qwen2", seed=5)),
            "self": Transformer(model)}


@pytest.mark.parametrize("batch_size, k", [(1, 4), (2, 1), (5, 3), (8, 4)])
def test_draft_matches_plain(target, batch_size, k):
    model, engine = target
    prompts = mixed_prompts(batch_size, seed=20 + batch_size)
    plain = engine.generate(prompts, MAX_NEW)
    for name, draft in drafts(model).items():
        spec = engine.generate(prompts, MAX_NEW, DraftProposer(draft, k))
        assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs], name
        assert spec.stats.new_tokens == plain.stats.new_tokens


@pytest.mark.parametrize("batch_size", [1, 5])
def test_perfect_draft_is_always_accepted(target, batch_size):
    """With the target as its own draft every candidate is right; any stale draft cache entry would break
    that, so this checks the catch-up and roll-back bookkeeping."""
    model, engine = target
    k = 4
    prompts = mixed_prompts(batch_size, seed=3)
    spec = engine.generate(prompts, MAX_NEW, DraftProposer(Transformer(model), k))
    assert [o.tokens for o in spec.outputs] == [hf_greedy(model, p, MAX_NEW) for p in prompts]
    hist = spec.stats.accept_hist
    assert hist[k] == spec.stats.row_steps  # every row, every step: all k accepted
    assert spec.stats.steps == -(-(MAX_NEW - 1) // (k + 1))


def test_rows_join_and_leave_a_draft_batch(target):
    """Continuous batching: rows added mid-flight and cancelled rows keep the draft cache consistent."""
    model, engine = target
    prompts = mixed_prompts(4, seed=9)
    proposer = DraftProposer(Transformer(model), 3)
    batch = engine.new_batch(3, 128, MAX_NEW)
    done = {}
    engine.add(batch, [0, 1], prompts[:2], MAX_NEW)
    for step in range(10):
        if step == 2:
            engine.add(batch, [2], prompts[2:3], MAX_NEW)
        if step == 3:
            batch.remove([1])
            engine.add(batch, [3], prompts[3:4], MAX_NEW)
        out = engine.step(batch, proposer if step != 5 else None)  # modes may switch per step
        if step >= 4 and step != 5:
            assert int(out.counts.min()) >= 2  # a perfect draft is accepted on every row
        for f in out.finished:
            done[f.id] = f.tokens
    while batch.n:
        for f in engine.step(batch, proposer).finished:
            done[f.id] = f.tokens
    for i in (0, 2, 3):
        assert done[i] == hf_greedy(model, prompts[i], MAX_NEW)


def test_long_catch_up_is_split_to_fit_the_cache(target):
    """A row joining late needs a catch-up block longer than the free cache room of its neighbours."""
    model, engine = target
    short, long = [5, 6], mixed_prompts(8, seed=2)[7] * 4
    proposer = DraftProposer(Transformer(model), 2)
    batch = engine.new_batch(2, len(long) + MAX_NEW + 8, MAX_NEW)
    engine.add(batch, ["s"], [short], MAX_NEW)
    for _ in range(4):
        engine.step(batch, proposer)
    engine.add(batch, ["l"], [long], MAX_NEW)
    done = {}
    while batch.n:
        for f in engine.step(batch, proposer).finished:
            done[f.id] = f.tokens
    assert done["l"] == hf_greedy(model, long, MAX_NEW)


def test_saved_truncated_draft_round_trips(target, tmp_path):
    model, _ = target
    draft = truncated_model(model, 1)
    with torch.no_grad():
        draft.model.layers[0].mlp.up_proj.weight.mul_(1.5)  # "trained": differs from the target's layer
        for p in draft.model.layers.parameters():  # stored as bf16: make the reference exactly representable
            p.copy_(p.to(torch.bfloat16).float())
    save_truncated(draft, tmp_path, {"hidden_size": model.config.hidden_size})
    loaded = load_draft(str(tmp_path), model).transformer
    ids = torch.tensor([[1, 2, 3, 4]])
    want = draft(ids).logits
    cache = loaded.new_cache(1, 8)
    got = loaded.lm_head(loaded(ids, torch.arange(4)[None], cache, slice(0, 1),
                                torch.ones(4, 4, dtype=torch.bool).tril()))
    assert torch.allclose(got, want.to(got.dtype), atol=1e-4)


def test_bad_draft_specs_are_clear_errors(target, tmp_path):
    model, _ = target
    with pytest.raises(MedusaError, match="--layers"):
        load_draft("layers:9", model)
    with pytest.raises(MedusaError, match="--draft"):
        load_draft("layers:x", model)
    with pytest.raises(MedusaError, match="--model"):
        load_draft(str(tmp_path / "missing"), model)
    with pytest.raises(MedusaError, match="k must be"):
        DraftProposer(Transformer(model), 0)


def test_reduced_vocabulary_draft(target, tmp_path):
    """A draft scoring only some token ids still proposes full-vocabulary ids, and stays lossless."""
    model, engine = target
    draft = truncated_model(model, 1)
    vocab = torch.arange(0, 97, 2)  # even ids only
    save_truncated(draft, tmp_path, {"hidden_size": model.config.hidden_size}, vocab)
    loaded = load_draft(str(tmp_path), model)
    assert loaded.vocab.tolist() == vocab.tolist()
    prompts = mixed_prompts(5, seed=41)
    plain = engine.generate(prompts, MAX_NEW)
    proposer = DraftProposer(loaded, 3)
    batch = engine.new_batch(5, 64, MAX_NEW)
    engine.add(batch, list(range(5)), prompts, MAX_NEW)
    assert (proposer.fill(batch) % 2 == 0).all()
    spec = engine.generate(prompts, MAX_NEW, proposer)
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]


@pytest.mark.slow
def test_embedded_draft_and_lookup_match_plain(embedded):
    """The real model and chat template (fp32): a cut-down draft and prompt lookup change no token."""
    from medusa.decoding.proposers.lookup import LookupProposer

    rt = embedded
    prompts = rt.encode(["Name three colours.", "Repeat after me: the quick brown fox jumps over the lazy dog.",
                         "What is 12 times 12?"])
    plain = rt.engine.generate(prompts, 24)
    for proposer in (DraftProposer(load_draft("layers:6", rt.hf_model), 3), LookupProposer(k=6)):
        spec = rt.engine.generate(prompts, 24, proposer)
        assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs], proposer.name
    assert spec.stats.mean_accepted > 1.0  # lookup finds the sentence it is asked to repeat


def test_draft_training_helpers():
    from medusa.train.draft import choose_vocab, collate, coverage, make_examples

    pairs = [([1, 2, 3], [7, 7, 8, 9]), ([4] * 30, [5, 6])]
    vocab = choose_vocab(pairs, 50, 5, always=[49])
    assert vocab.tolist() == sorted(vocab.tolist()) and 49 in vocab.tolist()
    assert {4, 7} <= set(vocab.tolist())  # the most frequent ids are kept
    assert coverage(pairs, vocab) < 1.0 and coverage(pairs, None) == 1.0
    ex = make_examples(pairs, seq_len=8)
    assert ex[0] == ([1, 2, 3, 7, 7, 8, 9], [-100, -100, -100, 7, 7, 8, 9])
    ids, labels = ex[1]
    # The prompt's front is cut (8 tokens of context stay before the answer), then the tail.
    assert ids == [4] * 8 + [5] and labels == [-100] * 8 + [5]
    x, y = collate(ex, pad=0)
    assert x.shape == y.shape == (2, 8) and y[0, :2].tolist() == [-100, -100] and y[0, 2] == 7
    assert y[1, -1] == 5 and (y[1, :-1] == -100).all()
