"""Summaries of the runs: per (method, batch size) the medians over repeats with their spread, acceptance,
the speedup over plain decoding and the equality check against the reference; and the measured crossover."""

from __future__ import annotations

import statistics

from medusa.decoding.trees.tree import DEFAULT_TREE
from medusa.eval.config import BATCH_ONE_ONLY, HF, OURS, MethodSpec
from medusa.eval.costmodel import crossover
from medusa.eval.driver import RunResult


def summarize(m: MethodSpec, batch: int, results: list[RunResult], reference: list[list[int]] | None) -> dict:
    """Medians over repeats (with min/max), acceptance and the equality check of one (method, batch)."""
    total = [r.new_tokens / r.seconds for r in results]
    per_user = [statistics.mean(len(o) / max(s, 1e-9) for o, s in zip(r.outputs, r.request_seconds))
                for r in results]
    tpot = [1000 * statistics.median(s / max(len(o), 1) for o, s in zip(r.outputs, r.request_seconds))
            for r in results]
    first = results[0]
    row: dict = {"method": m.name, "kind": m.method, "batch_size": batch,
                 "tokens_per_s_per_user": statistics.median(per_user),
                 "tokens_per_s_total": statistics.median(total),
                 "tokens_per_s_total_min": min(total), "tokens_per_s_total_max": max(total),
                 "time_per_output_token_ms": statistics.median(tpot),
                 "seconds": statistics.median(r.seconds for r in results),
                 "new_tokens": first.new_tokens, "repeats": len(results),
                 "mean_accepted": None, "acceptance_by_head": None}
    if m.method not in HF:  # what the cost model reads: steps, tokens per pass, prefill work
        row.update(steps=statistics.median(r.steps for r in results), tokens_per_pass=first.stats.tokens_per_pass,
                   batches=first.batches, prompt_tokens=first.prompt_tokens)
    if m.method in OURS or m.method == "auto":
        row["mean_accepted"] = first.stats.mean_accepted
        row["acceptance_by_head"] = first.stats.acceptance_by_head()
        if m.method == "auto" and first.realised is not None:
            row["realised"] = statistics.median(r.realised for r in results if r.realised is not None)
        if m.method == "draft":
            row["k"] = m.k or 4
        if m.method == "lookup":
            row["k"] = m.k or 8
        if m.method == "heads":
            row["tree"] = m.tree or DEFAULT_TREE
    row["greedy_mismatches"] = None
    if reference is not None:
        mismatches = [sum(a != b for a, b in zip(r.outputs, reference)) for r in results]
        row["greedy_mismatches"] = max(mismatches)
        # Where outputs part: a late first difference points at a near-tie argmax flipped by rounding
        # (reduced-precision passes of different shapes round differently), not at a lost token.
        row["first_divergence"] = sorted(_first_difference(a, b) for a, b in zip(first.outputs, reference)
                                         if a != b)
    return row


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summaries(runs: list[tuple[int, MethodSpec]], raw: dict[tuple[int, str], list[RunResult]],
              sampled: bool = False) -> list[dict]:
    """Summaries of every (batch size, method) that has runs, with speedups over plain."""
    results = []
    for b, m in runs:
        if (b, m.name) not in raw:
            continue
        ref_name = "hf" if m.method in BATCH_ONE_ONLY else "plain"
        ref_key = (b, ref_name)
        if m.method in HF and ref_key not in raw:
            ref_key = (b, "plain")  # no HF plain run at this size: compare with ours
        reference = raw[ref_key][0].outputs if m.name != ref_name and ref_key in raw and not sampled else None
        results.append(summarize(m, b, raw[(b, m.name)], reference if m.name != "plain" else None))
    plain = {r["batch_size"]: r["tokens_per_s_total"] for r in results if r["method"] == "plain"}
    for r in results:
        r["speedup_vs_plain"] = r["tokens_per_s_total"] / plain[r["batch_size"]] if r["batch_size"] in plain else None
        if r["method"] == "plain" and not sampled:
            r["greedy_mismatches"] = 0
    return results


def measured_crossover_by_method(results: list[dict]) -> dict:
    """Per method of ours other than plain: the smallest batch size whose measured speedup is not above 1."""
    speedups: dict[str, dict[int, float]] = {}
    for r in results:
        if r["kind"] not in HF and r["kind"] != "plain" and r.get("speedup_vs_plain") is not None:
            speedups.setdefault(r["method"], {})[r["batch_size"]] = r["speedup_vs_plain"]
    return {name: crossover(s) for name, s in speedups.items()}


def measured_crossover(results: list[dict]) -> dict:
    """Per speculative method: the smallest batch size whose measured speedup is no longer above 1."""
    out: dict = {}
    for kind in dict.fromkeys(r["kind"] for r in results if r["kind"] not in HF and r["kind"] != "plain"):
        best: dict[int, float] = {}
        for r in results:
            if r["kind"] == kind:
                best[r["batch_size"]] = max(best.get(r["batch_size"], 0.0), r["speedup_vs_plain"])
        if best:
            out[kind] = crossover(best)
    return out
