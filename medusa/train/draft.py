"""`medusa train-draft`: a small draft model cut from the target and distilled on the target's own answers.

The draft is the target's first N layers plus its final norm, reading the target's (frozen, shared)
embeddings and lm_head. Only the N layers and the norm are trained, on the self-distilled data the Medusa
heads use (`medusa distill`: the target's greedy answers), with cross-entropy on the answer tokens: the
draft learns to predict what the target would say, which is exactly what gets accepted. Only the draft's
own tensors are saved (bf16), so 4 layers of SmolLM2-135M take about 28 MB.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from medusa.decoding.proposers.draft import SHIPPED_DRAFT, save_truncated, truncated_model, vocab_subset_head
from medusa.errors import MedusaError
from medusa.io import cache_dir, write_json_atomic
from medusa.train.config import DataConfig, TrainConfig
from medusa.train.data import example, pad_batch
from medusa.train.distill import answer_all, distill_dir, load_distilled, select_prompts
from medusa.train.optim import lr_schedule

# The data section of configs/train/smollm2-medusa1.yaml (what names its distilled dataset): the answers
# the shipped heads were trained on, which the draft of the default model reuses.
SHIPPED_DATA = {"sources": ["sharegpt"], "max_prompt_tokens": 192, "max_new_tokens": 160}


def shipped_distill_config() -> TrainConfig:
    """The training config whose distilled dataset `find_distilled` reads (its model, dtype and data)."""
    return TrainConfig(dtype="auto", data=DataConfig(**SHIPPED_DATA))  # a given "auto" is resolved


def find_distilled(model: str) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, response_ids) pairs from `medusa distill`'s dataset for the default training config, if
    it has any complete shard; else an empty list."""
    if model != "default":
        return []
    try:
        return load_pairs(distill_dir(shipped_distill_config()))
    except MedusaError:
        return []


def load_pairs(path: str | Path) -> list[tuple[list[int], list[int]]]:
    ds = load_distilled(path)
    return list(zip(ds["prompt_ids"], ds["response_ids"]))


def _answers_dir() -> Path:
    return cache_dir() / "draft-distill"


def _model_name(rt) -> str:
    return getattr(rt.hf_model, "name_or_path", "model").replace("/", "_")


def distil_here(rt, count: int, max_new: int, batch_size: int = 32, progress: bool = True):
    """Greedy answers of the target to `count` ShareGPT prompts (never MT-bench: the evaluation set),
    cached so that a second training run does not distil again."""
    from tqdm import tqdm

    cached = _answers_dir() / f"{_model_name(rt)}-{count}-{max_new}.json"
    if cached.exists():
        return [tuple(p) for p in json.loads(cached.read_text())]
    cfg = TrainConfig(data=DataConfig(sources=["sharegpt"], limit=count, max_prompt_tokens=192))
    prompts = [ids for _, ids in select_prompts(cfg, rt.tokenizer)]
    with tqdm(total=len(prompts) * max_new, unit="tok", desc="distil", disable=not progress) as bar:
        finished = answer_all(rt.engine, prompts, max_new, batch_size, bar)
    pairs = [(p, f.tokens) for p, f in zip(prompts, finished)]
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cached, pairs, indent=None)
    return pairs


def cached_answers(rt) -> list[tuple[list[int], list[int]]]:
    """Every answer earlier train-draft runs distilled for this model."""
    out = []
    for path in sorted(_answers_dir().glob(f"{_model_name(rt)}-*.json")):
        out += [tuple(p) for p in json.loads(path.read_text())]
    return out


def make_examples(pairs, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) with labels only on answer tokens (-100 elsewhere), cut to seq_len + 1: a long
    example keeps the answer's start (the prompt's front goes first, down to 8 tokens), then loses its tail."""
    out = []
    for prompt, response in pairs:
        e = example(prompt, response, seq_len + 1, min_answer=1, context=8)
        if e is not None and sum(e["loss_mask"][1:]) > 0:
            out.append((e["input_ids"], [t if m else -100 for t, m in zip(e["input_ids"], e["loss_mask"])]))
    return out


def collate(batch, pad: int):
    """Padded inputs and next-token labels (-100: not an answer token, or padding)."""
    b = pad_batch([{"input_ids": ids, "loss_mask": [int(lab != -100) for lab in labels]} for ids, labels in batch],
                  pad)
    y = torch.where(b["loss_mask"].bool(), b["input_ids"], -100)
    return b["input_ids"][:, :-1], y[:, 1:]


def training_pairs(rt, model: str, data: str | None, distill_prompts: int, seq_len: int,
                   progress: bool) -> tuple[list, str]:
    """(prompt, answer) pairs and a line saying where they came from: --data, the default training config's
    distilled dataset (plus earlier train-draft answers), else prompts distilled here."""
    pairs = load_pairs(data) if data else find_distilled(model)
    source = data or (f"medusa distill dataset ({len(pairs)} answers)" if pairs else
                      f"{distill_prompts} prompts distilled here")
    if not pairs:
        pairs = distil_here(rt, distill_prompts, max_new=min(seq_len, 128), progress=progress)
    elif not data:  # answers distilled by earlier train-draft runs add to the shared dataset
        extra = cached_answers(rt)
        pairs += extra
        source += f" + {len(extra)} cached answers" if extra else ""
    return pairs, source


def train_draft(model: str = "default", layers: int = 4, data: str | None = None, distill_prompts: int = 128,
                steps: int = 300, batch_size: int = 8, seq_len: int = 256, lr: float = 3e-4,
                out: str | None = None, progress: bool = True, seed: int = 0, vocab: int = 0) -> Path:
    from medusa.runtime import Runtime

    if steps < 1 or batch_size < 1 or seq_len < 8:
        raise MedusaError("--steps and --batch-size must be >= 1 and --seq-len >= 8")
    torch.manual_seed(seed)
    rt = Runtime.load(model, heads="none", dtype="bf16")
    pairs, source = training_pairs(rt, model, data, distill_prompts, seq_len, progress)
    examples = make_examples(pairs, seq_len)
    if len(examples) < 2:
        raise MedusaError(f"--data: only {len(examples)} usable examples")
    random.Random(seed).shuffle(examples)
    n_eval = max(1, len(examples) // 20)
    held, train = examples[:n_eval], examples[n_eval:]
    target = rt.hf_model.float()
    draft = truncated_model(target, layers)
    subset = choose_vocab(pairs, target.config.vocab_size, vocab, rt.engine.eos.tolist()) if vocab else None
    head = vocab_subset_head(target, subset) if subset is not None else target.get_output_embeddings()
    lut = None
    if subset is not None:  # full token id -> row of the reduced head (-100: not scored, ignored)
        lut = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
        lut[subset] = torch.arange(len(subset))
    pad = rt.tokenizer.pad_token_id or 0
    before = agreement(draft, head, lut, held, pad)
    loss = fit(draft, head, lut, train, pad, steps, batch_size, lr, seed, progress)
    after = agreement(draft, head, lut, held, pad)
    meta = {"base_model": getattr(rt.hf_model, "name_or_path", model), "hidden_size": target.config.hidden_size,
            "data": source, "examples": len(train), "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
            "lr": lr, "final_loss": loss, "vocab_coverage": coverage(pairs, subset), "heldout_top1_before": before,
            "heldout_top1_after": after}
    where = save_truncated(draft, out or SHIPPED_DRAFT, meta, subset)
    print(f"held-out next-token agreement with the target: {before:.3f} -> {after:.3f}")
    return where


def fit(draft, head, lut, train: list, pad: int, steps: int, batch_size: int, lr: float, seed: int,
        progress: bool) -> float:
    """Train the draft's own layers and norm (cross-entropy on answer tokens); returns the last loss."""
    from tqdm import tqdm

    trainable = [p for n, p in draft.named_parameters() if not n.startswith(("model.embed_tokens", "lm_head"))]
    for p in trainable:
        p.requires_grad_(True)
    draft.train()
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(min(20, steps // 10), steps))
    rng = random.Random(seed + 1)
    bar = tqdm(range(steps), desc="train-draft", disable=not progress)
    loss_val = float("nan")
    for _ in bar:
        x, y = collate(rng.sample(train, min(batch_size, len(train))), pad)
        logits, y = _logits(draft, head, lut, x, y)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        loss_val = loss.item()
        bar.set_postfix(loss=f"{loss_val:.3f}")
    draft.eval().requires_grad_(False)
    return loss_val


def _logits(draft, head, lut, x, y):
    """Draft logits over its (possibly reduced) vocabulary, and the labels mapped to that vocabulary."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=x.device.type == "cpu"):
        logits = head(draft.model(x).last_hidden_state)
    if lut is not None:
        y = torch.where(y >= 0, lut[y.clamp(min=0)], y)
    return logits, y


def choose_vocab(pairs, vocab_size: int, size: int, always: list[int]) -> torch.Tensor:
    """The `size` token ids the draft scores: special/EOS ids, then the most frequent ids of the data, then
    the lowest ids (BPE gives frequent merges low ids)."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for prompt, response in pairs:
        counts += torch.bincount(torch.tensor(list(prompt) + list(response), dtype=torch.long), minlength=vocab_size)
    score = counts.double() + 1.0 / (2 + torch.arange(vocab_size, dtype=torch.double))  # ties: low ids first
    score[torch.tensor(always, dtype=torch.long)] = float("inf")
    return score.topk(size).indices.sort().values


def coverage(pairs, subset) -> float:
    """Fraction of answer tokens the reduced vocabulary can propose at all."""
    if subset is None:
        return 1.0
    allowed = set(subset.tolist())
    tokens = [t for _, r in pairs for t in r]
    return sum(t in allowed for t in tokens) / max(len(tokens), 1)


@torch.no_grad()
def agreement(draft, head, lut, examples, pad: int) -> float:
    """Top-1 agreement of the draft with the target's answer tokens (about the per-token acceptance)."""
    hit = total = 0
    for s in range(0, len(examples), 8):
        x, y = collate(examples[s: s + 8], pad)
        logits, y = _logits(draft, head, lut, x, y)
        pred = logits.argmax(-1)
        mask = y != -100
        hit += int((pred == y)[mask].sum())
        total += int(mask.sum())
    return hit / max(total, 1)
