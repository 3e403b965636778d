"""Feature heads (EAGLE-style) with dynamic trees: greedy output equals plain decoding (batched, ragged),
rejection sampling keeps the target distribution, the EAGLE layouts round-trip, training runs and resumes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import accepted_drafts, hf_greedy, mixed_prompts, tiny_model, without_gate
from medusa.decoding.engine import Engine
from medusa.errors import MedusaError
from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig, read_kind
from medusa.decoding.trees.dynamic_tree import TreeShape
from medusa.decoding.proposers.feature_proposer import FeatureProposer
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.target.transformer import Transformer

MAX_NEW = 24
V = 16  # a small vocabulary: random heads hit often enough that rows accept different numbers of tokens


def random_head(model, style="eagle1", seed=0, draft_ids=None, std=None):
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    n = vocab if draft_ids is None else len(draft_ids)
    head = FeatureHead(FeatureHeadConfig(model.config.hidden_size, vocab, n, style=style), model, draft_ids)
    if std is not None:
        with torch.no_grad():
            for name, p in head.named_parameters():
                if p.requires_grad and "norm" not in name:
                    p.normal_(0, std)
    return head


@pytest.fixture(scope="module")
def small():
    model = tiny_model("llama", vocab=V)
    return model, Engine(Transformer(model), eos_token_ids=None)


@pytest.mark.parametrize("batch_size, style", [(1, "eagle1"), (2, "eagle1"), (5, "eagle1"), (8, "eagle1"),
                                               (5, "eagle3")])
def test_greedy_matches_plain_batched(small, batch_size, style):
    model, engine = small
    prompts = mixed_prompts(batch_size, vocab=V, seed=batch_size)
    plain = engine.generate(prompts, MAX_NEW)
    proposer = FeatureProposer(random_head(model, style), engine.model, TreeShape(nodes=8, depth=4, topk=3))
    spec = engine.generate(prompts, MAX_NEW, proposer)
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    assert spec.stats.new_tokens == plain.stats.new_tokens
    if batch_size >= 5:  # rows accepted different numbers of tokens in the same steps
        assert sum(1 for c in spec.stats.accept_hist[1:] if c) >= 2


@pytest.mark.parametrize("shape", [TreeShape(1, 1, 1), TreeShape(4, 4, 1), TreeShape(16, 3, 4),
                                   TreeShape(32, 6, 4)])
def test_tree_shapes_match_hf_generate(shape):
    model = tiny_model("qwen2", vocab=31)  # small enough that the random head's drafts are accepted
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(3, vocab=31, seed=7)
    ids = torch.arange(0, 31, 3)  # a draft vocabulary of every third id
    spec = engine.generate(prompts, 16, FeatureProposer(random_head(model, draft_ids=ids), engine.model, shape))
    assert [o.tokens for o in spec.outputs] == [hf_greedy(model, p, 16) for p in prompts]
    assert accepted_drafts(spec.stats) > 0, shape  # drafts of this shape were accepted


def test_draft_vocabulary_maps_back_to_full_ids(small):
    model, engine = small
    ids = torch.tensor([1, 4, 6, 9, 12])
    proposer = FeatureProposer(random_head(model, draft_ids=ids), engine.model, TreeShape(6, 3, 2))
    batch = engine.new_batch(3, 64, MAX_NEW)
    proposer.attach(batch)
    engine.add(batch, [0, 1, 2], mixed_prompts(3, vocab=V), MAX_NEW)
    trees = proposer.draft(batch)
    assert set(trees.tokens.unique().tolist()) <= set(ids.tolist())
    assert trees.tokens.shape == (3, 6)


def test_rows_join_leave_and_switch_modes(small):
    """Continuous batching: rows added mid-flight, cancelled rows, plain steps in between (features then
    missing are recomputed) keep the head's per-row state exact."""
    model, engine = small
    prompts = mixed_prompts(4, vocab=V, seed=9)
    proposer = FeatureProposer(random_head(model), engine.model, TreeShape(8, 4, 3))
    batch = engine.new_batch(3, 128, MAX_NEW)
    done = {}
    engine.add(batch, [0, 1], prompts[:2], MAX_NEW)  # before attach: prompt features recomputed on first use
    for step in range(10):
        if step == 2:
            engine.add(batch, [2], prompts[2:3], MAX_NEW)
        if step == 3:
            batch.remove([1])
            engine.add(batch, [3], prompts[3:4], MAX_NEW)
        out = engine.step(batch, proposer if step not in (5, 6) else None)
        for f in out.finished:
            done[f.id] = f.tokens
    while batch.n:
        for f in engine.step(batch, proposer).finished:
            done[f.id] = f.tokens
    for i in (0, 2, 3):
        assert done[i] == hf_greedy(model, prompts[i], MAX_NEW)


def test_prompt_features_kept_at_prefill(small):
    """With the proposer attached before the prefill, the head's first step needs no extra target pass."""
    model, engine = small
    proposer = FeatureProposer(random_head(model), engine.model, TreeShape(4, 2, 2))
    batch = engine.new_batch(2, 64, MAX_NEW)
    proposer.attach(batch)
    state = batch.aux["feature"]
    prompts = mixed_prompts(2, vocab=V, seed=4)
    engine.add(batch, [0, 1], prompts, MAX_NEW)
    assert state.feat_len[:2].tolist() == [len(p) for p in prompts]
    calls = []
    original = proposer._fill_features
    proposer._fill_features = lambda *a: calls.append(1) or original(*a)
    proposer.draft(batch)
    assert not calls


def test_plain_steps_keep_features(small):
    """Plain steps (a server under load) keep the features of what they commit: speculation that resumes
    needs no second target pass, and the output still equals plain decoding."""
    model, engine = small
    proposer = FeatureProposer(random_head(model), engine.model, TreeShape(6, 3, 2))
    batch = engine.new_batch(3, 96, MAX_NEW)
    proposer.attach(batch)
    state = batch.aux["feature"]
    prompts = mixed_prompts(3, vocab=V, seed=6)
    engine.add(batch, [0, 1, 2], prompts, MAX_NEW)
    for _ in range(4):
        engine.step(batch, None)
    assert state.feat_len[:3].tolist() == batch.cache.lens[:3].tolist()
    calls = []
    original = proposer._fill_features
    proposer._fill_features = lambda *a: calls.append(1) or original(*a)
    done = {}
    while batch.n:
        for f in engine.step(batch, proposer).finished:
            done[f.id] = f.tokens
    assert not calls
    assert [done[i] for i in range(3)] == [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_logprobs_equal_plain_decoding(small):
    """Per-row trees with ragged acceptance report each emitted token's logprob and top-k as plain
    decoding does (the logits of the accepted path's nodes)."""
    from test_serve_openai import collect_logprobs

    model, engine = small
    prompts = mixed_prompts(5, vocab=V, seed=11)
    plain, _ = collect_logprobs(engine, prompts, None, 3, MAX_NEW)
    proposer = FeatureProposer(random_head(model), engine.model, TreeShape(8, 4, 3))
    spec, stats = collect_logprobs(engine, prompts, proposer, 3, MAX_NEW)
    assert sum(1 for c in stats.accept_hist[1:] if c) >= 2  # candidates were accepted, unevenly
    for i in plain:
        assert [t for t, *_ in spec[i]] == [t for t, *_ in plain[i]]
        assert [ids for _, _, ids, _ in spec[i]] == [ids for _, _, ids, _ in plain[i]]
        assert [lp for _, lp, _, _ in spec[i]] == pytest.approx([lp for _, lp, _, _ in plain[i]], abs=1e-5)


def test_bad_shapes_are_clear_errors(small):
    model, engine = small
    head = random_head(model)
    with pytest.raises(MedusaError, match="fewer than"):
        FeatureProposer(head, engine.model, TreeShape(nodes=40, depth=2, topk=2))
    with pytest.raises(MedusaError, match="deep"):
        FeatureProposer(head, engine.model, TreeShape(nodes=2, depth=3, topk=2))
    with pytest.raises(MedusaError, match="draft tokens"):
        FeatureProposer(random_head(model, draft_ids=torch.arange(3)), engine.model, TreeShape(8, 2, 4))
    other = tiny_model("llama", vocab=V + 1)
    with pytest.raises(MedusaError, match="vocabulary"):
        head.bind(other)


# ---- sampling ---------------------------------------------------------------------------------------


def test_rejection_sampling_is_lossless_with_feature_heads():
    from test_sampling import PROMPT, V as SV, chi_square_pvalue, exact_pairs

    model = tiny_model("llama", seed=5, vocab=SV)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)
    engine = Engine(Transformer(model), eos_token_ids=None)
    params = SamplingParams(temperature=1.0, acceptance="rejection")
    expected = exact_pairs(model, params)
    for chain in (True, False):  # a sampled chain with its q, or the top-k tree as point masses
        head = random_head(model, std=0.3, seed=3)
        proposer = FeatureProposer(head, engine.model, TreeShape(4, 2, 2), sample_chain=chain)
        gen = engine.generate([PROMPT] * 3000, 2, proposer, params)
        pairs = torch.tensor([o.tokens[0] * SV + o.tokens[1] for o in gen.outputs])
        counts = torch.bincount(pairs, minlength=SV * SV).double()
        assert chi_square_pvalue(counts, expected) > 1e-3, chain
        assert gen.stats.accept_hist[1] > 0  # candidates were accepted, so the test exercised acceptance


def test_mixed_greedy_and_sampled_rows(small):
    model, engine = small
    prompts = mixed_prompts(4, vocab=V, seed=3)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(),
              SamplingParams(temperature=0.7, acceptance="typical", seed=2)]
    proposer = FeatureProposer(random_head(model), engine.model, TreeShape(8, 4, 3))
    gen = engine.generate(prompts, 16, proposer, params)
    for i in (0, 2):
        assert gen.outputs[i].tokens == hf_greedy(model, prompts[i], 16)
    again = engine.generate(prompts, 16, proposer, params)
    assert again.outputs[1].tokens == gen.outputs[1].tokens  # seeded rows are reproducible


# ---- saving and loading -----------------------------------------------------------------------------


def test_native_round_trip(small, tmp_path):
    model, engine = small
    head = random_head(model, "eagle3", draft_ids=torch.arange(2, 14), std=0.2)
    head.config.own_lm_head = False
    head.save(tmp_path)
    assert read_kind(tmp_path) == "feature"
    assert json.loads((tmp_path / "heads.json").read_text())["kind"] == "feature"
    loaded = FeatureHead.load(tmp_path, model)
    for k, v in head.own_state().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    prompts = mixed_prompts(2, vocab=V)
    a = engine.generate(prompts, 12, FeatureProposer(head, engine.model, TreeShape(6, 3, 2)))
    b = engine.generate(prompts, 12, FeatureProposer(loaded, engine.model, TreeShape(6, 3, 2)))
    assert a.stats.accept_hist == b.stats.accept_hist


def test_eagle1_layout_keys_and_round_trip(tmp_path):
    from medusa.decoding.proposers.feature_formats import save_eagle
    from safetensors.torch import load_file

    model = tiny_model("llama")
    head = random_head(model, "eagle1", std=0.2)
    save_eagle(head, tmp_path, "eagle")
    state = load_file(str(tmp_path / "model.safetensors"))
    h, kv = 64, 2 * 16
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "fc.weight": (h, 2 * h), "fc.bias": (h,),
        "layers.0.self_attn.q_proj.weight": (h, h), "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, h),
        "layers.0.mlp.gate_proj.weight": (128, h), "layers.0.mlp.up_proj.weight": (128, h),
        "layers.0.mlp.down_proj.weight": (h, 128), "layers.0.post_attention_layernorm.weight": (h,)}
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] == h and cfg["vocab_size"] == 97
    assert read_kind(tmp_path) == "feature"
    loaded = FeatureHead.load(tmp_path, model)
    assert loaded.config.style == "eagle1"
    for k in ("fc.weight", "fc.bias", "layer.self_attn.q_proj.weight", "layer.mlp.down_proj.weight"):
        assert torch.equal(loaded.state_dict()[k], head.state_dict()[k]), k


def test_eagle3_layout_keys_and_round_trip(tmp_path):
    from medusa.decoding.proposers.feature_formats import save_eagle
    from safetensors.torch import load_file

    model = tiny_model("llama")
    ids = torch.tensor([0, 3, 5, 50, 96])
    torch.manual_seed(0)
    cfg = FeatureHeadConfig(64, 97, 5, style="eagle3", feature_layers=[1, 1, 2], own_lm_head=True)
    head = FeatureHead(cfg, model, ids)
    save_eagle(head, tmp_path, "eagle3")
    state = load_file(str(tmp_path / "model.safetensors"))
    h, kv = 64, 32
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (h, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, h), "midlayer.mlp.gate_proj.weight": (128, h),
        "midlayer.mlp.up_proj.weight": (128, h), "midlayer.mlp.down_proj.weight": (h, 128),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (5, h),
        "d2t": (5,), "t2d": (97,)}
    assert (torch.arange(5) + state["d2t"]).tolist() == ids.tolist()
    assert state["t2d"].nonzero()[:, 0].tolist() == ids.tolist() and state["t2d"].dtype == torch.bool
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 5
    loaded = FeatureHead.load(tmp_path, model)
    assert loaded.config.feature_layers == [1, 1, 2] and loaded.draft_ids.tolist() == ids.tolist()
    for k, v in head.state_dict().items():
        if not k.startswith("rotary."):
            assert torch.equal(loaded.state_dict()[k], v), k


def test_eagle_layout_of_the_wrong_style_is_refused(tmp_path):
    from medusa.decoding.proposers.feature_formats import save_eagle

    model = tiny_model("llama")
    with pytest.raises(MedusaError, match="eagle3-style"):
        save_eagle(random_head(model, "eagle1"), tmp_path, "eagle3")


# ---- training ---------------------------------------------------------------------------------------


def test_unrolled_mask_is_what_a_draft_sees():
    from medusa.train.feature import unrolled_mask

    t = 5
    m = unrolled_mask(3, t, torch.float32, "cpu")[0, 0] == 0
    # step 0 is causal over the true entries
    assert torch.equal(m[:t, :t], torch.ones(t, t, dtype=torch.bool).tril()) and not m[:t, t:].any()
    # step 2 at position 4: true entries 0..2, its step-1 entry at 3, itself at 4 (step 2)
    row = m[2 * t + 4]
    assert row[:t].tolist() == [True, True, True, False, False]
    assert row[t:2 * t].tolist() == [False, False, False, True, False]
    assert row[2 * t:].tolist() == [False, False, False, False, True]


@pytest.mark.parametrize("style", ["eagle1", "eagle3"])
def test_unrolled_steps_equal_one_stacked_pass(style):
    """Training's unrolled steps (one block of queries per step over the keys of the blocks so far) give what
    one pass over every step's inputs stacked under `unrolled_mask` gives, outputs and gradients."""
    from medusa.train.feature import unrolled, unrolled_mask

    model = tiny_model("llama")
    head = random_head(model, style, seed=3, std=0.2).float()
    b, t, h = 2, 7, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(b, t, h, generator=g)
    f_in = torch.randn(b, t, head.config.feature_dim, generator=g)
    ok = torch.ones(b, t, dtype=torch.bool)

    def stacked(steps: int) -> list[torch.Tensor]:
        positions = torch.arange(t).expand(b, t)
        xs, outs = [head.inputs(emb, f_in, fused=True)], []
        for j in range(steps):
            out = head.layer_forward(emb.repeat(1, j + 1, 1), torch.cat(xs, 1), positions.repeat(1, j + 1),
                                     unrolled_mask(j + 1, t, emb.dtype, "cpu"))[:, j * t:]
            outs.append(out)
            xs.append(head.inputs(emb, torch.cat([out[:, :1] * 0, out[:, :-1]], 1), fused=False))
        return outs

    def grads(outs: list[torch.Tensor]) -> list[torch.Tensor]:
        head.zero_grad()
        sum((o * (k + 1)).square().mean() for k, o in enumerate(outs)).backward()
        trained = [p for p in head.parameters() if p.requires_grad]
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in trained]

    want = stacked(3)
    want_grads = grads(want)
    got = [out for _, out, _ in unrolled(head, emb, f_in, ok, 3)]
    assert len(got) == 3
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)
    for w, o in zip(want_grads, grads(got)):  # summed in another order: equal to rounding of their scale
        assert (o - w).abs().max() <= 1e-5 * w.abs().max()


def test_sequence_order_groups_lengths_and_is_reproducible():
    """Each epoch visits every sequence once, in the same order after a resume; grouped batches need far
    less padding than shuffled ones."""
    from medusa.train.feature_data import sequence_order

    lengths = torch.randint(20, 256, (1000,), generator=torch.Generator().manual_seed(1))

    def padded(order: torch.Tensor) -> int:  # positions of 8-sequence batches padded to their longest
        return sum(8 * int(lengths[b].max()) for b in order[: len(order) // 8 * 8].view(-1, 8))

    plain, grouped = sequence_order(0, 3, lengths), sequence_order(0, 3, lengths, group=8)
    assert sorted(grouped.tolist()) == list(range(1000)) and torch.equal(grouped, sequence_order(0, 3, lengths, 8))
    assert not torch.equal(grouped, sequence_order(0, 4, lengths, 8))
    assert padded(grouped) < 0.8 * padded(plain) and padded(grouped) < 1.05 * int(lengths.sum())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from train_helpers import fake_distilled, save_tiny_model

    root = tmp_path_factory.mktemp("feature")
    model = save_tiny_model(root / "model")
    data = fake_distilled(root / "data", model, n=16, answer_len=16)
    return root, model, data


def _feature_config(root, model, data, run, **extra):
    import yaml

    from medusa.train.feature import load_feature_config

    cfg = {"model": str(model), "dtype": "fp32", "run_dir": str(run), "threads": 2,
           "data": {"sources": ["sharegpt"], "distill_dir": str(data), "use": "distilled", "eval_fraction": 0.2},
           "head": {"draft_vocab": 48}, "loss": {"unroll": 2}, "optim": {"lr": 0.003, "warmup_steps": 2},
           "batch_size": 4, "chunk": 8, "epochs": 6, "checkpoint_every": 5, "wandb": {"mode": "disabled"}}
    cfg.update(extra)
    path = root / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_feature_config(path)


def test_data_limit_takes_the_first_distilled_prompts(tiny_run, tmp_path):
    """`data.limit` keeps a run on the same prompts after more were distilled (16 here)."""
    from medusa.train.data import load_examples

    root, model, data = tiny_run
    every = load_examples(_feature_config(root, model, data, tmp_path / "all"), None)
    ten = _feature_config(root, model, data, tmp_path / "ten")
    ten.data.limit = 10
    first = load_examples(ten, None)
    assert sum(len(g) for _, g in every) == 16
    assert [len(g) for _, g in first] == [10] and first[0][1] == every[0][1][:10]


class Crash(Exception):
    """The end of a training process between two checkpoints."""


def crash_after(monkeypatch, step: int) -> None:
    """The next feature-head training run stops right after `step` (as `MEDUSA_TRAIN_KILL_AFTER_STEP` kills
    a process there): what it did since its last checkpoint is lost."""
    from medusa.train import feature

    def fault(at: int) -> None:
        if at == step:
            raise Crash(at)

    monkeypatch.setattr(feature, "fault_injection", fault)


def steps_taken(monkeypatch) -> list[int]:
    """The training steps the runs from now on take, in order."""
    from medusa.train import feature

    taken: list[int] = []
    monkeypatch.setattr(feature, "fault_injection", taken.append)
    return taken


def same_head(a, b) -> bool:
    """Two runs' heads are the same, bit for bit."""
    from safetensors.torch import load_file

    x, y = (load_file(str(run / "head" / "feature_head.safetensors")) for run in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_training_learns_resumes_and_writes_a_usable_head(tiny_run, tmp_path, monkeypatch, one_thread):
    """A run that ends after step 7 (its last checkpoint: step 5) and is run again resumes and ends on the head
    the uninterrupted run reaches, bit for bit (one process, the same threads: the same sums in the same
    order); the head learned, evaluates and decodes losslessly."""
    from medusa.train.feature import run_feature_training
    from transformers import AutoModelForCausalLM

    root, model_dir, data = tiny_run
    run = tmp_path / "run"
    config = lambda run: _feature_config(root, model_dir, data, run, measure_tau_prompts=0, threads=1)
    crash_after(monkeypatch, 7)
    with pytest.raises(Crash):
        run_feature_training(config(run), progress=False)
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000005"]
    assert len(list((run / "features").glob("*.safetensors"))) == 2  # 16 sequences in chunks of 8
    taken = steps_taken(monkeypatch)
    done = run_feature_training(config(run), progress=False)
    assert done["step"] == 18 and taken == list(range(6, 19))  # resumed after step 5
    straight = run_feature_training(config(tmp_path / "straight"), progress=False)
    assert straight["trained_tokens"] == done["trained_tokens"] and same_head(run, tmp_path / "straight")
    report = json.loads((run / "head" / "eval.json").read_text())
    # Measured at eval_steps (6) draft steps, deeper than the 2 it trained: auto mode plans depth from them.
    assert len(report["rank_accuracy"]) == 6 and report["examples"] == 4  # 2 held out of each chunk
    from medusa.train.feature import evaluate_saved

    again = evaluate_saved(_feature_config(root, model_dir, data, run, eval_steps=3, threads=1), run / "head")
    kept = json.loads((run / "head" / "eval.json").read_text())
    assert kept == again and len(kept["rank_accuracy"]) == 3 and kept["step"] == 18
    assert torch.allclose(torch.tensor(kept["rank_accuracy"][:2]), torch.tensor(report["rank_accuracy"][:2]))
    hist = torch.load(run / "checkpoints" / "step-00000018" / "trainer_state.pt", weights_only=False)["history"]
    assert hist[-1]["loss"] < hist[0]["loss"]
    # The head loads and decodes losslessly on the model it was trained for.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = FeatureHead.load(run / "head", model)
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(3, vocab=97, seed=2)
    spec = engine.generate(prompts, 16, FeatureProposer(head, engine.model, TreeShape(8, 3, 3)))
    assert [o.tokens for o in spec.outputs] == [hf_greedy(model, p, 16) for p in prompts]
    # `medusa export --format eagle` writes the EAGLE-1 layout, which loads back to the same head.
    from medusa.train.export import export

    out = export(run / "head", tmp_path / "eagle1", "eagle")
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    again = FeatureHead.load(out, model)
    assert torch.equal(again.fc.weight, head.fc.weight)
    with pytest.raises(MedusaError, match="eagle3-style"):
        export(run / "head", tmp_path / "eagle3", "eagle3")


def test_training_continues_from_a_checkpoint_made_elsewhere(tiny_run, tmp_path, monkeypatch, one_thread):
    """`--resume PATH` (resume_from): a new run directory starting from another run's checkpoint (say one
    committed on another machine) reaches exactly the head that continuing in place reaches, and the head of
    the same run uninterrupted."""
    from medusa.train.feature import run_feature_training

    root, model_dir, data = tiny_run
    config = lambda run, **kw: _feature_config(root, model_dir, data, run, max_steps=8,
                                               measure_tau_prompts=0, threads=1, **kw)
    first = tmp_path / "first"
    crash_after(monkeypatch, 7)
    with pytest.raises(Crash):
        run_feature_training(config(first), progress=False)
    moved = tmp_path / "moved"
    shutil.copytree(first / "checkpoints" / "step-00000005", moved)  # the committed state, elsewhere
    taken = steps_taken(monkeypatch)
    elsewhere = run_feature_training(config(tmp_path / "elsewhere", resume_from=str(moved)), progress=False)
    assert taken == [6, 7, 8]  # the state was used
    in_place = run_feature_training(config(first), progress=False)
    straight = run_feature_training(config(tmp_path / "straight"), progress=False)
    assert elsewhere["step"] == in_place["step"] == straight["step"] == 8
    assert elsewhere["trained_tokens"] == in_place["trained_tokens"] == straight["trained_tokens"]
    assert same_head(tmp_path / "elsewhere", first) and same_head(first, tmp_path / "straight")
    with pytest.raises(MedusaError, match="resume_from"):
        run_feature_training(config(tmp_path / "bad", resume_from=str(tmp_path / "nothing")), progress=False)


def test_cached_feature_rows_stay_in_their_files_and_read_as_built(tmp_path):
    """A run's feature tables are read from their cached files batch by batch (memory-mapped), not held in
    memory; batches read exactly the rows that were built, across chunk files."""
    from medusa.train.feature_data import Features, cached_features

    def table(seed, lengths):
        g = torch.Generator().manual_seed(seed)
        n = sum(lengths)
        return Features(torch.randn(n, 6, generator=g).bfloat16(), torch.randint(0, 50, (n,), generator=g),
                        torch.rand(n, generator=g) > 0.3, torch.randint(0, 50, (n,), generator=g),
                        torch.tensor([0] + lengths).cumsum(0))

    built = {"a": table(0, [3, 7]), "b": table(1, [5, 2, 4])}
    calls = []

    def build(name):
        calls.append(name)
        return built[name]

    for _ in range(2):  # the second time both come from their files
        both = Features.cat([cached_features(tmp_path, n, "key", lambda n=n: build(n)) for n in "ab"])
    assert calls == ["a", "b"]
    assert len(both) == 5 and both.feats.width == 6 and len(both.feats) == 21
    assert not any(isinstance(p, torch.Tensor) for p in both.feats.pieces)
    f, tok, ans, top, valid = both.batch([1, 3, 4], 6)
    rows = torch.cat([built["a"].feats.all(), built["b"].feats.all()])
    assert f.shape == (3, 6, 6) and valid.sum(1).tolist() == [6, 2, 4]  # cut to 6, padded
    assert torch.equal(f[0], rows[3:9].float()) and torch.equal(f[1, :2], rows[15:17].float())
    assert torch.equal(tok[2, :4], built["b"].tokens[7:11]) and torch.equal(f[2, 4:], torch.zeros(2, 6))
    with pytest.raises(ValueError, match="straddle"):
        both.feats.rows(8, 12)


def test_missing_chunks_are_extracted_together_and_saved_apart(tmp_path, monkeypatch):
    """Missing chunks are extracted several at a time (length-sorted together, so short chunks pad less)
    and each is saved to its own keyed file with the rows it would have alone; present chunks are skipped,
    and a chunk whose inputs changed is extracted again by itself."""
    import medusa.train.feature_data as fd

    model = tiny_model("llama", vocab=V, seed=4)
    g = torch.Generator().manual_seed(3)

    def examples(lengths):
        return [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist(), "loss_mask": [0, 0] + [1] * (n - 2)}
                for n in lengths]

    chunks = [("c0", "k0", examples([5, 17])), ("c1", "k1", examples([9, 12, 6])), ("c2", "k2", examples([14] * 4))]
    fn = fd.feature_fn(model, [])
    calls, alone = [], fd.extract

    def counted(exs, f, progress=False):
        calls.append(len(exs))
        return alone(exs, f, progress)

    monkeypatch.setattr(fd, "EXTRACT_SEQUENCES", 5)
    monkeypatch.setattr(fd, "extract", counted)
    assert fd.extract_missing(tmp_path, chunks, fn) == 3
    assert calls == [5, 4]  # c0 + c1 together (5 sequences), then c2
    for name, key, exs in chunks:
        got = fd.cached_features(tmp_path, name, key, lambda: pytest.fail("should be cached"))
        want = alone(exs, fn)
        assert len(got) == len(exs) and torch.equal(got.offsets, want.offsets)
        assert torch.allclose(got.feats.all().float(), want.feats.all().float(), atol=1e-2)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.answer, want.answer)
        assert torch.equal(got.top, want.top)
    calls.clear()
    assert fd.extract_missing(tmp_path, chunks, fn) == 0 and calls == []
    assert fd.extract_missing(tmp_path, [chunks[0], ("c1", "changed", chunks[1][2]), chunks[2]], fn) == 1
    assert calls == [3]


def test_a_run_resumed_on_more_data_keeps_its_draft_vocabulary(tiny_run, tmp_path, one_thread):
    """Distilling more prompts changes which answer tokens are most frequent; a run resumed on the grown data
    keeps the draft vocabulary its state was trained on, with the target's lm_head rows and the token map of
    those ids (the head it evaluates is the head its files load as)."""
    from safetensors.torch import load_file

    from medusa.train.feature import evaluate_saved, run_feature_training

    root, model_dir, data = tiny_run
    few = _feature_config(root, model_dir, data, tmp_path / "few", max_steps=5, measure_tau_prompts=0, threads=1)
    few.data.limit = 6
    run_feature_training(few, progress=False)
    grown = tmp_path / "grown"
    report = run_feature_training(_feature_config(root, model_dir, data, grown, max_steps=6, measure_tau_prompts=0,
                                                  threads=1, resume_from=str(tmp_path / "few")),
                                  progress=False)["eval"]
    fresh = tmp_path / "fresh"
    run_feature_training(_feature_config(root, model_dir, data, fresh, max_steps=1, measure_tau_prompts=0,
                                         threads=1), progress=False)
    ids = {name: load_file(str(run / "head" / "feature_head.safetensors"))["draft_ids"]
           for name, run in [("few", tmp_path / "few"), ("grown", grown), ("fresh", fresh)]}
    assert not torch.equal(ids["few"], ids["fresh"])  # the grown data alone picks another vocabulary
    assert torch.equal(ids["grown"], ids["few"])
    again = evaluate_saved(_feature_config(root, model_dir, data, grown, max_steps=6, threads=1), grown / "head")
    assert again["rank_accuracy"] == report["rank_accuracy"]


def test_shipped_feature_config_validates():
    from pathlib import Path

    from medusa.train.feature import load_feature_config

    paths = sorted((Path(__file__).resolve().parent.parent / "configs" / "feature").glob("*.yaml"))
    assert paths, "no feature-head configs found under configs/feature"
    for path in paths:
        load_feature_config(path)


# ---- the runtime ------------------------------------------------------------------------------------


def test_runtime_detects_feature_heads_and_plans_their_tree(tiny_run, tmp_path, monkeypatch):
    from medusa.runtime import Runtime
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    _, model_dir, _ = tiny_run
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = random_head(model, draft_ids=torch.arange(40))
    head.save(tmp_path / "head")
    (tmp_path / "head" / "eval.json").write_text(json.dumps({"rank_accuracy": [[0.6, 0.1], [0.5, 0.1], [0.4]]}))
    rt = Runtime.load(str(model_dir), heads=str(tmp_path / "head"), dtype="fp32", device="cpu")
    assert rt.feature is not None and rt.heads is None
    prompts = mixed_prompts(2, vocab=97, seed=5)
    plain = rt.engine.generate(prompts, 12)
    named = rt.proposer("heads", "dynamic-8x3")
    assert named.shape == TreeShape(8, 3, 8)  # top-k defaults to DEFAULT_TOPK, at most N
    spec = rt.engine.generate(prompts, 12, named)
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    # A tree a planner did not plan is made as its name says, not as the default shape.
    made = rt.auto(2, progress=False).make_proposer(named.tree)
    assert getattr(made, "inner", made).shape == TreeShape(8, 3, 8)  # retrieval wraps the head's proposer
    auto = rt.auto(2, progress=False)
    without_gate(auto)
    plan = auto.plan(len(prompts))  # what the calibrated curve predicts at the batch decoded below
    assert plan.tree is None or plan.tree.name.startswith("dynamic-")
    if plan.tree is None:  # plain predicted on this machine: speculate with the named tree instead, so the
        from medusa.runtime.auto import Plan  # tokens compared below come from speculation

        forced = Plan(2, named.tree, 1.0, 1.0, "a named dynamic tree")
        monkeypatch.setattr(auto, "_plans", lambda rows: forced)
    gen = rt.engine.generate(prompts, 12, None, policy=auto)
    assert [o.tokens for o in gen.outputs] == [o.tokens for o in plain.outputs]
    assert auto.steps["speculative"] > 0
    with pytest.raises(MedusaError, match="dynamic"):
        rt.proposer("heads", "tree-8")
    # Medusa heads take dynamic trees too.
    from medusa.decoding.trees.dynamic_tree import MedusaDynamicProposer
    from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads

    (tmp_path / "medusa").mkdir()
    MedusaHeads(HeadsConfig(64, 97, 3, 1)).save(tmp_path / "medusa")
    mrt = Runtime.load(str(model_dir), heads=str(tmp_path / "medusa"), dtype="fp32", device="cpu")
    dyn = mrt.proposer("heads", "dynamic-10x3")
    assert isinstance(dyn, MedusaDynamicProposer) and dyn.depth == 3 and dyn.topk == 4  # MEDUSA_TOPK
    spec = mrt.engine.generate(prompts, 12, dyn)
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]
    # The evaluator's `feature` method, beside a runtime without heads.
    from medusa.eval.evaluate import EvalConfig, Methods

    bare = Runtime.load(str(model_dir), heads="none", dtype="fp32", device="cpu")
    cfg = EvalConfig(methods=[{"method": "feature", "heads": str(tmp_path / "head"), "tree": "dynamic-6x3"}])
    m = cfg.methods[-1]
    assert m.name == "feature:dynamic-6x3"
    proposer = Methods(bare, cfg).proposer(m)
    assert isinstance(proposer, FeatureProposer) and proposer.shape == TreeShape(6, 3, 6)
    # Its cost in the evaluator's model: the head's passes and a whole draft step's host work, timed in the engine.
    from medusa.eval.cost_inputs import feature_drafting
    from medusa.eval.costmodel import drafting_ms

    acc: dict = {}
    timed = feature_drafting(bare.engine, proposer, acc, [1, 2], 16, 1)
    assert acc == {"nodes": 6, "depth": 3, "topk": 6} and set(timed) == {"1", "2"}
    for t in timed.values():
        assert t["catch_up"] > 0 and t["expand"] > 0 and t["host"] >= 0
        assert drafting_ms(t, 3) == pytest.approx(t["catch_up"] + 2 * t["expand"] + t["host"])


def test_fused_layer_features_are_the_targets_hidden_states():
    """eagle3 heads read HF hidden_states[i] of several layers; the kept features match HF's exactly, and
    greedy decoding stays plain decoding's."""
    model = tiny_model("llama", vocab=V, seed=3)
    engine = Engine(Transformer(model), eos_token_ids=None)
    torch.manual_seed(0)
    head = FeatureHead(FeatureHeadConfig(64, V, V, style="eagle3", feature_layers=[1, 2]), model)
    proposer = FeatureProposer(head, engine.model, TreeShape(6, 3, 2))
    prompts = mixed_prompts(3, vocab=V, seed=11)
    batch = engine.new_batch(3, 96, 20)
    proposer.attach(batch)
    state = batch.aux["feature"]
    engine.add(batch, [0, 1, 2], prompts, 20)
    for _ in range(4):
        engine.step(batch, proposer)
    for r in range(3):
        n = int(state.feat_len[r])
        seq = batch.seq[r, :n][None]
        with torch.no_grad():
            hs = model(seq, output_hidden_states=True).hidden_states
        want = torch.cat([hs[1], hs[2]], -1)[0]
        assert torch.allclose(state.feats[r, :n].float(), want, atol=1e-4)
    plain = engine.generate(prompts, 20)
    spec = engine.generate(prompts, 20, proposer)
    assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]


def test_fused_eagle3_training_runs_and_decodes(tiny_run, tmp_path):
    from medusa.train.feature import run_feature_training
    from transformers import AutoModelForCausalLM

    root, model_dir, data = tiny_run
    run = tmp_path / "run3"
    cfg = _feature_config(root, model_dir, data, run, max_steps=3,
                          head={"style": "eagle3", "feature_layers": [1], "draft_vocab": 40})
    result = run_feature_training(cfg, progress=False)
    assert result["step"] == 3 and len(result["eval"]["rank_accuracy"]) == 6
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = FeatureHead.load(run / "head", model)
    assert head.config.feature_layers == [1] and head.fc.weight.shape == (64, 64)
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(2, vocab=97, seed=8)
    spec = engine.generate(prompts, 12, FeatureProposer(head, engine.model, TreeShape(6, 3, 2)))
    assert [o.tokens for o in spec.outputs] == [hf_greedy(model, p, 12) for p in prompts]


def test_default_heads_are_the_preferred_shipped_kind(embedded):
    """`--heads default` loads the shipped feature heads when marked preferred and keeps the shipped Medusa
    heads beside them: a static tree names the Medusa heads, a dynamic one the feature heads; `medusa` and
    `feature` name one kind alone."""
    from dataclasses import replace

    from medusa.decoding.proposers import MedusaProposer
    from medusa.runtime.feature import resolve_feature, shipped_preferred
    from medusa.runtime.runtime import load_heads

    hf = embedded.hf_model
    assert load_heads("medusa", hf) is not None and resolve_feature("medusa", hf) is None
    preferred = shipped_preferred(hf.config.hidden_size)
    assert (resolve_feature("default", hf) is not None) == preferred
    both = replace(embedded, feature=resolve_feature("feature", hf))  # what `default` loads when preferred
    assert isinstance(both.proposer("heads", "tree-8"), MedusaProposer)
    dynamic = both.proposer("heads", "dynamic-6x2")
    assert isinstance(dynamic, FeatureProposer) and dynamic.shape == TreeShape(6, 2, 6)
    prompts = embedded.encode(["Name three colours.", "Count from one to five."])
    plain = embedded.engine.generate(prompts, 16)
    for proposer in (both.proposer("heads", "tree-8"), dynamic):
        spec = both.engine.generate(prompts, 16, proposer)
        assert [o.tokens for o in spec.outputs] == [o.tokens for o in plain.outputs]


def test_bench_times_the_feature_heads_it_is_given(embedded):
    """`medusa bench --feature`: `auto` times the runtime's own feature heads (loaded beside the Medusa
    heads by `--heads default`), a directory times that one, `none` nothing; feature heads loaded alone
    already run as the main method."""
    from dataclasses import replace

    from medusa.decoding.proposers.feature_heads import SHIPPED_FEATURE_DIR
    from medusa.runtime.feature import bench_methods, resolve_feature

    both = replace(embedded, feature=resolve_feature("feature", embedded.hf_model))
    assert bench_methods(both, "none") == {}
    (own,) = bench_methods(both, "auto").values()
    assert own.head is both.feature
    (named,) = bench_methods(both, str(SHIPPED_FEATURE_DIR)).values()
    assert isinstance(named, FeatureProposer) and named.head is not both.feature
    assert bench_methods(replace(both, heads=None), "auto") == {}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_vocabulary_loss_equals_soft_cross_entropy_on_the_logits(precision):
    """Blockwise soft-target cross-entropy over the draft vocabulary: the same per-row loss, top id and
    gradient as `F.cross_entropy(lm_head(x).float(), softmax(lm_head(t).float()))` with the same matmul dtype
    (blocks of 7 rows here, so the last block is partial)."""
    import torch.nn.functional as F

    from medusa.train.vocab_loss import DraftVocab

    g = torch.Generator().manual_seed(0)
    n, h, v = 30, 16, 50
    weight = torch.randn(v, h, generator=g) * 0.5
    x0, t = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    scale = torch.rand(n, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        x = x0.clone().requires_grad_(True)
        vocab = DraftVocab(weight, block=7)
        loss, top = vocab.loss(x, vocab.teacher(t))
        (loss * scale).sum().backward()
        ref_x = x0.clone().requires_grad_(True)
        teacher = torch.softmax(F.linear(t, weight).float(), -1)
        logits = F.linear(ref_x, weight).float()
        ref = F.cross_entropy(logits, teacher, reduction="none")
        (ref * scale).sum().backward()
    tol = {"fp32": 1e-5, "bf16": 2e-2}[precision]
    assert loss.dtype == torch.float32 and torch.allclose(loss, ref, atol=tol, rtol=tol)
    assert torch.equal(top, logits.max(-1).indices)
    assert torch.allclose(x.grad, ref_x.grad, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="frozen"):
        DraftVocab(weight.clone().requires_grad_(True))


def test_acceptance_is_logged_while_training_and_measured_at_the_end(tiny_run, tmp_path, capsys):
    """Every eval_every steps: held-out top-1 and the tau it predicts for tau_tree; at the end the same
    prediction beside tau measured by decoding held-out prompts with the head (what auto mode would see)."""
    from medusa.train.feature import predicted_tau, run_feature_training

    root, model_dir, data = tiny_run
    cfg = _feature_config(root, model_dir, data, tmp_path / "acc", max_steps=6, eval_every=2, eval_examples=2,
                          tau_tree="dynamic-6x3", measure_tau_prompts=3, measure_tau_tokens=10)
    result = run_feature_training(cfg, progress=False)
    err = capsys.readouterr().err
    assert err.count("expected tau (dynamic-6x3)") == 3  # steps 2 and 4, and the end
    report = result["eval"]
    assert report["examples"] == 4 and report["expected_tau"]["dynamic-6x3"] == round(
        predicted_tau("dynamic-6x3", report), 3)
    assert 1.0 <= report["measured_tau"]["dynamic-6x3"] <= 7.0 and "measured" in err
    saved = json.loads((tmp_path / "acc" / "head" / "eval.json").read_text())
    assert saved["measured_tau"] == report["measured_tau"]


def test_each_named_model_gets_its_own_shipped_head(tmp_path, monkeypatch):
    """A named model's shipped head (`assets/feature_heads-<name>`) is what `--heads default` loads for that
    model when marked preferred, `--heads feature` loads whatever the mark, and `--heads <name>` names it;
    the embedded model's head is never loaded for it, and a head shipped for another model is refused by
    name, as is a named model with no head shipped."""
    import medusa.runtime.feature as rf

    assets = tmp_path / "assets"
    monkeypatch.setattr(rf, "ASSETS", assets)
    monkeypatch.setattr(rf, "SHIPPED_FEATURE_DIR", assets / "feature_heads")
    target = tiny_model("llama", vocab=V)
    target.name_or_path = "Qwen2.5-Coder-1.5B-Instruct"  # what loading `--model qwen2.5-coder-1.5b` names it
    embedded_like = tiny_model("llama", vocab=V, seed=1)  # same sizes, not a named model
    random_head(target).save(assets / "feature_heads", meta={"preferred": True})  # the embedded model's
    own = assets / "feature_heads-qwen2.5-coder-1.5b"
    random_head(target, seed=3).save(own, meta={"preferred": False, "base_model": target.name_or_path})

    assert rf.shipped_for(target) == "qwen2.5-coder-1.5b" and rf.shipped_for(embedded_like) == "default"
    assert rf.resolve_feature("default", target) is None  # shipped, but not marked preferred
    head = rf.resolve_feature("feature", target)
    expected = FeatureHead.load(own, target)
    assert all(torch.equal(a, b) for a, b in zip(head.own_state().values(), expected.own_state().values()))
    assert rf.resolve_feature("qwen2.5-coder-1.5b", target) is not None
    assert rf.shipped_names() == ["feature", "qwen2.5-coder-1.5b"]
    info = json.loads((own / "heads.json").read_text())
    (own / "heads.json").write_text(json.dumps(info | {"preferred": True}))
    assert rf.resolve_feature("default", target) is not None
    # The embedded model's head still goes to models of its sizes that are not named models.
    assert rf.resolve_feature("default", embedded_like) is not None
    with pytest.raises(MedusaError, match="--heads qwen2.5-coder-0.5b: no feature head is shipped"):
        rf.resolve_feature("qwen2.5-coder-0.5b", target)
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert rf.shipped_for(wider) is None  # no shipped head of its sizes
    with pytest.raises(MedusaError, match="--heads qwen2.5-coder-1.5b: that head was trained for"):
        rf.resolve_feature("qwen2.5-coder-1.5b", wider)
    shutil.rmtree(own)
    with pytest.raises(MedusaError, match="--heads feature: no feature head is shipped for Qwen2.5-Coder-1.5B"):
        rf.resolve_feature("feature", target)


def test_a_second_prediction_for_prompts_unlike_the_training_data(tiny_run, tmp_path, capsys):
    """With `other_prompts`, every report also predicts tau on the target's own answers to prompts of
    another source (written once to run_dir/other_answers.json, so a resumed run counts the same texts),
    beside the held-out split's prediction."""
    from medusa.train.feature import predicted_tau, run_feature_training

    root, model_dir, data = tiny_run
    prompts = tmp_path / "other.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: what comes after {i}?"}) + "\n" for i in range(5)))
    run = tmp_path / "other"
    cfg = _feature_config(root, model_dir, data, run, max_steps=4, eval_every=2, eval_examples=2,
                          tau_tree="dynamic-6x3", measure_tau_prompts=0, other_prompts=str(prompts),
                          other_prompts_count=3, other_answer_tokens=6)
    report = run_feature_training(cfg, progress=False)["eval"]
    err = capsys.readouterr().err
    assert err.count(f"on {prompts} prompts") == 2  # step 2 and the end
    saved = json.loads((run / "other_answers.json").read_text())
    assert saved["source"] == str(prompts) and len(saved["sequences"]) == 3
    assert all(0 < sum(s["loss_mask"]) <= 6 for s in saved["sequences"])
    other = report["other_prompts"]  # the end's report counts every answer (eval_examples is for the steps)
    assert other["examples"] == 3 and report["expected_tau_other"]["dynamic-6x3"] == round(
        predicted_tau("dynamic-6x3", {"rank_accuracy": other["rank_accuracy"]}), 3)
    # The answers are not made again: a changed file is not read once they are written.
    prompts.write_text(json.dumps({"prompt": "something else entirely"}) + "\n")
    from medusa.train.feature_eval import other_answers

    assert other_answers(cfg, None, None) == saved["sequences"]
