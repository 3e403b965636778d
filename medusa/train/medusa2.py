"""Medusa-2: heads and a LoRA adapter on the base trained together.

Loss = base_loss_weight * CE(base next token, on answer tokens) + head_loss_weight * head loss. During the
first `medusa2.heads_only_steps` steps the base runs without gradients and only the heads learn, so that
the randomly initialised heads do not push large gradients into the adapter. The adapter is saved with
peft (`adapter/`), next to the heads; `merged/` holds base + adapter as a plain model directory that
`medusa generate --model` loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from medusa.train.config import Medusa2Config
from medusa.train.objective import HeadObjective


def add_lora(hf_model, cfg: Medusa2Config):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")
    model = get_peft_model(hf_model, lora)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # fp32 adapter weights: the optimizer updates are tiny
            p.requires_grad_(True)
    return model


class Medusa2Module(nn.Module):
    """Base (with adapter) + heads; forward gives the combined loss of one micro-batch."""

    def __init__(self, peft_model, objective: HeadObjective, cfg: Medusa2Config):
        super().__init__()
        self.base = peft_model
        self.objective = objective
        self.cfg = cfg

    def forward(self, batch: dict, labels: torch.Tensor, norm: torch.Tensor, base_norm: torch.Tensor,
                heads_only: bool, kl: bool = False):
        with torch.set_grad_enabled(not heads_only and torch.is_grad_enabled()):
            out = self.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1]
        keep = (labels >= 0).any(-1)
        teacher = None
        if kl:
            t = hidden.shape[1]
            j = (torch.arange(t)[:, None] + torch.arange(1, labels.shape[-1] + 1)[None]).clamp(max=t - 1)
            teacher = hidden.detach()[:, j][keep]
        head_loss, stats = self.objective(hidden[keep], labels[keep], norm, teacher)
        loss = self.cfg.head_loss_weight * head_loss
        if not heads_only:
            target = batch["input_ids"][:, 1:]
            mask = batch["loss_mask"][:, 1:].bool()
            ce = F.cross_entropy(out.logits[:, :-1][mask].float(), target[mask], reduction="sum")
            loss = loss + self.cfg.base_loss_weight * ce / base_norm.clamp_min(1)
        return loss, stats


def attach(run) -> Medusa2Module:
    """Wire the adapter into a training run: trainable parameters, save and load hooks."""
    module = Medusa2Module(run.hf_model, run.objective, run.cfg.medusa2)
    run.module = module
    run.lora_params = [p for n, p in run.hf_model.named_parameters() if p.requires_grad and "lora_" in n]
    run.save_adapter = lambda d: run.hf_model.save_pretrained(str(d))
    run.load_adapter = lambda d: _load_adapter(run.hf_model, Path(d))
    return module


def _load_adapter(model, directory: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(str(directory / "adapter_model.safetensors")))


def save_merged(run, directory: Path) -> None:
    """Base with the adapter folded in, as a plain model directory (what `--model DIR` loads)."""
    from medusa.io import atomic_dir

    merged = run.hf_model.merge_and_unload()
    merged = merged.to(torch.bfloat16) if run.cfg.dtype == "bf16" else merged

    def fill(tmp: Path) -> None:
        merged.save_pretrained(str(tmp))
        run.tokenizer.save_pretrained(str(tmp))

    atomic_dir(directory, fill)
