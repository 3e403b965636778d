"""Resident memory of `medusa serve` before, during and after mixed traffic.

Starts one loopback server (embedded default model and heads, default settings unless a --config says
otherwise), records its RSS when idle (after start-up and calibration), runs `--passes` identical passes of
mixed traffic (short, medium and long prompts; 1, 4 and 12 concurrent clients; n = 1 and n = 3; streaming
and not), records RSS after each pass, waits `--idle` seconds and records it again. Also copies the
server's own memory gauges (`medusa_memory_*` in /metrics) at each point.

    python benchmarks/serve_memory.py --passes 6 --idle 20 --out serve_memory.json

The verdict `returns_to_idle` is true when RSS after the idle wait is within 15% of the idle level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from server_process import ServerProcess

WORDS = "the quick brown fox jumps over a lazy dog while seven sailors sing of distant harbours".split()


def prompt_of(words: int, salt: int) -> str:
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(words))


def pass_requests() -> list[list[dict]]:
    """One pass: groups of request bodies, each group sent concurrently (the group's size is the load)."""
    groups = []
    for clients, words, n, stream in ((1, 8, 1, True), (4, 60, 1, False), (12, 20, 1, True),
                                      (2, 400, 1, False), (4, 30, 3, True), (1, 900, 1, True), (8, 120, 2, False)):
        group = []
        for c in range(clients):
            body = {"prompt": prompt_of(words, c), "max_tokens": 12, "n": n, "stream": stream}
            if n > 1:
                body.update(temperature=0.8, seed=c)
            group.append(body)
        groups.append(group)
    return groups


async def run_pass(url: str, model: str, timeout: float) -> dict:
    answered = failed = 0
    async with httpx.AsyncClient(timeout=timeout) as http:
        for group in pass_requests():
            rs = await asyncio.gather(*(http.post(url + "/v1/completions", json={**b, "model": model})
                                        for b in group), return_exceptions=True)
            for r in rs:
                if isinstance(r, httpx.Response) and r.status_code == 200:
                    answered += 1
                else:
                    failed += 1
                    print(f"  request failed: {r if not isinstance(r, httpx.Response) else r.text[:200]}",
                          file=sys.stderr)
    return {"answered": answered, "failed": failed}


def memory_gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("medusa_memory_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="serve YAML (default: the server's defaults)")
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--idle", type=float, default=20.0, help="seconds idle after the traffic")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server process")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    cfg.setdefault("log_level", "warning")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(dict(e.split("=", 1) for e in args.env))  # the server process inherits them
        server = ServerProcess("memory", cfg, Path(tmp))
        try:
            server.wait_ready(args.startup_timeout)
            model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            time.sleep(2)
            points = [{"at": "idle", "rss_mb": round(server.rss_mb(), 1), "gauges": memory_gauges(server.url)}]
            print(f"idle: {points[0]['rss_mb']} MB", flush=True)
            for i in range(args.passes):
                start = time.perf_counter()
                tally = asyncio.run(run_pass(server.url, model, args.request_timeout))
                points.append({"at": f"pass {i + 1}", "rss_mb": round(server.rss_mb(), 1),
                               "seconds": round(time.perf_counter() - start, 1), **tally,
                               "gauges": memory_gauges(server.url)})
                print(f"pass {i + 1}: {points[-1]['rss_mb']} MB ({points[-1]['seconds']} s, {tally})", flush=True)
            time.sleep(args.idle)
            points.append({"at": f"{args.idle:g} s idle", "rss_mb": round(server.rss_mb(), 1),
                           "gauges": memory_gauges(server.url)})
            print(f"after {args.idle:g} s idle: {points[-1]['rss_mb']} MB", flush=True)
        finally:
            server.stop()
    idle, after = points[0]["rss_mb"], points[-1]["rss_mb"]
    result = {"config": cfg, "env": args.env, "points": points, "idle_mb": idle, "after_idle_mb": after,
              "peak_mb": max(pt["rss_mb"] for pt in points),
              "verdict": {"growth": round(after / idle - 1, 3), "returns_to_idle": after <= 1.15 * idle}}
    print(json.dumps({k: result[k] for k in ("idle_mb", "peak_mb", "after_idle_mb", "verdict")}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
