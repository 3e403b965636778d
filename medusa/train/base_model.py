"""`medusa export --base-model DIR`: the target written in a layout transformers 4.x reads, for other loaders
(FasterDecoding's Medusa and SafeAILab's EAGLE code pin transformers 4.x)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from medusa.errors import MedusaError
from medusa.io import atomic_dir

# Bytes per element of the safetensors dtypes (for the index's total_size).
_ST_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
WEIGHTS_INDEX = "model.safetensors.index.json"
_MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt")


def write_base_model(model: str, out: Path) -> Path:
    """Write target `model` (`default`, a folder, a .gguf file or a hub id) to `out`, atomically, in a layout
    transformers 4.x reads (what FasterDecoding's and SafeAILab/EAGLE's loaders run on): config.json with
    `rope_theta` (transformers 5 keeps it under `rope_parameters`), tokenizer_config.json with
    `tokenizer_class: PreTrainedTokenizerFast`, tokenizer.json with BPE merges as "a b" strings, and a
    model.safetensors.index.json mapping every tensor to its file (EAGLE reads the embeddings through it)."""
    from medusa.decoding.target.model import resolve_model_dir

    where = resolve_model_dir(model)
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise MedusaError(f"--base-model: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").exists():
        raise MedusaError(f"--base-model: {out} is a non-empty directory that holds no model; name a new or "
                          "empty one")
    src = Path(where)
    if src.is_dir() and (out.resolve().is_relative_to(src.resolve()) or src.resolve().is_relative_to(out.resolve())):
        raise MedusaError(f"--base-model: {out} must not be the model's own folder {src}, inside it or above it")

    def fill(tmp: Path) -> None:
        if src.is_dir() and any(src.glob("*.safetensors")):
            for pattern in _MODEL_FILES:
                for f in src.glob(pattern):
                    if f.is_file() and f.name != "medusa_source.json":
                        shutil.copy2(f, tmp / f.name)
        else:  # a hub id, or a folder of .bin weights: load and save (transformers writes safetensors)
            from medusa.decoding.target.model import load_target

            hf_model, tokenizer = load_target(model, "fp32", "cpu")
            hf_model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        legacy_model_files(tmp)

    return atomic_dir(out, fill)


def legacy_model_files(d: Path) -> None:
    """Rewrite the model folder `d` (as transformers 5 saves it) so that transformers 4.x reads it too."""
    from medusa.decoding.proposers.feature_formats import rope_fields
    from medusa.io import write_json_atomic

    cfg = json.loads((d / "config.json").read_text())
    try:
        cfg.update(rope_fields(cfg))
    except MedusaError as exc:
        raise MedusaError(f"--base-model: {exc}") from None
    if "dtype" in cfg and "torch_dtype" not in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    write_json_atomic(d / "config.json", cfg)

    if (d / "tokenizer.json").is_file():
        tok = json.loads((d / "tokenizer.json").read_text())
        m = tok.get("model") or {}
        if m.get("type") == "BPE" and m.get("merges"):
            merges = []
            for pair in m["merges"]:
                if isinstance(pair, list):
                    if len(pair) != 2 or any(" " in part for part in pair):
                        raise MedusaError(f"--base-model: the tokenizer's BPE merge {pair!r} cannot be written "
                                          "as an \"a b\" string")
                    pair = " ".join(pair)
                merges.append(pair)
            m["merges"] = merges
            write_json_atomic(d / "tokenizer.json", tok)
        tc_path = d / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        tc.pop("backend", None)
        if "chat_template" not in tc and (d / "chat_template.jinja").is_file():
            tc["chat_template"] = (d / "chat_template.jinja").read_text()  # 4.x before 4.43 reads it here
        write_json_atomic(tc_path, tc)

    files = sorted(d.glob("*.safetensors"))
    if files and not (d / WEIGHTS_INDEX).is_file():
        from safetensors import safe_open

        weight_map, total = {}, 0
        for f in files:
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    sl = st.get_slice(key)
                    n = 1
                    for dim in sl.get_shape():
                        n *= dim
                    total += n * _ST_BYTES.get(sl.get_dtype(), 4)
                    weight_map[key] = f.name
        write_json_atomic(d / WEIGHTS_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
