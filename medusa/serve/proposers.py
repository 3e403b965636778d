"""What the server speculates with: the Medusa proposer of each tree the policy names, a draft model, and
the dynamic policy's defaults calibrated on this machine."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from medusa.decoding.proposers import Proposer
from medusa.decoding.tree import Tree, load_tree
from medusa.errors import MedusaError
from medusa.runtime import Runtime
from medusa.runtime.gate import bucket
from medusa.runtime.proposers import build_proposer
from medusa.serve.config import ServeConfig
from medusa.serve.policy import CostModel, SpeculationPolicy

log = logging.getLogger("medusa.serve.app")


def calibrated_policy(cfg: ServeConfig, rt: Runtime, draft: Any) -> tuple[CostModel | None, dict[str, Tree]]:
    """The dynamic policy's defaults from this machine's calibrated curve and the heads' accuracy (the
    plans `--mode auto` makes), with the trees they name; nothing when a cost_model file decides, the
    policy is fixed, a draft is served, or the heads carry no eval.json to predict from."""
    pc = cfg.policy
    if pc.mode != "dynamic" or pc.cost_model or not pc.calibrate or draft is not None or rt.heads is None:
        return None, {}
    auto = rt.auto(cfg.max_batch)
    if auto is None or not auto.predicted:
        return None, {}
    plans = [auto.plan(1 << i) for i in range(bucket(cfg.max_batch).bit_length())]
    for p in plans:
        log.info("calibrated policy at batch size %d: %s (%s)", p.batch, p.tree.name if p.tree else "plain", p.reason)
    return CostModel.from_plans(plans), {p.tree.name: p.tree for p in plans if p.tree is not None}


def medusa_proposers(rt: Runtime, policy: SpeculationPolicy, planned: dict[str, Tree]) -> dict[str, Any]:
    """A Medusa proposer per tree the policy names, built up front: a bad tree name or a heads/tree
    mismatch fails at startup."""
    if rt.heads is None:
        return {}
    return {name: rt.proposer("medusa", planned.get(name) or tree_by_name(name, rt.heads.directory))
            for name in sorted(set(policy.trees.values()))}


def tree_by_name(name: str, heads_dir: Path | None = None) -> Tree:
    """A tree the policy names (`tree-16`, `chain-K`, a path), read by the one tree parser; errors name the
    config key."""
    try:
        return load_tree(name, heads_dir=heads_dir)
    except MedusaError as exc:
        raise MedusaError(f"policy.trees: {str(exc).removeprefix('--tree: ')}") from None


def load_draft(cfg: ServeConfig, rt: Runtime) -> Proposer:
    """The draft-model proposer for `draft` speculation (`--draft`: `default`, `layers:N`, a `medusa
    train-draft` directory or an HF model sharing the target's tokenizer), `--draft-k` tokens a step."""
    return build_proposer(rt, f"draft:{cfg.draft}", k=cfg.draft_k)
