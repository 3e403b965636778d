"""Evaluation output: report.json (schema below), report.md (tables) and PNG plots, all written atomically.

report.json
    model, device, dtype, threads, prompts, num_prompts, max_new_tokens, batch_sizes, repeats, config,
    sampling ({temperature, top_p, acceptance}, or null when greedy)
    results: one entry per (method, batch size):
        method, kind (plain|heads|draft|lookup|hf|hf_assisted|hf_lookup), batch_size,
        tokens_per_s_per_user, tokens_per_s_total (+ _min/_max over repeats), time_per_output_token_ms,
        seconds, new_tokens, repeats, mean_accepted (tau; null for HF), acceptance_by_head (list; null for
        HF), speedup_vs_plain (total throughput over ours at the same batch size), greedy_mismatches
        (outputs differing from the reference: our plain for our methods, HF plain for HF's),
        first_divergence (for each differing output, the index of its first differing token); both null
        in a sampled run; tau_by_kind {kind: tau} (medusa.eval.kinds; null for HF); realised (auto mode
        with measured heads: the share of its plans' expected gain its steps delivered, which its
        prediction plans with)
    kinds: {kind: prompts} of the prompt set (held-out kinds, MT-bench categories, a file's kind field, the
        source's name); report.md then has a table of tau by kind
    cost_model: latency_ms {target, draft: {grid [[B, T, ms]], fit {a_ms, b_ms_per_row, c_ms_per_token,
        max_rel_error}}, heads {B: ms}, feature_draft {B: {catch_up, expand, host}}}, acceptance,
        predicted {B: {plain, heads, feature, draft, ...}}, analytic {B: {c, speedup}},
        predicted_by_method {B: {method: speedup}} (medusa.eval.step_model), crossover_by_method
        {method: B|null}, fastest {B: {measured, measured_speedup, predicted, predicted_speedup}} (every
        method of ours, plain included), recommendation {B: heads|draft|plain} (the server's mode for the
        fastest), best_tree {B: name}, best_k {B: K}, crossover {kind: B|null}
    crossover: {kind: B|null} predicted; measured_crossover: the same from the runs;
        measured_crossover_by_method: {method: B|null}
    results also carry, for our methods, steps, tokens_per_pass, batches and prompt_tokens (what the
    per-method prediction reads)
"""

from __future__ import annotations

import json
from pathlib import Path

from medusa.eval.kinds import kinds_markdown
from medusa.eval.costmodel import SPECULATIVE
from medusa.io import write_atomic, write_text_atomic

REQUIRED_KEYS = ("model", "device", "dtype", "prompts", "max_new_tokens", "results", "cost_model", "crossover")
RESULT_KEYS = ("method", "batch_size", "tokens_per_s_per_user", "tokens_per_s_total", "mean_accepted",
               "acceptance_by_head", "speedup_vs_plain", "greedy_mismatches")


def validate(report: dict) -> None:
    """Raise ValueError naming the first missing or ill-typed field."""
    for key in REQUIRED_KEYS:
        if key not in report:
            raise ValueError(f"report.json: missing key {key!r}")
    if not isinstance(report["results"], list) or not report["results"]:
        raise ValueError("report.json: 'results' must be a non-empty list")
    for i, r in enumerate(report["results"]):
        for key in RESULT_KEYS:
            if key not in r:
                raise ValueError(f"report.json: results[{i}] has no {key!r}")
        if not isinstance(r["batch_size"], int) or r["batch_size"] < 1:
            raise ValueError(f"report.json: results[{i}].batch_size must be a positive integer")
        for key in ("tokens_per_s_per_user", "tokens_per_s_total", "speedup_vs_plain"):
            if not isinstance(r[key], (int, float)) or r[key] <= 0:
                raise ValueError(f"report.json: results[{i}].{key} must be a positive number")
    for key in ("heads", "draft"):
        if key not in report["crossover"]:
            raise ValueError(f"report.json: crossover has no {key!r}")


def write_report(report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    validate(report)
    write_text_atomic(out / "report.json", json.dumps(report, indent=2, default=_jsonable) + "\n")
    write_text_atomic(out / "report.md", markdown(report))
    if report.get("cost_model"):  # on its own too: what `medusa serve --cost-model` reads
        write_text_atomic(out / "cost_model.json", json.dumps(report["cost_model"], indent=2, default=_jsonable) + "\n")
    plots(report, out)
    return out


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def _f(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown(report: dict) -> str:
    lines = [f"# Evaluation: {report['model']}", "",
             f"device {report['device']}, dtype {report['dtype']}, threads {report.get('threads', '-')}, "
             f"prompts {report['prompts']} ({report.get('num_prompts', '-')}), "
             f"max_new_tokens {report['max_new_tokens']}, repeats {report.get('repeats', '-')} "
             f"(medians; total tok/s range over repeats in brackets)", "",
             "| method | batch | tok/s per user | tok/s total | ms / token | tau | speedup vs plain | "
             "acceptance by head | mismatches |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in report["results"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_by_head"]) if r.get("acceptance_by_head") else "-"
        spread = (f" [{_f(r.get('tokens_per_s_total_min'), 1)}-{_f(r.get('tokens_per_s_total_max'), 1)}]"
                  if "tokens_per_s_total_min" in r else "")
        lines.append(f"| {r['method']} | {r['batch_size']} | {_f(r['tokens_per_s_per_user'], 1)} | "
                     f"{_f(r['tokens_per_s_total'], 1)}{spread} | {_f(r.get('time_per_output_token_ms'), 1)} | "
                     f"{_f(r['mean_accepted'])} | {_f(r['speedup_vs_plain'])} | {acc} | "
                     f"{_mismatch(r)} |")
    cm = report.get("cost_model") or {}
    if cm.get("predicted_by_method"):
        lines += ["", "## Cost model", "", _fit_line(cm), "", *_method_table(report, cm)]
    elif cm.get("predicted"):
        lines += ["", "## Cost model", "", _fit_line(cm), "", *_kind_table(report, cm)]
    lines += kinds_markdown(report)
    return "\n".join(lines) + "\n"


def _kind_table(report: dict, cm: dict) -> list[str]:
    """Predictions by kind from the latency curve alone (a cost model without runs to anchor it)."""
    measured = _best_measured(report["results"])
    kinds = [k for k in SPECULATIVE if any(k in row for row in cm["predicted"].values())]
    lines = ["| batch | " + " | ".join(f"predicted {k} | measured {k}" for k in kinds)
             + " | analytic draft | best tree | best K | recommendation |",
             "|---:|" + "---:|---:|" * len(kinds) + "---:|---|---:|---|"]
    for b, row in cm["predicted"].items():
        cells = [f"{_f(row.get(k))} | {_f(measured.get((k, int(b))))}" for k in kinds]
        lines.append(f"| {b} | {' | '.join(cells)} | "
                     f"{_f((cm.get('analytic') or {}).get(b, {}).get('speedup'))} | "
                     f"{cm['best_tree'].get(b, '-')} | {cm['best_k'].get(b, '-')} | "
                     f"{cm['recommendation'][b]} |")
    mc = report.get("measured_crossover", {})
    lines += ["", "Crossover (smallest batch size where speculation stops paying): predicted "
              + ", ".join(f"{k} {_f(report['crossover'].get(k))}" for k in kinds) + "; measured "
              + ", ".join(f"{k} {_f(mc.get(k))}" for k in kinds) + " (`-`: pays at every size measured)."]
    return lines


def _method_table(report: dict, cm: dict) -> list[str]:
    """Each method's predicted and measured speedup per batch size, the fastest method, the crossovers."""
    by_method = cm["predicted_by_method"]
    names = list(dict.fromkeys(n for row in by_method.values() for n in row))
    measured = {(r["method"], str(r["batch_size"])): r["speedup_vs_plain"] for r in report["results"]}
    analytic = cm.get("analytic") or {}
    lines = ["Predicted / measured speedup over plain decoding at each batch size; the fastest method measured "
             "(predicted), weighing every method this engine ran, and the mode a server takes for it.", "",
             "| batch | " + " | ".join(names) + (" | analytic draft" if analytic else "")
             + " | fastest measured (predicted) | server mode |",
             "|---:|" + "---:|" * len(names) + ("---:|" if analytic else "") + "---|---|"]
    for b, row in by_method.items():
        cells = [f"{_f(row.get(n))} / {_f(measured.get((n, b)))}" for n in names]
        if analytic:
            cells.append(_f(analytic.get(b, {}).get("speedup")))
        fast = (cm.get("fastest") or {}).get(b, {})
        cells.append(f"{fast.get('measured', '-')} ({fast.get('predicted', '-')})")
        lines.append(f"| {b} | {' | '.join(cells)} | {cm['recommendation'].get(b, '-')} |")
    predicted, measured_at = cm.get("crossover_by_method") or {}, report.get("measured_crossover_by_method") or {}
    lines += ["", "Crossover (smallest batch size where the method stops paying; `-`: pays at every size "
              "measured), predicted / measured: " + "; ".join(f"{n} {_f(predicted.get(n))} / "
                                                           f"{_f(measured_at.get(n))}" for n in names) + ".",
              "", "Each prediction comes from the method's own run at the smallest batch size (its tau, tree "
              "size and host time) carried to the other sizes by the calibrated pass-latency curve and plain "
              "decoding's measured step (medusa.eval.step_model)."
              + (" The analytic column is S = E/(1 + K c), c the draft/target decode-step cost ratio: it "
                 "assumes a verification pass costs one decoding step, which holds while passes are bound by "
                 "reading weights." if analytic else "")]
    return lines


def _mismatch(r: dict) -> str:
    cell = _f(r["greedy_mismatches"])
    if r.get("first_divergence"):
        cell += " (first differing token: " + ", ".join(str(d) for d in r["first_divergence"]) + ")"
    return cell


def _fit_line(cm: dict) -> str:
    parts = []
    for name in ("target", "draft"):
        fit = (cm["latency_ms"].get(name) or {}).get("fit")
        if fit:
            parts.append(f"{name}: latency(B, T) = {fit['a_ms']:.2f} + {fit['b_ms_per_row']:.3f}·B + "
                         f"{fit['c_ms_per_token']:.4f}·B·T ms (max error {100 * fit['max_rel_error']:.0f}%)")
    return "; ".join(parts)


def _best_measured(results: list[dict]) -> dict:
    best: dict = {}
    for r in results:
        if r.get("kind") in SPECULATIVE:
            key = (r["kind"], r["batch_size"])
            best[key] = max(best.get(key, 0.0), r["speedup_vs_plain"])
    return best


def plots(report: dict, out: Path) -> list[Path]:
    """speedup.png, throughput.png, acceptance.png and (with a cost model) predicted_vs_measured.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    methods = list(dict.fromkeys(r["method"] for r in results))
    written = []

    def series(key):
        for m in methods:
            rows = sorted((r for r in results if r["method"] == m), key=lambda r: r["batch_size"])
            yield m, [r["batch_size"] for r in rows], [r[key] for r in rows]

    for key, name, ylabel in (("speedup_vs_plain", "speedup.png", "speedup over plain (same batch size)"),
                              ("tokens_per_s_total", "throughput.png", "aggregate tokens/s")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, xs, ys in series(key):
            ax.plot(xs, ys, marker="o", label=m)
        if key == "speedup_vs_plain":
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        _batch_axis(ax, ylabel)
        written.append(_save(fig, out / name))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for m, xs, ys in series("mean_accepted"):
        if any(y is not None for y in ys):
            ax1.plot(xs, ys, marker="o", label=m)
    _batch_axis(ax1, "tau (tokens per verification step)")
    first_bs = min(r["batch_size"] for r in results)
    for r in results:
        if r["batch_size"] == first_bs and r.get("acceptance_by_head"):
            ax2.plot(range(1, len(r["acceptance_by_head"]) + 1), r["acceptance_by_head"], marker="o",
                     label=r["method"])
    ax2.set_xlabel("candidate position (head)")
    ax2.set_ylabel(f"P(accepted | previous accepted), batch {first_bs}")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    written.append(_save(fig, out / "acceptance.png"))

    cm = report.get("cost_model") or {}
    if cm.get("predicted_by_method"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sizes = sorted(int(b) for b in cm["predicted_by_method"])
        names = list(dict.fromkeys(n for row in cm["predicted_by_method"].values() for n in row))
        speed = {(r["method"], r["batch_size"]): r["speedup_vs_plain"] for r in results}
        for i, name in enumerate(names):
            color = f"C{i % 10}"
            ax.plot(sizes, [cm["predicted_by_method"][str(b)].get(name) for b in sizes], ls="--", marker="x",
                    color=color, label=f"{name} predicted")
            ax.plot(sizes, [speed.get((name, b)) for b in sizes], marker="o", color=color, label=f"{name} measured")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        _batch_axis(ax, "speedup over plain")
        written.append(_save(fig, out / "predicted_vs_measured.png"))
    return written


def _batch_axis(ax, ylabel: str) -> None:
    """Batch size on a log2 x axis, a legend and a light grid: every per-batch-size plot."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return path
