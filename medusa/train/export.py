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

    from medusa.decoding.feature_heads import FeatureHead
    from medusa.decoding.model import load_target

    model = "default"
    if (src / "train_config.yaml").exists():
        model = (yaml.safe_load((src / "train_config.yaml").read_text()) or {}).get("model", "default")
    target, _ = load_target(model, "fp32", "cpu")
    return FeatureHead.load(src, target)


def _write_eagle(layout: str) -> Callable[[Path, Path], None]:
    """Feature heads as an EAGLE-1 (`eagle`) or EAGLE-3 (`eagle3`) checkpoint (config.json + weights)."""
    def write(src: Path, dest: Path) -> None:
        from medusa.decoding.feature_formats import save_eagle

        save_eagle(_feature_head(src), dest, layout)
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

    from medusa.decoding.model import load_target, resolve_model_dir

    where = Path(resolve_model_dir(model))
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else []
    for key in ("lm_head.weight", "model.embed_tokens.weight"):  # untied models store lm_head.weight
        for f in files:
            with safe_open(str(f), "pt") as st:
                if key in st.keys():
                    return st.get_tensor(key)
    hf_model, _ = load_target(model, "fp32", "cpu")
    return hf_model.get_output_embeddings().weight.detach()


def _write_layout(layout: str, src: Path, dest: Path, model: str | None) -> None:
    from medusa.decoding.heads import MedusaHeads

    heads = MedusaHeads.load(src)
    if heads.lm_heads is None:
        # Heads sharing the target's lm_head: these layouts store it, so it is read from the target.
        name = model or heads.config.base_model
        if not name:
            raise MedusaError(f"--model: {src} shares the target's lm_head but does not record its target; "
                              "name the target model with --model")
        heads.use_projection(target_lm_head(name))
    if layout == "medusa" and heads.candidate_ids is not None:
        print(f"medusa export: the Medusa layout has no candidate vocabulary; the {heads.config.candidates} "
              "candidates are dropped and its heads rank the whole vocabulary", file=sys.stderr)
    heads.save(dest, layout=layout)
    _copy_extras(src, dest)


def _write_vllm(src: Path, dest: Path, model: str | None = None) -> None:
    """vLLM's Medusa checkpoint: config.json (model_type medusa) + model.safetensors; a candidate vocabulary
    becomes truncated_vocab_size + token_map."""
    _write_layout("vllm", src, dest, model)


def _write_medusa(src: Path, dest: Path, model: str | None = None) -> None:
    """FasterDecoding's Medusa layout: config.json (medusa_num_heads, ...) + medusa_lm_head.pt with a
    vocabulary projection per head, which both its v1 and v2 loaders read."""
    _write_layout("medusa", src, dest, model)


# Output formats by name; each writes the exported heads from `src` into the (temporary) `dest`.
FORMATS: dict[str, Callable[[Path, Path], None]] = {"native": _write_native, "eagle": _write_eagle("eagle"),
                                                    "eagle3": _write_eagle("eagle3")}
FORMATS.update(vllm=_write_vllm, medusa=_write_medusa)
# Formats that store the target's lm_head: their writers take the target model (`--model`) as `model=`.
TARGET_FORMATS = {"vllm", "medusa"}


def shipped_dir() -> Path:
    """The shipped heads (read at call time so tests can point it at a copy)."""
    from medusa.decoding import heads

    return Path(heads.SHIPPED_DIR)


@dataclass
class Measure:
    tau: float
    tree: str
    top1: list[float]


def measure(heads_dir: Path) -> Measure | None:
    """tau of the heads' own default tree from their eval.json; None without a usable eval.json."""
    from medusa.decoding.tree import DEFAULT_TREE, build_tree, expected_tau, load_tree

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


def _check_heads(src: Path | str) -> Path:
    """The heads' directory (`default` or `medusa`: the shipped Medusa heads; a hub id is fetched first);
    refuses one without (valid) heads."""
    from medusa.decoding.head_formats import resolve_heads_dir
    from medusa.decoding.heads import SHIPPED_NAMES, MedusaHeads

    src = shipped_dir() if str(src) in SHIPPED_NAMES else resolve_heads_dir(src)
    from medusa.decoding.feature_heads import read_kind

    if read_kind(src) == "feature":
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
    if out.exists() and not out.is_dir():
        raise MedusaError(f"--out: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not any((out / f).exists() for f in ("heads.json", "config.json")):
        raise MedusaError(f"--out: {out} is a non-empty directory that holds no heads; name a new or empty one")


def export(src: Path | str, out: Path, fmt: str = "native", model: str | None = None) -> Path:
    """Copy heads (with trees and eval.json) from `src` (a directory or a hub id) to `out` in layout `fmt`,
    replacing `out` atomically. `model`: the target whose lm_head the vllm and medusa layouts store
    (default: the one the heads record)."""
    if fmt not in FORMATS:
        raise MedusaError(f"--format: unknown format {fmt!r} (choose {', '.join(sorted(FORMATS))})")
    if model is not None and fmt not in TARGET_FORMATS:
        raise MedusaError(f"--model: only the {' and '.join(sorted(TARGET_FORMATS))} formats read the target model")
    src = _check_heads(src)
    _check_out(src, out)
    writer = FORMATS[fmt]
    if fmt in TARGET_FORMATS:
        return atomic_dir(out, lambda tmp: writer(src, tmp, model=model))
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
    from medusa.decoding.tree import DEFAULT_TREE

    if fmt != "native":
        raise MedusaError(f"--format: the shipped heads are stored in the native format, not {fmt!r}")
    src = _check_heads(src)
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
