"""Training throughput of the Medusa-1 paths: cached hidden states vs a live frozen forward per step.

    python benchmarks/train_throughput.py --config configs/train/smollm2-medusa1.yaml --steps 10

Reports label positions trained per second (head-0 labels; every position feeds all heads) for each path,
and the one-off cost of building the cache. Uses the config's distilled data (run `medusa distill` first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from medusa.train.config import load_config
from medusa.train.trainer import run_training


def measure(config: str, steps: int, cached: bool, batch: int, seqs: int, subset: int | None) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        # Reuse the configured run's hidden-state cache (built by `medusa train --prepare-only`) if any.
        hidden = Path(load_config(config).run_dir).resolve() / "hidden"
        if hidden.is_dir():
            os.symlink(hidden, Path(run_dir) / "hidden")
        overrides = [f"run_dir={run_dir}", f"max_steps={steps}", f"cache_hidden={str(cached).lower()}",
                     f"loss.vocab_subset={'null' if subset is None else subset}",
                     f"batch_size={batch if cached else seqs}", "wandb.mode=disabled", "evaluate=false",
                     f"checkpoint_every={steps + 1}"]
        result = run_training(load_config(config, overrides))
    return {"path": "cached" if cached else "plain", "steps": steps, "vocab_subset": subset,
            "positions": result["trained_positions"], "train_seconds": round(result["train_seconds"], 2),
            "positions_per_s": round(result["trained_positions"] / max(result["train_seconds"], 1e-9), 1),
            "cache_build_seconds": round(result.get("table_seconds", 0.0), 2) if cached else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/train/smollm2-medusa1.yaml")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256, help="positions per step (cached path)")
    p.add_argument("--sequences", type=int, default=2, help="sequences per step (plain path)")
    p.add_argument("--vocab-subset", type=int, default=None, help="loss.vocab_subset for both paths")
    args = p.parse_args()
    rows = [measure(args.config, args.steps, True, args.batch_size, args.sequences, args.vocab_subset),
            measure(args.config, args.steps, False, args.batch_size, args.sequences, args.vocab_subset)]
    for row in rows:
        print(json.dumps(row))
    speedup = rows[0]["positions_per_s"] / max(rows[1]["positions_per_s"], 1e-9)
    print(json.dumps({"cached_over_plain": round(speedup, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
