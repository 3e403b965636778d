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

Traffic goes only to the loopback server this script starts; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

HOST = "127.0.0.1"
PROMPTS = ["Give me three tips for staying focused.", "What is the capital of Italy?",
           "Write a haiku about autumn rain.", "Explain what a hash table is in one paragraph."]
GREEDY_TOKENS = 16
# A divergence is a near-tie when both tokens' logits are within this fraction of max|logit| of the top
# logit. fp32 rounding differences between batch shapes are ~1e-6 absolute on logits of magnitude ~10-30,
# i.e. ~1e-7 relative (measured in every run, `rounding`); a wrong token from a real defect (a wrong
# position, a stale cache row, another row's state) differs by whole logits. 1e-4 sits 2-3 orders of
# magnitude above the first and 3-4 below the second.
NEAR_TIE = 1e-4
BAD_BODIES: list[bytes] = [
    json.dumps({"model": "M", "prompt": "x", "seed": 2**64, "temperature": 1.0}).encode(),
    b'{"model": "M", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}",
    b'{"model": "M", "prompt": "lone \\ud800 surrogate"}',
    json.dumps({"model": "M", "prompt": "x", "presence_penalty": 0.5}).encode(),
    json.dumps({"model": "M", "prompt": "x", "temperature": -1}).encode(),
    json.dumps({"model": "M", "prompt": "x", "max_tokens": 10**9}).encode(),
    json.dumps({"model": "M", "messages": [{"role": "robot", "content": "x"}]}).encode(),
    json.dumps({"model": "gpt-none", "prompt": "x"}).encode(),
    b'{"model": "M", "prompt": "x", "top_p": NaN}',
    b"{not json",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="default")
    p.add_argument("--dtype", default="fp32", help="fp32 makes greedy answers comparable token for token")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--max-requests", type=int, default=3000)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=2, help="small, so some requests are refused with 429")
    p.add_argument("--bad", type=float, default=0.15, help="fraction of invalid requests")
    p.add_argument("--disconnect", type=float, default=0.10, help="fraction of streams dropped mid-way")
    p.add_argument("--oversized", type=float, default=0.05, help="fraction of bodies over the size limit")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of the same traffic before the baseline")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--memory-tolerance", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/soak.json")
    return p.parse_args(argv)


# ---- the server ---------------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.port = free_port()
        cfg = {"model": args.model, "heads": args.heads, "dtype": args.dtype, "host": HOST, "port": self.port,
               "threads": 1, "max_batch": args.max_batch, "max_queue": args.max_queue, "max_context": 512,
               "queue_timeout_s": 30, "max_body_bytes": args.max_body_bytes, "log_level": "warning"}
        path = workdir / "soak.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.log_path = workdir / "server.log"
        self.log = open(self.log_path, "w")
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-m", "medusa.cli", "serve", "--config", str(path)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"server did not start within {timeout:.0f} s")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("VmRSS not found")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# ---- one request of each kind -------------------------------------------------------------------------

@dataclass
class Tally:
    sent: int = 0
    answered: int = 0          # valid requests with a complete answer
    refused: int = 0           # valid requests refused with 429/503 (+ Retry-After)
    lost: int = 0              # valid requests with no complete answer and no refusal
    server_errors: int = 0     # any 5xx, of any request
    bad_sent: int = 0
    bad_4xx: int = 0
    oversized_sent: int = 0
    oversized_413: int = 0
    disconnects: int = 0
    greedy_checked: int = 0
    greedy_mismatch: int = 0   # answers whose tokens differ from the solo answer (judged afterwards)
    mismatches: list[dict] = field(default_factory=list)
    retry_after: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


def body_for(rng: random.Random, model: str, greedy: bool) -> tuple[str, dict, tuple | None]:
    """A valid request: (path, body, key of its solo answer when greedy)."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    i = rng.randrange(len(PROMPTS))
    body: dict = {"model": model, "stream": stream, "max_tokens": GREEDY_TOKENS if greedy else rng.choice([8, 24])}
    if greedy:  # the exact tokens, to compare with the solo answer and to judge a difference offline
        body["return_token_ids"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[i]}]
    else:
        body["prompt"] = PROMPTS[i]
    if not greedy:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**64))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, body, ((path, i) if greedy else None)


@dataclass
class Answer:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)

    def take(self, obj: dict) -> None:
        """Token ids of a response or chunk (`return_token_ids`: chat puts the prompt's at the top)."""
        self.prompt_ids = obj.get("prompt_token_ids") or self.prompt_ids
        for c in obj.get("choices", []):
            self.prompt_ids = c.get("prompt_token_ids") or self.prompt_ids
            self.token_ids += c.get("token_ids") or []


async def send_valid(http: httpx.AsyncClient, url: str, path: str, body: dict) -> tuple[str, Answer | str, float]:
    """(outcome, answer or error text, seconds); outcome is answered / refused / lost:<why> / 5xx."""
    start = time.perf_counter()
    try:
        if not body["stream"]:
            r = await http.post(url + path, json=body)
            if r.status_code in (429, 503):
                return f"refused:{r.headers.get('retry-after', '')}", "", 0.0
            if r.status_code >= 500:
                return "5xx", r.text[:200], 0.0
            if r.status_code != 200:
                return f"lost:status {r.status_code}", r.text[:200], 0.0
            obj = r.json()
            choice = obj["choices"][0]
            answer = Answer(choice["message"]["content"] if "message" in choice else choice["text"])
            answer.take(obj)
            if choice["finish_reason"] not in ("stop", "length"):
                return "lost:no finish_reason", "", 0.0
            return "answered", answer, time.perf_counter() - start
        async with http.stream("POST", url + path, json=body) as r:
            if r.status_code in (429, 503):
                return f"refused:{r.headers.get('retry-after', '')}", "", 0.0
            if r.status_code != 200:
                await r.aread()
                return ("5xx" if r.status_code >= 500 else f"lost:status {r.status_code}"), r.text[:200], 0.0
            text, finish, done, answer = "", None, False, Answer()
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[5:])
                if "error" in obj:
                    return "5xx", json.dumps(obj)[:200], 0.0
                answer.take(obj)
                for c in obj["choices"]:
                    text += c["delta"].get("content") or "" if "delta" in c else c["text"]
                    finish = c["finish_reason"] or finish
            if not done or finish not in ("stop", "length"):
                return "lost:truncated stream", text[-80:], 0.0
            answer.text = text
            return "answered", answer, time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        return f"lost:{type(exc).__name__}", str(exc)[:200], 0.0


async def send_bad(http: httpx.AsyncClient, url: str, raw: bytes) -> int:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = await http.post(url + path, content=raw, headers={"Content-Type": "application/json"})
    err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
    return r.status_code if set(err) == {"message", "type", "param", "code"} else -r.status_code


async def send_oversized(http: httpx.AsyncClient, url: str, size: int) -> str:
    raw = b'{"model": "M", "prompt": "' + b"a" * size + b'"}'
    try:
        r = await http.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        return str(r.status_code)
    except httpx.HTTPError as exc:  # the server may answer 413 and close before the body is sent
        return f"reset:{type(exc).__name__}"


async def send_and_drop(http: httpx.AsyncClient, url: str, path: str, body: dict, chunks: int) -> bool:
    """Open a stream, read a few chunks, close it. True when the stream was opened."""
    async with http.stream("POST", url + path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return False
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= chunks:
                    break
    return True


# ---- the load -------------------------------------------------------------------------------------------

async def client_loop(cid: int, url: str, model: str, args: argparse.Namespace, stop_at: float,
                      budget: list[int], solo: dict, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + cid)
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(timeout=timeout) as http:
        while time.monotonic() < stop_at and budget[0] > 0:
            budget[0] -= 1
            tally.sent += 1
            roll = rng.random()
            if roll < args.bad:
                tally.bad_sent += 1
                status = await send_bad(http, url, rng.choice(BAD_BODIES).replace(b'"M"', json.dumps(model).encode()))
                if 400 <= status < 500:
                    tally.bad_4xx += 1
                else:
                    tally.server_errors += abs(status) >= 500
                    tally.problem(f"bad request answered {status}")
                continue
            roll -= args.bad
            if roll < args.oversized:
                tally.oversized_sent += 1
                got = await send_oversized(http, url, args.max_body_bytes + 1024)
                tally.oversized_413 += got == "413" or got.startswith("reset")
                tally.server_errors += got.isdigit() and int(got) >= 500
                continue
            roll -= args.oversized
            path, body, key = body_for(rng, model, greedy=rng.random() < 0.6)
            if roll < args.disconnect:
                tally.disconnects += await send_and_drop(http, url, path, body, rng.randint(1, 3))
                continue
            outcome, got, seconds = await send_valid(http, url, path, body)
            text = got if isinstance(got, str) else got.text
            if outcome == "answered":
                tally.answered += 1
                tally.latencies.append(seconds)
                if key is not None:
                    tally.greedy_checked += 1
                    want = solo[key]
                    if got.token_ids != want.token_ids or got.text != want.text:
                        tally.greedy_mismatch += 1
                        tally.mismatches.append({"request": list(key), "prompt_ids": want.prompt_ids,
                                                 "solo": want.token_ids, "got": got.token_ids,
                                                 "solo_text": want.text, "got_text": got.text})
            elif outcome.startswith("refused"):
                tally.refused += 1
                ra = outcome.split(":", 1)[1]
                if ra.isdigit():
                    tally.retry_after.append(int(ra))
                else:
                    tally.problem("refusal without Retry-After")
                await asyncio.sleep(0.2)
            elif outcome == "5xx":
                tally.server_errors += 1
                tally.lost += 1
                tally.problem(f"5xx: {text}")
            else:
                tally.lost += 1
                tally.problem(f"{outcome}: {text}")


async def run_load(url: str, model: str, args: argparse.Namespace, seconds: float, max_requests: int,
                   solo: dict) -> Tally:
    tally = Tally()
    stop_at = time.monotonic() + seconds
    budget = [max_requests]
    loops = [client_loop(c, url, model, args, stop_at, budget, solo, tally) for c in range(args.clients)]
    # Bounded: the loops stop sending at stop_at; the requests in flight then have request_timeout.
    await asyncio.wait_for(asyncio.gather(*loops), seconds + args.request_timeout + 30)
    return tally


async def solo_answers(url: str, model: str) -> dict:
    """Each greedy prompt's answer with nothing else running, per endpoint."""
    out = {}
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(len(PROMPTS)):
            for path in ("/v1/chat/completions", "/v1/completions"):
                body = {"model": model, "max_tokens": GREEDY_TOKENS, "stream": False, "return_token_ids": True}
                body.update({"messages": [{"role": "user", "content": PROMPTS[i]}]} if "chat" in path
                            else {"prompt": PROMPTS[i]})
                outcome, answer, _ = await send_valid(http, url, path, body)
                if outcome != "answered" or not answer.prompt_ids:
                    raise SystemExit(f"solo request failed: {outcome} {answer}")
                out[(path, i)] = answer
    return out


def wait_drained(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health", timeout=10).json()
        if (health["running"] == 0 and health["queued"] == 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.25)


def outcome_counts(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for prefix in ("medusa_responses_total{", "medusa_failures_total{"):
            if line.startswith(prefix):
                label = line.split('"')[1]
                out[prefix.split("_total")[0].removeprefix("medusa_") + ":" + label] = float(line.split()[-1])
    return out


# ---- greedy mismatches, judged offline -------------------------------------------------------------------

def judge_mismatches(args: argparse.Namespace, mismatches: list[dict], solo: dict) -> dict:
    """Classify each greedy mismatch as a near-tie or a defect with one plain forward of the same model over
    prompt + the common prefix of the two answers, and measure the batch-shape rounding itself."""
    import torch

    from medusa.decoding.hardware import resolve_dtype
    from medusa.decoding.model import load_target

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
    model, flags = platform.processor(), ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        flags = next(line for line in text.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    return {"model": model, "avx512_bf16": "avx512_bf16" in flags.split(), "cores": os.cpu_count()}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(args, Path(tmp))
        try:
            server.wait_ready(args.startup_timeout)
            model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            solo = asyncio.run(solo_answers(server.url, model))
            warm = asyncio.run(run_load(server.url, model, args, args.warmup, args.max_requests, solo))
            wait_drained(server.url)
            time.sleep(1.0)
            rss_before = server.rss_mb()
            start = time.monotonic()
            tally = asyncio.run(run_load(server.url, model, args, args.duration, args.max_requests, solo))
            elapsed = time.monotonic() - start
            health = wait_drained(server.url)
            time.sleep(1.0)
            rss_after = server.rss_mb()
            metrics = outcome_counts(server.url)
        finally:
            server.stop()
        log_tail = server.log_path.read_text()[-3000:]
    greedy = judge_mismatches(args, warm.mismatches + tally.mismatches, solo)
    report = build_report(args, tally, warm, elapsed, health, rss_before, rss_after, metrics, log_tail, greedy)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    return 0 if report["verdict"]["pass"] else 1


def build_report(args: argparse.Namespace, t: Tally, warm: Tally, elapsed: float, health: dict,
                 rss_before: float, rss_after: float, metrics: dict, log_tail: str, greedy: dict) -> dict:
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
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
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


if __name__ == "__main__":
    raise SystemExit(main())
