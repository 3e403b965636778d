"""The frozen linear layers of the decoding path: oneDNN-packed on CPU, with the residual add fused in, and
row-blocked when the model must be batch-invariant."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


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
    # the kernels may split a long reduction differently once a pass has more rows (`medusa.decoding.invariant`).
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
