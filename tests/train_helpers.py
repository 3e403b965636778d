"""Tiny fixtures for the training tests: a random Llama saved with a word-level tokenizer, fake distilled data."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

VOCAB = 97


def save_tiny_model(directory: Path, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conftest import tiny_model

    model = tiny_model("llama", seed=seed, vocab=VOCAB)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(directory)
    return directory


def fake_distilled(directory: Path, model_dir: Path, n: int = 24, answer_len: int = 24, seed: int = 0) -> Path:
    """Greedy answers of the tiny model to random prompts, in the `medusa distill` layout."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    rows = {"prompt": [], "prompt_ids": [], "response_ids": [], "response": [], "finish_reason": []}
    for i in range(n):
        prompt = torch.randint(2, VOCAB, (4 + i % 5,), generator=g)
        out = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=answer_len, do_sample=False, pad_token_id=0, eos_token_id=None)
        rows["prompt"].append(f"p{i}")
        rows["prompt_ids"].append(prompt.tolist())
        rows["response_ids"].append(out[0, len(prompt):].tolist())
        rows["response"].append("")
        rows["finish_reason"].append("length")
    shard = directory / "shard-00000"
    Dataset.from_dict(rows).save_to_disk(str(shard))
    (shard / "count.json").write_text(json.dumps({"rows": n}))
    return directory


def write_config(path: Path, model_dir: Path, data_dir: Path, run_dir: Path, **overrides) -> Path:
    cfg = {"model": str(model_dir), "dtype": "fp32", "seed": 0, "run_dir": str(run_dir),
           "data": {"sources": ["sharegpt"], "distill_dir": str(data_dir), "eval_fraction": 0.2},
           "heads": {"num_heads": 3, "num_layers": 1},
           "optim": {"lr": 0.01, "warmup_steps": 2},
           "cache_hidden": True, "batch_size": 32, "epochs": 2, "checkpoint_every": 5,
           "wandb": {"mode": "disabled"}, "tree_budgets": [4, 8]}
    for key, value in overrides.items():
        node = cfg
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    path.write_text(yaml.safe_dump(cfg))
    return path
