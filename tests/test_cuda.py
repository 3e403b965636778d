"""The project's guarantees on a CUDA device, and the GPU code path's choices (checked on any machine).

Tests marked `cuda` run where `torch.cuda.is_available()` and are skipped, with the reason, elsewhere
(tests/conftest.py). They reuse the CPU tests' helpers on a model moved to the GPU:

- greedy decoding: fp32 Medusa output token-identical to plain decoding and to HF generate; bf16 output
  allowed to part from plain decoding only at near-ties of the target's logits, and the partings counted;
- sampled decoding: the chi-square test of rejection acceptance (and the same test rejecting typical
  acceptance, so it can fail on this device too);
- the server: concurrent streams through the openai client, each equal to its prompt decoded alone;
- training: one process on the GPU gives the CPU's heads; two processes on two GPUs give one's.

`bash scripts/gpu_check.sh` runs them (`pytest -m cuda`) with the pass-cost curve.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

from conftest import hf_greedy, mixed_prompts, tiny_model
from medusa.decoding.engine import Engine
from medusa.decoding.proposers import MedusaProposer, StaticProposer
from medusa.decoding.target.kernels import pack_weights
from medusa.decoding.target.transformer import RMSNorm, Transformer, attention_dtype, cache_dtype, mirrored_norm
from medusa.decoding.trees.tree import chain, load_tree
from medusa.decoding.verifier import RowTrees

cuda = pytest.mark.cuda
CUDA = torch.device("cuda")


class OnDevice(StaticProposer):
    """A test proposer that builds its candidates on the CPU, handing them over on the batch's device."""

    def __init__(self, inner):
        self.inner, self.tree, self.name = inner, inner.tree, inner.name

    def draft(self, batch):
        drafted, dev = self.inner.draft(batch), batch.root.device
        q = None if drafted.proposal is None else drafted.proposal.to(dev)
        return RowTrees.shared(drafted.tokens.to(dev), self.tree.buffers(dev), q)


@pytest.fixture
def exact_fp32():
    """fp32 matmuls in full fp32 (no TF32), as the CPU runs them, for the token-identity checks."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---- the GPU code path's choices: pure functions, and a Transformer built on a non-CPU device -------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_no_cpu_only_path_on_cuda(dtype):
    """oneDNN packing, the [x, -x] layer-norm RMSNorm, fp32 K/V caches and fp32 small-pass attention are
    CPU choices; on CUDA each is the plain path in the model's dtype."""
    assert not pack_weights("cuda", dtype)
    assert not mirrored_norm("cuda", dtype)
    for rows in (1, 16, 17, 256):
        assert cache_dtype("cuda", dtype, rows) == dtype
        assert attention_dtype("cuda", dtype, cache_dtype("cuda", dtype, rows), rows) == dtype
    # The same functions do pick the CPU tricks on the CPU, so the checks above can fail.
    assert cache_dtype("cpu", dtype, 1) == torch.float32 and cache_dtype("cpu", dtype, 17) == dtype
    assert attention_dtype("cpu", dtype, dtype, 1) == torch.float32
    assert mirrored_norm("cpu", torch.bfloat16) and not mirrored_norm("cpu", torch.float32)


def _transformer_choices(tr: Transformer, rows: int) -> dict:
    norms = [m for m in tr.modules() if isinstance(m, RMSNorm)]
    linears = [m for m in tr.modules() if hasattr(m, "packed")]
    cache = tr.new_cache(rows, 32)
    lens = torch.full((rows,), 5, dtype=torch.long, device=tr.device)
    block = torch.ones(3, 3, dtype=torch.bool, device=tr.device).tril()
    _, bias = tr._pass_masks(lens, block, 3, 8, cache.data.dtype)
    return {"packed": any(m.packed for m in linears), "mirrored": any(m.mirrored for m in norms),
            "cache": cache.data.dtype, "attention": bias.dtype, "count": (len(norms), len(linears))}


def test_transformer_off_the_cpu_takes_the_plain_path():
    """Built on a device that is not the CPU (`meta`: shapes only, no data), the Transformer packs nothing,
    keeps the stock RMSNorm, and holds K/V and small-pass attention in bf16; the same model on the CPU
    takes the CPU path, so the comparison can fail."""
    model = tiny_model("llama").to(torch.bfloat16)
    on_cpu = _transformer_choices(Transformer(model), rows=1)
    off_cpu = _transformer_choices(Transformer(copy.deepcopy(model).to("meta")), rows=1)
    assert off_cpu["count"] == on_cpu["count"] and off_cpu["count"][1] > 0
    assert (off_cpu["packed"], off_cpu["mirrored"], off_cpu["cache"], off_cpu["attention"]) == \
        (False, False, torch.bfloat16, torch.bfloat16)
    assert on_cpu["mirrored"] and on_cpu["cache"] == torch.float32 and on_cpu["attention"] == torch.float32


@cuda
def test_transformer_on_cuda_takes_the_plain_path():
    choices = _transformer_choices(Transformer(tiny_model("llama").to(CUDA, torch.bfloat16)), rows=1)
    assert (choices["packed"], choices["mirrored"], choices["cache"], choices["attention"]) == \
        (False, False, torch.bfloat16, torch.bfloat16)


# ---- greedy decoding ------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch_size", [1, 5, 8])
def test_greedy_fp32_on_cuda_is_token_identical(exact_fp32, arch, batch_size):
    """Plain decoding on the GPU equals HF generate (on the CPU, same weights); Medusa with random heads
    over a deep tree and a proposer accepted several tokens at a time, a different number per row, equal
    plain decoding token for token."""
    from conftest import random_heads
    from test_engine import DEEP_TREE, MAX_NEW, OracleProposer

    model = tiny_model(arch)
    prompts = mixed_prompts(batch_size, seed=20 + batch_size)
    reference = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    gpu = copy.deepcopy(model).to(CUDA)
    engine = Engine(Transformer(gpu), eos_token_ids=None)
    plain = engine.generate(prompts, MAX_NEW)
    assert [o.tokens for o in plain.outputs] == reference
    tree = engine.generate(prompts, MAX_NEW, MedusaProposer(random_heads(gpu), DEEP_TREE))
    assert [o.tokens for o in tree.outputs] == reference
    oracle = OnDevice(OracleProposer(DEEP_TREE, dict(enumerate(reference)), model.config.vocab_size))
    ragged = engine.generate(prompts, MAX_NEW, oracle)
    assert [o.tokens for o in ragged.outputs] == reference
    assert ragged.stats.mean_accepted > 1.5 and sum(c > 0 for c in ragged.stats.accept_hist) > 2


def greedy_drift(model, prompts: list[list[int]], proposer, max_new: int) -> list[dict]:
    """Where bf16 Medusa output parts from bf16 plain output: one entry per parted row, with the gap
    between the two tokens' logits there, computed in fp32 from the same (bf16-rounded) weights, relative
    to the spread of that position's logits. Tree and one-token passes round bf16 activations
    differently, so a near-tie may fall either way; a real defect parts rows at clear margins."""
    engine = Engine(Transformer(model), eos_token_ids=None)
    plain = engine.generate(prompts, max_new).outputs
    spec = engine.generate(prompts, max_new, proposer).outputs
    exact = copy.deepcopy(model).float()
    parted = []
    for r, (a, b) in enumerate(zip(plain, spec)):
        if a.tokens == b.tokens:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
        with torch.inference_mode():
            ids = torch.tensor([prompts[r] + a.tokens[:i]], device=model.device)
            logits = exact(ids).logits[0, -1].float()
        gap = float((logits[a.tokens[i]] - logits[b.tokens[i]]).abs())
        parted.append({"row": r, "position": i, "gap": gap,
                       "relative_gap": gap / float(logits.max() - logits.min())})
    return parted


# A parting where the two tokens' exact logits are further apart than this share of the logits' spread is
# not a rounding near-tie. bf16 carries 8 significant bits; the tree and one-token passes each round a
# few dozen times on the way to the logits.
NEAR_TIE = 0.03


def _check_drift(parted: list[dict], rows: int) -> None:
    assert all(p["relative_gap"] <= NEAR_TIE for p in parted), parted
    assert len(parted) <= rows // 2, parted  # partings are rare events, not the rule


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_greedy_bf16_drift_is_only_at_near_ties(device, record_property):
    from conftest import random_heads
    from test_engine import DEEP_TREE, MAX_NEW

    model = tiny_model("llama", seed=2).to(device, torch.bfloat16)
    prompts = mixed_prompts(8, seed=31)
    parted = greedy_drift(model, prompts, MedusaProposer(random_heads(model), DEEP_TREE), MAX_NEW)
    record_property("bf16_parted_rows", len(parted))
    print(f"bf16 on {device}: {len(parted)} of {len(prompts)} rows parted from plain decoding: {parted}")
    _check_drift(parted, len(prompts))


def test_drift_check_rejects_a_parting_at_a_clear_margin():
    with pytest.raises(AssertionError):
        _check_drift([{"row": 0, "position": 3, "gap": 2.0, "relative_gap": 0.2}], 8)
    with pytest.raises(AssertionError):
        _check_drift([{"row": r, "position": 1, "gap": 0.0, "relative_gap": 0.0} for r in range(5)], 8)


# ---- the step's host reads ------------------------------------------------------------------------------


@cuda
def test_a_greedy_medusa_step_waits_for_the_device_at_most_three_times():
    """The step's host synchronisations: the sampling flag (before any work is queued), the cache window
    (`int(lens.max())`, after the proposal) and the one read of counts and finish flags. Anything more
    was added since; the failure lists where each came from."""
    from conftest import random_heads
    from test_engine import DEEP_TREE

    model = tiny_model("llama").to(CUDA)
    engine = Engine(Transformer(model), eos_token_ids=None)
    proposer = MedusaProposer(random_heads(model), DEEP_TREE)
    batch = engine.new_batch(4, 128, 64)
    engine.add(batch, [0, 1, 2, 3], mixed_prompts(4, seed=3), 64)
    engine.step(batch, proposer)  # first step: tree buffers and kernels set up
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step(batch, proposer)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert batch.n == 4  # no row finished: no compaction reads
    assert 1 <= len(syncs) <= 3, syncs


# ---- sampled decoding -----------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("kind", ["plain", "tree", "chain", "typical"])
def test_sampling_on_cuda_has_the_target_distribution(kind):
    """Rejection acceptance on the GPU samples exactly the target's distribution (plain sampling, a Medusa
    tree, a chain drawn from a wrong distribution); the same test rejects typical acceptance there."""
    from medusa.decoding.sampling import SamplingParams
    from conftest import random_heads
    from test_sampling import PARAMS, SampledChain, chi_square_pvalue, exact_pairs, sample_pairs, small_model

    model = small_model()
    gpu = copy.deepcopy(model).to(CUDA)
    engine = Engine(Transformer(gpu), eos_token_ids=None)
    params = PARAMS
    proposer = None
    if kind in ("tree", "typical"):
        proposer = MedusaProposer(random_heads(gpu), load_tree("prior-8"))
    elif kind == "chain":
        proposer = OnDevice(SampledChain(3))
    if kind == "typical":
        params = SamplingParams(temperature=1.0, acceptance="typical", typical_epsilon=0.3, typical_delta=0.5)
    p = chi_square_pvalue(sample_pairs(engine, proposer, params), exact_pairs(model, params))
    assert p < 1e-6 if kind == "typical" else p > 1e-3


def test_chain_proposer_hands_over_on_the_batch_device():
    from test_sampling import SampledChain

    class FakeBatch:
        n = 3
        root = torch.zeros(3, dtype=torch.long, device="meta")

    drafted = OnDevice(SampledChain(3)).draft(FakeBatch())
    tokens, q = drafted.tokens, drafted.proposal
    assert tokens.device.type == q.device.type == "meta" and tokens.shape == (3, chain(3).size - 1)


# ---- the server -----------------------------------------------------------------------------------------


@cuda
def test_concurrent_streams_on_cuda_match_decoding_alone():
    """12 streaming clients (more than the 8 batch rows, every fourth sampling) against a server whose
    model is on the GPU: each greedy stream equals its prompt decoded alone."""
    pytest.importorskip("openai", reason="the server test needs the openai client (the `test` extra)")
    pytest.importorskip("uvicorn", reason="the server test needs uvicorn (the `serve` extra)")
    pytest.importorskip("fastapi", reason="the server test needs fastapi (the `serve` extra)")
    from test_serve import DYNAMIC_POLICY, check_concurrent_streams, serve, tiny_runtime

    tokenizer = _tokenizer()
    rt = tiny_runtime(tokenizer, device=CUDA)
    assert rt.model.device.type == CUDA.type
    with serve(rt, policy=DYNAMIC_POLICY, max_queue=64) as url:
        check_concurrent_streams(url, rt, tokenizer, 12)


def _tokenizer():
    """The embedded model's tokenizer; `MEDUSA_TEST_TOKENIZER=DIR` reads a saved copy instead (a GPU
    machine without network access that has not converted the embedded model)."""
    from transformers import AutoTokenizer

    saved = os.environ.get("MEDUSA_TEST_TOKENIZER")
    if saved:
        return AutoTokenizer.from_pretrained(saved)
    from medusa.errors import MedusaError
    from test_serve import embedded_tokenizer

    try:
        return embedded_tokenizer()
    except MedusaError as exc:
        if "could not download" not in str(exc):  # a broken tokenizer or conversion fails the test
            raise
        # Offline and not cached: say so instead of failing.
        pytest.skip(f"the embedded tokenizer is not available here ({exc}); set MEDUSA_TEST_TOKENIZER to a "
                    "saved copy")


# ---- training -------------------------------------------------------------------------------------------


def _training_prerequisites():
    for name in ("datasets", "safetensors", "yaml"):
        pytest.importorskip(name, reason=f"training needs {name} (the `train` extra)")


@cuda
def test_training_on_cuda_matches_the_cpu(tmp_path, monkeypatch):
    """One process training on the GPU (fp32, no TF32) computes the heads one process computes on the CPU."""
    _training_prerequisites()
    from test_train_distributed import _same_heads
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training
    from train_helpers import fake_distilled, save_tiny_model, write_config

    monkeypatch.setenv("WANDB_MODE", "disabled")
    model = save_tiny_model(tmp_path / "model")
    data = fake_distilled(tmp_path / "data", model, n=16)
    common = dict(max_steps=6, batch_size=32, grad_accum=2, checkpoint_every=100)
    on_gpu = load_config(write_config(tmp_path / "gpu.yaml", model, data, tmp_path / "gpu", **common))
    on_cpu = load_config(write_config(tmp_path / "cpu.yaml", model, data, tmp_path / "cpu", **common))
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        run_training(on_gpu)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: False)  # the reference: the same run on the CPU
        run_training(on_cpu)
    _same_heads(tmp_path / "cpu" / "heads", tmp_path / "gpu" / "heads", rtol=1e-3, atol=1e-4)


@cuda
def test_two_processes_on_two_gpus_match_one(tmp_path):
    """torchrun with two ranks, each on its own GPU (NCCL), computes the heads of one process."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices (one per rank), this machine has {torch.cuda.device_count()}")
    _training_prerequisites()
    from test_train_distributed import _launch, _same_heads
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training
    from train_helpers import fake_distilled, save_tiny_model, write_config

    model = save_tiny_model(tmp_path / "model")
    data = fake_distilled(tmp_path / "data", model, n=16)
    common = dict(max_steps=6, batch_size=32, grad_accum=2, checkpoint_every=100)
    run_training(load_config(write_config(tmp_path / "one.yaml", model, data, tmp_path / "one", **common)))
    proc = _launch(write_config(tmp_path / "two.yaml", model, data, tmp_path / "two", **common), 2, [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training in 2 processes (rank 0 on cuda:0)" in proc.stderr
    _same_heads(tmp_path / "one" / "heads", tmp_path / "two" / "heads", rtol=1e-3, atol=1e-4)


# ---- benchmarks/gpu_curve.py: the same code on the CPU with --tiny ---------------------------------------


def _gpu_curve():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_curve.py"
    spec = importlib.util.spec_from_file_location("gpu_curve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_curve_tiny_runs_and_predicts_from_its_curve(tmp_path, monkeypatch, capsys):
    """--tiny measures the whole (small) grid, writes it under $OUT, and its predicted speedups and
    crossovers are the formulas applied to what it measured and to the acceptance it read."""
    import json

    monkeypatch.setenv("OUT", str(tmp_path))
    curve = _gpu_curve()
    assert curve.main(["--tiny", "--device", "cpu", "--feature-tau", "2.5"]) == 0
    r = json.loads((tmp_path / "gpu_curve_tiny.json").read_text())
    assert "stops paying at B" in capsys.readouterr().out
    sizes = [1, 2, 4]
    grid = {(b, t): ms for b, t, ms in r["grid"]}
    assert r["batch_sizes"] == sizes and r["skipped_batch_sizes"] == []
    acc = r["acceptance"]
    shape = acc["feature"]
    trees = acc["medusa"]
    needed = {t["tree_size"] for t in trees.values()} | {acc["draft"]["k"] + 1, shape["nodes"] + 1}
    assert needed | {1, 2, 4} <= set(r["tokens"])
    assert set(grid) == {(b, t) for b in sizes for t in r["tokens"]} and min(grid.values()) > 0
    report = json.loads(curve.EVAL_JSON.read_text())["cost_model"]["acceptance"]
    assert acc["draft"]["tau"] == report["draft"]["tau"] and shape["tau"] == 2.5
    feature = {(b, t): ms for b, t, ms in r["feature_grid"]}
    for b in sizes:
        s = r["speedup"][str(b)]
        tree = trees[s["medusa_tree"]]
        heads = r["heads_ms"][str(b)]
        assert s["medusa"] == pytest.approx(tree["tau"] * grid[(b, 1)] / (grid[(b, tree["tree_size"])] + heads))
        drafting = feature[(b, 2)] + (shape["depth"] - 1) * feature[(b, shape["topk"])]
        assert s["feature"] == pytest.approx(2.5 * grid[(b, 1)] / (grid[(b, shape["nodes"] + 1)] + drafting))
        assert s["draft"] > 0
    for method in ("medusa", "feature", "draft"):
        stops = [b for b in sizes if r["speedup"][str(b)][method] <= 1]
        assert r["crossover"][method] == (stops[0] if stops else None)


def test_gpu_curve_budget_and_cpu_guard(tmp_path):
    import json

    curve = _gpu_curve()
    out = tmp_path / "c.json"
    assert curve.main(["--tiny", "--device", "cpu", "--budget-s", "0", "--batch-sizes", "1,2",
                       "--tokens", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["batch_sizes"] == [1] and r["skipped_batch_sizes"] == [2]  # the smallest B is always measured
    with pytest.raises(SystemExit):  # the full-size curve refuses the CPU
        curve.parse_args(["--device", "cpu"])
