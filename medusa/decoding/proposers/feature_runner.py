"""A feature head at inference (`medusa.decoding.proposers.feature_heads`): the head's packed copy in the target's dtype
running over its own per-row KV cache, the taps that collect fused target features, and the per-row state
kept beside a batch.

The layer is the target's own architecture run through `medusa.decoding.target.transformer`'s fused, packed layer
code and attention; the vocabulary projection reads only the draft vocabulary (`draft_ids`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from medusa.decoding.proposers.feature_heads import FeatureHead
from medusa.decoding.proposers import RowState
from medusa.errors import MedusaError
from medusa.decoding.target.kernels import LayerInputs, packed_linear, pass_mask, rows_linear, short_block_bias
from medusa.decoding.target.transformer import (SHORT_BLOCK, DecoderLayer, KVCache, RMSNorm, RotaryTable, Transformer,
                                         attention_dtype, cache_dtype)

if TYPE_CHECKING:
    from medusa.decoding.verifier import Verdict

class _HeadLayer(DecoderLayer):
    """`medusa.decoding.target.transformer.DecoderLayer` (fused, packed projections, the shared attention) with the
    head's
    inputs: eagle1 attends over x itself (no input norm); eagle3 over [norm(emb), norm(x)], residual x."""

    def __init__(self, head: FeatureHead, head_dim: int):
        super().__init__(head.layer, head_dim)
        self.hnorm = RMSNorm(head.hidden_norm) if head.hidden_norm is not None else None

    def forward(self, emb: torch.Tensor, x: torch.Tensor, at: LayerInputs, kv: torch.Tensor) -> torch.Tensor:
        """DecoderLayer.forward with the head's embeddings `emb` beside x."""
        a_in = x if self.hnorm is None else torch.cat([self.ln1.forward(emb), self.hnorm.forward(x)], -1)
        return self.block(a_in, x, at, kv)


@dataclass
class DraftBlock:
    """Where one pass of a feature head writes its t entries per row, and what they see (`HeadRunner`).

    positions: [B, t] long, each entry's position in its sequence
    rows:      slice, the cache rows the B rows are
    used:      int, draft entries already written past each row's committed length (cache.lens); this
               block goes after them
    visible:   [B, t, used + t] bool, which of those draft entries and of this block each entry sees (every
               committed entry is seen)
    longest:   max(cache.lens[rows]) when the caller knows it (a draft's passes share it; reading it from
               the device each pass would wait for the device), else None
    """

    positions: torch.Tensor
    rows: slice
    used: int
    visible: torch.Tensor
    longest: int | None = None


class HeadRunner(nn.Module):
    """The head's inference copy in the target's dtype: packed weights, a pass over a ragged cache."""

    def __init__(self, head: FeatureHead, dtype: torch.dtype, vocab: int | None = None):
        super().__init__()
        original, embed, borrowed = head, head.embed, head._target
        original._target = []  # the target is borrowed: never copied
        try:
            head = copy.deepcopy(original).to(dtype)
        finally:
            original._target = borrowed
        cfg = head.layer_config
        self.config = head.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer = _HeadLayer(head, self.head_dim)
        self.fc = packed_linear(head.fc.requires_grad_(False))
        lm = head.lm_head.requires_grad_(False)
        ids = head.draft_ids
        if vocab is not None and vocab < len(ids):  # the first `vocab` draft ids (trained heads: most frequent)
            lm = rows_linear(head.lm_head.weight, slice(0, vocab), dtype)
            ids = ids[:vocab]
        self.lm_head = packed_linear(lm)
        self.norm = RMSNorm(head.norm) if head.norm is not None else None
        self.rotary = head.rotary
        self.rope = RotaryTable(self.rotary)
        self._embed = [embed]
        self.register_buffer("draft_ids", ids.clone(), persistent=False)
        self.vocab = len(ids)
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.draft_ids.device

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        kv_dtype = cache_dtype(self.device.type, self.dtype, rows)
        return KVCache(1, rows, self.n_kv, capacity, self.head_dim, kv_dtype, self.device)

    def inputs(self, tokens: torch.Tensor, feats: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding of tokens, the layer's residual input) for tokens [B, T], feats [B, T, F or h]."""
        emb = self._embed[0](tokens).to(self.dtype)
        if self.config.style == "eagle1":
            return emb, self.fc.forward(torch.cat([emb, feats.to(self.dtype)], -1))
        return emb, self.fc.forward(feats.to(self.dtype)) if fused else feats

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(out if self.norm is None else self.norm.forward(out))

    def forward(self, emb: torch.Tensor, x: torch.Tensor, cache: KVCache, block: DraftBlock) -> torch.Tensor:
        """One pass over emb, x [B, t, h] (`inputs`) written into `cache` where `block` says -> [B, t, h]."""
        positions, rows, used = block.positions, block.rows, block.used
        b, t = positions.shape
        hl = cache.lens[rows]
        span = used + t
        window = (int(hl.max()) if block.longest is None else block.longest) + span
        if window > cache.capacity:
            raise MedusaError(f"feature head cache of {cache.capacity} entries is too small for {window}")
        mask = pass_mask(hl, block.visible, window, window - span if b == 1 else None)
        bias = None
        if t <= SHORT_BLOCK:
            bias = short_block_bias(mask, self.n_kv, self.n_heads // self.n_kv,
                                    attention_dtype(x.device.type, self.dtype, cache.data.dtype, b * t))
        slots = window - span + used if b == 1 else hl[:, None] + used + torch.arange(t, device=x.device)
        at = LayerInputs(self.rope(x, positions, cache.capacity), cache.data[:, :, rows, :, :window],
                         torch.arange(b, device=x.device)[:, None], slots, mask, bias)
        return self.layer.forward(emb, x, at, at.kv[0])


class _Tap(nn.Module):
    """A target layer that also keeps its last output (the residual stream after it)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.inner = layer
        self.out: torch.Tensor | None = None

    def forward(self, x, *args):
        self.out = self.inner.forward(x, *args)
        return self.out


class LayerTaps:
    """Fused features for eagle3 heads: HF `hidden_states[i]` of every pass, i.e. the output of target
    layer i-1 (kept by a transparent wrapper around that layer), or the final normed hidden state for
    i = number of layers. Installed once per target; the wrappers cost one reference per layer call."""

    def __init__(self, target: Transformer, layers: list[int]):
        self.layers = list(layers)
        self.target = target

    @classmethod
    def install(cls, target: Transformer, layers: list[int]) -> "LayerTaps":
        n = len(target.layers)
        for i in layers:
            if not 1 <= i <= n:
                raise MedusaError(f"feature head fuses hidden_states[{i}]; this target has 1..{n} "
                                  f"(0, the embeddings, is not supported)")
            if i < n and not isinstance(target.layers[i - 1], _Tap):
                target.layers[i - 1] = _Tap(target.layers[i - 1])
        return cls(target, layers)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        n = len(self.target.layers)
        parts = [hidden if i == n else self.target.layers[i - 1].out for i in self.layers]
        return torch.cat([p.to(hidden.dtype) for p in parts], dim=-1)


class FeatureState(RowState):
    """Per-row state beside a batch: the head's cache, the target features of committed positions and the
    tokens both were computed from (`seq[r, s]` = x_s; the pending root included)."""

    def __init__(self, runner: HeadRunner, rows: int, capacity: int, feature_dim: int, taps: "LayerTaps | None" = None):
        self.runner = runner
        self.taps = taps  # fused multi-layer features: read from taps on the target's layers
        dev = runner.device
        self.cache = runner.new_cache(rows, capacity)
        self.seq = torch.full((rows, capacity), -1, dtype=torch.long, device=dev)
        self.feats = torch.zeros(rows, capacity, feature_dim, dtype=runner.dtype, device=dev)
        self.feat_len = torch.zeros(rows, dtype=torch.long, device=dev)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        self.cache.move_rows(src, dst)
        if src:
            s, d = torch.tensor(src, device=self.seq.device), torch.tensor(dst, device=self.seq.device)
            self.seq[d] = self.seq[s]
            self.feats[d] = self.feats[s]
            self.feat_len[d] = self.feat_len[s]

    def prefilled(self, rows: slice, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor,
                  start: int = 0) -> None:
        """The engine's prefill of new rows (or a chunk of one): keep their prompt features (so no second
        pass is needed)."""
        end = start + tokens.shape[1]
        self.seq[rows, start:end] = tokens
        self.feats[rows, start:end] = self.features(hidden).to(self.feats.dtype)
        self.feat_len[rows] = start + lengths
        self.cache.lens[rows] = 0

    def committed(self, lens: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor, verdict: "Verdict") -> None:
        """An engine step over rows [0, n) at lengths `lens` [n] (speculative or plain, any proposer): keep
        the true features of the positions it commits (the accepted path, root first), so speculation that
        resumes after plain steps needs no second target pass. Rows whose features already lag keep lagging
        (the proposer refills them)."""
        n = hidden.shape[0]
        rows = torch.arange(n, device=hidden.device)[:, None]
        j = torch.arange(verdict.path.shape[1], device=hidden.device)
        keep = j[None, :] <= verdict.accepted[:, None]
        pos = (lens[:, None] + j).clamp(max=self.feats.shape[1] - 1)
        feats = self.features(hidden)[rows, verdict.path].to(self.feats.dtype)
        self.feats[rows, pos] = torch.where(keep[:, :, None], feats, self.feats[rows, pos])
        self.seq[rows, pos] = torch.where(keep, tokens.gather(1, verdict.path), self.seq[rows, pos])
        self.feat_len[:n] = torch.where(self.feat_len[:n] >= lens, lens + verdict.accepted + 1, self.feat_len[:n])

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input features of the target pass that just ran (its final hidden states `hidden`)."""
        return hidden if self.taps is None else self.taps.features(hidden)


def draft_pass_ms(runner: HeadRunner, rows: int, tokens: int, prefix: int = 256, repeats: int = 5) -> float:
    """Fastest ms of one head pass over `tokens` entries per row for `rows` rows after a `prefix`-entry
    cache, with its draft-vocabulary log-softmax and top-k: one draft step's cost."""
    dev = runner.device
    cache = runner.new_cache(rows, prefix + tokens + 1)
    cache.lens[:rows] = prefix
    h = runner.config.hidden_size
    emb = torch.randn(rows, tokens, h, dtype=runner.dtype, device=dev)
    x = torch.randn(rows, tokens, h, dtype=runner.dtype, device=dev)
    pos = torch.full((rows, tokens), prefix, device=dev)
    vis = torch.ones(rows, tokens, tokens, dtype=torch.bool, device=dev)
    best = float("inf")
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            out = runner(emb, x, cache, DraftBlock(pos, slice(0, rows), 0, vis))
            torch.log_softmax(runner.logits(out).float(), -1).topk(min(4, runner.vocab), -1)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i:
                best = min(best, (time.perf_counter() - t0) * 1000)
    return best

