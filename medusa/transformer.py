"""The target's forward pass over a ragged, row-addressable KV cache.

Plain PyTorch for the Llama family (Llama/SmolLM, Qwen2, Qwen3, Mistral), reusing the weights of a loaded
HF model. Why not call the HF module: at batch size 1 a step of a small model is bound by framework
overhead (mask construction, cache objects, hooks), not by the weights, and a lean forward with fused
projections is what makes plain decoding several times faster. Every row of the batch has its own length;
the tokens of one pass (a prompt chunk, one token, or a whole candidate tree) are written after each row's
committed prefix and see that prefix plus whatever the pass mask allows inside the block.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .errors import MedusaError

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


class KVCache:
    """Keys and values of every layer in one tensor [layers, 2, rows, kv_heads, capacity, head_dim].

    `lens[r]` is the committed length of row r. Rows are slots: a batch occupies slots [0, n) and
    finished rows are filled by moving the last rows down, so the active batch stays a contiguous view.
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.data = torch.zeros(layers, 2, rows, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    @property
    def rows(self) -> int:
        return self.data.shape[2]

    def commit(self, rows: slice, src: torch.Tensor, count: torch.Tensor) -> None:
        """Keep block entries `src[b, :]` (offsets after lens) as the next entries of each row; lens += count.

        Entries past `count` are copied too (harmless: they lie beyond the new length) so the move is two
        tensor ops for all layers, with no per-row loop.
        """
        lens = self.lens[rows]
        n = src.shape[1]
        if not torch.equal(src, torch.arange(n, device=src.device).expand_as(src)):
            view = self.data[:, :, rows]
            shape = (view.shape[0], view.shape[1], view.shape[2], view.shape[3], n, view.shape[5])
            src_idx = (lens[:, None] + src)[None, None, :, None, :, None].expand(shape)
            dst_idx = (lens[:, None] + torch.arange(n, device=src.device))[None, None, :, None, :, None].expand(shape)
            view.scatter_(4, dst_idx, view.gather(4, src_idx))
        self.lens[rows] += count

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        if src:
            s, d = torch.tensor(src, device=self.lens.device), torch.tensor(dst, device=self.lens.device)
            self.data[:, :, d] = self.data[:, :, s]
            self.lens[d] = self.lens[s]


class Transformer(nn.Module):
    """hidden = forward(tokens, positions, cache, rows, block_mask); logits = lm_head(hidden)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED:
            raise MedusaError(f"--model: architecture {cfg.model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED)})")
        inner = hf_model.model
        self.config = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = _packed(hf_model.lm_head)
        self.layers = nn.ModuleList(_Layer(layer, self.head_dim) for layer in inner.layers)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        return KVCache(len(self.layers), rows, self.n_kv, capacity, self.head_dim, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: slice,
                block_mask: torch.Tensor) -> torch.Tensor:
        """tokens/positions [B, T]; block_mask [T, T] (or [B, T, T]) says which block entries each sees."""
        b, t = tokens.shape
        lens = cache.lens[rows]
        window = int(lens.max()) + t
        if window > cache.capacity:
            raise MedusaError(f"sequence of {window} tokens exceeds the cache capacity {cache.capacity}; "
                              f"lower --max-new-tokens or shorten the prompt")
        rel = torch.arange(window, device=tokens.device)[None, :] - lens[:, None]  # [B, L]
        in_block = (rel >= 0) & (rel < t)
        bm = block_mask if block_mask.dim() == 3 else block_mask.expand(b, t, t)
        block_part = torch.gather(bm, 2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, window))
        mask = ((rel < 0)[:, None, :] | (in_block[:, None, :] & block_part))[:, None]  # [B, 1, T, L]
        slots = lens[:, None] + torch.arange(t, device=tokens.device)  # where this block's K/V go
        x = self.embed(tokens)
        cos, sin = self.rotary(x, positions)
        data = cache.data[:, :, rows, :, :window]
        row_idx = torch.arange(b, device=tokens.device)[:, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, data[i], row_idx, slots, mask)
        return self.norm(x)


class _Layer(nn.Module):
    def __init__(self, hf_layer: nn.Module, head_dim: int):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.head_dim = head_dim
        self.ln1, self.ln2 = hf_layer.input_layernorm, hf_layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.nq = attn.q_proj.out_features // head_dim
        self.nkv = attn.k_proj.out_features // head_dim
        # Fused projections: one matmul instead of three (and two) per layer.
        self.wqkv = _packed(_fuse(attn.q_proj, attn.k_proj, attn.v_proj))
        self.wo = _packed(attn.o_proj)
        self.w13 = _packed(_fuse(mlp.gate_proj, mlp.up_proj))
        self.w2 = _packed(mlp.down_proj)
        self.scale = attn.scaling

    def forward(self, x, cos, sin, kv, row_idx, slots, mask):
        b, t, _ = x.shape
        d = self.head_dim
        qkv = self.wqkv(self.ln1(x))
        q, k, v = qkv.split([self.nq * d, self.nkv * d, self.nkv * d], dim=-1)
        q = q.view(b, t, self.nq, d)
        k = k.view(b, t, self.nkv, d)
        v = v.view(b, t, self.nkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
        kv[0][row_idx, :, slots] = k.transpose(1, 2)
        kv[1][row_idx, :, slots] = v
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.nq != self.nkv)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, self.nq * d))
        gate, up = self.w13(self.ln2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def _fuse(*linears: nn.Linear) -> nn.Linear:
    w = torch.cat([lin.weight.data for lin in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    fused.weight.data.copy_(w)
    if has_bias:
        fused.bias.data.copy_(torch.cat([lin.bias.data for lin in linears]))
    return fused.requires_grad_(False)


class PackedLinear(nn.Module):
    """A frozen bf16 linear layer whose weight is pre-packed for oneDNN on CPU.

    At batch size 1 a decode step is a chain of matrix-vector products; oneDNN's packed bf16 layout
    reads the weights markedly faster than the generic path, and packing happens once at load.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                             persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def packing_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and os.environ.get("MEDUSA_NO_PACK", "") in ("", "0"))


def _packed(linear: nn.Linear) -> nn.Module:
    return PackedLinear(linear) if packing_available(linear.weight) else linear


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
