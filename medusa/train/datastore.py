"""`medusa datastore build`: a corpus as a memory-mapped suffix automaton (`medusa.decoding.proposers.suffix.Datastore`)
that retrieval drafts from beside the row's own text (`--datastore DIR`).

    medusa datastore build --from distilled --out runs/datastore        # the target's own distilled answers
    medusa datastore build --from texts.jsonl --out runs/datastore      # any texts, tokenised raw

`distilled[:DIR]` reads the answers of a `medusa distill` directory (default data/distill-sharegpt): the
target's own greedy outputs, as token ids. A file holds one text per record (.txt lines, .json/.jsonl
strings or records with `text`, `prompt` and `response`; .parquet), tokenised without a chat template.
Beside the arrays, `datastore.json` records the source, the sizes and the vocabulary it was built for.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from medusa.errors import MedusaError

DEFAULT_DISTILLED = "data/distill-sharegpt"


def add_parser(sub) -> None:
    p = sub.add_parser("datastore", help="build a retrieval datastore (suffix automaton) from a corpus")
    actions = p.add_subparsers(dest="action", required=True)
    b = actions.add_parser("build", help="build one from distilled answers or a text file")
    b.add_argument("--from", dest="source", required=True, help="distilled[:DIR] or a .txt/.json/.jsonl/.parquet file")
    b.add_argument("--out", required=True, help="output directory")
    b.add_argument("--model", default="default", help="whose tokenizer tokenises a text file (default: embedded)")
    b.add_argument("--limit", type=int, default=None, help="at most this many sequences")
    b.set_defaults(func=run)


def _distilled(directory: str, limit: int | None) -> tuple[list[list[int]], int | None]:
    from medusa.train.distill import load_shards

    seqs: list[list[int]] = []
    for _, ds in load_shards(directory):
        seqs.extend(list(r) for r in ds["response_ids"])
        if limit is not None and len(seqs) >= limit:
            break
    meta = Path(directory) / "meta.json"
    model = json.loads(meta.read_text()).get("model") if meta.is_file() else None
    return seqs[:limit], model


def _texts(path: Path, model: str, limit: int | None) -> tuple[list[list[int]], int]:
    from transformers import AutoTokenizer

    from medusa.decoding.target.model import resolve_model_dir
    from medusa.prompts import read_records

    texts = []
    for i, item in enumerate(read_records(path, "--from")):
        if isinstance(item, dict):
            item = "\n".join(str(item[k]) for k in ("text", "prompt", "response") if item.get(k))
        if not isinstance(item, str) or not item:
            raise MedusaError(f"--from {path}: record {i} is neither a string nor has text, prompt or response")
        texts.append(item)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model))
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[:limit]], len(tokenizer)


def build(source: str, out: str | Path, model: str = "default", limit: int | None = None) -> dict:
    from medusa.decoding.target.hardware import provenance
    from medusa.decoding.proposers.suffix import Datastore
    from medusa.io import atomic_dir

    if limit is not None and limit < 1:
        raise MedusaError(f"--limit must be positive, got {limit}")
    kind, _, arg = source.partition(":")
    vocab = None
    if kind == "distilled":
        seqs, model_name = _distilled(arg or DEFAULT_DISTILLED, limit)
        model = model_name or model
    else:
        path = Path(source)
        if not path.is_file():
            raise MedusaError(f"--from: {source!r} is neither distilled[:DIR] nor a file")
        seqs, vocab = _texts(path, model, limit)
    if not seqs:
        raise MedusaError(f"--from {source}: no sequences")
    start = time.perf_counter()
    store = Datastore.build(seqs)
    info = {"source": source, "model": model, "vocab_size": vocab, "sequences": len(seqs),
            "tokens": sum(len(s) for s in seqs), "states": store.num_states,
            "build_seconds": round(time.perf_counter() - start, 1), **provenance(None)}

    def fill(tmp: Path) -> None:
        store.save(tmp)
        (tmp / "datastore.json").write_text(json.dumps(info, indent=2) + "\n")

    atomic_dir(Path(out), fill)
    info["bytes"] = sum(f.stat().st_size for f in Path(out).iterdir())
    return info


def run(args: argparse.Namespace) -> int:
    info = build(args.source, args.out, args.model, args.limit)
    print(f"datastore {args.out}: {info['sequences']} sequences, {info['tokens']} tokens, {info['states']} states, "
          f"{info['bytes'] / 2**20:.1f} MiB, built in {info['build_seconds']} s")
    return 0
