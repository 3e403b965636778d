"""Judging prompts: normalised text for exact duplicates, MinHash over word shingles for near duplicates,
quality checks for text a sampled model wrote, and a keyword guess of a prompt's task kind.

Near duplicates: each prompt's set of word 3-grams (of its normalised text) is summarised by a MinHash
signature of `PERMUTATIONS` values; locality-sensitive hashing over `BANDS` bands of the signature finds the
earlier prompts that may be similar, and the exact Jaccard similarity of the shingle sets decides: at
`similarity` or above the prompt is a near duplicate of the earlier one.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
import zlib

import numpy as np

PERMUTATIONS = 64
BANDS = 16  # 4 rows a band: pairs of Jaccard 0.5 share a band with probability ~0.65, of 0.7 ~0.98
SHINGLE = 3

# Why a prompt is dropped, in the order the checks run.
REASONS = ("empty", "truncated", "template", "too_short", "non_text", "repetitive", "eval_set", "duplicate",
           "near_duplicate")


def normalise(text: str) -> str:
    """Unicode-compatible, case-folded, punctuation to spaces, whitespace collapsed: the exact-duplicate key."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[^\w]+", " ", text).split())


def shingles(text: str, n: int = SHINGLE) -> set[str]:
    words = normalise(text).split()
    if len(words) <= n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i: i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(len(a | b), 1)


class NearDuplicates:
    """Remembers prompts; `find(text)` names an earlier one at Jaccard >= similarity (or None)."""

    def __init__(self, similarity: float = 0.7, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 2**63, PERMUTATIONS, dtype=np.uint64) | np.uint64(1)
        self.b = rng.integers(0, 2**63, PERMUTATIONS, dtype=np.uint64)
        self.similarity = similarity
        self.buckets: dict[tuple, list[int]] = {}
        self.sets: list[set[str]] = []
        self.ids: list[object] = []

    def signature(self, items: set[str]) -> np.ndarray:
        base = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
                         for s in sorted(items)], dtype=np.uint64)
        with np.errstate(over="ignore"):
            mixed = base[:, None] * self.a[None, :] + self.b[None, :]  # multiply-shift hashing, mod 2**64
        return (mixed >> np.uint64(32)).min(0)

    def _bands(self, sig: np.ndarray) -> list[tuple]:
        rows = PERMUTATIONS // BANDS
        return [(k, sig[k * rows: (k + 1) * rows].tobytes()) for k in range(BANDS)]

    def find(self, text: str) -> object | None:
        items = shingles(text)
        if not items:
            return None
        seen: set[int] = set()
        for band in self._bands(self.signature(items)):
            for j in self.buckets.get(band, ()):
                if j not in seen:
                    seen.add(j)
                    if jaccard(items, self.sets[j]) >= self.similarity:
                        return self.ids[j]
        return None

    def add(self, text: str, id_: object) -> None:
        items = shingles(text)
        if not items:
            return
        j = len(self.sets)
        self.sets.append(items)
        self.ids.append(id_)
        for band in self._bands(self.signature(items)):
            self.buckets.setdefault(band, []).append(j)


def quality_problem(text: str, finish: str, min_words: int = 3) -> str | None:
    """Why a written prompt is unusable (a name in REASONS), or None. `finish`: "stop" when it ended its turn,
    "length" when it hit the length cap first, "template" when it wrote chat-template tokens."""
    stripped = text.strip()
    if not stripped:
        return "empty"
    if finish == "length":
        return "truncated"
    if finish == "template":
        return "template"
    words = stripped.split()
    if len(words) < min_words:
        return "too_short"
    visible = [c for c in stripped if not c.isspace()]
    if sum(c.isalpha() for c in visible) < 0.5 * len(visible):
        return "non_text"
    if repetitive(stripped):
        return "repetitive"
    return None


def repetitive(text: str) -> bool:
    """A repetition loop: few distinct word 3-grams, a line repeated three times, or text that compresses
    far better than prose does."""
    words = text.lower().split()
    if len(words) >= 12:
        grams = [tuple(words[i: i + 3]) for i in range(len(words) - 2)]
        if len(set(grams)) < 0.5 * len(grams):
            return True
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) >= 3 and max(lines.count(line) for line in lines) >= 3:
        return True
    raw = text.encode()
    return len(raw) >= 200 and len(zlib.compress(raw, 9)) < 0.2 * len(raw)


KIND_RULES = (
    ("translation", r"\btranslat"),
    ("summarisation", r"\bsummar|\btl;?dr\b"),
    ("code", r"```|\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|html|css|regex|function|code|"
             r"script|program|compile|bug|api|class|json)\b"),
    ("math", r"\b(calculate|solve|equation|integral|derivative|probability|algebra|geometry|percent(age)?|"
             r"how (many|much))\b|\d\s*[-+*/×^]\s*\d"),
    ("extraction", r"\b(extract|list (all|every)|table of|parse)\b"),
    ("writing", r"\b(write|draft|compose|rewrite|essay|poem|story|letter|e-?mail|blog|article|speech|slogan)\b"),
    ("advice", r"\b(recommend|suggest|advice|tips|ideas|help me|should i|plan)\b"),
    ("explanation", r"\b(explain|why|what is|what are|how does|how do|describe|difference between)\b"),
)


def guess_kind(text: str) -> str:
    """A coarse task kind from keywords (the first rule of KIND_RULES that matches), else "question" for a
    text with a question mark, else "other"."""
    low = text.lower()
    for kind, pattern in KIND_RULES:
        if re.search(pattern, low):
            return kind
    return "question" if "?" in text else "other"
