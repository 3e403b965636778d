"""Loopback load test of `medusa serve` for three speculation policies: always on, always off, dynamic.

Starts one server process per policy on 127.0.0.1 (same model, same settings otherwise), then for each
concurrency level runs a closed loop of streaming chat requests against each server in turn (the order
rotates per level, so slow drift of a shared machine does not favour one policy). Reports throughput and
p50/p95 time per output token (TPOT) and time to first token per policy and level, the steps each mode
took, and whether dynamic is within 5% of the better fixed policy at every level and strictly better than
each fixed policy somewhere.

    python benchmarks/serve_load.py --levels 1,2,4,8,16,32 --max-tokens 64 --out serve_load.json

With `--base REV` each policy also gets a server run from revision REV (checked out into a temporary git
worktree); both revisions' servers take turns in every level, and the report gives this checkout's
throughput over the base's per policy and level (is a change within noise under load?).

Every loop is bounded: requests per level are fixed, each request and each level have a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from server_process import ServerProcess, counter

from medusa.decoding.target.hardware import provenance
from medusa.io import write_json_atomic

POLICIES = {"on": "heads", "off": "plain", "dynamic": "dynamic"}
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="default")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--levels", default="1,2,4,8,16,32", help="concurrent clients per level")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="runs per policy and level (the median is kept)")
    p.add_argument("--prompts", default="mtbench", help="prompt source for medusa.prompts.load_prompts")
    p.add_argument("--policies", default="on,off,dynamic")
    p.add_argument("--config", default=None, help="base serve YAML (policy.mode is set per server)")
    p.add_argument("--cost-model", default=None, help="cost-model JSON for the dynamic policy")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--level-timeout", type=float, default=900.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--base", default=None, help="also serve each policy from this git revision, side by side")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def server_config(mode: str, args: argparse.Namespace) -> dict:
    """The serve config of one policy's server: the base YAML with this run's settings and `mode`."""
    base = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    policy = dict(base.get("policy") or {}, mode=mode)
    if args.cost_model and mode == "dynamic":
        policy["cost_model"] = args.cost_model
    return {**base, "model": args.model, "heads": args.heads, "dtype": args.dtype, "max_batch": args.max_batch,
            "max_context": args.max_context, "max_queue": 4 * args.max_batch,
            "queue_timeout_s": args.request_timeout, "policy": policy, "log_level": "warning"}


def steps_by_mode(url: str) -> dict[str, float]:
    return counter(url, "medusa_steps_total")


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      timeout: float) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    if first is None:
        return {"error": "no tokens"}
    return {"ttft": first - start, "tpot": (last - first) / max(tokens - 1, 1), "tokens": tokens}


async def run_level(url: str, prompts: list[str], clients: int, requests: int, args: argparse.Namespace) -> dict:
    todo = list(range(requests))
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    results: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop(0)
            results.append(await one_request(client, url, model, prompts[i % len(prompts)], args.max_tokens,
                                             args.request_timeout))

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(clients))), args.level_timeout)
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    for r in results[:1]:
        if "error" in r:
            print(f"  first error: {r['error']}", file=sys.stderr)
    tpot = sorted(r["tpot"] for r in ok)
    ttft = sorted(r["ttft"] for r in ok)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"clients": clients, "requests": requests, "errors": len(results) - len(ok),
            "tokens": sum(r["tokens"] for r in ok), "seconds": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "tpot_p50_ms": 1000 * statistics.median(tpot) if tpot else float("nan"),
            "tpot_p95_ms": 1000 * pct(tpot, 0.95),
            "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else float("nan")}


def verdict(table: dict[str, dict[int, dict]], levels: list[int]) -> dict:
    if not all(k in table for k in ("on", "off", "dynamic")):
        return {}
    tput = {p: {lv: table[p][lv]["tokens_per_s"] for lv in levels} for p in table}
    if any(table[p][lv]["errors"] or not table[p][lv]["tokens"] for p in table for lv in levels):
        return {"valid": False, "why": "some requests failed"}
    within = {lv: tput["dynamic"][lv] >= 0.95 * max(tput["on"][lv], tput["off"][lv]) for lv in levels}
    return {"valid": True, "within_5pct_of_best_fixed": within, "all_within_5pct": all(within.values()),
            "beats_on_somewhere": any(tput["dynamic"][lv] > tput["on"][lv] for lv in levels),
            "beats_off_somewhere": any(tput["dynamic"][lv] > tput["off"][lv] for lv in levels)}


def markdown(table: dict[str, dict[int, dict]], levels: list[int]) -> str:
    lines = ["| clients | " + " | ".join(f"{p} tok/s | {p} TPOT p50/p95 ms" for p in table) + " |",
             "|---|" + "---|---|" * len(table)]
    for lv in levels:
        cells = []
        for p in table:
            r = table[p].get(lv)
            cells += ["-", "-"] if r is None else [f"{r['tokens_per_s']:.1f}",
                                                   f"{r['tpot_p50_ms']:.0f} / {r['tpot_p95_ms']:.0f}"]
        lines.append(f"| {lv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    names = [p.strip() for p in args.policies.split(",")]
    from medusa.prompts import load_prompts

    prompts = load_prompts(args.prompts)
    workdir = Path(tempfile.mkdtemp(prefix="serve_load-"))
    base = None
    if args.base:
        base = git("rev-parse", "--short", args.base)
        tree = workdir / "base"
        git("worktree", "add", "--detach", str(tree), base)
    servers = {n: ServerProcess(n, server_config(POLICIES[n], args), workdir) for n in names}
    if base:
        servers.update({f"{n}@{base}": ServerProcess(f"{n}@{base}", server_config(POLICIES[n], args), workdir,
                                                     root=tree) for n in names})
    names = list(servers)
    table: dict[str, dict[int, dict]] = {n: {} for n in names}
    try:
        for s in servers.values():
            s.wait_ready(args.startup_timeout)
            asyncio.run(run_level(s.url, prompts[-1:], 1, 1, args))  # warm-up
        for i, clients in enumerate(levels):
            requests = max(args.min_requests, clients * args.requests_per_client)
            order = names[i % len(names):] + names[: i % len(names)]
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for _ in range(args.repeats):
                for n in order:
                    before = steps_by_mode(servers[n].url)
                    row = asyncio.run(run_level(servers[n].url, prompts, clients, requests, args))
                    after = steps_by_mode(servers[n].url)
                    row["steps"] = {m: after[m] - before.get(m, 0) for m in after if after[m] - before.get(m, 0)}
                    runs[n].append(row)
            for n in order:
                row = sorted(runs[n], key=lambda r: r["tokens_per_s"])[len(runs[n]) // 2]
                row["tokens_per_s_runs"] = [round(r["tokens_per_s"], 2) for r in runs[n]]
                table[n][clients] = row
                print(f"clients={clients:3d} {n:8s} {row['tokens_per_s']:8.1f} tok/s  "
                      f"TPOT p50 {row['tpot_p50_ms']:7.1f} ms p95 {row['tpot_p95_ms']:7.1f} ms  "
                      f"TTFT p50 {row['ttft_p50_ms']:7.1f} ms  errors {row['errors']}  steps {row['steps']}",
                      flush=True)
    finally:
        for s in servers.values():
            s.stop()
        if base:
            git("worktree", "remove", "--force", str(workdir / "base"))
    result = {"model": args.model, "heads": args.heads, "dtype": args.dtype, **provenance(args.dtype),
              "max_tokens": args.max_tokens,
              "levels": levels, "results": table, "verdict": verdict(table, levels)}
    if base:
        result.update(base=base, head=git("rev-parse", "--short", "HEAD"), head_over_base={
            n: {lv: round(table[n][lv]["tokens_per_s"] / table[f"{n}@{base}"][lv]["tokens_per_s"], 3)
                for lv in levels} for n in names if "@" not in n})
        print("this checkout's throughput over " + base + ": " + json.dumps(result["head_over_base"]))
    print(markdown(table, levels))
    print(json.dumps(result["verdict"], indent=1))
    if args.out:
        write_json_atomic(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
