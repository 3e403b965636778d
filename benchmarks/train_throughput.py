"""Training throughput on this machine, side by side in one run, for the costly steps of making heads:

    python benchmarks/train_throughput.py feature --steps 30 --rev 05335ee   # train-feature: then vs fp32 vs auto
    python benchmarks/train_throughput.py distill --prompts 256   # medusa distill: batch 16 vs auto
    python benchmarks/train_throughput.py medusa --steps 10       # medusa train: cached hidden states vs live
    python benchmarks/train_throughput.py extract --prompts 96    # train-feature's cache: chunks alone vs together

feature: trained positions per second of the configured feature-head recipe with `precision=fp32` and with
`precision=auto` (bf16 matmuls with fp32 master weights where the CPU multiplies bf16 natively), on the
configured run's cached features (`medusa train-feature --prepare-only` first, or the first run builds them).
distill: answer tokens per second of greedy distillation with the former fixed batch size (16) and with the
batch size `distill_batch_size: auto` picks from the calibrated curve, on the same prompts.
medusa: label positions per second of Medusa-1 training from cached hidden states and with a live frozen
forward per step. extract: positions per second of the offline feature cache (`medusa train-feature
--prepare-only`) with each missing chunk extracted alone and with chunks extracted together
(`medusa.train.feature_data.EXTRACT_SEQUENCES`), on the config's first `--prompts` sequences, each into an
empty cache, with the padded positions each way (`--count-only`: only those, no target loaded). Every
result names the machine; `--out FILE` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from medusa.io import write_json_atomic


def _with_cache(cache: Path, name: str, run_dir: str) -> None:
    """Reuse a configured run's cache (features or hidden states) inside a throw-away run directory."""
    if cache.is_dir():
        os.symlink(cache.resolve(), Path(run_dir) / name)


def feature_rows(config: str, steps: int, batch: int | None, overrides: list[str]) -> list[dict]:
    """Per precision, by difference as for `--rev`: a (steps + 1)-step run minus a 1-step run, so the first
    step (the kernels' one-time set-up) is left out of every row alike."""
    from medusa.train.feature import load_feature_config, run_feature_training

    def run(precision: str, n: int) -> tuple[float, int, int]:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg0 = load_feature_config(config, overrides)
            _with_cache(Path(cfg0.run_dir) / "features", "features", run_dir)
            extra = [f"run_dir={run_dir}", f"max_steps={n}", f"precision={precision}", "wandb.mode=disabled",
                     "data.eval_fraction=0", f"checkpoint_every={n + 1}", f"log_every={n + 1}"]
            extra += [f"batch_size={batch}"] if batch else []
            cfg = load_feature_config(config, overrides + extra)
            result = run_feature_training(cfg, progress=False)
        return result["train_seconds"], result["trained_tokens"], cfg.batch_size

    rows = []
    for precision in ("fp32", "auto"):
        t1, p1, _ = run(precision, 1)
        tn, pn, bs = run(precision, steps + 1)
        rows.append({"what": "train-feature", "precision": precision, "steps": steps, "batch_size": bs,
                     "positions": pn - p1, "train_seconds": round(tn - t1, 2),
                     "positions_per_s": round((pn - p1) / max(tn - t1, 1e-9), 1)})
    return rows


REV_SNIPPET = """
import json, sys, time
sys.path.insert(0, sys.argv[4])  # the revision's tree, ahead of an editable install of the current one
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
import medusa
from medusa.train.feature import load_feature_config, run_feature_training
assert medusa.__file__.startswith(sys.argv[4]), f"imported {medusa.__file__}, not the revision's package"
config, overrides = sys.argv[1], json.loads(sys.argv[2])
out = []
for steps in (1, 1, int(sys.argv[3]) + 1):  # the first run also builds any cache this revision reads
    cfg = load_feature_config(config, overrides + [f"max_steps={steps}", f"checkpoint_every={steps + 1}"])
    t0 = time.perf_counter()
    result = run_feature_training(cfg, progress=False)
    out.append((time.perf_counter() - t0, result["trained_tokens"]))
print(json.dumps(out))
"""


def feature_rev_row(config: str, steps: int, batch: int | None, overrides: list[str], rev: str) -> dict:
    """The same measurement with the package as it was at git revision `rev` (its default precision), by
    difference: a (steps + 1)-step run minus a 1-step run, so loading the target and the cached features,
    which both pay alike, drops out (after a first 1-step run that builds whatever cache the revision
    reads). Runs in a temporary git worktree."""
    import shutil
    import subprocess

    wt = Path(tempfile.mkdtemp(prefix="medusa-rev-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(wt), rev], check=True, capture_output=True)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg0 = __import__("medusa.train.feature", fromlist=["x"]).load_feature_config(config, overrides)
            _with_cache(Path(cfg0.run_dir) / "features", "features", run_dir)
            extra = [f"run_dir={run_dir}", "wandb.mode=disabled", "data.eval_fraction=0", "log_every=100000"]
            extra += [f"batch_size={batch}"] if batch else []
            env = {**os.environ, "PYTHONPATH": str(wt)}
            proc = subprocess.run([sys.executable, "-c", REV_SNIPPET, str(Path(config).resolve()),
                                   json.dumps(overrides + extra), str(steps), str(wt)], env=env,
                                  capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"--rev {rev}: the measurement failed:\n{proc.stderr[-2000:]}")
        _, (t1, p1), (tn, pn) = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(wt)], capture_output=True)
        shutil.rmtree(wt, ignore_errors=True)
    return {"what": "train-feature", "precision": f"as at {rev}", "steps": steps, "positions": pn - p1,
            "train_seconds": round(tn - t1, 2), "positions_per_s": round((pn - p1) / max(tn - t1, 1e-9), 1)}


def distill_rows(config: str, prompts: int, overrides: list[str]) -> list[dict]:
    from medusa.runtime import Runtime
    from medusa.train.config import load_config
    from medusa.train.distill import answer_all, distill_batch_size, select_prompts

    cfg = load_config(config, overrides + [f"data.limit={prompts}"])
    rt = Runtime.load(cfg.model, heads="none", dtype=cfg.dtype)
    ids = [p for _, p in select_prompts(cfg, rt.tokenizer)]
    auto = distill_batch_size(cfg.model_copy(update={"data": cfg.data.model_copy(
        update={"distill_batch_size": "auto"})}), rt, len(ids))
    rows = []
    for label, size in (("fixed", 16), ("auto", auto)):
        start = time.perf_counter()
        finished = answer_all(rt.engine, ids, cfg.data.max_new_tokens, size)
        seconds = time.perf_counter() - start
        tokens = sum(len(f.tokens) for f in finished)
        rows.append({"what": "distill", "batch": label, "batch_size": size, "prompts": len(ids),
                     "answer_tokens": tokens, "seconds": round(seconds, 2),
                     "answer_tokens_per_s": round(tokens / seconds, 1), "dtype": cfg.dtype})
    return rows


def extract_rows(config: str, prompts: int, overrides: list[str], count_only: bool = False) -> list[dict]:
    import torch

    import medusa.train.feature_data as fd
    from medusa.decoding.target.model import load_target
    from medusa.train.data import length_batches, load_examples
    from medusa.train.feature import chunk_groups, load_feature_config

    cfg = load_feature_config(config, overrides + [f"data.limit={prompts}"])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if count_only:
        from transformers import AutoTokenizer

        from medusa.decoding.target.model import resolve_model_dir

        hf, tokenizer = None, AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model))
    else:
        hf, tokenizer = load_target(cfg.model, cfg.dtype, "cpu")
    chunks = [(name, "bench", exs) for name, exs in chunk_groups(cfg, load_examples(cfg, tokenizer))]
    if hf is not None:
        fn = fd.feature_fn(hf, cfg.head.feature_layers)
        fd.extract([e for _, _, exs in chunks[:1] for e in exs][:2], fn)  # warm-up: kernels chosen
    positions = sum(len(e["input_ids"]) for _, _, exs in chunks for e in exs)
    rows = []
    for label, together in (("alone", 1), ("together", fd.EXTRACT_SEQUENCES)):
        padded = 0
        for group in fd.extraction_groups(chunks, together):
            exs = [e for _, _, c in group for e in c]
            padded += sum(len(b) * max(len(exs[k]["input_ids"]) for k in b) for b in length_batches(exs, 4096))
        row = {"what": "extract", "chunks": label, "sequences_per_extraction": together,
               "sequences": sum(len(c) for _, _, c in chunks), "positions": positions, "padded_positions": padded,
               "padding": round(padded / positions - 1, 4)}
        if count_only:
            rows.append(row)
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            start = time.perf_counter()
            fd.extract_missing(Path(run_dir), chunks, fn, together=together)
            seconds = time.perf_counter() - start
        rows.append(row | {"seconds": round(seconds, 2), "positions_per_s": round(positions / seconds, 1)})
    return rows


def medusa_rows(config: str, steps: int, batch: int, seqs: int, subset: int | None) -> list[dict]:
    from medusa.train.config import load_config
    from medusa.train.trainer import run_training

    rows = []
    for cached in (True, False):
        with tempfile.TemporaryDirectory() as run_dir:
            _with_cache(Path(load_config(config).run_dir) / "hidden", "hidden", run_dir)
            overrides = [f"run_dir={run_dir}", f"max_steps={steps}", f"cache_hidden={str(cached).lower()}",
                         f"loss.vocab_subset={'null' if subset is None else subset}",
                         f"batch_size={batch if cached else seqs}", "wandb.mode=disabled", "evaluate=false",
                         f"checkpoint_every={steps + 1}"]
            result = run_training(load_config(config, overrides))
        rows.append({"what": "train", "path": "cached" if cached else "plain", "steps": steps,
                     "vocab_subset": subset, "positions": result["trained_positions"],
                     "train_seconds": round(result["train_seconds"], 2),
                     "positions_per_s": round(result["trained_positions"] / max(result["train_seconds"], 1e-9), 1),
                     "cache_build_seconds": round(result.get("table_seconds", 0.0), 2) if cached else 0.0})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["feature", "distill", "medusa", "extract"])
    p.add_argument("--config", help="training YAML (default: configs/feature/smollm2-feature.yaml for feature, "
                                    "configs/train/smollm2-medusa1.yaml otherwise)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--steps", type=int, default=30, help="training steps per measured path")
    p.add_argument("--batch-size", type=int, default=None,
                   help="feature: sequences per step (default: the config's); medusa: positions per step (256)")
    p.add_argument("--sequences", type=int, default=2, help="medusa: sequences per step (plain path)")
    p.add_argument("--vocab-subset", type=int, default=None, help="medusa: loss.vocab_subset for both paths")
    p.add_argument("--prompts", type=int, default=256,
                   help="distill: prompts answered per batch-size setting; extract: prompts whose features are made")
    p.add_argument("--count-only", action="store_true",
                   help="extract: count the padded positions each way, extracting nothing (no target loaded)")
    p.add_argument("--rev", help="feature: also measure the package as it was at this git revision (before/after)")
    p.add_argument("--out", help="write the rows, with the machine and the command, to this JSON file")
    args = p.parse_args()
    if args.what == "feature":
        rows = feature_rows(args.config or "configs/feature/smollm2-feature.yaml", args.steps, args.batch_size,
                            args.set)
        key, ratio = "positions_per_s", "bf16_over_fp32"
        if args.rev:
            rows.insert(0, feature_rev_row(args.config or "configs/feature/smollm2-feature.yaml", args.steps,
                                           args.batch_size, args.set, args.rev))
            rows = [rows[0], rows[2], rows[1]]  # before, then after: ratio = after (auto) / before
            ratio = f"auto_over_{args.rev}"
    elif args.what == "extract":
        rows = extract_rows(args.config or "configs/feature/smollm2-feature.yaml", args.prompts, args.set,
                            args.count_only)
        key, ratio = "padded_positions" if args.count_only else "positions_per_s", "together_over_alone"
    elif args.what == "distill":
        rows = distill_rows(args.config or "configs/train/smollm2-medusa1.yaml", args.prompts, args.set)
        key, ratio = "answer_tokens_per_s", "auto_over_fixed"
    else:
        rows = medusa_rows(args.config or "configs/train/smollm2-medusa1.yaml", args.steps, args.batch_size or 256,
                           args.sequences, args.vocab_subset)
        key, ratio = "positions_per_s", "cached_over_plain"
        rows.reverse()
    from medusa.decoding.target.hardware import machine

    report = {"machine": machine().to_dict(), "command": " ".join(sys.argv), "rows": rows,
              ratio: round(rows[1][key] / max(rows[0][key], 1e-9), 2)}
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({ratio: report[ratio], "machine": report["machine"]}))
    if args.out:
        write_json_atomic(Path(args.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
