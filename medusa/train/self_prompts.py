"""`self:N`: training prompts the target writes itself (Magpie, Xu et al., 2024).

An aligned chat model given its own chat template up to the start of a user turn writes a plausible user
request, in the distribution of the chats it was tuned on. Where that turn starts is found from the template
itself: a conversation whose user message is a sentinel string is rendered, and the text before the sentinel
is the prefix (the system turn the template adds by default, then the user header); the text after it shows
how the turn ends (its first token, when it is a special token, stops the writing, as the end-of-sequence
tokens do). This works for any template that shows the user's message verbatim.

Candidates are sampled by the project's batched engine with a continuously refilled batch; candidate i is
drawn with the seed `seed * 1_000_003 + i` (the engine's keyed draws), so its text depends on (seed, i) and
the model only, not on its batch. They are judged in index order: dropped when empty, unfinished at
`max_tokens` (truncated), writing template tokens, under three words, mostly not letters, a repetition loop,
an MT-bench question, the same normalised text as an earlier prompt (or a prompt of another source), or a
near duplicate of an earlier one (medusa.train.prompt_filters). The first N kept are the source's prompts.

Every judged candidate is appended to `<distilled dir>/self_prompts.jsonl` as it is judged (index, text,
kind, tokens, finish, drop reason, the prompt it duplicates, cumulative seconds), so a restart reads them
back, rebuilds the duplicate indexes, and goes on from the next index: the same seed gives the same set.

Topics (`data.self_prompts.topics`, a YAML list) steer the spread: candidate i gets topic i mod T. A topic
is a name, for which the writer gets the system prompt "... The user will ask for help with <name>." (a
system prompt shifts what user turn is likely without writing any of it), or a mapping with `name` and
optionally its own `system` prompt and an `opener`, text the user turn starts with (kept in the prompt).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from medusa.decoding.target.chat import has_chat_template
from medusa.decoding.engine import Engine
from medusa.decoding.sampling import SamplingParams
from medusa.decoding.target.transformer import cache_capacity
from medusa.errors import MedusaError
from medusa.io import write_text_atomic

from medusa.train.prompt_filters import NearDuplicates, guess_kind, normalise, quality_problem

SENTINEL = "\u00a7MEDUSA-USER-TURN\u00a7"
PROMPTS_FILE = "self_prompts.jsonl"
SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class Topic:
    name: str
    system: str | None = None
    opener: str = ""


def load_topics(path: str | None) -> list[Topic]:
    """The topics of a YAML list file (names, or mappings with name, system, opener); [] without one."""
    if not path:
        return []
    where = f"data.self_prompts.topics: {path}"
    if not Path(path).is_file():
        raise MedusaError(f"{where}: no such file")
    try:
        items = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise MedusaError(f"{where}: not valid YAML: {exc}") from None
    if isinstance(items, dict) and "topics" in items:
        items = items["topics"]
    if not isinstance(items, list) or not items:
        raise MedusaError(f"{where}: must be a non-empty YAML list of topics")
    topics = []
    for k, item in enumerate(items):
        if isinstance(item, str) and item.strip():
            topics.append(Topic(item.strip(), f"You are a helpful AI assistant. The user will ask for help with "
                                              f"{item.strip()}."))
        elif isinstance(item, dict) and isinstance(item.get("name"), str) and not set(item) - {"name", "system",
                                                                                                 "opener"}:
            topics.append(Topic(item["name"], item.get("system"), item.get("opener") or ""))
        else:
            raise MedusaError(f"{where}: item {k} must be a name or a mapping with 'name' and optionally "
                              "'system' and 'opener'")
    return topics


def user_turn(tokenizer, system: str | None = None) -> tuple[str, str]:
    """(the chat rendered up to where the user's text starts, what follows the user's text)."""
    if not has_chat_template(tokenizer):
        raise MedusaError("data.sources: self:N needs a model with a chat template (this tokenizer has none)")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str) or text.count(SENTINEL) != 1:
        raise MedusaError("data.sources: self:N: the model's chat template does not show the user's message "
                          "verbatim, so where a user turn starts cannot be found")
    before, after = text.split(SENTINEL)
    return before, after


def stop_ids(tokenizer, after: str, eos: list[int]) -> list[int]:
    """The end-of-sequence tokens, and the token that closes a user turn when it is a special token."""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids)
    return list(dict.fromkeys(list(eos) + ([ids[0]] if ids and ids[0] in special else [])))


class SelfPromptWriter:
    """Writes and judges candidates until `n` are kept; see the module's docstring."""

    def __init__(self, rt, settings, n: int, path: Path, others: set[str] | None = None,
                 avoid: set[str] | None = None, batch_size: int = 32, progress: bool = True):
        self.rt, self.s, self.n, self.path = rt, settings, n, Path(path)
        self.tok = rt.tokenizer
        self.topics = load_topics(settings.topics)
        self.others, self.avoid = others or set(), avoid or set()
        self.batch_size, self.progress = batch_size, progress
        self.prefixes: dict[int, list[int]] = {}
        self.records: list[dict] = []
        self.exact: dict[str, int] = {}
        self.near = NearDuplicates(settings.similarity)
        self.kept = 0
        self.seconds = 0.0
        after = user_turn(self.tok)[1]
        self.stops = stop_ids(self.tok, after, rt.engine.eos.tolist())
        # A turn closed by plain text (`[/INST]`) rather than a special token: cut where that text appears.
        marker = after.strip().splitlines()[0].strip() if after.strip() else ""
        marker_ids = self.tok(marker, add_special_tokens=False)["input_ids"] if marker else []
        self.end_text = marker if marker_ids and marker_ids[0] not in self.stops else ""
        self.special = set(self.tok.all_special_ids) - set(self.stops)

    # ---- the record file -------------------------------------------------------------------------------
    def resume(self) -> None:
        """Read back the candidates judged so far (a torn last line is dropped) and rebuild the indexes."""
        if not self.path.exists():
            return
        good, lines = [], self.path.read_text().splitlines()
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                break
            if rec.get("i") != len(good):
                break
            good.append(rec)
        if len(good) != len(lines):
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in good))
        for rec in good:
            self._remember(rec)

    def _remember(self, rec: dict) -> None:
        self.records.append(rec)
        self.seconds = rec.get("s", self.seconds)
        if rec["drop"] is None:
            self.kept += 1
            self.exact[normalise(rec["prompt"])] = rec["i"]
            self.near.add(rec["prompt"], rec["i"])

    # ---- writing candidates -----------------------------------------------------------------------------
    def topic(self, i: int) -> Topic | None:
        return self.topics[i % len(self.topics)] if self.topics else None

    def prefix(self, i: int) -> list[int]:
        t = self.topic(i)
        key = i % len(self.topics) if self.topics else -1
        if key not in self.prefixes:
            before = user_turn(self.tok, t.system if t else None)[0] + (t.opener if t else "")
            self.prefixes[key] = list(self.tok(before, add_special_tokens=False)["input_ids"])
        return self.prefixes[key]

    def params(self, i: int) -> SamplingParams:
        return SamplingParams(temperature=self.s.temperature, top_p=self.s.top_p,
                              seed=self.s.seed * SEED_STRIDE + i)

    def judge(self, i: int, tokens: list[int], reason: str) -> dict:
        t = self.topic(i)
        text = self.tok.decode(tokens, skip_special_tokens=True)
        finish = "stop" if reason == "stop" else "length"
        if self.end_text and self.end_text in text:  # a turn closed by plain text rather than a special token
            text, finish = text[: text.index(self.end_text)], "stop"
        if any(x in self.special for x in tokens):
            finish = "template"
        prompt = ((t.opener if t else "") + text).strip()
        drop, like = quality_problem(prompt, finish), None
        key = normalise(prompt)
        if drop is None and key in self.avoid:
            drop = "eval_set"
        elif drop is None and (key in self.exact or key in self.others):
            drop, like = "duplicate", self.exact.get(key, "source")
        elif drop is None:
            like = self.near.find(prompt)
            drop = "near_duplicate" if like is not None else None
        return {"i": i, "prompt": prompt, "kind": t.name if t else guess_kind(prompt), "tokens": len(tokens),
                "finish": finish, "drop": drop, "like": like, "s": round(self.seconds, 2)}

    def run(self) -> list[dict]:
        """The first n kept records, writing candidates as needed."""
        from tqdm import tqdm

        self.resume()
        if self.kept >= self.n:
            return self.kept_records()
        cap = max(4 * self.n, self.n + 64)
        first = len(self.records)
        if first >= cap:
            return self._short(cap)
        engine = Engine(self.rt.model, self.stops)
        longest = max(len(self.prefix(i)) for i in range(first, first + max(len(self.topics), 1)))
        rows = max(1, min(self.batch_size, self.n - self.kept + 8))
        batch = engine.new_batch(rows, cache_capacity(longest, self.s.max_tokens), self.s.max_tokens)
        pending: dict[int, tuple[list[int], str]] = {}
        state = {"issued": first, "judged": first, "kept": self.kept}
        bar = tqdm(total=self.n, initial=self.kept, unit="prompt", desc="self prompts", disable=not self.progress)
        started = time.monotonic() - self.seconds
        with self.path.open("a") as log:
            def finished(done: list) -> None:
                for f in done:
                    pending[f.id] = (f.tokens, f.reason)
                while state["judged"] in pending and self.kept < self.n:
                    self.seconds = time.monotonic() - started
                    rec = self.judge(state["judged"], *pending.pop(state["judged"]))
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    self._remember(rec)
                    bar.update(rec["drop"] is None)
                    state["judged"] += 1

            def refill() -> None:
                judged = state["judged"] - first
                rate = (self.kept - state["kept"]) / judged if judged >= 16 else 1.0
                in_flight = state["issued"] - state["judged"]
                want = min(batch.free, cap - state["issued"])
                if self.kept + max(rate, 0.05) * in_flight >= 1.1 * self.n + 1:
                    want = 0  # enough in flight to finish, by the keep rate so far
                ids = list(range(state["issued"], state["issued"] + max(want, 0)))
                state["issued"] += len(ids)
                if ids:
                    finished(engine.add(batch, ids, [self.prefix(i) for i in ids], self.s.max_tokens,
                                        [self.params(i) for i in ids]).finished)

            try:
                refill()
                while self.kept < self.n and (batch.n or state["issued"] < cap):
                    if batch.n:
                        finished(engine.step(batch).finished)
                    refill()
            finally:
                bar.close()
        return self.kept_records() if self.kept >= self.n else self._short(cap)

    def _short(self, cap: int) -> list[dict]:
        print(f"self prompts: {self.kept} of {self.n} kept after {cap} candidates (the most tried); see "
              f"{self.path} for why the others were dropped", file=sys.stderr)
        return self.kept_records()

    def kept_records(self) -> list[dict]:
        return [r for r in self.records if r["drop"] is None][: self.n]


def read_self_records(directory: Path) -> list[dict]:
    """Every judged candidate recorded in a distilled directory (none when it has no self prompts)."""
    path = Path(directory) / PROMPTS_FILE
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                break
    return out
