"""The target's forward pass over a ragged, row-addressable KV cache.

Plain PyTorch for the Llama family (Llama/SmolLM, Qwen2, Qwen3, Mistral), reusing the weights of a loaded
HF model. Why not call the HF module: at batch size 1 a step of a small model is bound by framework
overhead (mask construction, cache objects, hooks), not by the weights, and a lean forward with fused
projections is what makes plain decoding several times faster. Every row of the batch has its own length;
the tokens of one pass (a prompt chunk, one token, or a whole candidate tree) are written after each row's
committed prefix and see that prefix plus whatever the pass mask allows inside the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from medusa.errors import MedusaError
from medusa.decoding.target import invariant
from medusa.decoding.target.kernels import (
    LayerInputs, Linear, attention, fuse, packed_linear, pass_mask, short_block_bias
)

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class PassInputs:
    """One block of tokens per row for a target pass (a candidate tree per row, a prompt chunk).

    tokens:    [B, T] long
    positions: [B, T] long, each token's position in its sequence
    rows:      slice, the cache rows the B rows are (their K/V go after each one's cached length)
    mask:      [T, T] or [B, T, T] bool, which block entries each token sees
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    rows: slice
    mask: torch.Tensor


def causal(t: int, device: torch.device | str) -> torch.Tensor:
    """[t, t] bool: each position of a block sees itself and the positions before it (the one causal mask:
    prefills, catch-up blocks, calibration passes)."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


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
        if src.device.type == "cpu":  # on the CPU the check costs less than the copy it saves
            move = not torch.equal(src, torch.arange(n, device=src.device).expand_as(src))
        else:  # no host read on a GPU: a root-only path never moves, longer paths are copied even in place
            move = n > 1
        if move:
            # Advanced indexing reads and writes only the moved entries in place. (A scatter into the
            # row-slice view would first copy the whole strided view: time that grows with the cache.)
            r = torch.arange(rows.start, rows.stop, device=src.device)[:, None]
            base = lens[:, None]
            self.data[:, :, r, :, base + torch.arange(n, device=src.device)] = self.data[:, :, r, :, base + src]
        self.lens[rows] += count

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        if src:
            s, d = torch.tensor(src, device=self.lens.device), torch.tensor(dst, device=self.lens.device)
            self.data[:, :, d] = self.data[:, :, s]
            self.lens[d] = self.lens[s]


def cache_capacity(prompt_tokens: int, max_new_tokens: int, block: int = 1) -> int:
    """KV slots per row for prompts of up to `prompt_tokens` that grow by up to `max_new_tokens`, with room
    past them for one pass of `block` tokens (a candidate tree's size; 1 for plain decoding) and a spare."""
    return prompt_tokens + max_new_tokens + block + 1


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
        self.norm = RMSNorm(inner.norm)
        self.rotary = inner.rotary_emb
        self.rope = RotaryTable(self.rotary)
        self.lm_head = packed_linear(hf_model.lm_head)
        self.layers = nn.ModuleList(DecoderLayer(layer, self.head_dim) for layer in inner.layers)
        self.invariant = False
        self.passes = 0  # forward passes run (decoding, prefill, timing alike): what a call's stats count

    @property
    def invariant(self) -> bool:
        """Batch invariance (`medusa.decoding.target.invariant`): a row's results do not depend on the pass, through
        the attention and through projections run at most `invariant.ROW_BLOCK` rows per matmul."""
        return self._invariant

    @invariant.setter
    def invariant(self, on: bool) -> None:
        self._invariant = on
        for m in self.modules():
            if isinstance(m, Linear):
                m.row_block = invariant.ROW_BLOCK if on else None

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def release_source_weights(self, hf_model: nn.Module) -> int:
        """Free the HF model's decoder-layer projections wherever this model holds copies of its own (the
        fused q/k/v and gate/up, and every packed projection), for a process that only runs this model
        (distillation): the weights then take their memory once, not twice. `hf_model`'s own forward no
        longer works afterwards. Returns the bytes given back."""
        freed = 0
        for mine, layer in zip(self.layers, hf_model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            copied = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
            copied += [lin for lin, own in ((attn.o_proj, mine.wo), (mlp.down_proj, mine.w2)) if own.packed]
            for lin in copied:
                freed += lin.weight.numel() * lin.weight.element_size()
                lin.weight = nn.Parameter(lin.weight.new_empty(0), requires_grad=False)
        return freed

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        # Small batches on CPU keep K/V in fp32, the dtype their attention runs in (see FP32_ATTENTION_ROWS):
        # converting each layer's K/V window at every step would cost more than the attention itself.
        dtype = cache_dtype(self.device.type, self.dtype, rows)
        if self.invariant:  # its attention reads whole groups of slots
            capacity = invariant.window(capacity, 1 << 62)
        return KVCache(len(self.layers), rows, self.n_kv, capacity, self.head_dim, dtype, self.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: slice,
                block_mask: torch.Tensor) -> torch.Tensor:
        """tokens/positions [B, T]; block_mask [T, T] (or [B, T, T]) says which block entries each sees."""
        self.passes += 1
        x, at = self.prepare(PassInputs(tokens, positions, rows, block_mask), cache)
        for i, layer in enumerate(self.layers):  # (no per-call hook machinery)
            x = layer.forward(x, at, at.kv[i])
        return self.norm.forward(x)

    @property
    def fuses_parts(self) -> bool:
        """Whether `forward_parts` can run: no layer is wrapped (a feature head's taps keep one pass's output
        per layer, so a pass of several parts would hand them a mix)."""
        return all(isinstance(layer, DecoderLayer) for layer in self.layers)

    def forward_parts(self, cache: KVCache, parts: list[PassInputs]) -> list[torch.Tensor]:
        """One pass over several parts (the running rows' candidate trees, a prompt chunk): the linear
        layers run once over every part's tokens, so the weights are read once, and attention runs per
        part. -> each part's hidden [B, T, h]."""
        if not self.fuses_parts:
            raise MedusaError("the target's layers are wrapped (feature taps): run each part in a pass of its own")
        self.passes += 1
        ready = [self.prepare(p, cache) for p in parts]
        shapes = [x.shape[:2] for x, _ in ready]
        sizes = [b * t for b, t in shapes]
        x = torch.cat([x.reshape(1, n, -1) for (x, _), n in zip(ready, sizes)], dim=1)  # [1, N, h]
        for i, layer in enumerate(self.layers):
            qkv = layer.wqkv.forward(layer.ln1.forward(x))
            o = [layer.attend(q.view(b, t, -1, layer.head_dim), at, at.kv[i]).reshape(1, b * t, -1)
                 for q, (b, t), (_, at) in zip(qkv.split(sizes, dim=1), shapes, ready)]
            x = layer.mlp(layer.wo.plus(torch.cat(o, dim=1), x))
        x = self.norm.forward(x)
        return [h.view(b, t, -1) for h, (b, t) in zip(x.split(sizes, dim=1), shapes)]

    def prepare(self, part: PassInputs, cache: KVCache) -> tuple[torch.Tensor, LayerInputs]:
        """A pass's embeddings [B, T, h] and what its attention needs in every layer."""
        tokens, rows, block_mask = part.tokens, part.rows, part.mask
        b, t = tokens.shape
        lens = cache.lens[rows]
        window = int(lens.max()) + t
        if window > cache.capacity:
            raise MedusaError(f"sequence of {window} tokens exceeds the cache capacity {cache.capacity}; "
                              f"lower --max-new-tokens or shorten the prompt")
        start = window - t if b == 1 else None  # one row: its length, as a number
        if self.invariant:
            window = invariant.window(window, cache.capacity)
            mask = pass_mask(lens, block_mask, window)
            mask, bias = invariant.plan(lens, mask, block_mask, self.n_heads // self.n_kv), None
        else:
            mask, bias = self._pass_masks(lens, block_mask, t, window, cache.data.dtype, start)
        # Where this block's K/V go (one row: a contiguous run from its length).
        slots = start if start is not None else lens[:, None] + torch.arange(t, device=tokens.device)
        x = self.embed(tokens)
        rope = self.rope(x, part.positions, cache.capacity)
        row_idx = torch.arange(b, device=tokens.device)[:, None]
        return x, LayerInputs(rope, cache.data[:, :, rows, :, :window], row_idx, slots, mask, bias)

    def _pass_masks(self, lens: torch.Tensor, block_mask: torch.Tensor, t: int, window: int, kv_dtype: torch.dtype,
                    start: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pass's attention mask [B, 1, T, L] and, for short passes, its additive form for `attention`
        (`start`: the one row's length, when there is one row).

        One token of one row sees its whole window: no mask, and the fused kernel is the fastest there.
        """
        b = lens.shape[0]
        if b * t == 1:
            return None, None
        mask = pass_mask(lens, block_mask, window, start)
        if t > SHORT_BLOCK:
            return mask, None
        return mask, short_block_bias(mask, self.n_kv, self.n_heads // self.n_kv,
                                      attention_dtype(lens.device.type, self.dtype, kv_dtype, b * t))


class DecoderLayer(nn.Module):
    """One Llama-family decoder layer over a ragged cache, built from an HF layer's weights.

    What subclasses may rely on: `ln1`, `ln2`, `q_norm`/`k_norm` (None when the model has none), the fused
    packed projections `wqkv`, `wo`, `w13`, `w2`, the sizes `head_dim`, `nq`, `nkv` and `scale`, and
    `block`, the layer after its input norm (so a layer with other attention inputs reuses the rest).
    """

    def __init__(self, hf_layer: nn.Module, head_dim: int):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.head_dim = head_dim
        self.ln1, self.ln2 = RMSNorm(hf_layer.input_layernorm), RMSNorm(hf_layer.post_attention_layernorm)
        self.q_norm = RMSNorm(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None
        self.k_norm = RMSNorm(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None
        self.nq = attn.q_proj.out_features // head_dim
        self.nkv = attn.k_proj.out_features // head_dim
        # Fused projections: one matmul instead of three (and two) per layer; at batch size 1 each call
        # costs more in fixed overhead than its weights take to read.
        self.wqkv = packed_linear(fuse(attn.q_proj, attn.k_proj, attn.v_proj))
        self.wo = packed_linear(attn.o_proj)
        self.w13 = packed_linear(fuse(mlp.gate_proj, mlp.up_proj))
        self.w2 = packed_linear(mlp.down_proj)
        self.scale = attn.scaling

    def forward(self, x: torch.Tensor, at: LayerInputs, kv: torch.Tensor) -> torch.Tensor:
        """The layer over x [B, T, h]: `at`, what every layer of the pass reads; kv [2, B, KV, L, D], this
        layer's cache window (`at.kv[i]`)."""
        return self.block(self.ln1.forward(x), x, at, kv)

    def block(self, attn_in: torch.Tensor, x: torch.Tensor, at: LayerInputs, kv: torch.Tensor) -> torch.Tensor:
        """Attention over `attn_in` [B, T, *] (the normed input) added to the residual x [B, T, h], then the
        MLP. This block's K/V are written into kv [2, B, KV, L, D] at `at.slots` (see `LayerInputs`)."""
        b, t, _ = x.shape
        qkv = self.wqkv.forward(attn_in).view(b, t, self.nq + 2 * self.nkv, self.head_dim)
        return self.mlp(self.wo.plus(self.attend(qkv, at, kv), x))

    def attend(self, qkv: torch.Tensor, at: LayerInputs, kv: torch.Tensor) -> torch.Tensor:
        """Attention of this block's projections qkv [B, T, nq + 2*nkv, D] over its rows' cache window kv
        (this block's K/V written into it at `at.slots` first: rows `at.row_idx`, or from slot `at.slots` on
        when it is an int, one row's contiguous run written without index tensors) -> [B, T, nq*D]."""
        nq, nkv, slots, mask = self.nq, self.nkv, at.slots, at.mask
        if self.q_norm is not None:
            qkv[:, :, :nq] = self.q_norm.forward(qkv[:, :, :nq])
            qkv[:, :, nq: nq + nkv] = self.k_norm.forward(qkv[:, :, nq: nq + nkv])
        rope_(qkv[:, :, : nq + nkv], *at.rope)  # q and k rotated in one go, in place
        # K and V of this block go after each row's prefix: they lie side by side in qkv, so one write
        # stores both.
        new = qkv[:, :, nq:].unflatten(2, (2, nkv))  # [B, T, 2, KV, D]
        if isinstance(slots, int):
            kv[:, :, :, slots: slots + new.shape[1]] = new.permute(2, 0, 3, 1, 4)
        else:
            kv[:, at.row_idx, :, slots] = new.to(kv.dtype)
        if isinstance(mask, invariant.InvariantPlan):
            return invariant.attention(qkv[:, :, :nq], kv[0], kv[1], mask, self.scale)
        return attention(qkv[:, :, :nq], kv[0], kv[1], mask, at.bias, self.scale)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP with its residual, on x after attention."""
        gate, up = self.w13.forward(self.ln2.forward(x)).chunk(2, dim=-1)
        return self.w2.plus(F.silu(gate) * up, x)


class RMSNorm(nn.Module):
    """The model's RMSNorm (x / rms(x) * w) in as few kernels as the backend allows.

    `F.rms_norm` runs about eight kernels on CPU (upcast, square, mean, rsqrt, two multiplies, downcast),
    and at batch size 1 each costs more to dispatch than to compute. In bf16/fp16 on CPU, layer_norm over
    [x, -x] is one fused kernel that gives the same result: that vector's mean is zero and its mean square
    is x's. fp32 and other devices keep the stock op, so fp32 numerics stay those of the HF model.
    """

    def __init__(self, norm: nn.Module):
        super().__init__()
        w = norm.weight.detach()
        self.eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
        self.register_buffer("weight", w, persistent=False)
        self.mirrored = mirrored_norm(w.device.type, w.dtype)
        self.register_buffer("weight2", torch.cat([w, w]) if self.mirrored else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mirrored:
            d = x.shape[-1]
            return F.layer_norm(torch.cat([x, -x], dim=-1), (2 * d,), self.weight2, None, self.eps)[..., :d]
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


SHORT_BLOCK = 64  # passes of at most this many tokens per row use the matmul attention below


# On CPU small passes attend in fp32: its small-matrix kernels are about twice as fast as bf16's at decode
# shapes. Caches of up to this many rows hold K/V in fp32; larger ones keep the model dtype (their K/V
# would take twice the memory and bandwidth) and convert for a pass of at most this many tokens in all.
FP32_ATTENTION_ROWS = 16


# ---- per-device choices, as functions of (device type, dtype, rows) so they can be checked anywhere -------
# On CUDA every one of them is the plain path: cuBLAS weights as stored, the stock RMSNorm, attention and
# K/V in the model dtype.


def cache_dtype(device_type: str, dtype: torch.dtype, rows: int) -> torch.dtype:
    """K/V dtype of a cache of `rows` rows: fp32 for small caches on CPU, the model dtype elsewhere."""
    return torch.float32 if device_type == "cpu" and rows <= FP32_ATTENTION_ROWS else dtype


def attention_dtype(device_type: str, dtype: torch.dtype, kv_dtype: torch.dtype, rows: int) -> torch.dtype:
    """dtype of a short pass's matmul attention over `rows` = B*T query tokens: fp32 when the cache is fp32
    or, on CPU, for small passes; the model dtype otherwise."""
    fp32 = kv_dtype == torch.float32 or (device_type == "cpu" and rows <= FP32_ATTENTION_ROWS)
    return torch.float32 if fp32 else dtype


def mirrored_norm(device_type: str, dtype: torch.dtype) -> bool:
    """RMSNorm as one layer_norm kernel over [x, -x]: on CPU in bf16/fp16 only."""
    return device_type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, D] (the HF rotary embedding's output) shaped for [B, T, H, D] tensors, with
    rotate_half's sign folded into sin: the `rope` argument of `DecoderLayer` and `rope_`."""
    half = cos.shape[-1] // 2
    signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos[:, :, None], signed[:, :, None]


class RotaryTable:
    """`rope_tables` of a pass looked up by position in a table the model's rotary embedding fills once (and
    again, twice as long, when a pass reaches past it): per pass two lookups instead of a dozen small kernels.
    Only rotary types whose tables depend on the position alone are tabled; the dynamic ones (their frequencies
    follow the sequence length) are computed per pass as before."""

    PER_POSITION = ("default", "linear", "llama3", "yarn")

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary
        self.tabled = getattr(rotary, "rope_type", "default") in self.PER_POSITION
        self.cos: torch.Tensor | None = None  # [P, 1, D] in the pass's dtype, with
        self.sin: torch.Tensor | None = None  # rotate_half's sign folded in (see rope_tables)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [B, T, 1, D] for positions [B, T] of a pass over x, every position below `bound`
        (the cache's capacity: a host number, so no device read)."""
        if not self.tabled:
            return rope_tables(*self.rotary(x, positions))
        cos = self.cos
        if cos is None or cos.shape[0] < bound or cos.dtype != x.dtype or cos.device != x.device:
            size = max(bound, 2 * cos.shape[0] if cos is not None and cos.dtype == x.dtype else 0)
            cos, sin = rope_tables(*self.rotary(x, torch.arange(size, device=x.device)[None]))
            self.cos, self.sin = cos[0], sin[0]
        return self.cos[positions], self.sin[positions]


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """x <- x*cos + rotate_half(x)*sin for x [B, T, H, D], rotate_half being a swap of the two halves."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # flip copies, so x can be updated in place
    x.mul_(cos).addcmul_(swapped, signed_sin)
