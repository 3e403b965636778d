"""The data card of a distilled directory: `card.json` (all the numbers) and `card.md` (the same, to read).

It records the sources and their share of the prompts, the prompts' lengths in tokens and their task kinds
(the topic a self-written prompt was asked for, else a keyword guess, medusa.train.prompt_filters.guess_kind),
for self-written prompts the settings, the candidates tried, what was dropped and why (duplicates among them),
the cost, and examples kept and dropped; the answers written so far (shards, rows, answer tokens, finish
reasons, rows per dtype they were answered in: a directory resumed on other machines can mix them); and
every run that added to the directory (command, machine, torch version, dtype). `medusa distill` writes it
when the prompts are chosen and again after every shard.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path

from medusa.io import write_text_atomic

from medusa.train.prompt_filters import REASONS
from medusa.train.self_prompts import read_self_records

CARD_JSON, CARD_MD = "card.json", "card.md"
EXAMPLES = 3
SHOWN = 240  # characters of an example shown


def length_stats(values: list[int]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    return {"min": ordered[0], "median": statistics.median(ordered), "mean": round(statistics.fmean(ordered), 1),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max": ordered[-1]}


def self_summary(records: list[dict], settings: dict | None) -> dict:
    """Candidates, kept, drops by reason, the duplicate rate and the cost of the self-written prompts."""
    drops = Counter(r["drop"] for r in records if r["drop"] is not None)
    kept = [r for r in records if r["drop"] is None]
    sound = len(kept) + drops["duplicate"] + drops["near_duplicate"]  # candidates that passed the quality checks
    seconds = records[-1].get("s", 0.0) if records else 0.0
    examples_dropped = []
    for reason in REASONS:
        examples_dropped += [{"reason": reason, "prompt": r["prompt"][:SHOWN]} for r in records
                             if r["drop"] == reason][:1]
    return {"settings": settings, "candidates": len(records), "kept": len(kept),
            "dropped": {reason: drops[reason] for reason in REASONS if drops[reason]},
            "exact_duplicates": drops["duplicate"], "near_duplicates": drops["near_duplicate"],
            "dedup_rate": round((drops["duplicate"] + drops["near_duplicate"]) / sound, 4) if sound else 0.0,
            "seconds": seconds, "seconds_per_1k_kept": round(1000 * seconds / len(kept), 1) if kept else None,
            "written_tokens": sum(r["tokens"] for r in records),
            "examples": {"kept": [r["prompt"][:SHOWN] for r in kept[:EXAMPLES]],
                         "dropped": examples_dropped[: 2 * EXAMPLES]}}


def shard_stats(path: Path) -> dict:
    """Rows, answer tokens and finish reasons of one written shard, and the dtype it was answered in."""
    from datasets import load_from_disk

    ds = load_from_disk(str(path))
    return {"rows": len(ds), "answer_tokens": sum(len(r) for r in ds["response_ids"]),
            "finish": dict(Counter(ds["finish_reason"])), "dtype": shard_dtype(path)}


def shard_dtype(path: Path) -> str:
    """The dtype a shard's answers were computed in, from its count.json ("served": by an OpenAI-compatible
    server; "unknown" for shards written before it was recorded)."""
    try:
        made = json.loads((path / "count.json").read_text())
    except (OSError, ValueError):
        return "unknown"
    return made.get("dtype") or ("served" if made.get("server") else "unknown")


class DataCard:
    """The card of one distilled directory; `prompts(...)` once the prompts are chosen, `shard(...)` as each
    shard is written."""

    def __init__(self, directory: Path, meta: dict, run: dict):
        self.dir = Path(directory)
        old = self._read()
        self.data = {"name": self.dir.name, "model": meta.get("model"), "dtype": meta.get("dtype"), "meta": meta,
                     "runs": (old.get("runs") or [])[-19:] + [run],
                     "answers": {"per_shard": (old.get("answers") or {}).get("per_shard", {})}}
        self.total_shards = 0

    def _read(self) -> dict:
        try:
            return json.loads((self.dir / CARD_JSON).read_text())
        except (OSError, ValueError):
            return {}

    def prompts(self, selected: list[tuple[str, list[int], str, str]], template_tokens: int,
                self_settings: dict | None, shard_size: int) -> None:
        """selected: (prompt, chat ids, source, kind) of every prompt, in order."""
        by_source = Counter(s for _, _, s, _ in selected)
        lengths = {s: [max(len(ids) - template_tokens, 0) for _, ids, src, _ in selected if src == s] for s in by_source}
        self.data["prompts"] = len(selected)
        self.data["sources"] = [{"source": s, "prompts": c, "share": round(c / len(selected), 4),
                                 "prompt_tokens": length_stats(lengths[s]),
                                 "kinds": dict(Counter(k for _, _, src, k in selected if src == s).most_common()),
                                 "examples": [p[:SHOWN] for p, _, src, _ in selected if src == s][:EXAMPLES]}
                                for s, c in by_source.items()]
        self.data["prompt_tokens"] = length_stats([n for v in lengths.values() for n in v])
        self.data["kinds"] = dict(Counter(k for *_, k in selected).most_common())
        records = read_self_records(self.dir)
        if records:
            self.data["self_prompts"] = self_summary(records, self_settings)
        self.total_shards = -(-len(selected) // shard_size)
        per = self.data["answers"]["per_shard"]
        for path in sorted(self.dir.glob("shard-*")):
            if (path / "count.json").exists() and path.name not in per:
                per[path.name] = shard_stats(path)
            elif path.name in per and "dtype" not in per[path.name]:  # a card from before dtypes were kept
                per[path.name]["dtype"] = shard_dtype(path)
        self.write()

    def shard(self, name: str, rows: list, seconds: float) -> None:
        """A shard was written: rows are its Finished answers."""
        self.data["answers"]["per_shard"][name] = {"rows": len(rows), "answer_tokens": sum(len(g.tokens) for g in rows),
                                                   "finish": dict(Counter(g.reason for g in rows)),
                                                   "seconds_since_start": seconds,
                                                   "dtype": shard_dtype(self.dir / name)}
        self.write()

    def write(self) -> None:
        per = self.data["answers"]["per_shard"]
        finish: Counter = Counter()
        dtypes: Counter = Counter()
        for s in per.values():
            finish.update(s["finish"])
            dtypes[s.get("dtype", "unknown")] += s["rows"]
        self.data["answers"].update({"shards": len(per), "of_shards": self.total_shards,
                                     "rows": sum(s["rows"] for s in per.values()),
                                     "answer_tokens": sum(s["answer_tokens"] for s in per.values()),
                                     "finish": dict(finish), "rows_by_dtype": dict(dtypes.most_common())})
        self.data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_text_atomic(self.dir / CARD_JSON, json.dumps(self.data, indent=2, ensure_ascii=False) + "\n")
        write_text_atomic(self.dir / CARD_MD, markdown(self.data))


def _quote(text: str) -> str:
    return "`" + " ".join(text.split()).replace("`", "'")[:SHOWN] + "`"


def markdown(card: dict) -> str:
    run = card["runs"][-1]
    lines = [f"# Data card: {card['name']}", "",
             f"Target `{card['model']}`; {card.get('prompts', 0)} prompts, answers in "
             f"{card['answers']['shards']} of {card['answers']['of_shards']} shards "
             f"({card['answers']['rows']} rows, {card['answers']['answer_tokens']} answer tokens"
             + ("; finish reasons " + ", ".join(f"{k} {v}" for k, v in card["answers"]["finish"].items())
                if card["answers"]["finish"] else "") + ")"
             + ("; answered in " + ", ".join(f"{k} ({v} rows)" for k, v in card["answers"]["rows_by_dtype"].items())
                if card["answers"].get("rows_by_dtype") else "") + ".", "",
             f"Last run: `{run['command']}` on {run['machine']}, torch {run['torch']}, {run['dtype']} "
             f"({run['started']}; {len(card['runs'])} runs in all, card.json lists them).", "",
             "| source | prompts | share | prompt tokens (median / p90 / max) | kinds |", "|---|---:|---:|---|---|"]
    for s in card.get("sources", []):
        t = s["prompt_tokens"]
        kinds = ", ".join(f"{k} {v}" for k, v in list(s["kinds"].items())[:6])
        lines.append(f"| {s['source']} | {s['prompts']} | {100 * s['share']:.1f}% | "
                     f"{t.get('median', '-')} / {t.get('p90', '-')} / {t.get('max', '-')} | {kinds} |")
    sp = card.get("self_prompts")
    if sp:
        cost = f"{sp['seconds']:.0f} s of writing, {sp['seconds_per_1k_kept']} s per 1000 kept prompts" \
            if sp["seconds_per_1k_kept"] else f"{sp['seconds']:.0f} s of writing"
        lines += ["", "## Self-written prompts", "",
                  f"Settings: {json.dumps(sp['settings'])}.", "",
                  f"{sp['kept']} kept of {sp['candidates']} candidates ({sp['written_tokens']} tokens written; {cost}). "
                  f"Duplicates among the sound ones: {100 * sp['dedup_rate']:.1f}% ({sp['exact_duplicates']} exact, "
                  f"{sp['near_duplicates']} near). Dropped by reason: "
                  + (", ".join(f"{k} {v}" for k, v in sp["dropped"].items()) or "none") + ".", "",
                  "Kept, for example:", ""] + [f"- {_quote(p)}" for p in sp["examples"]["kept"]]
        if sp["examples"]["dropped"]:
            lines += ["", "Dropped, for example:", ""]
            lines += [f"- {e['reason']}: {_quote(e['prompt'])}" for e in sp["examples"]["dropped"]]
    lines += ["", "Examples of each source's prompts are in card.json (`sources[].examples`)."]
    return "\n".join(lines) + "\n"
