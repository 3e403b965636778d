"""What one optimizer step trains on, from the cached hidden-state table or from live forwards of the target.

Both sources yield the same `StepBatch`: `grad_accum` micro-batches of this process's share of the global
batch, each with the head labels and the label counts of the whole global batch (the loss normaliser).
Every process draws the same global order (seeded per epoch, so a resumed run continues it) and takes its
slice of every micro-batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from medusa.errors import MedusaError
from medusa.train.data import head_labels, pad_batch
from medusa.train.dist import Dist
from medusa.train.hidden import PositionTable, build_table, cached_table, table_key


@dataclass
class MicroBatch:
    labels: torch.Tensor                 # [N, K] head labels (-100: none)
    norm: torch.Tensor                   # [K] label count per head in the global batch
    hidden: torch.Tensor | None = None   # [N, H] the base's hidden states (None: the strategy runs the base)
    teacher: torch.Tensor | None = None  # [N, K, H] the base's hidden state at t+k+1 (loss kind "kl")
    tokens: dict | None = None           # the padded sequences, for a strategy that runs the base itself
    base_norm: torch.Tensor | None = None  # answer tokens in the global batch (the base's own loss)


@dataclass
class StepBatch:
    micro: list[MicroBatch]
    positions: int                       # head-0 labels in the global batch


class Batches:
    """A seeded global order over `items` things, cut into steps of batch_size * grad_accum of them."""

    too_few = "{unit} items per step exceed the {items} available"

    def __init__(self, cfg, d: Dist, items: int):
        self.cfg, self.d, self.items = cfg, d, items
        unit = cfg.batch_size * cfg.grad_accum
        self.per_epoch = items // unit
        if self.per_epoch == 0:
            raise MedusaError("batch_size: " + self.too_few.format(unit=unit, items=items))
        self.micro = cfg.batch_size // d.world
        self.kl = cfg.loss.kind == "kl"

    def total_steps(self) -> int:
        return self.cfg.max_steps or max(1, math.ceil(self.cfg.epochs * self.per_epoch))

    def steps(self, start: int, total: int) -> Iterator[StepBatch]:
        if self.cfg.batch_size % self.d.world:
            raise MedusaError(f"batch_size: {self.cfg.batch_size} is not divisible by the {self.d.world} processes")
        for step in range(start, total):
            yield self.batch(self._global_indices(step))

    def _global_indices(self, step: int) -> list[torch.Tensor]:
        """The global batch of every micro-step of `step`."""
        cfg = self.cfg
        epoch, within = divmod(step, self.per_epoch)
        order = epoch_order(cfg.seed, epoch, self.items)
        first = within * cfg.grad_accum
        return [order[(first + m) * cfg.batch_size: (first + m + 1) * cfg.batch_size] for m in range(cfg.grad_accum)]

    def batch(self, global_idx: list[torch.Tensor]) -> StepBatch:
        raise NotImplementedError


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, items: int) -> torch.Tensor:
    """The shuffled order of `items` for one epoch, the same on every rank and after a resume; drawn once
    per epoch (a table can hold millions of positions), not once per step. Read-only."""
    return torch.randperm(items, generator=torch.Generator().manual_seed(seed * 100003 + epoch))


class TableBatches(Batches):
    """Positions of the cached hidden-state table (Medusa-1's fast path: no forward of the target)."""

    too_few = "{unit} positions per step exceed the {items} available"

    def __init__(self, cfg, d: Dist, table: PositionTable):
        self.table = table
        self.positions = table.trainable()
        super().__init__(cfg, d, len(self.positions))

    def answers(self) -> torch.Tensor:
        return self.table.tokens[self.table.answer]

    def batch(self, global_idx: list[torch.Tensor]) -> StepBatch:
        k, dev, table = self.cfg.heads.num_heads, self.d.device, self.table
        sel = [self.positions[g] for g in global_idx]
        labels = [table.labels(s, k) for s in sel]
        norm = sum((lab >= 0).sum(0) for lab in labels).to(dev)
        micro = []
        for s, lab in zip(sel, labels):
            idx, lab = s[self.d.mine(self.micro)], lab[self.d.mine(self.micro)].to(dev)
            teacher = teacher_from_table(table, idx, k).to(dev) if self.kl else None
            micro.append(MicroBatch(lab, norm, table.hidden[idx].to(dev), teacher))
        return StepBatch(micro, int(norm[0]))


class SequenceBatches(Batches):
    """Whole sequences; with `hidden_fn` the frozen target's hidden states are computed here (Medusa-1 without
    the cache), without it the strategy runs the base on `tokens` (Medusa-2, the base trains too)."""

    too_few = "{unit} sequences per step exceed the {items} training examples"

    def __init__(self, cfg, d: Dist, examples: list[dict], hidden_fn: Callable[[dict], torch.Tensor] | None):
        self.examples, self.hidden_fn = examples, hidden_fn
        super().__init__(cfg, d, len(examples))

    def answers(self) -> torch.Tensor:
        return torch.tensor([t for e in self.examples for t, m in zip(e["input_ids"], e["loss_mask"]) if m],
                            dtype=torch.long)

    def batch(self, global_idx: list[torch.Tensor]) -> StepBatch:
        k, dev = self.cfg.heads.num_heads, self.d.device
        batches = [pad_batch([self.examples[int(i)] for i in g]) for g in global_idx]
        labels = [head_labels(b["input_ids"], b["loss_mask"], k) for b in batches]
        norm = sum((lab >= 0).sum((0, 1)) for lab in labels).to(dev)
        base_norm = sum(b["loss_mask"][:, 1:].sum() for b in batches).to(dev)
        micro = []
        for b, lab in zip(batches, labels):
            part = {name: v[self.d.mine(self.micro)].to(dev) for name, v in b.items()}
            lab = lab[self.d.mine(self.micro)].to(dev)
            micro.append(self._micro(part, lab, norm, base_norm))
        return StepBatch(micro, int(norm[0]))

    def _micro(self, part: dict, lab: torch.Tensor, norm: torch.Tensor, base_norm: torch.Tensor) -> MicroBatch:
        if self.hidden_fn is None:
            return MicroBatch(lab, norm, tokens=part, base_norm=base_norm)
        with torch.no_grad():
            hidden = self.hidden_fn(part)
        keep = (lab >= 0).any(-1)
        teacher = teacher_from_seq(hidden, lab.shape[-1])[keep] if self.kl else None
        return MicroBatch(lab[keep], norm, hidden[keep], teacher)


def teacher_from_table(table: PositionTable, idx: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, K, H]: the hidden state at flat index idx + k + 1 (kept inside the table)."""
    j = torch.stack([(idx + k + 1).clamp(max=len(table) - 1) for k in range(num_heads)], 1)
    return table.hidden[j]


def teacher_from_seq(hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, T, H] -> [B, T, K, H]: the hidden state at t + k + 1 (the last one past the end)."""
    t = hidden.shape[1]
    j = (torch.arange(t)[:, None] + torch.arange(1, num_heads + 1)[None]).clamp(max=t - 1)  # [T, K]
    return hidden[:, j]


def cached_tables(groups: list[tuple[str, list[dict]]], base: dict, dtype: str, directory: Path, d: Dist,
                  hidden_fn: Callable[[dict], torch.Tensor]) -> PositionTable:
    """One cached table per group under `directory` (reused while that group is unchanged), concatenated."""
    tables = []
    for name, exs in groups:
        key = table_key(base, dtype, name, len(exs), [e["input_ids"] for e in exs])
        path = directory / f"{name}.safetensors"
        build = lambda exs=exs: build_table(exs, hidden_fn, progress=d.main)
        if d.world > 1:
            # One process builds the cache, the others wait and read it.
            if d.main:
                cached_table(path, key, build)
            d.barrier()
        tables.append(cached_table(path, key, build))
    return PositionTable.cat(tables)
