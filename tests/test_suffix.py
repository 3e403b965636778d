"""Suffix automata and the datastore: every answer checked against a direct search of the text."""

import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medusa.decoding.proposers.suffix import Continuation, Datastore, Match, SuffixAutomaton, corpus_automaton
from medusa.errors import MedusaError


def brute(seqs, query, k, depth, min_match=1, levels=16, own=False):
    """(longest match, continuations as tuples) by direct search, ranked as medusa.decoding.proposers.suffix says.

    own: the automaton's own text (seqs == [query]): a suffix counts only where it occurs followed by a
    token, i.e. earlier. Otherwise: anywhere in any one sequence. Positions index the joined text, where
    sequence i is followed by one separator."""
    offsets, pos = [], 0
    for s in seqs:
        offsets.append(pos)
        pos += len(s) + 1
    n = len(query)

    def occurrences(m):  # (sequence, exclusive end) of every occurrence of the query's last m tokens
        suf = list(query[n - m:])
        return [(i, e) for i, s in enumerate(seqs) for e in range(m, len(s) + 1) if s[e - m:e] == suf]

    def found(m):
        return any(e < len(seqs[i]) for i, e in occurrences(m)) if own else bool(occurrences(m))

    longest = 0
    while longest < n and found(longest + 1):
        longest += 1
    out, seen, before = [], set(), None
    for m in range(longest, min_match - 1, -1):
        if occurrences(m) != before:  # a new set of occurrences: the next automaton state
            before = occurrences(m)
            levels -= 1
            if levels < 0:
                break
        follow = {}  # token -> (count, start in the joined text, sequence, end) of its latest occurrence
        for i, e in occurrences(m):  # in text order: the last one seen is the latest
            if e < len(seqs[i]):
                follow[seqs[i][e]] = (follow.get(seqs[i][e], (0,))[0] + 1, offsets[i] + e, i, e)
        for count, start, i, e in sorted(follow.values(), reverse=True):
            tokens = tuple(seqs[i][e:e + depth])
            if tokens not in seen and len(out) < k:
                seen.add(tokens)
                out.append((tokens, m, count, start))
    return longest, out


def as_tuples(conts):
    return [(tuple(c.tokens), c.match_len, c.count, c.start) for c in conts]


def tokens(alphabet, max_size):  # lengths spread evenly: plain st.lists favours very short ones
    return st.integers(0, max_size).flatmap(lambda n: st.lists(st.integers(0, alphabet - 1), min_size=n,
                                                               max_size=n))


def texts(max_size=60):
    return st.integers(1, 4).flatmap(lambda a: tokens(a, max_size))


# k, depth, min_match, levels
queries = st.tuples(st.integers(1, 6), st.integers(1, 5), st.integers(1, 3), st.integers(1, 20))


# The automaton over its own text


def test_copies_what_followed_the_longest_earlier_match():
    sam = SuffixAutomaton([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert sam.match() == Match(3, 7)
    assert sam.continuations(k=3, depth=2) == [Continuation([7, 8], 3, 1, 7), Continuation([9, 1], 3, 1, 3)]


def test_counts_rank_before_recency_and_shorter_matches_fill_up():
    sam = SuffixAutomaton([4, 5, 1, 4, 5, 1, 4, 5, 2, 6, 5])  # [4, 5] -> 1 twice, -> 2 once; the suffix is [6, 5]
    assert sam.match() == Match(1, 8)  # only [5] occurred before, most recently ending at 8
    assert sam.continuations(k=4, depth=2) == [Continuation([1, 4], 1, 2, 5), Continuation([2, 6], 1, 1, 8)]
    assert sam.continuations(k=1, depth=1, min_match=2) == []


def test_a_loop_walks_at_most_levels_states():
    sam = SuffixAutomaton([1, 2, 3] * 5)  # one suffix-link state per lap; each proposes [1, 2, 3], cut at the end
    assert sam.match() == Match(12, 12)
    assert sam.continuations(k=4, depth=4) == [Continuation([1, 2, 3], 12, 1, 12)]
    assert sam.continuations(k=4, depth=4, levels=2) == [Continuation([1, 2, 3], 12, 1, 12)]
    assert sam.continuations(k=4, depth=4, levels=0) == []


def test_empty_and_unmatched_texts():
    assert SuffixAutomaton().match() == Match(0, -1)
    assert SuffixAutomaton().continuations(4, 4) == []
    assert SuffixAutomaton([1, 2, 3]).continuations(4, 4) == []
    with pytest.raises(MedusaError):
        SuffixAutomaton([1, 1]).continuations(4, 0)


@settings(deadline=None, max_examples=1000)
@given(texts(), queries)
def test_own_text_matches_direct_search(text, q):
    k, depth, min_match, levels = q
    sam = SuffixAutomaton(text)
    longest, want = brute([text], text, k, depth, min_match, levels, own=True)
    got = sam.continuations(k, depth, min_match, levels)
    assert sam.match().length == longest
    assert as_tuples(got) == want
    n = len(text)
    for c in got:  # and, stated directly: each is what followed an earlier occurrence of the text's suffix
        assert c.start < n and text[c.start - c.match_len:c.start] == text[n - c.match_len:]
        assert text[c.start:c.start + len(c.tokens)] == c.tokens and 1 <= len(c.tokens) <= depth
    if longest:
        m = sam.match()
        assert m.start < n and text[m.start - longest:m.start] == text[n - longest:]
        assert not any(text[e - longest:e] == text[n - longest:] for e in range(m.start + 1, n))


@settings(deadline=None, max_examples=200)
@given(texts(40), queries)
def test_growing_equals_building_from_scratch(text, q):
    k, depth, min_match, levels = q
    sam = SuffixAutomaton()
    for i, t in enumerate(text):
        sam.continuations(k, depth, min_match, levels)  # answers memoised before the text grows must not go stale
        sam.extend(t)
        fresh = SuffixAutomaton(text[:i + 1])
        assert sam.num_states == fresh.num_states <= max(2, 2 * (i + 1) - 1)
        assert sam.match() == fresh.match()
        assert sam.continuations(k, depth, min_match, levels) == fresh.continuations(k, depth, min_match, levels)


@settings(deadline=None, max_examples=300)
@given(texts(30), st.lists(st.integers(0, 3), max_size=8))
def test_recognises_exactly_the_substrings(text, probe):
    sam = SuffixAutomaton(text)
    is_sub = any(text[i:i + len(probe)] == probe for i in range(len(text) - len(probe) + 1))
    assert (sam.match_for(probe).length == len(probe)) == is_sub
    longest = max(m for m in range(len(probe) + 1)
                  if any(text[i:i + m] == probe[len(probe) - m:] for i in range(len(text) - m + 1)))
    assert sam.match_for(probe).length == longest


# The datastore


def corpus(a):  # sequences, and a context: random, or random then the start of a sequence (long matches)
    return st.lists(tokens(a, 20), min_size=1, max_size=5).flatmap(lambda seqs: st.tuples(st.just(seqs), st.one_of(
        tokens(a, 12), st.tuples(tokens(a, 3), st.sampled_from(seqs), st.integers(0, 20)).map(
            lambda t: t[0] + t[1][:t[2]]))))


corpora = st.integers(1, 4).flatmap(corpus)


def test_matches_never_cross_a_sequence_boundary():
    store = Datastore.build([[1, 2], [3, 4], [2, 3, 9]])
    assert store.match([7, 2, 3]).length == 2  # [2, 3] occurs, but only in the third sequence
    assert store.continuations([7, 2, 3], 4, 4) == [Continuation([9], 2, 1, 8), Continuation([4], 1, 1, 4)]
    assert store.continuations([1, 2], 4, 4) == [Continuation([3, 9], 1, 1, 7)]  # not [3, 4]: [1, 2][3, 4]
    assert store.continuations([4], 4, 4) == []  # 4 ends its sequence: nothing followed it


@settings(deadline=None, max_examples=500)
@given(corpora, queries)
def test_datastore_round_trips_and_matches_direct_search(corpus, q):
    seqs, context = corpus
    k, depth, min_match, levels = q
    sam = corpus_automaton(seqs)
    built = Datastore.build(seqs)
    with tempfile.TemporaryDirectory() as d:
        loaded = Datastore.load(built.save(d))
        assert all(isinstance(a, np.memmap) for a in loaded.files.values())
        assert np.shares_memory(loaded.edge_token, loaded.files["edge_token"])
        longest, want = brute(seqs, context, k, depth, min_match, levels)
        for index in (sam, built, loaded):
            assert index.match_for(context).length == longest
            assert as_tuples(index.continuations_for(context, k, depth, min_match, levels)) == want
        assert as_tuples(loaded.continuations(context, k, depth, min_match, levels)) == want
        if longest:  # where: the most recent occurrence in the joined text
            joined, suffix = loaded.text.tolist(), list(context[len(context) - longest:])
            ends = [e for e in range(longest, len(joined) + 1) if joined[e - longest:e] == suffix]
            assert loaded.match(context) == Match(longest, max(ends))
        matcher = loaded.matcher()
        for t in context:
            matcher.feed([t])
        assert matcher.length == longest
        assert as_tuples(matcher.continuations(k, depth, min_match, levels)) == want
        for c in loaded.continuations(context, k, depth, min_match, levels):
            assert min(c.tokens) >= 0


def test_datastore_errors(tmp_path):
    assert Datastore.build([]).continuations([1], 4, 4) == []
    with pytest.raises(MedusaError, match="negative"):
        Datastore.build([[1, -2]])
    with pytest.raises(MedusaError, match="no text.npy"):
        Datastore.load(tmp_path)
    Datastore.build([[1, 2]]).save(tmp_path)
    (tmp_path / "count.npy").unlink()
    with pytest.raises(MedusaError, match="no count.npy"):
        Datastore.load(tmp_path)
