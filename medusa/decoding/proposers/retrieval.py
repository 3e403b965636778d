"""Retrieval drafts: what followed earlier occurrences of the text's own suffix (prompt and output so far),
as branches of a dynamic tree, alone or grafted onto a head's tree under one node budget.

Each row keeps a suffix automaton (`medusa.decoding.proposers.suffix`) of its committed tokens and pending root,
grown by the tokens each step commits. A step asks it for up to `branches` ranked continuations, each at
most `depth` tokens, and scores every token by the log of its chance of being accepted, measured on the
target's own greedy answers by match length (`ACCEPT`, from `benchmarks/retrieval_acceptance.py`):

    score(token j of a continuation from a match of m tokens) = log first(m, top) + j * log next(m)

`first(m, top)` is how often the first token is right (higher for the best continuation at its suffix
than for the others), `next(m)` how often a token is right after a right one. These are chances of the
same kind as a dynamic tree's cumulative log-probabilities (EAGLE-2's node scores), so both kinds of node
compete for one budget: `graft` walks each continuation down the head's pool, raises the score of every
node it meets (same parent, same token) to the continuation's and appends the rest as new nodes; then the
N best nodes are kept (`Pool.trees`). A row whose match is long gets a deep retrieval branch; a row with
none gets the head's tree unchanged. Scores still only fall along every path, so the kept nodes form a tree.

`RetrievalProposer` drafts from retrieval alone (any model, no heads); `MergedProposer` wraps a tree proposer
(feature heads, Medusa heads' dynamic trees). Rows sampled with a drafted chain (rejection sampling with a
feature head) keep the head's chain alone: retrieval nodes are point masses, and those rows' trees are the
sampled chain exactly. Verification does not change: any draft is safe, and greedy output is the target's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Hashable

import torch

from medusa.decoding.trees.dynamic_tree import NEG, Growth, Pool, stand_in_tree
from medusa.decoding.proposers import GrowingProposer, Proposer, RowState, aux_state, context
from medusa.decoding.proposers.suffix import Datastore, Matcher, SuffixAutomaton
from medusa.decoding.verifier import RowTrees
from medusa.errors import MedusaError

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch

AUX_KEY = "retrieval"
# Match lengths are bucketed: bucket i holds lengths MATCH_BUCKETS[i] up to the next bucket's start.
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
# Per bucket: (first token right, best continuation at its suffix; first token right, the others; next
# token right after a right one). Measured on 1,024 distilled ShareGPT answers of the embedded model
# (`python benchmarks/retrieval_acceptance.py --shards 8`: benchmarks/results/retrieval_acceptance.json).
ACCEPT = (
    (0.20, 0.07, 0.65),
    (0.47, 0.10, 0.72),
    (0.58, 0.15, 0.77),
    (0.67, 0.13, 0.82),
    (0.75, 0.11, 0.86),
    (0.82, 0.08, 0.89),
    (0.88, 0.10, 0.92),
    (0.97, 0.05, 0.98),
)


def match_bucket(match_len: int) -> int:
    """The bucket of a match of `match_len` >= 1 tokens."""
    b = 0
    while b + 1 < len(MATCH_BUCKETS) and match_len >= MATCH_BUCKETS[b + 1]:
        b += 1
    return b


# The same for continuations read from a datastore (a corpus the row's text is not part of): a store of the
# first 8,192 distilled answers, measured on the same 1,024 later answers (`--datastore`:
# benchmarks/results/retrieval_acceptance_datastore.json). Less sure than the row's own text at every length.
STORE_ACCEPT = (
    (0.20, 0.07, 0.22),
    (0.30, 0.07, 0.33),
    (0.37, 0.08, 0.40),
    (0.41, 0.10, 0.48),
    (0.51, 0.11, 0.56),
    (0.57, 0.15, 0.65),
    (0.69, 0.17, 0.71),
    (0.87, 0.16, 0.92),
)


def token_scores(match_len: int, top: bool, length: int, table=ACCEPT) -> list[float]:
    """Cumulative log-chance of acceptance of each token of a continuation."""
    first, other, nxt = table[match_bucket(match_len)]
    start = math.log(first if top else other)
    return [start + j * math.log(nxt) for j in range(length)]


@dataclass
class Chains:
    """One step's retrieval drafts for n rows, C continuations of at most L tokens each.

    tokens: [n, C, L] long (anything past a continuation's end)
    scores: [n, C, L] float, cumulative log-chance of acceptance; -inf past the end and for no draft
    """

    tokens: torch.Tensor
    scores: torch.Tensor

    @property
    def depth(self) -> int:
        return self.tokens.shape[2]

    def drop(self, rows: torch.Tensor) -> "Chains":
        """Without drafts for rows [n] bool."""
        return Chains(self.tokens, torch.where(rows[:, None, None], NEG, self.scores))


class RetrievalState(RowState):
    """Per-row suffix automata (and datastore matchers), by request id (rows move, ids stay); one per batch
    (`batch.aux`)."""

    def __init__(self, store: Datastore | None = None):
        self.store = store
        self.automata: dict[Hashable, SuffixAutomaton] = {}
        self.matchers: dict[Hashable, Matcher] = {}

    def sync(self, ids: list[Hashable], ctx: torch.Tensor,
             ends: list[int]) -> list[tuple[SuffixAutomaton, Matcher | None]]:
        """Each row's automaton (and matcher) fed up to its text ctx[r, :ends[r]] (host tensor: committed
        tokens, then the pending root); only the tokens it has not seen are read."""
        out = []
        for r, (i, end) in enumerate(zip(ids, ends)):
            sam = self.automata.get(i)
            fed = len(sam.text) if sam is not None else 0
            if sam is None or fed > end or (fed and sam.text[-1] != int(ctx[r, fed - 1])):
                sam, fed = SuffixAutomaton(), 0
                self.automata[i] = sam
                if self.store is not None:
                    self.matchers[i] = self.store.matcher()
            new = ctx[r, fed:end].tolist()
            sam.extend_many(new)
            matcher = self.matchers.get(i)
            if matcher is not None:
                matcher.feed(new)
            out.append((sam, matcher))
        for gone in set(self.automata) - set(ids):
            del self.automata[gone]
            self.matchers.pop(gone, None)
        return out


def load_datastore(directory: str | Path, vocab_size: int) -> Datastore:
    """The datastore at `directory`, refused when its tokens cannot be the model's (ids past its vocabulary)."""
    store = Datastore.load(directory)
    text = store.text
    top = int(text.max()) if text.shape[0] else -1
    if top >= vocab_size:
        raise MedusaError(f"--datastore {directory}: token id {top} is outside the model's vocabulary of "
                          f"{vocab_size}: it was built for another tokenizer")
    return store


class Retriever:
    """Ranked continuations of each row's text: `branches` of at most `depth` tokens, from matches of at
    least `min_match` tokens; with a datastore, `store_branches` more from the corpus (matches of at least
    `store_min_match` tokens)."""

    def __init__(self, branches: int = 4, depth: int = 8, min_match: int = 1, store: Datastore | None = None,
                 store_branches: int = 2, store_min_match: int = 2):
        if branches < 1 or depth < 1 or min_match < 1 or store_branches < 0 or store_min_match < 1:
            raise MedusaError(f"retrieval needs branches, depth and min_match >= 1, got {branches}, {depth}, "
                              f"{min_match}")
        self.branches, self.depth, self.min_match = branches, depth, min_match
        self.store, self.store_branches, self.store_min_match = store, store_branches, store_min_match

    def chains(self, batch: "Batch") -> Chains:
        n = batch.n
        state = aux_state(batch, AUX_KEY, lambda s: isinstance(s, RetrievalState) and s.store is self.store,
                          lambda: RetrievalState(self.store))
        rows = state.sync(batch.ids[:n], context(batch).cpu(), (batch.cache.lens[:n] + 1).tolist())
        width = self.branches + (self.store_branches if self.store is not None else 0)
        tokens = [[[0] * self.depth for _ in range(width)] for _ in range(n)]
        scores = [[[NEG] * self.depth for _ in range(width)] for _ in range(n)]
        for r, (sam, matcher) in enumerate(rows):
            found = [(c, ACCEPT) for c in sam.continuations(self.branches, self.depth, self.min_match)]
            if matcher is not None:
                found += [(c, STORE_ACCEPT) for c in
                          matcher.continuations(self.store_branches, self.depth, self.store_min_match)]
            levels: set[tuple[int, int]] = set()
            for c, (cont, table) in enumerate(found):
                top = (id(table), cont.match_len) not in levels
                levels.add((id(table), cont.match_len))
                m = len(cont.tokens)
                tokens[r][c][:m] = cont.tokens
                scores[r][c][:m] = token_scores(cont.match_len, top, m, table)
        dev = batch.root.device
        return Chains(torch.tensor(tokens, device=dev), torch.tensor(scores, device=dev))


def graft(pool: Pool, chains: Chains) -> None:
    """Add each continuation to `pool` as a path from the root: a node it meets (same parent and token) keeps
    the higher of the two scores, the rest become new entries. Scores still fall along every path.

    A walk over a few dozen small nodes per row: done on host lists, one read and one write of the pool,
    where tensor ops per node would cost more in dispatch than the walk itself."""
    n = chains.tokens.shape[0]
    tok, score, par, _ = pool.flat(n, chains.tokens.device)
    lengths = (chains.scores > NEG).sum(-1)  # [n, C]: a continuation's tokens (scores are -inf past its end)
    if not bool(lengths.any()):
        return
    size = tok.shape[1]
    toks, scores, parents = tok.tolist(), score.tolist(), par.tolist()
    c_tok, c_score, c_len = chains.tokens.tolist(), chains.scores.tolist(), lengths.tolist()
    added: list[list[tuple[int, float, int, int]]] = []  # per row: (token, score, parent, depth)
    for r in range(n):
        row_s = scores[r]
        at = {(parents[r][i], toks[r][i]): i for i in range(size) if row_s[i] > NEG}
        extra: list[tuple[int, float, int, int]] = []
        for c, length in enumerate(c_len[r]):
            attach = -1
            for j in range(length):
                key, s = (attach, c_tok[r][c][j]), c_score[r][c][j]
                i = at.get(key)
                if i is None:
                    i = at[key] = size + len(extra)
                    extra.append((key[1], s, attach, j + 1))
                elif i < size:
                    row_s[i] = max(row_s[i], s)
                else:
                    extra[i - size] = (key[1], max(extra[i - size][1], s), *extra[i - size][2:])
                attach = i
        added.append(extra)
    score.copy_(torch.tensor(scores, dtype=score.dtype))
    width = max(len(e) for e in added)
    if width:
        pad = (0, NEG, -1, 1)  # dead entries: rows with fewer new nodes
        cols = list(zip(*[e + [pad] * (width - len(e)) for e in added]))  # width tuples of n entries
        t, sc, pa, de = (torch.tensor([[col[r][f] for col in cols] for r in range(n)],
                                      dtype=torch.float if f == 1 else torch.long, device=tok.device)
                         for f in range(4))
        pool.add(t, sc.to(score.dtype), pa, de)


class RetrievalProposer(Proposer):
    """Retrieval alone: a tree of `nodes` candidates per row from its best continuations. Needs no heads.
    Its tree is named as its mode is, `retrieval:N`."""

    name = "retrieval"

    def __init__(self, nodes: int = 16, retriever: Retriever | None = None):
        self.retriever = retriever or Retriever()
        if nodes < 1 or nodes > self.retriever.branches * self.retriever.depth:
            raise MedusaError(f"retrieval: {nodes} nodes do not fit {self.retriever.branches} branches of "
                              f"{self.retriever.depth} tokens")
        self.nodes = nodes
        self.max_nodes, self.max_depth = nodes + 1, self.retriever.depth
        self.tree = stand_in_tree(nodes, self.retriever.depth, f"{self.name}:{nodes}")

    @torch.inference_mode()
    def draft(self, batch: "Batch") -> RowTrees:
        pool = Pool([], [], [], [])
        chains = self.retriever.chains(batch)
        graft(pool, chains)
        return pool.trees(self.nodes, chains.depth)


class MergedProposer(Proposer):
    """A growing proposer's dynamic tree with retrieval branches grafted in, under the inner tree's budget."""

    def __init__(self, inner: GrowingProposer, retriever: Retriever | None = None):
        self.inner = inner
        self.retriever = retriever or Retriever()
        self.nodes = inner.max_nodes - 1
        self.name = f"{inner.name}+retrieval"
        self.max_nodes, self.max_depth = inner.max_nodes, max(inner.max_depth, self.retriever.depth)
        self.tree = stand_in_tree(self.nodes, self.max_depth, f"{inner.tree.name}+retrieval")

    def attach(self, batch: "Batch") -> None:
        self.inner.attach(batch)  # retrieval's automata are fed at the first draft

    @torch.inference_mode()
    def draft(self, batch: "Batch") -> RowTrees:
        grown: Growth = self.inner.grow(batch)
        chains = self.retriever.chains(batch)
        if grown.sampled is not None:
            chains = chains.drop(grown.sampled)
        graft(grown.pool, chains)
        return grown.pool.trees(self.nodes, max(grown.depth, chains.depth), grown.proposal)
