"""Attention over a ragged KV cache: the pass mask (cache prefix plus the pass's own block), what every layer
of a pass reads (`LayerInputs`) and the two attention paths (batched matmuls for short blocks, the fused
kernel for long ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from medusa.decoding.invariant import InvariantPlan


@dataclass
class LayerInputs:
    """What attention needs in every layer of one pass, built once per pass (`Transformer.prepare`).

    rope:    (cos, signed sin), each [B, T, 1, D]: the block's rotary tables
    kv:      [layers, 2, B, KV, L, D]: the rows' cache window (a view), L slots
    row_idx: [B, 1] long, the rows' indices in the window
    slots:   [B, T] long, where the block's K/V go; or an int, one row's first slot (a contiguous run)
    mask:    [B, 1, T, L] bool, a `medusa.decoding.invariant.InvariantPlan`, or None (one token of one row:
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
