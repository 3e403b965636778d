"""One bad request never harms another: faults injected into one row of a running batch, into a prefill,
into the proposer and into the engine itself, on the tiny random model behind the real server."""

from __future__ import annotations

import queue
import time

import httpx
import pytest
import torch

from medusa.decoding.proposers import StaticProposer
from medusa.decoding.sampling import SamplingParams
from medusa.serve.app import create_app
from medusa.serve.config import ServeConfig
from medusa.serve.request import Event, Request
from test_serve import _metric, _wait, running_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPTS = ["The sea is", "Once upon a time there was", "Numbers: one two", "Write a short poem about rain"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def solo(rt, tokenizer) -> dict[str, list[int]]:
    """Each prompt's greedy tokens decoded alone: what its row must produce whatever its neighbours do."""
    out = {}
    for p in PROMPTS:
        out[p] = rt.engine.generate([tokenizer(p)["input_ids"]], MAX_TOKENS).outputs[0].tokens
    return out


def app_for(rt, **overrides):
    base = dict(dtype="fp32", max_batch=8, max_context=256, default_max_tokens=16, policy={"mode": "plain"})
    return create_app(ServeConfig(**{**base, **overrides}), rt)


class Collector:
    """A request's events, as the scheduler hands them to the HTTP side."""

    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()

    def __call__(self, ev: Event) -> None:
        self.events.put(ev)

    def result(self, timeout: float = 60) -> Event:
        """The final event (done or error)."""
        while True:
            ev = self.events.get(timeout=timeout)
            if ev.kind in ("done", "error"):
                return ev


def submit_together(sched, reqs: list[Request]) -> None:
    """Queue the requests under the scheduler's lock, so they enter the batch in one prefill."""
    with sched.admission.cond:
        sched.admission.queue.extend(reqs)
        sched.admission.cond.notify_all()


def make(tokenizer, prompt: str, tag: str, sampling: SamplingParams | None = None) -> tuple[Request, Collector]:
    got = Collector()
    req = Request(tokenizer(prompt)["input_ids"], MAX_TOKENS, got, tag=tag)
    if sampling is not None:
        req.sampling = sampling
    return req, got


def test_fault_in_one_row_mid_decode_leaves_the_other_rows_unchanged(rt, tokenizer, solo, monkeypatch):
    app = app_for(rt)
    sched = app.state.server.scheduler
    detokenize = sched.outcomes.detokenize

    def faulty(req: Request, final: bool) -> bool:
        if req.tag == "poison" and len(req.tokens) >= 4:  # a fault that appears mid-way through the row
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return detokenize(req, final)

    monkeypatch.setattr(sched.outcomes, "detokenize", faulty)
    with running_server(app) as url:
        jobs = [make(tokenizer, p, "poison" if i == 1 else f"ok{i}") for i, p in enumerate(PROMPTS)]
        submit_together(sched, [r for r, _ in jobs])
        results = [got.result() for _, got in jobs]
        assert results[1].kind == "error" and results[1].status == 500
        assert "request id poison" in results[1].text and "injected" not in results[1].text
        for i, ((req, _), ev) in enumerate(zip(jobs, results)):
            if i != 1:
                assert ev.kind == "done" and ev.finish_reason == "length"
                assert req.tokens == solo[PROMPTS[i]]
        assert _wait(lambda: httpx.get(url + "/health", timeout=10).json()["running"] == 0)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, 'medusa_failures_total{stage="row"}') == 1
        assert _metric(metrics, 'medusa_failures_total{stage="engine"}') == 0
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_prefill_fault_refuses_only_the_request_that_causes_it(rt, tokenizer, solo, monkeypatch):
    """A prefill raising after it has written the batch (the rows added) is undone; the requests are retried
    one at a time and only the one that fails alone is refused."""
    app = app_for(rt)
    sched = app.state.server.scheduler
    add = sched.engine.add
    poison = tokenizer(PROMPTS[2])["input_ids"]

    def faulty(batch, ids, prompts, *args, **kwargs):
        out = add(batch, ids, prompts, *args, **kwargs)
        if poison in prompts:
            raise RuntimeError("injected prefill fault")
        return out

    monkeypatch.setattr(sched.engine, "add", faulty)
    with running_server(app):
        jobs = [make(tokenizer, p, f"r{i}") for i, p in enumerate(PROMPTS)]
        submit_together(sched, [r for r, _ in jobs])
        results = [got.result() for _, got in jobs]
    monkeypatch.undo()
    assert [ev.kind for ev in results] == ["done", "done", "error", "done"]
    assert results[2].status == 500 and "request id r2" in results[2].text
    assert [jobs[i][0].tokens for i in (0, 1, 3)] == [solo[PROMPTS[i]] for i in (0, 1, 3)]


def test_seed_torch_cannot_take_fails_only_its_request(rt, tokenizer, solo):
    """Below the HTTP validation (which refuses seeds outside [0, 2**64 - 1]): a seed torch raises on fails
    its own prefill, and the greedy rows prefilled with it decode as they do alone."""
    app = app_for(rt)
    sched = app.state.server.scheduler
    with running_server(app):
        jobs = [make(tokenizer, p, f"s{i}", SamplingParams(temperature=1.0, seed=2**70) if i == 0 else None)
                for i, p in enumerate(PROMPTS)]
        submit_together(sched, [r for r, _ in jobs])
        results = [got.result() for _, got in jobs]
    assert results[0].kind == "error" and results[0].status == 500
    assert [ev.kind for ev in results[1:]] == ["done"] * 3
    assert [req.tokens for req, _ in jobs[1:]] == [solo[p] for p in PROMPTS[1:]]


def test_huge_seed_over_http_is_a_400_and_running_streams_finish(rt, tokenizer, solo):
    app = app_for(rt)
    with running_server(app) as url, httpx.Client(timeout=60) as http:
        body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "stream": True}
        with http.stream("POST", url + "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            bad = http.post(url + "/v1/completions", json={"model": "default", "prompt": "x", "seed": 2**64,
                                                           "temperature": 1.0, "max_tokens": 3})
            edge = http.post(url + "/v1/completions", json={"model": "default", "prompt": "x",
                                                            "seed": 2**64 - 1, "temperature": 1.0, "max_tokens": 3})
            rest = [first] + [line for line in lines if line.startswith("data:")]
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
        assert edge.status_code == 200 and edge.json()["usage"]["completion_tokens"] == 3
        assert rest[-1] == "data: [DONE]"
        import json

        text = "".join(json.loads(line[5:])["choices"][0]["text"] for line in rest[:-1])
        want = rt.tokenizer.decode(solo[PROMPTS[0]], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert text == want


def test_proposer_failure_redoes_the_step_without_speculation(rt, tokenizer, solo):
    app = app_for(rt, policy={"mode": "heads", "trees": {1: "tree-8"}})
    server = app.state.server
    good = server.policy.heads["tree-8"]

    class Broken(StaticProposer):
        name, tree = "broken", good.tree

        def fill(self, batch):
            raise RuntimeError("proposer exploded")

    server.policy.heads["tree-8"] = Broken()
    with running_server(app) as url:
        got = [httpx.post(url + "/v1/completions", json={"model": "default", "prompt": p, "max_tokens": MAX_TOKENS},
                          timeout=60) for p in PROMPTS[:2]]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        health = httpx.get(url + "/health", timeout=10)
    want = [rt.tokenizer.decode(solo[p], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            for p in PROMPTS[:2]]
    assert [r.status_code for r in got] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in got] == want
    assert _metric(metrics, 'medusa_failures_total{stage="proposer"}') > 0
    assert _metric(metrics, 'medusa_failures_total{stage="engine"}') == 0
    assert health.status_code == 200


class BreakableEngine:
    """The real engine, except that its steps (`step`, `policy_step`) and `generate` raise while `broken` is set."""

    def __init__(self, engine):
        self.engine, self.broken = engine, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, *args, **kwargs):
        if self.broken:
            raise RuntimeError("CUDA error: secret device state")
        return self.engine.step(*args, **kwargs)

    def policy_step(self, *args, **kwargs):
        if self.broken:
            raise RuntimeError("CUDA error: secret device state")
        return self.engine.policy_step(*args, **kwargs)

    def generate(self, *args, **kwargs):
        if self.broken:
            raise RuntimeError("CUDA error: secret device state")
        return self.engine.generate(*args, **kwargs)


def test_engine_fault_fails_the_batch_and_health_says_so(rt):
    app = app_for(rt)
    sched = app.state.server.scheduler
    engine = sched.engine = BreakableEngine(sched.engine)
    body = {"model": "default", "prompt": "hi", "max_tokens": 4}
    with running_server(app) as url, httpx.Client(timeout=60) as http:
        engine.broken = True
        r = http.post(url + "/v1/completions", json=body)
        assert r.status_code == 500
        err = r.json()["error"]
        assert "secret" not in err["message"] and r.headers["x-request-id"] in err["message"]
        health = http.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        metrics = http.get(url + "/metrics").text
        assert _metric(metrics, "medusa_engine_healthy") == 0
        assert _metric(metrics, 'medusa_failures_total{stage="engine"}') == 1
        assert _metric(metrics, 'medusa_responses_total{outcome="server_error"}') == 1
        engine.broken = False
        # Recovery shows either way: the idle probe, or the next request's successful step.
        assert _wait(lambda: http.get(url + "/health").status_code == 200, timeout=30)
        r = http.post(url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert _metric(http.get(url + "/metrics").text, "medusa_engine_healthy") == 1


def test_retry_after_follows_the_drain_rate(rt):
    sched = app_for(rt, max_batch=2).state.server.scheduler
    admission = sched.admission
    now = time.monotonic()
    assert admission.retry_after() == 1  # free rows: no wait
    sched.running = {1: None, 2: None}
    admission.queue.extend([None] * 5)
    assert admission.retry_after() == 120  # nothing finished lately: no evidence of an early row
    admission.completions.extend([now - 29.5 + 3 * i for i in range(10)])  # about one row freed every 3 s
    assert admission.retry_after() == 18  # 6 ahead (5 queued + this one) at one per 3 s
    admission.completions.clear()
    admission.completions.extend([now - 2] * 5)  # a burst after an idle spell: 5 rows in the last 2 s
    assert admission.retry_after() == 3  # 6 ahead at 2.5 per s, not at 5 per 30 s (36 s)
    admission.completions.extend([now - 1] * 290)
    assert admission.retry_after() == 1
    admission.completions.clear()
    admission.completions.extend([now - 60] * 100)  # outside the window: forgotten
    assert admission.retry_after() == 120


def test_retry_after_is_the_drain_rate_of_the_moment(rt):
    """A queue that drained slowly at first (a batch filling up, long prefills) and fast now: Retry-After
    follows the rate now (it said 26 s for a queue that drained in 16 s when averaged over 30 s)."""
    sched = app_for(rt, max_batch=2).state.server.scheduler
    admission = sched.admission
    now = 1000.0
    admission.clock = lambda: now
    sched.running = {1: None, 2: None}
    admission.queue.extend([None] * 5)  # 6 ahead of a new request
    admission.completions.extend([now - 30 + 2 * i for i in range(12)])  # one row every 2 s, until 8 s ago
    admission.completions.extend([now - 4 + 0.5 * i for i in range(8)])  # two rows a second since
    assert admission.retry_after() == 3  # 6 ahead at 2 per s (the 30 s average, 20 per 30 s, says 9)
    admission.completions.clear()
    admission.completions.extend([now - 29 + 3 * i for i in range(10)])  # steady: one every 3 s
    assert admission.retry_after() == 18
    now += 3
    admission.freed()  # stamped with the admission's clock
    assert admission.completions[-1] == now


@pytest.mark.parametrize("mode", ["plain", "heads"])
def test_requests_joining_a_running_batch_get_their_solo_tokens(rt, tokenizer, mode):
    """Rows prefilled into a batch that is already decoding (at different step boundaries, with prompts of
    different lengths) produce exactly the tokens, and the same first-token distribution, as alone."""
    long_prompt, joiners = "Once upon a time there was", ["The sea is", "Numbers: one two three four five"]
    want = {p: rt.engine.generate([tokenizer(p)["input_ids"]], 30).outputs[0].tokens
            for p in [long_prompt, *joiners]}
    policy = {"mode": mode, "trees": {1: "tree-16"}} if mode == "heads" else {"mode": "plain"}
    app = app_for(rt, policy=policy)
    sched = app.state.server.scheduler
    jobs, pending = [], []
    for i, p in enumerate(joiners):
        got = Collector()
        req = Request(tokenizer(p)["input_ids"], 30 - 8 * (i + 1), got, tag=f"join{i}")
        req.logprobs = 3
        jobs.append((p, req, got))
        pending.append((4 + 6 * i, req))
    first = Collector()

    def runner_event(ev) -> None:
        """Each joiner is queued, from the runner's own events, once the runner has decoded a few tokens
        (and the previous joiner is in the batch): it joins at the next step boundary, however slow the
        machine."""
        first(ev)
        while pending and len(runner.tokens) >= pending[0][0] and not runner.done:
            sched.admission.submit(pending.pop(0)[1])

    runner = Request(tokenizer(long_prompt)["input_ids"], 30, runner_event, tag="runner")
    with running_server(app):
        sched.admission.submit(runner)
        assert first.result().finish_reason == "length" and runner.tokens == want[long_prompt]
        assert not pending, "a joiner was never queued"
        assert all(req.first_token_at > runner.first_token_at for _, req, _ in jobs)  # joined mid-run
        for p, req, got in jobs:
            assert got.result().finish_reason == "length"
            assert req.tokens == want[p][: req.max_tokens]
            ids = tokenizer(p)["input_ids"]
            with torch.no_grad():
                logits = rt.hf_model(torch.tensor([ids])).logits[0, -1].float()
            ref = torch.log_softmax(logits, -1)
            token, lp, top = req.token_logprobs[0]
            assert token == want[p][0] and abs(lp - float(ref[token])) < 1e-4
            assert [t for t, _ in top] == ref.topk(3).indices.tolist()


def test_row_ending_in_its_prefill_keeps_its_own_token(rt, tokenizer):
    """A row whose first token is EOS finishes inside the prefill and leaves the batch there, and a row
    prefilled with it moves into its slot: each must still be handed its own token (the finished row once
    got its neighbour's first token, which the soak saw as an empty answer turning into one token)."""
    from medusa.decoding.engine import Engine
    from medusa.runtime import Runtime

    a, b = (tokenizer(p)["input_ids"] for p in PROMPTS[:2])
    eos = rt.engine.generate([a], 1).outputs[0].tokens[0]  # make `a`'s first token the end of sequence
    engine = Engine(rt.model, [eos])
    want_b = engine.generate([b], MAX_TOKENS).outputs[0].tokens
    assert want_b[0] != eos
    batch = engine.new_batch(4, 64, MAX_TOKENS)
    out = engine.add(batch, ["a", "b", "c"], [a, b, a], MAX_TOKENS)
    got = {rid: out.tokens[i, : int(out.counts[i])].tolist() for i, rid in enumerate(out.ids)}
    assert got == {"a": [eos], "b": want_b[:1], "c": [eos]}
    assert [(f.id, f.reason) for f in out.finished] == [("a", "stop"), ("c", "stop")] and batch.ids == ["b"]

    app = app_for(Runtime(rt.hf_model, tokenizer, rt.model, engine, rt.heads))
    sched = app.state.server.scheduler
    with running_server(app):
        jobs = [make(tokenizer, p, f"r{i}") for i, p in enumerate([PROMPTS[0], PROMPTS[1], PROMPTS[0]])]
        submit_together(sched, [r for r, _ in jobs])
        results = [got.result() for _, got in jobs]
    assert [(r.tokens, ev.finish_reason) for (r, _), ev in zip(jobs, results)][0::2] == [([eos], "stop")] * 2
    assert jobs[1][0].tokens == want_b
