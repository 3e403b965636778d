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

from medusa.io import atomic_dir
from medusa.train.batches import MicroBatch, teacher_from_seq
from medusa.train.config import Medusa2Config
from medusa.train.objective import HeadObjective
from medusa.train.strategy import HeadsOnly


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
        teacher = teacher_from_seq(hidden.detach(), labels.shape[-1])[keep] if kl else None
        head_loss, stats = self.objective(hidden[keep], labels[keep], norm, teacher)
        loss = self.cfg.head_loss_weight * head_loss
        if not heads_only:
            target = batch["input_ids"][:, 1:]
            mask = batch["loss_mask"][:, 1:].bool()
            ce = F.cross_entropy(out.logits[:, :-1][mask].float(), target[mask], reduction="sum")
            loss = loss + self.cfg.base_loss_weight * ce / base_norm.clamp_min(1)
        return loss, stats


class Medusa2(HeadsOnly):
    """The heads and the adapter of a peft model (`add_lora`), each with its own learning rate."""

    runs_base = True  # the batches carry token sequences; the base runs inside the loss

    def __init__(self, objective: HeadObjective, cfg, peft_model, tokenizer):
        super().__init__(objective, cfg)
        self.peft_model, self.tokenizer = peft_model, tokenizer
        self.module = Medusa2Module(peft_model, objective, cfg.medusa2)

    def param_groups(self) -> list[dict]:
        lora = [p for n, p in self.peft_model.named_parameters() if p.requires_grad and "lora_" in n]
        groups = super().param_groups()
        if lora:
            groups.append({"params": lora, "lr": self.cfg.medusa2.lora_lr or self.cfg.optim.lr})
        return groups

    def loss(self, model: torch.nn.Module, micro: MicroBatch, step: int) -> tuple[torch.Tensor, dict]:
        heads_only = step < self.cfg.medusa2.heads_only_steps
        return model(micro.tokens, micro.labels, micro.norm, micro.base_norm, heads_only, self.cfg.loss.kind == "kl")

    def save(self, directory: Path) -> None:
        self.peft_model.save_pretrained(str(directory / "adapter"))

    def load(self, directory: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.peft_model, load_file(str(directory / "adapter" / "adapter_model.safetensors")))

    def outputs(self, run_dir: Path) -> dict:
        """Base with the adapter folded in, as a plain model directory (what `--model DIR` loads)."""
        merged = self.peft_model.merge_and_unload()
        merged = merged.to(torch.bfloat16) if self.cfg.dtype == "bf16" else merged

        def fill(tmp: Path) -> None:
            merged.save_pretrained(str(tmp))
            self.tokenizer.save_pretrained(str(tmp))

        atomic_dir(run_dir / "merged", fill)
        return {"merged_model": str(run_dir / "merged")}
