"""Soak test of `medusa serve`: mixed good and bad traffic for a fixed time, nothing may be lost.

Starts one server process on 127.0.0.1 (the embedded model and shipped heads by default, fp32 so greedy
answers can be compared token for token), takes each greedy prompt's answer alone, warms up, records the
server's memory, then runs N concurrent clients for `--duration` seconds (at most `--max-requests`
requests) with a mix of streaming / non-streaming, chat / completion, greedy / sampled requests, a fraction
of invalid requests, streams dropped mid-way and oversized bodies. Afterwards it waits for the batch to
drain and measures memory again.

Checks: every valid request gets a complete answer or an explicit refusal (429/503 with Retry-After);
nothing is lost (no connection error, timeout, 5xx or truncated stream); every invalid request gets a 4xx
in OpenAI's error shape; greedy answers equal the answer alone, token for token, except after a near-tie;
slots return to 0 and the server's RSS to within 5% of the warmed-up baseline. Writes JSON (default
benchmarks/results/soak.json); exit status 1 when a check fails.

Near-ties. Greedy decoding in a batch equals decoding alone only up to rounding: on CPU neither oneDNN's
packed fp32 matmul nor F.linear gives a row the same result whatever the number of rows beside it (they
differ at the 1e-6 level), so where the top two logits of a position are that close, the argmax may go
either way. Every greedy answer that differs from its solo answer is therefore judged offline, after the
server has stopped: one plain forward of the same model over prompt + the common prefix of the two answers
gives the logits at the first divergence. When both diverging tokens lie within NEAR_TIE of the largest
logit (relative to the largest |logit|), the mismatch is a near-tie, reported separately; any other
mismatch is a defect and fails the soak. The report also measures the rounding itself (the same rows
decoded alone and batched) to show how far below the bound it is.

    python benchmarks/soak.py                       # 60 s, 12 clients
    python benchmarks/soak.py --duration 20 --clients 6 --out /tmp/soak.json
    python benchmarks/soak.py --minutes 30 --out benchmarks/results/soak-30min.json
    python benchmarks/soak.py --minutes 30 --prefix-cache-mb 4 --out soak-prefix.json   # cache evicting throughout

Memory: the server's RSS is sampled every `--rss-every` seconds through the traffic (`benchmarks/rss_trace.py`);
its trend must stay under 1% per 10 minutes, and the trace is plotted beside the JSON (same name, .png).

Traffic goes only to the loopback server this script starts; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from medusa.io import write_json_atomic
from rss_trace import RssTrace, plot, slope_pct_per_10min
from server_process import ServerProcess
from soak_report import build_report, judge_mismatches, print_report
from soak_requests import outcome_counts, run_load, solo_answers, wait_drained


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="default")
    p.add_argument("--dtype", default="fp32", help="fp32 makes greedy answers comparable token for token")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--minutes", type=float, default=None, help="minutes of traffic (overrides --duration)")
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--max-requests", type=int, default=3000)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=2, help="small, so some requests are refused with 429")
    p.add_argument("--bad", type=float, default=0.15, help="fraction of invalid requests")
    p.add_argument("--disconnect", type=float, default=0.10, help="fraction of streams dropped mid-way")
    p.add_argument("--oversized", type=float, default=0.05, help="fraction of bodies over the size limit")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--prefix-cache-mb", type=float, default=None,
                   help="the server's prefix cache budget (small: eviction all through the soak); default: its own")
    p.add_argument("--kernel-cache-entries", type=int, default=None,
                   help="the server's cap on compiled kernels per cache (`medusa serve --kernel-cache-entries`)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of the same traffic before the baseline "
                   "(default: a tenth of the traffic, at least 15 s: the allocator keeps the largest shapes "
                   "it has served, so the baseline waits until the traffic's shapes have all come by)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--memory-tolerance", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/soak.json")
    args = p.parse_args(argv)
    if args.minutes is not None:
        args.duration = 60 * args.minutes
        args.max_requests = max(args.max_requests, int(args.duration * 20))
    if args.warmup is None:
        args.warmup = max(15.0, args.duration / 10)
    return args


def server_config(args: argparse.Namespace) -> dict:
    """One thread and a small queue and body limit, so refusals and 413s happen under the load."""
    return {"model": args.model, "heads": args.heads, "dtype": args.dtype, "threads": 1,
            "max_batch": args.max_batch, "max_queue": args.max_queue, "max_context": 512, "queue_timeout_s": 30,
            "max_body_bytes": args.max_body_bytes, "log_level": "warning",
            **({"prefix_cache_mb": args.prefix_cache_mb} if args.prefix_cache_mb else {}),
            **({"kernel_cache_entries": args.kernel_cache_entries} if args.kernel_cache_entries else {})}


def prefix_cache_counts(url: str) -> dict[str, float]:
    """The prefix cache's counters and gauges in /metrics (lookups, hits, evictions, cached tokens, bytes)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("medusa_prefix_cache_") and not line.startswith("#") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("medusa_prefix_cache_")] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess("soak", server_config(args), Path(tmp))
        try:
            server.wait_ready(args.startup_timeout)
            model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            solo = asyncio.run(solo_answers(server.url, model))
            warm = asyncio.run(run_load(server.url, model, args, args.warmup, args.max_requests, solo))
            wait_drained(server.url)
            time.sleep(1.0)
            rss_before = server.rss_mb()
            start = time.monotonic()
            trace = RssTrace(server.rss_mb, args.rss_every)
            trace.start()
            try:
                tally = asyncio.run(run_load(server.url, model, args, args.duration, args.max_requests, solo))
            finally:
                samples = trace.stop()
            elapsed = time.monotonic() - start
            health = wait_drained(server.url)
            time.sleep(1.0)
            rss_after = server.rss_mb()
            metrics = outcome_counts(server.url)
            cache = prefix_cache_counts(server.url)
        finally:
            server.stop()
        log_tail = server.log_path.read_text()[-3000:]
    greedy = judge_mismatches(args, warm.mismatches + tally.mismatches, solo)
    report = build_report(args, tally, warm, elapsed, health, rss_before, rss_after, metrics, log_tail, greedy)
    report["prefix_cache"] = {"budget_mb": args.prefix_cache_mb, **cache}
    report["rss_trace"] = {"every_s": args.rss_every, "samples": samples,
                           "slope_pct_per_10min": round(slope_pct_per_10min(samples), 3)}
    report["verdict"]["rss_slope_pct_per_10min"] = report["rss_trace"]["slope_pct_per_10min"]
    report["verdict"]["pass"] = report["verdict"]["pass"] and abs(report["rss_trace"]["slope_pct_per_10min"]) < 1.0
    plot(samples, str(Path(args.out).with_suffix(".png")),
         f"medusa serve RSS, {args.duration / 60:g} min soak, {report['cpu']['model']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, report)
    print(f"RSS trend over the traffic: {report['rss_trace']['slope_pct_per_10min']:+.2f}% per 10 minutes "
          f"({len(samples)} samples; flat: under 1%)")
    print_report(report)
    print("prefix cache: " + ", ".join(f"{k} {v:g}" for k, v in report["prefix_cache"].items()))
    return 0 if report["verdict"]["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
