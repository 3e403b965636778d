"""Command-line arguments shared by the commands that load a runtime: model, heads, dtype, device, sampling."""

from __future__ import annotations

import argparse

from medusa.decoding.target.hardware import DTYPE_CHOICES
from medusa.errors import MedusaError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct), a model "
                   "directory, a .gguf file or a hub id")
    p.add_argument("--heads", default="default", help="heads directory (Medusa heads, or feature heads: ours or an "
                   "EAGLE-1/EAGLE-3 layout), 'default' (the shipped heads that measured fastest), 'medusa' or "
                   "'feature' (the shipped heads of that kind) or 'none'")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, metavar="{auto,bf16,fp16,fp32}",
                   help="auto (default): bf16 where the hardware multiplies it natively, fp32 elsewhere")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--batch-invariant", default="off", choices=["on", "off"],
                   help="on: a row's tokens never depend on the other rows, tree or pass shape it is decoded in, "
                        "so greedy speculative decoding equals plain decoding bit for bit in bf16 too (CPUs whose "
                        "kernels pass the check; costs speed, see docs/engine.md)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--acceptance", default=None, choices=["greedy", "rejection", "typical"],
                   help="how speculative candidates are accepted when sampling (default: rejection, "
                        "lossless; greedy when temperature is 0)")
    p.add_argument("--typical-epsilon", type=float, default=0.3)
    p.add_argument("--typical-delta", type=float, default=0.09)


def sampling_from_args(args: argparse.Namespace):
    from medusa.decoding.sampling import SamplingParams

    acceptance = args.acceptance or ("greedy" if args.temperature == 0 else "rejection")
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              acceptance=acceptance, typical_epsilon=args.typical_epsilon,
                              typical_delta=args.typical_delta)
    except MedusaError as exc:
        raise MedusaError(f"--{str(exc).split()[0].replace('_', '-')}: {exc}") from None


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals
