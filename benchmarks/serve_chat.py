"""Multi-turn chat against `medusa serve`, with the prefix cache on and off: time to first token per turn and
total throughput.

N users (default 16) chat at once, each for T turns (default 5). Every conversation starts with the same
~500-token system prompt; each turn sends the whole conversation so far (system prompt, earlier questions and
the server's own answers) plus a new question, streamed, greedy. With the cache on, a later turn finds its
earlier turns (and every user the system prompt) in the cache and prefills only what is new.

One server runs at a time (same settings but `prefix_cache`), the order given by `--order`, so the two never
share the CPU. Reports per setting and turn the median TTFT, the cached prompt tokens the server reported
(`usage.prompt_tokens_details.cached_tokens`), and the total completion tokens per second over the run.

    python benchmarks/serve_chat.py --users 16 --turns 5 --max-tokens 64 --out benchmarks/results/serve_chat.json

Every loop is bounded: each request has a timeout, and so has each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from server_process import ServerProcess

from medusa.decoding.target.hardware import auto_dtype, machine, provenance
from medusa.io import write_json_atomic

TOPICS = ["the harbour", "the ferry", "the fish market", "the lighthouse", "the tides", "the boatyard",
          "the weather station", "the coastal path", "the lifeboat crew", "the old customs house"]
RULES = ["Answer in plain words and keep each answer short.", "Say so when you do not know something.",
         "Never invent opening hours, prices or timetables.", "Prefer the town's own names for places.",
         "Warn about tides and weather whenever a question involves the shore or the sea.",
         "Suggest the tourist office for anything you cannot answer."]


def system_prompt() -> str:
    """A fixed system prompt of about 500 tokens (the embedded model's tokenizer)."""
    parts = ["You are the visitor assistant of a small fishing town on a rocky coast."]
    for i, topic in enumerate(TOPICS[:7]):
        parts.append(f"Section {i + 1}, {topic}: visitors ask about {topic} more than anything else in season. "
                     f"{RULES[i % len(RULES)]} {RULES[(i + 3) % len(RULES)]} Describe {topic} as a local "
                     f"would, mention how to reach it on foot from the square, and what to bring.")
    parts += RULES
    return " ".join(parts)


def questions(user: int, turns: int, prompts: list[str]) -> list[str]:
    return [prompts[(user * turns + t) % len(prompts)][:400] for t in range(turns)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", default="mtbench", help="question source for medusa.prompts.load_prompts")
    p.add_argument("--order", default="on,off", help="cache settings to run, in this order")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prefix-cache-mb", type=float, default=None)
    p.add_argument("--config", default=None, help="base serve YAML (prefix_cache is set per server)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--run-timeout", type=float, default=3600.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def server_config(cache: bool, args: argparse.Namespace) -> dict:
    import yaml

    base = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    cfg = {**base, "model": args.model, "heads": args.heads, "dtype": args.dtype, "max_batch": args.max_batch,
           "max_context": args.max_context, "max_queue": 4 * args.users, "queue_timeout_s": args.request_timeout,
           "prefix_cache": cache, "log_level": "warning"}
    if cache and args.prefix_cache_mb is not None:
        cfg["prefix_cache_mb"] = args.prefix_cache_mb
    return cfg


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                   timeout: float) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    text, usage = [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["delta"]["content"])
    end = time.perf_counter()
    if first is None or not usage:
        return {"error": "no tokens"}
    return {"ttft": first - start, "seconds": end - start, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def run(url: str, system: str, asks: list[list[str]], args: argparse.Namespace) -> dict:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    # turns[t][u]: user u's turn t (None when an earlier turn of that user failed)
    turns: list[list[dict | None]] = [[None] * len(asks) for _ in range(args.turns)]

    async def user(client: httpx.AsyncClient, u: int, qs: list[str]) -> None:
        messages = [{"role": "system", "content": system}]
        for t, q in enumerate(qs):
            messages.append({"role": "user", "content": q})
            r = await one_turn(client, url, model, messages, args.max_tokens, args.request_timeout)
            turns[t][u] = r
            if "error" in r:
                return
            messages.append({"role": "assistant", "content": r["text"]})

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.users + 4)) as client:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(user(client, u, qs) for u, qs in enumerate(asks))), args.run_timeout)
        wall = time.perf_counter() - start
    turns = [[r if r is not None else {"error": "not asked: an earlier turn failed"} for r in rs] for rs in turns]
    per_turn = []
    for t, rs in enumerate(turns):
        ok = [r for r in rs if "error" not in r]
        per_turn.append({"turn": t + 1, "requests": len(rs), "errors": len(rs) - len(ok),
                         "ttft_p50_s": statistics.median(r["ttft"] for r in ok) if ok else None,
                         "ttft_mean_s": statistics.fmean(r["ttft"] for r in ok) if ok else None,
                         "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else None,
                         "cached_tokens_mean": statistics.fmean(r["cached_tokens"] for r in ok) if ok else None})
        for r in rs[:1]:
            if "error" in r:
                print(f"  turn {t + 1} first error: {r['error']}", file=sys.stderr)
    ok = [r for rs in turns for r in rs if "error" not in r]
    tokens = sum(r["completion_tokens"] for r in ok)
    return {"seconds": wall, "requests": sum(len(rs) for rs in turns), "errors": sum(p["errors"] for p in per_turn),
            "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "cached_tokens": sum(r["cached_tokens"] for r in ok), "turns": per_turn,
            "texts": [[r.get("text") for r in rs] for rs in turns]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from medusa.prompts import load_prompts

    prompts = load_prompts(args.prompts)
    system = system_prompt()
    asks = [questions(u, args.turns, prompts) for u in range(args.users)]
    workdir = Path(tempfile.mkdtemp(prefix="serve_chat-"))
    results = {}
    for name in [n.strip() for n in args.order.split(",")]:
        if name not in ("on", "off"):
            raise SystemExit(f"--order: {name!r} is neither on nor off")
        server = ServerProcess(f"cache-{name}", server_config(name == "on", args), workdir)
        try:
            server.wait_ready(args.startup_timeout)
            asyncio.run(run(server.url, "Warm-up.", [["Say hello."]], argparse.Namespace(**{**vars(args),
                                                                                            "turns": 1})))
            results[name] = asyncio.run(run(server.url, system, asks, args))
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            results[name]["metrics"] = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                                        if line.startswith("medusa_prefix_cache_")}
        finally:
            server.stop()
        r = results[name]
        print(f"cache {name}: {r['tokens_per_s']:.1f} tok/s over {r['seconds']:.1f} s, {r['errors']} errors, "
              f"cached {r['cached_tokens']} of {r['prompt_tokens']} prompt tokens", flush=True)
        for p in r["turns"]:
            print(f"  turn {p['turn']}: TTFT p50 {p['ttft_p50_s']:.2f} s, prompt {p['prompt_tokens_mean']:.0f} "
                  f"tokens, cached {p['cached_tokens_mean']:.0f}", flush=True)
    summary = {}
    if "on" in results and "off" in results:
        on, off = results["on"], results["off"]
        summary = {"throughput_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
                   "ttft_off_over_on_by_turn": [b["ttft_p50_s"] / a["ttft_p50_s"] if a["ttft_p50_s"] else None
                                                for a, b in zip(on["turns"], off["turns"])],
                   "same_texts": on["texts"] == off["texts"],
                   "same_answers": sum(a == b for x, y in zip(on["texts"], off["texts"]) for a, b in zip(x, y)),
                   "answers": sum(len(x) for x in on["texts"])}
        print(json.dumps(summary, indent=1))
    dtype = args.dtype if args.dtype != "auto" else auto_dtype(machine("cpu"))[0]
    result = {"model": args.model, "heads": args.heads, "dtype": dtype, **provenance(dtype),
              "users": args.users, "turns": args.turns, "max_tokens": args.max_tokens, "max_batch": args.max_batch,
              "system_prompt_chars": len(system), "results": results, "summary": summary}
    if args.out:
        write_json_atomic(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
