"""The Medusa head loss: sum_k w_k * CE(head_k(h_t), token_{t+k+2}), or KL to the base's own distribution.

Both losses are normalised by the number of labels of head k in the whole global batch (all processes
and accumulation steps), passed in as `norm`, so that splitting a batch across processes or micro-batches
changes nothing but the summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medusa.decoding.proposers.heads import MedusaHeads


class HeadObjective(nn.Module):
    """Trainable heads (fp32 master weights) over a frozen vocabulary projection in the base's dtype."""

    def __init__(self, heads: MedusaHeads, projection: torch.Tensor, weights: list[float], kind: str = "ce",
                 temperature: float = 1.0):
        super().__init__()
        self.heads = heads
        # A plain attribute, not a parameter or buffer: frozen, never saved, never synchronised by DDP.
        self.projection = [projection.detach().requires_grad_(False)]
        self.weights = list(weights)
        self.kind = kind
        self.temperature = temperature
        self.vocab: torch.Tensor | None = None   # training softmax over these ids only (None: all)
        self.remap: torch.Tensor | None = None

    def restrict_vocab(self, ids: torch.Tensor | None) -> None:
        """Train the softmax over a subset of the vocabulary (every label must be in it).

        The vocabulary projection is most of a step's cost; the answers of a chat model use a few thousand
        distinct tokens, so a softmax over those (plus the most frequent ids) is several times cheaper.
        Evaluation and inference always rank the full vocabulary."""
        if ids is None:
            self.vocab = self.remap = None
            return
        ids = torch.unique(ids)
        self.vocab = ids
        self.remap = torch.full((self.projection[0].shape[0],), -100, dtype=torch.long)
        self.remap[ids] = torch.arange(ids.shape[0])
        self._sub = [self.projection[0][ids].contiguous()]

    def logits(self, hidden: torch.Tensor, full: bool = True) -> torch.Tensor:
        """[B, H] -> [K, B, V] float32 logits (V: the training subset when full is False)."""
        sub = not full and self.vocab is not None
        w = self._sub[0] if sub else self.projection[0]
        out = []
        for k, block in enumerate(self.heads.blocks):
            h = block(hidden.float())
            if self.heads.lm_heads is not None:
                proj = self.heads.lm_heads[k]
                out.append(F.linear(h, proj.weight[self.vocab] if sub else proj.weight).float())
            else:
                out.append(F.linear(h.to(w.dtype), w).float())
        return torch.stack(out)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self._sub[0] if self.vocab is not None else self.projection[0]
        return F.linear(hidden.to(w.dtype), w).float()

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, norm: torch.Tensor,
                teacher_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """hidden [B, H]; labels [B, K] (-100: none); norm [K] label counts of the global batch;
        teacher_hidden [B, K, H]: base hidden state at t+k+1 (for kind == "kl").
        Returns (loss, stats [3, K]: top-1 hits, top-5 hits and labels per head) on this micro-batch.

        Rows without a label are masked, not dropped, so nothing here waits for the device: the statistics
        stay on it until the step's log line reads them once."""
        logits = self.logits(hidden, full=False)
        if self.remap is not None:
            labels = torch.where(labels >= 0, self.remap[labels.clamp_min(0)], labels)
        loss = hidden.new_zeros((), dtype=torch.float32)
        stats = []
        for k in range(logits.shape[0]):
            valid = labels[:, k] >= 0
            lk, yk = logits[k], labels[:, k].clamp_min(0)
            if self.kind == "kl":
                with torch.no_grad():
                    target = F.softmax(self.base_logits(teacher_hidden[:, k]) / self.temperature, -1)
                logp = F.log_softmax(lk / self.temperature, -1)
                per = (target * (torch.log(target.clamp_min(1e-20)) - logp)).sum(-1)
            else:
                per = F.cross_entropy(lk, yk, reduction="none")
            loss = loss + self.weights[k] * torch.where(valid, per, 0.0).sum() / norm[k].clamp_min(1)
            with torch.no_grad():
                hit = (lk.topk(min(5, lk.shape[-1]), -1).indices == yk[:, None]) & valid[:, None]
                stats.append(torch.stack([hit[:, :1].sum(), hit.sum(), valid.sum()]))
        return loss, torch.stack(stats, 1).float()


@torch.no_grad()
def rank_accuracy(objective: HeadObjective, hidden: torch.Tensor, labels: torch.Tensor, topk: int = 10,
                  batch: int = 512) -> tuple[list[list[float]], list[int]]:
    """acc[k][r]: fraction of head k's labels that are its rank-r prediction (r < topk); and label counts."""
    k_heads = labels.shape[1]
    hits = torch.zeros(k_heads, topk, device=hidden.device)  # a training rank evaluates on its own device
    counts = torch.zeros(k_heads, device=hidden.device)
    for s in range(0, hidden.shape[0], batch):
        logits = objective.logits(hidden[s: s + batch])
        lab = labels[s: s + batch]
        for k in range(k_heads):
            valid = lab[:, k] >= 0
            top = logits[k][valid].topk(topk, -1).indices
            hits[k] += (top == lab[valid, k][:, None]).float().sum(0)
            counts[k] += valid.sum()
    acc = (hits / counts.clamp_min(1)[:, None]).tolist()
    return acc, counts.long().tolist()
