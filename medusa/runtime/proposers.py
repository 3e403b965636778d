"""One place that turns a proposer spec into a proposer for a runtime's model.

    plain            no proposer: plain decoding
    medusa           the runtime's heads: Medusa heads over a static tree (`--tree`, default the heads'
                     own) or a per-row dynamic tree (`dynamic-N[xD[xK]]`), or the feature heads `--heads`
                     loaded (dynamic trees only)
    feature[:DIR]    feature heads from DIR (default: the runtime's own, else the shipped ones)
    draft[:PATH]     a draft model (`default`, `layers:N`, a `medusa train-draft` directory, an HF model
                     directory or hub id) proposing a chain of `k` tokens
    lookup[:K]       prompt lookup, K tokens (default 8)
    suffix[:N]       retrieval alone: a tree of N nodes (default 16) from the text's own earlier
                     continuations (`medusa.decoding.retrieval`); needs no heads
    X+suffix         X's dynamic trees (medusa with feature heads or --tree dynamic-N, feature[:DIR])
                     with retrieval branches grafted in, under X's node budget

The CLI, the evaluator and the server build their proposers here, so a spec means the same everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from medusa.decoding.proposers import MedusaProposer, Proposer
from medusa.decoding.tree import DEFAULT_TREE, Tree, load_tree
from medusa.errors import MedusaError

if TYPE_CHECKING:
    from medusa.runtime import Runtime

SPECS = "plain, medusa, feature[:DIR], draft[:PATH], lookup[:K], suffix[:N], medusa+suffix, feature[:DIR]+suffix"
DRAFT_K = 4
LOOKUP_K = 8
SUFFIX_NODES = 16
# What `--mode` names besides auto (medusa: the runtime's heads; suffix: retrieval alone; both: merged).
MODES = ("plain", "medusa", "suffix", "medusa+suffix")
MERGED = "+suffix"


def build_proposer(rt: "Runtime", spec: str, tree: "str | list | Tree | None" = None, k: int | None = None,
                   max_ngram: int = 3) -> Proposer | None:
    """The proposer `spec` names (None for plain decoding). `tree` shapes Medusa and feature heads' trees;
    `k` is the draft's chain length (default 4) or lookup's token count when the spec gives none;
    `max_ngram` the longest n-gram prompt lookup matches."""
    if spec.endswith(MERGED):
        return merged(build_proposer(rt, spec.removesuffix(MERGED), tree, k, max_ngram), rt.retriever(), spec)
    kind, _, arg = spec.partition(":")
    if kind in ("plain", "medusa") and arg:
        raise MedusaError(f"--mode: {spec!r}: {kind} takes no argument (choose {SPECS})")
    if kind == "plain":
        return None
    if kind == "medusa":
        return _medusa(rt, tree)
    if kind == "feature":
        from medusa.runtime.feature import method_proposer

        return method_proposer(rt, arg or None, None if tree is None else str(tree))
    if kind == "draft":
        return _draft(rt, arg or "default", k or DRAFT_K)
    if kind == "lookup":
        from medusa.decoding.lookup import LookupProposer

        return LookupProposer(k=_count(spec, arg) if arg else k or LOOKUP_K, max_ngram=max_ngram)
    if kind == "suffix":
        from medusa.decoding.retrieval import SuffixProposer

        return SuffixProposer(_count(spec, arg) if arg else SUFFIX_NODES, rt.retriever())
    raise MedusaError(f"--mode: unknown proposer {spec!r} (choose {SPECS})")


def _medusa(rt: "Runtime", tree: "str | list | Tree | None") -> Proposer:
    name = tree.name if isinstance(tree, Tree) else str(tree)
    static = tree is not None and not name.startswith("dynamic-")
    if rt.feature is not None and not (static and rt.heads is not None):
        from medusa.runtime.feature import feature_proposer

        return feature_proposer(rt, None if tree is None else name)
    if rt.heads is not None and isinstance(tree, str) and tree.startswith("dynamic-"):
        from medusa.runtime.feature import medusa_dynamic

        return medusa_dynamic(rt, tree)  # a per-row dynamic tree from the heads' own log-probabilities
    # Names resolve against the heads' own trees first, so trained heads get the trees built for them.
    shape = load_tree(tree or DEFAULT_TREE, heads_dir=rt.heads.directory if rt.heads is not None else None)
    if rt.heads is None:
        raise MedusaError("--mode medusa needs heads: pass --heads PATH (no shipped heads fit this model)")
    return MedusaProposer(rt.heads, shape, projection=rt.model.lm_head)


def _draft(rt: "Runtime", path: str, k: int) -> Proposer:
    from medusa.decoding.draft import DraftProposer, load_draft

    draft = load_draft(path, rt.hf_model)
    if draft.config.vocab_size != rt.model.config.vocab_size:
        raise MedusaError(f"--draft: {path} has a vocabulary of {draft.config.vocab_size}, the target "
                          f"{rt.model.config.vocab_size}; the draft must share the target's tokenizer")
    return DraftProposer(draft, k)


def merged(inner: Proposer | None, retriever=None, spec: str = "medusa+suffix") -> Proposer:
    """`inner`'s dynamic trees with retrieval branches grafted in."""
    from medusa.decoding.dynamic_tree import MedusaDynamicProposer
    from medusa.decoding.feature_proposer import FeatureProposer
    from medusa.decoding.retrieval import MergedProposer

    if not isinstance(inner, (FeatureProposer, MedusaDynamicProposer)):
        raise MedusaError(f"--mode: {spec!r}: retrieval merges into dynamic trees: feature heads, or Medusa heads "
                          f"with --tree dynamic-N (use suffix alone for plain, static trees, drafts or lookup)")
    return MergedProposer(inner, retriever)


def _count(spec: str, arg: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise MedusaError(f"--mode: {spec!r}: expected {spec.partition(':')[0]}:N with an integer N") from None
