"""`medusa eval`, `medusa crossover` and `medusa train-draft`.

The evaluator runs every configured method on the same prompts, with the same max tokens and dtype, in one
process: a warm-up first, then `repeats` rounds in which every (batch size, method) pair runs once, so
that slow drifts of the machine hit all methods alike. Medians over the rounds are reported with their
spread. Each of our own methods' outputs is checked token for token against plain decoding at the same
batch size (greedy speculation is lossless, so the count of mismatching outputs must be 0); the HF anchors
are checked against HF's plain `generate()`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from medusa.io import read_json, read_yaml
from medusa.errors import MedusaError
from medusa.runtime.args import int_list
from medusa.decoding.hardware import DTYPE_CHOICES, check_dtype_spelling
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.tree import DEFAULT_TREE

OURS = ("plain", "medusa", "draft", "lookup", "feature")
HF = ("hf", "hf_assisted", "hf_lookup")
BATCH_ONE_ONLY = ("hf_assisted", "hf_lookup")  # HF runs these for batch size 1 only


# ---- configuration ----------------------------------------------------------------------------------


class MethodSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["plain", "medusa", "draft", "lookup", "feature", "hf", "hf_assisted", "hf_lookup"]
    label: str | None = None
    tree: str | None = None           # medusa: tree file or shipped name
    draft: str | None = None          # draft / hf_assisted: see medusa.decoding.draft.load_draft
    k: int | None = Field(default=None, ge=1, le=64)  # draft chain length / lookup tokens
    max_ngram: int = Field(default=3, ge=1)
    heads: str | None = None          # feature: feature heads directory (default: the shipped ones)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.method == "feature":  # tree: dynamic-N[xD[xK]], or None for the planned size
            return f"feature:{self.tree or 'planned'}"
        if self.method == "medusa":
            return f"medusa:{Path(self.tree or DEFAULT_TREE).stem}"
        return self.method


class CostModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    tokens: list[int] = [1, 2, 4, 8, 16, 32, 64]
    prefix: int = Field(default=256, ge=1)
    repeats: int = Field(default=5, ge=1)


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = "default"
    heads: str = "default"
    dtype: str = "auto"               # auto (the machine's choice), bf16, fp16, fp32 (and their long names)
    device: str | None = None
    prompts: str = "mtbench"          # mtbench, sharegpt or a local .txt/.json/.jsonl file
    raw_prompts: bool = False         # tokenise prompts as raw text (no chat template)
    max_prompts: int = Field(default=16, ge=1)
    max_new_tokens: int = Field(default=128, ge=1)
    batch_sizes: list[int] = [1, 2, 4, 8, 16, 32, 64]
    repeats: int = Field(default=3, ge=1)
    warmup: bool = True
    threads: int | None = Field(default=None, ge=1)
    methods: list[MethodSpec] = [MethodSpec(method="plain"), MethodSpec(method="medusa", tree=DEFAULT_TREE),
                                 MethodSpec(method="draft", draft="default", k=4),
                                 MethodSpec(method="lookup", k=8),
                                 MethodSpec(method="hf"), MethodSpec(method="hf_assisted", draft="default", k=4),
                                 MethodSpec(method="hf_lookup", k=10)]
    hf_batch_sizes: list[int] = [1]   # HF plain generate() is slow on CPU: only these batch sizes
    hf_repeats: int | None = Field(default=None, ge=1)  # fewer rounds for the (slow) HF anchors
    # Sampled decoding (temperature > 0): every method samples; speculative methods accept by `acceptance`
    # (rejection: the target's distribution exactly; typical: more tokens, not lossless). Outputs then
    # differ run to run, so greedy_mismatches is not computed.
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    acceptance: Literal["rejection", "typical"] = "rejection"
    seed: int = 0
    cost_model: CostModelSpec = CostModelSpec()

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def sampling(self, request: int) -> SamplingParams | None:
        """Request `request`'s parameters (seeded per request: the same draws whatever its batch)."""
        if not self.sampled:
            return None
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, acceptance=self.acceptance,
                              seed=self.seed * 1_000_003 + request)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return check_dtype_spelling(v)

    @field_validator("batch_sizes", "hf_batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(b < 1 for b in v):
            raise ValueError("must be a non-empty list of positive integers")
        return sorted(set(v))


def load_config(path: str | None, overrides: dict | None = None) -> EvalConfig:
    data: dict = read_yaml(path) if path else {}
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        cfg = EvalConfig(**data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        raise MedusaError(f"eval config key {key!r}: {err['msg']}") from None
    names = [m.name for m in cfg.methods]
    if len(set(names)) != len(names):
        raise MedusaError(f"eval config key 'methods': duplicate method names {names}; set 'label'")
    if "plain" not in [m.method for m in cfg.methods]:
        cfg.methods.insert(0, MethodSpec(method="plain"))  # the reference every speedup is relative to
    return cfg


# ---- running ----------------------------------------------------------------------------------------


@dataclass
class RunResult:
    outputs: list[list[int]]
    seconds: float
    request_seconds: list[float]     # time until each request finished
    new_tokens: int
    accept_hist: list[int] = field(default_factory=list)
    row_steps: int = 0


def prompts_for_batch(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """The prompt list cycled up to a whole number of batches, so every batch runs full."""
    count = -(-len(prompts) // batch) * batch
    return [prompts[i % len(prompts)] for i in range(count)]


def run_engine(engine, prompts: list[list[int]], batch: int, max_new: int, proposer,
               sampling=None) -> RunResult:
    """Decode `prompts` in consecutive batches of `batch` rows with the step API, timing each request.
    `sampling(i)` gives request i's SamplingParams (None: greedy)."""
    outputs: dict[int, list[int]] = {}
    finish: dict[int, float] = {}
    hist: list[int] = []
    row_steps = 0
    total = 0.0
    extra = proposer.tree.size if proposer is not None else 1
    for start in range(0, len(prompts), batch):
        chunk = prompts[start: start + batch]
        capacity = max(len(p) for p in chunk) + max_new + extra + 1
        b = engine.new_batch(len(chunk), capacity, max_new)
        t0 = time.perf_counter()
        ids = list(range(start, start + len(chunk)))
        params = [sampling(i) for i in ids] if sampling is not None else None
        done = list(engine.add(b, ids, chunk, max_new, params).finished)
        for f in done:
            finish[f.id] = time.perf_counter() - t0
        while b.n:
            for f in engine.step(b, proposer).finished:
                done.append(f)
                finish[f.id] = time.perf_counter() - t0  # since its own batch started
        _sync(engine.model.device)
        elapsed = time.perf_counter() - t0
        for f in done:
            outputs[f.id] = f.tokens
        total += elapsed
        for a, c in enumerate(b.stats.accept_hist):
            hist += [0] * (a + 1 - len(hist))
            hist[a] += c
        row_steps += b.stats.row_steps
    order = range(len(prompts))
    return RunResult([outputs[i] for i in order], total, [finish[i] for i in order],
                     sum(len(outputs[i]) for i in order), hist, row_steps)


def run_hf(rt, prompts: list[list[int]], batch: int, max_new: int, spec: MethodSpec, draft_hf=None,
           sampling: SamplingParams | None = None) -> RunResult:
    """HF `generate()` (plain, assisted or prompt lookup), greedy or sampled; batches are left-padded."""
    eos = rt.engine.eos.tolist()
    pad = rt.tokenizer.pad_token_id if rt.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    kwargs: dict = {"do_sample": False, "max_new_tokens": max_new, "min_new_tokens": 0,
                    "eos_token_id": eos or None, "pad_token_id": pad}
    if sampling is not None:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        torch.manual_seed(sampling.seed or 0)
    if spec.method == "hf_assisted":
        draft_hf.generation_config.num_assistant_tokens = spec.k or 4
        draft_hf.generation_config.num_assistant_tokens_schedule = "constant"
        draft_hf.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft_hf
    elif spec.method == "hf_lookup":
        kwargs["prompt_lookup_num_tokens"] = spec.k or 10
    dev = rt.hf_model.device
    outputs, finish, total = [], [], 0.0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start: start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = rt.hf_model.generate(ids.to(dev), attention_mask=mask.to(dev), **kwargs)
        _sync(dev)
        elapsed = time.perf_counter() - t0
        total += elapsed
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            outputs.append(row[:cut])
            finish.append(elapsed)
    return RunResult(outputs, total, finish, sum(len(o) for o in outputs))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Methods:
    """Builds each configured method's proposer (or HF settings) once, lazily."""

    def __init__(self, rt, cfg: EvalConfig):
        self.rt, self.cfg = rt, cfg
        self._drafts: dict[str, object] = {}
        self._proposers: dict[str, object] = {}

    def draft_hf(self, spec: str):
        from medusa.decoding.draft import load_draft_hf

        if spec not in self._drafts:
            self._drafts[spec] = load_draft_hf(spec, self.rt.hf_model)
        return self._drafts[spec]

    def proposer(self, m: MethodSpec):
        if m.name in self._proposers:
            return self._proposers[m.name]
        if m.method == "plain":
            p = None
        elif m.method == "medusa":
            p = self.rt.proposer("medusa", m.tree)
        elif m.method == "feature":
            from medusa.runtime.feature import method_proposer

            p = method_proposer(self.rt, m.heads, m.tree)
        elif m.method == "draft":
            from medusa.decoding.draft import DraftProposer, load_draft

            p = DraftProposer(load_draft(m.draft or "default", self.rt.hf_model), m.k or 4)
        elif m.method == "lookup":
            from medusa.decoding.lookup import LookupProposer

            p = LookupProposer(k=m.k or 8, max_ngram=m.max_ngram)
        else:
            raise AssertionError(m.method)
        self._proposers[m.name] = p
        return p

    def run(self, m: MethodSpec, prompts: list[list[int]], batch: int, max_new: int) -> RunResult:
        if m.method in HF:
            draft = self.draft_hf(m.draft or "default") if m.method == "hf_assisted" else None
            return run_hf(self.rt, prompts, batch, max_new, m, draft, self.cfg.sampling(0))
        return run_engine(self.rt.engine, prompts, batch, max_new, self.proposer(m),
                          self.cfg.sampling if self.cfg.sampled else None)


def planned_runs(cfg: EvalConfig) -> list[tuple[int, MethodSpec]]:
    runs = []
    for b in cfg.batch_sizes:
        for m in cfg.methods:
            if m.method in BATCH_ONE_ONLY and b != 1:
                continue
            if m.method == "hf" and b not in cfg.hf_batch_sizes:
                continue
            runs.append((b, m))
    return runs


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
    if m.method in OURS:
        from medusa.decoding.engine import Stats

        stats = Stats(row_steps=first.row_steps, accept_hist=list(first.accept_hist))
        row["mean_accepted"] = stats.mean_accepted
        row["acceptance_by_head"] = stats.acceptance_by_head()
        if m.method == "draft":
            row["k"] = m.k or 4
        if m.method == "lookup":
            row["k"] = m.k or 8
        if m.method == "medusa":
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


def evaluate(cfg: EvalConfig, out_dir: Path, progress: bool = True) -> dict:
    """Run the whole evaluation and write report.json, report.md and the plots into `out_dir`."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _evaluate(cfg, out_dir, progress)
    finally:
        torch.set_num_threads(threads)


def finish_from_partial(cfg: EvalConfig, out_dir: Path, partial: Path, progress: bool = True) -> dict:
    """Write the report (cost model included) from the per-run summaries an interrupted evaluation left
    in partial.json: the runs it finished count, the rest are missing from the report."""
    from medusa.eval.report import write_report
    from medusa.runtime import Runtime

    if not partial.is_file():
        raise MedusaError(f"--from-partial: {partial} does not exist")
    results = [r for r in json.loads(partial.read_text()) if r.get("speedup_vs_plain")]
    if not results:
        raise MedusaError(f"--from-partial: {partial} holds no finished run with a plain reference")
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        needs_heads = any(r["kind"] == "medusa" for r in results)
        rt = Runtime.load(cfg.model, cfg.heads if needs_heads else "none", cfg.dtype, cfg.device)
        cfg = cfg.model_copy(update={"batch_sizes": sorted({r["batch_size"] for r in results})})
        cost = build_cost_model(rt, cfg, Methods(rt, cfg), results, progress) if cfg.cost_model.enabled else {}
        report = _report(rt, cfg, len(load_prompts_count(cfg)), results, cost)
        report["interrupted"] = True
        write_report(report, out_dir)
        return report
    finally:
        torch.set_num_threads(threads)


def load_prompts_count(cfg: EvalConfig) -> list[str]:
    from medusa.prompts import load_prompts

    return load_prompts(cfg.prompts, cfg.max_prompts)


def _report(rt, cfg: EvalConfig, num_prompts: int, results: list[dict], cost: dict) -> dict:
    return {"model": getattr(rt.hf_model, "name_or_path", cfg.model), "device": str(rt.model.device),
            "dtype": rt.dtype.name, "machine": rt.machine.to_dict(), "threads": torch.get_num_threads(),
            "prompts": cfg.prompts,
            "num_prompts": num_prompts, "max_new_tokens": cfg.max_new_tokens,
            "batch_sizes": cfg.batch_sizes, "repeats": cfg.repeats,
            "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "acceptance": cfg.acceptance}
            if cfg.sampled else None,
            "config": cfg.model_dump(), "results": results, "cost_model": cost,
            "crossover": cost.get("crossover", {"medusa": None, "draft": None}),
            "measured_crossover": measured_crossover(results)}


def _evaluate(cfg: EvalConfig, out_dir: Path, progress: bool) -> dict:
    from tqdm import tqdm

    from medusa.prompts import load_prompts
    from medusa.eval.report import write_report
    from medusa.runtime import Runtime

    needs_heads = any(m.method == "medusa" for m in cfg.methods)
    rt = Runtime.load(cfg.model, cfg.heads if needs_heads else "none", cfg.dtype, cfg.device)
    texts = load_prompts(cfg.prompts, cfg.max_prompts)
    if not texts:
        raise MedusaError(f"eval config key 'prompts': {cfg.prompts} gave no prompts")
    prompts = rt.encode(texts, raw=cfg.raw_prompts)
    methods = Methods(rt, cfg)
    runs = planned_runs(cfg)
    for m in cfg.methods:  # build everything up front: configuration errors surface before any timing
        if m.method in OURS:
            methods.proposer(m)
        elif m.method == "hf_assisted":
            methods.draft_hf(m.draft or "default")
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
    results = _results(runs, raw, cfg.sampled)
    cost = build_cost_model(rt, cfg, methods, results, progress) if cfg.cost_model.enabled else {}
    report = _report(rt, cfg, len(prompts), results, cost)
    write_report(report, out_dir)
    return report


def _results(runs: list[tuple[int, MethodSpec]], raw: dict, sampled: bool = False) -> list[dict]:
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


def _write_partial(out_dir: Path, runs, raw, sampled: bool) -> None:
    from medusa.io import write_text_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "partial.json", json.dumps(_results(runs, raw, sampled), indent=2) + "\n")


def measured_crossover(results: list[dict]) -> dict:
    """Per speculative method: the smallest batch size whose measured speedup is no longer above 1."""
    from medusa.eval.costmodel import crossover

    out: dict = {}
    for kind in ("medusa", "draft", "lookup"):
        names = {r["method"] for r in results if r["kind"] == kind}
        if not names:
            continue
        best = {}
        for r in results:
            if r["kind"] == kind:
                best[r["batch_size"]] = max(best.get(r["batch_size"], 0.0), r["speedup_vs_plain"])
        out[kind] = crossover(best)
    return out


def build_cost_model(rt, cfg: EvalConfig, methods: Methods, results: list[dict], progress: bool) -> dict:
    """Latency grids for target, draft and heads, fitted; acceptance from the runs; predictions."""
    from tqdm import tqdm

    from medusa.runtime.calibrate import load_or_measure
    from medusa.eval.costmodel import Latency, alpha_from_acceptance, predict
    from medusa.runtime.timing import measure_forward, measure_heads
    from medusa.decoding.tree import load_tree

    cm = cfg.cost_model
    bs1 = min(cfg.batch_sizes)
    acc: dict = {"medusa": {}, "draft": None}
    for r in results:
        if r["batch_size"] != bs1 or r["mean_accepted"] is None:
            continue
        if r["kind"] == "medusa":
            tree = load_tree(r["tree"], heads_dir=rt.heads.directory if rt.heads is not None else None)
            acc["medusa"][tree.name] = {"tau": r["mean_accepted"], "tree_size": tree.size, "method": r["method"],
                                        "spec": r["tree"]}
        elif r["kind"] == "draft" and acc["draft"] is None:
            acc["draft"] = {"k": r["k"], "tau": r["mean_accepted"], "method": r["method"],
                            "alpha": alpha_from_acceptance(r["acceptance_by_head"])}
    tokens = sorted(set(cm.tokens) | {s["tree_size"] for s in acc["medusa"].values()}
                    | ({acc["draft"]["k"] + 1} if acc["draft"] else set()))
    draft_spec = next((m for m in cfg.methods if m.method == "draft"), None)
    n_grid = len(cfg.batch_sizes) * (len(tokens) + (2 if draft_spec else 0))
    bar = tqdm(total=n_grid, desc="cost model", unit="pass", disable=not progress)
    # The target's curve is the machine's calibration file (the one --mode auto and the server read),
    # extended by any (B, T) point this evaluation needs that it lacks.
    cal = load_or_measure(rt, cfg.batch_sizes, tokens=tokens, progress=progress)
    bar.update(len(cfg.batch_sizes) * len(tokens))
    lat: dict = {"target": Latency([(b, t, cal.grid[(b, t)]) for b in cfg.batch_sizes for t in tokens]).to_dict()}
    if draft_spec is not None:
        draft = methods.proposer(draft_spec).draft
        lat["draft"] = Latency(measure_forward(draft, cfg.batch_sizes, [1, 2, 4], cm.prefix, cm.repeats,
                                               bar)).to_dict()
    if rt.heads is not None and acc["medusa"]:
        topk = max(load_tree(s["spec"]).topk for s in acc["medusa"].values())
        lat["heads"] = {str(b): ms for b, ms in measure_heads(rt.heads, rt.model.config.hidden_size,
                                                               cfg.batch_sizes, topk, rt.model.dtype,
                                                               rt.model.device, cm.repeats,
                                                               rt.model.lm_head).items()}
    bar.close()
    model = {"model": getattr(rt.hf_model, "name_or_path", cfg.model), "device": str(rt.model.device),
             "dtype": rt.dtype.name, "prefix_tokens": cm.prefix, "latency_ms": lat,
             "calibration": str(cal.path),
             "acceptance": {k: v for k, v in acc.items() if v}}
    return apply_measurements(predict(model, cfg.batch_sizes), results)


def apply_measurements(model: dict, results: list[dict]) -> dict:
    """Where the runs measured a batch size, the measured speedups decide its recommendation; the latency
    model's predictions fill in the rest. A prediction is a fit of a noisy latency grid (its error is in
    `fit.max_rel_error`); an end-to-end run at that batch size is the better witness. The predictions stay
    in `predicted` / `predicted_recommendation`, and `recommendation_source` says which one decided."""
    from medusa.eval.costmodel import pays

    best: dict[str, tuple[float, str, str | None]] = {}
    for r in results:
        if r["kind"] in ("medusa", "draft") and r.get("speedup_vs_plain") is not None:
            b = str(r["batch_size"])
            if r["speedup_vs_plain"] > best.get(b, (0.0,))[0]:
                best[b] = (r["speedup_vs_plain"], r["kind"], r.get("tree"))
    model["predicted_recommendation"] = dict(model["recommendation"])
    source = {b: "predicted" for b in model["recommendation"]}
    for b, (speedup, kind, tree) in best.items():
        model["recommendation"][b] = kind if pays(speedup) else "plain"
        source[b] = "measured"
        if kind == "medusa" and tree:
            model["best_tree"][b] = tree
    model["recommendation_source"] = source
    return model


# ---- command line -----------------------------------------------------------------------------------


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_parser(subparsers) -> None:
    e = subparsers.add_parser("eval", help="compare plain, Medusa, draft-model, lookup and HF decoding")
    e.add_argument("--config", default=None, help="evaluation YAML, e.g. configs/eval/mtbench.yaml")
    e.add_argument("--out", required=True, help="output directory (report.json, report.md, plots)")
    e.add_argument("--max-prompts", type=int, default=None)
    e.add_argument("--batch-sizes", type=int_list, default=None, help="e.g. 1,4,16")
    e.add_argument("--max-new-tokens", type=int, default=None)
    e.add_argument("--repeats", type=int, default=None)
    e.add_argument("--model", default=None)
    e.add_argument("--heads", default=None)
    e.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, metavar="{auto,bf16,fp16,fp32}")
    e.add_argument("--device", default=None)
    e.add_argument("--temperature", type=float, default=None, help="sample at this temperature (0: greedy)")
    e.add_argument("--acceptance", default=None, choices=["rejection", "typical"],
                   help="how sampled speculation accepts candidates")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--from-partial", default=None, metavar="PARTIAL_JSON",
                   help="finish an interrupted evaluation: report (and cost model) from its partial.json")
    e.set_defaults(func=cmd_eval)

    c = subparsers.add_parser("crossover", help="recommended decoding regime per batch size")
    c.add_argument("--cost-model", default=None, help="cost-model JSON written by `medusa eval`")
    c.add_argument("--target-ms", type=_float_list, default=None,
                   help="target decode-step latency (ms), one value or one per --batch-sizes entry")
    c.add_argument("--draft-ms", type=_float_list, default=None, help="draft decode-step latency (ms), same")
    c.add_argument("--verify-ms", type=_float_list, default=None,
                   help="target latency of a K+1-token pass (default: --target-ms, the textbook assumption)")
    c.add_argument("--alpha", type=float, default=None, help="per-token acceptance rate of the draft")
    c.add_argument("--k", type=int_list, default=None, help="draft length(s); several: pick the best")
    c.add_argument("--batch-sizes", type=int_list, default=None)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_crossover)

    t = subparsers.add_parser("train-draft", help="build a small draft model from the target's first layers")
    t.add_argument("--model", default="default")
    t.add_argument("--layers", type=int, default=4, help="how many of the target's first layers to keep")
    t.add_argument("--data", default=None, help="distilled dataset directory (`medusa distill`); default: "
                   "the training config's, else distil --distill-prompts prompts here")
    t.add_argument("--distill-prompts", type=int, default=128)
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--vocab", type=int, default=8192, help="score only this many token ids (the data's most "
                   "frequent; 0: the whole vocabulary): a full-vocabulary projection dominates a small draft")
    t.add_argument("--out", default=None, help="output directory (default: medusa/assets/draft)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train_draft)


def cmd_eval(args: argparse.Namespace) -> int:
    overrides = {"max_prompts": args.max_prompts, "batch_sizes": args.batch_sizes,
                 "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "model": args.model,
                 "heads": args.heads, "dtype": args.dtype, "device": args.device,
                 "temperature": args.temperature, "acceptance": args.acceptance}
    cfg = load_config(args.config, overrides)
    if args.from_partial:
        report = finish_from_partial(cfg, Path(args.out), Path(args.from_partial), progress=not args.no_progress)
    else:
        report = evaluate(cfg, Path(args.out), progress=not args.no_progress)
    print(f"wrote {Path(args.out) / 'report.json'} and report.md ({len(report['results'])} runs)")
    bad = [r for r in report["results"] if r["greedy_mismatches"]]
    for r in bad:
        print(f"warning: {r['method']} bs={r['batch_size']}: {r['greedy_mismatches']} outputs differ from plain")
    return 0


def cmd_crossover(args: argparse.Namespace) -> int:
    from medusa.eval.costmodel import analytic_speedup, expected_accepted, pays

    if args.cost_model:
        from medusa.eval.costmodel import predict

        path = Path(args.cost_model)
        data = read_json(path, "--cost-model")
        data = data.get("cost_model", data)  # a whole report.json works too
        if "latency_ms" not in data:
            raise MedusaError(f"--cost-model: {path} has no 'latency_ms' (write it with `medusa eval`)")
        sizes = args.batch_sizes or sorted(int(b) for b in data.get("predicted", {})) or [1, 2, 4, 8, 16, 32, 64]
        model = predict(data, sizes)
        rows = [{"batch_size": b, "medusa": model["predicted"][str(b)].get("medusa"),
                 "draft": model["predicted"][str(b)].get("draft"),
                 "best_tree": model["best_tree"].get(str(b)), "best_k": model["best_k"].get(str(b)),
                 "regime": model["recommendation"][str(b)]} for b in sizes]
        return _print_crossover(rows, model["crossover"], args.json)
    missing = [f for f, v in (("--target-ms", args.target_ms), ("--draft-ms", args.draft_ms),
                              ("--alpha", args.alpha), ("--k", args.k)) if v is None]
    if missing:
        raise MedusaError(f"give --cost-model FILE, or all of --target-ms, --draft-ms, --alpha, --k "
                          f"(missing {', '.join(missing)})")
    sizes = args.batch_sizes or ([1] if len(args.target_ms) == 1 else list(range(1, len(args.target_ms) + 1)))
    target = _per_batch(args.target_ms, sizes, "--target-ms")
    draft = _per_batch(args.draft_ms, sizes, "--draft-ms")
    verify = _per_batch(args.verify_ms, sizes, "--verify-ms") if args.verify_ms else target
    if any(v <= 0 for v in target + verify) or any(v < 0 for v in draft):
        raise MedusaError("--target-ms / --verify-ms must be positive and --draft-ms non-negative")
    rows = []
    for b, t, d, v in zip(sizes, target, draft, verify):
        # Generalised: S = E * t / (v + K d); with v = t it is exactly E / (1 + K c).
        by_k = {k: (analytic_speedup(args.alpha, k, d / t) if v == t
                    else expected_accepted(args.alpha, k) * t / (v + k * d)) for k in args.k}
        k = max(by_k, key=lambda kk: (by_k[kk], -kk))
        rows.append({"batch_size": b, "draft": by_k[k], "best_k": k, "c": d / t,
                     "regime": "draft" if pays(by_k[k]) else "plain"})
    cross = next((r["batch_size"] for r in rows if r["regime"] == "plain"), None)
    return _print_crossover(rows, {"draft": cross}, args.json)


def _per_batch(values: list[float], sizes: list[int], flag: str) -> list[float]:
    if len(values) == 1:
        return values * len(sizes)
    if len(values) != len(sizes):
        raise MedusaError(f"{flag}: {len(values)} values for {len(sizes)} batch sizes")
    return values


def _print_crossover(rows: list[dict], cross: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"rows": rows, "crossover": cross}))
        return 0
    print(f"{'batch':>6} {'medusa S':>9} {'draft S':>8} {'best K':>6} {'best tree':>10}  regime")
    for r in rows:
        fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else "-"  # noqa: E731
        print(f"{r['batch_size']:>6} {fmt(r.get('medusa')):>9} {fmt(r.get('draft')):>8} "
              f"{str(r.get('best_k') or '-'):>6} {str(r.get('best_tree') or '-'):>10}  {r['regime']}")
    for name, b in cross.items():
        print(f"{name} stops paying at batch size {b}" if b else f"{name} pays at every batch size listed")
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    from medusa.train.draft import train_draft

    out = train_draft(model=args.model, layers=args.layers, data=args.data, distill_prompts=args.distill_prompts,
                      steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      out=args.out, progress=not args.no_progress, vocab=args.vocab)
    print(f"draft model: {out}")
    return 0
