"""Medusa heads: small residual MLPs on the target's last hidden state, one per look-ahead distance.

Head k (0-based) predicts the token k+2 positions after the hidden state's own position (the target's
lm_head predicts k+1 = 1). Each head is `num_layers` blocks x + SiLU(Linear(x)) (Linear zero-initialised,
so an untrained head starts as the base model's own next-token guess) followed by a vocabulary projection:
the frozen base lm_head (shared, the default: ~0.33 M parameters per head on a 576-wide model) or the
head's own copy initialised from it (the original Medusa layout).

The layouts heads are saved in and loaded from (ours, Medusa v1/v2, vLLM) are in
`medusa.decoding.proposers.head_formats`; `MedusaHeads.load` and `save` go through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from medusa.errors import MedusaError
from medusa.io import ASSETS

SHIPPED_DIR = ASSETS / "heads"
SHIPPED_NAMES = ("default", "medusa")  # what `--heads` and `medusa export --heads` call them


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
        idx = self.candidate_logits(hidden, num_heads, projection).topk(k, dim=-1).indices
        return idx if self.candidate_ids is None else self.candidate_ids[idx]

    def candidate_logits(self, hidden: torch.Tensor, num_heads: int,
                         projection: nn.Module | None = None) -> torch.Tensor:
        """Each head's logits over what it can propose: the whole vocabulary, or (with candidate_ids) the
        candidate rows, column i scoring candidate_ids[i]: [num_heads, n, V or C]."""
        if self.candidate_ids is None:
            return self(hidden, projection, num_heads)
        blocks = self.blocks[:num_heads]
        if self.lm_heads is not None:  # own projections already restricted to the candidates (vLLM token_map)
            return torch.stack([self.lm_heads[i](block(hidden)) for i, block in enumerate(blocks)])
        return self.candidate_projection()(torch.stack([block(hidden) for block in blocks]))

    def candidate_projection(self) -> nn.Module:
        """The shared base lm_head's rows of the candidate ids as one packed projection (row i scores
        candidate_ids[i]); built on first use, rebuilt after the candidates or the projection change."""
        if self._candidate_proj is None:
            from medusa.decoding.target.kernels import packed_linear, rows_linear

            self._candidate_proj = packed_linear(rows_linear(self.base_lm_head.weight, self.candidate_ids))
        return self._candidate_proj

    def projection(self, k: int) -> torch.Tensor:
        """Head k's vocabulary projection [rows, hidden] on the CPU (its own, or the shared base lm_head)."""
        proj = self.lm_heads[k] if self.lm_heads is not None else self.base_lm_head
        return proj.weight.detach().cpu()

    def one_projection(self) -> bool:
        """All heads go through one projection (the shared base lm_head, or one module in every slot)."""
        return self.lm_heads is None or all(h is self.lm_heads[0] for h in self.lm_heads)

    def save(self, directory: str | Path, medusa_layout: bool = False, layout: str | None = None) -> Path:
        """Write atomically: a reader never sees a half-written checkpoint.

        `layout`: `native` (ours, the default), `medusa` (FasterDecoding v1: `medusa_lm_head.pt` +
        `config.json`) or `vllm` (`model.safetensors` + `config.json`); `medusa_layout=True` means `medusa`.
        The last two store a vocabulary projection, so heads that share the base lm_head need it bound
        (`attach` or `use_projection`).
        """
        from medusa.decoding.proposers.head_formats import write_heads

        return write_heads(self, Path(directory), layout or ("medusa" if medusa_layout else "native"))

    def medusa_state(self) -> dict[str, torch.Tensor]:
        """The tensors of the FasterDecoding v1 layout (see `head_formats.medusa_state`)."""
        from medusa.decoding.proposers.head_formats import medusa_state

        return medusa_state(self)

    @property
    def trees_dir(self) -> Path | None:
        """The trees built for these heads (`<directory>/trees`), if they have any."""
        trees = self.directory / "trees" if self.directory is not None else None
        return trees if trees is not None and trees.is_dir() else None

    def tree(self, spec: "str | Path | list | None" = None):
        """A tree by name, resolved against these heads' own trees first; None: their default tree."""
        from medusa.decoding.trees.tree import DEFAULT_TREE, load_tree

        return load_tree(DEFAULT_TREE if spec is None else spec, heads_dir=self.directory)

    @classmethod
    def load(cls, directory: str | Path) -> "MedusaHeads":
        """Load any layout from a directory, a hub id (when online) or `default` (the shipped heads)."""
        from medusa.decoding.proposers.head_formats import read_heads, resolve_heads_dir

        directory = SHIPPED_DIR if str(directory) == "default" else resolve_heads_dir(directory)
        heads = read_heads(directory)
        heads.directory = directory
        return heads
