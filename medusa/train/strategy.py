"""What a heads training run trains, as an object the training loop is given.

The loop asks its strategy for the module to optimise and its parameter groups, for the loss of each
micro-batch, for the state a checkpoint and the heads directory carry besides the heads, and for any
output written at the end. `HeadsOnly` (Medusa-1) trains the heads on a frozen base; `Medusa2`
(medusa.train.medusa2) trains a LoRA adapter on the base with them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from medusa.train.batches import MicroBatch
from medusa.train.objective import HeadObjective


class HeadsOnly:
    """Medusa-1: the heads learn from the frozen base's hidden states (cached or computed per batch)."""

    runs_base = False  # the batches carry the base's hidden states, computed without gradients

    def __init__(self, objective: HeadObjective, cfg):
        self.objective, self.cfg = objective, cfg
        self.module: torch.nn.Module = objective

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.objective.parameters() if p.requires_grad], "lr": self.cfg.optim.lr}]

    def loss(self, model: torch.nn.Module, micro: MicroBatch, step: int) -> tuple[torch.Tensor, dict]:
        """`model` is `module`, or what DDP / DeepSpeed wrapped it in."""
        return model(micro.hidden, micro.labels, micro.norm, micro.teacher)

    def save(self, directory: Path) -> None:
        """State besides the heads, into a checkpoint or the heads directory."""

    def load(self, directory: Path) -> None:
        """What `save` wrote, from a checkpoint."""

    def outputs(self, run_dir: Path) -> dict:
        """Outputs written once training is over (rank 0), by name."""
        return {}
