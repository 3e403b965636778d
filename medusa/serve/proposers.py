"""What the server speculates with: a proposer of the runtime's heads for each tree the policy names (Medusa
heads over static or dynamic trees, feature heads over dynamic trees), a draft model, and the dynamic
policy's defaults calibrated on this machine."""

from __future__ import annotations

import logging
from typing import Any

from medusa.decoding.trees.dynamic_tree import is_dynamic
from medusa.decoding.proposers import Proposer
from medusa.decoding.trees.tree import DEFAULT_TREE, Tree, load_tree
from medusa.errors import MedusaError
from medusa.runtime import Runtime
from medusa.runtime.gate import bucket
from medusa.runtime.proposers import RETRIEVAL_NODES, ProposerSpec, build_proposer
from medusa.serve.config import ServeConfig
from medusa.serve.policy import CostModel, SpeculationPolicy

log = logging.getLogger("medusa.serve.app")


def calibrated_policy(cfg: ServeConfig, rt: Runtime, draft: Any) -> tuple[CostModel | None, dict[str, Tree]]:
    """The dynamic policy's defaults from this machine's calibrated curve and the heads' accuracy (the
    plans `--mode auto` makes), with the trees they name; nothing when a cost_model file decides, the
    policy is fixed, a draft is served, or the heads carry no eval.json to predict from."""
    pc = cfg.policy
    if (pc.mode != "dynamic" or pc.cost_model or not pc.calibrate or draft is not None
            or (rt.heads is None and rt.feature is None)):  # retrieval alone: nothing to predict from
        return None, {}
    auto = rt.auto(cfg.max_batch)
    if auto is None or not auto.predicted:
        return None, {}
    plans = [auto.plan(1 << i) for i in range(bucket(cfg.max_batch).bit_length())]
    for p in plans:
        log.info("calibrated policy at batch size %d: %s (%s)", p.batch, p.tree.name if p.tree else "plain", p.reason)
    return CostModel.from_plans(plans), {p.tree.name: p.tree for p in plans if p.tree is not None}


def drafts_without_draft_model(rt: Runtime) -> bool:
    """Whether the runtime can speculate with no draft model (the policy's "heads" mode): heads of its own
    (Medusa or feature heads), or, without heads, retrieval alone (`retrieval:N` trees)."""
    return rt.heads is not None or rt.feature is not None or rt.retrieval


def default_trees(rt: Runtime) -> dict[int, str]:
    """The trees when neither the config nor a calibration names them: Medusa heads' default static tree,
    a middle-sized dynamic tree for feature heads (they grow dynamic trees only), or without heads
    retrieval's default tree, named as its mode (`retrieval:16`)."""
    if rt.feature is not None:
        from medusa.runtime.feature import DEFAULT_SHAPE

        return {1: DEFAULT_SHAPE.full_name}
    if rt.heads is None:
        return {1: str(ProposerSpec("retrieval", str(RETRIEVAL_NODES)))}
    return {1: DEFAULT_TREE}


def heads_proposers(rt: Runtime, policy: SpeculationPolicy, planned: dict[str, Tree]) -> dict[str, Any]:
    """A proposer of the runtime's heads per tree the policy names, built up front: a bad tree name or a
    heads/tree mismatch fails at startup, naming the config key."""
    if not drafts_without_draft_model(rt):
        return {}
    return {name: heads_proposer(rt, name, planned.get(name)) for name in sorted(set(policy.trees.values()))}


def heads_proposer(rt: Runtime, name: str, planned: Tree | None = None) -> Any:
    """The runtime's heads over tree `name`: dynamic trees (`dynamic-N[xD[xK]]`) by name, static trees as
    calibration planned them or by the one tree parser."""
    try:
        if rt.heads is None and rt.feature is None:  # retrieval alone: its trees are named as its mode
            kind, _, nodes = name.partition(":")
            if kind != "retrieval" or not nodes.isdigit():
                raise MedusaError(f"{name!r}: without heads the trees are retrieval's, named retrieval:N")
            return build_proposer(rt, name)
        if is_dynamic(name) or rt.feature is not None:  # dynamic trees: retrieval grafted in
            return rt.proposer("heads+retrieval" if rt.retrieval else "heads", name)
        return rt.proposer("heads", planned or load_tree(name, heads_dir=rt.heads.directory))
    except MedusaError as exc:
        raise MedusaError(f"policy.trees: {str(exc).removeprefix('--tree: ')}") from None


def load_draft(cfg: ServeConfig, rt: Runtime) -> Proposer:
    """The draft-model proposer for `draft` speculation (`--draft`: `default`, `layers:N`, a `medusa
    train-draft` directory or an HF model sharing the target's tokenizer), `--draft-k` tokens a step."""
    return build_proposer(rt, f"draft:{cfg.draft}", k=cfg.draft_k)
