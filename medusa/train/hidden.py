"""The target's final (normed) hidden states, and the flat per-position table the heads train on.

`PositionTable` keeps, for every position that feeds at least one head label: the hidden state [N, H]
(bf16 on disk), the token at that position, whether it is an answer token, and where its sequence ends.
Head k's label at flat index i is `tokens[i + k + 2]` when that index is inside the same sequence and is
an answer token. The Medusa-1 fast path builds the table once (one frozen forward per sequence) and trains
for many epochs from it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch
from safetensors.torch import load_file, save_file

from medusa.io import write_atomic
from medusa.train.data import length_batches, pad_batch

T = TypeVar("T")


@dataclass
class PositionTable:
    hidden: torch.Tensor    # [N, H]
    tokens: torch.Tensor    # [N] long
    answer: torch.Tensor    # [N] bool, the token is an answer token (a valid label)
    seq_end: torch.Tensor   # [N] long, flat index one past the end of this position's sequence

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def trainable(self) -> torch.Tensor:
        """Flat indices whose head-0 label exists (every other head's label exists only if this one does)."""
        idx = torch.arange(len(self))
        nxt = (idx + 2).clamp(max=len(self) - 1)
        return idx[(idx + 2 < self.seq_end) & self.answer[nxt]]

    def labels(self, idx: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[B, num_heads] labels of the positions idx (-100 where none)."""
        out = torch.full((idx.shape[0], num_heads), -100, dtype=torch.long)
        for k in range(num_heads):
            j = idx + k + 2
            jc = j.clamp(max=len(self) - 1)
            ok = (j < self.seq_end[idx]) & self.answer[jc]
            out[:, k] = torch.where(ok, self.tokens[jc], -100)
        return out

    @classmethod
    def cat(cls, tables: list["PositionTable"]) -> "PositionTable":
        offsets, n = [], 0
        for t in tables:
            offsets.append(n)
            n += len(t)
        return cls(torch.cat([t.hidden for t in tables]), torch.cat([t.tokens for t in tables]),
                   torch.cat([t.answer for t in tables]),
                   torch.cat([t.seq_end + o for t, o in zip(tables, offsets)]))

    def save(self, path: Path, key: str) -> None:
        save_keyed(path, {"hidden": self.hidden, "tokens": self.tokens, "answer": self.answer.to(torch.uint8),
                          "seq_end": self.seq_end}, key)

    @classmethod
    def load(cls, path: Path) -> "PositionTable":
        t = load_file(str(path))
        return cls(t["hidden"], t["tokens"], t["answer"].bool(), t["seq_end"])


def hf_hidden_fn(model) -> Callable[[dict], torch.Tensor]:
    """Final normed hidden state from an HF causal LM (hidden_states[-1] is after the final norm)."""
    def run(batch: dict) -> torch.Tensor:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_hidden_states=True, use_cache=False)
        return out.hidden_states[-1]
    return run


def table_hidden_fn(model, device: torch.device) -> Callable[[dict], torch.Tensor]:
    """The frozen base's hidden states for a CPU batch, computed on `device` and kept on the CPU (where
    cached tables live)."""
    fn = hf_hidden_fn(model)
    return lambda batch: fn({k: v.to(device) for k, v in batch.items()}).cpu()


@torch.inference_mode()
def build_table(examples: list[dict], hidden_fn: Callable[[dict], torch.Tensor], batch_tokens: int = 4096,
                progress: bool = False, store_dtype: torch.dtype = torch.bfloat16) -> PositionTable:
    """Run the frozen target over every example (length-sorted batches) and keep the answer window."""
    from tqdm import tqdm

    parts: dict[int, tuple] = {}
    bar = tqdm(total=sum(len(e["input_ids"]) for e in examples), unit="tok", desc="hidden states",
               disable=not progress)
    for picked in length_batches(examples, batch_tokens):
        chunk = [examples[o] for o in picked]
        hidden = hidden_fn(pad_batch(chunk))
        for r, (o, e) in enumerate(zip(picked, chunk)):
            mask = torch.tensor(e["loss_mask"])
            start = max(int(mask.nonzero()[0, 0]) - 1, 0)  # the last prompt position predicts the answer
            n = len(e["input_ids"])
            parts[o] = (hidden[r, start:n].to(store_dtype).clone(), torch.tensor(e["input_ids"][start:n]),
                        mask[start:n].bool())
            bar.update(n)
    bar.close()
    hs, toks, ans, ends = [], [], [], []
    offset = 0
    for o in range(len(examples)):
        h, t, a = parts[o]
        hs.append(h), toks.append(t), ans.append(a)
        offset += t.shape[0]
        ends.append(torch.full((t.shape[0],), offset, dtype=torch.long))
    return PositionTable(torch.cat(hs), torch.cat(toks).long(), torch.cat(ans), torch.cat(ends))


def table_key(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def save_keyed(path: Path, tensors: dict[str, torch.Tensor], key: str) -> None:
    """Tensors in one safetensors file (written atomically) that records the `key` of its inputs."""
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"key": key}))


def fresh(path: Path, key: str) -> bool:
    """Whether the cache file at `path` exists and was built from the inputs `key` names."""
    if not path.exists():
        return False
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("key") == key


def cached(path: Path, key: str, build: Callable[[], T], load: Callable[[Path], T]) -> T:
    """Load the cache at `path` if it was built from the same inputs (`key`), else build it and save it
    (`build()`'s result has `.save(path, key)`)."""
    if fresh(path, key):
        return load(path)
    value = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    value.save(path, key)
    return value


def cached_table(path: Path, key: str, build: Callable[[], PositionTable]) -> PositionTable:
    """Load the table at `path` if it was built from the same inputs (`key`), else build and save it."""
    return cached(path, key, build, PositionTable.load)
