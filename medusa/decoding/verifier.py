"""Verification: given the target's logits over a candidate tree, keep the longest agreeing path.

One verifier serves every proposer: a chain (draft model) is a tree with one path and plain decoding is
the tree with only the root, so greedy acceptance needs no special cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.decoding.sampling import MODE_TYPICAL, argmax, sample_from
from medusa.decoding.tree import TreeBuffers


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] candidates accepted (root excluded)
    path: torch.Tensor      # [B, D+1] node indices of the chosen root-to-leaf path
    next_token: torch.Tensor  # [B] the target's own token after the last accepted node


class GreedyVerifier:
    """Lossless for greedy decoding: output equals plain argmax decoding token for token."""

    name = "greedy"

    def verify(self, logits: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers) -> Verdict:
        pred = argmax(logits)  # [B, T]: the target's choice after each node
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


class SamplingVerifier:
    """Acceptance for sampled decoding, row by row as each row's parameters say.

    - rejection (lossless): walk down the tree; at each node try its children in rank order, accepting
      child c with probability min(1, r(c) / q_c(c)) where r is the target distribution with the mass of
      already-rejected children removed (r <- norm(max(0, r - q_c)) after each rejection) and q_c the
      distribution child c was drawn from. Medusa's top-k picks are deterministic, so q_c is a point mass
      on c: the rule accepts c with probability r(c) and, on rejection, removes c from r. When no child is
      accepted the next token is drawn from r. Output tokens are distributed exactly as the target's own
      sampling, for any proposer.
    - typical (Medusa's, not lossless): a candidate is accepted when the target gives it probability above
      min(epsilon, delta * exp(-H(p))); the longest such path wins; the next token is sampled from p.
    - greedy rows: p is one-hot on the argmax, so both rules reduce to greedy acceptance.
    """

    name = "sampling"

    def verify(self, p: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers, sampling, rows: slice,
               proposal: torch.Tensor | None = None) -> Verdict:
        """p [n, T, V]: target sampling distribution at every node; proposal [n, T-1, V] or None (point
        masses: deterministic candidates)."""
        typical = sampling.mode[rows] == MODE_TYPICAL
        rejection = self._rejection(p, tokens, tree, sampling, rows, proposal)
        if not bool(typical.any()):
            return rejection
        t = self._typical(p, tokens, tree, sampling, rows)
        pick = typical[:, None]
        return Verdict(torch.where(typical, t.accepted, rejection.accepted),
                       torch.where(pick, t.path, rejection.path),
                       torch.where(typical, t.next_token, rejection.next_token))

    def _rejection(self, p, tokens, tree, sampling, rows_slice, proposal) -> Verdict:
        n, t, _ = p.shape
        rows = torch.arange(n, device=p.device)
        depth_max = tree.paths.shape[1] - 1
        width = tree.children.shape[1]
        u = sampling.uniform(rows_slice, depth_max * width + 1)
        cur = torch.zeros(n, dtype=torch.long, device=p.device)
        path = torch.zeros(n, depth_max + 1, dtype=torch.long, device=p.device)
        accepted = torch.zeros(n, dtype=torch.long, device=p.device)
        searching = torch.ones(n, dtype=torch.bool, device=p.device)  # still walking down
        residual = p[rows, cur].clone()
        for level in range(depth_max):
            moved = torch.zeros(n, dtype=torch.bool, device=p.device)
            nxt = cur.clone()
            for i in range(width):
                child = tree.children[cur, i]
                trying = searching & ~moved & (child >= 0)
                if not bool(trying.any()):
                    break
                c = child.clamp(min=0)
                tok = tokens[rows, c]
                r = residual / residual.sum(-1, keepdim=True)
                if proposal is None:
                    q_tok = torch.ones(n, device=p.device)
                    q = None
                else:
                    q = proposal[rows, (c - 1).clamp(min=0)]
                    q_tok = q[rows, tok]
                ratio = (r[rows, tok] / q_tok.clamp(min=1e-20)).clamp(max=1.0)
                ok = trying & (u[:, level * width + i] < ratio)
                rejected = trying & ~ok
                if q is None:
                    residual[rows[rejected], tok[rejected]] = 0.0
                else:
                    residual = torch.where(rejected[:, None], (r - q).clamp(min=0.0), residual)
                moved |= ok
                nxt = torch.where(ok, c, nxt)
            searching &= moved
            cur = nxt
            accepted += moved.long()
            path[:, level + 1] = cur
            # A row that moved starts afresh from the target distribution at its new node.
            residual = torch.where(moved[:, None], p[rows, cur], residual)
        # Rows that stopped early keep their last node in the rest of the path (like padded tree paths).
        for level in range(1, depth_max + 1):
            path[:, level] = torch.where(accepted >= level, path[:, level], path[:, level - 1])
        # A residual with no mass left can only come from rounding: fall back to the target distribution.
        empty = residual.sum(-1) <= 0
        residual = torch.where(empty[:, None], p[rows, cur], residual)
        next_token = sample_from(residual, u[:, -1])
        return Verdict(accepted, path, next_token)

    def _typical(self, p, tokens, tree, sampling, rows) -> Verdict:
        n = p.shape[0]
        entropy = -(p * torch.log(p.clamp(min=1e-20))).sum(-1)  # [n, T]
        threshold = torch.minimum(sampling.epsilon[rows, None], sampling.delta[rows, None] * torch.exp(-entropy))
        # Each node's token under its parent's distribution, and whether it clears the parent's bar.
        node_prob = p[:, tree.parent].gather(-1, tokens[..., None])[..., 0]  # [n, T]
        node_ok = node_prob > threshold[:, tree.parent]
        paths = tree.paths
        depth = torch.arange(paths.shape[1] - 1, device=p.device)
        ok = node_ok[:, paths[:, 1:]] & (depth < tree.path_len[:, None])
        run = ok.long().cumprod(-1).sum(-1)
        accepted, best = run.max(-1)
        path = paths[best]
        last = path.gather(1, accepted[:, None])[:, 0]
        u = sampling.uniform(rows, 1)[:, 0]
        next_token = sample_from(p[torch.arange(n, device=p.device), last], u)
        return Verdict(accepted, path, next_token)
