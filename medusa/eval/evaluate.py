"""The evaluator: every configured method on the same prompts, with the same max tokens and dtype, in one
process.

A warm-up first, then `repeats` rounds in which every (batch size, method) pair runs once, so that slow
drifts of the machine hit all methods alike. Medians over the rounds are reported with their spread. Each
of our own methods' outputs is checked token for token against plain decoding at the same batch size
(greedy speculation is lossless, so the count of mismatching outputs must be 0); the HF anchors are
checked against HF's plain `generate()`.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch

from medusa.decoding.target.hardware import provenance
from medusa.errors import MedusaError
from medusa.eval.config import HF, OURS, EvalConfig, MethodSpec
from medusa.eval.cost_inputs import build_cost_model
from medusa.eval.driver import RunResult, prompts_for_batch
from medusa.eval.kinds import add_tau_by_kind, eval_prompts
from medusa.eval.methods import Methods, planned_runs
from medusa.eval.report import write_report
from medusa.eval.summary import measured_crossover, measured_crossover_by_method, summaries
from medusa.io import read_json, write_text_atomic
from medusa.runtime import Runtime


def evaluate(cfg: EvalConfig, out_dir: Path, progress: bool = True) -> dict:
    """Run the whole evaluation and write report.json, report.md and the plots into `out_dir`."""
    with torch_threads(cfg.threads):
        return _evaluate(cfg, out_dir, progress)


def finish_from_partial(cfg: EvalConfig, out_dir: Path, partial: Path, progress: bool = True) -> dict:
    """Write the report (cost model included) from the per-run summaries an interrupted evaluation left
    in partial.json: the runs it finished count, the rest are missing from the report."""
    results = [r for r in read_json(partial, "--from-partial") if r.get("speedup_vs_plain")]
    if not results:
        raise MedusaError(f"--from-partial: {partial} holds no finished run with a plain reference")
    with torch_threads(cfg.threads):
        rt = _runtime(cfg, any(r["kind"] == "heads" for r in results))
        cfg = cfg.model_copy(update={"batch_sizes": sorted({r["batch_size"] for r in results})})
        cost = build_cost_model(rt, cfg, Methods(rt, cfg), results, progress) if cfg.cost_model.enabled else {}
        report = _report(rt, cfg, len(eval_texts(cfg)), results, cost)
        report["interrupted"] = True
        write_report(report, out_dir)
        return report


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to `threads` (when given) inside the block, restored after it."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _runtime(cfg: EvalConfig, needs_heads: bool) -> Runtime:
    return Runtime.load(cfg.model, cfg.heads if needs_heads else "none", cfg.dtype, cfg.device,
                        datastore=cfg.datastore, batch_invariant=cfg.batch_invariant)


def eval_texts(cfg: EvalConfig) -> list[str]:
    """The prompts: up to `max_prompts` from each source, in the order the sources are listed."""
    return [p for p, _ in eval_prompts(cfg.sources, cfg.max_prompts)]


def _report(rt: Runtime, cfg: EvalConfig, num_prompts: int, results: list[dict], cost: dict) -> dict:
    return {"model": getattr(rt.hf_model, "name_or_path", cfg.model), "device": str(rt.model.device),
            "dtype": rt.dtype.name, **provenance(rt.dtype.name, machine_=rt.machine),
            "threads": torch.get_num_threads(),
            "prompts": cfg.prompts,
            "num_prompts": num_prompts, "max_new_tokens": cfg.max_new_tokens,
            "batch_sizes": cfg.batch_sizes, "repeats": cfg.repeats,
            "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "acceptance": cfg.acceptance}
            if cfg.sampled else None,
            "config": cfg.model_dump(), "results": results, "cost_model": cost,
            "crossover": cost.get("crossover", {"heads": None, "draft": None}),
            "measured_crossover": measured_crossover(results),
            "measured_crossover_by_method": measured_crossover_by_method(results)}


def _evaluate(cfg: EvalConfig, out_dir: Path, progress: bool) -> dict:
    from tqdm import tqdm

    rt = _runtime(cfg, any(m.method in ("heads", "heads+retrieval", "auto") for m in cfg.methods))
    labelled = eval_prompts(cfg.sources, cfg.max_prompts)
    prompts = rt.encode([p for p, _ in labelled], raw=cfg.raw_prompts)
    kinds = [k for _, k in labelled]
    methods = Methods(rt, cfg)
    runs = planned_runs(cfg)
    for m in cfg.methods:  # build everything up front: configuration errors surface before any timing
        if m.method in OURS:
            methods.proposer(m)
        elif m.method == "hf_assisted":
            methods.draft_hf(m.draft or "default")
        elif m.method == "auto":
            rt.auto(max(cfg.batch_sizes))  # this machine's curve, measured once, before anything is timed
    if cfg.warmup:
        for m in cfg.methods:
            methods.run(m, prompts[:1], 1, min(16, cfg.max_new_tokens))
    raw: dict[tuple[int, str], list[RunResult]] = {}
    hf_rounds = min(cfg.hf_repeats or cfg.repeats, cfg.repeats)
    total = sum(hf_rounds if m.method in HF else cfg.repeats for _, m in runs)
    bar = tqdm(total=total, desc="eval", unit="run", disable=not progress)
    for round_ in range(cfg.repeats):
        for b, m in runs:
            if m.method in HF and round_ >= hf_rounds:
                continue
            bar.set_postfix_str(f"{m.name} bs={b}")
            raw.setdefault((b, m.name), []).append(methods.run(m, prompts_for_batch(prompts, b), b,
                                                               cfg.max_new_tokens))
            bar.update(1)
            _write_partial(out_dir, runs, raw, cfg.sampled)  # a long run that dies late still leaves its measurements
    bar.close()
    results = summaries(runs, raw, cfg.sampled)
    add_tau_by_kind(results, raw, kinds)
    cost = build_cost_model(rt, cfg, methods, results, progress) if cfg.cost_model.enabled else {}
    report = _report(rt, cfg, len(prompts), results, cost)
    report["kinds"] = dict(Counter(kinds))
    write_report(report, out_dir)
    return report


def _write_partial(out_dir: Path, runs: list[tuple[int, MethodSpec]], raw: dict, sampled: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "partial.json", json.dumps(summaries(runs, raw, sampled), indent=2) + "\n")
