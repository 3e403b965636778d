"""The configured methods: each one's proposer (or HF assistant) built once, the (batch size, method) runs
planned, and one run of a method dispatched to our engine or to HF `generate()`."""

from __future__ import annotations

from medusa.decoding.proposers import Proposer
from medusa.decoding.trees.tree import DEFAULT_TREE
from medusa.runtime.proposers import MERGED, ProposerSpec, build_proposer
from medusa.eval.anchors import run_hf
from medusa.eval.config import BATCH_ONE_ONLY, HF, EvalConfig, MethodSpec
from medusa.eval.driver import RunResult, run_engine


def make_proposer(rt, m: MethodSpec) -> Proposer | None:
    """The proposer of one of our methods (None: plain decoding), from the one proposer factory."""
    kind = m.method.removesuffix(MERGED)
    arg = {"feature": m.heads, "draft": m.draft or "default", "retrieval": str(m.k) if m.k else None}.get(kind)
    spec = ProposerSpec(kind, arg, retrieval=m.method.endswith(MERGED))
    # `heads` is the Medusa heads over their default tree even where feature heads were loaded beside them.
    tree = m.tree or (DEFAULT_TREE if m.method == "heads" else None)
    return build_proposer(rt, spec, tree, k=m.k, max_ngram=m.max_ngram)


class Methods:
    """Builds each configured method's proposer (or HF settings) once, lazily."""

    def __init__(self, rt, cfg: EvalConfig):
        self.rt, self.cfg = rt, cfg
        self._drafts: dict[str, object] = {}
        self._proposers: dict[str, Proposer | None] = {}

    def draft_hf(self, spec: str):
        from medusa.decoding.proposers.draft import load_draft_hf

        if spec not in self._drafts:
            self._drafts[spec] = load_draft_hf(spec, self.rt.hf_model)
        return self._drafts[spec]

    def proposer(self, m: MethodSpec) -> Proposer | None:
        if m.name not in self._proposers:
            self._proposers[m.name] = make_proposer(self.rt, m)
        return self._proposers[m.name]

    def run(self, m: MethodSpec, prompts: list[list[int]], batch: int, max_new: int) -> RunResult:
        if m.method in HF:
            draft = self.draft_hf(m.draft or "default") if m.method == "hf_assisted" else None
            return run_hf(self.rt, prompts, batch, max_new, m, draft, self.cfg.sampling(0))
        sampling = self.cfg.sampling if self.cfg.sampled else None
        if m.method == "auto":  # a fresh auto mode per run, as each `medusa generate` makes one
            policy = self.rt.auto(batch, progress=False)
            result = run_engine(self.rt.engine, prompts, batch, max_new, sampling=sampling, policy=policy)
            if policy is not None and policy.predicted:
                result.realised = policy.realised.overall()
            return result
        return run_engine(self.rt.engine, prompts, batch, max_new, self.proposer(m), sampling)


def planned_runs(cfg: EvalConfig) -> list[tuple[int, MethodSpec]]:
    """Every (batch size, method) pair the config asks for, HF's limits applied."""
    runs = []
    for b in cfg.batch_sizes:
        for m in cfg.methods:
            if m.method in BATCH_ONE_ONLY and b != 1:
                continue
            if m.method == "hf" and b not in cfg.hf_batch_sizes:
                continue
            runs.append((b, m))
    return runs
