"""Feature heads in the runtime: which heads `--heads` names, the proposer, and auto mode's tree size.

`--heads DIR` holding feature heads (`heads.json` with `"kind": "feature"`, or an EAGLE-1/EAGLE-3 layout)
loads them instead of Medusa heads; `--heads feature` names the shipped ones, and `--heads default` picks
them over the shipped Medusa heads when their heads.json says `"preferred": true` (set only when they
measured faster, see the README; the Medusa heads then stay loaded beside them for static trees) and
`--heads medusa` names the shipped Medusa heads alone. A tree for them is `dynamic-N`, `dynamic-NxD` or
`dynamic-NxDxK` (N nodes, D draft steps, top-K expansion); without one, the size comes from this machine's
calibrated pass-cost curve and the head's per-step accuracy (eval.json), as auto mode does.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from medusa.decoding.trees.dynamic_tree import TreeShape, expected_tau_dynamic, is_dynamic, parse_shape, shape_candidates
from medusa.decoding.proposers.feature_heads import CONFIG, KIND, SHIPPED_FEATURE_DIR, FeatureHead, read_kind
from medusa.decoding.target.model import NAMED_MODELS, named_model_of
from medusa.io import ASSETS
from medusa.decoding.proposers.feature_proposer import FeatureProposer, HeadRunner
from medusa.decoding.proposers.retrieval import MergedProposer
from medusa.errors import MedusaError
from medusa.runtime.auto import MARGIN, Plan, read_accuracy, realised_note, weighed

if TYPE_CHECKING:
    from medusa.runtime.auto import AutoSpeculation
    from medusa.runtime import Runtime

DEFAULT_SHAPE = TreeShape(16, 5)  # when nothing was measured: a middle-sized tree
# Medusa heads' dynamic trees keep top-4 expansions where a name leaves top-k out (the wider default was
# measured on feature heads only).
MEDUSA_TOPK = 4


def shipped_feature_dir(model: str | None = None) -> Path:
    """Where the feature head shipped for a model lives: the embedded model's (`model` None), or a named
    model's own (`medusa.decoding.target.model.NAMED_MODELS`, e.g. qwen2.5-coder-1.5b) beside it. Read at call time
    (tests point SHIPPED_FEATURE_DIR and ASSETS at copies)."""
    if model is None:
        return SHIPPED_FEATURE_DIR
    if model not in NAMED_MODELS:
        raise MedusaError(f"--heads: {model!r} is not a named model ({', '.join(sorted(NAMED_MODELS))})")
    return ASSETS / f"feature_heads-{model}"


def shipped_feature_info(model: str | None = None) -> dict | None:
    """The heads.json of the feature head shipped for `model` (see `shipped_feature_dir`), None if none is."""
    path = shipped_feature_dir(model) / CONFIG
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
    except ValueError:
        return None
    return info if isinstance(info, dict) and info.get("kind", KIND) == KIND else None


def shipped_for(target) -> str | None:
    """Which shipped feature head belongs to a loaded target: its named model's own (by short name), or
    "default" (the embedded model's) for any other target whose hidden and vocabulary sizes it matches;
    None when no shipped head fits."""
    named = named_model_of(target)
    info = shipped_feature_info(named)
    if info is None:
        return None
    config = target.config
    if info.get("hidden_size") != config.hidden_size or info.get("vocab_size") not in (None, config.vocab_size):
        return None
    return named or "default"


def shipped_preferred(hidden_size: int | None = None, model: str | None = None) -> bool:
    """A shipped feature head is the default for its model when marked so (it measured faster than the
    alternatives); `model`: a named model's own head (None: the embedded model's); `hidden_size`: the
    target's, when one is loaded."""
    info = shipped_feature_info(model)
    return bool(info and info.get("preferred")) and (hidden_size is None or info.get("hidden_size") == hidden_size)


def resolve_feature(spec: str | None, hf_model) -> FeatureHead | None:
    """The feature head `--heads` names, or None when it names Medusa heads (or none).

    default:  the head shipped for this target (the embedded model's, or a named model's own), when it is
              marked preferred; feature: that head whatever the mark; a named model's short name: the head
              shipped for that model (e.g. `--heads qwen2.5-coder-1.5b`); a directory: the head in it."""
    if spec in (None, "none", "medusa"):
        return None
    hidden = hf_model.config.hidden_size
    if spec in ("feature", "default"):
        own = shipped_for(hf_model)
        model = None if own in (None, "default") else own
        if own is not None and (spec == "feature" or shipped_preferred(hidden, model)):
            return FeatureHead.load(shipped_feature_dir(model), hf_model)
        if spec == "feature":
            title = getattr(hf_model, "name_or_path", None) or "this model"
            raise MedusaError(f"--heads feature: no feature head is shipped for {title} (shipped: "
                              f"{', '.join(shipped_names()) or 'none'}); train one with `medusa train-feature` "
                              f"and pass its directory")
        return None
    if spec in NAMED_MODELS:
        info = shipped_feature_info(spec)
        if info is None:
            raise MedusaError(f"--heads {spec}: no feature head is shipped for that model (shipped: "
                              f"{', '.join(shipped_names()) or 'none'})")
        if info.get("hidden_size") != hidden:
            raise MedusaError(f"--heads {spec}: that head was trained for {info.get('base_model') or spec} "
                              f"(hidden size {info.get('hidden_size')}), not this model (hidden size {hidden})")
        return FeatureHead.load(shipped_feature_dir(spec), hf_model)
    if spec != "default" and Path(spec).is_dir() and read_kind(spec) == "feature":
        return FeatureHead.load(spec, hf_model)
    return None


def shipped_names() -> list[str]:
    """`--heads` names of the shipped feature heads: `feature` (the embedded model's) and each named model's
    own that this installation holds."""
    return (["feature"] if shipped_feature_info() is not None else []) + \
        [name for name in sorted(NAMED_MODELS) if shipped_feature_info(name) is not None]


@functools.lru_cache(maxsize=8)
def _runner(head: FeatureHead, dtype: torch.dtype, device: torch.device) -> HeadRunner:
    return HeadRunner(head, dtype).to(device)


def runner_for(rt: "Runtime") -> HeadRunner:
    """The runtime's feature head, ready to run in the model's dtype on its device (one per head)."""
    return _runner(rt.feature, rt.model.dtype, rt.model.device)


def feature_proposer(rt: "Runtime", tree: str | None = None, batch_size: int = 1) -> FeatureProposer:
    """`--mode heads` with feature heads: the named dynamic tree, or the planned one for `batch_size`."""
    runner = runner_for(rt)
    if tree is not None:
        if not is_dynamic(tree):
            raise MedusaError(f"--tree: feature heads grow dynamic trees; name one as dynamic-N, dynamic-NxD "
                              f"or dynamic-NxDxK, not {tree!r}")
        return FeatureProposer(rt.feature, rt.model, parse_shape(str(tree)), runner=runner)
    shape = _FeatureAuto(rt, False, batch_size).shape_for(batch_size)
    return FeatureProposer(rt.feature, rt.model, shape or DEFAULT_SHAPE, runner=runner)


class _FeatureAuto:
    """AutoSpeculation's plans for a feature head: one planned dynamic tree per batch size."""

    def __init__(self, rt: "Runtime", progress: bool, batch_size: int):
        from medusa.runtime.calibrate import draft_key, host_key, load_or_measure
        from medusa.runtime.gate import bucket

        self.rt = rt
        self.runner = runner_for(rt)
        # Everything a plan reads is measured here, once per machine (and cached on disk): planning itself,
        # at any batch size a generation passes through as its rows finish, only reads the curve.
        self.cal = load_or_measure(rt, [1 << i for i in range(bucket(batch_size).bit_length())], progress=progress)
        self.accuracy = read_accuracy(rt.feature)
        self.shapes: dict[str, TreeShape] = {}
        self._drafting = functools.partial(self.cal.drafting, draft_key(rt.feature), host_key(rt))

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one planner per runtime; plans are pure per batch size)
    def plan(self, rows: int, realised: float = 1.0):
        if self.accuracy is None:
            shape = DEFAULT_SHAPE
            tree = shape.stand_in()
            self.shapes[tree.name] = shape
            return Plan(rows, tree, 0.0, 0.0, "feature head without eval.json: default dynamic tree, checked "
                                              "by measurement")
        plan, shape = plan_shape(self.cal, self.accuracy, rows, self._drafting, realised=realised)
        if shape is not None:
            self.shapes[plan.tree.name] = shape
        return plan

    def shape_for(self, rows: int) -> TreeShape | None:
        """The planned shape at `rows` rows (None: plain decoding)."""
        tree = self.plan(rows).tree
        return self.shapes.get(tree.name) if tree is not None else None

    def attach(self, batch) -> None:
        """The head's per-row state, shared by every planned shape, before the batch's prefill (prompts
        then need no second pass)."""
        self.make(None).attach(batch)

    def make(self, tree):
        """The planned tree's proposer: the feature head's, with retrieval grafted in unless turned off. A
        tree this planner did not plan is read by its name (`dynamic-NxDxK`)."""
        shape = DEFAULT_SHAPE if tree is None else self.shapes.get(tree.name) or parse_shape(tree.name)
        return draft_proposer(self.rt, shape)


def draft_proposer(rt: "Runtime", shape: TreeShape):
    """Auto mode's proposer for a planned shape: the feature head's, with retrieval grafted in unless turned
    off (also what calibration times a whole draft step of)."""
    heads = FeatureProposer(rt.feature, rt.model, shape, runner=runner_for(rt))
    return MergedProposer(heads, rt.retriever()) if rt.retrieval else heads


def feature_auto(rt: "Runtime", batch_size: int, progress: bool = True) -> "AutoSpeculation":
    """Auto mode with a feature head: the planned dynamic tree per batch size, behind the acceptance gate."""
    from medusa.runtime.auto import AutoSpeculation

    planner = _FeatureAuto(rt, progress, batch_size)
    # The largest planned tree: 64 nodes + the root.
    return AutoSpeculation(planner.plan, planner.make, 65, attach=planner.attach, plain_scale=planner.cal.plain_scale)


def plan_shape(cal, accuracy: list[list[float]], batch: int, drafting, shapes: list[TreeShape] | None = None,
               realised: float = 1.0):
    """The dynamic tree with the best predicted speedup at `batch` rows, or None (plain decoding):
    speedup = tau'(shape) / (ratio(B, N + 1) + drafting(B, D, K)), in one-token passes, with
    tau' = 1 + realised * (tau - 1) (`medusa.runtime.auto.Realised`; the plan keeps the heads' own tau).

    `drafting(rows, depth, topk)` is a whole draft step's cost in one-token target passes (the catch-up
    pass, D - 1 expansions and their host work: `Calibration.drafting`); `cal` the calibrated target
    pass-cost curve."""
    best = None
    # Many shapes share a node count or a depth and top-k: each cost is read off the curve once per plan.
    drafts = functools.lru_cache(maxsize=None)(lambda depth, topk: drafting(batch, depth, topk))
    passes = functools.lru_cache(maxsize=None)(lambda tokens: cal.ratio(batch, tokens))
    for shape in shapes or shape_candidates():
        tau = expected_tau_dynamic(shape, accuracy)
        cost = passes(shape.nodes + 1) + drafts(shape.depth, shape.topk)
        speedup = weighed(tau, realised) / cost
        if best is None or speedup > best[0]:
            best = (speedup, shape, tau, cost)
    speedup, shape, tau, cost = best
    tree = shape.stand_in()
    reason = (f"tau {tau:.2f} expected{realised_note(realised)}, drafting and a {shape.nodes + 1}-token pass cost "
              f"{cost:.2f} plain steps")
    if speedup < MARGIN:
        return Plan(batch, None, 1.0, 1.0, f"best dynamic tree {tree.name} predicts {speedup:.2f}x (< {MARGIN}x): "
                                           f"{reason}"), None
    return Plan(batch, tree, speedup, tau, reason), shape



def method_proposer(rt: "Runtime", heads: str | None, tree: str | None) -> FeatureProposer:
    """The evaluator's and the benchmark's `feature` method: feature heads from `heads` (default: the
    runtime's own when it loaded feature heads, else the shipped ones) beside whatever else runs."""
    from dataclasses import replace

    if heads is None and rt.feature is not None:
        head = rt.feature
    else:
        head = resolve_feature(heads or "feature", rt.hf_model)
        if head is None:
            raise MedusaError(f"feature method: {heads} holds no feature heads")
    return feature_proposer(replace(rt, feature=head), tree)


def bench_methods(rt: "Runtime", spec: str) -> dict[str, FeatureProposer]:
    """`medusa bench --feature`: {'feature:<tree>': proposer} for the named (or shipped) feature heads at
    their planned tree size for batch size 1; nothing for 'none' or when there are none to time."""
    if spec == "none" or (rt.feature is not None and rt.heads is None):
        return {}  # feature heads loaded alone with --heads already run as the main speculative method
    if spec == "auto":  # the runtime's own (loaded beside Medusa heads by `--heads default`), else the shipped
        if rt.feature is None and not (SHIPPED_FEATURE_DIR / "heads.json").is_file():
            return {}
        spec = None if rt.feature is not None else "feature"
    proposer = method_proposer(rt, spec, None)
    return {f"feature:{proposer.tree.name}": proposer}


def medusa_dynamic(rt: "Runtime", tree: str):
    """`--tree dynamic-N[xD[xK]]` with Medusa heads: a per-row dynamic tree (depth at most the heads')."""
    from medusa.decoding.trees.dynamic_tree import MedusaDynamicProposer, pool_size

    shape = parse_shape(tree, topk=MEDUSA_TOPK)
    depth = min(shape.depth, rt.heads.config.num_heads)
    if pool_size(depth, shape.topk) < shape.nodes:
        raise MedusaError(f"--tree {tree}: {rt.heads.config.num_heads} heads cannot grow {shape.nodes} nodes")
    return MedusaDynamicProposer(rt.heads, shape.nodes, depth, shape.topk, projection=rt.model.lm_head)
