"""Resident memory a packed linear layer adds per matrix shape it meets, with the compiled-kernel caches
capped or not (`medusa serve --kernel-cache-entries`, `medusa.decoding.target.hardware.limit_kernel_caches`).

Each setting runs in a fresh process (the caps take effect only before the first oneDNN kernel): one
packed layer of `--features IN OUT`, then `--shapes` passes of 2, 3, ... rows, twice over; RSS is read
after each round. A second round over the same shapes adds nothing when every shape stayed cached.

    python benchmarks/kernel_cache_memory.py --shapes 200 --caps default,256,64,8 --json OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys
from medusa.decoding.target.hardware import limit_kernel_caches
caps = limit_kernel_caches(None if sys.argv[1] == "default" else int(sys.argv[1]))
import torch
from medusa.decoding.target.kernels import packed_linear
from medusa.serve.memory import MALLOC_TRIM, resident_bytes
torch.set_num_threads(1)
n_in, n_out, shapes = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
layer = packed_linear(torch.nn.Linear(n_in, n_out).requires_grad_(False))
layer(torch.randn(1, n_in))
start, rounds = resident_bytes(), []
with torch.inference_mode():
    for _ in range(2):
        for m in range(2, shapes + 2):
            layer(torch.randn(m, n_in))
        rounds.append((resident_bytes() - start) / 2**20)
if MALLOC_TRIM is not None:
    MALLOC_TRIM(0)
trimmed = (resident_bytes() - start) / 2**20
print(json.dumps({"caps": caps, "grown_mb": [round(r, 1) for r in rounds], "after_trim_mb": round(trimmed, 1),
                  "mb_per_shape": round(rounds[0] / shapes, 3)}))
"""


def measure(cap: str, n_in: int, n_out: int, shapes: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, cap, str(n_in), str(n_out), str(shapes)],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=int, nargs=2, default=[576, 1536], metavar=("IN", "OUT"))
    ap.add_argument("--shapes", type=int, default=200)
    ap.add_argument("--caps", default="default,256,64,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from medusa.decoding.target.hardware import machine

    rows = {cap: measure(cap, *args.features, args.shapes) for cap in args.caps.split(",")}
    for cap, r in rows.items():
        print(f"cap {cap:>7}: +{r['grown_mb'][0]:.1f} MB after {args.shapes} shapes, +{r['grown_mb'][1]:.1f} MB "
              f"after the same shapes again, +{r['after_trim_mb']:.1f} MB after malloc_trim "
              f"({r['mb_per_shape']:.3f} MB per shape)")
    out = {"command": " ".join(["benchmarks/kernel_cache_memory.py", *(argv or sys.argv[1:])]),
           "features": args.features, "shapes": args.shapes, "results": rows,
           "machine": {k: v for k, v in machine().__dict__.items()}}
    if args.json:
        from medusa.io import write_json_atomic

        write_json_atomic(Path(args.json), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
