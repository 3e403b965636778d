"""Which ops give a row a result that depends on the shape of the pass it is in.

For the embedded model (bf16 where the CPU multiplies it natively), each op on the decoding path is run on
one row alone and on the same row inside passes of 2..64 rows (for the projections, every row of passes of
2..512 rows against each row alone: a batched prefill reaches hundreds), and the results are compared bit for bit: the fused projections of a layer (wqkv, wo, w13, w2) and the
vocabulary projection (lm_head), the RMSNorm, attention over a cached prefix (a row's one query alone and
beside other rows; and the root of a 16-token tree against the same token alone), and the whole forward
pass (a row's last hidden state, one token alone against the same token in a batch, and in a tree pass).

    python benchmarks/row_invariance.py --out benchmarks/results/row-invariance-xeon-amx.json

A 0 in the table is a row that gets the same bits whatever the pass; anything else breaks greedy identity
between speculative and plain decoding at near-ties (`max_abs` is the largest difference seen).
"""

from __future__ import annotations

import argparse
import sys

import torch

from medusa.decoding.target.hardware import provenance
from medusa.decoding.target.transformer import causal
from medusa.io import write_json_atomic

ROWS = [2, 4, 8, 16, 32, 64]
LINEAR_ROWS = ROWS + [128, 192, 256, 512]  # a batched prefill's projections reach hundreds of rows


def compare(alone: torch.Tensor, inside: torch.Tensor) -> dict:
    """alone [..] vs the same row's result inside a bigger pass: share of differing elements, largest gap."""
    diff = (alone.float() - inside.float()).abs()
    return {"differ": round(float((diff > 0).float().mean()), 4), "max_abs": float(diff.max())}


def ops(model) -> dict:
    layer = model.layers[0]
    return {"wqkv": layer.wqkv.forward, "wo": layer.wo.forward, "w13": layer.w13.forward, "w2": layer.w2.forward,
            "lm_head": model.lm_head.forward, "rmsnorm": layer.ln1.forward}


def linear_rows(model, g: torch.Generator) -> dict[str, dict]:
    """Each op on every row alone, against the same rows in one pass of M rows (all of them compared: a
    kernel may round only some rows of a pass differently, such as those past a block of rows)."""
    out = {}
    for name, op in ops(model).items():
        width = {"wo": model.layers[0].wo.in_features, "w2": model.layers[0].w2.in_features}.get(
            name, model.config.hidden_size)
        x = torch.randn(max(LINEAR_ROWS), width, generator=g).to(model.dtype)
        alone = torch.cat([op(x[None, i: i + 1])[0] for i in range(len(x))])
        out[name] = {m: compare(alone[:m], op(x[None, :m])[0]) for m in LINEAR_ROWS}
    return out


def attention_rows(model, g: torch.Generator, window: int = 96) -> dict[str, dict]:
    """One query row over its cached window: the one-token path (fused kernel, no mask) and the short-block
    matmul path alone, against the matmul path inside passes of M rows (K/V in fp32 and in the model dtype)."""
    from medusa.decoding.target.kernels import attention, pass_mask, short_block_bias

    h, kvh, d = model.n_heads, model.n_kv, model.head_dim
    scale = model.layers[0].scale
    out = {}
    for kv_dtype in (torch.float32, model.dtype):
        q = torch.randn(64, 1, h, d, generator=g).to(model.dtype)
        k = torch.randn(64, kvh, window, d, generator=g).to(kv_dtype)
        v = torch.randn(64, kvh, window, d, generator=g).to(kv_dtype)

        def matmul(m: int) -> torch.Tensor:
            mask = pass_mask(torch.full((m,), window - 1), causal(1, "cpu"), window)
            bias = short_block_bias(mask, kvh, h // kvh, torch.float32 if kv_dtype == torch.float32 else kv_dtype)
            return attention(q[:m], k[:m], v[:m], mask, bias, scale)[0, 0]

        fused = attention(q[:1], k[:1], v[:1], None, None, scale)[0, 0]
        alone = matmul(1)
        name = str(kv_dtype).removeprefix("torch.")
        out[f"fused_vs_matmul_{name}"] = compare(fused, alone)
        out[f"matmul_{name}"] = {m: compare(alone, matmul(m)) for m in ROWS}
    return out


def whole_pass(model, g: torch.Generator, prefix: int = 96) -> dict[str, dict]:
    """The model's last hidden state for one row's next token: alone, inside a batch of M rows (each with its
    own prefix), and as the root of a T-token causal block (the tree verification pass's shape)."""
    v = model.config.vocab_size
    prompts = torch.randint(0, v, (64, prefix + 16), generator=g)
    cache = model.new_cache(64, prefix + 32)

    def run(rows: int, t: int) -> torch.Tensor:
        cache.lens[:rows] = 0
        model(prompts[:rows, :prefix], torch.arange(prefix).expand(rows, prefix), cache, slice(0, rows),
              causal(prefix, "cpu"))
        cache.lens[:rows] = prefix
        tokens = prompts[:rows, prefix: prefix + t]
        pos = (prefix + torch.arange(t)).expand(rows, t)
        return model(tokens, pos, cache, slice(0, rows), causal(t, "cpu"))[0, 0]

    alone = run(1, 1)
    return {"batch": {m: compare(alone, run(m, 1)) for m in ROWS},
            "tree": {t: compare(alone, run(1, t)) for t in (2, 4, 8, 16)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from medusa.runtime import Runtime

    if args.threads:
        torch.set_num_threads(args.threads)
    rt = Runtime.load(args.model, heads=None, dtype=args.dtype)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        result = {"ops": linear_rows(rt.model, g), "attention": attention_rows(rt.model, g),
                  "forward": whole_pass(rt.model, g)}
    result = {**provenance(rt.model.dtype), **result}
    for name, by_m in result["ops"].items():
        cells = " ".join(f"{m}:{c['max_abs']:.1e}" for m, c in by_m.items())
        print(f"{name:8s} {cells}")
    for kind, by in result["attention"].items():
        print(f"attention {kind:22s} " + (f"{by['max_abs']:.1e}" if "max_abs" in by else
                                           " ".join(f"{k}:{c['max_abs']:.1e}" for k, c in by.items())))
    for kind, by in result["forward"].items():
        print(f"forward {kind:6s} " + " ".join(f"{k}:{c['max_abs']:.1e}" for k, c in by.items()))
    if args.out:
        write_json_atomic(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
