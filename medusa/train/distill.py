"""`medusa distill`: the target answers training prompts (greedy), saved as a `datasets` dataset on disk.

The answers are the target's own outputs, which is what its heads must learn to predict. Prompts are
processed in shards of `data.shard_size`; each shard is written atomically (temporary directory, then
rename) once all its answers are in, so an interrupted run resumes with the missing shards. Decoding keeps
the batch full across shards: as soon as a row finishes, the next prompt takes its slot.

Layout of a distilled directory (what other training code can reuse, see `load_distilled`):
    <dir>/meta.json                     model, dtype, max_new_tokens, max_prompt_tokens, sources
    <dir>/shard-00000/ ...              `Dataset.save_to_disk` output, columns:
        prompt (str), prompt_ids (list[int]), response_ids (list[int]), response (str), finish_reason (str)
    <dir>/shard-00000/count.json        rows, and what answered them: dtype, machine, seconds of wall time
    <dir>/self_prompts.jsonl            with a `self:N` source: every prompt the target wrote, kept or dropped
    <dir>/card.json, card.md            the data card (medusa.train.card), rewritten after every shard

A directory may be continued in another dtype (a machine without native bf16 answers in fp32): `meta.json`
keeps the dtype it was started in, each shard's count.json the one that answered it. Greedy answers of the
two dtypes part only where the top two logits are within rounding, so heads train on either alike.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import deque
from pathlib import Path

from medusa.decoding.target.chat import chat_ids
from medusa.decoding.target.transformer import cache_capacity
from medusa.errors import MedusaError
from medusa.io import atomic_dir, cache_dir, write_json_atomic

from medusa.train.card import DataCard
from medusa.train.config import TrainConfig, self_count
from medusa.train.data import training_pairs
from medusa.train.prompt_filters import guess_kind, normalise
from medusa.train.self_prompts import PROMPTS_FILE, SelfPromptWriter


def self_settings(cfg: TrainConfig) -> dict | None:
    """The settings self-written prompts depend on (the topics file by its content too); None without a
    self:N source."""
    if not any(self_count(s) is not None for s in cfg.data.sources):
        return None
    out = cfg.data.self_prompts.model_dump()
    topics = out.get("topics")
    if topics and Path(topics).is_file():
        out["topics_sha1"] = hashlib.sha1(Path(topics).read_bytes()).hexdigest()[:12]
    return out


def default_distill_dir(cfg: TrainConfig) -> Path:
    d = cfg.data
    key = json.dumps([cfg.model, cfg.dtype, d.sources, d.max_prompt_tokens, d.max_new_tokens]
                     + ([self_settings(cfg)] if self_settings(cfg) else []))
    name = Path(cfg.model).name if cfg.model != "default" else "default"
    return cache_dir() / "distill" / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def distill_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.data.distill_dir) if cfg.data.distill_dir else default_distill_dir(cfg)


def _meta(cfg: TrainConfig) -> dict:
    d = cfg.data
    meta = {"model": cfg.model, "dtype": cfg.dtype, "sources": d.sources, "max_new_tokens": d.max_new_tokens,
            "max_prompt_tokens": d.max_prompt_tokens}
    return {**meta, "self_prompts": self_settings(cfg)} if self_settings(cfg) else meta


def extends(old: dict, new: dict) -> bool:
    """A distilled directory made with `old` settings can be continued with `new` ones: the same settings,
    with the same sources first (more sources append prompts after the ones already answered, so every
    existing shard keeps its prompts)."""
    free = ("sources", "dtype") + (() if "self_prompts" in old else ("self_prompts",))
    same = {k: v for k, v in old.items() if k not in free} == {k: v for k, v in new.items() if k not in free}
    before, after = old["sources"], new["sources"][: len(old["sources"])]
    if before and after and self_count(before[-1]) is not None and self_count(after[-1]) is not None:
        # the last source self:M grows to self:N: the first M written prompts stay where they were
        return same and before[:-1] == after[:-1] and self_count(after[-1]) >= self_count(before[-1])
    return same and after == before


# (prompt, chat-formatted ids, source, kind) of one prompt to answer
Prompt = tuple[str, list[int], str, str]


def labelled_prompts(cfg: TrainConfig, tokenizer, rt=None, out: Path | None = None,
                     progress: bool = False) -> list[Prompt]:
    """The training prompts that fit data.max_prompt_tokens, source by source, each once (an exact repeat
    of an earlier prompt is skipped), MT-bench questions left out, with their source and kind; a `self:N`
    source has the target (`rt`) write its N prompts first, recorded in `out`."""
    per_source = {s: [] if self_count(s) is not None else [p for p, _ in training_pairs([s])] for s in cfg.data.sources}
    n_self = next((self_count(s) for s in cfg.data.sources if self_count(s) is not None), None)
    if n_self is not None:
        if rt is None or out is None:
            raise MedusaError("data.sources: self:N prompts are written by the target: run `medusa distill` "
                              "(not with --server)")
        before = sum(len(per_source[s]) for s in cfg.data.sources[: _self_index(cfg)])
        if not cfg.data.limit or before < cfg.data.limit:
            per_source[cfg.data.sources[_self_index(cfg)]] = _write_self(cfg, rt, out, n_self, per_source, progress)
    seen, chosen = set(), []
    for source in cfg.data.sources:
        for item in per_source[source]:
            prompt, kind = item if isinstance(item, tuple) else (item, None)
            if prompt.strip() in seen:
                continue
            seen.add(prompt.strip())
            ids = chat_ids(tokenizer, prompt)
            if len(ids) <= cfg.data.max_prompt_tokens:
                chosen.append((prompt, ids, source, kind or guess_kind(prompt)))
                if cfg.data.limit and len(chosen) >= cfg.data.limit:
                    return chosen
    return chosen


def _self_index(cfg: TrainConfig) -> int:
    return next(i for i, s in enumerate(cfg.data.sources) if self_count(s) is not None)


def _write_self(cfg: TrainConfig, rt, out: Path, n: int, per_source: dict, progress: bool) -> list[tuple[str, str]]:
    from medusa.prompts import mtbench_prompts

    try:
        avoid = {normalise(p) for p in mtbench_prompts()}
    except MedusaError:
        avoid = set()  # no registry access: nothing to compare with
    others = {normalise(p) for s, ps in per_source.items() for p in ps}
    writer = SelfPromptWriter(rt, cfg.data.self_prompts, n, out / PROMPTS_FILE, others, avoid,
                              distill_batch_size(cfg, rt, n), progress)
    return [(r["prompt"], r["kind"]) for r in writer.run()]


def select_prompts(cfg: TrainConfig, tokenizer, rt=None, out: Path | None = None) -> list[tuple[str, list[int]]]:
    """(prompt, chat-formatted ids) of the training prompts that fit data.max_prompt_tokens."""
    return [(p, ids) for p, ids, _, _ in labelled_prompts(cfg, tokenizer, rt, out)]


# Batch sizes `distill_batch_size: auto` chooses among (one-token passes timed once per machine).
DISTILL_BATCH_SIZES = [8, 16, 32, 64, 128]


def distill_batch_size(cfg: TrainConfig, rt, prompts: int) -> int:
    """The configured batch size, or for `auto` the smallest measured batch size within 5% of the best
    answer tokens per second, B / ms(B rows, 1 token), on the calibrated curve (one-token passes over a
    256-token prefix); never more rows than prompts."""
    size = cfg.data.distill_batch_size
    if size != "auto":
        return size
    from medusa.runtime.calibrate import load_or_measure

    cal = load_or_measure(rt, batch_sizes=DISTILL_BATCH_SIZES, tokens=[1])
    rate = {b: b / cal.ms(b, 1) for b in DISTILL_BATCH_SIZES}
    best = max(rate.values())
    chosen = min(b for b, r in rate.items() if r >= 0.95 * best)
    print(f"distill batch size {chosen} (auto: " + ", ".join(f"{b}: {r * 1000:.0f} tok/s" for b, r in rate.items())
          + ")", file=sys.stderr)
    return max(1, min(chosen, prompts))


def answer_all(engine, prompts: list[list[int]], max_new_tokens: int, batch_size: int, progress=None,
               on_finish=None) -> list:
    """Greedy answers for every prompt, with a continuously refilled batch. Returns Finished per prompt;
    `on_finish(finished)` hears of each answer as it is complete (id: the prompt's index)."""
    capacity = cache_capacity(max(len(p) for p in prompts), max_new_tokens)
    batch = engine.new_batch(min(batch_size, len(prompts)), capacity, max_new_tokens)
    queue = deque(range(len(prompts)))
    results = {}

    def done(finished: list) -> None:
        for f in finished:
            results[f.id] = f
            if on_finish is not None:
                on_finish(f)

    def refill() -> None:
        ids = [queue.popleft() for _ in range(min(batch.free, len(queue)))]
        if ids:
            done(engine.add(batch, ids, [prompts[i] for i in ids], max_new_tokens).finished)

    refill()
    while batch.n:
        out = engine.step(batch)
        done(out.finished)
        if progress is not None:
            progress.update(sum(out.count_list))
        refill()
    return [results[i] for i in range(len(prompts))]


def run_distill(cfg: TrainConfig, runtime=None, show_progress: bool = True, server: str | None = None,
                concurrency: int = 8, api_key: str | None = None, server_model: str | None = None) -> Path:
    """Distil every missing shard; returns the dataset directory. The prompts of all missing shards share
    one continuously refilled batch (no shard waits for its slowest answer before the next starts); a shard
    is written as soon as its last answer is in. With `server` (an OpenAI-compatible URL) the answers come
    from there, `concurrency` requests at a time (`medusa.train.distill_server`), and only the target's
    tokenizer is loaded here."""
    from datasets import Dataset
    from tqdm import tqdm

    from medusa.runtime import Runtime

    out = distill_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    if meta_path.exists() and not extends(json.loads(meta_path.read_text()), _meta(cfg)):
        raise MedusaError(f"data.distill_dir: {out} holds answers made with other settings "
                          f"({meta_path.read_text().strip()}); choose another directory")
    meta = _meta(cfg)
    if meta_path.exists():  # the dtype it was started in stays; each shard records its own
        meta["dtype"] = json.loads(meta_path.read_text()).get("dtype", cfg.dtype)
    write_json_atomic(meta_path, meta)
    if server is None:
        rt = runtime or Runtime.load(cfg.model, heads="none", dtype=cfg.dtype)
        if runtime is None:  # only the engine runs here: the model's weights need not be held twice
            freed = rt.model.release_source_weights(rt.hf_model)
            print(f"distill: {freed / 2**30:.1f} GiB of duplicate weights released", file=sys.stderr)
        tokenizer = rt.tokenizer
    else:
        from transformers import AutoTokenizer

        from medusa.decoding.target.model import resolve_model_dir
        from medusa.train.distill_server import served_model

        rt, tokenizer = None, AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model))
        server_model = served_model(server, api_key, server_model)
    labelled = labelled_prompts(cfg, tokenizer, rt, out, show_progress)
    if not labelled:
        raise MedusaError("data.sources: no prompt fits data.max_prompt_tokens")
    prompts = [(p, ids) for p, ids, _, _ in labelled]
    card = DataCard(out, meta, _run_facts(cfg, rt, server))
    card.prompts(labelled, len(chat_ids(tokenizer, "")), self_settings(cfg), cfg.data.shard_size)
    if server is not None:
        from medusa.train.distill_server import check_same_tokenizer

        check_same_tokenizer(server, server_model, tokenizer, *prompts[0], api_key)
    size = cfg.data.shard_size
    shards = [(i, prompts[s: s + size]) for i, s in enumerate(range(0, len(prompts), size))]
    todo = [(i, chunk) for i, chunk in shards if _shard_count(out / f"shard-{i:05d}") != len(chunk)]
    if not todo:
        return out
    flat = [(i, k) for i, chunk in todo for k in range(len(chunk))]  # (shard, index in it) per prompt
    chunks = dict(todo)
    answers: dict[int, dict[int, object]] = {i: {} for i, _ in todo}
    if server is None:
        batch_size = distill_batch_size(cfg, rt, len(prompts))
        made = {"dtype": cfg.dtype, "machine": rt.machine.describe()}
    else:
        made = {"server": server, "served_model": server_model, "concurrency": concurrency}
    started = time.monotonic()
    bar = tqdm(total=len(flat) * cfg.data.max_new_tokens, unit="tok", desc=f"distill {len(todo)}/{len(shards)} shards",
               disable=not show_progress)

    def finished(f) -> None:
        shard, k = flat[f.id]
        answers[shard][k] = f
        chunk = chunks[shard]
        if len(answers[shard]) == len(chunk):
            got = [answers[shard][k] for k in range(len(chunk))]
            del answers[shard]
            rows = {"prompt": [p for p, _ in chunk], "prompt_ids": [ids for _, ids in chunk],
                    "response_ids": [g.tokens for g in got],
                    "response": [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in got],
                    "finish_reason": [g.reason for g in got]}
            seconds = round(time.monotonic() - started, 1)
            _save_shard(Dataset.from_dict(rows), out / f"shard-{shard:05d}", {**made, "seconds_since_start": seconds})
            card.shard(f"shard-{shard:05d}", got, seconds)

    try:
        if server is None:
            answer_all(rt.engine, [chunks[i][k][1] for i, k in flat], cfg.data.max_new_tokens, batch_size, bar,
                       finished)
        else:
            from medusa.train.distill_server import answer_all_served

            answer_all_served(server, server_model, [chunks[i][k][0] for i, k in flat], cfg.data.max_new_tokens,
                              tokenizer, concurrency, finished, bar, api_key)
    finally:
        bar.close()
    return out


def _run_facts(cfg: TrainConfig, rt, server: str | None) -> dict:
    """What the card records of a run: when, the command, the machine (or the server), torch, the dtype."""
    import torch

    from medusa.decoding.target.hardware import command_line

    where = {"machine": f"server {server}"} if server else {"machine": rt.machine.describe(),
                                                            "machine_facts": rt.machine.to_dict()}
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command_line(), **where,
            "torch": torch.__version__, "dtype": cfg.dtype}


def _shard_count(path: Path) -> int:
    info = path / "count.json"
    return json.loads(info.read_text())["rows"] if info.exists() else -1


def _save_shard(ds, path: Path, made: dict | None = None) -> None:
    def fill(tmp: Path) -> None:
        ds.save_to_disk(str(tmp))
        (tmp / "count.json").write_text(json.dumps({"rows": len(ds), **(made or {})}))

    atomic_dir(path, fill)


def load_shards(directory: str | Path) -> list[tuple[str, object]]:
    """(name, dataset) of every complete shard, in order."""
    from datasets import load_from_disk

    directory = Path(directory)
    shards = sorted(p for p in directory.glob("shard-*") if (p / "count.json").exists())
    if not shards:
        raise MedusaError(f"data.distill_dir: {directory} holds no distilled shards; run `medusa distill` first")
    return [(p.name, load_from_disk(str(p))) for p in shards]


def load_distilled(directory: str | Path):
    """All complete shards of a distilled directory as one `datasets.Dataset`."""
    from datasets import concatenate_datasets

    return concatenate_datasets([ds for _, ds in load_shards(directory)])
