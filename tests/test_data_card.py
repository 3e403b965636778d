"""`medusa distill` with self-written prompts mixed with other sources, the data card it keeps, the flags and
keys that set it up, and the held-out evaluation set (its kinds, and no prompt any training source has)."""

from __future__ import annotations

import json

import pytest

from medusa.cli import main
from medusa.errors import MedusaError
from medusa.train.config import TrainConfig
from medusa.train.distill import extends, load_distilled, run_distill

FILE_PROMPTS = ["Name a colour.", "Count to three.", "Say hi."]


def config(tmp_path, sources, **data) -> TrainConfig:
    (tmp_path / "p.txt").write_text("\n".join(FILE_PROMPTS) + "\n")
    sources = [str(tmp_path / "p.txt") if s == "file" else s for s in sources]
    return TrainConfig(model="default", dtype="fp32", data={
        "sources": sources, "max_new_tokens": 8, "shard_size": 3, "distill_batch_size": 4,
        "distill_dir": str(tmp_path / "out"), "self_prompts": {"max_tokens": 40}, **data})


def test_self_prompts_mix_with_a_file_and_the_card_records_it(embedded, tmp_path):
    out = run_distill(config(tmp_path, ["file", "self:4"]), runtime=embedded, show_progress=False)
    ds = load_distilled(out)
    records = [json.loads(line) for line in (out / "self_prompts.jsonl").read_text().splitlines()]
    written = [r["prompt"] for r in records if r["drop"] is None]
    assert ds["prompt"] == FILE_PROMPTS + written and len(written) == 4
    assert set(ds.column_names) == {"prompt", "prompt_ids", "response_ids", "response", "finish_reason"}
    card = json.loads((out / "card.json").read_text())
    assert [(s["source"].split("/")[-1], s["prompts"]) for s in card["sources"]] == [("p.txt", 3), ("self:4", 4)]
    assert abs(sum(s["share"] for s in card["sources"]) - 1) < 1e-3
    assert card["prompt_tokens"]["max"] >= card["prompt_tokens"]["median"] >= card["prompt_tokens"]["min"] > 0
    assert sum(card["kinds"].values()) == 7
    sp = card["self_prompts"]
    assert sp["candidates"] == len(records) and sp["kept"] == 4
    assert sum(sp["dropped"].values()) == len(records) - 4 and 0 <= sp["dedup_rate"] <= 1
    assert sp["settings"]["temperature"] == 1.0 and sp["examples"]["kept"]
    assert card["answers"]["rows"] == 7 and card["answers"]["shards"] == card["answers"]["of_shards"] == 3
    assert card["answers"]["rows_by_dtype"] == {"fp32": 7}
    run = card["runs"][-1]
    assert run["dtype"] == "fp32" and run["torch"] and run["machine_facts"]["name"] and "command" in run
    md = (out / "card.md").read_text()
    assert "Self-written prompts" in md and "self:4" in md and "Kept, for example" in md
    assert "answered in fp32 (7 rows)" in md
    # a second run finds everything done and only adds itself to the card (and the dtypes a card from before
    # they were kept lacks, from each shard's count.json)
    old = json.loads((out / "card.json").read_text())
    for shard in old["answers"]["per_shard"].values():
        del shard["dtype"]
    (out / "card.json").write_text(json.dumps(old))
    run_distill(config(tmp_path, ["file", "self:4"]), runtime=embedded, show_progress=False)
    again = json.loads((out / "card.json").read_text())
    assert len(again["runs"]) == 2 and again["answers"] == card["answers"]
    assert load_distilled(out)["prompt"] == ds["prompt"]


def test_the_command_line_takes_prompts_and_self_flags(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("\n".join(FILE_PROMPTS) + "\n")
    out = tmp_path / "cli"
    rc = main(["distill", "--prompts", f"{tmp_path / 'p.txt'},self:2", "--out", str(out), "--self-seed", "3",
               "--self-max-tokens", "40", "--set", "dtype=fp32", "--set", "data.max_new_tokens=4",
               "--set", "data.distill_batch_size=4", "--no-progress"])
    assert rc == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sources"][1] == "self:2" and meta["self_prompts"]["seed"] == 3
    assert len(load_distilled(out)) == 5
    assert json.loads((out / "card.json").read_text())["runs"][0]["command"]  # sys.argv: pytest's here
    for flags, says in ((["--prompts", "self:x"], "--prompts: 'self:x'"),
                        (["--prompts", "self:2", "--self-topics", str(tmp_path / "no.yaml")], "--self-topics")):
        assert main(["distill", *flags, "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["distill", "--prompts", "self:2", "--self-top-p", "2", "--out", str(tmp_path / "bad")])
    assert "--self-top-p" in capsys.readouterr().err


def test_config_keys_are_checked_by_name(tmp_path):
    for sources, says in ((["self:0"], "self:N with N a positive"), (["self:2", "self:3"], "at most one self:N"),
                          (["self"], "self:N with N")):
        with pytest.raises(Exception, match=says):
            TrainConfig(data={"sources": sources})
    from medusa.train.config import parse_config

    with pytest.raises(MedusaError, match=r"data\.self_prompts\.temprature"):
        parse_config({"data": {"sources": ["self:2"], "self_prompts": {"temprature": 1}}})
    with pytest.raises(MedusaError, match=r"data\.self_prompts\.top_p"):
        parse_config({"data": {"sources": ["self:2"], "self_prompts": {"top_p": 0}}})


def test_a_self_source_grows_in_place_and_settings_are_kept():
    base = {"model": "m", "dtype": "fp32", "max_new_tokens": 8, "max_prompt_tokens": 256,
            "self_prompts": {"seed": 0}}
    assert extends({**base, "sources": ["sharegpt", "self:4"]}, {**base, "sources": ["sharegpt", "self:9"]})
    assert not extends({**base, "sources": ["self:4"]}, {**base, "sources": ["self:3"]})
    assert not extends({**base, "sources": ["self:4"]}, {**base, "sources": ["self:4"], "self_prompts": {"seed": 1}})
    plain = {k: v for k, v in base.items() if k != "self_prompts"}
    assert extends({**plain, "sources": ["sharegpt"]}, {**base, "sources": ["sharegpt", "self:4"]})


# ---- the held-out set -------------------------------------------------------------------------------------
def test_the_heldout_set_has_its_kinds():
    from medusa.prompts import HELDOUT_KINDS, heldout_prompts, load_kinded_prompts, load_prompts

    items = heldout_prompts()
    kinds = [k for _, k in items]
    assert set(kinds) == set(HELDOUT_KINDS) and len(HELDOUT_KINDS) >= 6
    assert all(kinds.count(k) == 8 for k in HELDOUT_KINDS) and len({p for p, _ in items}) == len(items)
    assert [k for _, k in heldout_prompts(6)] == list(HELDOUT_KINDS)  # the first of each kind come first
    assert load_prompts("heldout", 12) == [p for p, _ in items[:12]]
    assert load_kinded_prompts("heldout") == items
    assert {k for _, k in load_kinded_prompts("mtbench")} >= {"writing", "math", "coding", "reasoning"}


def test_no_heldout_prompt_is_in_a_training_source():
    from medusa.prompts import heldout_prompts, mtbench_prompts, sharegpt_conversations
    from medusa.train.data import later_turns
    from medusa.train.prompt_filters import normalise

    records = sharegpt_conversations()
    training = {normalise(t["value"]) for r in records for t in r["conversations"]
                if t.get("from") == "human" and isinstance(t.get("value"), str)}
    training |= {normalise(p) for p, _ in later_turns(records)} | {normalise(p) for p in mtbench_prompts()}
    held = [normalise(p) for p, _ in heldout_prompts()]
    assert len(training) > 40_000
    assert not [p for p in held if p in training]


# ---- tau by kind in the evaluator -------------------------------------------------------------------------
def test_per_request_counts_add_up_to_the_batch_and_group_by_kind(embedded):
    from medusa.eval.config import MethodSpec
    from medusa.eval.kinds import generate_tracked, tau_by_kind
    from medusa.eval.methods import make_proposer

    proposer = make_proposer(embedded, MethodSpec(method="heads", tree="tree-8"))
    prompts = embedded.encode(["Name three primes.", "Write a haiku about rain.", "What is 12 * 7?"])
    done = []
    gen, steps, made = generate_tracked(embedded.engine, prompts, 12, proposer, None, None, done.append)
    plain = embedded.engine.generate(prompts, 12, proposer)
    assert [f.tokens for f in gen.outputs] == [f.tokens for f in plain.outputs] and len(done) == 3
    assert sum(steps) == gen.stats.row_steps
    assert sum(made) == sum((a + 1) * c for a, c in enumerate(gen.stats.accept_hist))
    by_kind = tau_by_kind(steps + steps, made + made, ["a", "b", "a"])
    # six requests over three prompts of kinds a, b, a: requests 0, 2, 3, 5 are a, 1 and 4 are b
    assert by_kind == {"a": round(2 * (made[0] + made[2]) / (2 * (steps[0] + steps[2])), 4),
                       "b": round(made[1] / steps[1], 4)}
    assert tau_by_kind([], [], ["a"]) is None
