"""`medusa export`: copy a run's heads, with their trees and eval.json, to a place the user names.

A training run writes only under its run_dir. Putting heads anywhere else is this explicit step: `--out DIR`
for any directory, `--to-shipped` for the heads `--heads default` loads, which is refused when the new heads
measure worse than the shipped ones. Heads, `trees/` and `eval.json` are always copied together, into a
temporary directory renamed into place, so a reader never sees heads with another run's trees.

"Worse" is judged by tau, the expected accepted length per verification pass with the heads' own default
tree, computed from the held-out rank accuracies in each one's eval.json (the quantity the greedy tree
builder maximises). Each tau comes from its own run's held-out split, so small differences are noise.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from medusa.errors import MedusaError

from medusa.io import atomic_dir


def _write_native(src: Path, dest: Path) -> None:
    """Our layout as training wrote it: heads, eval.json, train_config.yaml, trees/ (and adapter/)."""
    shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*"))


def _feature_head(src: Path):
    """The feature head in `src` with the target it was trained for (train_config.yaml's model)."""
    import yaml

    from medusa.decoding.proposers.feature_heads import FeatureHead
    from medusa.decoding.target.model import load_target

    model = "default"
    if (src / "train_config.yaml").exists():
        model = (yaml.safe_load((src / "train_config.yaml").read_text()) or {}).get("model", "default")
    target, _ = load_target(model, "fp32", "cpu")
    return FeatureHead.load(src, target)


def _write_eagle(layout: str) -> Callable[[Path, Path], None]:
    """Feature heads as an EAGLE-1 (`eagle`) or EAGLE-3 (`eagle3`) checkpoint (config.json + weights)."""
    def write(src: Path, dest: Path) -> None:
        from medusa.decoding.proposers.feature_formats import save_eagle

        head = _feature_head(src)
        n = len(head._target[0].model.layers)
        eagle_layers = [2, n // 2, n - 3]
        if layout == "eagle3" and list(head.config.feature_layers) != eagle_layers:
            print(f"medusa export: this head fuses target layers {list(head.config.feature_layers)}; "
                  f"SafeAILab/EAGLE's code feeds an EAGLE-3 head layers {eagle_layers} (its config key "
                  "eagle_feature_layers is ours only)", file=sys.stderr)
        save_eagle(head, dest, layout)
        for extra in ("eval.json", "train_config.yaml"):
            if (src / extra).exists():
                shutil.copy2(src / extra, dest / extra)
    return write


def _copy_extras(src: Path, dest: Path) -> None:
    """eval.json, train_config.yaml and trees/ go along in every layout (other loaders ignore them, ours
    finds the heads' own trees next to them)."""
    for name in ("eval.json", "train_config.yaml"):
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    if (src / "trees").is_dir():
        shutil.copytree(src / "trees", dest / "trees", dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*"))


def target_lm_head(model: str) -> torch.Tensor:
    """The target's output projection [vocab, hidden], as stored: read from its safetensors files when it is a
    local checkpoint (`lm_head.weight`, or the tied `model.embed_tokens.weight`), else from the loaded model."""
    from safetensors import safe_open

    from medusa.decoding.target.model import load_target, resolve_model_dir

    where = Path(resolve_model_dir(model))
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else []
    for key in ("lm_head.weight", "model.embed_tokens.weight"):  # untied models store lm_head.weight
        for f in files:
            with safe_open(str(f), "pt") as st:
                if key in st.keys():
                    return st.get_tensor(key)
    hf_model, _ = load_target(model, "fp32", "cpu")
    return hf_model.get_output_embeddings().weight.detach()


# What FasterDecoding's loader builds whatever config.json says (it overrides medusa_num_heads).
FASTERDECODING_HEADS = 5
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def base_name(name: str, flag: str = "--base") -> str:
    """What another loader's `base_model_name_or_path` should say for target `name`: the hub id of the
    embedded model, the absolute path of a local model folder, a hub id as given."""
    from medusa.decoding.target.model import DEFAULT_MODEL, EMBEDDED_NAME

    if name in (DEFAULT_MODEL, EMBEDDED_NAME):
        return EMBEDDED_HUB_ID
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.is_file():
        raise MedusaError(f"{flag}: {name} is a file; other loaders read the target from a model folder or a hub "
                          "id (write one with --base-model DIR and pass --base DIR)")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return name
    raise MedusaError(f"{flag}: {name!r} is neither a local model folder, a hub id (owner/name) nor 'default'")


def _write_layout(layout: str, src: Path, dest: Path, model: str | None, base: str | None = None) -> None:
    from medusa.decoding.proposers.heads import MedusaHeads

    heads = MedusaHeads.load(src)
    target = model or heads.config.base_model
    if heads.lm_heads is None:
        # Heads sharing the target's lm_head: these layouts store it, so it is read from the target.
        if not target:
            raise MedusaError(f"--model: {src} shares the target's lm_head but does not record its target; "
                              "name the target model with --model")
        heads.use_projection(target_lm_head(target))
    if base is not None:
        heads.config.base_model = base_name(base)
    elif target:
        heads.config.base_model = base_name(target, "--model" if model else "--base")
    else:
        raise MedusaError(f"--base: {src} does not record its target model; name it with --base (a hub id or "
                          "a model folder)")
    if layout == "medusa" and heads.candidate_ids is not None:
        print(f"medusa export: the Medusa layout has no candidate vocabulary; the {heads.config.candidates} "
              "candidates are dropped and its heads rank the whole vocabulary", file=sys.stderr)
    n = heads.config.num_heads
    if layout == "medusa" and n != FASTERDECODING_HEADS:
        def span(a: int, b: int) -> str:
            return f"head {a}" if a == b else f"heads {a}..{b}"
        extra = (f"its {span(n + 1, FASTERDECODING_HEADS)} keep their random initialisation, without a warning: "
                 f"use medusa_choices over the first {n} heads only" if n < FASTERDECODING_HEADS else
                 f"{span(FASTERDECODING_HEADS + 1, n)} are dropped without a warning")
        print(f"medusa export: {n} heads written (medusa_num_heads {n}); FasterDecoding's loader always builds "
              f"{FASTERDECODING_HEADS} and loads non-strictly, so {extra}", file=sys.stderr)
    heads.save(dest, layout=layout)
    _copy_extras(src, dest)


def _write_vllm(src: Path, dest: Path, model: str | None = None, base: str | None = None) -> None:
    """vLLM's Medusa checkpoint: config.json (model_type medusa) + model.safetensors; a candidate vocabulary
    becomes truncated_vocab_size + token_map."""
    _write_layout("vllm", src, dest, model, base)


def _write_medusa(src: Path, dest: Path, model: str | None = None, base: str | None = None) -> None:
    """FasterDecoding's Medusa layout: config.json (medusa_num_heads, base_model_name_or_path, ...) +
    medusa_lm_head.pt with a vocabulary projection per head, which both its v1 and v2 loaders read."""
    _write_layout("medusa", src, dest, model, base)


# Output formats by name; each writes the exported heads from `src` into the (temporary) `dest`.
FORMATS: dict[str, Callable[[Path, Path], None]] = {"native": _write_native, "eagle": _write_eagle("eagle"),
                                                    "eagle3": _write_eagle("eagle3")}
FORMATS.update(vllm=_write_vllm, medusa=_write_medusa)
# Formats that store the target's lm_head: their writers take the target model (`--model`) as `model=` and
# the name their config gives it (`--base`) as `base=`.
TARGET_FORMATS = {"vllm", "medusa"}
# The kind of heads each format holds (None: either).
FORMAT_KINDS = {"native": None, "eagle": "feature", "eagle3": "feature", "vllm": "medusa", "medusa": "medusa"}


def shipped_dir() -> Path:
    """The shipped Medusa heads (read at call time so tests can point it at a copy)."""
    from medusa.decoding.proposers import heads

    return Path(heads.SHIPPED_DIR)


def shipped_feature_dir() -> Path:
    """The shipped feature heads, where `--heads feature|default` finds them at run time (read at call time so
    tests can point it at a copy)."""
    from medusa.runtime import feature

    return Path(feature.SHIPPED_FEATURE_DIR)


@dataclass
class Measure:
    tau: float
    tree: str
    top1: list[float]


def measure(heads_dir: Path) -> Measure | None:
    """tau of the heads' own default tree from their eval.json; None without a usable eval.json."""
    from medusa.decoding.trees.tree import DEFAULT_TREE, build_tree, expected_tau, load_tree

    try:
        report = json.loads((heads_dir / "eval.json").read_text())
    except (OSError, ValueError):
        return None
    acc = report.get("rank_accuracy") if isinstance(report, dict) else None
    if not acc:
        return None
    own = heads_dir / "trees" / f"{DEFAULT_TREE}.yaml"
    budget = int(DEFAULT_TREE.rsplit("-", 1)[1])
    tree = load_tree(str(own)) if own.exists() else build_tree(acc, budget, name=DEFAULT_TREE)
    return Measure(expected_tau(tree.nodes, acc), DEFAULT_TREE, [a[0] for a in acc])


SHIPPED_KINDS = ("default", "medusa", "feature")  # the names `--heads` gives the shipped heads, everywhere


def shipped_kind(spec: str) -> str:
    """Which shipped heads `--heads default|medusa|feature` names, as `medusa generate` reads them: `default`
    is the feature heads when their heads.json marks them preferred (they measured faster), else the Medusa
    heads."""
    from medusa.runtime.feature import shipped_preferred

    if spec == "default":
        return "feature" if (shipped_feature_dir() / "heads.json").is_file() and shipped_preferred() else "medusa"
    return spec


def check_heads(src: Path | str, fmt: str | None = None) -> Path:
    """The heads' directory (`default`, `medusa`, `feature`: the shipped heads, as every command names them;
    a hub id is fetched first); refuses one without (valid) heads, or of a kind that `fmt` cannot hold."""
    from medusa.decoding.proposers.feature_heads import read_kind
    from medusa.decoding.proposers.head_formats import resolve_heads_dir
    from medusa.decoding.proposers.heads import MedusaHeads

    spec = str(src)
    if spec in SHIPPED_KINDS:
        kind = shipped_kind(spec)
        src = shipped_feature_dir() if kind == "feature" else shipped_dir()
        if not src.is_dir():
            raise MedusaError(f"--heads {spec}: no shipped {kind} heads in this installation")
    else:
        src = resolve_heads_dir(src)
        kind = "feature" if read_kind(src) == "feature" else "medusa"
    wanted = FORMAT_KINDS.get(fmt) if fmt else None
    if wanted is not None and kind != wanted:
        named = f"{spec} names the shipped {kind} heads" if spec in SHIPPED_KINDS else f"{spec} holds {kind} heads"
        other = "--heads feature or a feature-head directory" if wanted == "feature" else \
            "--heads medusa or a Medusa heads directory"
        fits = sorted(f for f, k in FORMAT_KINDS.items() if k in (None, kind))
        raise MedusaError(f"--heads: {named}, and --format {fmt} holds {wanted} heads only; export them with "
                          f"--format {', '.join(fits[:-1])} or {fits[-1]}, or pass {other}")
    if kind == "feature":
        return src  # feature heads: checked when a format reads them
    MedusaHeads.load(src)  # refuses a directory without (valid) heads
    return src


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def _check_out(src: Path, out: Path) -> None:
    s, o = src.resolve(), out.resolve()
    if _inside(o, s) or _inside(s, o):
        raise MedusaError(f"--out: {out} must not be the heads directory {src}, inside it or above it")
    if o == shipped_dir().resolve():
        raise MedusaError(f"--out: {out} is the shipped heads directory; use --to-shipped (it checks that "
                          "the new heads are not worse)")
    if o == shipped_feature_dir().resolve():
        raise MedusaError(f"--out: {out} is the shipped feature heads directory; name another one")
    if out.exists() and not out.is_dir():
        raise MedusaError(f"--out: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not any((out / f).exists() for f in ("heads.json", "config.json")):
        raise MedusaError(f"--out: {out} is a non-empty directory that holds no heads; name a new or empty one")


def export(src: Path | str, out: Path, fmt: str = "native", model: str | None = None,
           base: str | None = None) -> Path:
    """Copy heads (with trees and eval.json) from `src` (a directory, a hub id or a shipped name) to `out` in
    layout `fmt`, replacing `out` atomically. `model`: the target whose lm_head the vllm and medusa layouts
    store (default: the one the heads record); `base`: what their config calls the target
    (`base_model_name_or_path`; default: the hub id of the embedded model, the absolute folder of a local one)."""
    if fmt not in FORMATS:
        raise MedusaError(f"--format: unknown format {fmt!r} (choose {', '.join(sorted(FORMATS))})")
    if model is not None and fmt not in TARGET_FORMATS:
        raise MedusaError(f"--model: only the {' and '.join(sorted(TARGET_FORMATS))} formats read the target model")
    if base is not None and fmt not in TARGET_FORMATS:
        raise MedusaError(f"--base: only the {' and '.join(sorted(TARGET_FORMATS))} formats name the target model")
    src = check_heads(src, fmt)
    _check_out(src, out)
    writer = FORMATS[fmt]
    if fmt in TARGET_FORMATS:
        if base is not None:
            base_name(base)  # a bad --base is refused before anything is written
        return atomic_dir(out, lambda tmp: writer(src, tmp, model=model, base=base))
    return atomic_dir(out, lambda tmp: writer(src, tmp))


def _shipped_problems(src: Path, dest: Path, new: Measure | None, old: Measure | None) -> list[str]:
    """Reasons not to replace the shipped heads, each overridable with --force."""
    problems = []
    if new is None:
        problems.append(f"{src} has no eval.json with rank_accuracy, so it cannot be compared with the shipped "
                        "heads")
    elif old is not None and new.tau < old.tau:
        problems.append(f"these heads measure worse than the shipped ones: tau {new.tau:.3f} < {old.tau:.3f} "
                        f"with their {new.tree} (from each one's held-out eval.json)")
    sizes = [_sizes(p) for p in (src, dest)]
    if None not in sizes and sizes[0] != sizes[1]:
        problems.append(f"these heads are for hidden size/vocabulary {sizes[0]}, the shipped ones for {sizes[1]}")
    if (src / "adapter").exists():
        problems.append("these heads were trained with a LoRA adapter (Medusa-2) and need its merged model")
    return problems


def _sizes(heads_dir: Path) -> tuple[int, int] | None:
    try:
        cfg = json.loads((heads_dir / "heads.json").read_text())
        return int(cfg["hidden_size"]), int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_to_shipped(src: Path, force: bool = False, fmt: str = "native") -> tuple[Measure | None, Measure | None]:
    """Replace the shipped heads with `src`; returns (new, old) measures."""
    from medusa.decoding.trees.tree import DEFAULT_TREE

    if fmt != "native":
        raise MedusaError(f"--format: the shipped heads are stored in the native format, not {fmt!r}")
    src = check_heads(src)
    from medusa.decoding.proposers.feature_heads import read_kind

    if read_kind(src) == "feature":
        raise MedusaError(f"--to-shipped: replaces the shipped Medusa heads, and {src} holds feature heads")
    dest = shipped_dir()
    if _inside(dest.resolve(), src.resolve()):
        raise MedusaError(f"--heads: {src} already is the shipped heads directory")
    if not (src / "trees" / f"{DEFAULT_TREE}.yaml").exists():
        raise MedusaError(f"--heads: {src} has no trees/{DEFAULT_TREE}.yaml, which the shipped heads need; "
                          "write them with `medusa train --config CONFIG --eval-only`")
    new, old = measure(src), measure(dest)
    problems = _shipped_problems(src, dest, new, old)
    if problems and not force:
        raise MedusaError(f"--to-shipped: refused, {'; '.join(problems)}; pass --force to replace them anyway")
    atomic_dir(dest, lambda tmp: FORMATS[fmt](src, tmp))
    return new, old
