"""Plain decoding vs Medusa on the embedded model, same prompts, side by side."""

from __future__ import annotations

import argparse
import sys
import textwrap

from .errors import MedusaError
from .hardware import DTYPE_CHOICES
from .runtime import Runtime

PROMPTS = ["Explain in three sentences why the sky is blue.",
           "Write a Python function that checks whether a string is a palindrome."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="medusa-demo", description=__doc__)
    p.add_argument("--prompt", action="append", help="prompt (repeatable); two built-in ones by default")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default=None)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="{auto,bf16,fp32}")
    args = p.parse_args(argv)
    try:
        rt = Runtime.load("default", "default", args.dtype)
        if rt.heads is None:
            raise MedusaError("no shipped heads found in medusa/assets/heads")
        prompts = rt.encode(args.prompt or PROMPTS)
        rt.engine.generate(prompts, 4)  # warm-up
        plain = rt.engine.generate(prompts, args.max_new_tokens)
        spec = rt.engine.generate(prompts, args.max_new_tokens, rt.proposer("medusa", args.tree))
    except MedusaError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    width = 60
    for i, (a, b) in enumerate(zip(plain.outputs, spec.outputs)):
        print(f"\n=== prompt {i + 1}: {(args.prompt or PROMPTS)[i]}")
        left = textwrap.wrap(rt.decode(a.tokens), width) or [""]
        right = textwrap.wrap(rt.decode(b.tokens), width) or [""]
        print(f"{'plain':<{width}} | medusa")
        for k in range(max(len(left), len(right))):
            print(f"{left[k] if k < len(left) else '':<{width}} | {right[k] if k < len(right) else ''}")
        print(f"identical tokens: {a.tokens == b.tokens}")
    print(f"\nplain : {plain.tokens_per_s:6.1f} tok/s, {plain.stats.forward_passes} forward passes, "
          f"{plain.stats.new_tokens} tokens")
    print(f"medusa: {spec.tokens_per_s:6.1f} tok/s, {spec.stats.forward_passes} forward passes, "
          f"{spec.stats.new_tokens} tokens, tau {spec.stats.mean_accepted:.2f} tokens/step, "
          f"speedup {spec.tokens_per_s / plain.tokens_per_s:.2f}x")
    print("per-head acceptance: " + ", ".join(f"{a:.2f}" for a in spec.stats.acceptance_by_head()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
