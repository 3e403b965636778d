"""Classic speculative decoding: a separate, smaller draft model proposes a chain of K tokens.

The draft keeps its own KV cache per batch row (`batch.aux["draft"]`). Each `fill` call (the engine's `draft`)

1. finds, per row, how much of the draft's cache is still valid: the longest prefix on which the tokens it
   was computed from equal the row's committed tokens. KV entries depend only on the tokens before them, so
   a matching prefix is exact: accepted speculative tokens need no recomputation, rejected ones are simply
   overwritten, and a new request in a reused slot starts from scratch (or from a shared prompt prefix);
2. catches the draft up on the rest of the committed tokens plus the pending root, all rows in one
   right-padded block with a causal mask (a long catch-up, e.g. a freshly added prompt, is split into
   blocks that fit the cache);
3. runs K-1 single-token greedy steps.

A draft is a `DraftModel`: its Transformer and the head that scores its next token, which may score only
part of the vocabulary (`vocab`, the full id of each row): a full-vocabulary projection is the costliest
part of a small draft.

Nothing loops over rows in Python. The verifier sees a chain (`medusa.decoding.trees.tree.chain(K)`), so greedy
output is token-identical to plain decoding whatever the draft proposes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from medusa.errors import MedusaError
from medusa.io import ASSETS
from medusa.decoding.target.kernels import packed_linear, rows_linear
from medusa.decoding.proposers import RowState, StaticProposer, aux_state, catch_up, common_prefix, context
from medusa.decoding.target.transformer import KVCache, Transformer, causal
from medusa.decoding.trees.tree import chain
from medusa.decoding.verifier import argmax

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch

AUX_KEY = "draft"


class DraftState(RowState):
    """The draft's per-row cache plus the tokens each cached position was computed from."""

    def __init__(self, owner: Transformer, rows: int, capacity: int):
        self.owner = owner
        self.cache: KVCache = owner.new_cache(rows, capacity)
        self.tokens = torch.full((rows, capacity), -1, dtype=torch.long, device=owner.device)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        self.cache.move_rows(src, dst)
        if src:
            s = torch.tensor(src, device=self.tokens.device)
            self.tokens[torch.tensor(dst, device=self.tokens.device)] = self.tokens[s]


@dataclass
class DraftModel:
    """A draft: its Transformer, the head that scores its next token (the Transformer's own lm_head, or
    the target's projection restricted to `vocab`) and `vocab` [V'] long, the full id of each head row
    (None: the head scores the whole vocabulary)."""

    transformer: Transformer
    head: torch.nn.Module
    vocab: torch.Tensor | None = None

    @classmethod
    def of(cls, transformer: Transformer) -> "DraftModel":
        return cls(transformer, transformer.lm_head)

    @property
    def config(self):
        return self.transformer.config

    def next_token(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's greedy token (full vocabulary id) after each hidden state [..., h]."""
        best = argmax(self.head(hidden))
        return self.vocab[best] if self.vocab is not None else best


class DraftProposer(StaticProposer):
    """Greedy chain of `k` tokens from a draft Transformer that shares the target's tokenizer."""

    name = "draft"

    def __init__(self, draft: DraftModel | Transformer, k: int = 4):
        if k < 1:
            raise MedusaError(f"draft k must be >= 1, got {k}")
        self.model = draft if isinstance(draft, DraftModel) else DraftModel.of(draft)
        self.transformer = self.model.transformer
        self.k = k
        self.tree = chain(k)

    def _state(self, batch: "Batch") -> DraftState:
        # Room for the target's committed prefix, the K speculative slots and one catch-up block.
        need = batch.cache.capacity + self.k + 1
        return aux_state(batch, AUX_KEY, lambda s: isinstance(s, DraftState) and s.owner is self.transformer
                         and s.cache.rows >= batch.cache.rows and s.cache.capacity >= need,
                         lambda: DraftState(self.transformer, batch.cache.rows, need))

    @torch.inference_mode()
    def fill(self, batch: "Batch") -> torch.Tensor:
        n = batch.n
        rows = slice(0, n)
        state = self._state(batch)
        cache = state.cache
        dev = self.transformer.device
        target_len = batch.cache.lens[rows]
        # Context the draft must have seen: committed tokens, then the pending root at position target_len.
        ctx = context(batch)
        width, ctx_len = ctx.shape[1], target_len + 1
        cache.lens[rows] = common_prefix(state.tokens[rows, :width], ctx,
                                         torch.minimum(cache.lens[rows], ctx_len - 1))
        last = self._catch_up(state, rows, ctx, ctx_len)
        out = torch.empty(n, self.k, dtype=torch.long, device=dev)
        token = self.model.next_token(last)
        out[:, 0] = token
        one = torch.ones(1, 1, dtype=torch.bool, device=dev)
        for i in range(1, self.k):
            lens = cache.lens[rows]
            state.tokens[rows].scatter_(1, lens[:, None], token[:, None])
            hidden = self.transformer(token[:, None], lens[:, None], cache, rows, one)
            cache.lens[rows] += 1
            token = self.model.next_token(hidden[:, 0])
            out[:, i] = token
        return out

    def _catch_up(self, state: DraftState, rows: slice, ctx: torch.Tensor, ctx_len: torch.Tensor) -> torch.Tensor:
        """Feed each row ctx[r, cache_len:ctx_len]; return the draft's hidden state after the last one."""
        def run(lens: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            slots = lens[:, None] + j
            tokens = ctx.gather(1, slots.clamp(max=ctx.shape[1] - 1))
            hidden = self.transformer(tokens, slots, state.cache, rows, causal(len(j), ctx.device))
            taken = j < (ctx_len - lens).clamp(min=0)[:, None]
            tok_rows = state.tokens[rows]  # a view: written in place
            slots = slots.clamp(max=tok_rows.shape[1] - 1)
            tok_rows.scatter_(1, slots, torch.where(taken, tokens, tok_rows.gather(1, slots)))
            return hidden

        net = self.transformer
        last = torch.zeros(ctx.shape[0], net.config.hidden_size, dtype=net.dtype, device=ctx.device)
        return catch_up(state.cache, rows, ctx_len, last, run)


# ---- building a draft model -------------------------------------------------------------------------

DRAFT_FILES = ("draft.safetensors", "draft.json")


def truncated_model(target: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """An HF causal LM made of the target's first `num_layers` layers, its final norm and its embeddings.

    The embeddings and lm_head are the target's own tensors (shared, not copied): a truncated draft costs
    only its layers in memory and on disk.
    """
    import copy

    total = len(target.model.layers)
    if not 1 <= num_layers <= total:
        raise MedusaError(f"--layers must be between 1 and {total}, got {num_layers}")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    draft = type(target)(cfg).to(dtype=target.dtype, device=target.device)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    for mine, theirs in zip(draft.model.layers, target.model.layers):
        mine.load_state_dict(theirs.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    return draft.eval().requires_grad_(False)


def own_state(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's tensors that are not the target's (everything but embeddings and lm_head)."""
    return {k: v for k, v in draft.state_dict().items()
            if not k.startswith(("model.embed_tokens.", "lm_head."))}


VOCAB_KEY = "draft_vocab"


def save_truncated(draft: torch.nn.Module, directory: str | Path, meta: dict,
                   vocab: torch.Tensor | None = None) -> Path:
    """Write the draft's own layers (bf16), its reduced vocabulary if any, and a small JSON; atomic."""
    from safetensors.torch import save_file

    from medusa.io import write_atomic, write_json_atomic

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous().clone() for k, v in own_state(draft).items()}
    if vocab is not None:
        tensors[VOCAB_KEY] = vocab.to("cpu", torch.long).contiguous()
    info = {"kind": "truncated", "num_layers": len(draft.model.layers),
            "vocab_subset": None if vocab is None else len(vocab), **meta}
    write_atomic(directory / DRAFT_FILES[0], lambda p: save_file(tensors, str(p)))
    write_json_atomic(directory / DRAFT_FILES[1], info)
    for name in DRAFT_FILES:
        (directory / name).chmod(0o644)  # temp files are created private; the result is a shared asset
    return directory


SHIPPED_DRAFT = ASSETS / "draft"


def load_draft(spec: str, target: torch.nn.Module) -> DraftModel:
    """A draft for `target` (see `load_draft_hf` for the accepted specs), scoring through its reduced
    vocabulary head when it was trained with one."""
    hf, vocab = _load(spec, target)
    model = Transformer(hf)
    if vocab is None:
        return DraftModel.of(model)
    return DraftModel(model, packed_linear(vocab_subset_head(target, vocab)), vocab.to(model.device))


def vocab_subset_head(target: torch.nn.Module, vocab: torch.Tensor) -> torch.nn.Linear:
    """The target's output projection restricted to the token ids in `vocab` (row i scores vocab[i])."""
    return rows_linear(target.get_output_embeddings().weight, vocab)


def load_draft_hf(spec: str, target: torch.nn.Module) -> torch.nn.Module:
    """The draft as an HF causal LM (what HF assisted generation takes as `assistant_model`).

    spec: `default` (a named target's smaller sibling, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; else
    the shipped truncated draft of the embedded model), `layers:N` (the target's first N layers, untrained),
    a directory written by `medusa train-draft`, a named model, or any HF model directory / hub id sharing
    the target's tokenizer.
    """
    return _load(spec, target)[0]


def _load(spec: str, target: torch.nn.Module) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """The draft as an HF causal LM and its reduced vocabulary (None: the whole vocabulary)."""
    from safetensors.torch import load_file

    if spec.startswith("layers:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise MedusaError(f"--draft: {spec!r}: expected layers:N with an integer N") from None
        return truncated_model(target, n), None
    if spec == "default":
        from medusa.decoding.target.model import NAMED_MODELS, named_model_of

        named = named_model_of(target)
        spec = (NAMED_MODELS[named].draft or spec) if named is not None else spec
    directory = SHIPPED_DRAFT if spec == "default" else Path(spec)
    if (directory / DRAFT_FILES[1]).exists():
        info = json.loads((directory / DRAFT_FILES[1]).read_text())
        if info.get("hidden_size", target.config.hidden_size) != target.config.hidden_size:
            raise MedusaError(f"--draft: {directory} was made for hidden size {info['hidden_size']}, the "
                              f"target has {target.config.hidden_size}")
        draft = truncated_model(target, int(info["num_layers"]))
        state = load_file(str(directory / DRAFT_FILES[0]))
        vocab = state.pop(VOCAB_KEY, None)
        missing, unexpected = draft.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith(("model.embed_tokens.", "lm_head."))]
        if missing or unexpected:
            raise MedusaError(f"--draft: {directory} does not match the target (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
        if vocab is not None and int(vocab.max()) >= target.config.vocab_size:
            raise MedusaError(f"--draft: {directory} scores token ids beyond the target's vocabulary")
        return draft.to(target.dtype), None if vocab is None else vocab.long()
    if spec == "default":
        raise MedusaError("--draft default: no shipped draft model; build one with `medusa train-draft` "
                          "or pass --draft layers:N")
    from medusa.decoding.target.model import load_target

    hf, _ = load_target(spec, target.dtype, target.device)
    if hf.config.vocab_size < target.config.vocab_size:
        raise MedusaError(f"--draft: {spec} has a vocabulary of {hf.config.vocab_size}, the target "
                          f"{target.config.vocab_size}; the draft must share the target's tokenizer")
    return hf, None
