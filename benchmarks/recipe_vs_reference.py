"""Our feature-head recipe against SafeAILab's own EAGLE-1 trainer, at equal data and steps.

    python benchmarks/recipe_vs_reference.py --prompts 4096 --epochs 1 --batch-size 8 \
        --features runs/feature-8k/features --json benchmarks/results/recipe-vs-reference.json

1. Ours: `medusa train-feature` with the shipped config (`--config`), cut to the first `--prompts` distilled
   prompts, `--epochs` epochs at `--batch-size`; its held-out split is the comparison's.
2. The reference: the same training sequences, features and all (the target's final normed hidden states that
   our trainer cached), written as the files their trainer reads (`hidden_state`, `input_ids`, `loss_mask` per
   sequence, cut at the config's `data.max_seq_tokens` as ours are). Their trainer, `eagle/train/main.py` of
   eagle-llm 1.2.1 from PyPI, runs unmodified in a side environment (`scripts/reference_envs.sh eagle-train`)
   through `eagle_reference_trainer.py` (device placement on CPU; stops after `--epochs` of its epochs) with its
   own recipe: smooth-L1 on features + 0.1 x cross-entropy over the full vocabulary, uniform input noise, AdamW,
   linear warm-up over 2,000 steps to `--ref-lr` (theirs: 3e-5; more values, more runs). `--ref-warmup ours` gives
   their schedule our config's warm-up length instead (the one change to their recipe, made by the runner around
   their file), so that a short run reaches their learning rate as ours does. One of their epochs is
   ceil(sequences / batch) steps, ours floor(...): the counts are reported.
   Their files include a test split they print (5%, by file name last); it is filled with the prompts and
   first answer positions of training sequences and plays no part here.
3. Both heads on our held-out split (top-1 per draft step, the head's own outputs fed back), and tau (tokens
   per verification, greedy, batch 1) with a dynamic tree on each prompt set of `--tau-prompts`
   (benchmarks/feature_tau.py). Their head drafts from the full vocabulary, ours from its draft vocabulary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "eagle_reference_trainer.py"
TRAIN_SHARE = 0.95  # their trainer trains on the first int(0.95 * files) files
# Each file of their test split: a training sequence's prompt and its first FILLER_TOKENS answer positions (their
# per-position accuracy loop is slow, and it divides by zero unless some positions are labelled), then
# TEST_STEPS positions unlabelled, so that loop's 5 draft steps stop before the end of the file.
FILLER_TOKENS = 16
TEST_STEPS = 5


def reference_python() -> str:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "reference_envs.sh"), "eagle-train"], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)})
    if proc.returncode != 0:
        raise SystemExit(f"scripts/reference_envs.sh eagle-train failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1].split(" ", 1)[1]


def test_fillers(n: int) -> int:
    """How many files to add after `n` training files so that their split trains on exactly those `n`."""
    k = 1
    while int((n + k) * TRAIN_SHARE) < n:
        k += 1
    if int((n + k) * TRAIN_SHARE) != n:
        raise SystemExit(f"no file count splits at {n} training files")
    return k


def write_reference_data(feats, out: Path, max_len: int) -> int:
    """Every sequence of `feats` as one of their training files (sorted names: training first), then the
    test fillers; returns the number of training files."""
    out.mkdir(parents=True, exist_ok=True)
    n = len(feats)

    def save(name: str, i: int, length: int, test: bool = False) -> None:
        s = feats.seq(i)
        mask = feats.answer[s.start: s.stop].long()
        if test:  # the prompt, FILLER_TOKENS answer positions, then TEST_STEPS unlabelled ones
            length = int(mask.nonzero()[0]) + FILLER_TOKENS + TEST_STEPS if mask.any() else length
        end = min(s.stop, s.start + length)
        mask = mask[: end - s.start].clone()
        if test:
            mask[-TEST_STEPS:] = 0
        torch.save({"hidden_state": feats.feats.rows(s.start, end).clone(), "input_ids": feats.tokens[s.start: end].clone(),
                    "loss_mask": mask}, out / name)

    for i in range(n):
        save(f"a-train-{i:06d}.ckpt", i, max_len)
    for j in range(test_fillers(n)):
        save(f"b-test-{j:06d}.ckpt", j % n, max_len, test=True)
    return n


def reference_base(model: str, out: Path) -> Path:
    """The target as their trainer reads it: our `--base-model` layout plus an explicit `lm_head.weight` in the
    weight index (the embedded model ties it to the embeddings; their trainer looks it up by name)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from medusa.train.base_model import WEIGHTS_INDEX, write_base_model

    if not (out / WEIGHTS_INDEX).is_file():
        write_base_model(model, out)
    index = json.loads((out / WEIGHTS_INDEX).read_text())
    if "lm_head.weight" not in index["weight_map"]:
        src = index["weight_map"]["model.embed_tokens.weight"]
        with safe_open(str(out / src), "pt") as f:
            emb = f.get_tensor("model.embed_tokens.weight")
        save_file({"lm_head.weight": emb.clone()}, str(out / "lm_head.safetensors"))
        index["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
        (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
    return out


def run_reference(python: str, base: Path, config: Path, data: Path, out: Path, epochs: int, batch: int, lr: float,
                  threads: int, warmup: int | None = None) -> tuple[Path, float]:
    """Their trainer for `epochs` epochs; returns an EAGLE-1 head directory (their config and weights)."""
    if epochs % 5 == 0:
        raise SystemExit("--epochs: their trainer saves no state after epochs 5, 10, ...; pick another count")
    cp = out / "states"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads))
    cmd = [python, str(RUNNER), str(epochs), *([] if warmup is None else [str(warmup)]), "--", "--basepath", str(base),
           "--configpath", str(config), "--tmpdir", str(data), "--cpdir", str(cp), "--bs", str(batch), "--lr", str(lr)]
    t0 = time.perf_counter()
    with open(out / "trainer.log", "w") as log:
        proc = subprocess.run(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    state = cp / f"state_{epochs - 1}"
    if proc.returncode != 0 or not (state / "model.safetensors").is_file():
        raise SystemExit(f"their trainer failed (rc {proc.returncode}); see {out / 'trainer.log'}")
    head = out / "head"
    head.mkdir(exist_ok=True)
    shutil.copy2(config, head / "config.json")
    shutil.copy2(state / "model.safetensors", head / "model.safetensors")
    return head, seconds


def main(argv: list[str] | None = None) -> int:
    from medusa.decoding.proposers.feature_formats import eagle_config
    from medusa.decoding.proposers.feature_heads import FeatureHead
    from medusa.decoding.target.model import load_target
    from medusa.train import checkpoint as ckpt
    from medusa.train.feature import (chunk_groups, evaluate_head, load_feature_config, training_features,
                                      run_feature_training)
    from medusa.train.data import load_examples, split_groups
    from medusa.train.feature_data import draft_map, feature_fn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/feature/smollm2-feature.yaml"))
    ap.add_argument("--prompts", type=int, default=4096, help="distilled prompts (data.limit)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ref-lr", type=float, nargs="+", default=[3e-5], help="their trainer's --lr (theirs: 3e-5)")
    ap.add_argument("--ref-warmup", default="theirs", type=lambda v: v if v in ("theirs", "ours") else int(v),
                    help="their linear warm-up: 'theirs' (2,000 steps), 'ours' (the config's warmup_steps) or a count")
    ap.add_argument("--work", default="runs/recipe-vs-reference")
    ap.add_argument("--features", default=None, help="a features/ directory to reuse (same model, data and dtype)")
    ap.add_argument("--tau-prompts", nargs="+", default=["mtbench", "benchmarks/prompts/mixed.jsonl"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--shape", default="dynamic-16x5")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work).resolve()
    ours_dir = work / "ours"
    ours_dir.mkdir(parents=True, exist_ok=True)
    if args.features and not (ours_dir / "features").exists():
        (ours_dir / "features").symlink_to(Path(args.features).resolve())
    cfg = load_feature_config(args.config, [f"data.limit={args.prompts}", f"batch_size={args.batch_size}",
                                            f"epochs={args.epochs}", f"run_dir={ours_dir}", f"threads={args.threads}",
                                            "wandb.mode=disabled"])
    if cfg.head.style != "eagle1" or cfg.head.feature_layers:
        raise SystemExit(f"{args.config}: their EAGLE-1 trainer reads final-layer features; the config must train "
                         "an eagle1 head without feature_layers")

    t0 = time.perf_counter()
    ours = run_feature_training(cfg, progress=False)
    ours_seconds = time.perf_counter() - t0
    ours_steps = ours["step"]

    hf, tokenizer = load_target(cfg.model, cfg.dtype, "cpu")
    hf.eval().requires_grad_(False)
    train_groups, held = split_groups(cfg, chunk_groups(cfg, load_examples(cfg, tokenizer)))
    fn = feature_fn(hf, cfg.head.feature_layers)
    feats = training_features(cfg, train_groups, ckpt.base_fingerprint(hf, cfg.model), fn, False)
    data = work / "reference-data"
    if not data.is_dir():
        write_reference_data(feats, data, cfg.data.max_seq_tokens)
    base = reference_base(cfg.model, work / "reference-base")
    our_head = FeatureHead.load(Path(ours["head_dir"]), hf)
    config = work / "reference-config.json"
    config.write_text(json.dumps(eagle_config(our_head, draft_vocab=False), indent=2))
    python = reference_python()

    warmup = {"theirs": None, "ours": cfg.optim.warmup_steps}.get(args.ref_warmup, args.ref_warmup)
    heads = {"ours": {"dir": ours["head_dir"], "steps": ours_steps, "train_seconds": round(ours_seconds, 1),
                      "top1": ours["eval"].get("top1")}}
    for lr in args.ref_lr:
        out = work / (f"reference-lr{lr:g}" + ("" if warmup is None else f"-warmup{warmup}"))
        out.mkdir(exist_ok=True)
        head_dir, seconds = run_reference(python, base, config, data, out, args.epochs, args.batch_size, lr,
                                          args.threads, warmup)
        head = FeatureHead.load(head_dir, hf).float()
        report = evaluate_head(head, cfg, hf, fn, held, draft_map(head.config.vocab_size, head.draft_ids))
        steps = args.epochs * math.ceil(len(feats) / args.batch_size)
        name = f"reference lr {lr:g}" + ("" if warmup is None else f" warm-up {warmup}")
        heads[name] = {"dir": str(head_dir), "steps": steps, "warmup_steps": 2000 if warmup is None else warmup,
                       "train_seconds": round(seconds, 1), "top1": report.get("top1")}

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import feature_tau

    tau: dict[str, dict] = {}
    for prompts in args.tau_prompts:
        tmp = work / f"tau-{Path(prompts).stem}.json"
        feature_tau.main(["--heads", *[h["dir"] for h in heads.values()], "--shapes", args.shape, "--prompts", prompts,
                          "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
                          "--threads", str(args.threads), "--json", str(tmp)])
        rows = {r["method"]: r for r in json.loads(tmp.read_text())["results"]}
        for name, h in heads.items():
            tau.setdefault(name, {})[prompts] = rows[f"{h['dir']}:{args.shape}"]["tau"]
    for name, h in heads.items():
        h["tau"] = tau[name]
        top1 = ", ".join(f"{a:.3f}" for a in (h["top1"] or [])[:3])
        print(f"{name:<22} steps {h['steps']:>5}  {h['train_seconds']:>7.0f} s  held-out top-1 [{top1}]  tau "
              + "  ".join(f"{Path(p).stem} {t:.2f}" for p, t in h["tau"].items()))
    if args.json:
        from medusa.decoding.target.hardware import provenance
        from medusa.io import write_json_atomic

        result = {**provenance(cfg.dtype, threads=args.threads), "config": args.config,
                  "prompts": args.prompts, "train_sequences": len(feats), "held_out_sequences": len(held),
                  "epochs": args.epochs, "batch_size": args.batch_size, "shape": args.shape, "heads": heads}
        write_json_atomic(Path(args.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
