"""Plain decoding next to what `--mode auto` chooses on this machine, same prompts, side by side."""

from __future__ import annotations

import argparse
import sys
import textwrap

import torch

from medusa.runtime.auto import describe_auto
from medusa.errors import MedusaError
from medusa.decoding.target.hardware import DTYPE_CHOICES
from medusa.runtime import Runtime
from medusa.runtime.args import int_list

PROMPTS = ["Explain in three sentences why the sky is blue.",
           "Write a Python function that checks whether a string is a palindrome."]
# The batch-size table's prompts: several kinds, so no size is timed on one kind of text alone.
MORE = ["Translate into Spanish: 'The museum opens at nine, but the best time to visit is after lunch.'",
        "List five tips for keeping houseplants alive in winter.",
        "Summarize the plot of Romeo and Juliet in four sentences.",
        "What is the difference between a list and a tuple in Python? Give an example of each.",
        "Write a short, friendly email asking a colleague to review a report by Friday.",
        "Explain what a hash table is to a beginner programmer."]
WIDTH = 60


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="medusa-demo", description=__doc__)
    p.add_argument("--prompt", action="append", help="prompt (repeatable); two built-in ones by default")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--mode", default="auto", choices=["auto", "heads"],
                   help="auto (default): what this machine's calibration recommends; heads: always speculate")
    p.add_argument("--tree", default=None, help="with --mode heads: the tree")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="{auto,bf16,fp32}")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8], metavar="1,2,4,8",
                   help="then time plain decoding against auto mode at these batch sizes and say what auto "
                        "chose at each")
    p.add_argument("--no-table", action="store_true", help="skip the batch-size table")
    p.add_argument("--table-tokens", type=int, default=64, help="new tokens per row in the batch-size table")
    args = p.parse_args(argv)
    texts = args.prompt or PROMPTS
    try:
        rt = Runtime.load("default", "default", args.dtype)
        if rt.heads is None and rt.feature is None:
            raise MedusaError("no shipped heads found in medusa/assets")
        prompts = rt.encode(texts)
        print(f"machine: {rt.machine.describe()}")
        print(f"dtype:   {rt.dtype.name} ({rt.dtype.reason})")
        auto = rt.auto(len(prompts)) if args.mode == "auto" else None
        proposer = rt.proposer("heads", args.tree) if args.mode == "heads" else None
        if auto is not None:
            print(describe_auto(rt, auto, len(prompts)).removeprefix("medusa: "))
        # Warm-up, both sides alike: first calls pack the head's weights and pick kernels for each pass shape
        # (auto's own gate and counts stay untouched: the warm-up runs a fresh instance).
        rt.engine.generate(prompts, 16)
        warm_auto = rt.auto(len(prompts), progress=False) if auto is not None else None
        rt.engine.generate(prompts, 16, proposer, policy=warm_auto)
        plain = rt.engine.generate(prompts, args.max_new_tokens)
        spec = rt.engine.generate(prompts, args.max_new_tokens, proposer, policy=auto)
    except MedusaError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    label = "auto" if auto is not None else "heads"
    for i, (a, b) in enumerate(zip(plain.outputs, spec.outputs)):
        print(f"\n=== prompt {i + 1}: {texts[i]}")
        side_by_side(rt.decode(a.tokens), rt.decode(b.tokens), label)
        print(identity_line(rt, prompts[i], a.tokens, b.tokens))
    print(f"\nplain : {plain.tokens_per_s:6.1f} tok/s, {plain.stats.forward_passes} forward passes, "
          f"{plain.stats.new_tokens} tokens")
    print(f"{label:6s}: {spec.tokens_per_s:6.1f} tok/s, {spec.stats.forward_passes} forward passes, "
          f"{spec.stats.new_tokens} tokens, tau {spec.stats.mean_accepted:.2f} tokens/step, "
          f"speedup {spec.tokens_per_s / plain.tokens_per_s:.2f}x")
    if auto is not None:
        print(f"auto steps: {auto.steps['speculative']} speculative, {auto.steps['plain']} plain"
              + (f"; {'; '.join(auto.events)}" if auto.events else ""))
    if spec.stats.steps and any(spec.stats.acceptance_by_head()):
        print("per-head acceptance: " + ", ".join(f"{a:.2f}" for a in spec.stats.acceptance_by_head()))
    if args.mode == "auto" and not args.no_table:
        batch_table(rt, rt.encode(texts + MORE), args.batch_sizes, args.table_tokens)
    return 0


def batch_table(rt: Runtime, prompts: list[list[int]], sizes: list[int], max_new_tokens: int) -> None:
    """Plain decoding against default flags at each batch size (one batch each: a short run moves by several
    percent), with what auto mode chose there: its plan, its steps, and any pause of its gate."""
    from medusa.eval.bench import batched_rates

    print(f"\nby batch size ({max_new_tokens} new tokens per row, one batch each, prompts of several kinds):")
    for b, r in batched_rates(rt, prompts, sizes, max_new_tokens, repeats=1, max_groups=1).items():
        plan, steps = r["auto_plan"], r["auto_steps"]
        chose = f"{plan['tree']} planned" if plan["tree"] else "plain decoding planned"
        print(f"  bs {b}: plain {r['plain']:6.1f} tok/s, auto {r['auto']:6.1f} tok/s, {r['speedup']:.2f}x; "
              f"auto: {chose}, {steps['speculative']} speculative and {steps['plain']} plain steps, "
              f"tau {r['auto_tau']:.2f}")


def side_by_side(left_text: str, right_text: str, label: str) -> None:
    left, right = textwrap.wrap(left_text, WIDTH) or [""], textwrap.wrap(right_text, WIDTH) or [""]
    print(f"{'plain':<{WIDTH}} | {label}")
    for k in range(max(len(left), len(right))):
        print(f"{left[k] if k < len(left) else '':<{WIDTH}} | {right[k] if k < len(right) else ''}")


def identity_line(rt: Runtime, prompt: list[int], a: list[int], b: list[int]) -> str:
    """'identical tokens', or where the outputs part and how close the target's top two logits were there:
    in bf16 a tree pass and a one-token pass round differently, so a near-tie may fall either way."""
    if a == b:
        return "identical tokens: yes"
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    with torch.inference_mode():
        ids = torch.tensor([prompt + a[:n]], device=rt.model.device)
        logits = rt.hf_model(ids).logits[0, -1].float()
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    return (f"identical tokens: no, from token {n + 1} on: the target's top two logits there are {gap:.3f} apart "
            f"(a near-tie that {rt.dtype.name} rounding decides; fp32 decoding is token-identical)")


if __name__ == "__main__":
    sys.exit(main())
