"""OpenAI-server conventions through the real `openai` client on the tiny random model: neutral values of
unsupported fields, logprobs (the target's distribution, the same with and without speculation), n choices,
the API key, X-Request-Id, vLLM's metric names, and the serving flags."""

from __future__ import annotations

import argparse
import json

import httpx
import openai
import pytest
import torch

from conftest import mixed_prompts, tiny_model
from medusa.serve.responses import Shape
from test_serve import CLIENT_TIMEOUT, _wait, alone, chat_ids, client, serve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def plain_url(rt):
    with serve(rt, policy={"mode": "plain"}) as url:
        yield url


def reference_logprobs(rt, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's own logits at each position that produced `tokens` (one HF forward)."""
    with torch.no_grad():
        logits = rt.hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1)


# ---- neutral values of unsupported fields -------------------------------------------------------------

def test_neutral_values_of_unsupported_fields_are_accepted(plain_url, rt, tokenizer):
    c = client(plain_url)
    text = "Tell me about the sea."
    want = alone(rt, chat_ids(tokenizer, text), 8)[0]
    r = c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": text}], max_tokens=8, logprobs=False,
        presence_penalty=0, frequency_penalty=0.0, user="someone", logit_bias={}, n=1, parallel_tool_calls=False,
        service_tier="auto", tools=[], tool_choice="none", response_format={"type": "text"}, store=False,
        metadata={"k": "v"}, extra_body={"top_logprobs": 0, "modalities": ["text"]})
    assert r.choices[0].message.content == want and r.choices[0].logprobs is None
    prompt = "The capital of France is"
    r = c.completions.create(model="default", prompt=prompt, max_tokens=8, echo=False, best_of=1, suffix=None,
                             logit_bias=None, presence_penalty=0, frequency_penalty=0, user="u", n=1)
    assert r.choices[0].text == alone(rt, tokenizer(prompt)["input_ids"], 8)[0]


# ---- logprobs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_models_distribution(plain_url, rt, tokenizer, stream):
    c = client(plain_url)
    text = "Name a colour."
    kw = dict(model="default", messages=[{"role": "user", "content": text}], max_tokens=6, logprobs=True,
              top_logprobs=3, extra_body={"return_token_ids": True})
    if stream:
        chunks = list(c.chat.completions.create(stream=True, **kw))
        content = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                   for e in ch.choices[0].logprobs.content]
        tokens = [t for ch in chunks if ch.choices for t in (ch.choices[0].model_extra or {}).get("token_ids", [])]
        got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        r = c.chat.completions.create(**kw)
        content, tokens, got = r.choices[0].logprobs.content, r.choices[0].model_extra["token_ids"], \
            r.choices[0].message.content
    prompt = chat_ids(tokenizer, text)
    assert got == alone(rt, prompt, 6)[0] and len(tokens) == len(content) == 6
    ref = reference_logprobs(rt, prompt, tokens)
    for j, e in enumerate(content):
        assert e.token == tokenizer.decode([tokens[j]]) and e.bytes == list(e.token.encode())
        assert abs(e.logprob - float(ref[j, tokens[j]])) < 1e-4
        top = ref[j].topk(3)
        assert [t.token for t in e.top_logprobs] == [tokenizer.decode([i]) for i in top.indices.tolist()]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)  # greedy: the top token


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_shape(plain_url, rt, tokenizer, stream):
    c = client(plain_url)
    prompt = "Once upon a time"
    kw = dict(model="default", prompt=prompt, max_tokens=5, logprobs=2,
              extra_body={"return_tokens_as_token_ids": True})
    if stream:
        chunks = list(c.completions.create(stream=True, **kw))
        parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        token_lp = [x for p in parts for x in p.token_logprobs]
        tops = [x for p in parts for x in p.top_logprobs]
        offsets = [x for p in parts for x in p.text_offset]
    else:
        lp = c.completions.create(**kw).choices[0].logprobs
        tokens, token_lp, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert len(ids) == 5 and all(t.startswith("token_id:") for t in tokens)
    ref = reference_logprobs(rt, tokenizer(prompt)["input_ids"], ids)
    assert token_lp == pytest.approx([float(ref[j, t]) for j, t in enumerate(ids)], abs=1e-4)
    for j, top in enumerate(tops):
        want = {f"token_id:{i}": v for i, v in zip(*[x.tolist() for x in ref[j].topk(2)][::-1])}
        assert set(top) == set(want) and [top[k] for k in want] == pytest.approx(list(want.values()), abs=1e-4)
    assert offsets == sorted(offsets) and offsets[0] == 0


def collect_logprobs(engine, prompts: list[list[int]], proposer, k: int, max_new: int) -> tuple[dict, object]:
    """Every row's (token, logprob, top ids, top logprobs) per emitted position, driving add/step by hand."""
    batch = engine.new_batch(len(prompts), max(map(len, prompts)) + max_new + 32, max_new)
    got: dict[int, list] = {i: [] for i in range(len(prompts))}

    def take(out) -> None:
        for r, rid in enumerate(out.ids):
            for j in range(int(out.counts[r])):
                lp = out.logprobs
                got[rid].append((int(out.tokens[r, j]), float(lp.token[r, j]), lp.top_ids[r, j].tolist(),
                                 lp.top[r, j].tolist()))

    take(engine.add(batch, list(range(len(prompts))), prompts, max_new, logprobs=[k] * len(prompts)))
    while batch.n:
        take(engine.step(batch, proposer))
    return got, batch.stats


def test_engine_logprobs_are_the_same_with_and_without_speculation():
    """Rows accepting different numbers of candidates per step (an oracle proposer over a deep tree): each
    emitted token's logprob and top-5 equal those of plain decoding (fp32), and the model's own."""
    from medusa.decoding.engine import Engine
    from medusa.decoding.target.transformer import Transformer
    from test_engine import DEEP_TREE, OracleProposer

    model = tiny_model("llama")
    engine = Engine(Transformer(model), eos_token_ids=None)
    prompts = mixed_prompts(4, seed=7)
    plain, _ = collect_logprobs(engine, prompts, None, 5, 16)
    oracle = OracleProposer(DEEP_TREE, {i: [t for t, *_ in plain[i]] for i in plain}, 97)
    spec, stats = collect_logprobs(engine, prompts, oracle, 5, 16)
    # The oracle really was accepted, a different number of tokens per row and step, so the logits of
    # nodes past the root were read.
    assert stats.mean_accepted > 1.5 and sum(c > 0 for c in stats.accept_hist) > 2
    for i in plain:
        assert [t for t, *_ in spec[i]] == [t for t, *_ in plain[i]]
        assert [ids for _, _, ids, _ in spec[i]] == [ids for _, _, ids, _ in plain[i]]
        assert [lp for _, lp, _, _ in spec[i]] == pytest.approx([lp for _, lp, _, _ in plain[i]], abs=1e-5)
        with torch.no_grad():
            logits = model(torch.tensor([prompts[i] + [t for t, *_ in plain[i]]])).logits[0, len(prompts[i]) - 1:-1]
        ref = torch.log_softmax(logits.float(), -1)
        assert [lp for _, lp, _, _ in spec[i]] == pytest.approx(
            [float(ref[j, t]) for j, (t, *_) in enumerate(spec[i])], abs=1e-4)


def test_no_logprobs_asked_means_none_computed():
    from medusa.decoding.engine import Engine
    from medusa.decoding.target.transformer import Transformer

    engine = Engine(Transformer(tiny_model("llama")), eos_token_ids=None)
    batch = engine.new_batch(2, 64, 8)
    assert engine.add(batch, [0, 1], mixed_prompts(2), 8).logprobs is None
    assert engine.step(batch).logprobs is None and not batch.logprobs


def test_logprobs_through_the_server_with_and_without_speculation(rt, tokenizer):
    prompt = "Describe a quiet harbour town at dusk"
    kw = dict(model="default", prompt=prompt, max_tokens=10, logprobs=3)
    with serve(rt, policy={"mode": "heads", "trees": {1: "tree-16"}}) as url:
        spec = client(url).completions.create(**kw).choices[0].logprobs
    with serve(rt, draft="layers:2", draft_k=3, policy={"mode": "draft"}) as url:
        # The tiny model's 2 layers as draft: every draft token is accepted, so most tokens come from it.
        draft = client(url).completions.create(**kw).choices[0].logprobs
    with serve(rt, policy={"mode": "plain"}) as url:
        plain = client(url).completions.create(**kw).choices[0].logprobs
    for other in (spec, draft):
        assert other.tokens == plain.tokens
        # Same tokens; the values agree to fp32 rounding: passes of other shapes sum in other orders (on an
        # AVX2 CPU one logprob of -3.39 differed by 1.03e-5).
        assert other.token_logprobs == pytest.approx(plain.token_logprobs, rel=1e-5, abs=1e-5)
        assert [sorted(t) for t in other.top_logprobs] == [sorted(t) for t in plain.top_logprobs]


# ---- n choices ------------------------------------------------------------------------------------------

def test_n_choices(plain_url, rt, tokenizer):
    c = client(plain_url)
    prompt = "Roll the dice:"
    greedy = c.completions.create(model="default", prompt=prompt, max_tokens=6, n=2)
    want = alone(rt, tokenizer(prompt)["input_ids"], 6)[0]
    assert [ch.index for ch in greedy.choices] == [0, 1] and [ch.text for ch in greedy.choices] == [want] * 2
    assert greedy.usage.completion_tokens == 12
    kw = dict(model="default", prompt=prompt, max_tokens=6, temperature=1.0, seed=11)
    three = c.completions.create(n=3, **kw)
    texts = [ch.text for ch in sorted(three.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) == 3  # derived seeds: the choices differ ...
    assert c.completions.create(n=1, **kw).choices[0].text == texts[0]  # ... choice 0 uses the seed itself
    assert [ch.text for ch in sorted(c.completions.create(n=3, **kw).choices, key=lambda ch: ch.index)] == texts
    chunks = list(c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, n=2, stream=True, temperature=1.0, seed=3,
                                            stream_options={"include_usage": True}))
    by_index: dict[int, str] = {}
    finish = {}
    for ch in chunks:
        for choice in ch.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert set(by_index) == {0, 1} and finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 10


def test_n_beyond_what_the_server_holds_is_a_400(rt):
    with serve(rt, max_batch=2, max_queue=1, policy={"mode": "plain"}) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "x", "n": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "x", "n": 3, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3


# ---- API key and request ids --------------------------------------------------------------------------

def test_api_key(rt, monkeypatch):
    with serve(rt, api_key="s3cret", policy={"mode": "plain"}) as url:
        with pytest.raises(openai.AuthenticationError) as err:
            client(url).models.list()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "x"}, headers=headers)
            assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=CLIENT_TIMEOUT)
        assert good.completions.create(model="default", prompt="x", max_tokens=2).choices[0].text
        assert httpx.get(url + "/health").status_code == 200  # monitors need no key
        # Counted once the response is sent, so possibly just after the client has it.
        assert _wait(lambda: scrape(url)['medusa_responses_total{outcome="unauthorized"}'] == 4)
    monkeypatch.setenv("MEDUSA_API_KEY", "from-env")
    with serve(rt, policy={"mode": "plain"}) as url:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_request_id_is_echoed_or_generated(plain_url):
    body = {"model": "default", "prompt": "x", "max_tokens": 2}
    r = httpx.post(plain_url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42.a:b"})
    assert r.headers["x-request-id"] == "trace-42.a:b" and r.json()["id"] == "cmpl-trace-42.a:b"
    for bad in ("x" * 129, "a b", "semi;colon", ""):
        r = httpx.post(plain_url + "/v1/completions", json=body, headers={"X-Request-Id": bad})
        assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 24
    assert httpx.get(plain_url + "/health").headers["x-request-id"]


# ---- metrics --------------------------------------------------------------------------------------------

def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_vllm_speculation_counters_are_consistent(rt):
    # The tiny model's own two layers as draft: most candidates are accepted, so every position counts.
    k = 3
    with serve(rt, draft="layers:2", draft_k=k, policy={"mode": "draft"}) as url:
        before = scrape(url)
        c = client(url)
        for prompt in ("Name a fruit", "Describe a harbour"):
            c.completions.create(model="default", prompt=prompt, max_tokens=12)
        after = scrape(url)
    d = {name: after[name] - before.get(name, 0.0) for name in after}
    drafts = d["vllm:spec_decode_num_drafts_total"]
    accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [d[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}'] for p in range(k)]
    assert drafts > 0 and d["vllm:spec_decode_num_draft_tokens_total"] == drafts * k
    assert 0 < accepted <= d["vllm:spec_decode_num_draft_tokens_total"]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True) and per_pos[-1] > 0
    assert d["medusa_accepted_tokens_total"] == accepted and d["medusa_speculative_row_steps_total"] == drafts
    assert after["medusa_acceptance_rate"] == pytest.approx(after["medusa_accepted_tokens_total"]
                                                           / after["medusa_proposed_depth_tokens_total"])
    # 24 tokens, 2 requests: every request has a first token, and later deliveries are inter-token gaps.
    assert d["vllm:time_to_first_token_seconds_count"] == 2 == d["medusa_time_to_first_token_seconds_count"]
    assert 0 < d["vllm:inter_token_latency_seconds_count"] <= 22


# ---- flags --------------------------------------------------------------------------------------------

def test_serving_flags_and_version(capsys):
    from medusa.cli import main
    from medusa.serve.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--served-model-name", "m", "--max-model-len", "300", "--max-num-seqs",
                              "4", "--api-key", "k"])
    assert (args.served_model_name, args.max_context, args.max_batch, args.api_key) == ("m", 300, 4, "k")
    assert parser.parse_args(["serve", "--max-context", "64", "--max-batch", "2"]).max_context == 64
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("medusa ")
    assert main([]) == 0 and "usage: medusa" in capsys.readouterr().out


def test_shape_reports_unlikely_tokens_at_a_json_floor(rt):
    """A token the model rules out has logprob -inf, which JSON cannot carry: it is reported at -9999."""
    from medusa.serve.server import Server
    from medusa.serve.config import ServeConfig
    from medusa.serve.request import Event

    server = Server(ServeConfig(dtype="fp32", policy={"mode": "plain"}), rt)
    body = argparse.Namespace(logprobs_k=lambda: 1, return_token_ids=False, return_tokens_as_token_ids=True)
    shape = Shape(server, False, [1, 2], "rid", body)
    chunk = shape.chunk(0, Event("delta", "x", 1, token_ids=[5], logprobs=[(5, float("-inf"), [(7, -0.1)])]))
    json.dumps(chunk, allow_nan=False)
    assert chunk["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0]


def test_the_end_of_sequence_token_is_listed_and_counted(tokenizer):
    """An answer that ends at the end-of-sequence token lists that token in its logprobs and counts it in
    `usage`, as the serving docs say (here the model's own fourth greedy token is made its end token)."""
    import dataclasses

    from medusa.decoding.engine import Engine
    from test_serve import tiny_runtime

    base = tiny_runtime(tokenizer, seed=6, heads=False)
    prompt = "Once upon a time"
    free = base.engine.generate([tokenizer(prompt)["input_ids"]], 8).outputs[0].tokens
    end = free.index(free[3]) + 1  # the answer up to the first occurrence of its end token
    rt = dataclasses.replace(base, engine=Engine(base.model, eos_token_ids=[free[3]]))
    with serve(rt, policy={"mode": "plain"}) as url:
        r = client(url).completions.create(model="default", prompt=prompt, max_tokens=8, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens] == free[:end]
    assert r.usage.completion_tokens == end and len(choice.logprobs.token_logprobs) == end
