"""`medusa export` for other loaders: the keys their readers take from each config.json, the base model they
are pointed at, what `--heads` names, and a copy of the target that transformers 4.x reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from medusa.cli import main
from train_helpers import VOCAB, save_tiny_model

ROPE_THETA = 123456.0  # not transformers' default (10000), so a value taken from the wrong place shows
# The config keys SafeAILab/EAGLE's reader (EConfig + its Llama layer and Model) reads.
EAGLE_KEYS = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "hidden_act",
              "max_position_embeddings", "rms_norm_eps", "pad_token_id", "vocab_size", "pretraining_tp",
              "rope_theta", "rope_scaling", "bias", "num_hidden_layers"}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """The tiny model with a rotary base of ROPE_THETA, kept as transformers 5 writes it (rope_parameters)."""
    d = save_tiny_model(tmp_path_factory.mktemp("target") / "model")
    cfg = json.loads((d / "config.json").read_text())
    assert "rope_theta" not in cfg, "transformers 5 keeps the rotary base under rope_parameters"
    cfg["rope_parameters"]["rope_theta"] = ROPE_THETA
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def feature_head_dir(directory: Path, model_dir: Path, style: str = "eagle1", preferred: bool = False) -> Path:
    """A (random) feature head for the model in `model_dir`, in our layout, as a training run leaves it."""
    from transformers import AutoModelForCausalLM

    from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    if style == "eagle3":
        cfg = FeatureHeadConfig(64, VOCAB, 5, style="eagle3", feature_layers=[1, 1, 2], own_lm_head=True)
        head = FeatureHead(cfg, model, torch.tensor([0, 3, 5, 50, 96]))
    else:
        head = FeatureHead(FeatureHeadConfig(64, VOCAB, VOCAB), model)
    head.save(directory, meta={"preferred": True} if preferred else None)
    (directory / "train_config.yaml").write_text(yaml.safe_dump({"model": str(model_dir)}))
    return directory


def medusa_heads_dir(directory: Path, num_heads: int = 3, base_model: str = "") -> Path:
    from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads

    torch.manual_seed(0)
    MedusaHeads(HeadsConfig(hidden_size=64, vocab_size=VOCAB, num_heads=num_heads, own_lm_head=True,
                            base_model=base_model)).save(directory)
    return directory


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ---- 1. EAGLE configs carry the target's rotary base ------------------------------------------------------
@pytest.mark.parametrize("fmt, style", [("eagle", "eagle1"), ("eagle3", "eagle3")])
def test_eagle_config_carries_rope_theta_and_what_eagle_reads(tmp_path, target_dir, fmt, style, capsys):
    src = feature_head_dir(tmp_path / "head", target_dir, style)
    assert main(["export", "--heads", str(src), "--format", fmt, "--out", str(tmp_path / "out")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert EAGLE_KEYS <= set(cfg), EAGLE_KEYS - set(cfg)
    assert cfg["rope_theta"] == ROPE_THETA and cfg["rope_scaling"] is None
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == 64
    if fmt == "eagle3":
        assert cfg["draft_vocab_size"] == 5 and cfg["bias"] is False
        assert "EAGLE's code feeds an EAGLE-3 head layers" in capsys.readouterr().err  # [1, 1, 2] are not its own
    else:
        assert cfg["bias"] is True  # EAGLE-1's fc has a bias, which its reader takes from this key


def test_rope_fields_from_either_spelling():
    from medusa.decoding.proposers.feature_formats import rope_fields
    from medusa.errors import MedusaError

    assert rope_fields({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}) == \
        {"rope_theta": 1e5, "rope_scaling": None}
    assert rope_fields({"rope_theta": 5e5, "rope_scaling": None}) == {"rope_theta": 5e5, "rope_scaling": None}
    linear = rope_fields({"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}})
    assert linear["rope_scaling"]["type"] == "linear" and linear["rope_scaling"]["factor"] == 2.0
    with pytest.raises(MedusaError, match="rope_theta"):
        rope_fields({"hidden_size": 8})


# ---- 2. the Medusa layout names its base model so that another machine finds it ---------------------------
def test_medusa_base_model_is_an_absolute_folder_or_the_given_base(tmp_path, target_dir, monkeypatch, capsys):
    src = medusa_heads_dir(tmp_path / "heads", num_heads=3)
    monkeypatch.chdir(target_dir.parent)
    assert main(["export", "--heads", str(src), "--format", "medusa", "--out", str(tmp_path / "m"),
                 "--model", target_dir.name]) == 0  # a relative folder
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(target_dir.resolve())
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
    err = capsys.readouterr().err
    assert "always builds 5" in err and "heads 4..5" in err and "non-strictly" in err
    for base, expected in (("owner/some-model", "owner/some-model"), ("default", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                           (target_dir.name, str(target_dir.resolve()))):
        assert main(["export", "--heads", str(src), "--format", "medusa", "--out", str(tmp_path / "m"),
                     "--model", str(target_dir), "--base", base]) == 0
        assert json.loads((tmp_path / "m" / "config.json").read_text())["base_model_name_or_path"] == expected
    capsys.readouterr()
    assert main(["export", "--heads", str(src), "--format", "medusa", "--out", str(tmp_path / "m2"),
                 "--base", "no such thing"]) == 2
    assert "--base" in one_line_error(capsys) and not (tmp_path / "m2").exists()
    assert main(["export", "--heads", str(src), "--out", str(tmp_path / "n"), "--base", "owner/x"]) == 2
    assert "--base: only the medusa and vllm formats" in one_line_error(capsys)


def test_embedded_names_become_the_hub_id():
    from medusa.train.export import EMBEDDED_HUB_ID, base_name

    assert EMBEDDED_HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_name("default") == base_name("SmolLM2-135M-Instruct") == EMBEDDED_HUB_ID
    assert base_name("owner/name") == "owner/name"


def test_five_heads_need_no_note(tmp_path, target_dir, capsys):
    src = medusa_heads_dir(tmp_path / "heads", num_heads=5, base_model=str(target_dir))
    assert main(["export", "--heads", str(src), "--format", "medusa", "--out", str(tmp_path / "m")]) == 0
    assert "always builds" not in capsys.readouterr().err
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 5 and cfg["base_model_name_or_path"] == str(target_dir.resolve())


# ---- 3. --heads default|medusa|feature mean the same in export as in generate -------------------------------
@pytest.fixture
def shipped_both(tmp_path, target_dir, monkeypatch):
    """Stand-ins for both shipped heads; the feature heads marked preferred, as the real ones are."""
    import medusa.decoding.proposers.heads
    import medusa.runtime.feature

    medusa_dir = medusa_heads_dir(tmp_path / "shipped-medusa", base_model=str(target_dir))
    feature_dir = feature_head_dir(tmp_path / "shipped-feature", target_dir, preferred=True)
    monkeypatch.setattr(medusa.decoding.proposers.heads, "SHIPPED_DIR", medusa_dir)
    monkeypatch.setattr(medusa.runtime.feature, "SHIPPED_FEATURE_DIR", feature_dir)
    return medusa_dir, feature_dir


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_heads_names_mean_the_shipped_heads_generate_loads(tmp_path, shipped_both, target_dir, capsys):
    from transformers import AutoModelForCausalLM

    from medusa.runtime.feature import resolve_feature

    medusa_dir, feature_dir = shipped_both
    assert main(["export", "--heads", "feature", "--format", "eagle", "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "config.json").read_text())["rope_theta"] == ROPE_THETA
    assert main(["export", "--heads", "default", "--out", str(tmp_path / "d")]) == 0
    assert _files(tmp_path / "d") == _files(feature_dir)  # the preferred feature heads, as generate drafts with
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    assert resolve_feature("default", hf).directory == feature_dir
    assert main(["export", "--heads", "medusa", "--out", str(tmp_path / "m")]) == 0
    assert _files(tmp_path / "m") == _files(medusa_dir)

    capsys.readouterr()
    for heads, fmt in (("default", "vllm"), ("feature", "medusa"), ("medusa", "eagle"), (str(medusa_dir), "eagle3")):
        assert main(["export", "--heads", heads, "--format", fmt, "--out", str(tmp_path / "bad")]) == 2
        err = one_line_error(capsys)
        assert "--heads" in err and f"--format {fmt}" in err, err
        assert not (tmp_path / "bad").exists()


def test_default_is_the_medusa_heads_when_the_feature_heads_are_not_preferred(tmp_path, shipped_both):
    medusa_dir, feature_dir = shipped_both
    info = json.loads((feature_dir / "heads.json").read_text())
    (feature_dir / "heads.json").write_text(json.dumps({**info, "preferred": False}))
    assert main(["export", "--heads", "default", "--format", "vllm", "--out", str(tmp_path / "v")]) == 0
    assert json.loads((tmp_path / "v" / "config.json").read_text())["num_heads"] == 3


# ---- 5. a copy of the target that transformers 4.x reads -----------------------------------------------------
def _with_bpe_tokenizer(model_dir: Path, out: Path) -> Path:
    """`model_dir` with a small byte-level BPE tokenizer (transformers 5 writes its merges as pairs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir, out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / f).unlink(missing_ok=True)
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "Ġ": 4, "ab": 5, "Ġa": 6, "abc": 7}
    merges = [("a", "b"), ("Ġ", "a"), ("ab", "c")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>").save_pretrained(out)
    assert isinstance(json.loads((out / "tokenizer.json").read_text())["model"]["merges"][0], list)
    return out


def test_base_model_copy_reads_in_transformers_4(tmp_path, target_dir, capsys):
    from safetensors import safe_open

    src = _with_bpe_tokenizer(target_dir, tmp_path / "bpe-model")
    out = tmp_path / "base"
    assert main(["export", "--base-model", str(out), "--model", str(src)]) == 0
    assert "transformers 4.x" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == ROPE_THETA and cfg["rope_scaling"] is None and cfg["torch_dtype"]
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    merges = json.loads((out / "tokenizer.json").read_text())["model"]["merges"]
    assert merges == ["a b", "Ġ a", "ab c"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored, total = {}, 0
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                stored[key] = f.name
                total += st.get_tensor(key).nbytes
    assert stored and index["weight_map"] == stored and index["metadata"]["total_size"] == total
    assert "model.embed_tokens.weight" in index["weight_map"]  # what EAGLE's embedding loader looks up
    # transformers 5 still reads it, to the same tokens
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("abc ab").input_ids == AutoTokenizer.from_pretrained(src)("abc ab").input_ids


def test_base_model_beside_an_export_names_it(tmp_path, target_dir, capsys):
    src = medusa_heads_dir(tmp_path / "heads", base_model=str(target_dir))
    assert main(["export", "--heads", str(src), "--format", "medusa", "--out", str(tmp_path / "m"),
                 "--base-model", str(tmp_path / "base")]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert (tmp_path / "base" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("args, flag", [(["--heads", "medusa"], "--out"), (["--out", "x"], "--heads"), ([], "--heads"),
                                        (["--base-model", "b", "--to-shipped", "--heads", "medusa"], "--base-model")])
def test_export_flag_errors_name_the_flag(tmp_path, monkeypatch, capsys, args, flag):
    monkeypatch.chdir(tmp_path)
    assert main(["export", *args]) == 2
    assert one_line_error(capsys).split("error: ", 1)[-1].startswith(flag)


def test_base_model_refuses_a_folder_of_other_files(tmp_path, target_dir, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("keep me")
    assert main(["export", "--base-model", str(tmp_path / "notes"), "--model", str(target_dir)]) == 2
    assert "--base-model" in one_line_error(capsys)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "keep me"


# ---- the embedded model, end to end ---------------------------------------------------------------------------
@pytest.mark.slow
def test_shipped_exports_for_the_embedded_model(tmp_path, capsys):
    """The shipped feature heads as EAGLE-1 with the embedded model's rotary base (1e5), the shipped Medusa
    heads as FasterDecoding's layout naming the hub id, and the embedded model for transformers 4.x."""
    assert main(["export", "--heads", "feature", "--format", "eagle", "--out", str(tmp_path / "e"),
                 "--base-model", str(tmp_path / "base")]) == 0
    assert json.loads((tmp_path / "e" / "config.json").read_text())["rope_theta"] == 100000.0
    base = tmp_path / "base"
    assert json.loads((base / "config.json").read_text())["rope_theta"] == 100000.0
    merges = json.loads((base / "tokenizer.json").read_text())["model"]["merges"]
    assert merges and all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges)
    assert "model.embed_tokens.weight" in json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    assert main(["export", "--heads", "medusa", "--format", "medusa", "--out", str(tmp_path / "m")]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "always builds 5" in capsys.readouterr().err
