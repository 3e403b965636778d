"""What the server speculates with: the Medusa proposer of each tree the policy names, a draft model, and
the dynamic policy's defaults calibrated on this machine."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from medusa.decoding.tree import Tree, chain, load_tree
from medusa.errors import MedusaError
from medusa.runtime import Runtime
from medusa.runtime.gate import bucket
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
    """A shipped/file tree (`tree-16`, a path) or `chain-K`: the heads' top-1 tokens only, K deep (what pays
    when the heads are weak or a tree costs too much)."""
    m = re.fullmatch(r"chain-(\d+)", name)
    if m:
        if not 1 <= int(m.group(1)) <= 16:
            raise MedusaError(f"policy.trees: {name}: chain depth must be 1..16")
        return chain(int(m.group(1)))
    try:
        return load_tree(name, heads_dir=heads_dir)
    except MedusaError as exc:
        raise MedusaError(f"policy.trees: {exc}") from None


def load_draft(cfg: ServeConfig, rt: Runtime) -> Any:
    """A draft-model proposer for `draft` speculation: `default` (the shipped draft of the embedded
    model), `layers:N` (the target's first N layers), a `medusa train-draft` directory or an HF model
    sharing the target's tokenizer."""
    try:
        from medusa.decoding.draft import DraftProposer, load_draft as load_draft_model
    except ImportError:
        raise MedusaError("--draft: draft-model speculation is not available (medusa.decoding.draft is missing)") from None
    draft = load_draft_model(cfg.draft, rt.hf_model)
    if draft.config.vocab_size != rt.model.config.vocab_size:
        raise MedusaError(f"--draft: {cfg.draft} has a vocabulary of {draft.config.vocab_size}, the target "
                          f"{rt.model.config.vocab_size}; the draft must share the target's tokenizer")
    return DraftProposer(draft, cfg.draft_k)
