"""Other projects' loaders read our exports.

1. vLLM's Medusa model: the parameter names of a `--format vllm` export against vLLM's name mapping,
   written down below as data (cheap; no vLLM install).
2. The released reference code, each in a side virtual environment built from PyPI by
   `scripts/reference_envs.sh` (cached under ~/.cache/medusa/refenv): FasterDecoding/Medusa (medusa-llm 0.1,
   transformers 4.36.2) reads a `--format medusa` export, SafeAILab/EAGLE (eagle-llm 1.2.1, transformers
   4.53.3) reads a `--format eagle` export. A driver in tests/reference/ runs their code, unmodified, on CPU in
   fp32 and answers with how the keys loaded, the heads' logits on inputs computed here, and what their own
   decoding loop generated, which must be plain greedy decoding's tokens.

The PyPI releases are older than the projects' current code: medusa-llm 0.1 builds as many heads as
config.json says (not always 5) and sizes its KV cache by attention heads (no grouped-query attention);
eagle-llm 1.2.1 reads EAGLE-1 heads only, from pytorch_model.bin (see tests/reference/eagle_driver.py).
The reference runs use a tiny random Llama target (saved by transformers 5, rewritten for transformers 4.x by
`medusa export --base-model`): both released loaders build their base model with their own copy of the Llama
code, whose rotary embedding always uses base 10000 (they ignore `rope_theta`), so they compute SmolLM2
(rope_theta 1e5) as a different model; the tiny target keeps the default base, on which their base model and
ours agree. MEDUSA_REFERENCE_TESTS=0 skips the reference runs (they need PyPI the first time, about two
minutes on two cores, and ~2.2 GB of disk).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, random_heads
from medusa.cli import main
from train_helpers import VOCAB, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DRIVERS = Path(__file__).resolve().parent / "reference"
NEW_TOKENS = 24
TOL = 1e-4  # the same head on the same hidden states: only summation order differs
# Their base model against ours, relative to the hidden states' largest value: two implementations of the model
# (transformers 4.x and their own attention code against transformers 5 and SDPA), whose kernels differ by CPU.
# They agree to ~5e-7 of the scale on an AVX-512 Xeon and to ~2.5e-4 on another CI machine; a weight read in
# the wrong layout (a rotary permutation, a transposed projection) is off by the order of the scale itself.
BASE_RTOL = 2e-3

# ---- 1. vLLM's Medusa layout ---------------------------------------------------------------------------------
# How vLLM's Medusa model (vllm/model_executor/models/medusa.py, `Medusa.__init__` and `load_weights`, at
# vllm-project/vllm@01dbb08195ca9c70ac9044786a906a353e07fcdf, unchanged at 09cddad8f0324594022359cd2b07e962a14b895f)
# and its config (vllm/transformers_utils/configs/medusa.py @0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f) name and
# load a checkpoint. Anything that maps to no parameter is dropped without a word, so the test requires every
# exported tensor to land somewhere.
VLLM_MEDUSA = {
    "strip_prefix": "medusa_heads.",          # removed from every checkpoint name first
    # parameters of the model, for head k < num_heads and layer j < num_hidden_layers
    "block_weight": "blocks.{k}.layers.{j}.weight",   # [hidden, hidden]
    "block_bias": "blocks.{k}.layers.{j}.bias",       # [hidden], only when config.medusa_fc_bias
    "head_weight": "lm_heads.{k}.weight",             # [truncated_vocab_size, hidden], without original_lm_head
    "shared_weight": "lm_head.weight",                # one projection, with config.original_lm_head
    # checkpoint name -> parameter, with config.original_lm_head
    "original_lm_head_renames": {"lm_heads.0.weight": "lm_head.weight"},
    # a buffer, taken only when truncated_vocab_size < vocab_size: the token id of each projection row; a
    # projection with more rows than token_map is cut to those rows on loading
    "token_map": "token_map",
    # config keys it reads; a key holding "num" and "heads" becomes num_heads, "num" and "layers"
    # num_hidden_layers (so no other key may hold those words)
    "config_keys": {"hidden_size", "vocab_size", "num_heads", "num_hidden_layers", "truncated_vocab_size"},
    "config_optional": {"medusa_fc_bias": False, "original_lm_head": False},
}


def vllm_params(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The parameters (name -> shape before vocabulary padding) vLLM's Medusa model builds from `cfg`."""
    m, h = VLLM_MEDUSA, cfg["hidden_size"]
    rows = cfg.get("truncated_vocab_size") or cfg["vocab_size"]
    params = {}
    for k in range(cfg["num_heads"]):
        for j in range(cfg["num_hidden_layers"]):
            params[m["block_weight"].format(k=k, j=j)] = (h, h)
            if cfg.get("medusa_fc_bias", m["config_optional"]["medusa_fc_bias"]):
                params[m["block_bias"].format(k=k, j=j)] = (h,)
        if not cfg.get("original_lm_head", m["config_optional"]["original_lm_head"]):
            params[m["head_weight"].format(k=k)] = (rows, h)
    if cfg.get("original_lm_head", m["config_optional"]["original_lm_head"]):
        params[m["shared_weight"]] = (rows, h)
    return params


def vllm_config(raw: dict) -> dict:
    """config.json as vLLM's MedusaConfig.from_pretrained reads it (its key renaming, then its defaults)."""
    cfg = {}
    for key, value in raw.items():
        if "num" in key and "heads" in key:
            key = "num_heads"
        elif "num" in key and "layers" in key:
            key = "num_hidden_layers"
        cfg[key] = value
    cfg.setdefault("truncated_vocab_size", cfg.get("vocab_size"))
    return cfg


def vllm_load(raw_cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Which parameter each checkpoint tensor fills under VLLM_MEDUSA (cut to token_map's rows where vLLM
    cuts it), and the names it would drop."""
    m, cfg = VLLM_MEDUSA, vllm_config(raw_cfg)
    params = vllm_params(cfg)
    truncated = cfg["truncated_vocab_size"] < cfg["vocab_size"]
    loaded, dropped, token_map = {}, [], None
    for name, t in tensors.items():
        name = name.replace(m["strip_prefix"], "")
        if name == m["token_map"]:
            if truncated:
                token_map = t
            else:
                dropped.append(name)
        elif name in params:
            loaded[name] = t
        elif cfg.get("original_lm_head") and name in m["original_lm_head_renames"]:
            loaded[m["original_lm_head_renames"][name]] = t
        else:
            dropped.append(name)
    if token_map is not None:
        loaded = {k: (t[token_map] if "lm_head" in k and t.shape[0] > len(token_map) else t) for k, t in loaded.items()}
        loaded["token_map"] = token_map
    return loaded, dropped


@pytest.mark.parametrize("own, layers, candidates", [(False, 1, None), (True, 1, None), (True, 2, None),
                                                     (False, 1, torch.tensor([3, 5, 8, 13, 21, 34]))])
def test_vllm_export_names_are_what_vllm_loads(tmp_path, own, layers, candidates):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(tmp_path / "target")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    heads = random_heads(model, num_heads=3, num_layers=layers, own=own, candidates=candidates)
    heads.config.base_model = str(model_dir)  # where the export reads the shared projection from
    src = heads.save(tmp_path / "heads")
    assert main(["export", "--heads", str(src), "--format", "vllm", "--out", str(tmp_path / "v")]) == 0
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "v" / "model.safetensors"))

    cfg = vllm_config(raw)
    assert VLLM_MEDUSA["config_keys"] <= set(cfg), VLLM_MEDUSA["config_keys"] - set(cfg)
    assert [k for k in raw if "num" in k] == [k for k in raw if k in ("num_heads", "num_hidden_layers")], \
        "a key vLLM would rename to num_heads / num_hidden_layers"
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, layers, 64, VOCAB)
    assert raw["model_type"] == "medusa"

    loaded, dropped = vllm_load(raw, tensors)
    assert dropped == [], f"vLLM would drop {dropped}"
    params = vllm_params(cfg)
    assert sorted(set(params) - set(loaded)) == [], "parameters vLLM would leave uninitialised"
    assert {k: tuple(loaded[k].shape) for k in params} == params
    if candidates is not None:
        assert cfg["truncated_vocab_size"] == len(candidates) and torch.equal(loaded["token_map"], candidates)
    else:
        assert cfg["truncated_vocab_size"] == cfg["vocab_size"] and "token_map" not in loaded

    # The loaded parameters compute our heads' logits (on the proposable rows).
    hidden = torch.randn(5, 64)
    with torch.no_grad():
        ours = heads(hidden)
        for k in range(3):
            x = hidden
            for j in range(layers):
                b = loaded.get(VLLM_MEDUSA["block_bias"].format(k=k, j=j))
                x = x + torch.nn.functional.silu(x @ loaded[VLLM_MEDUSA["block_weight"].format(k=k, j=j)].T
                                                 + (b if b is not None else 0))
            w = loaded[VLLM_MEDUSA["shared_weight"]] if cfg.get("original_lm_head") else \
                loaded[VLLM_MEDUSA["head_weight"].format(k=k)]
            theirs = x @ w.T
            want = ours[k] if candidates is None else ours[k][:, candidates]
            torch.testing.assert_close(theirs, want, rtol=0, atol=1e-5)


def test_vllm_mapping_refuses_what_vllm_would_drop():
    """The check above catches a misnamed tensor (vLLM skips it silently)."""
    cfg = {"hidden_size": 4, "vocab_size": 7, "num_heads": 1, "num_hidden_layers": 1, "medusa_fc_bias": True,
           "original_lm_head": True}
    good = {"blocks.0.layers.0.weight": torch.zeros(4, 4), "blocks.0.layers.0.bias": torch.zeros(4),
            "lm_heads.0.weight": torch.zeros(7, 4)}
    assert vllm_load(cfg, good)[1] == [] and set(vllm_load(cfg, good)[0]) == set(vllm_params(cfg))
    assert vllm_load(cfg, {**good, "blocks.0.linear.weight": torch.zeros(4, 4)})[1] == ["blocks.0.linear.weight"]
    assert vllm_load({**cfg, "original_lm_head": False}, good)[0].keys() == set(good)


# ---- 2. the released reference loaders ---------------------------------------------------------------------------
def _reference_gate():
    flag = os.environ.get("MEDUSA_REFERENCE_TESTS", "1")
    return pytest.mark.skipif(flag == "0", reason="MEDUSA_REFERENCE_TESTS=0: the reference-loader runs (side "
                                                  "environments from PyPI, scripts/reference_envs.sh) are off")


reference = _reference_gate()


def reference_python(name: str) -> str:
    """The interpreter of side environment `name`, built on first use (a build failure fails the test with
    pip's own words: a missing release, no network)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "reference_envs.sh"), name], capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)})
    if proc.returncode != 0:
        pytest.fail(f"scripts/reference_envs.sh {name} failed:\n{proc.stderr[-4000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"{name} "), proc.stdout
    return line.split(" ", 1)[1]


def run_driver(python: str, driver: str, req: dict, tmp: Path) -> dict:
    """Run tests/reference/<driver> in a side environment: offline, without this repository on its path."""
    torch.save({"threads": 2, **req}, tmp / "request.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_HOME=str(tmp / "hf-home"))
    proc = subprocess.run([python, str(DRIVERS / driver), str(tmp / "request.pt"), str(tmp / "answer.pt")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    answer = torch.load(tmp / "answer.pt", weights_only=False) if (tmp / "answer.pt").exists() else None
    if proc.returncode != 0 or answer is None or "error" in answer:
        pytest.fail(f"{driver} failed (rc {proc.returncode}): {answer and answer.get('error')}\n{proc.stderr[-4000:]}")
    return answer


def save_target(directory: Path, kv_heads: int) -> Path:
    """A tiny random Llama like the other tests' (word-level tokenizer; eos id 1), with `kv_heads` key/value
    heads: medusa-llm 0.1's KV cache has a slot per attention head, so its decoding loop runs only on models
    without grouped-query attention (kv_heads == 4 here; SmolLM2's 9 heads share 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    # special tokens that no word contains (an added token is matched inside words: "t1" would split "t10")
    vocab = {"<unk>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(directory)
    return directory


def make_target(d: Path, kv_heads: int) -> dict:
    """The tiny target (transformers 5 layout), its copy for transformers 4.x, the model, and two prompts
    whose greedy continuations avoid the tokenizer's special ids (0 unk, 1 eos), with those continuations."""
    from transformers import AutoModelForCausalLM

    model_dir = save_target(d / "target", kv_heads)
    base_dir = d / "base"
    assert main(["export", "--base-model", str(base_dir), "--model", str(model_dir)]) == 0
    assert json.loads((base_dir / "config.json").read_text())["rope_theta"] == 10000.0  # see the module doc
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(7)
    prompts, greedy = [], []
    while len(prompts) < 2:
        p = torch.randint(2, VOCAB, (5 + 4 * len(prompts),), generator=g).tolist()
        out = hf_greedy(model, p, NEW_TOKENS + 16)
        if not {0, 1} & set(out):
            prompts.append(p)
            greedy.append(out)
    # greedy text to fit the heads on (the two test prompts among it), so that drafts get accepted and
    # their loops take the accepting paths too
    train = [p + out for p, out in zip(prompts, greedy)]
    for _ in range(6):
        p = torch.randint(2, VOCAB, (6,), generator=g).tolist()
        train.append(p + hf_greedy(model, p, 40))
    return {"dir": model_dir, "base": base_dir, "model": model, "prompts": prompts, "greedy": greedy,
            "train": torch.tensor([t[: min(map(len, train))] for t in train])}


def fit(params, loss_fn, steps: int = 150, lr: float = 1e-2) -> float:
    opt = torch.optim.Adam([p for p in params if p.requires_grad], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _last_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def _report(name: str, **values) -> None:
    print(f"\n[{name}] " + ", ".join(f"{k}={v}" for k, v in values.items()))


def _check_generated(answer: dict, target: dict) -> None:
    # the heads were fitted to this text: some drafts must be accepted, or the accepting paths went untested
    assert min(answer["steps"]) < NEW_TOKENS - 2, f"their loop took {answer['steps']} steps: no drafts accepted"
    for prompt, got, want in zip(target["prompts"], answer["generated"], target["greedy"]):
        assert len(got) >= NEW_TOKENS, (prompt, got)
        assert got == want[: len(got)], f"prompt {prompt}: their loop wrote {got}, greedy decoding {want[:len(got)]}"


@reference
@pytest.mark.slow
def test_fasterdecoding_medusa_reads_the_medusa_export(tmp_path):
    target = make_target(tmp_path / "target", kv_heads=4)
    model = target["model"]
    heads = random_heads(model, num_heads=3, num_layers=1, std=0.1, seed=3)
    seqs = target["train"]
    with torch.no_grad():
        hid = model.model(input_ids=seqs).last_hidden_state

    def loss():  # head k at position t: the token at t + k + 2
        logits = heads(hid)
        return sum(torch.nn.functional.cross_entropy(logits[k, :, : -(k + 2)].reshape(-1, VOCAB),
                                                     seqs[:, k + 2:].reshape(-1)) for k in range(3))
    fit(heads.parameters(), loss)
    src = heads.save(tmp_path / "heads")
    out = tmp_path / "export"
    assert main(["export", "--heads", str(src), "--format", "medusa", "--out", str(out),
                 "--model", str(target["dir"]), "--base", str(target["base"])]) == 0
    assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == str(target["base"].resolve())

    seq = target["prompts"][0] + target["greedy"][0][:8]
    hidden = _last_hidden(model, seq)
    with torch.no_grad():
        ours = heads(hidden)
    python = reference_python("medusa")
    answer = run_driver(python, "medusa_driver.py", {
        "heads": str(out), "hidden": hidden, "prompts": target["prompts"], "new_tokens": NEW_TOKENS,
        "choices": [1, 4, 3, 2]}, tmp_path)

    keys = answer["keys"]
    assert (keys["missing"], keys["unexpected"], keys["wrong_shape"]) == ([], [], []), keys
    assert len(keys["loaded_equal"]) == 9 and answer["num_heads"] == 3  # 3 heads x (linear w, b, projection)
    _check_logits_and_decoding("medusa-llm", answer, "head_logits", ours, model, target)


@reference
@pytest.mark.slow
def test_safeailab_eagle_reads_the_eagle_export(tmp_path):
    from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig

    target = make_target(tmp_path / "target", kv_heads=2)
    model = target["model"]
    torch.manual_seed(5)
    head = FeatureHead(FeatureHeadConfig(64, VOCAB, VOCAB, style="eagle1"), model)
    seqs = target["train"]
    with torch.no_grad():
        feats_all = model.model(input_ids=seqs).last_hidden_state[:, :-2]
        emb_all = model.get_input_embeddings()(seqs[:, 1:-1])
    positions = torch.arange(feats_all.shape[1])[None].expand(len(seqs), -1)

    def loss():  # (f_s, x_{s+1}) -> x_{s+2}
        out = head.layer_forward(emb_all, head.inputs(emb_all, feats_all, fused=True), positions, None)
        return torch.nn.functional.cross_entropy(head.logits(out).reshape(-1, VOCAB), seqs[:, 2:].reshape(-1))
    fit(head.parameters(), loss)
    src = head.save(tmp_path / "head")
    (src / "train_config.yaml").write_text(f"model: {target['dir']}\n")
    out = tmp_path / "export"
    assert main(["export", "--heads", str(src), "--format", "eagle", "--out", str(out)]) == 0

    seq = target["prompts"][1] + target["greedy"][1][:8]
    feats = _last_hidden(model, seq)[:-1]          # f_s at positions 0..T-1
    tokens = torch.tensor(seq[1:])                  # paired with x_{s+1}
    with torch.no_grad():
        emb = model.get_input_embeddings()(tokens)[None]
        x = head.inputs(emb, feats[None], fused=True)
        ours = head.logits(head.layer_forward(emb, x, torch.arange(len(seq) - 1)[None], None))[0]
    python = reference_python("eagle")
    answer = run_driver(python, "eagle_driver.py", {
        "head": str(out), "base": str(target["base"]), "features": feats, "tokens": tokens,
        "prompts": target["prompts"], "new_tokens": NEW_TOKENS}, tmp_path)

    keys = answer["keys"]
    assert (keys["missing"], keys["unexpected"], keys["wrong_shape"]) == ([], [], []), keys
    assert keys["filled"] == ["embed_tokens.weight"] and keys["load_missing"] == ["embed_tokens.weight"]
    assert keys["load_unexpected"] == [] and answer["bias"] is True
    _check_logits_and_decoding("eagle-llm", answer, "draft_logits", ours, model, target)


def _check_logits_and_decoding(name: str, answer: dict, key: str, ours, model, target) -> None:
    """Their `key` logits (within TOL) and their base model's last hidden state (within BASE_RTOL) against ours,
    and their own decoding loop's output against plain greedy decoding."""
    diff = (answer[key] - ours).abs().max().item()
    base = _last_hidden(model, target["prompts"][0])
    base_diff = (answer["base_hidden"] - base).abs().max().item() / base.abs().max().item()
    _report(name, versions=answer["versions"], **{f"{key}_max_abs_diff": f"{diff:.3g}"},
            base_hidden_max_rel_diff=f"{base_diff:.3g}", steps=answer["steps"],
            tokens=[len(g) for g in answer["generated"]])
    assert answer[key].shape == ours.shape
    assert diff <= TOL, f"their {key} differ from ours by {diff:.3g} (> {TOL})"
    assert base_diff <= BASE_RTOL, f"their base model's hidden states differ from ours by {base_diff:.3g} of the scale"
    _check_generated(answer, target)
