"""The feature head's loss over the draft vocabulary, fused.

Per labelled row i, with z_i = W x_i the head's draft-vocabulary logits (W: the target's frozen lm_head rows
for the draft ids) and p_i = softmax(W t_i) the target's own distribution over the same ids (t_i: the
target's final feature):

    loss_i = CE(p_i, softmax(z_i)) = logsumexp(z_i) - <p_i, z_i>        (sum_v p_iv = 1)
    d loss_i / d x_i = W^T (softmax(z_i) - p_i)

Both are computed in one sweep over blocks of `block` rows, so no [N, V] tensor outlives its block: the
logits are never kept for the backward pass (the gradient with respect to x is formed in the forward sweep
and scaled by the upstream gradient later), and the [N, V] fp32 copies, products and softmaxes of the plain
formulation (log_softmax, its backward, the soft-target product) become one block-sized pass each. Matmuls
run in the dtype of the step (bf16 under autocast, else fp32), the softmax arithmetic in fp32: the same
numbers as `F.cross_entropy(logits.float(), p)` on the unfused logits, at a fraction of the memory traffic.
"""

from __future__ import annotations

import torch

from medusa.decoding.verifier import argmax

BLOCK = 256  # rows per block: a [256, 8192] fp32 block is 8 MB


def matmul_dtype(device: torch.device) -> torch.dtype:
    """The dtype autocast would multiply in here (fp32 when it is off)."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32


class DraftVocab:
    """The frozen draft-vocabulary projection W [V, h] of one training step, cast once to the step's matmul
    dtype; `teacher` and `loss` read it."""

    def __init__(self, weight: torch.Tensor, block: int = BLOCK):
        if weight.requires_grad:
            raise ValueError("the fused draft-vocabulary loss needs a frozen lm_head (no gradient for W)")
        self.dtype = matmul_dtype(weight.device)
        self.weight = weight.detach().to(self.dtype)
        self.block = block

    @torch.no_grad()
    def teacher(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's distribution for rows t [N, h]: (logits [N, V] in the matmul dtype, their
        logsumexp [N] fp32), so that p = exp(logits - lse)."""
        with torch.autocast(t.device.type, enabled=False):
            logits = t.to(self.dtype) @ self.weight.T
            lse = torch.cat([torch.logsumexp(logits[a: a + self.block].float(), -1)
                             for a in range(0, len(t), self.block)]) if len(t) else logits.new_zeros(0).float()
        return logits, lse

    def loss(self, x: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss [N] fp32, differentiable in x [N, h]; the head's top draft id [N]) against `teacher`."""
        return _SoftCE.apply(x, self.weight, teacher[0], teacher[1], self.block)


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, t_logits, t_lse, block):
        n = x.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        top = torch.empty(n, dtype=torch.long, device=x.device)
        grad = torch.empty_like(x)
        with torch.autocast(x.device.type, enabled=False):
            xm = x.detach().to(weight.dtype)
            for a in range(0, n, block):
                b = min(n, a + block)
                z = (xm[a:b] @ weight.T).float()
                lse = torch.logsumexp(z, -1)
                p = torch.exp(t_logits[a:b].float() - t_lse[a:b, None])
                loss[a:b] = lse - (p * z).sum(-1)
                top[a:b] = argmax(z)
                g = torch.exp(z.sub_(lse[:, None])).sub_(p)  # softmax(z) - p
                grad[a:b] = (g.to(weight.dtype) @ weight).to(x.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(top)
        return loss, top

    @staticmethod
    def backward(ctx, grad_loss, _grad_top):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss[:, None].to(grad.dtype), None, None, None, None
