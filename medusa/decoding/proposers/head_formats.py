"""The on-disk layouts of Medusa heads: reading and writing them, and finding a heads directory.

All are read by `read_heads` (detected from the files), and written by `write_heads`:
- ours: `heads.safetensors` + `heads.json`;
- Medusa v1 (FasterDecoding): `medusa_lm_head.pt` (what its loaders read; `.safetensors` is what its newer
  trainer writes, also read) + `config.json` with `medusa_num_heads` / `medusa_num_layers` /
  `base_model_name_or_path`; keys `{head}.{block}.linear.{weight,bias}` and `{head}.{num_layers}.weight`,
  a vocabulary projection per head;
- Medusa v2 (FasterDecoding, `version: "2"`): the same without the projection keys; each head goes through
  the target's own lm_head;
- vLLM's Medusa: `config.json` with `model_type: "medusa"`, `hidden_size`, `vocab_size`, `num_heads`,
  `num_hidden_layers`, `truncated_vocab_size`, `medusa_fc_bias`, `original_lm_head`, and `*.safetensors`
  with `blocks.{head}.layers.{block}.{weight,bias}`, `lm_heads.{head}.weight` (only `lm_heads.0.weight`
  when `original_lm_head`, one projection for all heads) and `token_map` (the token id of each projection
  row when `truncated_vocab_size` < `vocab_size`: our candidate vocabulary).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from medusa.decoding.proposers.heads import HeadsConfig, MedusaHeads
from medusa.errors import MedusaError
from medusa.io import write_atomic, write_json_atomic

MEDUSA_PT = "medusa_lm_head.pt"
MEDUSA_FILES = (MEDUSA_PT, "medusa_lm_head.safetensors")
VLLM_WEIGHTS = "model.safetensors"
# What a heads repository on the hub may hold, in any of the layouts above.
HUB_PATTERNS = ["*.json", "*.safetensors", MEDUSA_PT, "pytorch_model.bin", "trees/*.yaml"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def write_heads(heads: MedusaHeads, directory: Path, layout: str) -> Path:
    """Write `heads` into `directory` in `layout` (native, medusa or vllm), each file atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "native":
        tensors = {k: v.detach().cpu().clone() for k, v in heads.state_dict().items()}  # clone: shared projections
        write_atomic(directory / "heads.safetensors", lambda p: save_file(tensors, str(p)))
        write_json_atomic(directory / "heads.json", asdict(heads.config))
    elif layout == "medusa":
        tensors = medusa_state(heads)
        # torch.save keeps one copy of a tensor referenced by several heads (the shared lm_head).
        write_atomic(directory / MEDUSA_PT, lambda p: torch.save(tensors, p))
        write_json_atomic(directory / "config.json", medusa_config(heads))
    elif layout == "vllm":
        tensors = {k: v.contiguous().clone() for k, v in vllm_state(heads).items()}
        write_atomic(directory / VLLM_WEIGHTS, lambda p: save_file(tensors, str(p)))
        write_json_atomic(directory / "config.json", vllm_config(heads))
    else:
        raise MedusaError(f"unknown heads layout {layout!r} (choose native, medusa or vllm)")
    return directory


def medusa_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """FasterDecoding v1 keys: `{k}.{j}.linear.{weight,bias}` and the projection `{k}.{num_layers}.weight`.

    Its loaders read a projection per head; heads sharing the base lm_head write that lm_head for each
    (FasterDecoding's v2 loader ignores these keys and uses the target's own lm_head: the same matrix).
    A candidate vocabulary cannot be expressed: the projection covers the whole vocabulary."""
    if heads.lm_heads is not None and heads.candidate_ids is not None:
        raise MedusaError("the Medusa layout has no place for per-head projections over a candidate "
                          "vocabulary (heads read from a vLLM token_map checkpoint); export them as vllm")
    state = {}
    for k, block in enumerate(heads.blocks):
        for j, res in enumerate(block):
            state[f"{k}.{j}.linear.weight"] = res.linear.weight.detach().cpu()
            state[f"{k}.{j}.linear.bias"] = res.linear.bias.detach().cpu()
        state[f"{k}.{heads.config.num_layers}.weight"] = heads.projection(k)
    return state


def medusa_config(heads: MedusaHeads) -> dict:
    """The keys FasterDecoding's MedusaConfig reads (no model_type: its loader then takes the base model
    from base_model_name_or_path and the heads from medusa_lm_head.pt)."""
    return {"medusa_num_heads": heads.config.num_heads, "medusa_num_layers": heads.config.num_layers,
            "base_model_name_or_path": heads.config.base_model, "hidden_size": heads.config.hidden_size,
            "vocab_size": heads.config.vocab_size}


def vllm_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """The weight names vLLM's Medusa model loads: `blocks.{k}.layers.{j}.{weight,bias}`, the projection(s)
    `lm_heads.{k}.weight` (only `lm_heads.0.weight` with `original_lm_head`) over the candidate rows, and
    `token_map` (each row's token id) when the heads have a candidate vocabulary."""
    state = {}
    for k, block in enumerate(heads.blocks):
        for j, res in enumerate(block):
            state[f"blocks.{k}.layers.{j}.weight"] = res.linear.weight.detach().cpu()
            state[f"blocks.{k}.layers.{j}.bias"] = res.linear.bias.detach().cpu()
    ids = heads.candidate_ids.cpu() if heads.candidate_ids is not None else None
    for k in range(1 if heads.one_projection() else heads.config.num_heads):
        w = heads.projection(k)
        # Shared base lm_head: its candidate rows; own projections already hold only those rows.
        state[f"lm_heads.{k}.weight"] = w[ids] if ids is not None and heads.lm_heads is None else w
    if ids is not None:
        state["token_map"] = ids.clone()
    return state


def vllm_config(heads: MedusaHeads) -> dict:
    """vLLM's MedusaConfig keys. It renames every key holding both "num" and "heads" (or "layers") to
    num_heads (num_hidden_layers), so no other key may hold those words."""
    c = heads.config
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
            "truncated_vocab_size": c.candidates or c.vocab_size, "medusa_fc_bias": True,
            "original_lm_head": heads.one_projection(), "base_model_name_or_path": c.base_model}


def read_heads(directory: Path) -> MedusaHeads:
    """The heads in `directory`, in whichever layout its files are (checked as they are read)."""
    if (directory / "heads.json").exists():
        return _load_native(directory)
    cfg_path = directory / "config.json"
    if cfg_path.exists():
        meta = _read_json(cfg_path)
        if meta.get("model_type") == "medusa":
            return _load_vllm_layout(directory, meta, cfg_path)
        if "medusa_num_heads" in meta:
            return _load_medusa_layout(directory, meta, cfg_path)
        raise MedusaError(f"--heads: {cfg_path} describes no Medusa heads: no model_type \"medusa\" (vLLM) "
                          f"and no medusa_num_heads (FasterDecoding); model_type is {meta.get('model_type')!r}")
    raise MedusaError(f"--heads: {directory} holds no heads (expected heads.json or a Medusa config.json)")


def _load_native(directory: Path) -> MedusaHeads:
    config = _read_config(directory / "heads.json")
    path = directory / "heads.safetensors"
    if not path.exists():
        raise MedusaError(f"--heads: {path} is missing (its heads.json is there)")
    heads = MedusaHeads(config)
    state = _Tensors(path, _read_tensors(path))
    expected = heads.state_dict()
    for key, value in expected.items():
        state.get(key, tuple(value.shape), f" (as {directory / 'heads.json'} describes)")
    if unexpected := sorted(set(state.tensors) - set(expected)):
        raise MedusaError(f"--heads: {path} has {unexpected[0]}, which {directory / 'heads.json'} does not describe")
    heads.load_state_dict(state.tensors)
    return heads


def _load_medusa_layout(directory: Path, meta: dict, cfg_path: Path) -> MedusaHeads:
    """FasterDecoding v1 (a projection per head) or v2 (none: the target's lm_head)."""
    n_layers = _config_int(meta, "medusa_num_layers", cfg_path, default=1)
    declared = _config_int(meta, "medusa_num_heads", cfg_path)
    found = [directory / f for f in MEDUSA_FILES if (directory / f).exists()]
    if not found:
        raise MedusaError(f"--heads: {directory} has a Medusa config.json but no {' or '.join(MEDUSA_FILES)}")
    state = _Tensors(found[0], _read_tensors(found[0]))
    # Heads are counted in the weights: FasterDecoding's published v1 configs understate
    # medusa_num_heads (its own loader overrides the value).
    n_heads = 0
    while f"{n_heads}.0.linear.weight" in state.tensors:
        n_heads += 1
    if n_heads < declared:
        state.get(f"{n_heads}.0.linear.weight", why=f" ({cfg_path} says medusa_num_heads {declared})")
    w0 = state.get("0.0.linear.weight")
    hidden = w0.shape[-1]
    with_proj = [f"{k}.{n_layers}.weight" in state.tensors for k in range(n_heads)]
    own = any(with_proj)
    if own and not all(with_proj):  # some heads have a projection, some not: name the first missing one
        state.get(f"{with_proj.index(False)}.{n_layers}.weight", why=" (the other heads have one)")
    vocab = state.get(f"0.{n_layers}.weight").shape[0] if own else int(meta.get("vocab_size") or 0)
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=n_heads, num_layers=n_layers,
                         own_lm_head=own, base_model=str(meta.get("base_model_name_or_path") or ""))
    heads = MedusaHeads(config)
    for k in range(n_heads):
        for j in range(n_layers):
            heads.blocks[k][j].linear.weight.data.copy_(state.get(f"{k}.{j}.linear.weight", (hidden, hidden)))
            heads.blocks[k][j].linear.bias.data.copy_(state.get(f"{k}.{j}.linear.bias", (hidden,)))
        if own:
            heads.lm_heads[k].weight.data.copy_(state.get(f"{k}.{n_layers}.weight", (vocab, hidden)))
    return heads


def _load_vllm_layout(directory: Path, meta: dict, cfg_path: Path) -> MedusaHeads:
    hidden = _config_int(meta, "hidden_size", cfg_path)
    vocab = _config_int(meta, "vocab_size", cfg_path)
    n_heads = _config_int(meta, _vllm_count_key(meta, "heads", "num_heads"), cfg_path)
    n_layers = _config_int(meta, _vllm_count_key(meta, "layers", "num_hidden_layers"), cfg_path, default=1)
    rows = _config_int(meta, "truncated_vocab_size", cfg_path, default=vocab)
    if rows > vocab:
        raise MedusaError(f"--heads: {cfg_path}: truncated_vocab_size {rows} exceeds vocab_size {vocab}")
    bias, one_projection = bool(meta.get("medusa_fc_bias", False)), bool(meta.get("original_lm_head", False))
    state = _vllm_tensors(directory)
    ids = None
    if rows < vocab:
        ids = state.get("token_map", (rows,), f" ({cfg_path}: truncated_vocab_size {rows} < vocab_size {vocab})")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or \
                len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab) or len(torch.unique(ids)) != len(ids):
            raise MedusaError(f"--heads: {state.path}: token_map must hold {rows} distinct token ids "
                              f"below vocab_size {vocab}")
        ids = ids.to(torch.long)
    config = HeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=n_heads, num_layers=n_layers,
                         own_lm_head=True, candidates=rows if ids is not None else 0,
                         base_model=str(meta.get("base_model_name_or_path") or ""))
    heads = MedusaHeads(config)
    if one_projection:  # one matrix in every head's slot, as vLLM does
        heads.lm_heads = nn.ModuleList([heads.lm_heads[0]] * n_heads)
    for k in range(n_heads):
        for j in range(n_layers):
            lin = heads.blocks[k][j].linear
            lin.weight.data.copy_(state.get(f"blocks.{k}.layers.{j}.weight", (hidden, hidden)))
            lin.bias.data.zero_()
            if bias:
                lin.bias.data.copy_(state.get(f"blocks.{k}.layers.{j}.bias", (hidden,),
                                              f" ({cfg_path}: medusa_fc_bias true)"))
    keys = ["lm_heads.0.weight"] if one_projection else [f"lm_heads.{k}.weight" for k in range(n_heads)]
    if one_projection and "lm_heads.0.weight" not in state.tensors and "lm_head.weight" in state.tensors:
        keys = ["lm_head.weight"]
    for k, key in enumerate(keys):
        w = state.get(key)
        if w.dim() != 2 or w.shape[1] != hidden or w.shape[0] not in (rows, vocab):
            raise MedusaError(f"--heads: {state.path}: {key} has shape {list(w.shape)}, expected [{rows}, {hidden}]"
                              + (f" or [{vocab}, {hidden}]" if rows != vocab else ""))
        if ids is not None and w.shape[0] == vocab:
            w = w[ids]  # a full-vocabulary projection: keep the token_map rows, as vLLM does
        heads.lm_heads[k].weight.data.copy_(w)
    if ids is not None:
        heads.candidate_ids = ids.clone()
    return heads


def resolve_heads_dir(spec: str | Path) -> Path:
    """A local heads directory, or a hub repository id (`owner/name`) fetched into the hub cache when online."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise MedusaError(f"--heads: {spec} is not a directory")
        return path
    text = str(spec)
    if isinstance(spec, str) and _HUB_ID.fullmatch(text):
        return _fetch_heads(text)
    raise MedusaError(f"--heads: {spec} is not a directory, a hub id (owner/name), 'default' or 'none'")


def _fetch_heads(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise MedusaError(f"--heads: {repo_id} is no local directory, and huggingface_hub (to fetch it from the "
                          "hub) is not installed") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repository, no network: one line, whatever the cause
        raise MedusaError(f"--heads: {repo_id} is no local directory and could not be fetched from the hub "
                          f"({type(exc).__name__}: {_first_line(exc)})") from None


class _Tensors:
    """A checkpoint's tensors; a missing or misshapen one is an error naming the file and the key."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]):
        self.path, self.tensors = path, tensors

    def get(self, key: str, shape: tuple | None = None, why: str = "") -> torch.Tensor:
        if key not in self.tensors:
            raise MedusaError(f"--heads: {self.path} has no {key}{why}")
        t = self.tensors[key]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise MedusaError(f"--heads: {self.path}: {key} has shape {list(t.shape)}, expected {list(shape)}{why}")
        return t


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, foreign or pickled-code files: one line naming the file
        raise MedusaError(f"--heads: {path} cannot be read as a tensor file ({_first_line(exc)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise MedusaError(f"--heads: {path} holds no mapping of names to tensors")
    return state


def _vllm_tensors(directory: Path) -> _Tensors:
    """Every weights file of a vLLM checkpoint (safetensors first, as vLLM looks), merged; vLLM drops a
    `medusa_heads.` prefix from the names, and so does this."""
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin")) or sorted(directory.glob("*.pt"))
    if not files:
        raise MedusaError(f"--heads: {directory} has a vLLM Medusa config.json but no *.safetensors or *.bin weights")
    tensors = {}
    for f in files:
        tensors.update({k.replace("medusa_heads.", ""): v for k, v in _read_tensors(f).items()})
    return _Tensors(files[0] if len(files) == 1 else directory / f"*{files[0].suffix}", tensors)


def _vllm_count_key(meta: dict, noun: str, default: str) -> str:
    """The config key vLLM reads as num_{noun}: any key holding both "num" and `noun` (the last one wins)."""
    keys = [k for k in meta if "num" in k and noun in k]
    return keys[-1] if keys else default


def _config_int(meta: dict, key: str, path: Path, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise MedusaError(f"--heads: {path} has no {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MedusaError(f"--heads: {path}: {key} must be a positive integer, got {value!r}")
    return value


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MedusaError(f"--heads: {path} is not valid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MedusaError(f"--heads: cannot read {path} ({_first_line(exc)})") from None
    if not isinstance(data, dict):
        raise MedusaError(f"--heads: {path} is not a JSON object")
    return data


def _read_config(path: Path) -> HeadsConfig:
    data = _read_json(path)
    known = set(HeadsConfig.__dataclass_fields__)
    if unknown := set(data) - known:
        raise MedusaError(f"--heads: {path}: unknown keys {sorted(unknown)}")
    try:
        return HeadsConfig(**data)
    except TypeError as exc:
        raise MedusaError(f"--heads: {path}: {exc}") from None
