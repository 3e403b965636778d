"""tau against trained positions and unique prompts, as a plot: one series per training set.

    python benchmarks/tau_curve.py --out benchmarks/results/tau_curve.png \
        --title "Feature head: tau against trained positions (MT-bench, dynamic-16x5x4)" \
        --series "8,232 distilled prompts=benchmarks/results/feature_tau_8k_mtbench_a.json,\
benchmarks/results/feature_tau_8k_mtbench_b.json|checkpoints" \
        --series "16,512 distilled prompts=benchmarks/results/feature_tau_16k_mtbench.json|feature-16k" \
        --series "24,576 distilled prompts=benchmarks/results/feature_tau_24k_mtbench.json,\
benchmarks/results/feature_tau_24k_8000_mtbench.json|feature-24k" \
        --series "28,672 (continued from 24,576)=benchmarks/results/feature_tau_24k_8000_mtbench.json,\
benchmarks/results/feature_tau_28k_12000_mtbench.json,benchmarks/results/feature_tau_28k_16000_mtbench.json" \
        --series "32,768 (continued from 28,672)=benchmarks/results/feature_tau_28k_16000_mtbench.json,\
benchmarks/results/feature_tau_32k_mtbench.json" \
        --series "36,864 (continued from 32,768)=benchmarks/results/feature_tau_32k_mtbench.json,\
benchmarks/results/feature_tau_36k_mtbench.json|step-00024000/head:dynamic-16x5x4;feature-36k/head:dynamic-16x5x4" \
        --series "44,544 (continued from 36,864)=benchmarks/results/feature_tau_36k_mtbench.json,\
benchmarks/results/feature_tau_44k_mtbench.json|feature-36k/head:dynamic-16x5x4;feature-44k/head:dynamic-16x5x4"

(then `cp benchmarks/results/tau_curve.png docs/img/`: the docs show a copy). Each FILE is a
`benchmarks/feature_tau.py --json` result (or an object of them); every result row with a `trained_tokens`
count is one point (x: trained positions, y: tau), series by its label. A series written
`LABEL=FILES|TEXT` keeps only the rows whose method contains TEXT (a run directory, a tree shape; several
TEXTs separated by `;`: any of them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows_of(data) -> list[dict]:
    """Every result row in a feature_tau JSON file (nested result objects included)."""
    if isinstance(data, dict):
        found = list(data.get("results", []))
        for key, value in data.items():
            if key != "results" and isinstance(value, (dict, list)):
                found += rows_of(value)
        return found
    if isinstance(data, list):
        return [r for item in data for r in rows_of(item)]
    return []


def points(files: list[str], method_filter: str | None) -> list[tuple[int, float]]:
    out = set()
    for f in files:
        for r in rows_of(json.loads(Path(f).read_text())):
            if r.get("trained_tokens") and (method_filter is None
                                            or any(t in r["method"] for t in method_filter.split(";"))):
                out.add((int(r["trained_tokens"]), float(r["tau"])))
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", action="append", required=True, metavar="LABEL=FILE[,FILE...][|TEXT]")
    ap.add_argument("--title", default="Feature head: tau against training (dynamic-16x5, bs 1, greedy)")
    ap.add_argument("--out", required=True, help="PNG file")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for spec in args.series:
        label, _, rest = spec.partition("=")
        files, _, method_filter = rest.partition("|")
        pts = points(files.split(","), method_filter or None)
        if not pts:
            print(f"no points with trained_tokens in {files}", file=sys.stderr)
            return 2
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for x, y in pts:
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("trained positions")
    ax.set_ylabel("tau (tokens per verification step)")
    ax.set_title(args.title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
