"""The target's kernels: its frozen linear layers and its attention over the ragged KV cache.

Linear layers (`Linear`, `packed_linear`): oneDNN-packed on CPU, with the residual add fused in, and
row-blocked when the model must be batch-invariant. Attention: the pass mask (cache prefix plus the pass's own
block), what every layer of a pass reads (`LayerInputs`) and the two attention paths (batched matmuls for
short blocks, the fused kernel for long ones).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from medusa.decoding.target.invariant import InvariantPlan


def fuse(*linears: nn.Linear) -> nn.Linear:
    w = torch.cat([lin.weight.data for lin in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    fused.weight.data.copy_(w)
    if has_bias:
        fused.bias.data.copy_(torch.cat([lin.bias.data for lin in linears]))
    return fused.requires_grad_(False)


class Linear(nn.Module):
    """A frozen linear layer, with the residual add (`plus`) available as a fused epilogue.

    On CPU the weight is pre-packed for oneDNN once at load (fp32, and bf16 where oneDNN runs it): at
    batch size 1 a decode step is a chain of matrix-vector products and the packed layout reads the
    weights markedly faster than the generic path, and the residual add then runs inside the matmul
    instead of as a separate op. Elsewhere (CUDA) it is a plain `F.linear` followed by the add.
    """

    # oneDNN's batch-size hint for the packed layout. In fp32 a layout packed for 1 row makes every pass
    # of 2+ rows (a tree, a batch) 1.5-2.6x dearer than one packed for 4, which costs a 1-row pass
    # nothing measurable (AVX2 and AVX-512, 576-wide layers: 2 rows 0.27 -> 0.12 ms, vocabulary 13.3 ->
    # 7.0 ms); in bf16 the hint made no difference and stays at 1.
    PACK_ROWS = {torch.float32: 4, torch.bfloat16: 1}

    def __init__(self, linear: nn.Linear, pack: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack
        w = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, self.PACK_ROWS.get(w.dtype, 1)) if pack else w
        self.register_buffer("weight", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    # Most rows per matmul, or None for any number: a batch-invariant model sets invariant.ROW_BLOCK, since
    # the kernels may split a long reduction differently once a pass has more rows (`medusa.decoding.target.invariant`).
    row_block: int | None = None

    def _blocked(self, x: torch.Tensor) -> bool:
        """More rows than `row_block` in x [..., in_features]."""
        return self.row_block is not None and x.numel() > self.row_block * x.shape[-1]

    def _alone(self, x: torch.Tensor) -> bool:
        """One row in x, with a row block set: some CPUs (AMD Zen 4, AVX-512) run a one-row product through a
        matrix-vector kernel whose long reductions (1,536 inputs) round unlike the same row's among 2-64 rows,
        so a batch-invariant model runs it as two copies of itself (a memory-bound pass reads the weights
        once either way)."""
        return self.row_block is not None and x.numel() == x.shape[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._blocked(x):
            return by_rows(self.forward, self.row_block, x)
        if self._alone(x):
            return self.forward(twice(x))[:1].view(*x.shape[:-1], -1)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self._blocked(x):
            return by_rows(self.plus, self.row_block, x, other)
        if self._alone(x):
            return self.plus(twice(x), twice(other))[:1].view(*x.shape[:-1], -1)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + other


def twice(x: torch.Tensor) -> torch.Tensor:
    """The one row of x [..., in] as two equal rows [2, in]."""
    return x.reshape(1, -1).expand(2, -1).contiguous()


def by_rows(fn, block: int, x: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    """fn over the rows of x [..., in] (and of `more`, shaped like fn's output) `block` rows at a time."""
    flat = [t.reshape(-1, t.shape[-1]) for t in (x, *more)]
    parts = [fn(*(t[i: i + block] for t in flat)) for i in range(0, flat[0].shape[0], block)]
    return torch.cat(parts).view(*x.shape[:-1], -1)


def packing_available(weight: torch.Tensor) -> bool:
    """Whether a weight of this device and dtype is packed (see `pack_weights`)."""
    return pack_weights(weight.device.type, weight.dtype)


def pack_weights(device_type: str, dtype: torch.dtype) -> bool:
    """oneDNN-packed weights on CPU only: fp32 always (oneDNN's packed sgemm beats the generic one at the
    few rows of decoding and tree passes), bf16 where oneDNN runs bf16 kernels."""
    if device_type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if os.environ.get("MEDUSA_NO_PACK", "") not in ("", "0"):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def packed_linear(linear: nn.Linear) -> Linear:
    """A frozen inference copy of `linear`, packed where its device and dtype allow (same results)."""
    return Linear(linear, pack=packing_available(linear.weight))


def rows_linear(weight: torch.Tensor, rows: torch.Tensor | slice, dtype: torch.dtype | None = None) -> nn.Linear:
    """A frozen bias-free projection whose output i is scored by weight[rows][i]: a vocabulary projection
    restricted to some token ids (candidates, a draft vocabulary), so a step reads only those rows."""
    w = weight.detach()[rows.to(weight.device) if isinstance(rows, torch.Tensor) else rows]
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=dtype or w.dtype)
    linear.weight.data.copy_(w)
    return linear.requires_grad_(False)


@dataclass
class LayerInputs:
    """What attention needs in every layer of one pass, built once per pass (`Transformer.prepare`).

    rope:    (cos, signed sin), each [B, T, 1, D]: the block's rotary tables
    kv:      [layers, 2, B, KV, L, D]: the rows' cache window (a view), L slots
    row_idx: [B, 1] long, the rows' indices in the window
    slots:   [B, T] long, where the block's K/V go; or an int, one row's first slot (a contiguous run)
    mask:    [B, 1, T, L] bool, a `medusa.decoding.target.invariant.InvariantPlan`, or None (one token of one row:
             no mask)
    bias:    [B*KV, G*T, L] float, the mask's additive form for short blocks, or None
    """

    rope: tuple[torch.Tensor, torch.Tensor]
    kv: torch.Tensor
    row_idx: torch.Tensor
    slots: torch.Tensor | int
    mask: "torch.Tensor | InvariantPlan | None"
    bias: torch.Tensor | None


def pass_mask(lens: torch.Tensor, visible: torch.Tensor, window: int, start: int | None = None) -> torch.Tensor:
    """The attention mask [B, 1, T, L] of a pass whose S block entries start at each row's `lens` [B]:
    every entry before them is seen, entries past the block are not, and `visible` [T, S] or [B, T, S]
    says which block entries each of the pass's T tokens sees (S = T when the block is the pass itself).
    `start`: lens of a single row when the caller holds it as a number (the mask is then assembled from
    slices, a third of the kernels: this runs once per pass of every decoding step at batch size 1)."""
    b, (t, span) = lens.shape[0], visible.shape[-2:]
    if start is not None and b == 1:
        mask = torch.zeros(1, 1, t, window, dtype=torch.bool, device=lens.device)
        mask[..., :start] = True
        mask[..., start: start + span] = visible
        return mask
    rel = torch.arange(window, device=lens.device)[None, :] - lens[:, None]  # [B, L]
    in_block = (rel >= 0) & (rel < span)
    vis = visible if visible.dim() == 3 else visible.expand(b, t, span)
    block_part = torch.gather(vis, 2, rel.clamp(0, span - 1)[:, None, :].expand(b, t, window))
    return ((rel < 0)[:, None, :] | (in_block[:, None, :] & block_part))[:, None]


def short_block_bias(mask: torch.Tensor, kvh: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """The pass mask [B, 1, T, L] as the additive [B*KV, G*T, L] term of `attention`'s score matmul for
    `kvh` KV heads of `g` query heads each, built once per pass for all layers."""
    b, _, t, window = mask.shape
    bias = torch.zeros(b, 1, 1, t, window, dtype=dtype, device=mask.device)
    bias.masked_fill_(~mask[:, :, None], float("-inf"))
    return bias.expand(b, kvh, g, t, window).reshape(b * kvh, g * t, window)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, T, H, D] over the cache window k/v [B, KV, L, D] -> [B, T, H*D], in q's dtype.

    `bias` (from `short_block_bias`, in the dtype to attend in) selects the matmul path; without it `mask`
    (None: everything visible) goes to the fused kernel.

    For the short blocks of decoding (a few tokens per row, or candidate trees), batched matmuls with the
    query heads of each KV group stacked, the scale and the mask folded into the first (`bias`), beat the
    fused CPU kernel several times over. Long prompt chunks go to scaled_dot_product_attention, which does
    not materialise the [T, L] scores, and so does a single unmasked query (its fused path is fastest).
    """
    b, t, h, d = q.shape
    kvh, window = k.shape[1], k.shape[2]
    g = h // kvh
    if bias is None:
        o = F.scaled_dot_product_attention(q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=g > 1)
        return o.transpose(1, 2).reshape(b, t, h * d).to(q.dtype)
    if k.dtype != bias.dtype:
        k, v = k.to(bias.dtype), v.to(bias.dtype)
    # Each regrouping and its dtype change in one copy (a small pass is a chain of small kernels).
    grouped = torch.empty(b, kvh, g, t, d, dtype=bias.dtype, device=q.device)
    grouped.copy_(q.view(b, t, kvh, g, d).permute(0, 2, 3, 1, 4))
    scores = torch.baddbmm(bias, grouped.view(b * kvh, g * t, d), k.reshape(b * kvh, window, d).transpose(1, 2),
                           alpha=scale)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if p.dtype != v.dtype:
        p = p.to(v.dtype)
    o = torch.bmm(p, v.reshape(b * kvh, window, d)).view(b, kvh, g, t, d)
    out = torch.empty(b, t, kvh, g, d, dtype=q.dtype, device=q.device)
    return out.copy_(o.permute(0, 3, 1, 2, 4)).view(b, t, h * d)
