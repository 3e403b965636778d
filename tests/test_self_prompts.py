"""`self:N`: prompts the target writes itself (found template prefix, batched seeded sampling, filters with
reasons, exact and near dedup, resume to the same set), the data card, and the held-out evaluation set."""

from __future__ import annotations

import json

import pytest
import yaml

from medusa.errors import MedusaError
from medusa.train.config import SelfPromptsConfig
from medusa.train.prompt_filters import NearDuplicates, guess_kind, normalise, quality_problem
from medusa.train.self_prompts import PROMPTS_FILE, SelfPromptWriter, load_topics, stop_ids, user_turn


def writer(rt, path, n, **settings):
    cfg = SelfPromptsConfig(**{"max_tokens": 40, **settings})
    return SelfPromptWriter(rt, cfg, n, path, batch_size=8, progress=False)


def kept(records):
    return [r["prompt"] for r in records]


# ---- the template prefix ------------------------------------------------------------------------------
def test_the_user_turn_is_cut_out_of_the_template(embedded):
    tok = embedded.tokenizer
    before, after = user_turn(tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == before + "Hello there" + after
    assert before.endswith("<|im_start|>user\n") and after.startswith("<|im_end|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_ids(tok, after, [tok.eos_token_id])
    with_system = user_turn(tok, "You answer questions about gardening.")[0]
    assert "gardening" in with_system and with_system.endswith("<|im_start|>user\n")


def test_a_template_without_the_message_or_no_template_is_refused(tmp_path):
    from transformers import AutoTokenizer

    from train_helpers import save_tiny_model

    tok = AutoTokenizer.from_pretrained(save_tiny_model(tmp_path / "m"))
    with pytest.raises(MedusaError, match="self:N needs a model with a chat template"):
        user_turn(tok)
    tok.chat_template = "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}t4"
    assert user_turn(tok) == ("t2 ", " t3 t4")
    tok.chat_template = "{% for m in messages %}t2 t3 {% endfor %}"
    with pytest.raises(MedusaError, match="does not show the user's message"):
        user_turn(tok)


# ---- filters and duplicates ----------------------------------------------------------------------------
def test_filters_name_their_reason():
    assert quality_problem("   ", "stop") == "empty"
    assert quality_problem("Write a haiku about", "length") == "truncated"
    assert quality_problem("Write <|im_start|>", "template") == "template"
    assert quality_problem("Hello", "stop") == "too_short"
    assert quality_problem("12 + 34 = 46 ; 99 / 3 = 33 ...", "stop") == "non_text"
    assert quality_problem("buy now " * 12, "stop") == "repetitive"
    assert quality_problem("line one\nline one\nline one\nsomething else here", "stop") == "repetitive"
    assert quality_problem("Can you explain how vaccines train the immune system?", "stop") is None
    assert normalise("  Hello,   WORLD! ") == normalise("hello world")
    assert guess_kind("Translate this into French: good morning") == "translation"
    assert guess_kind("Write a Python function that reverses a list") == "code"


def test_near_duplicates_are_found_and_others_are_not():
    index = NearDuplicates(0.7)
    index.add("Can you help me plan a three day trip to Rome with my family this summer?", 4)
    assert index.find("Can you help me plan a three day trip to Rome with my family this spring?") == 4
    assert index.find("Write a short poem about the sea at night and the moon above it.") is None


def test_judging_records_duplicates_with_the_prompt_they_repeat(embedded, tmp_path):
    w = writer(embedded, tmp_path / PROMPTS_FILE, 4)
    tok = embedded.tokenizer
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first = w.judge(0, ids("Can you help me plan a three day trip to Rome with my family this summer?"), "stop")
    assert first["drop"] is None
    w._remember(first)
    again = w.judge(1, ids("can you help me plan a three-day trip to Rome with my family this summer"), "stop")
    near = w.judge(2, ids("Can you help me plan a three day trip to Rome with my family this winter?"), "stop")
    cut = w.judge(3, ids("Tell me about the history of"), "length")
    assert (again["drop"], again["like"]) == ("duplicate", 0)
    assert (near["drop"], near["like"]) == ("near_duplicate", 0)
    assert cut["drop"] == "truncated"
    w.end_text = "[/INST]"  # a template whose user turn ends in plain text: the prompt ends there
    closed = w.judge(4, ids("Tell me a joke about cats, please. [/INST] Why did the cat"), "length")
    assert (closed["prompt"], closed["finish"], closed["drop"]) == ("Tell me a joke about cats, please.", "stop", None)


# ---- writing: batched, seeded, resumable ----------------------------------------------------------------
@pytest.fixture(scope="module")
def full_run(embedded, tmp_path_factory):
    path = tmp_path_factory.mktemp("self") / PROMPTS_FILE
    return path, writer(embedded, path, 6).run()


def test_prompts_are_written_judged_and_recorded(full_run):
    path, records = full_run
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 6 and [r["i"] for r in lines] == list(range(len(lines)))
    assert all(r["prompt"].strip() and r["finish"] == "stop" and r["drop"] is None for r in records)
    assert len({normalise(p) for p in kept(records)}) == 6
    assert all(r["drop"] is None or r["drop"] in ("empty", "truncated", "template", "too_short", "non_text",
                                                  "repetitive", "duplicate", "near_duplicate") for r in lines)
    assert all(0 < r["tokens"] <= 40 for r in lines)


def test_the_same_seed_gives_the_same_set_and_another_seed_another(embedded, full_run, tmp_path):
    # fewer asked for, in another batch (its rows are fewer): the first ones of the same set
    assert kept(writer(embedded, tmp_path / "a.jsonl", 3).run()) == kept(full_run[1])[:3]
    assert kept(writer(embedded, tmp_path / "b.jsonl", 2, seed=7).run()) != kept(full_run[1])[:2]


def test_a_restart_goes_on_to_the_same_set(embedded, full_run, tmp_path):
    path, records = full_run
    lines = path.read_text().splitlines()
    cut = tmp_path / PROMPTS_FILE
    cut.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])  # killed while writing line 4
    assert kept(writer(embedded, cut, 6).run()) == kept(records)
    again = [json.loads(line) for line in cut.read_text().splitlines()]
    assert [{**r, "s": 0} for r in again] == [{**json.loads(line), "s": 0} for line in lines]  # torn line redone


def test_filtered_candidates_keep_their_reason(embedded, tmp_path):
    path = tmp_path / PROMPTS_FILE
    writer(embedded, path, 2, max_tokens=14).run()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert any(r["drop"] == "truncated" and r["finish"] == "length" and r["tokens"] == 14 for r in lines)


def test_topics_steer_the_system_prompt_and_name_the_kind(embedded, tmp_path):
    topics = tmp_path / "topics.yaml"
    topics.write_text(yaml.safe_dump(["cooking", {"name": "code", "opener": "In Python,"}]))
    w = writer(embedded, tmp_path / PROMPTS_FILE, 4, topics=str(topics))
    assert "cooking" in embedded.tokenizer.decode(w.prefix(0)) and "cooking" not in embedded.tokenizer.decode(w.prefix(1))
    assert embedded.tokenizer.decode(w.prefix(1)).endswith("In Python,")
    records = w.run()
    assert {r["kind"] for r in records} <= {"cooking", "code"}
    assert all(r["prompt"].startswith("In Python,") for r in records if r["kind"] == "code")
    for bad, match in (("[]", "non-empty YAML list"), ("- {title: x}", "item 0 must be")):
        topics.write_text(bad)
        with pytest.raises(MedusaError, match=match):
            load_topics(str(topics))
    with pytest.raises(MedusaError, match="no such file"):
        load_topics(str(tmp_path / "none.yaml"))
