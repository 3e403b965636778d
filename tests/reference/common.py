"""What the reference drivers share: reading the request the test wrote and writing the answer back.

A driver runs inside one of the side environments `scripts/reference_envs.sh` builds (torch and an older
transformers, plus another project's package); it must import nothing from this repository's package.
The request and the answer are torch files: tensors plus plain Python values."""

from __future__ import annotations

import sys
import traceback

import torch


def request() -> tuple[dict, str]:
    """The request (argv[1]) and where the answer goes (argv[2])."""
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} REQUEST.pt ANSWER.pt")
    return torch.load(sys.argv[1], weights_only=False), sys.argv[2]


def key_report(expected: dict, given: dict, filled: set[str] = frozenset()) -> dict:
    """How the checkpoint `given` fits the module state `expected`: keys missing from it (apart from
    `filled`, which the loader fills by design), unexpected keys, and shape mismatches."""
    missing = sorted(set(expected) - set(given) - set(filled))
    unexpected = sorted(set(given) - set(expected))
    shapes = sorted(k for k in set(expected) & set(given) if tuple(expected[k].shape) != tuple(given[k].shape))
    return {"missing": missing, "unexpected": unexpected, "wrong_shape": shapes,
            "filled": sorted(set(filled) & set(expected) - set(given))}


def run(main) -> None:
    """Run `main(req) -> answer`, writing the answer, or the failure with its traceback, to argv[2]."""
    req, out = request()
    torch.set_num_threads(int(req.get("threads", 2)))
    try:
        answer = main(req)
    except Exception as exc:  # the test reports it
        answer = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    answer["versions"] = versions()
    torch.save(answer, out)
    if "error" in answer:
        print(answer["traceback"], file=sys.stderr)
        raise SystemExit(1)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "eagle-llm", "medusa-llm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found
