"""`medusa train-feature`: train a feature head (EAGLE-style) on a frozen target.

Data. Every training sequence (chat prompt + answer: ShareGPT's own answers, `data.use: source`, or the
target's distilled answers, `data.use: distilled`) goes through the frozen target once, in length-sorted
batched prefills; its final normed hidden states (the features) and the target's greedy next token at
every position are cached under `run_dir/features/` (bf16, one file per chunk of `chunk` sequences, reused
while the data is unchanged, so an interrupted extraction resumes at the first missing chunk).

Objective at position t (t+2 an answer token): the head reads (f_t, x_{t+1}) and predicts f_{t+1};
    loss = feature_weight * SmoothL1(f^_{t+1}, f_{t+1})              (eagle1 only)
         + ce_weight * CE(softmax over the draft vocabulary of lm_head(f_{t+1}), head's distribution)
with uniform noise (+-noise) on the input features. Training-time unrolling (EAGLE-3 / HASS): the head is
run `unroll` times, step j reading its own step j-1 output as the feature (the true tokens stay), attending
to true entries up to t-j and to its own chain, exactly what a j-deep draft sees; step j's loss is weighted
decay**j.

Checkpoints (`train/checkpoint.py`, resumable by re-running the command), wandb (offline by default),
`run_dir/head/` (the head, eval.json with per-step rank accuracies, train_config.yaml) at the end.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import yaml
from pydantic import Field

from medusa.errors import MedusaError

from medusa.io import atomic_dir
from medusa.train import checkpoint as ckpt
from medusa.train.config import DataConfig, OptimConfig, WandbConfig, _Strict


class HeadSection(_Strict):
    style: Literal["eagle1", "eagle3"] = "eagle1"
    feature_layers: list[int] = Field(default_factory=list)
    draft_vocab: int = Field(default=8192, gt=0)       # the most frequent answer tokens (+ ids below 256)


class FeatureLoss(_Strict):
    feature_weight: float = Field(default=1.0, ge=0.0)
    ce_weight: float = Field(default=0.1, ge=0.0)
    unroll: int = Field(default=3, ge=1, le=8)            # draft steps trained per position (1: EAGLE-1)
    decay: float = Field(default=0.8, gt=0.0, le=1.0)
    noise: float = Field(default=0.1, ge=0.0)             # uniform noise half-width on input features


class FeatureTrainConfig(_Strict):
    model: str = "default"
    dtype: Literal["bf16", "fp32"] = "bf16"
    seed: int = 0
    run_dir: str = "runs/feature"
    data: DataConfig = Field(default_factory=DataConfig)
    head: HeadSection = Field(default_factory=HeadSection)
    loss: FeatureLoss = Field(default_factory=FeatureLoss)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    batch_size: int = Field(default=8, gt=0)              # sequences per step
    chunk: int = Field(default=128, gt=0)                 # sequences per cached feature file
    epochs: float = Field(default=1.0, gt=0.0)
    max_steps: int | None = Field(default=None, gt=0)
    max_train_tokens: int | None = Field(default=None, gt=0)  # stop after this many trained positions
    checkpoint_every: int = Field(default=100, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    log_every: int = Field(default=10, gt=0)
    eval_topk: int = Field(default=10, gt=0, le=50)
    threads: int | None = Field(default=None, gt=0)


def load_feature_config(path: str | Path, overrides: list[str] | None = None) -> FeatureTrainConfig:
    from medusa.io import read_yaml, validate

    data = read_yaml(path)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise MedusaError(f"--set: {item!r} must look like key.sub=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(value)
    if "mtbench" in (data.get("data") or {}).get("sources", []):
        raise MedusaError("data.sources: 'mtbench' is the evaluation set and cannot be trained on")
    return validate(FeatureTrainConfig, data, str(path))


# ---- cached features ------------------------------------------------------------------------------


class Features:
    """Flat per-position table of many sequences: feats [N, F], tokens [N], answer [N] bool,
    top [N] (the target's greedy next token after each position), offsets [E+1]."""

    def __init__(self, feats, tokens, answer, top, offsets):
        self.feats, self.tokens, self.answer, self.top, self.offsets = feats, tokens, answer, top, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def seq(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def positions(self) -> int:
        """Positions with a label (t + 2 is an answer token)."""
        total = 0
        for i in range(len(self)):
            a = self.answer[self.seq(i)]
            total += int(a[2:].sum())
        return total

    @classmethod
    def cat(cls, parts: list["Features"]) -> "Features":
        offs, base = [torch.zeros(1, dtype=torch.long)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        return cls(torch.cat([p.feats for p in parts]), torch.cat([p.tokens for p in parts]),
                   torch.cat([p.answer for p in parts]), torch.cat([p.top for p in parts]), torch.cat(offs))

    def save(self, path: Path, key: str) -> None:
        from safetensors.torch import save_file

        tmp = path.with_name(f".{path.name}.tmp")
        save_file({"feats": self.feats.contiguous(), "tokens": self.tokens, "answer": self.answer.to(torch.uint8),
                   "top": self.top, "offsets": self.offsets}, str(tmp), metadata={"key": key})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Features":
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls(t["feats"], t["tokens"], t["answer"].bool(), t["top"], t["offsets"])


def feature_fn(model, layers: list[int]):
    """batch -> (features [B, T, F], greedy next token [B, T]) from an HF causal LM."""
    def run(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_hidden_states=True, use_cache=False)
        top = out.logits.argmax(-1)
        final = len(out.hidden_states) - 1
        if layers:  # the fused features, then the final one (the targets) unless it is the last fused
            picked = list(layers) + ([final] if layers[-1] != final else [])
            return torch.cat([out.hidden_states[i] for i in picked], -1), top
        return out.hidden_states[-1], top
    return run


@torch.inference_mode()
def extract(examples: list[dict], fn, batch_tokens: int = 4096, progress: bool = False) -> Features:
    """Run the frozen target over every example (length-sorted batches); keep every position."""
    from tqdm import tqdm

    from medusa.train.data import pad_batch

    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    parts: dict[int, tuple] = {}
    bar = tqdm(total=sum(len(e["input_ids"]) for e in examples), unit="tok", desc="features", disable=not progress)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * len(examples[order[j]]["input_ids"]) <= batch_tokens:
            j += 1
        chunk = [examples[o] for o in order[i:j]]
        feats, top = fn(pad_batch(chunk))
        for r, (o, e) in enumerate(zip(order[i:j], chunk)):
            n = len(e["input_ids"])
            parts[o] = (feats[r, :n].to(torch.bfloat16).clone(), torch.tensor(e["input_ids"]),
                        torch.tensor(e["loss_mask"]).bool(), top[r, :n].clone())
            bar.update(n)
        i = j
    bar.close()
    seqs = [parts[o] for o in range(len(examples))]
    offsets = torch.tensor([0] + [len(s[1]) for s in seqs]).cumsum(0)
    return Features(torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs]).long(),
                    torch.cat([s[2] for s in seqs]), torch.cat([s[3] for s in seqs]).long(), offsets)


def cached_features(run_dir: Path, name: str, key: str, build) -> Features:
    from safetensors import safe_open

    path = run_dir / "features" / f"{name}.safetensors"
    if path.exists():
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("key") == key:
                return Features.load(path)
    feats = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    feats.save(path, key)
    return feats


# ---- the objective --------------------------------------------------------------------------------


def unrolled_mask(steps: int, t: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, S, S] over `steps` stacked copies of a T-long sequence: step j at position t
    sees the true entries s <= t - j and its own chain (step i at t - j + i, 1 <= i <= j)."""
    s = steps * t
    q_step = torch.arange(s, device=device) // t
    q_pos = torch.arange(s, device=device) % t
    k_step, k_pos = q_step, q_pos
    qs, qp = q_step[:, None], q_pos[:, None]
    ks, kp = k_step[None, :], k_pos[None, :]
    true_part = (ks == 0) & (kp <= qp - qs)
    chain = (ks >= 1) & (ks <= qs) & (kp == qp - qs + ks)
    allowed = true_part | chain
    return torch.zeros(s, s, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))[None, None]


def head_loss(head, cfg: FeatureTrainConfig, feats: torch.Tensor, tokens: torch.Tensor, answer: torch.Tensor,
              top: torch.Tensor, valid: torch.Tensor, full_to_draft: torch.Tensor, noise: bool = True):
    """feats [B, T, F] (float), tokens/answer/top/valid [B, T]. Returns (loss, stats per unroll step)."""
    b, t, _ = feats.shape
    dev = feats.device
    h = head.config.hidden_size
    steps = min(cfg.loss.unroll, t)
    # Inputs at position s: f_s and x_{s+1}; targets: f_{s+1} and the target's distribution at s+1.
    nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)
    emb = head.embed(nxt).float()
    f_in = feats[..., : head.config.feature_dim]
    if noise and cfg.loss.noise > 0:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * cfg.loss.noise
    target_feat = torch.cat([feats[:, 1:, -h:], feats[:, -1:, -h:]], 1)  # the final feature at s+1
    label_ok = torch.zeros(b, t, dtype=torch.bool, device=dev)
    label_ok[:, : t - 2] = answer[:, 2:] & valid[:, 2:]
    with torch.no_grad():
        teacher = torch.softmax(head.lm_head(target_feat).float(), -1)  # draft-vocabulary softmax
        greedy = torch.cat([top[:, 1:], top[:, -1:]], 1)  # the target's token at s+2
        greedy_d = full_to_draft[greedy]
    positions = torch.arange(t, device=dev).expand(b, t)
    xs = [head.inputs(emb, f_in, fused=True)]
    loss = feats.new_zeros(())
    stats = []
    for j in range(steps):
        mask = unrolled_mask(j + 1, t, feats.dtype, dev)
        out = head.layer_forward(emb.repeat(1, j + 1, 1), torch.cat(xs, 1), positions.repeat(1, j + 1), mask)
        out = out[:, j * t:]
        ok = label_ok.clone()
        ok[:, :j] = False
        count = ok.sum().clamp(min=1)
        logits = head.logits(out).float()
        logq = torch.log_softmax(logits, -1)
        ce = -(teacher * logq).sum(-1)
        step_loss = cfg.loss.ce_weight * (ce * ok).sum() / count
        if head.config.style == "eagle1" and cfg.loss.feature_weight > 0:
            sl1 = F.smooth_l1_loss(out, target_feat, reduction="none").mean(-1)
            step_loss = step_loss + cfg.loss.feature_weight * (sl1 * ok).sum() / count
        loss = loss + cfg.loss.decay ** j * step_loss
        with torch.no_grad():
            hit = (logits.argmax(-1) == greedy_d) & ok
            stats.append((int(hit.sum()), int(ok.sum())))
        prev = torch.cat([out[:, :1] * 0, out[:, :-1]], 1)
        xs.append(head.inputs(emb, prev, fused=False))
    return loss, stats


def draft_vocabulary(counts: torch.Tensor, size: int, always: int = 256) -> torch.Tensor:
    """The `size` most frequent answer tokens, most frequent first (ids below `always` lead: special and
    byte tokens). The order lets inference keep any prefix as a smaller draft vocabulary."""
    vocab = counts.shape[0]
    size = min(size, vocab)
    score = counts.float().clone()
    score[: min(always, vocab)] += float(counts.sum()) + 1
    return torch.argsort(score, descending=True, stable=True)[:size]


# ---- the run --------------------------------------------------------------------------------------


def _examples(cfg: FeatureTrainConfig, tokenizer) -> list[tuple[str, list[dict]]]:
    from medusa.train.trainer import load_examples

    groups = load_examples(cfg, tokenizer)  # reads cfg.model, cfg.dtype and cfg.data only
    out = []
    for name, exs in groups:
        for c in range(0, len(exs), cfg.chunk):
            out.append((f"{name}-{c // cfg.chunk:04d}", exs[c: c + cfg.chunk]))
    return out


def _split(cfg: FeatureTrainConfig, groups):
    from medusa.train.data import split_eval

    train, held = [], []
    for name, exs in groups:
        tr, ev = split_eval(len(exs), cfg.data.eval_fraction, cfg.seed)
        train.append((name, [exs[i] for i in tr]))
        held += [exs[i] for i in ev]
    return train, held


def run_feature_training(cfg: FeatureTrainConfig, progress: bool = True, prepare_only: bool = False) -> dict:
    from medusa.decoding.feature_heads import FeatureHead, FeatureHeadConfig
    from medusa.decoding.model import load_target

    from medusa.train.data import split_eval  # noqa: F401  (import check: the data module is needed below)
    from medusa.train.trainer import base_fingerprint, lr_lambda, start_wandb

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.run_dir)
    hf, tokenizer = load_target(cfg.model, cfg.dtype, "cpu" if not torch.cuda.is_available() else None)
    hf.eval().requires_grad_(False)
    train_groups, held = _split(cfg, _examples(cfg, tokenizer))
    base = base_fingerprint(hf, cfg.model)
    fn = feature_fn(hf, cfg.head.feature_layers)
    parts = []
    t0 = time.perf_counter()
    for name, exs in train_groups:
        from medusa.train.hidden import table_key

        key = table_key(base, cfg.dtype, cfg.head.feature_layers, name, [e["input_ids"] for e in exs])
        parts.append(cached_features(run_dir, name, key, lambda exs=exs: extract(exs, fn, progress=progress)))
    feats = Features.cat(parts)
    extract_seconds = time.perf_counter() - t0
    if prepare_only:
        return {"sequences": len(feats), "positions": feats.positions(), "seconds": extract_seconds}
    counts = torch.bincount(feats.tokens[feats.answer], minlength=hf.config.vocab_size)
    ids = draft_vocabulary(counts, cfg.head.draft_vocab)
    hcfg = FeatureHeadConfig(hf.config.hidden_size, hf.get_output_embeddings().weight.shape[0], len(ids),
                             style=cfg.head.style, feature_layers=list(cfg.head.feature_layers),
                             base_model=str(getattr(hf, "name_or_path", cfg.model)))
    torch.manual_seed(cfg.seed)
    head = FeatureHead(hcfg, hf, ids).float()
    full_to_draft = torch.full((hcfg.vocab_size,), -1, dtype=torch.long)
    full_to_draft[ids] = torch.arange(len(ids))
    meta = {"base": base, "heads": asdict(hcfg) | {"base_model": None}}
    per_epoch = max(1, len(feats) // cfg.batch_size)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    step, trained, history = _resume(run_dir, head, opt, sched, meta)
    wb = start_wandb(_RunLike(cfg, run_dir)) if step < total else None
    while step < total and (cfg.max_train_tokens is None or trained < cfg.max_train_tokens):
        epoch, within = divmod(step, per_epoch)
        order = torch.randperm(len(feats), generator=torch.Generator().manual_seed(cfg.seed * 100003 + epoch))
        pick = order[within * cfg.batch_size: (within + 1) * cfg.batch_size].tolist()
        start = time.perf_counter()
        batch = _batch(feats, pick, cfg.data.max_seq_tokens)
        head.train()
        loss, stats = head_loss(head, cfg, *batch, full_to_draft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        sched.step()
        step += 1
        n = stats[0][1]
        trained += n
        row = {"step": step, "loss": float(loss.detach()), "lr": sched.get_last_lr()[0], "trained_tokens": trained,
               "tokens_per_s": n / max(time.perf_counter() - start, 1e-9),
               **{f"step{j}/top1": c / max(m, 1) for j, (c, m) in enumerate(stats)}}
        history.append({"step": step, "loss": row["loss"], "trained_tokens": trained})
        if wb is not None:
            wb.log(row, step=step)
        if step % cfg.log_every == 0 or step == 1:
            accs = " ".join(f"{row[f'step{j}/top1']:.3f}" for j in range(len(stats)))
            print(f"step {step}/{total} loss {row['loss']:.4f} top1 [{accs}] tokens {trained} "
                  f"{row['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
        if step % cfg.checkpoint_every == 0 or step == total:
            _save(run_dir, head, opt, sched, meta, step, trained, history, cfg.keep_checkpoints)
    if wb is not None:
        wb.finish()
    report = evaluate_head(head, cfg, hf, fn, held, full_to_draft)
    report.update(step=step, trained_tokens=trained, extract_seconds=round(extract_seconds, 1))
    out = run_dir / "head"

    def fill(tmp: Path) -> None:
        head.save(tmp)
        (tmp / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "train_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))

    atomic_dir(out, fill)
    return {"run_dir": str(run_dir), "head_dir": str(out), "step": step, "trained_tokens": trained, "eval": report}


class _RunLike:
    """What `medusa.train.trainer.start_wandb` reads from a run."""

    def __init__(self, cfg, run_dir):
        self.cfg, self.run_dir = cfg, run_dir


def _batch(feats: Features, pick: list[int], max_len: int):
    seqs = [feats.seq(i) for i in pick]
    t = min(max_len, max(s.stop - s.start for s in seqs))
    b = len(seqs)
    f = torch.zeros(b, t, feats.feats.shape[1])
    tok = torch.zeros(b, t, dtype=torch.long)
    ans = torch.zeros(b, t, dtype=torch.bool)
    top = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for r, s in enumerate(seqs):
        n = min(t, s.stop - s.start)
        f[r, :n] = feats.feats[s.start: s.start + n].float()
        tok[r, :n] = feats.tokens[s.start: s.start + n]
        ans[r, :n] = feats.answer[s.start: s.start + n]
        top[r, :n] = feats.top[s.start: s.start + n]
        valid[r, :n] = True
    return f, tok, ans, top, valid


def _save(run_dir: Path, head, opt, sched, meta, step: int, trained: int, history: list, keep: int) -> None:
    def fill(tmp: Path) -> None:
        head.save(tmp / "head")
        torch.save({"step": step, "trained": trained, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "rng": ckpt.rng_state(), "history": history}, tmp / ckpt.STATE)

    ckpt.save_checkpoint(run_dir / "checkpoints", step, meta, fill, keep)


def _resume(run_dir: Path, head, opt, sched, meta) -> tuple[int, int, list]:
    from safetensors.torch import load_file

    path = ckpt.latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        return 0, 0, []
    ckpt.check_meta(path, meta)
    state = load_file(str(path / "head" / "feature_head.safetensors"))
    head.load_state_dict(state, strict=False)
    st = torch.load(path / ckpt.STATE, map_location="cpu", weights_only=False)
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    ckpt.set_rng_state(st["rng"])
    print(f"resumed from {path} (step {st['step']})", file=sys.stderr)
    return int(st["step"]), int(st["trained"]), list(st.get("history", []))


@torch.no_grad()
def evaluate_head(head, cfg: FeatureTrainConfig, hf, fn, held: list[dict], full_to_draft: torch.Tensor) -> dict:
    """Held-out rank accuracy per draft step (step j: the head's own j previous outputs as features), the
    target's greedy token as the label: rank_accuracy[j][r] = P(label is the head's rank-r token)."""
    if not held:
        return {}
    head.eval()
    feats = extract(held, fn)
    steps = cfg.loss.unroll
    k = cfg.eval_topk
    hits = torch.zeros(steps, k)
    counts = torch.zeros(steps)
    for i in range(len(feats)):
        f, tok, ans, top, valid = _batch(feats, [i], cfg.data.max_seq_tokens)
        t = f.shape[1]
        if t < 4:
            continue
        nxt = torch.cat([tok[:, 1:], tok[:, -1:]], 1)
        emb = head.embed(nxt).float()
        greedy = torch.cat([top[:, 1:], top[:, -1:]], 1)
        label_ok = torch.zeros(1, t, dtype=torch.bool)
        label_ok[:, : t - 2] = ans[:, 2:]
        xs = [head.inputs(emb, f[..., : head.config.feature_dim], fused=True)]
        positions = torch.arange(t).expand(1, t)
        for j in range(min(steps, t)):
            out = head.layer_forward(emb.repeat(1, j + 1, 1), torch.cat(xs, 1), positions.repeat(1, j + 1),
                                     unrolled_mask(j + 1, t, f.dtype, f.device))[:, j * t:]
            ok = label_ok.clone()
            ok[:, :j] = False
            ranks = head.logits(out).topk(k, -1).indices  # [1, T, k] draft indices
            lab = full_to_draft[greedy]
            hit = (ranks == lab[..., None]) & ok[..., None]
            hits[j] += hit.float().sum((0, 1))
            counts[j] += ok.sum()
            xs.append(head.inputs(emb, torch.cat([out[:, :1] * 0, out[:, :-1]], 1), fused=False))
    acc = (hits / counts.clamp(min=1)[:, None]).tolist()
    return {"examples": len(held), "labels_per_step": counts.long().tolist(), "rank_accuracy": acc,
            "top1": [a[0] for a in acc], "topk_accuracy": [[sum(a[: r + 1]) for r in range(len(a))] for a in acc]}
