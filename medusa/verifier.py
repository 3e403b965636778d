"""Verification: given the target's logits over a candidate tree, keep the longest agreeing path.

One verifier serves every proposer: a chain (draft model) is a tree with one path and plain decoding is
the tree with only the root, so greedy acceptance needs no special cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TreeBuffers


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] candidates accepted (root excluded)
    path: torch.Tensor      # [B, D+1] node indices of the chosen root-to-leaf path
    next_token: torch.Tensor  # [B] the target's own token after the last accepted node


class GreedyVerifier:
    """Lossless for greedy decoding: output equals plain argmax decoding token for token."""

    name = "greedy"

    def verify(self, logits: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers) -> Verdict:
        pred = logits.argmax(-1)  # [B, T]: the target's choice after each node
        paths = tree.paths  # [P, D+1]
        child = tokens[:, paths[:, 1:]]  # [B, P, D]
        parent_pred = pred[:, paths[:, :-1]]  # [B, P, D]
        depth = torch.arange(paths.shape[1] - 1, device=paths.device)
        ok = (child == parent_pred) & (depth < tree.path_len[:, None])
        run = ok.long().cumprod(-1).sum(-1)  # [B, P] accepted length along each path
        accepted, best = run.max(-1)
        path = paths[best]  # [B, D+1]
        last = path.gather(1, accepted[:, None])[:, 0]
        next_token = pred.gather(1, last[:, None])[:, 0]
        return Verdict(accepted, path, next_token)
