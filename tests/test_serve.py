"""The server end to end: real `openai` client against uvicorn on a free loopback port, tiny random model."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import openai
import pytest

from conftest import random_heads, tiny_model
from medusa.serve.app import create_app
from medusa.serve.config import ServeConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CLIENT_TIMEOUT = 60
VOCAB = 49152  # the embedded tokenizer's vocabulary, so real text round-trips


def embedded_tokenizer():
    from transformers import AutoTokenizer

    from medusa.decoding.target.model import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


def tiny_runtime(tokenizer, seed: int = 0, heads: bool = True, device: str = "cpu"):
    """A Runtime over a tiny random Llama with the embedded tokenizer and random Medusa heads."""
    from medusa.decoding.engine import Engine
    from medusa.runtime.runtime import Runtime, eos_ids
    from medusa.decoding.target.transformer import Transformer

    model = tiny_model("llama", seed=seed, vocab=VOCAB).to(device)
    model.config.eos_token_id = tokenizer.eos_token_id
    medusa_heads = random_heads(model, seed=seed) if heads else None
    transformer = Transformer(model)
    engine = Engine(transformer, eos_ids(model, tokenizer))
    return Runtime(model, tokenizer, transformer, engine, medusa_heads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(app, timeout: float = 30.0) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread, configured as `medusa serve` configures it (connection
    deadlines included); yields the base URL; stops the server afterwards."""
    import uvicorn

    from medusa.serve.connection import uvicorn_config

    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, app.state.server.cfg, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)


def serve(rt, **overrides):
    base = dict(dtype="fp32", max_batch=8, max_context=512, default_max_tokens=16)
    return running_server(create_app(ServeConfig(**{**base, **overrides}), rt))


# Dynamic policy with low watermarks: load changes during the tests switch between Medusa and plain.
# Speculation comes back at 4 rows, so the tail of many concurrent streams has several speculative steps
# after each batch bucket's plain probe step (back at 1 row, the last stream's probe could take them all).
DYNAMIC_POLICY = {"mode": "dynamic", "high_watermark": 6, "low_watermark": 4, "min_tau": 1.0,
                  "trees": {1: "chain-2", 2: "tree-16", 4: "tree-8"}}


@pytest.fixture(scope="module")
def server(rt):
    with serve(rt, policy=DYNAMIC_POLICY, max_queue=64) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT)


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def alone(rt, ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """Text, token count and finish reason of plain greedy decoding of one prompt on its own."""
    out = rt.engine.generate([ids], max_tokens).outputs[0]
    text = rt.tokenizer.decode(out.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text, len(out.tokens), out.reason


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_models_health_metrics(server):
    assert model_name(server) == "default"
    health = httpx.get(server + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["running"] == 0
    metrics = httpx.get(server + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "medusa_requests_running" in metrics.text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_decoding_alone(server, rt, tokenizer, stream):
    c = client(server)
    text = "Tell me about the sea."
    want, n, _ = alone(rt, chat_ids(tokenizer, text), 20)
    kw = dict(model="default", messages=[{"role": "user", "content": text}], max_tokens=20)
    if stream:
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        usage = chunks[-1].usage
    else:
        r = c.chat.completions.create(**kw)
        got, usage = r.choices[0].message.content, r.usage
        assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert got == want
    assert usage.completion_tokens == n == 20
    assert usage.prompt_tokens == len(chat_ids(tokenizer, text))


@pytest.mark.parametrize("stream", [False, True])
def test_completion_matches_decoding_alone(server, rt, tokenizer, stream):
    c = client(server)
    prompt = "The capital of France is"
    want, n, _ = alone(rt, tokenizer(prompt)["input_ids"], 12)
    if stream:
        chunks = list(c.completions.create(model="default", prompt=prompt, max_tokens=12, stream=True))
        got = "".join(ch.choices[0].text for ch in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        r = c.completions.create(model="default", prompt=prompt, max_tokens=12)
        got = r.choices[0].text
        assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert got == want


def test_many_concurrent_streams_match_decoding_alone(server, rt, tokenizer):
    """36 streaming clients with mixed prompts and lengths, more than the 8 batch rows, every fourth one
    sampling: all complete, and each greedy one equals its prompt decoded alone (nothing lost,
    duplicated or interleaved across requests, sampled neighbours in the batch change nothing)."""
    check_concurrent_streams(server, rt, tokenizer, 36)


def check_concurrent_streams(server: str, rt, tokenizer, count: int) -> None:
    jobs = [(f"Request {i}: write about topic number {i * 7 % 13}" + " please" * (i % 5), 4 + (i * 11) % 29,
             1.0 if i % 4 == 3 else 0.0) for i in range(count)]
    expected = [alone(rt, tokenizer(p)["input_ids"], m)[0] for p, m, _ in jobs]

    async def one(c: openai.AsyncOpenAI, prompt: str, max_tokens: int, temperature: float) -> tuple[str, int]:
        stream = await c.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, stream=True,
                                            temperature=temperature, seed=5, stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0,
                                      timeout=CLIENT_TIMEOUT) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, *job) for job in jobs)), 120)

    got = asyncio.run(main())
    assert [n for _, n in got] == [m for _, m, _ in jobs]  # no EOS in this model's outputs: full lengths
    greedy = [i for i, job in enumerate(jobs) if job[2] == 0]
    assert [got[i][0] for i in greedy] == [expected[i] for i in greedy]
    sampled = [i for i, job in enumerate(jobs) if job[2] > 0]
    assert sum(got[i][0] != expected[i] for i in sampled) >= len(sampled) - 1
    assert httpx.get(server + "/health", timeout=10).json()["running"] == 0


def test_dynamic_policy_switches_by_load(rt, tokenizer):
    """Under load past the high watermark the dynamic policy decodes plainly, and once the load falls to
    the low watermark it speculates again. The engine's first step waits until every request is queued,
    so the load each step sees does not depend on how fast the clients connect: 16 short requests and one
    long one, which runs on alone (load 1) long after the others are done."""
    jobs = [(f"Short request {i} about topic {i * 5 % 11}", 2 + i % 4) for i in range(16)]
    jobs.append(("One long request that keeps going", 60))
    app = create_app(ServeConfig(dtype="fp32", max_batch=8, max_context=512, max_queue=64,
                                 policy=DYNAMIC_POLICY), rt)
    sched = app.state.server.scheduler
    submit, decide = sched.admission.submit, sched.policy.decide
    submitted, everyone_queued, decisions = [], threading.Event(), []

    def counting_submit(*reqs):
        submit(*reqs)
        submitted.extend(reqs)
        if len(submitted) == len(jobs):
            everyone_queued.set()

    def recording_decide(running: int, queued: int):
        if not decisions:
            assert everyone_queued.wait(CLIENT_TIMEOUT), "not every request reached the queue"
            with sched.admission.cond:  # what is queued now: the scheduler counted before the last arrived
                queued = len(sched.admission)
        decision = decide(running, queued)
        decisions.append((running + queued, decision))
        return decision

    sched.admission.submit, sched.policy.decide = counting_submit, recording_decide

    async def one(c: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> int:
        r = await c.completions.create(model="default", prompt=prompt, max_tokens=max_tokens)
        return r.usage.completion_tokens

    async def main() -> list[int]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                      timeout=CLIENT_TIMEOUT) as c:
            return await asyncio.gather(*(one(c, *job) for job in jobs))

    with running_server(app) as url:
        assert asyncio.run(main()) == [m for _, m in jobs]
        metrics = httpx.get(url + "/metrics", timeout=10).text
    high, low = DYNAMIC_POLICY["high_watermark"], DYNAMIC_POLICY["low_watermark"]
    by_load = [i for i, (load, d) in enumerate(decisions) if d.mode == "plain" and d.reason.startswith("load")]
    assert by_load and by_load[0] == 0 and decisions[0][0] >= high, decisions[:3]  # switched off by load
    back_on = [i for i, (_, d) in enumerate(decisions) if d.mode == "heads" and i > by_load[-1]]
    assert back_on, "speculation never came back once the load fell"
    assert decisions[by_load[-1] + 1][0] <= low  # switched back on at the low watermark, not before
    assert all(load >= low for load, _ in decisions[:by_load[-1] + 1])
    assert _metric(metrics, 'medusa_steps_total{mode="plain"}') >= len(by_load)
    assert _metric(metrics, 'medusa_steps_total{mode="heads"}') == len(
        [d for _, d in decisions if d.mode == "heads"]) > 0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_and_is_trimmed(server, rt, tokenizer, stream):
    prompt = "List some colours:"
    full, _, _ = alone(rt, tokenizer(prompt)["input_ids"], 30)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "the reference output is too short to cut"
    want = full[: full.index(stop)]
    c = client(server)
    kw = dict(model="default", prompt=prompt, max_tokens=30, stop=[stop, "\x00never"])
    if stream:
        chunks = list(c.completions.create(stream=True, **kw))
        got, reason = "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
    else:
        r = c.completions.create(**kw)
        got, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (got, reason) == (want, "stop")


def test_seeded_sampling_is_reproducible(rt, tokenizer):
    # A fixed speculation mode: under the dynamic policy the step modes (and so the random numbers a row
    # draws) depend on load and on the acceptance gate's history, which the shared server's tests change.
    with serve(rt, policy={"mode": "heads", "trees": {1: "chain-2"}}) as url:
        c = client(url)
        kw = dict(model="default", prompt="Roll the dice:", max_tokens=6, temperature=0.9, top_p=0.95)
        a = c.completions.create(seed=7, **kw).choices[0].text
        b = c.completions.create(seed=7, **kw).choices[0].text
        other = c.completions.create(seed=8, **kw).choices[0].text
    greedy = alone(rt, tokenizer("Roll the dice:")["input_ids"], 6)[0]
    assert a == b and a
    assert other != a and greedy not in (a, other)


BAD = [
    # (path, body (bytes are sent as-is), status, param, words in the message)
    ("/v1/chat/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/chat/completions", {"model": "default"}, 400, "messages", "missing"),
    ("/v1/chat/completions", {"model": "default", "messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role", "role"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "frobnicate": 1}, 400, "frobnicate", "unknown field"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": -5}, 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": "12"}, 400, "max_tokens",
     "integer"),
    ("/v1/completions", {"model": "default", "prompt": "x", "temperature": -1}, 400, "temperature",
     "greater than or equal to 0"),
    ("/v1/completions", {"model": "default", "prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"model": "default", "prompt": "x", "n": 17}, 400, "n", "less than or equal to 16"),
    # Fields this server does not implement: refused, naming the field, at values that change the output.
    ("/v1/completions", {"model": "default", "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty",
     "only 0"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "frequency_penalty": -1}, 400, "frequency_penalty", "only 0"),
    ("/v1/completions", {"model": "default", "prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias",
     "empty object"),
    ("/v1/completions", {"model": "default", "prompt": "x", "echo": True}, 400, "echo", "only false"),
    ("/v1/completions", {"model": "default", "prompt": "x", "best_of": 3}, 400, "best_of", "best_of = n"),
    ("/v1/completions", {"model": "default", "prompt": "x", "logprobs": 21}, 400, "logprobs",
     "less than or equal to 20"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs", "logprobs: true"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "empty list"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format", "text"),
    ("/v1/completions", {"model": "default", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "at most 4"),
    ("/v1/completions", {"model": "default", "prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"model": "default", "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"model": "default", "prompt": [1, 99999999]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"model": "default", "prompt": "word " * 600}, 400, "prompt", "context"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 600}, 400, "max_tokens", "context"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model", "does not exist"),
    ("/v1/nowhere", {}, 404, None, "Not Found"),
    # Bounds: a seed torch cannot take once failed every request decoding at that moment.
    ("/v1/completions", {"model": "default", "prompt": "x", "seed": 2**64}, 400, "seed", "less than or equal"),
    ("/v1/completions", {"model": "default", "prompt": "x", "seed": -1}, 400, "seed", "greater than or equal"),
    ("/v1/completions", {"model": "default", "prompt": "x", "top_k": -1}, 400, "top_k", "greater than or equal"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 2**70}, 400, "max_tokens",
     "less than or equal"),
    ("/v1/completions", {"model": "default", "prompt": [5, -1]}, 400, "prompt.1", "greater than or equal"),
    ("/v1/completions", {"model": "default", "prompt": "x", "stop": ""}, 400, "stop", "at least 1"),
    ("/v1/completions", b'{"model": "default", "prompt": "x", "temperature": NaN}', 400, None, "not valid JSON"),
    ("/v1/completions", b'{"model": "default", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", 400, None,
     "not valid JSON"),
    # Nesting: deep enough for the parser's recursion limit, and deep but within it.
    ("/v1/completions", b"[" * 2000 + b"]" * 2000, 400, None, "nested too deeply"),
    ("/v1/chat/completions", b'{"model": "default", "messages": ' + b"[" * 200 + b"]" * 200 + b"}", 400,
     "messages" + ".0" * 15, "nested too deeply"),
    # Text that is not Unicode (a lone surrogate escape), in a prompt, a message and a field name.
    ("/v1/completions", b'{"model": "default", "prompt": "a\\ud800b"}', 400, "prompt", "surrogate"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": "\\udfff"}]}',
     400, "messages.0.content", "surrogate"),
    ("/v1/completions", b'{"model": "default", "prompt": "x", "\\ud800": 1}', 400, None, "surrogate"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD)
def test_bad_input_gets_openai_error(server, path, body, status, param, words):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words.lower() in err["message"].lower(), err["message"]
    assert err["param"] == param
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"  # still serving


def test_context_error_code(server):
    r = httpx.post(server + "/v1/completions", json={"model": "default", "prompt": "word " * 600}, timeout=30)
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_body_over_the_limit_is_413(rt):
    with serve(rt, max_body_bytes=4096) as url:
        big = json.dumps({"model": "default", "prompt": "word " * 2000}).encode()
        r = httpx.post(url + "/v1/completions", content=big, headers={"Content-Type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit holds while reading
            for _ in range(10):
                yield b" " * 1000

        r = httpx.post(url + "/v1/completions", content=chunked(), headers={"Content-Type": "application/json"},
                       timeout=30)
        assert r.status_code == 413
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, 'medusa_responses_total{outcome="too_large"}') == 2
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_bad_text_keeps_the_connection(server):
    """A lone surrogate used to end in a 500 and a reset keep-alive connection."""
    with httpx.Client(timeout=30) as http:
        def port(r: httpx.Response) -> int:
            return r.extensions["network_stream"].get_extra_info("client_addr")[1]

        bad = http.post(server + "/v1/completions", content=b'{"model": "default", "prompt": "\\ud800"}',
                        headers={"Content-Type": "application/json"})
        good = http.post(server + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
        assert bad.status_code == 400 and good.status_code == 200
        assert port(bad) == port(good)


def test_internal_error_names_a_request_id_not_the_exception(rt, monkeypatch):
    app = create_app(ServeConfig(dtype="fp32", max_batch=2, max_context=256), rt)
    server = app.state.server

    def broken(raw: bytes, chat: bool):
        raise RuntimeError("secret internals /home/x/tokenizer.py")

    monkeypatch.setattr(server, "prepare", broken)
    with running_server(app) as url, httpx.Client(timeout=30) as http:
        r = http.post(url + "/v1/completions", json={"model": "default", "prompt": "hi"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "secret" not in err["message"]
        assert r.headers["x-request-id"] in err["message"]
        monkeypatch.undo()
        again = http.post(url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
        assert again.status_code == 200 and again.headers["x-request-id"] != r.headers["x-request-id"]
        metrics = http.get(url + "/metrics").text
        assert _metric(metrics, 'medusa_responses_total{outcome="server_error"}') == 1
        assert _metric(metrics, 'medusa_responses_total{outcome="ok"}') == 1


def test_prompt_is_prepared_off_the_event_loop(rt, monkeypatch):
    app = create_app(ServeConfig(dtype="fp32", max_batch=2, max_context=256), rt)
    server = app.state.server
    prepare, loops = server.prepare, []

    def spy(raw: bytes, chat: bool):
        try:
            loops.append(asyncio.get_running_loop())
        except RuntimeError:
            loops.append(None)
        return prepare(raw, chat)

    monkeypatch.setattr(server, "prepare", spy)
    with running_server(app) as url:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(url + path, json={"model": "default", "max_tokens": 2, **body}, timeout=30)
            assert r.status_code == 200
    assert loops == [None, None]  # tokenised and templated where no event loop runs


@pytest.mark.parametrize("docs", [False, True])
def test_docs_endpoints_only_when_enabled(rt, docs):
    app = create_app(ServeConfig(dtype="fp32", max_batch=2, max_context=256, docs=docs), rt)
    with running_server(app) as url:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(url + path, timeout=10).status_code == (200 if docs else 404)
    schema = app.openapi()  # the schema itself is always there for tools and tests
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest")
    seed = schema["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": 2**64 - 1} in seed


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _running(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["running"]


def test_overload_gets_429_and_disconnect_frees_the_slot(rt):
    with serve(rt, max_batch=1, max_queue=0, max_context=4096, policy={"mode": "plain"}) as url:
        body = {"model": "default", "prompt": "Count forever:", "max_tokens": 4000, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as first:
                lines = first.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                assert _running(url) == 1
                r = http.post(url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 429 and r.headers["Retry-After"]
                assert r.json()["error"]["code"] == "queue_full"
            # The stream is closed mid-generation: the row must be freed.
            assert _wait(lambda: _running(url) == 0), "the disconnected request still holds its row"
            r = http.post(url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, "medusa_requests_running") == 0
        assert _metric(metrics, 'medusa_requests_rejected_total{cause="queue_full"}') == 1
        assert _metric(metrics, 'medusa_requests_total{reason="cancelled"}') == 1


def test_queue_timeout_is_a_clear_503(rt):
    with serve(rt, max_batch=1, max_queue=4, queue_timeout_s=0.3, max_context=4096,
               policy={"mode": "plain"}) as url:
        body = {"model": "default", "prompt": "Count forever:", "max_tokens": 4000, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as first:
                lines = first.iter_lines()  # kept referenced: dropping the iterator closes the stream
                assert next(line for line in lines if line.startswith("data:"))
                r = http.post(url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and "waited more than 0.3 s" in r.json()["error"]["message"]
            assert _wait(lambda: _running(url) == 0)


def test_non_streaming_disconnect_frees_the_slot(rt):
    with serve(rt, max_batch=2, max_context=4096, policy={"mode": "plain"}) as url:
        body = {"model": "default", "prompt": "Count forever:", "max_tokens": 4000}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
        finished = 'medusa_requests_total{reason="%s"}'

        def done(reason: str) -> float:
            text = httpx.get(url + "/metrics", timeout=10).text
            return _metric(text, finished % reason) if finished % reason in text else 0.0

        # Ended by the disconnect, not by running out its 4000 tokens: the row was cancelled.
        assert _wait(lambda: done("cancelled") + done("length") > 0, timeout=120)
        assert (done("cancelled"), done("length")) == (1, 0)
        assert _running(url) == 0


def test_cli_serves_a_model_directory(tmp_path, tokenizer):
    """`medusa serve --model DIR` in its own process, answering the openai client."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "medusa.cli", "serve", "--model", str(tmp_path), "--heads", "none",
           "--dtype", "fp32", "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None
        assert _wait(up, timeout=90) and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        name = model_name(url)
        r = client(url).chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("trees, words", [({1: "tree-7"}, "tree-7"), ({1: "chain-99"}, "chain depth")])
def test_bad_tree_name_fails_at_startup(rt, trees, words):
    from medusa.errors import MedusaError

    with pytest.raises(MedusaError, match="policy.trees") as exc:
        create_app(ServeConfig(dtype="fp32", policy={"trees": trees}), rt)
    assert words in str(exc.value)


def test_cli_bad_config_is_one_line_error(tmp_path, capsys):
    from medusa.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("port: 8000\npolicy:\n  high_watermark: 2\n  low_watermark: 5\n  bogus: 1\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "policy.bogus" in err and "Traceback" not in err


def test_draft_speculation_matches_decoding_alone(rt, tokenizer):
    """`draft: layers:1` (the target's first layer as draft model) behind the server, fixed draft mode."""
    prompts = [("Name a fruit", 10), ("Describe a quiet harbour town at dusk", 17), ("Hi", 5)]
    with serve(rt, draft="layers:1", draft_k=3, policy={"mode": "draft"}) as url:
        c = client(url)
        got = [c.completions.create(model="default", prompt=p, max_tokens=m).choices[0].text for p, m in prompts]
        steps = _metric(httpx.get(url + "/metrics", timeout=10).text, 'medusa_steps_total{mode="draft"}')
    assert got == [alone(rt, tokenizer(p)["input_ids"], m)[0] for p, m in prompts]
    assert steps > 0


def test_prefill_budget_spreads_admission_over_steps(rt):
    """Waiting prompts are prefilled a budget's worth per step boundary, in arrival order: short ones whole,
    a long one in chunks between the running rows' steps, which never wait for it."""
    from medusa.serve.request import Request

    server = create_app(ServeConfig(dtype="fp32", max_batch=8, max_context=256, prefill_tokens_per_step=64,
                                    prefix_cache=False, policy={"mode": "plain"}), rt).state.server
    sched = server.scheduler
    sched.batch = sched.new_batch()
    lengths = [20, 20, 20, 5, 150, 10]  # prompts sharing prefixes: the prefix cache is off to count whole chunks
    events = {n: [] for n in lengths}
    for n in lengths:
        sched.admission.submit(Request(list(range(1, n + 1)), 40, events[n].append))
    rounds = []
    while sched.admission or sched.prefilling:
        with sched.admission.cond:  # a boundary's budget: 64 tokens less the decode pass's (1 per running row)
            whole, chunked = sched._take_admissible(sched.budget.tokens(sched.batch.n, sched.width))
        sched.admission.queue.extendleft(reversed(whole + ([chunked] if chunked else [])))
        got_token = len(events[20])
        sched.boundary()
        rounds.append([len(r.prompt) for r in whole] or [sched.batch.pending.done if sched.batch.pending else 150])
        assert len(events[20]) > got_token  # the running rows got tokens at every boundary
    # Padded cost = rows x longest prompt <= the budget; the 150-token prompt goes in chunks of 64 - rows.
    assert rounds == [[20, 20, 20], [5], [60], [120], [150], [10]]
    assert sched.batch.n == len(lengths)


def test_a_long_prompt_on_an_idle_server_is_prefilled_in_chunks_of_its_own(rt):
    """No row decodes: the chunks go in passes of their own, then the request runs like any other."""
    from medusa.serve.request import Request

    server = create_app(ServeConfig(dtype="fp32", max_batch=4, max_context=256, prefill_tokens_per_step=64,
                                    policy={"mode": "plain"}), rt).state.server
    sched = server.scheduler
    sched.batch = sched.new_batch()
    prompt = [(7 * i) % 500 + 1 for i in range(150)]
    events = []
    sched.admission.submit(Request(prompt, 6, events.append))
    chunks = []
    while sched.prefilling is not None or sched.admission:
        sched.boundary()
        chunks.append(sched.batch.pending.done if sched.batch.pending else len(prompt))
    assert chunks == [64, 128, 150] and sched.batch.n == 1 and events[0].kind == "delta"
    while sched.running:
        sched.boundary()
    assert [e.kind for e in events][-1] == "done"
    assert sum(len(e.token_ids) for e in events) == 6
    assert [t for e in events for t in e.token_ids] == rt.engine.generate([prompt], 6).outputs[0].tokens


def test_auto_prefill_budget_follows_the_measured_passes():
    from medusa.serve.prefill import MAX_CHUNK, MIN_CHUNK, PrefillBudget

    budget = PrefillBudget("auto", stall=1.0)
    assert budget.tokens(0, 8) == MAX_CHUNK  # nothing decodes: nothing to stall
    assert budget.tokens(2, 8) == 16  # nothing measured: as many tokens as the decode pass
    budget.observe(0.020)  # a decode step alone
    budget.observe(0.084, 64)  # one carrying 64 prompt tokens: 1 ms each
    assert budget.tokens(2, 8) == 20  # prompt tokens that double the decode pass
    curve = lambda b, t: 10.0 * b + 0.5 * t  # noqa: E731  (ms: 0.5 per token, 10 per row)
    assert PrefillBudget("auto", stall=2.0, curve=curve).tokens(3, 4) == int(2 * 32 / (42 / 64))
    budget.observe(0.0001)
    assert budget.tokens(2, 8) == MIN_CHUNK
    fixed = PrefillBudget(100)
    assert (fixed.tokens(0, 8), fixed.tokens(4, 8), fixed.tokens(40, 8)) == (100, 68, MIN_CHUNK)


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout bounds the wait)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_half_sent_requests_are_closed_and_dropped_bodies_are_cancellations(rt):
    """A socket that stops inside its headers is closed; one that stops inside its body gets 408 and is
    closed; one that disconnects mid-body is a cancelled request (one INFO line), never a server error."""
    with serve(rt, header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=0.5) as url:
        with _raw(url) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            assert _read_all(sock) == b""  # closed by the server, without a response
        with _raw(url) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"pro")
            reply = _read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply
        with _raw(url) as sock:  # keep-alive: idle after a complete request, then closed
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _read_all(sock).startswith(b"HTTP/1.1 200")
        before = _metric(httpx.get(url + "/metrics", timeout=10).text, 'medusa_responses_total{outcome="cancelled"}')
        with _raw(url) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\"")
        assert _wait(lambda: _metric(httpx.get(url + "/metrics", timeout=10).text,
                                     'medusa_responses_total{outcome="cancelled"}') == before + 1, 60)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, 'medusa_responses_total{outcome="server_error"}') == 0
        assert _metric(metrics, 'medusa_responses_total{outcome="client_timeout"}') == 1


def test_head_health(server):
    r = httpx.head(server + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b""


def test_a_cut_inside_a_character_drops_its_bytes(tokenizer):
    """max_tokens can end a request inside a multi-byte character: the text ends before it, not with U+FFFD."""
    from medusa.serve.detokenize import IncrementalText

    ids = tokenizer("Hi \U0001F600", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # the emoji's bytes span tokens here
    assert IncrementalText().extend(tokenizer, ids[:-1], final=True) == "Hi "
    assert IncrementalText().extend(tokenizer, ids, final=True) == "Hi \U0001F600"
