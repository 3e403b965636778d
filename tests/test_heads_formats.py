"""Heads in the layouts other projects read and write: vLLM's Medusa checkpoint, FasterDecoding's Medusa v1
(`medusa_lm_head.pt`, a projection per head) and v2 (`version: "2"`, no projection).

The checks read the exported files the way those loaders do, by the key names, shapes and config keys
they use (vllm/model_executor/models/medusa.py and vllm/transformers_utils/configs/medusa.py;
FasterDecoding/Medusa medusa/model/medusa_model.py and medusa_model_legacy.py), and compare the tokens
each head proposes from the same hidden states.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import conftest
from medusa.cli import main
from medusa.errors import MedusaError
from medusa.decoding.proposers.heads import MedusaHeads
from train_helpers import VOCAB, save_tiny_model

HIDDEN, HEADS, LAYERS = 64, 3, 2
CANDIDATES = torch.tensor([2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny target saved as a checkpoint directory, and the same model loaded."""
    from medusa.decoding.target.model import load_target

    directory = save_tiny_model(tmp_path_factory.mktemp("target") / "model")
    model, _ = load_target(str(directory), "fp32", "cpu")
    return directory, model


# The heads of these tests: HEADS heads of LAYERS blocks each.
random_heads = partial(conftest.random_heads, num_heads=HEADS, num_layers=LAYERS, std=0.2)


def saved(heads: MedusaHeads, directory: Path, base_model: str) -> Path:
    heads.config.base_model = base_model
    heads.save(directory)
    (directory / "eval.json").write_text(json.dumps({"rank_accuracy": [[0.5, 0.1]] * HEADS}))
    (directory / "trees").mkdir()
    (directory / "trees" / "tree-8.yaml").write_text("paths: [[0], [1], [0, 0]]\n")
    return directory


def hidden_states(n: int = 7, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


# ---- how the other loaders read the files (by their names, shapes and config keys) -------------------------
def vllm_config(directory: Path) -> dict:
    """vLLM's MedusaConfig.from_pretrained: every key holding "num" and "heads" ("layers") becomes num_heads
    (num_hidden_layers); truncated_vocab_size defaults to vocab_size."""
    raw = json.loads((directory / "config.json").read_text())
    cfg = {}
    for k, v in raw.items():
        if "num" in k and "heads" in k:
            k = "num_heads"
        elif "num" in k and "layers" in k:
            k = "num_hidden_layers"
        cfg[k] = v
    cfg.setdefault("truncated_vocab_size", cfg["vocab_size"])
    if cfg["truncated_vocab_size"] is None:
        cfg["truncated_vocab_size"] = cfg["vocab_size"]
    return cfg


def vllm_proposals(directory: Path, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """What vLLM's Medusa model computes from the checkpoint: residual blocks `x + SiLU(layers.j(x))`, one
    projection per head (or `lm_heads.0.weight` for all with original_lm_head), logits scattered into the
    full vocabulary through token_map; here the top-k of each head ([heads, n, k])."""
    cfg = vllm_config(directory)
    assert cfg["model_type"] == "medusa"
    w = {key.replace("medusa_heads.", ""): t for key, t in load_file(str(directory / "model.safetensors")).items()}
    token_map = w["token_map"] if cfg["truncated_vocab_size"] < cfg["vocab_size"] else None
    out = []
    for h in range(cfg["num_heads"]):
        x = hidden
        for j in range(cfg["num_hidden_layers"]):
            bias = w[f"blocks.{h}.layers.{j}.bias"] if cfg.get("medusa_fc_bias", False) else None
            x = x + F.silu(F.linear(x, w[f"blocks.{h}.layers.{j}.weight"], bias))
        proj = w["lm_heads.0.weight"] if cfg.get("original_lm_head", False) else w[f"lm_heads.{h}.weight"]
        if token_map is not None and proj.shape[0] > token_map.shape[0]:
            proj = proj[token_map]
        logits = F.linear(x, proj.float())
        if token_map is not None:
            full = torch.full((*logits.shape[:-1], cfg["vocab_size"]), float("-inf"))
            full[..., token_map] = logits
            logits = full
        out.append(logits.topk(k, dim=-1).indices)
    return torch.stack(out)


class ResBlock(torch.nn.Module):
    """FasterDecoding's ResBlock: `linear` inside, x + SiLU(linear(x))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + F.silu(self.linear(x))


def fasterdecoding_v1(directory: Path, model) -> torch.nn.ModuleList:
    """FasterDecoding's medusa_model.py: medusa_head[k] = Sequential(ResBlock x layers, Linear(H, V)), the state
    of medusa_lm_head.pt loaded into it (strictly here, so a stray or missing key fails)."""
    cfg = json.loads((directory / "config.json").read_text())
    assert "model_type" not in cfg  # its loader would then try to load a whole model from this directory
    vocab = model.config.vocab_size
    heads = torch.nn.ModuleList(
        torch.nn.Sequential(*[ResBlock(HIDDEN) for _ in range(cfg["medusa_num_layers"])],
                            torch.nn.Linear(HIDDEN, vocab, bias=False))
        for _ in range(cfg["medusa_num_heads"]))
    heads.load_state_dict(torch.load(directory / "medusa_lm_head.pt", map_location="cpu", weights_only=True))
    return heads


# ---- our heads -> vLLM -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("own, candidates", [(False, False), (False, True), (True, False)])
def test_vllm_export_has_the_names_shapes_and_config_vllm_reads(target, tmp_path, capsys, own, candidates):
    model_dir, model = target
    heads = random_heads(model, own=own, candidates=CANDIDATES if candidates else None)
    src = saved(heads, tmp_path / "heads", str(model_dir))
    out = tmp_path / "vllm"
    assert main(["export", "--heads", str(src), "--format", "vllm", "--out", str(out)]) == 0
    assert "exported" in capsys.readouterr().out

    cfg = json.loads((out / "config.json").read_text())
    rows = len(CANDIDATES) if candidates else VOCAB
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert {k: cfg[k] for k in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers",
                                "truncated_vocab_size", "medusa_fc_bias", "original_lm_head")} == {
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "num_heads": HEADS, "num_hidden_layers": LAYERS,
        "truncated_vocab_size": rows, "medusa_fc_bias": True, "original_lm_head": not own}
    # vLLM renames every key holding "num" and "heads"/"layers": no other key may hold them.
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]

    weights = load_file(str(out / "model.safetensors"))
    expected = {f"blocks.{k}.layers.{j}.{p}": [HIDDEN] * (2 if p == "weight" else 1)
                for k in range(HEADS) for j in range(LAYERS) for p in ("weight", "bias")}
    expected |= {f"lm_heads.{k}.weight": [rows, HIDDEN] for k in range(HEADS if own else 1)}
    if candidates:
        expected["token_map"] = [rows]
    assert {k: list(v.shape) for k, v in weights.items()} == expected
    if candidates:
        assert torch.equal(weights["token_map"], CANDIDATES)
        assert not weights["token_map"].is_floating_point()
    # Trees and eval.json travel along (vLLM reads only *.safetensors and config.json).
    assert (out / "trees" / "tree-8.yaml").exists() and (out / "eval.json").exists()
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]

    x = hidden_states()
    ours = heads.top_tokens(x, 3, HEADS)
    assert torch.equal(vllm_proposals(out, x, 3), ours)
    # ... and back: the vLLM checkpoint loads here and proposes the same tokens.
    back = MedusaHeads.load(out).attach(model)
    assert torch.equal(back.top_tokens(x, 3, HEADS), ours)
    assert back.tree().nodes == [(0,), (1,), (0, 0)]  # its own trees came along
    if not own and not candidates:
        # `--heads DIR` on a vLLM checkpoint: the runtime takes it for Medusa heads (not feature heads).
        from medusa.runtime import Runtime

        rt = Runtime.load(str(model_dir), heads=str(out), dtype="fp32", device="cpu")
        assert rt.feature is None and torch.equal(rt.heads.top_tokens(x, 3, HEADS), ours)


def test_vllm_checkpoint_variants_load(target, tmp_path):
    """What other tools write: a `medusa_heads.` prefix, no block bias, a full-vocabulary projection sliced by
    token_map, num keys spelled medusa_num_heads / medusa_num_layers."""
    _, model = target
    torch.manual_seed(1)
    w = {f"medusa_heads.blocks.{k}.layers.0.weight": torch.randn(HIDDEN, HIDDEN) * 0.2 for k in range(2)}
    w |= {f"medusa_heads.lm_heads.{k}.weight": torch.randn(VOCAB, HIDDEN) for k in range(2)}
    w["medusa_heads.token_map"] = CANDIDATES.clone()
    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "medusa", "hidden_size": HIDDEN, "vocab_size": VOCAB, "medusa_num_heads": 2,
        "medusa_num_layers": 1, "truncated_vocab_size": len(CANDIDATES)}))
    heads = MedusaHeads.load(tmp_path).attach(model)
    x = hidden_states()
    assert heads.config.num_heads == 2 and heads.config.candidates == len(CANDIDATES)
    assert torch.equal(heads.top_tokens(x, 3, 2), vllm_proposals(tmp_path, x, 3))
    assert torch.isin(heads.top_tokens(x, 3, 2), CANDIDATES).all()
    # Kept in our layout (projections over the candidate rows), and back to vLLM's: the same proposals.
    heads.save(tmp_path / "ours")
    again = MedusaHeads.load(tmp_path / "ours").attach(model)
    assert torch.equal(again.top_tokens(x, 3, 2), heads.top_tokens(x, 3, 2))
    again.save(tmp_path / "vllm-again", layout="vllm")
    assert torch.equal(vllm_proposals(tmp_path / "vllm-again", x, 3), heads.top_tokens(x, 3, 2))
    with pytest.raises(MedusaError, match="export them as vllm"):
        again.save(tmp_path / "medusa", layout="medusa")


# ---- our heads <-> FasterDecoding's Medusa layout ---------------------------------------------------------------
@pytest.mark.parametrize("own", [False, True])
def test_medusa_export_loads_in_fasterdecodings_v1_and_v2_models(target, tmp_path, own):
    model_dir, model = target
    heads = random_heads(model, own=own)
    src = saved(heads, tmp_path / "heads", str(model_dir))
    out = tmp_path / "medusa"
    assert main(["export", "--heads", str(src), "--format", "medusa", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["base_model_name_or_path"]) == (
        HEADS, LAYERS, str(model_dir))
    state = torch.load(out / "medusa_lm_head.pt", weights_only=True)
    expected = {f"{k}.{j}.linear.{p}": [HIDDEN] * (2 if p == "weight" else 1)
                for k in range(HEADS) for j in range(LAYERS) for p in ("weight", "bias")}
    expected |= {f"{k}.{LAYERS}.weight": [VOCAB, HIDDEN] for k in range(HEADS)}
    assert {k: list(v.shape) for k, v in state.items()} == expected
    assert not (out / "medusa_lm_head.safetensors").exists()

    x = hidden_states()
    ours = heads.top_tokens(x, 3, HEADS)
    v1 = fasterdecoding_v1(out, model)
    assert torch.equal(torch.stack([h(x) for h in v1]).topk(3, dim=-1).indices, ours)
    if not own:
        # FasterDecoding's v2 model: ResBlocks only (the projection keys are ignored), the base lm_head.
        v2 = torch.nn.ModuleList(torch.nn.Sequential(*[ResBlock(HIDDEN) for _ in range(LAYERS)]) for _ in range(HEADS))
        v2.load_state_dict(state, strict=False)
        assert torch.equal(torch.stack([model.lm_head(h(x)) for h in v2]).topk(3, dim=-1).indices, ours)
    back = MedusaHeads.load(out).attach(model)
    assert torch.equal(back.top_tokens(x, 3, HEADS), ours)


def test_medusa_export_says_it_drops_the_candidate_vocabulary(target, tmp_path, capsys):
    model_dir, model = target
    src = saved(random_heads(model, candidates=CANDIDATES), tmp_path / "heads", str(model_dir))
    assert main(["export", "--heads", str(src), "--format", "medusa", "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "no candidate vocabulary" in err and "12 candidates are dropped" in err


def write_fasterdecoding(directory: Path, heads: MedusaHeads, version2: bool, num_heads_in_config: int | None = None,
                         fmt: str = "pt") -> Path:
    """Heads as FasterDecoding's trainers write them: v1 with `{k}.{layers}.weight`, v2 (train_legacy.py:
    MedusaConfig(version="2") + the state of ResBlock-only heads) without."""
    directory.mkdir(parents=True, exist_ok=True)
    state = heads.medusa_state()
    if version2:
        state = {k: v for k, v in state.items() if "linear" in k}
    cfg = {"medusa_num_heads": num_heads_in_config or heads.config.num_heads,
           "medusa_num_layers": heads.config.num_layers, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
           "transformers_version": "4.34.0"}
    if version2:
        cfg["version"] = "2"
    (directory / "config.json").write_text(json.dumps(cfg))
    if fmt == "pt":
        torch.save({k: v.half() for k, v in state.items()}, directory / "medusa_lm_head.pt")
    else:
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(directory / "medusa_lm_head.safetensors"))
    return directory


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_fasterdecoding_v2_heads_bind_to_the_targets_lm_head(target, tmp_path, fmt):
    _, model = target
    heads = random_heads(model)
    d = write_fasterdecoding(tmp_path / "v2", heads, version2=True, fmt=fmt)
    loaded = MedusaHeads.load(d)
    assert loaded.lm_heads is None and loaded.config.vocab_size == 0  # learnt from the target on attach
    loaded.attach(model)
    assert loaded.config.vocab_size == VOCAB
    x = hidden_states()
    expected = heads.float().top_tokens(x, 3, HEADS) if fmt == "safetensors" else None
    if fmt == "pt":  # stored in fp16, as FasterDecoding's checkpoints are
        ref = random_heads(model)
        for p in ref.blocks.parameters():
            p.data = p.data.half().float()
        expected = ref.top_tokens(x, 3, HEADS)
    assert torch.equal(loaded.top_tokens(x, 3, HEADS), expected)


def test_fasterdecoding_v1_heads_keep_their_own_projections(target, tmp_path):
    _, model = target
    heads = random_heads(model, own=True)
    # FasterDecoding's published v1 configs understate medusa_num_heads; the weights say how many there are.
    d = write_fasterdecoding(tmp_path / "v1", heads, version2=False, num_heads_in_config=2, fmt="safetensors")
    loaded = MedusaHeads.load(d).attach(model)
    assert loaded.config.num_heads == HEADS and loaded.lm_heads is not None
    x = hidden_states()
    assert torch.equal(loaded.top_tokens(x, 3, HEADS), heads.top_tokens(x, 3, HEADS))
    # A v1 checkpoint exports to vLLM with its projections.
    out = tmp_path / "vllm"
    assert main(["export", "--heads", str(d), "--format", "vllm", "--out", str(out)]) == 0
    assert torch.equal(vllm_proposals(out, x, 3), heads.top_tokens(x, 3, HEADS))


def test_fasterdecoding_v2_heads_export_to_vllm_with_the_named_target(target, tmp_path, capsys):
    model_dir, model = target
    heads = random_heads(model)
    d = write_fasterdecoding(tmp_path / "v2", heads, version2=True, fmt="safetensors")
    out = tmp_path / "vllm"
    assert main(["export", "--heads", str(d), "--format", "vllm", "--out", str(out), "--model", str(model_dir)]) == 0
    x = hidden_states()
    assert torch.equal(vllm_proposals(out, x, 3), heads.top_tokens(x, 3, HEADS))
    assert main(["export", "--heads", str(d), "--format", "native", "--out", str(tmp_path / "n"),
                 "--model", str(model_dir)]) == 2
    assert "--model: only with --format vllm|medusa or --base-model" in capsys.readouterr().err


# ---- bad and foreign files: one line naming the file and the key ---------------------------------------------
def _vllm_dir(directory: Path, model, **config) -> Path:
    heads = random_heads(model)
    heads.save(directory, layout="vllm")
    if config:
        cfg = json.loads((directory / "config.json").read_text()) | config
        (directory / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return directory


def _drop(path: Path, key: str, replace: torch.Tensor | None = None) -> None:
    w = load_file(str(path))
    del w[key]
    if replace is not None:
        w[key] = replace
    save_file(w, str(path))


def _bad_layouts(d: Path, model) -> dict[str, tuple[Path, list[str]]]:
    """name -> (heads directory, words the one-line error must hold)."""
    cases = {}
    v = _vllm_dir(d / "v-missing", model)
    _drop(v / "model.safetensors", "blocks.1.layers.1.weight")
    cases["vllm missing block"] = (v, [str(v / "model.safetensors"), "blocks.1.layers.1.weight"])
    v = _vllm_dir(d / "v-shape", model)
    _drop(v / "model.safetensors", "lm_heads.0.weight", torch.zeros(5, HIDDEN))
    cases["vllm misshapen projection"] = (v, [str(v / "model.safetensors"), "lm_heads.0.weight", "[5, 64]"])
    v = _vllm_dir(d / "v-nomap", model, truncated_vocab_size=10)
    cases["vllm truncated without token_map"] = (v, [str(v / "model.safetensors"), "token_map"])
    v = _vllm_dir(d / "v-nohidden", model, hidden_size=None)
    cases["vllm config without hidden_size"] = (v, [str(v / "config.json"), "hidden_size"])
    v = _vllm_dir(d / "v-badheads", model, num_heads="three")
    cases["vllm non-integer num_heads"] = (v, [str(v / "config.json"), "num_heads", "'three'"])

    m = d / "m-garbage"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    (m / "medusa_lm_head.pt").write_bytes(b"not a checkpoint")
    cases["medusa unreadable .pt"] = (m, [str(m / "medusa_lm_head.pt"), "cannot be read"])
    m = write_fasterdecoding(d / "m-partial", random_heads(model, own=True), version2=False, fmt="safetensors")
    _drop(m / "medusa_lm_head.safetensors", f"1.{LAYERS}.weight")
    cases["medusa one projection missing"] = (m, [str(m / "medusa_lm_head.safetensors"), f"1.{LAYERS}.weight"])
    m = write_fasterdecoding(d / "m-fewer", random_heads(model), version2=True, num_heads_in_config=5, fmt="safetensors")
    cases["medusa fewer heads than its config"] = (m, [str(m / "medusa_lm_head.safetensors"), "3.0.linear.weight",
                                                       "medusa_num_heads 5"])
    m = d / "m-noweights"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"medusa_num_heads": 3}))
    cases["medusa without weights"] = (m, [str(m), "medusa_lm_head.pt"])

    f = d / "foreign"
    f.mkdir()
    (f / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))  # e.g. an EAGLE head
    cases["foreign config.json"] = (f, [str(f / "config.json"), "model_type", "medusa_num_heads"])
    j = d / "notjson"
    j.mkdir()
    (j / "config.json").write_text("{medusa_num_heads: 3")
    cases["config.json not JSON"] = (j, [str(j / "config.json"), "not valid JSON"])

    n = d / "n-shape"
    random_heads(model).save(n)
    _drop(n / "heads.safetensors", "blocks.2.0.linear.bias", torch.zeros(3))
    cases["ours misshapen"] = (n, [str(n / "heads.safetensors"), "blocks.2.0.linear.bias", "[3]"])
    n = d / "n-missing"
    random_heads(model).save(n)
    (n / "heads.safetensors").unlink()
    cases["ours without weights"] = (n, [str(n / "heads.safetensors"), "missing"])
    return cases


def test_bad_and_foreign_heads_are_one_line_errors_naming_file_and_key(target, tmp_path, capsys):
    _, model = target
    cases = _bad_layouts(tmp_path, model)
    for name, (directory, words) in cases.items():
        with pytest.raises(MedusaError) as info:
            MedusaHeads.load(directory)
        message = str(info.value)
        assert len(message.splitlines()) == 1, name
        assert all(w in message for w in words), (name, message)
    # Through the command line: exit status 2, one line.
    directory, words = cases["vllm missing block"]
    assert main(["export", "--heads", str(directory), "--format", "vllm", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words)
    assert not (tmp_path / "o").exists()


# ---- --heads as a hub id ------------------------------------------------------------------------------------------
def test_heads_from_a_hub_id_when_online(target, tmp_path, monkeypatch):
    """A hub id is fetched with huggingface_hub (here a stand-in returning a local snapshot)."""
    import huggingface_hub

    _, model = target
    heads = random_heads(model)
    snapshot = tmp_path / "snapshot"
    heads.save(snapshot, layout="vllm")
    asked = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        asked.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = MedusaHeads.load("someone/medusa-heads").attach(model)
    assert asked[0][0] == "someone/medusa-heads" and "medusa_lm_head.pt" in asked[0][1]
    assert loaded.directory == snapshot
    x = hidden_states()
    assert torch.equal(loaded.top_tokens(x, 3, HEADS), heads.top_tokens(x, 3, HEADS))


def test_heads_hub_id_offline_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing cached
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["export", "--heads", "someone/medusa-heads", "--format", "vllm", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--heads: someone/medusa-heads is no local directory and could not be fetched from the hub" in err
    with pytest.raises(MedusaError, match="not a directory, a hub id"):
        MedusaHeads.load("no/such/dir")
