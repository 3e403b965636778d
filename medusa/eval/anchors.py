"""The HF anchors: Hugging Face `generate()` plain (`hf`), with an assistant model (`hf_assisted`) and with
prompt lookup (`hf_lookup`), timed per batch on the same prompts as our methods."""

from __future__ import annotations

import time

import torch

from medusa.decoding.sampling import SamplingParams
from medusa.eval.config import MethodSpec
from medusa.eval.driver import RunResult, chunks, sync


def run_hf(rt, prompts: list[list[int]], batch: int, max_new: int, spec: MethodSpec, draft_hf=None,
           sampling: SamplingParams | None = None) -> RunResult:
    """HF `generate()` (plain, assisted or prompt lookup), greedy or sampled; batches are left-padded."""
    eos = rt.engine.eos.tolist()
    pad = rt.tokenizer.pad_token_id if rt.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    kwargs = generate_kwargs(spec, max_new, eos, pad, draft_hf, sampling)
    dev = rt.hf_model.device
    outputs, finish, total = [], [], 0.0
    for _, chunk in chunks(prompts, batch):
        ids, mask = left_padded(chunk, pad)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = rt.hf_model.generate(ids.to(dev), attention_mask=mask.to(dev), **kwargs)
        sync(dev)
        elapsed = time.perf_counter() - t0
        total += elapsed
        for row in out[:, ids.shape[1]:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            outputs.append(row[:cut])
            finish.append(elapsed)
    return RunResult(outputs, total, finish, sum(len(o) for o in outputs))


def generate_kwargs(spec: MethodSpec, max_new: int, eos: list[int], pad: int, draft_hf=None,
                    sampling: SamplingParams | None = None) -> dict:
    """`generate()` arguments of one anchor; a sampled run seeds torch here, as HF draws from its generator."""
    kwargs: dict = {"do_sample": False, "max_new_tokens": max_new, "min_new_tokens": 0,
                    "eos_token_id": eos or None, "pad_token_id": pad}
    if sampling is not None:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        torch.manual_seed(sampling.seed or 0)
    if spec.method == "hf_assisted":
        draft_hf.generation_config.num_assistant_tokens = spec.k or 4
        draft_hf.generation_config.num_assistant_tokens_schedule = "constant"
        draft_hf.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft_hf
    elif spec.method == "hf_lookup":
        kwargs["prompt_lookup_num_tokens"] = spec.k or 10
    return kwargs


def left_padded(chunk: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of a batch, each prompt right-aligned behind `pad` tokens."""
    width = max(len(p) for p in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(chunk):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask
