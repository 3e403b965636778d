"""Decoding speed of two revisions, interleaved: is a change within noise?

    python benchmarks/compare_revisions.py --base ab92dff --rounds 3 \
        --bench-args "--no-hf --feature none --tree tree-16 --num-prompts 2 --max-new-tokens 64" \
        --json benchmarks/results/compare-revisions.json

Checks the base revision out into a temporary git worktree, then runs `medusa bench` (same arguments, this
interpreter) alternately in the worktree and in this checkout, `--rounds` times each, so that whatever else
the machine is doing weighs on both alike. Reports each method's tokens per second per round, the medians,
and the median over rounds of this checkout's speed over the base's; with `--batch-sizes` in the bench
arguments, default flags and plain decoding at each batch size too, and their ratio. Beside the speeds, each
speculative method's tau (tokens per step) in each revision: greedy output is the same text, so a change
that kept the algorithm keeps tau to rounding (auto mode's can move with its timing-driven choices).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(where: Path, args: list[str], out: Path) -> tuple[dict[str, float], dict[str, float], dict]:
    """(tok/s per timed method, tau per speculative method, the machine) of one `medusa bench` run in `where`."""
    env = dict(os.environ, PYTHONPATH=str(where))
    subprocess.run([sys.executable, "-m", "medusa.cli", "bench", *args, "--json", str(out)], cwd=where, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    speeds, taus = dict(report["tokens_per_s"]), dict(report.get("mean_accepted") or {})
    for b, row in (report.get("batched") or {}).items():  # `--batch-sizes`: default flags and plain per size
        # Paired: each batch's default/plain, median over batches (computed here, so a base revision that
        # reported a ratio of medians is read the same way).
        paired = statistics.median(a / p for a, p in zip(row["auto_all"], row["plain_all"]))
        speeds.update({f"bs{b} plain": row["plain"], f"bs{b} auto": row["auto"], f"bs{b} auto/plain": paired})
        taus[f"bs{b} auto"] = row["auto_tau"]
    # A base from before today's names reports its methods as suffix:N (retrieval) and medusa:TREE (the
    # heads' mode): read as today's names.
    renamed = lambda d: {k.replace("suffix", "retrieval").replace("medusa:", "heads:"): v  # noqa: E731
                         for k, v in d.items()}
    return renamed(speeds), renamed(taus), report["machine"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare against (a commit or ref)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bench-args", default="--no-hf --num-prompts 2 --max-new-tokens 64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bench_args = shlex.split(args.bench_args)
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    runs: dict[str, list[dict[str, float]]] = {base: [], "HEAD": []}
    tau_runs: dict[str, list[dict[str, float]]] = {base: [], "HEAD": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for r in range(args.rounds):
                for name, where in ((base, tree), ("HEAD", ROOT)):
                    speeds, taus, machine = bench(where, bench_args, Path(tmp) / f"{name}-{r}.json")
                    runs[name].append(speeds)
                    tau_runs[name].append(taus)
                    print(f"round {r + 1} {name}: " + ", ".join(f"{m} {v:.1f}" for m, v in runs[name][-1].items()),
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    methods = [m for m in runs["HEAD"][0] if all(m in run for run in runs[base] + runs["HEAD"])]
    medians = {name: {m: statistics.median(run[m] for run in rs) for m in methods} for name, rs in runs.items()}
    # Each round's two runs were neighbours in time: the median of their ratios is the steadier figure.
    ratio = {m: round(statistics.median(h[m] / b[m] for b, h in zip(runs[base], runs["HEAD"])), 3)
             for m in methods}
    tau_methods = [m for m in tau_runs["HEAD"][0] if all(m in run for run in tau_runs[base] + tau_runs["HEAD"])]
    tau = {name: {m: round(statistics.median(run[m] for run in rs), 3) for m in tau_methods}
           for name, rs in tau_runs.items()}
    for m in methods:
        print(f"{m:>24}: {base} {medians[base][m]:.1f} tok/s, HEAD ({head}) {medians['HEAD'][m]:.1f} tok/s, "
              f"median ratio of rounds {ratio[m]:.3f}" + (f"; tau {tau[base][m]:.3f} -> {tau['HEAD'][m]:.3f}"
                                                        if m in tau_methods else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine,
            "command": "python benchmarks/compare_revisions.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "base": base, "head": head, "runs": runs, "medians": medians, "head_over_base": ratio,
            "tau_runs": tau_runs, "tau": tau}, indent=1))


if __name__ == "__main__":
    main()
