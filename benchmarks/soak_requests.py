"""The soak's traffic: one request of each kind (valid, invalid, oversized, dropped mid-stream), the
client loops that mix them for a fixed time, and the tally of what came back.

Valid requests are greedy (compared token for token with each prompt's answer alone) or sampled; a valid
request either gets a complete answer, an explicit refusal (429/503 with Retry-After), or counts as lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from server_process import counter

PROMPTS = ["Give me three tips for staying focused.", "What is the capital of Italy?",
           "Write a haiku about autumn rain.", "Explain what a hash table is in one paragraph."]
GREEDY_TOKENS = 16
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
    """The server's response outcomes and internal failures, as `responses:<outcome>` / `failures:<stage>`."""
    return {f"{kind}:{label}": value for kind in ("responses", "failures")
            for label, value in counter(url, f"medusa_{kind}_total").items()}
