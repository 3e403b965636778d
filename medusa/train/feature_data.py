"""The cached features a feature head (`medusa train-feature`) trains on.

Every training sequence goes through the frozen target once, in length-sorted batched prefills; its
features (final normed hidden states, or fused layers then the final one) and the target's greedy next
token at every position are kept in a flat per-position table, cached under `run_dir/features/` (bf16, one
file per chunk of sequences, reused while the data is unchanged, so an interrupted extraction resumes at
the first missing chunk). Missing chunks are extracted several at a time (`EXTRACT_SEQUENCES`), their sequences
length-sorted together: a chunk of one distilled shard (32 sequences) alone pads its batches by about 28%,
eight together by about 6%. Training reads the feature rows from those files batch by batch (memory-mapped),
so the run's memory does not grow with the data or with the width of fused features.
"""

from __future__ import annotations

import bisect
import itertools
from pathlib import Path

import torch

from medusa.train.batches import epoch_order
from medusa.train.data import length_batches, pad_batch
from medusa.train.hidden import cached, fresh, save_keyed


class FeatureRows:
    """The [N, F] feature rows of a table, kept in pieces: tensors in memory, or slices of cached safetensors
    files that are read on demand (memory-mapped: a run over many sequences, or fused features several layers
    wide, needs no more memory than its batches). A sequence's rows never straddle two pieces."""

    def __init__(self, pieces: list):
        self.pieces = pieces
        shapes = [p.shape if isinstance(p, torch.Tensor) else p.get_shape() for p in pieces]
        self.starts = [0, *itertools.accumulate(shape[0] for shape in shapes)]
        self.width = shapes[0][1]

    def __len__(self) -> int:
        return self.starts[-1]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) (within one piece) as a tensor of their own."""
        i = bisect.bisect_right(self.starts, start) - 1
        if stop > self.starts[i + 1]:
            raise ValueError(f"rows {start}:{stop} straddle two pieces of the feature table")
        return self.pieces[i][start - self.starts[i]: stop - self.starts[i]]

    def all(self) -> torch.Tensor:
        return torch.cat([self.rows(a, b) for a, b in zip(self.starts, self.starts[1:])])


class Features:
    """Flat per-position table of many sequences: feats [N, F] (`FeatureRows`), tokens [N], answer [N]
    bool, top [N] (the target's greedy next token after each position), offsets [E+1]."""

    def __init__(self, feats, tokens, answer, top, offsets):
        self.feats = feats if isinstance(feats, FeatureRows) else FeatureRows([feats])
        self.tokens, self.answer, self.top, self.offsets = tokens, answer, top, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def seq(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def lengths(self) -> torch.Tensor:
        """[E] positions of each sequence."""
        return self.offsets[1:] - self.offsets[:-1]

    def positions(self) -> int:
        """Positions with a label (t + 2 is an answer token)."""
        return sum(int(self.answer[self.seq(i)][2:].sum()) for i in range(len(self)))

    def answer_tokens(self) -> torch.Tensor:
        """Every answer token of every sequence (what the draft vocabulary is chosen from)."""
        return self.tokens[self.answer]

    @classmethod
    def cat(cls, parts: list["Features"]) -> "Features":
        offs, base = [torch.zeros(1, dtype=torch.long)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        return cls(FeatureRows([piece for p in parts for piece in p.feats.pieces]),
                   torch.cat([p.tokens for p in parts]), torch.cat([p.answer for p in parts]),
                   torch.cat([p.top for p in parts]), torch.cat(offs))

    def split(self, counts: list[int]) -> list["Features"]:
        """The table cut into consecutive tables of `counts` sequences each (an in-memory table)."""
        out, first = [], 0
        for n in counts:
            a, b = int(self.offsets[first]), int(self.offsets[first + n])
            out.append(Features(self.feats.rows(a, b), self.tokens[a:b], self.answer[a:b], self.top[a:b],
                                self.offsets[first: first + n + 1] - a))
            first += n
        return out

    def save(self, path: Path, key: str) -> None:
        save_keyed(path, {"feats": self.feats.all(), "tokens": self.tokens, "answer": self.answer.to(torch.uint8),
                          "top": self.top, "offsets": self.offsets}, key)

    @classmethod
    def load(cls, path: Path) -> "Features":
        """The table in `path`, its feature rows left in the file (read per batch, memory-mapped)."""
        from safetensors import safe_open

        f = safe_open(str(path), "pt")  # kept open by the slice: the rows are read when a batch asks for them
        small = {name: f.get_tensor(name) for name in ("tokens", "answer", "top", "offsets")}
        return cls(FeatureRows([f.get_slice("feats")]), small["tokens"], small["answer"].bool(), small["top"],
                   small["offsets"])

    def batch(self, pick: list[int], max_len: int) -> tuple[torch.Tensor, ...]:
        """Sequences `pick`, cut to max_len and padded: feats [B, T, F] (float), tokens, answer, top, valid
        [B, T]."""
        seqs = [self.seq(i) for i in pick]
        t = min(max_len, max(s.stop - s.start for s in seqs))
        b = len(seqs)
        f = torch.zeros(b, t, self.feats.width)
        tok = torch.zeros(b, t, dtype=torch.long)
        ans = torch.zeros(b, t, dtype=torch.bool)
        top = torch.zeros(b, t, dtype=torch.long)
        valid = torch.zeros(b, t, dtype=torch.bool)
        for r, s in enumerate(seqs):
            n = min(t, s.stop - s.start)
            f[r, :n] = self.feats.rows(s.start, s.start + n).float()
            tok[r, :n] = self.tokens[s.start: s.start + n]
            ans[r, :n] = self.answer[s.start: s.start + n]
            top[r, :n] = self.top[s.start: s.start + n]
            valid[r, :n] = True
        return f, tok, ans, top, valid


class OnlineFeatures:
    """`features: online`: the same interface as `Features`, but a batch's features come from running the
    frozen target on its sequences when the batch is drawn, inside the training step; nothing is cached.
    They are rounded to bf16 as cached ones are, so a run trains alike in both modes (up to the batch
    shapes the target runs at)."""

    def __init__(self, examples: list[dict], fn, device: torch.device | str = "cpu"):
        self.examples, self.fn, self.device = examples, fn, torch.device(device)

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(e["input_ids"]) for e in self.examples])

    def positions(self) -> int:
        return sum(sum(e["loss_mask"][2:]) for e in self.examples)

    def answer_tokens(self) -> torch.Tensor:
        return torch.tensor([t for e in self.examples for t, m in zip(e["input_ids"], e["loss_mask"]) if m],
                            dtype=torch.long)

    @torch.no_grad()
    def batch(self, pick: list[int], max_len: int) -> tuple[torch.Tensor, ...]:
        chunk = [{k: self.examples[i][k][:max_len] for k in ("input_ids", "loss_mask")} for i in pick]
        padded = {k: v.to(self.device) for k, v in pad_batch(chunk).items()}
        feats, top = self.fn(padded)
        return (feats.to(torch.bfloat16).float(), padded["input_ids"], padded["loss_mask"].bool(), top,
                padded["attention_mask"].bool())


def sequence_order(seed: int, epoch: int, lengths: torch.Tensor, group: int = 0, window: int = 64) -> torch.Tensor:
    """One epoch's order of the sequences (seeded: the same after a resume). With `group` (a batch size),
    batches of similar lengths, for less padding: each window of `window` batches of the shuffled order is
    sorted by length and cut into batches, and the batches are shuffled again."""
    order = epoch_order(seed, epoch, len(lengths))
    if not group:
        return order
    ranked = torch.cat([w[torch.argsort(lengths[w], stable=True)] for w in order.split(group * window)])
    n = len(ranked) // group
    shuffle = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch + 1))
    return torch.cat([ranked[: n * group].view(n, group)[shuffle].flatten(), ranked[n * group:]])


def feature_fn(model, layers: list[int]):
    """batch -> (features [B, T, F], greedy next token [B, T]) from an HF causal LM."""
    def run(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_hidden_states=True, use_cache=False)
        top = out.logits.argmax(-1)
        final = len(out.hidden_states) - 1
        if layers:  # the fused features, then the final one (the targets) unless it is the last fused
            picked = list(layers) + ([final] if layers[-1] != final else [])
            return torch.cat([out.hidden_states[i] for i in picked], -1), top
        return out.hidden_states[-1], top
    return run


@torch.no_grad()  # not inference_mode: a sharded target (FSDP2) gathers into tensors reused by later passes
def extract(examples: list[dict], fn, batch_tokens: int = 4096, progress: bool = False) -> Features:
    """Run the frozen target over every example (length-sorted batches); keep every position."""
    from tqdm import tqdm

    parts: dict[int, tuple] = {}
    bar = tqdm(total=sum(len(e["input_ids"]) for e in examples), unit="tok", desc="features", disable=not progress)
    for picked in length_batches(examples, batch_tokens):
        chunk = [examples[o] for o in picked]
        feats, top = fn(pad_batch(chunk))
        for r, (o, e) in enumerate(zip(picked, chunk)):
            n = len(e["input_ids"])
            parts[o] = (feats[r, :n].to(torch.bfloat16).clone(), torch.tensor(e["input_ids"]),
                        torch.tensor(e["loss_mask"]).bool(), top[r, :n].clone())
            bar.update(n)
    bar.close()
    seqs = [parts[o] for o in range(len(examples))]
    offsets = torch.tensor([0] + [len(s[1]) for s in seqs]).cumsum(0)
    return Features(torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs]).long(),
                    torch.cat([s[2] for s in seqs]), torch.cat([s[3] for s in seqs]).long(), offsets)


# Missing chunks are extracted together until they hold this many sequences (then each is saved to its file):
# fewer padded positions, at the price of redoing up to this many sequences after an interruption.
EXTRACT_SEQUENCES = 256


def extraction_groups(chunks: list[tuple[str, str, list[dict]]], together: int | None = None) -> list[list]:
    """Consecutive chunks (name, key, examples) grouped for one `extract` each: up to `together` sequences
    (default `EXTRACT_SEQUENCES`), a larger chunk alone."""
    limit = together or EXTRACT_SEQUENCES
    groups: list[list] = []
    n = 0
    for chunk in chunks:
        if groups and n + len(chunk[2]) <= limit:
            groups[-1].append(chunk)
            n += len(chunk[2])
        else:
            groups.append([chunk])
            n = len(chunk[2])
    return groups


def extract_missing(run_dir: Path, chunks: list[tuple[str, str, list[dict]]], fn, progress: bool = False,
                    together: int | None = None) -> int:
    """Extract and save every chunk (name, key, examples) whose cached file is missing or stale, several
    chunks per `extract` (`extraction_groups`). Returns how many chunks it extracted."""
    todo = [c for c in chunks if not fresh(run_dir / "features" / f"{c[0]}.safetensors", c[1])]
    for group in extraction_groups(todo, together):
        feats = extract([e for _, _, exs in group for e in exs], fn, progress=progress)
        for (name, key, _), part in zip(group, feats.split([len(exs) for _, _, exs in group])):
            part.save(run_dir / "features" / f"{name}.safetensors", key)  # write_atomic makes the folder
    return len(todo)


def cached_features(run_dir: Path, name: str, key: str, build) -> Features:
    """One chunk's table, built and saved unless its file holds the same inputs (`key`); either way its
    feature rows are then read from the file."""
    path = run_dir / "features" / f"{name}.safetensors"
    cached(path, key, build, lambda p: None)
    return Features.load(path)


def draft_vocabulary(counts: torch.Tensor, size: int, always: int = 256) -> torch.Tensor:
    """The `size` most frequent answer tokens, most frequent first (ids below `always` lead: special and
    byte tokens). The order lets inference keep any prefix as a smaller draft vocabulary."""
    vocab = counts.shape[0]
    size = min(size, vocab)
    score = counts.float().clone()
    score[: min(always, vocab)] += float(counts.sum()) + 1
    return torch.argsort(score, descending=True, stable=True)[:size]


def draft_map(vocab_size: int, ids: torch.Tensor) -> torch.Tensor:
    """[vocab_size] long: each full token id's index in the draft vocabulary `ids` (-1: outside it)."""
    full_to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    full_to_draft[ids] = torch.arange(len(ids))
    return full_to_draft
