"""Mode names, and the one place that turns them into a proposer for a runtime's model.

The one vocabulary of how tokens are drafted, the same in `medusa generate --mode`, the evaluator's
`methods`, `medusa bench` and the server's policy (its modes are `heads`, `draft` and `plain`):

    plain            no proposer: plain decoding
    heads            the runtime's heads, of either kind: Medusa heads over a static tree (`--tree`, default
                     the heads' own) or a per-row dynamic tree (`dynamic-N[xD[xK]]`), or the feature heads
                     `--heads` loaded (dynamic trees only)
    feature[:DIR]    feature heads from DIR (default: the runtime's own, else the shipped ones)
    draft[:PATH]     a draft model (`default`, `layers:N`, a `medusa train-draft` directory, an HF model
                     directory or hub id) proposing a chain of `k` tokens
    lookup[:K]       prompt lookup, K tokens (default 8)
    retrieval[:N]    retrieval alone: a tree of N nodes (default 16) from the text's own earlier
                     continuations (`medusa.decoding.proposers.retrieval`); needs no heads. Its tree has the same
                     name, `retrieval:N` (the server's `policy.trees` without heads)
    X+retrieval      X's dynamic trees (heads with feature heads or --tree dynamic-N, feature[:DIR])
                     with retrieval branches grafted in, under X's node budget

`auto` (the CLI's and the server's default) is not a proposer: it chooses among these per step.
A spec is parsed once, where it enters (flag, config key, request), into a `ProposerSpec`. Earlier
spellings (`RENAMED`: `medusa` for heads, `suffix[:N]` and `X+suffix` for retrieval) are still read, with one
warning naming the new one.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from medusa.decoding.trees.dynamic_tree import is_dynamic
from medusa.decoding.proposers.lookup import LookupProposer
from medusa.decoding.proposers import GrowingProposer, MedusaProposer, Proposer
from medusa.decoding.proposers.retrieval import MergedProposer, RetrievalProposer
from medusa.decoding.trees.tree import DEFAULT_TREE, Tree, load_tree
from medusa.errors import MedusaError

if TYPE_CHECKING:
    from medusa.runtime import Runtime

MERGED = "+retrieval"
MERGEABLE = ("heads", "feature")  # the kinds that grow dynamic trees retrieval can graft onto
NO_ARGUMENT = ("plain", "heads")
COUNT_ARGUMENT = ("lookup", "retrieval")
SPECS = ("plain, heads, feature[:DIR], draft[:PATH], lookup[:K], retrieval[:N], heads+retrieval, "
         "feature[:DIR]+retrieval")
RENAMED = {"medusa": "heads", "suffix": "retrieval"}  # kinds' earlier names, still read
OLD_MERGED = "+suffix"  # retrieval's earlier spelling as a graft
log = logging.getLogger("medusa")


@functools.lru_cache(maxsize=None)
def _renamed(old: str, new: str, key: str) -> None:
    log.warning("%s: %r is spelled %r now; read as such", key, old, new)


def current_spelling(text: str, key: str = "--mode") -> str:
    """`text` with a kind's earlier name (`RENAMED`: `medusa[+suffix]`, `suffix[:N]`, `X+suffix`, a tree
    `suffix:N`) replaced by the current one, warning once per spelling."""
    body, graft = text, ""
    for end in (MERGED, OLD_MERGED):
        if body.endswith(end):
            body, graft = body.removesuffix(end), MERGED
            break
    kind, sep, rest = body.partition(":")
    new = RENAMED.get(kind, kind) + sep + rest + graft
    if new != text:
        _renamed(text, new, key)
    return new


DRAFT_K = 4
LOOKUP_K = 8
RETRIEVAL_NODES = 16


@dataclass(frozen=True)
class ProposerSpec:
    """A parsed mode: `kind` (one of KINDS), its argument (feature's DIR, draft's PATH, lookup's K,
    retrieval's N; None: the default) and whether retrieval is grafted in (`+retrieval`)."""

    kind: str
    arg: str | None = None
    retrieval: bool = False

    @classmethod
    def parse(cls, text: "str | ProposerSpec", key: str = "--mode") -> "ProposerSpec":
        """The spec `text` names; a MedusaError naming `key` when it names none."""
        if isinstance(text, ProposerSpec):
            return text
        text = current_spelling(str(text).strip(), key)
        retrieval = text.endswith(MERGED)
        kind, sep, arg = text.removesuffix(MERGED).partition(":") if retrieval else text.partition(":")
        if kind not in BUILDERS:  # read at call time: a builder added later is a kind too
            raise MedusaError(f"{key}: unknown proposer {text!r} (choose {SPECS})")
        if sep and not arg:
            raise MedusaError(f"{key}: {text!r}: nothing after ':' (choose {SPECS})")
        if kind in NO_ARGUMENT and arg:
            raise MedusaError(f"{key}: {text!r}: {kind} takes no argument (choose {SPECS})")
        if kind in COUNT_ARGUMENT and arg and not arg.isdigit():
            raise MedusaError(f"{key}: {text!r}: expected {kind}:N with an integer N")
        if retrieval and kind not in MERGEABLE:
            raise MedusaError(f"{key}: {text!r}: retrieval merges into dynamic trees: feature heads, or Medusa "
                              f"heads with --tree dynamic-N (use retrieval alone for plain, drafts or lookup)")
        return cls(kind, arg or None, retrieval)

    @property
    def mode(self) -> str:
        """The mode name (the spec without its argument)."""
        return self.kind + (MERGED if self.retrieval else "")

    def __str__(self) -> str:
        return self.kind + (f":{self.arg}" if self.arg else "") + (MERGED if self.retrieval else "")


@dataclass(frozen=True)
class Options:
    """What shapes a proposer besides its spec: `tree` for Medusa and feature heads; `k` the draft's chain
    length or lookup's token count when the spec gives none; `max_ngram` the longest n-gram lookup matches."""

    tree: "str | list | Tree | None" = None
    k: int | None = None
    max_ngram: int = 3


# The registry: a proposer kind is its module plus one line here, (runtime, spec, options) -> proposer.
BUILDERS: dict[str, Callable[["Runtime", ProposerSpec, Options], "Proposer | None"]] = {
    "plain": lambda rt, spec, o: None,
    "heads": lambda rt, spec, o: _heads(rt, o.tree),
    "feature": lambda rt, spec, o: _feature(rt, spec.arg, o.tree),
    "draft": lambda rt, spec, o: _draft(rt, spec.arg or "default", o.k or DRAFT_K),
    "lookup": lambda rt, spec, o: LookupProposer(k=int(spec.arg or o.k or LOOKUP_K), max_ngram=o.max_ngram),
    "retrieval": lambda rt, spec, o: RetrievalProposer(int(spec.arg or RETRIEVAL_NODES), rt.retriever()),
}
KINDS = tuple(BUILDERS)
MODES = KINDS + tuple(k + MERGED for k in MERGEABLE)  # every mode name (a spec without its argument)


def build_proposer(rt: "Runtime", spec: "str | ProposerSpec", tree: "str | list | Tree | None" = None,
                   k: int | None = None, max_ngram: int = 3) -> Proposer | None:
    """The proposer `spec` names (None for plain decoding), shaped by `Options(tree, k, max_ngram)`."""
    spec = ProposerSpec.parse(spec)
    options = Options(tree, k, max_ngram)
    proposer = BUILDERS[spec.kind](rt, ProposerSpec(spec.kind, spec.arg), options)
    return merged(proposer, rt.retriever(), str(spec)) if spec.retrieval else proposer


def _feature(rt: "Runtime", heads: str | None, tree: "str | list | Tree | None") -> Proposer:
    from medusa.runtime.feature import method_proposer

    return method_proposer(rt, heads, None if tree is None else str(tree))


def _heads(rt: "Runtime", tree: "str | list | Tree | None") -> Proposer:
    name = tree.name if isinstance(tree, Tree) else str(tree)
    static = tree is not None and not is_dynamic(name)
    if rt.feature is not None and not (static and rt.heads is not None):
        from medusa.runtime.feature import feature_proposer

        return feature_proposer(rt, None if tree is None else name)
    if rt.heads is not None and isinstance(tree, str) and is_dynamic(tree):
        from medusa.runtime.feature import medusa_dynamic

        return medusa_dynamic(rt, tree)  # a per-row dynamic tree from the heads' own log-probabilities
    # Names resolve against the heads' own trees first, so trained heads get the trees built for them.
    shape = load_tree(tree or DEFAULT_TREE, heads_dir=rt.heads.directory if rt.heads is not None else None)
    if rt.heads is None:
        raise MedusaError("--mode heads needs heads: pass --heads PATH (no shipped heads fit this model)")
    return MedusaProposer(rt.heads, shape, projection=rt.model.lm_head)


def _draft(rt: "Runtime", path: str, k: int) -> Proposer:
    from medusa.decoding.proposers.draft import DraftProposer, load_draft

    draft = load_draft(path, rt.hf_model)
    if draft.config.vocab_size != rt.model.config.vocab_size:
        raise MedusaError(f"--draft: {path} has a vocabulary of {draft.config.vocab_size}, the target "
                          f"{rt.model.config.vocab_size}; the draft must share the target's tokenizer")
    return DraftProposer(draft, k)


def merged(inner: Proposer | None, retriever=None, spec: str = "heads+retrieval") -> Proposer:
    """`inner`'s dynamic trees with retrieval branches grafted in (`inner` must grow its trees)."""
    if not isinstance(inner, GrowingProposer):
        raise MedusaError(f"--mode: {spec!r}: retrieval merges into dynamic trees: feature heads, or Medusa heads "
                          f"with --tree dynamic-N (use retrieval alone for plain, static trees, drafts or lookup)")
    return MergedProposer(inner, retriever)

