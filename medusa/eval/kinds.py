"""Acceptance by task kind: each request's verification steps and the tokens they produced are counted as it
decodes, so tau (tokens per row per verification step) is reported for each kind of prompt (the held-out
set's kinds, MT-bench's categories, a file's `kind` field, else the source's name), alongside the overall
figure, from the same timed runs."""

from __future__ import annotations

from collections import Counter
from typing import Callable

from medusa.decoding.engine import Engine, StepPolicy
from medusa.decoding.outputs import Finished, Generation, StepOutput
from medusa.decoding.proposers import Proposer
from medusa.decoding.sampling import SamplingParams
from medusa.errors import MedusaError
from medusa.prompts import load_kinded_prompts


def eval_prompts(sources: list[str], limit: int) -> list[tuple[str, str]]:
    """(prompt, kind): up to `limit` prompts from each source, in the order the sources are listed."""
    out = []
    for source in sources:
        got = load_kinded_prompts(source, limit)
        if not got:
            raise MedusaError(f"eval config: prompts: {source} gave no prompts")
        out += got
    return out


def generate_tracked(engine: Engine, prompts: list[list[int]], max_new: int, proposer: Proposer | None,
                     sampling: list[SamplingParams] | None, policy: StepPolicy | None,
                     on_finish: Callable[[Finished], None]) -> tuple[Generation, list[int], list[int]]:
    """`Engine.generate`, also returning each request's verification steps and the tokens those steps
    produced (accepted candidates + 1, before EOS cuts)."""
    steps, made = [0] * len(prompts), [0] * len(prompts)

    def count(out: StepOutput) -> None:
        for i, a in zip(out.ids, out.accepted_list):
            steps[i] += 1
            made[i] += a + 1

    gen = engine.generate(prompts, max_new, proposer, sampling, policy, on_finish=on_finish, on_step=count)
    return gen, steps, made


def tau_by_kind(request_steps: list[int], request_made: list[int], kinds: list[str]) -> dict[str, float] | None:
    """tau per kind over the requests of a run (request i is prompt i mod len(kinds), as the runs cycle the
    prompt list); None without per-request counts."""
    if not request_steps or not kinds:
        return None
    steps: Counter = Counter()
    made: Counter = Counter()
    for i, (s, m) in enumerate(zip(request_steps, request_made)):
        steps[kinds[i % len(kinds)]] += s
        made[kinds[i % len(kinds)]] += m
    return {k: round(made[k] / steps[k], 4) for k in dict.fromkeys(kinds) if steps[k]}


def add_tau_by_kind(results: list[dict], raw: dict, kinds: list[str]) -> None:
    """Each result of ours gets `tau_by_kind` from its first run (None for the HF anchors)."""
    for r in results:
        runs = raw.get((r["batch_size"], r["method"]))
        first = runs[0] if runs else None
        r["tau_by_kind"] = tau_by_kind(first.request_steps, first.request_made, kinds) \
            if first is not None and r.get("mean_accepted") is not None else None


def kinds_markdown(report: dict) -> list[str]:
    """The report's table of tau by kind (nothing when no run has one)."""
    rows = [r for r in report["results"] if r.get("tau_by_kind")]
    if not rows:
        return []
    kinds = list(dict.fromkeys(k for r in rows for k in r["tau_by_kind"]))
    counts = report.get("kinds") or {}
    head = [f"{k} ({counts[k]})" if k in counts else k for k in kinds]
    lines = ["", "## Tau by kind of prompt", "", "| method | batch | " + " | ".join(head) + " |",
             "|---|---:|" + "---:|" * len(kinds)]
    for r in rows:
        cells = [f"{r['tau_by_kind'][k]:.2f}" if k in r["tau_by_kind"] else "-" for k in kinds]
        lines.append(f"| {r['method']} | {r['batch_size']} | " + " | ".join(cells) + " |")
    return lines
