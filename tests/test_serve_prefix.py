"""The server's prefix cache and latency target: answers are the same with the cache on and off (shared system
prompts, a second turn extending the first), usage reports cached prompt tokens as OpenAI does, /metrics
counts hits and evictions, a tiny budget evicts only blocks no request holds, bad settings are refused naming
the flag, and the prefill budget keeps a step-time target (saying once when it cannot)."""

from __future__ import annotations

import concurrent.futures
import logging

import httpx
import pytest
from test_serve import _metric, _wait, alone, client, serve

from medusa.decoding.prefix_cache import PrefixCache
from medusa.errors import MedusaError
from medusa.serve.app import create_app
from medusa.serve.config import ServeConfig, load_config
from medusa.serve.prefill import MIN_CHUNK, PrefillBudget, Target, parse_tpot_slo

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SYSTEM = ("You are a careful assistant for a small harbour town. Answer questions about tides, boats, the "
          "market hours, the ferry timetable and the weather. Keep every answer short, friendly and exact, "
          "and say so when you do not know.")
QUESTIONS = ["When does the ferry leave?", "Is the market open on Sunday?", "Will it rain today?"]
MAX_TOKENS = 10


def chat(c, messages: list[dict], stream: bool = False):
    """(text, usage) of a greedy chat completion."""
    kw = dict(model="default", messages=messages, max_tokens=MAX_TOKENS)
    if stream:
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks[-1].usage
    r = c.chat.completions.create(**kw)
    return r.choices[0].message.content, r.usage


def conversation(url: str) -> tuple[list[str], list, list[list[dict]], str]:
    """Three users sharing a system prompt, then the first user's second turn (prompt + answer + question),
    the second turn streamed; the same completion prompt twice: texts, usages, the chat messages, metrics."""
    c = client(url)
    texts, usages, asked = [], [], []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        text, usage = chat(c, messages)
        texts.append(text)
        usages.append(usage)
        asked.append(messages)
    turn2 = asked[0] + [{"role": "assistant", "content": texts[0]}, {"role": "user", "content": "And tomorrow?"}]
    text, usage = chat(c, turn2, stream=True)
    texts.append(text)
    usages.append(usage)
    asked.append(turn2)
    for _ in range(2):
        r = c.completions.create(model="default", prompt=SYSTEM, max_tokens=MAX_TOKENS)
        texts.append(r.choices[0].text)
        usages.append(r.usage)
    return texts, usages, asked, settled(url)


def settled(url: str) -> str:
    """/metrics once the engine thread has counted its last boundary (no block held: every row has left)."""
    assert _wait(lambda: _metric(httpx.get(url + "/metrics", timeout=10).text, "medusa_prefix_cache_held_blocks") == 0
                 and _metric(httpx.get(url + "/metrics", timeout=10).text, "medusa_requests_running") == 0)
    return httpx.get(url + "/metrics", timeout=10).text


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def runs(rt):
    """The conversation against a server with the cache on (16-token blocks) and one with it off."""
    out = {}
    for on in (True, False):
        with serve(rt, prefix_cache=on, policy={"mode": "heads", "trees": {1: "tree-8"}, "calibrate": False}) as url:
            out[on] = conversation(url)
    return out


def test_answers_are_the_same_with_the_cache_on_and_off(runs, rt, tokenizer):
    on, off = runs[True], runs[False]
    assert on[0] == off[0]
    prompts = [chat_prompt_ids(tokenizer, m) for m in on[2]] + [tokenizer(SYSTEM)["input_ids"]] * 2
    assert on[0] == [alone(rt, p, MAX_TOKENS)[0] for p in prompts]


def test_usage_reports_the_cached_prompt_tokens(runs, tokenizer):
    usages, asked = runs[True][1], runs[True][2]
    assert [cached(u) for u in runs[False][1]] == [0] * len(usages)
    assert cached(usages[0]) == 0  # the first request finds nothing
    ids = [chat_prompt_ids(tokenizer, m) for m in asked]
    shared = max(common(ids[0], ids[1]), common(ids[0], ids[2]), common(ids[1], ids[2]))
    assert shared > 32  # the system turn
    # Later users reuse the shared system prompt, whole blocks of it.
    assert cached(usages[1]) == common(ids[0], ids[1]) // 16 * 16
    assert cached(usages[2]) == max(common(ids[0], ids[2]), common(ids[1], ids[2])) // 16 * 16
    turn1 = len(ids[0])
    assert cached(usages[3]) >= turn1 // 16 * 16  # the second turn reuses the whole first turn (streamed usage)
    assert cached(usages[3]) < usages[3].prompt_tokens
    assert cached(usages[5]) == (usages[5].prompt_tokens - 1) // 16 * 16  # the same completion prompt again


def test_metrics_count_hits_cached_tokens_and_bytes(runs):
    usages, metrics = runs[True][1], runs[True][3]
    hits = sum(cached(u) > 0 for u in usages)
    assert _metric(metrics, "medusa_prefix_cache_lookups_total") == len(usages)
    assert _metric(metrics, "medusa_prefix_cache_hits_total") == hits
    assert _metric(metrics, "medusa_prefix_cache_hit_rate") == pytest.approx(hits / len(usages))
    assert _metric(metrics, "medusa_prefix_cache_cached_tokens_total") == sum(cached(u) for u in usages)
    assert _metric(metrics, "vllm:prefix_cache_hits_total") == sum(cached(u) for u in usages)
    assert _metric(metrics, "vllm:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert _metric(metrics, "medusa_prefix_cache_bytes") > 0
    assert _metric(metrics, "medusa_prefix_cache_capacity_bytes") >= _metric(metrics, "medusa_prefix_cache_bytes")
    assert _metric(metrics, "medusa_prefix_cache_evictions_total") == 0
    assert _metric(metrics, "medusa_prefix_cache_held_blocks") == 0  # nothing runs: nothing held
    off = runs[False][3]
    assert _metric(off, "medusa_prefix_cache_lookups_total") == 0
    assert _metric(off, "medusa_prefix_cache_capacity_bytes") == 0


def test_a_tiny_budget_evicts_only_blocks_no_request_holds(rt, tokenizer, monkeypatch):
    """Six 16-token blocks for 12 concurrent chats of 4 rows: blocks are evicted all the time, never one a
    running request holds, and every request is answered as it is alone."""
    victims = []
    original = PrefixCache._evict

    def evict(self, blk):
        victims.append((blk.pins, blk.children, blk.slot in self.held()))
        original(self, blk)

    monkeypatch.setattr(PrefixCache, "_evict", evict)
    jobs = [[{"role": "system", "content": SYSTEM if i % 2 else SYSTEM[:90]},
             {"role": "user", "content": f"Question {i}: what about pier {i * 7 % 11}?"}] for i in range(12)]
    with serve(rt, max_batch=4, prefix_cache_mb=6 * 8192 / 2**20, policy={"mode": "plain"}, max_queue=64) as url:
        c = client(url)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda m: chat(c, m), jobs))
        metrics = settled(url)
    assert [t for t, _ in got] == [alone(rt, chat_prompt_ids(tokenizer, m), MAX_TOKENS)[0] for m in jobs]
    assert victims and all(v == (0, 0, False) for v in victims)
    assert _metric(metrics, "medusa_prefix_cache_evictions_total") == len(victims)
    assert _metric(metrics, "medusa_prefix_cache_capacity_bytes") == 6 * 8192
    assert _metric(metrics, "medusa_prefix_cache_held_blocks") == 0


@pytest.mark.parametrize("overrides, words", [
    ({"prefix_cache_mb": 0}, "prefix_cache_mb"),
    ({"prefix_cache_mb": -5}, "prefix_cache_mb"),
    ({"prefix_cache": "sometimes"}, "prefix_cache"),
    ({"prefix_cache_block": 0}, "prefix_cache_block"),
    ({"tpot_slo": "soon"}, "tpot_slo"),
    ({"tpot_slo": "1x"}, "tpot_slo"),
    ({"tpot_slo": 0}, "tpot_slo"),
    ({"tpot_slo": "80ms", "prefill_stall": 1.0}, "prefill_stall"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, words):
    with pytest.raises(MedusaError, match=words):
        load_config(None, overrides)


def test_a_budget_without_room_for_one_block_is_refused_at_start(rt):
    with pytest.raises(MedusaError, match=r"--prefix-cache-mb .*holds no block"):
        create_app(ServeConfig(dtype="fp32", prefix_cache_mb=0.001), rt)


def test_cli_flags(capsys):
    from medusa.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--prefix-cache", "maybe"])
    assert "--prefix-cache" in capsys.readouterr().err
    assert main(["serve", "--tpot-slo", "soon", "--port", "8001"]) == 2
    assert "tpot_slo" in capsys.readouterr().err


def test_tpot_slo_spellings():
    assert parse_tpot_slo("80ms") == parse_tpot_slo("80") == parse_tpot_slo(80) == Target(ms=80.0)
    assert parse_tpot_slo("2x") == Target(factor=2.0)
    assert str(Target(factor=2.0)) == "2x a stream's step alone"


def test_the_chunk_fills_what_the_target_leaves_and_a_missed_target_is_said_once(caplog):
    curve = lambda b, t: 10.0 * b + 0.5 * t
    token_ms = curve(1, 64) / 64
    fixed = PrefillBudget("auto", None, curve, target=Target(ms=100))
    assert fixed.tokens(4, 1) == int((100 - curve(4, 1)) / token_ms)
    assert fixed.tokens(12, 1) == int(curve(12, 1) / token_ms) and fixed.missed  # past it: the step's own time
    budget = PrefillBudget("auto", None, curve, target=Target(factor=2))
    assert budget.tokens(1, 1) == int((2 * curve(1, 1) - curve(1, 1)) / token_ms)  # twice a stream's step alone
    assert budget.target_ms == 2 * curve(1, 1) and not budget.missed
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="medusa.serve.prefill"):
        for _ in range(5):  # 4 rows' step alone is past twice one row's: the target cannot be kept, and the
            # chunk takes (2 - 1) x the running rows' own step meanwhile, so prompts still advance
            assert budget.tokens(4, 1) == int(curve(4, 1) / token_ms) > MIN_CHUNK
        assert budget.missed
        budget.tokens(1, 1)
        assert not budget.missed
        budget.tokens(4, 1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "cannot be kept" in warnings[0].getMessage()  # once per spell, not per step
    budget.observe(0.030, 0, rows=1, width=1)  # a measured step of one row alone replaces the curve's
    assert budget.step_target(1, 50.0) == 60.0


def test_a_target_with_room_for_few_tokens_is_kept_with_small_chunks_and_not_called_missed(caplog):
    # A slow CPU: one stream's step alone is 30 ms and a prompt token costs 2.7 ms, so a 2x target leaves room
    # for 11 tokens. The chunk must be those 11 (not MIN_CHUNK, which would make the step 73 ms), and the
    # target is being kept, so nothing may say it is missed, at any step.
    curve = lambda b, t: 30.0 * b + 2.7 * (t - 1)
    budget = PrefillBudget("auto", None, curve, target=Target(factor=2))
    for _ in range(4):
        budget.observe(0.030, 0, rows=1, width=1)  # the stream's steps alone, measured before the prompt came
    chunks = []
    with caplog.at_level(logging.INFO, logger="medusa.serve.prefill"):
        for _ in range(20):
            chunks.append(budget.tokens(1, 1))
            assert not budget.missed
            budget.observe((30.0 + 2.7 * chunks[-1]) / 1000, chunks[-1], rows=1, width=1)  # the pass the chunk made
    assert max(chunks) == chunks[-1] == int(30.0 / 2.7) < MIN_CHUNK  # never past the target, and up to it
    assert not caplog.records
    budget.observe(0.213, 0, rows=1, width=1)  # one slow pass alone (a prompt joining): the target holds
    budget.observe(0.090, 0, rows=1, width=4)  # a pass of another width is not this stream's step
    assert budget.step_target(1, 30.0) == 60.0 and budget.tokens(1, 1) == int(30.0 / 2.7)
    # What small chunks add is learnt from them: tokens that cost twice as much halve the chunk.
    for _ in range(30):
        chunk = budget.tokens(1, 1)
        budget.observe((30.0 + 5.4 * chunk) / 1000, chunk, rows=1, width=1)
    assert budget.token_ms == pytest.approx(5.4, rel=0.05) and budget.tokens(1, 1) == int(30.0 / 5.4)
    # Room for less than one token: missed, said once, and prompts still advance.
    slow = PrefillBudget("auto", None, lambda b, t: 30.0 * b + 40.0 * t, target=Target(ms=60.0))
    with caplog.at_level(logging.INFO, logger="medusa.serve.prefill"):
        slow_chunks = [slow.tokens(2, 1) for _ in range(5)]
        assert slow.missed and slow_chunks == [int(slow.curve(2, 1) / slow.token_ms)] * 5 and slow_chunks[0] >= 1
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1


def test_a_missed_target_shows_in_metrics(rt):
    with serve(rt, tpot_slo="0.001ms", policy={"mode": "plain"}) as url:
        c = client(url)
        c.completions.create(model="default", prompt="The sea is", max_tokens=8)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    assert _metric(metrics, "medusa_tpot_target_missed_spells_total") == 1
    assert _metric(metrics, "medusa_tpot_target_missed") == 1
    assert _metric(metrics, "medusa_tpot_target_seconds") == pytest.approx(1e-6)
