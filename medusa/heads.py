"""Medusa heads: small residual MLPs on the target's last hidden state, one per look-ahead distance.

Head k (0-based) predicts the token k+2 positions after the hidden state's own position (the target's
lm_head predicts k+1 = 1). Each head is `num_layers` blocks x + SiLU(Linear(x)) (Linear zero-initialised,
so an untrained head starts as the base model's own next-token guess) followed by a vocabulary projection:
the frozen base lm_head (shared, the default: ~0.33 M parameters per head on a 576-wide model) or the
head's own copy initialised from it (the original Medusa layout).

Two on-disk layouts:
- ours: `heads.safetensors` + `heads.json`;
- the original Medusa layout: `medusa_lm_head.safetensors` (or `.pt`) + `config.json` with
  `medusa_num_heads` / `medusa_num_layers`, keys `{head}.{block}.linear.{weight,bias}` and
  `{head}.{num_layers}.weight` for the projection.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .errors import MedusaError

SHIPPED_DIR = Path(__file__).resolve().parent / "assets" / "heads"


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
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                                          for _ in range(config.num_heads))
            if base_lm_head is not None:
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

    def attach(self, model: nn.Module) -> "MedusaHeads":
        """Check the heads fit `model` and bind its lm_head as the shared projection."""
        hidden, vocab = model.config.hidden_size, model.get_output_embeddings().weight.shape[0]
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
            return torch.stack([self.lm_heads[k](block(hidden)) for k, block in enumerate(blocks)])
        return (projection or self.base_lm_head)(torch.stack([block(hidden) for block in blocks]))

    @torch.inference_mode()
    def top_tokens(self, hidden: torch.Tensor, k: int, num_heads: int,
                   projection: nn.Module | None = None) -> torch.Tensor:
        """Each head's k most likely next tokens: hidden [n, H] -> token ids [num_heads, n, k]."""
        if self.candidate_ids is None:
            return self(hidden, projection, num_heads).topk(k, dim=-1).indices
        if self._candidate_proj is None:
            from .transformer import _packed

            weight = self.base_lm_head.weight.detach()[self.candidate_ids]
            lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
            lin.weight.data.copy_(weight)
            self._candidate_proj = _packed(lin.requires_grad_(False))
        h = torch.stack([block(hidden) for block in self.blocks[:num_heads]])
        return self.candidate_ids[self._candidate_proj(h).topk(k, dim=-1).indices]

    # ---- saving and loading -------------------------------------------------------------------
    def save(self, directory: str | Path, medusa_layout: bool = False) -> Path:
        """Write atomically: a reader never sees a half-written checkpoint."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if medusa_layout:
            tensors, meta = self._medusa_state(), {
                "medusa_num_heads": self.config.num_heads, "medusa_num_layers": self.config.num_layers,
                "base_model_name_or_path": self.config.base_model, "hidden_size": self.config.hidden_size,
                "vocab_size": self.config.vocab_size}
            files = ("medusa_lm_head.safetensors", "config.json")
        else:
            tensors, meta = self.state_dict(), asdict(self.config)
            files = ("heads.safetensors", "heads.json")
        tensors = {k: v.detach().cpu().clone() for k, v in tensors.items()}  # clone: shared projections
        _atomic(directory / files[0], lambda p: save_file(tensors, str(p)))
        _atomic(directory / files[1], lambda p: Path(p).write_text(json.dumps(meta, indent=2) + "\n"))
        return directory

    def _medusa_state(self) -> dict[str, torch.Tensor]:
        state = {}
        for k, block in enumerate(self.blocks):
            for j, res in enumerate(block):
                state[f"{k}.{j}.linear.weight"] = res.linear.weight
                state[f"{k}.{j}.linear.bias"] = res.linear.bias
            proj = self.lm_heads[k] if self.lm_heads is not None else self.base_lm_head
            state[f"{k}.{self.config.num_layers}.weight"] = proj.weight
        return state

    @property
    def trees_dir(self) -> Path | None:
        """The trees built for these heads (`<directory>/trees`), if they have any."""
        trees = self.directory / "trees" if self.directory is not None else None
        return trees if trees is not None and trees.is_dir() else None

    def tree(self, spec: "str | Path | list | None" = None):
        """A tree by name, resolved against these heads' own trees first; None: their default tree."""
        from .tree import DEFAULT_TREE, load_tree

        return load_tree(DEFAULT_TREE if spec is None else spec, heads_dir=self.directory)

    @classmethod
    def load(cls, directory: str | Path) -> "MedusaHeads":
        """Load either layout from a directory (or `default` for the shipped heads)."""
        directory = SHIPPED_DIR if str(directory) == "default" else Path(directory)
        heads = cls._load_layout(directory)
        heads.directory = directory
        return heads

    @classmethod
    def _load_layout(cls, directory: Path) -> "MedusaHeads":
        if (directory / "heads.json").exists():
            config = _read_config(directory / "heads.json")
            heads = cls(config)
            state = load_file(str(directory / "heads.safetensors"))
            missing, unexpected = heads.load_state_dict(state, strict=False)
            if missing or unexpected:
                raise MedusaError(f"heads checkpoint {directory} does not match its heads.json "
                                  f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
            return heads
        if (directory / "config.json").exists():
            return cls._load_medusa_layout(directory)
        raise MedusaError(f"--heads: {directory} holds no heads (expected heads.json or a Medusa config.json)")

    @classmethod
    def _load_medusa_layout(cls, directory: Path) -> "MedusaHeads":
        meta = json.loads((directory / "config.json").read_text())
        if "medusa_num_heads" not in meta:
            raise MedusaError(f"--heads: {directory}/config.json has no medusa_num_heads")
        if (directory / "medusa_lm_head.safetensors").exists():
            state = load_file(str(directory / "medusa_lm_head.safetensors"))
        elif (directory / "medusa_lm_head.pt").exists():
            state = torch.load(directory / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
        else:
            raise MedusaError(f"--heads: {directory} has config.json but no medusa_lm_head.safetensors/.pt")
        n_heads, n_layers = int(meta["medusa_num_heads"]), int(meta.get("medusa_num_layers", 1))
        proj = state[f"0.{n_layers}.weight"]
        config = HeadsConfig(hidden_size=proj.shape[1], vocab_size=proj.shape[0], num_heads=n_heads,
                             num_layers=n_layers, own_lm_head=True,
                             base_model=meta.get("base_model_name_or_path", ""))
        heads = cls(config)
        for k in range(n_heads):
            for j in range(n_layers):
                heads.blocks[k][j].linear.weight.data.copy_(state[f"{k}.{j}.linear.weight"])
                heads.blocks[k][j].linear.bias.data.copy_(state[f"{k}.{j}.linear.bias"])
            heads.lm_heads[k].weight.data.copy_(state[f"{k}.{n_layers}.weight"])
        return heads


def _read_config(path: Path) -> HeadsConfig:
    data = json.loads(path.read_text())
    known = set(HeadsConfig.__dataclass_fields__)
    if unknown := set(data) - known:
        raise MedusaError(f"{path}: unknown keys {sorted(unknown)}")
    try:
        return HeadsConfig(**data)
    except TypeError as exc:
        raise MedusaError(f"{path}: {exc}") from None


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
