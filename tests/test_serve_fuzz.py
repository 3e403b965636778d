"""Fuzzing the server: schemathesis over its OpenAPI schema, hypothesis over the request models and the
edge checks. Properties: no 5xx, every error in OpenAI's shape, the server healthy afterwards.

Derandomised with bounded example counts, so a run is reproducible and short (the tiny random model with a
128-token context keeps every generated request cheap)."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies as st

from medusa.serve.app import create_app
from medusa.serve.body import load_json, parse_body
from medusa.serve.errors import ApiError
from medusa.serve.config import ServeConfig
from medusa.serve.protocol import ChatCompletionRequest, CompletionRequest
from test_serve import embedded_tokenizer, running_server, tiny_runtime

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_app():
    rt = tiny_runtime(embedded_tokenizer())
    return create_app(ServeConfig(dtype="fp32", max_batch=4, max_context=128, default_max_tokens=8,
                                  max_queue=64, max_body_bytes=64 * 1024, policy={"mode": "plain"}), rt)


@pytest.fixture(scope="module")
def fuzz_url(fuzz_app):
    with running_server(fuzz_app) as url:
        yield url
    # Every test that used the server left it serving and healthy.


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_dict(fuzz_app.openapi())


def check_answer(status: int, body: bytes, content_type: str) -> None:
    """No 5xx; a 4xx carries OpenAI's error object."""
    assert status < 500, body[:500]
    if status >= 400:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    elif content_type.startswith("text/event-stream"):
        events = [line for line in body.decode().splitlines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" or '"error"' in events[-1], events[-3:]


def assert_healthy(url: str) -> None:
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"


OPERATIONS = ["GET /health", "GET /metrics", "GET /v1/models", "POST /v1/chat/completions",
              "POST /v1/completions"]


def test_schema_lists_every_endpoint(api_schema):
    assert sorted(r.ok().label for r in api_schema.get_all_operations()) == sorted(OPERATIONS)


# Negative cases need something to break: the GET endpoints take no input.
CASES = [(label, schemathesis.GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, schemathesis.GenerationMode.NEGATIVE) for label in OPERATIONS if label.startswith("POST")]


@pytest.mark.parametrize("label, mode", CASES)
def test_schemathesis_finds_no_server_error(api_schema, fuzz_url, label, mode):
    """Cases schemathesis derives from the schema: valid ones (positive) and ones that break it (negative)."""
    op = next(r.ok() for r in api_schema.get_all_operations() if r.ok().label == label)
    examples = 25 if label.startswith("POST") else 3
    statuses = []

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(FUZZ, max_examples=examples)
    def call(case):
        # The schema cannot know the served model's name: valid cases use it, invalid ones half the time.
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and (
                mode == schemathesis.GenerationMode.POSITIVE or len(case.body["model"]) % 2):
            case.body["model"] = "default"
        response = case.call(base_url=fuzz_url, timeout=60)
        statuses.append(response.status_code)
        check_answer(response.status_code, response.content, "".join(response.headers.get("content-type", [])))

    call()
    assert_healthy(fuzz_url)
    if mode == schemathesis.GenerationMode.POSITIVE:
        assert 200 in statuses, statuses  # the valid cases did reach the engine


# ---- hypothesis: request bodies built from the fields we serve, with hostile values mixed in ----------

# Lone surrogates included: JSON can carry them as \ud800 escapes.
text = st.text(st.characters(codec=None, categories=None) | st.characters(min_codepoint=0xD800,
                                                                            max_codepoint=0xDFFF), max_size=24)
scalar = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | text)
anything = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                        max_leaves=12)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", ""]),
     "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
     | anything}, optional={"name": text})
FIELDS = {
    "model": st.sampled_from(["default", "gpt-9"]) | anything,
    "max_tokens": st.integers(-2, 80) | anything,
    "max_completion_tokens": st.integers(-2, 80),
    "temperature": st.floats(-1, 3) | anything,
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 70000),
    "seed": st.integers(-2, 2**65) | anything,
    "stop": text | st.lists(text, max_size=5),
    "n": st.integers(0, 3),
    "stream": st.booleans() | anything,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": text,
    "logprobs": st.booleans(),
}
OPTIONAL = {k: v for k, v in FIELDS.items() if k != "model"}
completion = st.fixed_dictionaries(
    {"model": st.just("default") | FIELDS["model"],
     "prompt": text | st.lists(text, max_size=2) | st.lists(st.integers(-3, 60000), max_size=8) | anything},
    optional=OPTIONAL)
chat = st.fixed_dictionaries({"model": st.just("default") | FIELDS["model"],
                              "messages": st.lists(message, max_size=3) | anything}, optional=OPTIONAL)


def encode(body: dict) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: surrogates travel as \u escapes


@given(raw=st.binary(max_size=200) | anything.map(lambda v: json.dumps(v).encode()))
@settings(FUZZ, max_examples=300)
def test_any_bytes_parse_or_get_a_400(raw):
    try:
        load_json(raw)
    except ApiError as exc:
        assert exc.status == 400 and exc.message


@given(body=completion | chat)
@settings(FUZZ, max_examples=400)
def test_request_models_accept_or_refuse_with_a_named_field(body):
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    try:
        parse_body(encode(body), model)
    except ApiError as exc:
        assert exc.status == 400 and exc.message
        json.dumps(exc.message).encode("utf-8")  # what the client gets must be writable
        assert exc.param is None or isinstance(exc.param, str)


@given(body=completion | chat)
@settings(FUZZ, max_examples=150)
def test_prepare_tokenises_or_refuses(fuzz_app, body):
    """Parsing, model check, chat template and tokenisation: an answer or a 4xx, never another exception."""
    try:
        fuzz_app.state.server.prepare(encode(body), "messages" in body)
    except ApiError as exc:
        assert 400 <= exc.status < 500


def post_fuzzed(url: str, body: dict) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(url + path, content=encode(body), headers={"Content-Type": "application/json"}, timeout=60)
    check_answer(r.status_code, r.content, r.headers.get("content-type", ""))


@given(body=completion | chat)
@settings(FUZZ, max_examples=40)
def test_fuzzed_requests_over_http_get_no_5xx(fuzz_url, body):
    post_fuzzed(fuzz_url, body)


def test_server_healthy_after_fuzzing(fuzz_url):
    """Fuzzes the server itself first, so it does not depend on running after the other tests."""
    answered = []

    @given(body=completion | chat)
    @settings(FUZZ, max_examples=20)
    def fuzz(body):
        post_fuzzed(fuzz_url, body)
        answered.append(body)

    fuzz()
    assert answered
    assert_healthy(fuzz_url)
    metrics = httpx.get(fuzz_url + "/metrics", timeout=30).text
    assert 'medusa_responses_total{outcome="server_error"} 0.0' in metrics
    assert 'medusa_failures_total{stage="engine"} 0.0' in metrics
