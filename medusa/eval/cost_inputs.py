"""The cost model of an evaluation: the target's latency curve from the machine's calibration, the
draft's, the heads' and a feature head's draft passes timed here, auto mode's plans, acceptance from the
runs; every method's predictions, then the fastest method measured and predicted at each batch size."""

from __future__ import annotations

from medusa.decoding.trees.dynamic_tree import parse_shape
from medusa.decoding.trees.tree import load_tree
from medusa.eval.config import HF, EvalConfig
from medusa.eval.costmodel import (SPECULATIVE, alpha_from_acceptance, crossover, crossover_of, drafting_ms, pays,
                                   predict)
from medusa.eval.methods import Methods
from medusa.eval.step_model import planned, predict_runs
from medusa.runtime.calibrate import draft_key, host_key, load_or_measure
from medusa.runtime.gate import bucket
from medusa.runtime.proposers import MERGED
from medusa.runtime.timing import Latency, draft_pass_ms, draft_step_ms, measure_forward, measure_heads


def build_cost_model(rt, cfg: EvalConfig, methods: Methods, results: list[dict], progress: bool) -> dict:
    """Latency grids for target, draft and heads, fitted; acceptance from the runs; predictions."""
    from tqdm import tqdm

    cm = cfg.cost_model
    acc = acceptance(rt, results, min(cfg.batch_sizes))
    tokens = sorted(set(cm.tokens) | {s["tree_size"] for s in acc["heads"].values()}
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
    if rt.heads is not None and acc["heads"]:
        topk = max(load_tree(s["spec"]).topk for s in acc["heads"].values())
        lat["heads"] = {str(b): ms for b, ms in measure_heads(rt.heads, rt.model.config.hidden_size,
                                                               cfg.batch_sizes, topk, rt.model.dtype,
                                                               rt.model.device, cm.repeats,
                                                               rt.model.lm_head).items()}
    feature_spec = next((m for m in cfg.methods if m.method == "feature"), None)
    if feature_spec is not None and acc["feature"]:
        lat["feature_draft"] = feature_drafting(rt.engine, methods.proposer(feature_spec), acc["feature"],
                                                cfg.batch_sizes, cm.prefix, cm.repeats)
    drafting = method_drafting(rt, cfg, methods, lat, cm)
    b0_auto = [r for r in results if r["kind"] == "auto" and r["batch_size"] == min(cfg.batch_sizes)]
    plans = auto_plans(rt, cfg.batch_sizes, b0_auto[0].get("realised") if b0_auto else None) if b0_auto else {}
    bar.close()
    model = {"model": getattr(rt.hf_model, "name_or_path", cfg.model), "device": str(rt.model.device),
             "dtype": rt.dtype.name, "prefix_tokens": cm.prefix, "latency_ms": lat,
             "calibration": str(cal.path),
             "acceptance": {k: v for k, v in acc.items() if v}}
    model = predict(model, cfg.batch_sizes)
    by_method(model, Latency.from_dict(lat["target"]), results, drafting, plans)
    return apply_measurements(model, results)


def feature_drafting(engine, proposer, acc: dict, batch_sizes: list[int], prefix: int, repeats: int) -> dict:
    """A feature head's draft cost per batch size: one catch-up pass (the root and the token before it), one
    expansion pass over the frontier, and `host`: what a whole draft step of `proposer` (retrieval grafted in
    when it grafts) spends beyond its depth's passes, timed in `engine`. Records the tree shape in `acc`."""
    inner = getattr(proposer, "inner", proposer)  # a merged tree drafts with its inner head
    shape = inner.shape
    acc.update(nodes=shape.nodes, depth=shape.depth, topk=shape.topk)
    out = {}
    for b in batch_sizes:
        t = {"catch_up": draft_pass_ms(inner.runner, b, 2, prefix, repeats),
             "expand": draft_pass_ms(inner.runner, b, shape.topk, prefix, repeats)}
        step = draft_step_ms(engine, proposer, b, prefix)
        out[str(b)] = {**t, "host": max(step - drafting_ms(t, shape.depth), 0.0)}
    return out



def method_drafting(rt, cfg: EvalConfig, methods: Methods, lat: dict, cm) -> dict[str, dict[int, float]]:
    """Per configured method, ms of its draft passes per step at each batch size, from the curves timed
    above (a feature head's drafting at its own tree's shape, timed here for each method that drafts
    with one); methods that draft on the host (lookup, retrieval) have none, auto mode's follow its plans."""
    out: dict[str, dict[int, float]] = {}
    draft = Latency.from_dict(lat["draft"]) if lat.get("draft") else None
    heads = lat.get("heads") or {}
    for m in cfg.methods:
        kind = m.method.removesuffix(MERGED)
        if kind == "heads" and heads:
            out[m.name] = {int(b): ms for b, ms in heads.items()}
        elif kind == "draft" and draft is not None:
            k = m.k or 4
            out[m.name] = {b: draft(b, 2) + (k - 1) * draft(b, 1) for b in cfg.batch_sizes}
        elif kind == "feature" and rt.feature is not None:
            proposer = methods.proposer(m)
            inner = getattr(proposer, "inner", proposer)  # a merged tree drafts with its inner head
            shape = inner.shape
            first = m is next(x for x in cfg.methods if x.method == "feature")
            # The first feature method's drafting was timed above, for the latency model: not again.
            timed = lat["feature_draft"] if first and lat.get("feature_draft") else \
                feature_drafting(rt.engine, proposer, {}, cfg.batch_sizes, cm.prefix, cm.repeats)
            out[m.name] = {int(b): drafting_ms(t, shape.depth) for b, t in timed.items()}
    return out


def auto_plans(rt, batch_sizes: list[int], realised: float | None = None) -> dict[int, dict | None]:
    """Auto mode's plan at each batch size, as `medusa generate` makes it once its steps have shown what
    share of the expected gain they deliver (`realised`, measured by its run at the smallest batch size;
    None: the plans before any step): the planned tree's tokens per row, its expected tau and its draft
    passes' ms from this machine's calibration (None: plain decoding)."""
    policy = rt.auto(max(batch_sizes), progress=False)
    if policy is None:
        return {b: None for b in batch_sizes}
    cal = load_or_measure(rt, [1 << i for i in range(bucket(max(batch_sizes)).bit_length())], progress=False)
    out: dict[int, dict | None] = {}
    for b in batch_sizes:
        plan = policy.plan(b, realised)
        if plan.tree is None:
            out[b] = None
            continue
        draft = 0.0  # retrieval alone drafts on the host
        if rt.feature is not None:
            shape = parse_shape(plan.tree.name)
            draft = cal.drafting(draft_key(rt.feature), host_key(rt), b, shape.depth, shape.topk) * cal.ms(b, 1)
        elif rt.heads is not None:
            draft = cal.heads(b)
        out[b] = {"tokens": plan.tree.size, "tau": plan.tau, "draft": draft}
    return out


def by_method(model: dict, target: Latency, results: list[dict], drafting: dict[str, dict[int, float]],
              plans: dict[int, dict | None] | None = None) -> None:
    """Each speculative method's predicted speedup at every batch size from its run at the smallest one
    (`medusa.eval.step_model`; auto mode's following its `plans`), its predicted crossover, and each kind's
    best method in `predicted`."""
    rows = [r for r in results if r["kind"] not in HF and "steps" in r]
    plain = {r["batch_size"]: r for r in rows if r["kind"] == "plain"}
    if not plain:
        return
    b0 = min(plain)
    sizes = sorted(plain)
    per_method: dict[str, dict[int, float]] = {}
    best: dict[tuple[str, int], float] = {}  # (kind, B) -> the best of that kind's methods
    for r in rows:
        if r["kind"] == "plain" or r["batch_size"] != b0:
            continue
        run = {"batch": b0, "run": r, "tokens_per_pass": r["tokens_per_pass"]}
        if r["kind"] == "auto" and plans:
            run["plan"] = planned(plans, b0, r["mean_accepted"], r["tokens_per_pass"])
        per_method[r["method"]] = predict_runs(target, plain, run, drafting.get(r["method"]), sizes)
        kind = r["kind"].removesuffix(MERGED)
        for b, s in per_method[r["method"]].items():
            best[(kind, b)] = max(s, best.get((kind, b), 0.0))
    for (kind, b), s in best.items():  # the runs' predictions replace the latency-only ones of their kind
        model["predicted"].setdefault(str(b), {"plain": 1.0})[kind] = s
    model["predicted_by_method"] = {str(b): {name: p[b] for name, p in per_method.items() if b in p}
                                    for b in sizes}
    model["crossover_by_method"] = {name: crossover(p) for name, p in per_method.items()}
    model["crossover"] = {kind: crossover_of(model["predicted"], kind)
                          for kind in dict.fromkeys((*SPECULATIVE, *(k for k, _ in best)))}


def acceptance(rt, results: list[dict], batch: int) -> dict:
    """Acceptance at batch size `batch`: tau and tree size per Medusa tree, tau and alpha of the first draft,
    tau of the first feature method."""
    acc: dict = {"heads": {}, "draft": None, "feature": None}
    for r in results:
        if r["batch_size"] != batch or r["mean_accepted"] is None:
            continue
        if r["kind"] == "heads":
            tree = load_tree(r["tree"], heads_dir=rt.heads.directory if rt.heads is not None else None)
            acc["heads"][tree.name] = {"tau": r["mean_accepted"], "tree_size": tree.size, "method": r["method"],
                                        "spec": r["tree"]}
        elif r["kind"] == "draft" and acc["draft"] is None:
            acc["draft"] = {"k": r["k"], "tau": r["mean_accepted"], "method": r["method"],
                            "alpha": alpha_from_acceptance(r["acceptance_by_head"])}
        elif r["kind"] == "feature" and acc["feature"] is None:
            acc["feature"] = {"tau": r["mean_accepted"], "method": r["method"]}
    return acc


def server_kind(kind: str) -> str:
    """The server policy's mode that runs a method of this kind: a draft model, plain decoding, or the
    runtime's own proposer (its heads, with retrieval) for every other kind."""
    return kind if kind in ("plain", "draft") else "heads"


def apply_measurements(model: dict, results: list[dict]) -> dict:
    """The fastest method at each batch size, weighing every method this engine ran (plain included; the
    HF anchors are references, not methods it serves): measured where the runs measured that batch size,
    predicted elsewhere. `fastest` {B: {measured, predicted}} names them; `recommendation` gives the
    server's mode for the measured one (the prediction where none was measured), `predicted_recommendation`
    the mode for the predicted one. A prediction is a model of a noisy machine; a run is the better witness.
    `recommendation_source` says which one decided."""
    measured: dict[str, tuple[float, str, str]] = {}
    for r in results:
        if r["kind"] in HF or r.get("speedup_vs_plain") is None:
            continue
        b = str(r["batch_size"])  # plain decoding is the 1.0 every speedup is measured against
        best = measured.setdefault(b, (1.0, "plain", "plain"))
        if r["speedup_vs_plain"] > best[0]:
            measured[b] = (r["speedup_vs_plain"], r["method"], r["kind"])
    kinds = {r["method"]: r["kind"] for r in results}
    fastest, source = {}, {}
    model["predicted_recommendation"] = dict(model["recommendation"])
    for b in model["recommendation"]:
        options = {"plain": 1.0, **(model.get("predicted_by_method") or {}).get(b, {})}
        predicted = max(options, key=lambda name: (options[name], name == "plain"))
        fastest[b] = {"predicted": predicted, "predicted_speedup": options[predicted]}
        if (model.get("predicted_by_method") or {}).get(b):
            model["predicted_recommendation"][b] = server_kind(kinds.get(predicted, "plain"))
        if b in measured:
            speedup, name, kind = measured[b]
            fastest[b].update(measured=name, measured_speedup=speedup)
            model["recommendation"][b] = server_kind(kind) if pays(speedup) else "plain"
            source[b] = "measured"
            if kind == "heads":
                model["best_tree"][b] = next(r.get("tree") for r in results if r["method"] == name) or \
                    model["best_tree"].get(b)
        else:
            model["recommendation"][b] = model["predicted_recommendation"][b]
            source[b] = "predicted"
    model["fastest"], model["recommendation_source"] = fastest, source
    return model
