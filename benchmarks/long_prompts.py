"""Long prompts against a running stream: chunked prefill (the default) against whole-prompt prefill.

Four `medusa serve` processes on 127.0.0.1, the same but for prefill: the default (chunks carried by the
running rows' decode passes, each adding at most the decode pass's own time), the same with `prefill_stall`
0.5 and 2, and `chunked_prefill: false` with a 512-token budget (each long prompt prefilled whole, alone: the server's
behaviour before chunking). For each, in turn, `--repeats` times:

1. the canary alone: one greedy streaming chat of `--canary-tokens` tokens;
2. the canary again, and as soon as its first token arrives, `--long` prompts of about `--long-tokens` tokens
   (streaming completions of `--long-max-tokens` tokens each) arrive together.

It reports the canary's time with the long prompts over its time alone (median over repeats; the target is
<= 2x), its largest gap between tokens, the long prompts' time to first token (chunked over unchunked: the
target is <= 1.2x), and the server's inter-token-latency and time-to-first-token histograms over each scenario.

    python benchmarks/long_prompts.py --repeats 3 --out benchmarks/results/long-prompts.json
    python benchmarks/long_prompts.py --servers chunked --repeats 3 --out long-prompts-target.json

For the default server (step-time target 2x) it also gives the long prompts' mean TTFT over its bound
(docs/serving.md, "What the target costs a long prompt"): the k-th prompt to get its first token waits the
whole-prefill time of the first k (the unchunked server's k-th TTFT, same round) plus the canary's own step time
for the steps it takes meanwhile (its decode time alone, times the share of its life that overlaps), and over the
worst case, a stream running all along (the whole-prefill time over the share of each step left to prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from server_process import ServerProcess

from medusa.decoding.target.hardware import provenance
from medusa.io import write_json_atomic

# What each server changes from the default config (chunked prefill, auto budget, the step-time target 2x).
SERVERS = {"chunked": {}, "chunked-stall-0.5": {"prefill_stall": 0.5}, "chunked-stall-2": {"prefill_stall": 2.0},
           "unchunked": {"chunked_prefill": False, "prefill_tokens_per_step": 512}}
# The step-time target of a server, as a multiple of a stream's step alone (docs/serving.md, "Latency target"):
# its long prompts may wait their whole-prefill time over s = (T - d) / T = (m - 1) / m, the share of each step
# left to prefill. The whole-prefill time is the unchunked server's, measured in the same run.
TARGET_MULTIPLE = {"chunked": 2.0}
CANARY = "Give three short tips for writing clear technical documentation."
HISTOGRAMS = ("vllm:inter_token_latency_seconds", "vllm:time_to_first_token_seconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--canary-tokens", type=int, default=48)
    p.add_argument("--long", type=int, default=3, help="long prompts arriving together")
    p.add_argument("--long-tokens", type=int, default=1800, help="about this many prompt tokens each")
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--servers", default=",".join(SERVERS), help="which of " + ", ".join(SERVERS)
                   + " to run (unchunked is always run: the others are compared with it)")
    p.add_argument("--out", default=None)
    p.add_argument("--log-level", default="warning", help="the servers' log level; `debug` logs every step "
                   "(mode, rows, prompt tokens carried, target, time) in the working folder printed at the start")
    return p.parse_args(argv)


def long_text(index: int, chars: int) -> str:
    """A different stretch of real text per prompt (Python's own argparse source), ~3.6 characters a token."""
    import argparse as source

    text = inspect.getsource(source)
    start = (index * 7919) % max(len(text) - chars, 1)
    return "Summarise what this code does.\n\n" + text[start: start + chars]


async def stream(client: httpx.AsyncClient, url: str, path: str, body: dict, timeout: float,
                 first: asyncio.Event | None = None) -> dict:
    """A streaming request: its time, first token, largest gap between tokens and usage; `first` is set
    at its first token."""
    start = time.perf_counter()
    times, usage = [], {}
    async with client.stream("POST", url + path, json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}},
                             timeout=timeout) as r:
        if r.status_code != 200:
            raise SystemExit(f"{path}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("delta", {}).get("content") or choice.get("text"):
                times.append(time.perf_counter() - start)
                if first is not None:
                    first.set()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"seconds": time.perf_counter() - start, "ttft": times[0] if times else None,
            "max_gap": max(gaps, default=0.0), "prompt_tokens": usage.get("prompt_tokens"),
            "tokens": usage.get("completion_tokens")}


async def scenario(url: str, model: str, args: argparse.Namespace, with_long: bool, round_: int) -> dict:
    canary = {"model": model, "messages": [{"role": "user", "content": CANARY}],
              "max_tokens": args.canary_tokens, "temperature": 0}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.long + 4)) as client:
        if not with_long:
            return {"canary": await stream(client, url, "/v1/chat/completions", canary, args.timeout)}
        first = asyncio.Event()
        task = asyncio.create_task(stream(client, url, "/v1/chat/completions", canary, args.timeout, first))
        await asyncio.wait_for(first.wait(), args.timeout)
        longs = [{"model": model, "prompt": long_text(round_ * args.long + i, int(3.6 * args.long_tokens)),
                  "max_tokens": args.long_max_tokens, "temperature": 0} for i in range(args.long)]
        results = await asyncio.gather(task, *(stream(client, url, "/v1/completions", b, args.timeout)
                                               for b in longs))
    return {"canary": results[0], "long": list(results[1:])}


def histograms(url: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {h: {} for h in HISTOGRAMS}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for h in HISTOGRAMS:
            if line.startswith(h + "_bucket{"):
                out[h][line.split('le="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def diff(after: dict, before: dict) -> dict:
    return {h: {le: after[h][le] - before[h].get(le, 0.0) for le in after[h]} for h in after}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="long_prompts-"))
    print(f"server logs: {workdir}", flush=True)
    base = {"model": args.model, "heads": args.heads, "dtype": args.dtype, "max_context": 2048,
            "log_level": args.log_level}
    names = {n.strip() for n in args.servers.split(",")} | {"unchunked"}
    unknown = names - set(SERVERS)
    if unknown:
        raise SystemExit(f"--servers: unknown {', '.join(sorted(unknown))} (known: {', '.join(SERVERS)})")
    servers = {n: ServerProcess(n, {**base, **v}, workdir) for n, v in SERVERS.items() if n in names}
    runs: dict[str, dict[str, list]] = {n: {"alone": [], "with_long": [], "hist": []} for n in servers}
    try:
        for s in servers.values():
            s.wait_ready(args.timeout)
        model = httpx.get(servers["unchunked"].url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for s in servers.values():  # warm-up: both scenarios once
            for with_long in (False, True):
                asyncio.run(scenario(s.url, model, args, with_long, 99))
        for r in range(args.repeats):
            order = list(servers)[r % len(servers):] + list(servers)[: r % len(servers)]
            for n in order:
                url = servers[n].url
                runs[n]["alone"].append(asyncio.run(scenario(url, model, args, False, r)))
                before = histograms(url)
                runs[n]["with_long"].append(asyncio.run(scenario(url, model, args, True, r)))
                runs[n]["hist"].append(diff(histograms(url), before))
                print(f"round {r} {n}: canary alone {runs[n]['alone'][-1]['canary']['seconds']:.2f} s, with long "
                      f"prompts {runs[n]['with_long'][-1]['canary']['seconds']:.2f} s; long TTFT "
                      + ", ".join(f"{x['ttft']:.2f}" for x in runs[n]["with_long"][-1]["long"]), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    summary = {n: summarise(v) for n, v in runs.items()}
    for n in servers:
        summary[n]["long_ttft_over_unchunked"] = (summary[n]["long_ttft_mean_s"]
                                                  / summary["unchunked"]["long_ttft_mean_s"])
        if n in TARGET_MULTIPLE:
            m = TARGET_MULTIPLE[n]
            summary[n]["long_ttft_bound_s"] = statistics.mean(ttft_bounds(runs[n], runs["unchunked"]))
            summary[n]["long_ttft_over_bound"] = summary[n]["long_ttft_mean_s"] / summary[n]["long_ttft_bound_s"]
            summary[n]["long_ttft_worst_case_s"] = summary["unchunked"]["long_ttft_mean_s"] * m / (m - 1)
            summary[n]["canary_target"] = m
    result = {"settings": vars(args), **provenance(args.dtype), "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.out:
        write_json_atomic(args.out, result, indent=1)
    return 0


def ttft_bounds(chunked: dict, unchunked: dict) -> list[float]:
    """Per round and prompt, the k-th first token's bound: the first k prompts' prefill (the unchunked
    server's k-th TTFT, same prompts) plus the canary's decode time alone times the share of the canary's life
    after the prompts came that had passed by the measured k-th first token (the steps it took meanwhile)."""
    out = []
    for alone, with_long, whole in zip(chunked["alone"], chunked["with_long"], unchunked["with_long"]):
        decode_alone = alone["canary"]["seconds"] - alone["canary"]["ttft"]
        life = with_long["canary"]["seconds"] - with_long["canary"]["ttft"]
        measured = sorted(x["ttft"] for x in with_long["long"])
        for work, got in zip(sorted(x["ttft"] for x in whole["long"]), measured):
            out.append(work + decode_alone * min(1.0, got / life))
    return out


def summarise(v: dict) -> dict:
    med = statistics.median
    ratios = [w["canary"]["seconds"] / a["canary"]["seconds"] for a, w in zip(v["alone"], v["with_long"])]
    ttfts = [x["ttft"] for w in v["with_long"] for x in w["long"]]
    return {"canary_alone_s": med(a["canary"]["seconds"] for a in v["alone"]),
            "canary_with_long_s": med(w["canary"]["seconds"] for w in v["with_long"]),
            "canary_slowdown": med(ratios), "canary_slowdown_runs": ratios,
            "canary_max_gap_s": med(w["canary"]["max_gap"] for w in v["with_long"]),
            "long_ttft_mean_s": statistics.mean(ttfts), "long_ttft_max_s": max(ttfts),
            "long_prompt_tokens": [x["prompt_tokens"] for x in v["with_long"][0]["long"]]}


if __name__ == "__main__":
    sys.exit(main())
