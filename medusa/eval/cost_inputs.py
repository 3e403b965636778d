"""The cost model of an evaluation: the target's latency curve from the machine's calibration, the
draft's, the heads' and a feature head's draft passes timed here, acceptance from the runs; predictions, then the measured speedups
where there are some."""

from __future__ import annotations

from medusa.decoding.feature_runner import draft_pass_ms
from medusa.decoding.tree import load_tree
from medusa.eval.config import EvalConfig
from medusa.eval.costmodel import RECOMMENDABLE, alpha_from_acceptance, pays, predict
from medusa.eval.methods import Methods
from medusa.runtime.calibrate import load_or_measure
from medusa.runtime.timing import Latency, measure_forward, measure_heads


def build_cost_model(rt, cfg: EvalConfig, methods: Methods, results: list[dict], progress: bool) -> dict:
    """Latency grids for target, draft and heads, fitted; acceptance from the runs; predictions."""
    from tqdm import tqdm

    cm = cfg.cost_model
    acc = acceptance(rt, results, min(cfg.batch_sizes))
    tokens = sorted(set(cm.tokens) | {s["tree_size"] for s in acc["medusa"].values()}
                    | ({acc["draft"]["k"] + 1} if acc["draft"] else set()))
    draft_spec = next((m for m in cfg.methods if m.method == "draft"), None)
    n_grid = len(cfg.batch_sizes) * (len(tokens) + (2 if draft_spec else 0))
    bar = tqdm(total=n_grid, desc="cost model", unit="pass", disable=not progress)
    # The target's curve is the machine's calibration file (the one --mode auto and the server read),
    # extended by any (B, T) point this evaluation needs that it lacks.
    cal = load_or_measure(rt, cfg.batch_sizes, tokens=tokens, progress=progress)
    bar.update(len(cfg.batch_sizes) * len(tokens))
    lat: dict = {"target": Latency([(b, t, cal.grid[(b, t)]) for b in cfg.batch_sizes for t in tokens]).to_dict()}
    if draft_spec is not None:
        draft = methods.proposer(draft_spec).model  # timed with its own head: a draft may score a reduced vocabulary
        lat["draft"] = Latency(measure_forward(draft.transformer, cfg.batch_sizes, [1, 2, 4], cm.prefix, cm.repeats,
                                               bar, head=draft.head)).to_dict()
    if rt.heads is not None and acc["medusa"]:
        topk = max(load_tree(s["spec"]).topk for s in acc["medusa"].values())
        lat["heads"] = {str(b): ms for b, ms in measure_heads(rt.heads, rt.model.config.hidden_size,
                                                               cfg.batch_sizes, topk, rt.model.dtype,
                                                               rt.model.device, cm.repeats,
                                                               rt.model.lm_head).items()}
    feature_spec = next((m for m in cfg.methods if m.method == "feature"), None)
    if feature_spec is not None and acc["feature"]:
        lat["feature_draft"] = feature_drafting(methods.proposer(feature_spec), acc["feature"], cfg.batch_sizes,
                                                cm.prefix, cm.repeats)
    bar.close()
    model = {"model": getattr(rt.hf_model, "name_or_path", cfg.model), "device": str(rt.model.device),
             "dtype": rt.dtype.name, "prefix_tokens": cm.prefix, "latency_ms": lat,
             "calibration": str(cal.path),
             "acceptance": {k: v for k, v in acc.items() if v}}
    return apply_measurements(predict(model, cfg.batch_sizes), results)


def feature_drafting(proposer, acc: dict, batch_sizes: list[int], prefix: int, repeats: int) -> dict:
    """A feature head's draft cost per batch size: one catch-up pass (the root and the token before it) and
    one expansion pass over the frontier. Records the tree shape it drafts in `acc`."""
    shape = proposer.shape
    acc.update(nodes=shape.nodes, depth=shape.depth, topk=shape.topk)
    return {str(b): {"catch_up": draft_pass_ms(proposer.runner, b, 2, prefix, repeats),
                     "expand": draft_pass_ms(proposer.runner, b, shape.topk, prefix, repeats)} for b in batch_sizes}


def acceptance(rt, results: list[dict], batch: int) -> dict:
    """Acceptance at batch size `batch`: tau and tree size per Medusa tree, tau and alpha of the first draft,
    tau of the first feature method."""
    acc: dict = {"medusa": {}, "draft": None, "feature": None}
    for r in results:
        if r["batch_size"] != batch or r["mean_accepted"] is None:
            continue
        if r["kind"] == "medusa":
            tree = load_tree(r["tree"], heads_dir=rt.heads.directory if rt.heads is not None else None)
            acc["medusa"][tree.name] = {"tau": r["mean_accepted"], "tree_size": tree.size, "method": r["method"],
                                        "spec": r["tree"]}
        elif r["kind"] == "draft" and acc["draft"] is None:
            acc["draft"] = {"k": r["k"], "tau": r["mean_accepted"], "method": r["method"],
                            "alpha": alpha_from_acceptance(r["acceptance_by_head"])}
        elif r["kind"] == "feature" and acc["feature"] is None:
            acc["feature"] = {"tau": r["mean_accepted"], "method": r["method"]}
    return acc


def apply_measurements(model: dict, results: list[dict]) -> dict:
    """Where the runs measured a batch size, the measured speedups decide its recommendation; the latency
    model's predictions fill in the rest. A prediction is a fit of a noisy latency grid (its error is in
    `fit.max_rel_error`); an end-to-end run at that batch size is the better witness. The predictions stay
    in `predicted` / `predicted_recommendation`, and `recommendation_source` says which one decided."""
    best: dict[str, tuple[float, str, str | None]] = {}
    for r in results:
        if r["kind"] in RECOMMENDABLE and r.get("speedup_vs_plain") is not None:
            b = str(r["batch_size"])
            if r["speedup_vs_plain"] > best.get(b, (0.0,))[0]:
                best[b] = (r["speedup_vs_plain"], r["kind"], r.get("tree"))
    model["predicted_recommendation"] = dict(model["recommendation"])
    source = {b: "predicted" for b in model["recommendation"]}
    for b, (speedup, kind, tree) in best.items():
        model["recommendation"][b] = kind if pays(speedup) else "plain"
        source[b] = "measured"
        if kind == "medusa" and tree:
            model["best_tree"][b] = tree
    model["recommendation_source"] = source
    return model
