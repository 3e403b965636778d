"""Suffix automata over token ids: drafts read from what the text (or a corpus) already said.

Output repeats its prompt and itself (code edits, summaries, lists, a model caught in a loop), and so does
a corpus of earlier outputs. A suffix automaton holds every substring of an n-token text in at most 2n - 1
states: walking it finds the longest suffix of the text (or of a context) seen before, and the transitions
out of that state are the tokens that followed it: drafts that cost no model pass.

`SuffixAutomaton` grows one token at a time (the classic online construction, dict transitions) and
answers for its own text (`match`, `continuations`) or for any context (`match_for`, `continuations_for`).
`Datastore` freezes one automaton over a corpus into flat arrays, saved as `.npy` files and memory-mapped
on load; it answers for contexts with the same ranking code, so the two agree.

Ranking (`continuations` and its context forms). Take the suffixes of the text that occurred earlier (of
the context that occur in the corpus), longest first, one per automaton state: a state's suffixes share
their occurrences, so its longest one (for the first state: the matched length) stands for them all. The
walk follows suffix links and stops below `min_match` tokens or after `levels` states (a text in a loop has
one state per lap, all proposing the same). At each such suffix s, every token c that followed s gives one
candidate, read at the most recent occurrence of s + c, with count = the occurrences of s + c; within one
s by count, then most recent first. A candidate whose tokens equal one already listed is dropped; the list
stops at k. So the order is (match_len, count, start), all descending. Continuations stop at `depth`
tokens, at the end of the text and before a separator (a negative id, never returned).

Counts and most recent positions are sums and maxima over subtrees of the suffix-link tree: an automaton
computes those a query needs on demand (memoised until the text grows), so `extend` stays amortised O(1)
and a query costs O(occurrences of the suffixes it walks); a `Datastore` stores them.

Cost, CPython 3.11 on one core of an "Intel(R) Xeon(R) Processor" (lscpu) shared with other work, for
4096-token texts: `extend` 0.6-1.4 us a token (6 ms for 4096 tokens of model output: 5.7k states, 3.3 MiB);
`continuations(8, 8)` after 3 new tokens (memo cold) median 26 us, worst 0.33 ms on model output, 40 us on
a text stuck in a 1- or 7-token loop, under 1 us with no match (random ids). A `Datastore` over 52k tokens
(73k states) builds in 0.45 s; loaded, `continuations` of a 64-token context takes 0.25 ms, mostly the
walk (3.3 us a token: a growing context should feed its new tokens to a `Matcher` instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from medusa.errors import MedusaError

LEVELS = 16  # suffix-link states a query walks at most, by default


@dataclass(frozen=True)
class Match:
    """The longest suffix of the text (context) found earlier in the text (in the corpus).

    length:  int >= 0, its number of tokens (0: not even the last token occurred)
    start:   int, where the most recent such occurrence ends (exclusive), i.e. where a continuation would be
             read: text[start - length : start] equals the suffix; -1 when length is 0
    """

    length: int
    start: int


@dataclass(frozen=True)
class Continuation:
    """One draft: what followed an earlier occurrence of a suffix of the text (context).

    tokens:     list[int], 1..depth token ids, all >= 0: text[start : start + len(tokens)], cut at depth, at
                the end of the text and before a separator
    match_len:  int >= 1, the suffix's length: text[start - match_len : start] equals the last match_len
                tokens of the text (context)
    count:      int >= 1, how many times tokens[0] followed that suffix in the text (the corpus)
    start:      int, index of tokens[0] in the text (a datastore's `text` array): the most recent occurrence
                of suffix + tokens[0]
    """

    tokens: list[int]
    match_len: int
    count: int
    start: int


def _cut(tokens: list[int]) -> list[int]:
    """`tokens` up to the first separator."""
    for i, t in enumerate(tokens):
        if t < 0:
            return tokens[:i]
    return tokens


class _Index:
    """Matching and ranking over an automaton, in memory or in arrays. States are ints, the root is 0.
    Subclasses give, per state v: _len_of(v) and _link_of(v); _step(v, token), the target or -1; _edges(v),
    the (token, target) pairs; _stats(v), (occurrences, exclusive end of the most recent one) of v's strings;
    and _read(start, depth), at most depth tokens of the text from start, cut before a separator."""

    def _walk(self, tokens: Iterable[int], v: int = 0, length: int = 0) -> tuple[int, int]:
        """The state and length of the longest suffix of (what was walked) + tokens that is a substring."""
        for t in tokens:
            t = int(t)
            if t < 0:  # a separator: nothing spans it
                v, length = 0, 0
                continue
            while True:
                nxt = self._step(v, t)
                if nxt >= 0:
                    v, length = nxt, length + 1
                    break
                if v == 0:
                    length = 0
                    break
                v = self._link_of(v)
                length = self._len_of(v)
        return v, length

    def _rank(self, v: int, length: int, k: int, depth: int, min_match: int, levels: int) -> list[Continuation]:
        if depth < 1 or min_match < 1 or k < 0 or levels < 0:
            raise MedusaError(f"continuations need depth >= 1, min_match >= 1, k >= 0 and levels >= 0, got "
                              f"depth={depth}, min_match={min_match}, k={k}, levels={levels}")
        out: list[Continuation] = []
        seen: set[tuple[int, ...]] = set()
        while v > 0 and length >= min_match and len(out) < k and levels > 0:
            levels -= 1
            level = [(*self._stats(target), token) for token, target in self._edges(v) if token >= 0]
            level.sort(reverse=True)  # count, then recency; ends differ within a level, so no ties
            for count, end, _ in level:
                tokens = self._read(end - 1, depth)
                key = tuple(tokens)
                if key not in seen:
                    seen.add(key)
                    out.append(Continuation(tokens, length, count, end - 1))
                    if len(out) == k:
                        break
            v = self._link_of(v)
            length = self._len_of(v)
        return out

    def match_for(self, context: Sequence[int]) -> Match:
        """The longest suffix of `context` that occurs in the text, and its most recent occurrence."""
        v, length = self._walk(context)
        return Match(length, self._stats(v)[1] if length else -1)

    def continuations_for(self, context: Sequence[int], k: int, depth: int,
                          min_match: int = 1, levels: int = LEVELS) -> list[Continuation]:
        """Up to k continuations of the longest suffix of `context` that occurs in the text (then of shorter
        ones), ranked as the module says. O(len(context)) to match: for a growing context against a fixed
        index, keep a `Matcher` instead."""
        return self._rank(*self._walk(context), k, depth, min_match, levels)


class SuffixAutomaton(_Index):
    """The suffix automaton of a growing token list.

    text:  list[int], every token appended so far (negative ids are separators: never matched across)
    Per state v (0 is the root, the empty string): _len[v] the longest string's length, _link[v] the suffix
    link (-1 for the root), _next[v] {token: state}, _end[v] the exclusive end of the position that created
    v (-1 for clones and the root), _kids[v] the states whose link is v.
    """

    def __init__(self, tokens: Iterable[int] = ()):
        self.text: list[int] = []
        self._len: list[int] = []
        self._link: list[int] = []
        self._next: list[dict[int, int]] = []
        self._end: list[int] = []
        self._kids: list[set[int]] = []
        self._memo: dict[int, tuple[int, int]] = {}  # state -> _stats(state), while len(text) == _memo_n
        self._memo_n = 0
        self._last = self._new(0, -1)
        self.extend_many(tokens)

    @property
    def num_states(self) -> int:
        return len(self._len)

    def _new(self, length: int, end: int) -> int:
        self._len.append(length)
        self._link.append(-1)
        self._next.append({})
        self._end.append(end)
        self._kids.append(set())
        return len(self._len) - 1

    def _relink(self, v: int, parent: int) -> None:
        old = self._link[v]
        if old >= 0:
            self._kids[old].discard(v)
        self._link[v] = parent
        self._kids[parent].add(v)

    def extend(self, token: int) -> None:
        """Append one token: amortised O(1) dict operations."""
        token = int(token)
        self.text.append(token)
        nxt, length = self._next, self._len
        cur = self._new(length[self._last] + 1, len(self.text))
        p = self._last
        while p >= 0 and token not in nxt[p]:
            nxt[p][token] = cur
            p = self._link[p]
        if p < 0:
            self._relink(cur, 0)
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                self._relink(cur, q)
            else:
                clone = self._new(length[p] + 1, -1)
                nxt[clone] = dict(nxt[q])
                self._relink(clone, self._link[q])
                self._relink(q, clone)
                self._relink(cur, clone)
                while p >= 0 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = self._link[p]
        self._last = cur

    def extend_many(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.extend(t)

    def match(self) -> Match:
        """The longest suffix of the text that occurs earlier in it (not only as the suffix itself), and
        where its most recent earlier occurrence ends."""
        v = self._link[self._last] if self.text else -1
        if v <= 0:
            return Match(0, -1)
        return Match(self._len[v], max(self._stats(q)[1] for q in self._next[v].values()) - 1)

    def continuations(self, k: int, depth: int, min_match: int = 1, levels: int = LEVELS) -> list[Continuation]:
        """Up to k continuations of the longest suffix of the text that occurred earlier (then of shorter
        ones), ranked as the module says: a list of `Continuation`, each what followed an earlier occurrence."""
        v = self._link[self._last] if self.text else 0
        return self._rank(v, self._len[v], k, depth, min_match, levels)

    # _Index, in memory
    def _len_of(self, v: int) -> int:
        return self._len[v]

    def _link_of(self, v: int) -> int:
        return self._link[v]

    def _step(self, v: int, token: int) -> int:
        return self._next[v].get(token, -1)

    def _edges(self, v: int) -> Iterable[tuple[int, int]]:
        return self._next[v].items()

    def _read(self, start: int, depth: int) -> list[int]:
        return _cut(self.text[start:start + depth])

    def _stats(self, v: int) -> tuple[int, int]:
        """Occurrences of v's strings and the exclusive end of the most recent one: a post-order walk of
        v's link subtree, stopping at states already known since the text last grew."""
        memo = self._memo
        if self._memo_n != len(self.text):
            memo.clear()
            self._memo_n = len(self.text)
        if v in memo:
            return memo[v]
        order, stack = [], [v]
        while stack:
            u = stack.pop()
            order.append(u)
            stack.extend(w for w in self._kids[u] if w not in memo)
        for u in reversed(order):  # children before parents
            end = self._end[u]
            count = 1 if end >= 0 else 0
            for w in self._kids[u]:
                c, e = memo[w]
                count += c
                end = e if e > end else end
            memo[u] = (count, end)
        return memo[v]

    def arrays(self) -> dict[str, np.ndarray]:
        """The automaton as flat arrays (`Datastore`'s layout): transitions in CSR form, sorted by token."""
        n = self.num_states
        self._stats(0)  # the root's walk visits every state
        stats = [self._memo[v] for v in range(n)]
        offsets = np.zeros(n + 1, dtype=np.int64)
        edges = [sorted(d.items()) for d in self._next]
        offsets[1:] = np.cumsum([len(e) for e in edges])
        flat = [pair for e in edges for pair in e]
        return {"text": np.asarray(self.text, dtype=np.int64), "length": np.asarray(self._len, dtype=np.int64),
                "link": np.asarray(self._link, dtype=np.int64), "offsets": offsets,
                "edge_token": np.asarray([t for t, _ in flat], dtype=np.int64),
                "edge_target": np.asarray([s for _, s in flat], dtype=np.int64),
                "count": np.asarray([c for c, _ in stats], dtype=np.int64),
                "last_end": np.asarray([e for _, e in stats], dtype=np.int64)}


def corpus_automaton(seqs: Iterable[Sequence[int]]) -> SuffixAutomaton:
    """One automaton over `seqs`, each followed by its own separator: sequence i by -(i + 1)."""
    sam = SuffixAutomaton()
    for i, seq in enumerate(seqs):
        seq = [int(t) for t in seq]
        if any(t < 0 for t in seq):
            raise MedusaError(f"datastore sequence {i} has a negative token id (ids must be >= 0)")
        sam.extend_many(seq)
        sam.extend(-(i + 1))
    return sam


class Datastore(_Index):
    """A frozen suffix automaton over a corpus, in flat int64 arrays (S states, E transitions, N tokens).

    text:         [N], the sequences, each followed by its separator: sequence i by -(i + 1)
    length:       [S], each state's longest string's length
    link:         [S], each state's suffix link (-1 for the root, state 0)
    offsets:      [S + 1], state v's transitions are edge_token/edge_target[offsets[v] : offsets[v + 1]]
    edge_token:   [E], transition tokens, ascending within each state
    edge_target:  [E], transition targets
    count:        [S], occurrences of each state's strings in text
    last_end:     [S], exclusive end of the most recent occurrence (the root: N)
    Saved as one `<name>.npy` per array; `load` memory-maps them.
    """

    FIELDS = ("text", "length", "link", "offsets", "edge_token", "edge_target", "count", "last_end")

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.files = {f: arrays[f] for f in self.FIELDS}  # as given: memory maps when loaded
        # Plain ndarray views of the same memory: slicing a np.memmap costs microseconds, a view's does not.
        self.text, self.length, self.link, self.offsets, self.edge_token, self.edge_target, self.count, \
            self.last_end = (np.asarray(a) for a in self.files.values())
        s = self.length.shape[0]
        if not (self.link.shape == self.count.shape == self.last_end.shape == (s,)
                and self.offsets.shape == (s + 1,) and self.edge_token.shape == self.edge_target.shape
                and int(self.offsets[-1]) == self.edge_token.shape[0] and s >= 1):
            raise MedusaError("datastore arrays have inconsistent shapes (a partial or mixed save?)")

    @classmethod
    def build(cls, seqs: Iterable[Sequence[int]]) -> "Datastore":
        return cls(corpus_automaton(seqs).arrays())

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for f, a in self.files.items():
            np.save(directory / f"{f}.npy", np.ascontiguousarray(a))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "Datastore":
        directory = Path(directory)
        arrays = {}
        for f in cls.FIELDS:
            path = directory / f"{f}.npy"
            if not path.is_file():
                raise MedusaError(f"{directory} is not a datastore: no {f}.npy (build one with "
                                  f"Datastore.build(seqs).save(dir))")
            arrays[f] = np.load(path, mmap_mode="r")
        return cls(arrays)

    @property
    def num_states(self) -> int:
        return int(self.length.shape[0])

    def matcher(self) -> "Matcher":
        return Matcher(self)

    match = _Index.match_for
    continuations = _Index.continuations_for

    # _Index, over the arrays
    def _len_of(self, v: int) -> int:
        return int(self.length[v])

    def _link_of(self, v: int) -> int:
        return int(self.link[v])

    def _step(self, v: int, token: int) -> int:
        lo, hi = int(self.offsets[v]), int(self.offsets[v + 1])
        i = lo + int(np.searchsorted(self.edge_token[lo:hi], token))
        return int(self.edge_target[i]) if i < hi and int(self.edge_token[i]) == token else -1

    def _edges(self, v: int) -> Iterable[tuple[int, int]]:
        lo, hi = int(self.offsets[v]), int(self.offsets[v + 1])
        return zip(self.edge_token[lo:hi].tolist(), self.edge_target[lo:hi].tolist())

    def _stats(self, v: int) -> tuple[int, int]:
        return int(self.count[v]), int(self.last_end[v])

    def _read(self, start: int, depth: int) -> list[int]:
        return _cut(self.text[start:start + depth].tolist())


class Matcher:
    """A context matched against a fixed `Datastore` token by token (amortised one binary search each).

    state:   int, the automaton state of the matched suffix (0: none)
    length:  int, the matched suffix's length
    """

    def __init__(self, store: Datastore):
        self.store, self.state, self.length = store, 0, 0

    def feed(self, tokens: Iterable[int]) -> None:
        self.state, self.length = self.store._walk(tokens, self.state, self.length)

    def continuations(self, k: int, depth: int, min_match: int = 1, levels: int = LEVELS) -> list[Continuation]:
        return self.store._rank(self.state, self.length, k, depth, min_match, levels)
