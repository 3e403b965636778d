"""Medusa heads: small residual MLPs on the target's last hidden state, one per look-ahead distance.

Head k (0-based) predicts the token k+2 positions after the hidden state's own position (the target's
lm_head predicts k+1 = 1). Each head is `num_layers` blocks x + SiLU(Linear(x)) (Linear zero-initialised,
so an untrained head starts as the base model's own next-token guess) followed by a vocabulary projection:
the frozen base lm_head (shared, the default: ~0.33 M parameters per head on a 576-wide model) or the
head's own copy initialised from it (the original Medusa layout).

On-disk layouts, all loaded by `MedusaHeads.load` (detected from the files):
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
`save(directory, layout)` writes ours, `medusa` (v1) or `vllm`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from medusa.errors import MedusaError
from medusa.io import ASSETS, write_atomic, write_json_atomic

SHIPPED_DIR = ASSETS / "heads"


@dataclass
class HeadsConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = False
    base_model: str = ""
    # > 0: the heads propose only these many token ids (the most frequent in their training answers,
    # stored as `candidate_ids`), so a proposal reads that slice of the vocabulary matrix, not all of it.
    candidates: int = 0


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: HeadsConfig, base_lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads))
        self.lm_heads = None
        if config.own_lm_head:
            # With a candidate vocabulary (loaded from a vLLM checkpoint's token_map) each projection has
            # only the candidates' rows.
            rows = config.candidates or config.vocab_size
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, rows, bias=False)
                                          for _ in range(config.num_heads))
            if base_lm_head is not None and rows == config.vocab_size:
                for head in self.lm_heads:
                    head.weight.data.copy_(base_lm_head.weight.data)
        # Kept outside the module tree so that the frozen base weights are never saved or trained here.
        self._base = [base_lm_head]
        self.register_buffer("candidate_ids", torch.zeros(config.candidates, dtype=torch.long)
                             if config.candidates else None)
        self._candidate_proj: nn.Module | None = None
        # Where these heads were loaded from: their trees (`trees/`) and eval.json sit next to them.
        self.directory: Path | None = None

    def set_candidates(self, ids: torch.Tensor | None) -> None:
        """Restrict proposals to `ids` (None: the whole vocabulary)."""
        if ids is not None and self.lm_heads is not None:
            raise MedusaError("a candidate vocabulary needs heads that share the base lm_head")
        self.config.candidates = 0 if ids is None else len(ids)
        self.candidate_ids = None if ids is None else ids.to(torch.long).clone()
        self._candidate_proj = None

    @property
    def base_lm_head(self) -> nn.Module:
        if self._base[0] is None:
            raise MedusaError("these heads share the base lm_head: attach them with heads.attach(model)")
        return self._base[0]

    def use_projection(self, weight: torch.Tensor) -> "MedusaHeads":
        """Bind a [vocab, hidden] matrix as the shared projection without a model (e.g. the target's lm_head
        read from its checkpoint, to export heads in a layout that stores the projection)."""
        if self.config.vocab_size == 0:  # Medusa v2 heads learn their vocabulary size from the target
            self.config.vocab_size = weight.shape[0]
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise MedusaError(f"the projection is {list(weight.shape)}, these heads need "
                              f"[{self.config.vocab_size}, {self.config.hidden_size}]")
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        lin.weight.data = weight.detach()
        self._base = [lin.requires_grad_(False)]
        self._candidate_proj = None
        return self

    def attach(self, model: nn.Module) -> "MedusaHeads":
        """Check the heads fit `model` and bind its lm_head as the shared projection."""
        hidden, vocab = model.config.hidden_size, model.get_output_embeddings().weight.shape[0]
        if self.config.vocab_size == 0:  # Medusa v2 heads learn their vocabulary size from the target
            self.config.vocab_size = vocab
        if (self.config.hidden_size, self.config.vocab_size) != (hidden, vocab):
            raise MedusaError(
                f"heads were made for hidden size {self.config.hidden_size} and vocabulary "
                f"{self.config.vocab_size}, but the model has hidden size {hidden} and vocabulary {vocab}")
        self._base = [model.get_output_embeddings()]
        self._candidate_proj = None
        ids = self.candidate_ids
        if ids is not None and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            raise MedusaError(f"heads' candidate_ids reach outside the model's vocabulary of {vocab}")
        p = model.get_output_embeddings().weight
        return self.to(device=p.device, dtype=p.dtype)  # integer buffers keep their dtype

    def forward(self, hidden: torch.Tensor, projection: nn.Module | None = None,
                num_heads: int | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [num_heads, ..., V].

        `projection` may stand in for the shared base lm_head (e.g. the engine's packed copy of it).
        All shared-projection heads go through it in one matmul, so the vocabulary matrix, the largest
        weight of a small model, is read once per step rather than once per head.
        """
        blocks = self.blocks[: num_heads or len(self.blocks)]
        if self.lm_heads is not None:
            logits = torch.stack([self.lm_heads[k](block(hidden)) for k, block in enumerate(blocks)])
            if self.candidate_ids is None:
                return logits
            # Projections over the candidates only: every other token can never be proposed.
            full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
            full[..., self.candidate_ids] = logits
            return full
        return (projection or self.base_lm_head)(torch.stack([block(hidden) for block in blocks]))

    @torch.inference_mode()
    def top_tokens(self, hidden: torch.Tensor, k: int, num_heads: int,
                   projection: nn.Module | None = None) -> torch.Tensor:
        """Each head's k most likely next tokens: hidden [n, H] -> token ids [num_heads, n, k]."""
        if self.candidate_ids is None:
            return self(hidden, projection, num_heads).topk(k, dim=-1).indices
        if self.lm_heads is not None:
            h = [self.lm_heads[i](block(hidden)) for i, block in enumerate(self.blocks[:num_heads])]
            return self.candidate_ids[torch.stack(h).topk(k, dim=-1).indices]
        if self._candidate_proj is None:
            from medusa.decoding.transformer import _packed

            weight = self.base_lm_head.weight.detach()[self.candidate_ids]
            lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
            lin.weight.data.copy_(weight)
            self._candidate_proj = _packed(lin.requires_grad_(False))
        h = torch.stack([block(hidden) for block in self.blocks[:num_heads]])
        return self.candidate_ids[self._candidate_proj(h).topk(k, dim=-1).indices]

    # ---- saving and loading -------------------------------------------------------------------
    def save(self, directory: str | Path, medusa_layout: bool = False, layout: str | None = None) -> Path:
        """Write atomically: a reader never sees a half-written checkpoint.

        `layout`: `native` (ours, the default), `medusa` (FasterDecoding v1: `medusa_lm_head.pt` +
        `config.json`) or `vllm` (`model.safetensors` + `config.json`); `medusa_layout=True` means `medusa`.
        The last two store a vocabulary projection, so heads that share the base lm_head need it bound
        (`attach` or `use_projection`).
        """
        layout = layout or ("medusa" if medusa_layout else "native")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if layout == "native":
            tensors = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}  # clone: shared projections
            write_atomic(directory / "heads.safetensors", lambda p: save_file(tensors, str(p)))
            write_json_atomic(directory / "heads.json", asdict(self.config))
        elif layout == "medusa":
            tensors = self.medusa_state()
            # torch.save keeps one copy of a tensor referenced by several heads (the shared lm_head).
            write_atomic(directory / MEDUSA_PT, lambda p: torch.save(tensors, p))
            write_json_atomic(directory / "config.json", self.medusa_config())
        elif layout == "vllm":
            tensors = {k: v.contiguous().clone() for k, v in self.vllm_state().items()}
            write_atomic(directory / VLLM_WEIGHTS, lambda p: save_file(tensors, str(p)))
            write_json_atomic(directory / "config.json", self.vllm_config())
        else:
            raise MedusaError(f"unknown heads layout {layout!r} (choose native, medusa or vllm)")
        return directory

    def _projection(self, k: int) -> torch.Tensor:
        proj = self.lm_heads[k] if self.lm_heads is not None else self.base_lm_head
        return proj.weight.detach().cpu()

    def medusa_state(self) -> dict[str, torch.Tensor]:
        """FasterDecoding v1 keys: `{k}.{j}.linear.{weight,bias}` and the projection `{k}.{num_layers}.weight`.

        Its loaders read a projection per head; heads sharing the base lm_head write that lm_head for each
        (FasterDecoding's v2 loader ignores these keys and uses the target's own lm_head: the same matrix).
        A candidate vocabulary cannot be expressed: the projection covers the whole vocabulary."""
        if self.lm_heads is not None and self.candidate_ids is not None:
            raise MedusaError("the Medusa layout has no place for per-head projections over a candidate "
                              "vocabulary (heads read from a vLLM token_map checkpoint); export them as vllm")
        state = {}
        for k, block in enumerate(self.blocks):
            for j, res in enumerate(block):
                state[f"{k}.{j}.linear.weight"] = res.linear.weight.detach().cpu()
                state[f"{k}.{j}.linear.bias"] = res.linear.bias.detach().cpu()
            state[f"{k}.{self.config.num_layers}.weight"] = self._projection(k)
        return state

    def medusa_config(self) -> dict:
        """The keys FasterDecoding's MedusaConfig reads (no model_type: its loader then takes the base model
        from base_model_name_or_path and the heads from medusa_lm_head.pt)."""
        return {"medusa_num_heads": self.config.num_heads, "medusa_num_layers": self.config.num_layers,
                "base_model_name_or_path": self.config.base_model, "hidden_size": self.config.hidden_size,
                "vocab_size": self.config.vocab_size}

    def _one_projection(self) -> bool:
        """All heads go through one projection (the shared base lm_head, or one module in every slot)."""
        return self.lm_heads is None or all(h is self.lm_heads[0] for h in self.lm_heads)

    def vllm_state(self) -> dict[str, torch.Tensor]:
        """The weight names vLLM's Medusa model loads: `blocks.{k}.layers.{j}.{weight,bias}`, the projection(s)
        `lm_heads.{k}.weight` (only `lm_heads.0.weight` with `original_lm_head`) over the candidate rows, and
        `token_map` (each row's token id) when the heads have a candidate vocabulary."""
        state = {}
        for k, block in enumerate(self.blocks):
            for j, res in enumerate(block):
                state[f"blocks.{k}.layers.{j}.weight"] = res.linear.weight.detach().cpu()
                state[f"blocks.{k}.layers.{j}.bias"] = res.linear.bias.detach().cpu()
        ids = self.candidate_ids.cpu() if self.candidate_ids is not None else None
        for k in range(1 if self._one_projection() else self.config.num_heads):
            w = self._projection(k)
            # Shared base lm_head: its candidate rows; own projections already hold only those rows.
            state[f"lm_heads.{k}.weight"] = w[ids] if ids is not None and self.lm_heads is None else w
        if ids is not None:
            state["token_map"] = ids.clone()
        return state

    def vllm_config(self) -> dict:
        """vLLM's MedusaConfig keys. It renames every key holding both "num" and "heads" (or "layers") to
        num_heads (num_hidden_layers), so no other key may hold those words."""
        c = self.config
        return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
                "truncated_vocab_size": c.candidates or c.vocab_size, "medusa_fc_bias": True,
                "original_lm_head": self._one_projection(), "base_model_name_or_path": c.base_model}

    @property
    def trees_dir(self) -> Path | None:
        """The trees built for these heads (`<directory>/trees`), if they have any."""
        trees = self.directory / "trees" if self.directory is not None else None
        return trees if trees is not None and trees.is_dir() else None

    def tree(self, spec: "str | Path | list | None" = None):
        """A tree by name, resolved against these heads' own trees first; None: their default tree."""
        from medusa.decoding.tree import DEFAULT_TREE, load_tree

        return load_tree(DEFAULT_TREE if spec is None else spec, heads_dir=self.directory)

    @classmethod
    def load(cls, directory: str | Path) -> "MedusaHeads":
        """Load any layout from a directory, a hub id (when online) or `default` (the shipped heads)."""
        directory = SHIPPED_DIR if str(directory) == "default" else resolve_heads_dir(directory)
        heads = cls._load_layout(directory)
        heads.directory = directory
        return heads

    @classmethod
    def _load_layout(cls, directory: Path) -> "MedusaHeads":
        if (directory / "heads.json").exists():
            return cls._load_native(directory)
        cfg_path = directory / "config.json"
        if cfg_path.exists():
            meta = _read_json(cfg_path)
            if meta.get("model_type") == "medusa":
                return cls._load_vllm_layout(directory, meta, cfg_path)
            if "medusa_num_heads" in meta:
                return cls._load_medusa_layout(directory, meta, cfg_path)
            raise MedusaError(f"--heads: {cfg_path} describes no Medusa heads: no model_type \"medusa\" (vLLM) "
                              f"and no medusa_num_heads (FasterDecoding); model_type is {meta.get('model_type')!r}")
        raise MedusaError(f"--heads: {directory} holds no heads (expected heads.json or a Medusa config.json)")

    @classmethod
    def _load_native(cls, directory: Path) -> "MedusaHeads":
        config = _read_config(directory / "heads.json")
        path = directory / "heads.safetensors"
        if not path.exists():
            raise MedusaError(f"--heads: {path} is missing (its heads.json is there)")
        heads = cls(config)
        state = _Tensors(path, _read_tensors(path))
        expected = heads.state_dict()
        for key, value in expected.items():
            state.get(key, tuple(value.shape), f" (as {directory / 'heads.json'} describes)")
        if unexpected := sorted(set(state.tensors) - set(expected)):
            raise MedusaError(f"--heads: {path} has {unexpected[0]}, which {directory / 'heads.json'} does not describe")
        heads.load_state_dict(state.tensors)
        return heads

    @classmethod
    def _load_medusa_layout(cls, directory: Path, meta: dict, cfg_path: Path) -> "MedusaHeads":
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
        heads = cls(config)
        for k in range(n_heads):
            for j in range(n_layers):
                heads.blocks[k][j].linear.weight.data.copy_(state.get(f"{k}.{j}.linear.weight", (hidden, hidden)))
                heads.blocks[k][j].linear.bias.data.copy_(state.get(f"{k}.{j}.linear.bias", (hidden,)))
            if own:
                heads.lm_heads[k].weight.data.copy_(state.get(f"{k}.{n_layers}.weight", (vocab, hidden)))
        return heads

    @classmethod
    def _load_vllm_layout(cls, directory: Path, meta: dict, cfg_path: Path) -> "MedusaHeads":
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
        heads = cls(config)
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


MEDUSA_PT = "medusa_lm_head.pt"
MEDUSA_FILES = (MEDUSA_PT, "medusa_lm_head.safetensors")
VLLM_WEIGHTS = "model.safetensors"
# What a heads repository on the hub may hold, in any of the layouts above.
HUB_PATTERNS = ["*.json", "*.safetensors", MEDUSA_PT, "pytorch_model.bin", "trees/*.yaml"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


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
