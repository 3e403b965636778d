"""The soak's verdict: greedy mismatches judged offline (near-tie or defect) and the JSON / text report.

Every greedy answer that differs from its solo answer is judged after the server has stopped: one plain
forward of the same model over prompt + the common prefix of the two answers gives the logits at the first
divergence; both diverging tokens within NEAR_TIE of the largest logit make a near-tie, anything else is a
defect. The batch-shape rounding itself is measured alongside, to show how far below the bound it is.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import asdict

from soak_requests import Tally

# A divergence is a near-tie when both tokens' logits are within this fraction of max|logit| of the top
# logit. fp32 rounding differences between batch shapes are ~1e-6 absolute on logits of magnitude ~10-30,
# i.e. ~1e-7 relative (measured in every run, `rounding`); a wrong token from a real defect (a wrong
# position, a stale cache row, another row's state) differs by whole logits. 1e-4 sits 2-3 orders of
# magnitude above the first and 3-4 below the second.
NEAR_TIE = 1e-4


# ---- greedy mismatches, judged offline -------------------------------------------------------------------

def judge_mismatches(args: argparse.Namespace, mismatches: list[dict], solo: dict) -> dict:
    """Classify each greedy mismatch as a near-tie or a defect with one plain forward of the same model over
    prompt + the common prefix of the two answers, and measure the batch-shape rounding itself."""
    import torch

    from medusa.decoding.target.hardware import resolve_dtype
    from medusa.decoding.target.model import load_target

    dtype = resolve_dtype(args.dtype, torch.device("cpu")).torch
    model, _ = load_target(args.model, dtype, torch.device("cpu"))
    model.eval()

    def last_logits(ids: list[list[int]]) -> list[torch.Tensor]:
        """Each sequence's next-token logits; several sequences go right-padded through one pass."""
        width = max(len(x) for x in ids)
        tokens = torch.tensor([x + [0] * (width - len(x)) for x in ids])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        with torch.inference_mode():
            logits = model(input_ids=tokens, attention_mask=mask).logits.float()
        return [logits[i, len(x) - 1] for i, x in enumerate(ids)]

    judged = []
    for m in mismatches:
        a, b = m["solo"], m["got"]
        c = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        entry = {"request": m["request"], "diverge_at": c, "solo_text": m["solo_text"], "got_text": m["got_text"]}
        if c >= min(len(a), len(b)):  # one answer is a prefix of the other without an end token: no tie
            judged.append({**entry, "near_tie": False, "why": "one answer stops early without a token choice"})
            continue
        logits = last_logits([m["prompt_ids"] + a[:c]])[0]
        top = logits.topk(2)
        scale = float(logits.abs().max())
        behind = [float(top.values[0] - logits[t]) for t in (a[c], b[c])]
        near = max(behind) <= NEAR_TIE * scale
        judged.append({**entry, "solo_token": a[c], "got_token": b[c], "top2_gap": float(top.values[0] - top.values[1]),
                       "behind_top": behind, "max_abs_logit": scale, "bound": NEAR_TIE * scale, "near_tie": near})
    # The rounding the bound has to cover: the same prompts' next-token logits alone and in one batch.
    prompts = [v.prompt_ids for v in solo.values()]
    alone = [last_logits([p])[0] for p in prompts]
    together = last_logits(prompts)
    rel = max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(alone, together))
    absolute = max(float((x - y).abs().max()) for x, y in zip(alone, together))
    return {"judged": judged, "near_tie_bound": f"{NEAR_TIE:g} x max|logit|",
            "rounding": {"what": f"max |logit alone - logit in a batch of {len(prompts)}|, fp forward of the "
                                 "same model", "absolute": absolute, "relative_to_max_logit": rel}}


def cpu_info() -> dict:
    from medusa.decoding.target.hardware import cpu_flags, cpu_name

    return {"model": cpu_name(), "avx512_bf16": "avx512_bf16" in cpu_flags(), "cores": os.cpu_count()}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def build_report(args: argparse.Namespace, t: Tally, warm: Tally, elapsed: float, health: dict,
                 rss_before: float, rss_after: float, metrics: dict, log_tail: str, greedy: dict) -> dict:
    from medusa.decoding.target.hardware import provenance

    growth = (rss_after - rss_before) / rss_before
    near_ties = sum(j["near_tie"] for j in greedy["judged"])
    verdict = {"lost": t.lost + warm.lost, "server_errors": t.server_errors + warm.server_errors,
               "greedy_mismatch": len(greedy["judged"]) - near_ties, "greedy_near_ties": near_ties,
               "bad_not_4xx": t.bad_sent - t.bad_4xx, "oversized_not_413": t.oversized_sent - t.oversized_413,
               "slots_after": {"running": health["running"], "queued": health["queued"]},
               "memory_growth": round(growth, 4)}
    verdict["pass"] = (verdict["lost"] == 0 and verdict["server_errors"] == 0 and verdict["greedy_mismatch"] == 0
                       and verdict["bad_not_4xx"] == 0 and verdict["oversized_not_413"] == 0
                       and health["running"] == 0 and health["queued"] == 0 and health["status"] == "ok"
                       and abs(growth) <= args.memory_tolerance)
    summary = asdict(t)
    summary.pop("latencies")
    summary.pop("mismatches")
    summary["retry_after"] = sorted(set(t.retry_after))
    return {
        **provenance(args.dtype, threads=1),  # the server's settings (benchmarks/soak.py server_config)
        "cpu": cpu_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "seconds": round(elapsed, 1),
        "requests": summary,
        "requests_per_s": round(t.sent / elapsed, 2),
        "latency_s": {"p50": pct(t.latencies, 50), "p99": pct(t.latencies, 99), "answered": len(t.latencies)},
        "warmup": {"sent": warm.sent, "answered": warm.answered, "lost": warm.lost,
                   "greedy_checked": warm.greedy_checked, "greedy_differs": warm.greedy_mismatch},
        "greedy": greedy,
        "rss_mb": {"before": round(rss_before, 1), "after": round(rss_after, 1)},
        "server_counters": metrics,
        "health_after": health,
        "verdict": verdict,
        "server_log_tail": log_tail if not verdict["pass"] else "",
    }


def print_report(r: dict) -> None:
    q, lat, v = r["requests"], r["latency_s"], r["verdict"]
    print(f"CPU: {r['cpu']['model']} (avx512_bf16: {r['cpu']['avx512_bf16']}); {r['seconds']} s of traffic")
    print(f"sent {q['sent']}: answered {q['answered']}, refused {q['refused']} (Retry-After {q['retry_after']}), "
          f"lost {q['lost']}; bad {q['bad_sent']} -> 4xx {q['bad_4xx']}; oversized {q['oversized_sent']} -> "
          f"413 {q['oversized_413']}; dropped streams {q['disconnects']}; 5xx {q['server_errors']}")
    g = r["greedy"]
    print(f"greedy answers checked against solo: {q['greedy_checked']} (+{r['warmup']['greedy_checked']} in warm-up); "
          f"differing: {len(g['judged'])}, of which near-ties {v['greedy_near_ties']} and defects "
          f"{v['greedy_mismatch']}")
    for j in g["judged"]:
        what = "near-tie" if j["near_tie"] else "DEFECT"
        detail = (f"tokens {j['solo_token']} vs {j['got_token']}, top-2 gap {j['top2_gap']:.2e}, behind top "
                  f"{j['behind_top'][0]:.2e}/{j['behind_top'][1]:.2e}, bound {j['bound']:.2e}"
                  if "bound" in j else j["why"])
        print(f"  {what}: {j['request']} at token {j['diverge_at']}: {j['solo_text']!r} vs {j['got_text']!r}; {detail}")
    print(f"rounding between batch shapes: {g['rounding']['absolute']:.2e} absolute, "
          f"{g['rounding']['relative_to_max_logit']:.2e} of max|logit| (bound: {g['near_tie_bound']})")
    if lat["p50"] is not None:
        print(f"latency p50 {lat['p50']:.2f} s, p99 {lat['p99']:.2f} s")
    print(f"RSS {r['rss_mb']['before']} MB -> {r['rss_mb']['after']} MB ({100 * v['memory_growth']:+.1f}%); "
          f"slots after: {v['slots_after']}")
    for p in q["problems"]:
        print("  problem:", p)
    print("PASS" if v["pass"] else "FAIL")

