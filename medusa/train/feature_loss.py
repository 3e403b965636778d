"""A feature head's training objective (`medusa train-feature`): the head unrolled over its own outputs,
each step's feature regression and cross-entropy against the target over the draft vocabulary.

Objective at position t (t+2 an answer token): the head reads (f_t, x_{t+1}) and predicts f_{t+1};
    loss = feature_weight * SmoothL1(f^_{t+1}, f_{t+1})              (eagle1 only)
         + ce_weight * CE(softmax over the draft vocabulary of lm_head(f_{t+1}), head's distribution)
with uniform noise (+-noise) on the input features; step j of `unroll` reads its own step j-1 outputs as
features and is weighted decay**j.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F

from medusa.train.vocab_loss import DraftVocab

if TYPE_CHECKING:
    from medusa.train.feature import FeatureTrainConfig


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


def shifted(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> the entry at s + 1 for every position s (the last one repeats)."""
    return torch.cat([x[:, 1:], x[:, -1:]], 1)


def unrolled(head, emb: torch.Tensor, f_in: torch.Tensor, label_ok: torch.Tensor, steps: int) -> Iterator:
    """Run the head `steps` times over a [B, T] batch, step j reading its own step j-1 outputs as the
    features; yields (j, output [B, T, H], ok [B, T]: the positions with a label at step j). Step j runs
    the layer over its own T positions only: queries over the cached keys of every step so far, with the
    last T rows of `unrolled_mask(j + 1, T)`."""
    from transformers import DynamicCache

    b, t = label_ok.shape
    positions = torch.arange(t, device=emb.device).expand(b, t)
    x = head.inputs(emb, f_in, fused=True)
    cache = DynamicCache()
    for j in range(min(steps, t)):
        mask = None if j == 0 else unrolled_mask(j + 1, t, f_in.dtype, emb.device)[:, :, j * t:]
        out = head.layer_forward(emb, x, positions, mask, cache=cache)
        ok = label_ok.clone()
        ok[:, :j] = False
        yield j, out, ok
        x = head.inputs(emb, torch.cat([out[:, :1] * 0, out[:, :-1]], 1), fused=False)


def label_mask(answer: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, T]: the positions s whose s+2 is an answer token (what a draft at s is trained to predict)."""
    b, t = answer.shape
    ok = torch.zeros(b, t, dtype=torch.bool, device=answer.device)
    ok[:, : t - 2] = answer[:, 2:] & valid[:, 2:]
    return ok


def step_counts(answer: torch.Tensor, valid: torch.Tensor, steps: int) -> torch.Tensor:
    """Labelled positions per unroll step [steps] (step j has none in a sequence's first j positions)."""
    ok = label_mask(answer, valid)
    return torch.stack([ok[:, j:].sum() for j in range(steps)]).float()


def head_loss(head, cfg: FeatureTrainConfig, feats: torch.Tensor, tokens: torch.Tensor, answer: torch.Tensor,
              top: torch.Tensor, valid: torch.Tensor, full_to_draft: torch.Tensor, noise: bool = True,
              counts: torch.Tensor | None = None):
    """feats [B, T, F] (float), tokens/answer/top/valid [B, T]. Returns (loss, stats per unroll step).
    `counts` [unroll]: the labelled positions per step that each step's loss is averaged over (default:
    this batch's; a process holding part of a global batch passes the whole batch's, `step_counts` summed
    over the processes, so the processes' summed gradients are the whole batch's)."""
    b, t, _ = feats.shape
    h = head.config.hidden_size
    # Inputs at position s: f_s and x_{s+1}; targets: f_{s+1} and the target's distribution at s+1.
    emb = head.embed(shifted(tokens)).float()
    f_in = feats[..., : head.config.feature_dim]
    if noise and cfg.loss.noise > 0:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * cfg.loss.noise
    target_feat = shifted(feats[..., -h:])  # the final feature at s+1
    label_ok = label_mask(answer, valid)
    # The vocabulary projections and the loss run on the labelled positions only (answers, not prompts
    # or padding): rows [N] of the flattened batch; step j's labels are the subset where ok_j holds.
    rows = label_ok.flatten().nonzero().squeeze(1)
    vocab = DraftVocab(head.lm_head.weight)  # the frozen projection, cast once for the step
    with torch.no_grad():
        target_rows = target_feat.flatten(0, 1)[rows]
        teacher = vocab.teacher(target_rows)  # the target's draft-vocabulary distribution [N, V]
        greedy_d = full_to_draft[shifted(top).flatten()[rows]]  # the target's token at s+2 [N]
    loss = feats.new_zeros(())
    stats = []
    for j, out, ok in unrolled(head, emb, f_in, label_ok, cfg.loss.unroll):
        w = ok.flatten()[rows].float()  # [N]: 0 where step j has no label (its first j positions)
        count = (w.sum() if counts is None else counts[j]).clamp(min=1)
        out_rows = out.flatten(0, 1)[rows]
        ce, drafted = vocab.loss(out_rows if head.norm is None else head.norm(out_rows), teacher)
        step_loss = cfg.loss.ce_weight * (ce * w).sum() / count
        if head.config.style == "eagle1" and cfg.loss.feature_weight > 0:
            sl1 = F.smooth_l1_loss(out_rows.float(), target_rows.float(), reduction="none").mean(-1)
            step_loss = step_loss + cfg.loss.feature_weight * (sl1 * w).sum() / count
        loss = loss + cfg.loss.decay ** j * step_loss
        with torch.no_grad():
            hit = (drafted == greedy_d).float() * w
            stats.append((int(hit.sum()), int(w.sum())))
    return loss, stats
