"""Verification: given the target's logits over a candidate tree, keep the longest agreeing path.

Every proposer's `draft` returns `RowTrees`, a candidate tree per row; the engine puts the pending roots in
front (`RowTrees.candidates`) and the verifiers read the result. One verifier serves every proposer: a chain
(draft model) is a tree with one path, plain decoding is the tree with only the root, and a static tree is a
per-row tree that every row happens to share (`RowTrees.shared`: views of the tree's precomputed buffers),
so dynamic trees (`medusa.decoding.trees.dynamic_tree`) are verified by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.decoding.trees.tree import TreeBuffers

# Each row's acceptance rule (`RowSampling.acceptance`; `sampling.acceptance_of` picks it from a request).
ACCEPT_GREEDY, ACCEPT_REJECTION, ACCEPT_TYPICAL, ACCEPT_MATCH = 0, 1, 2, 3


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` with the same first-index rule on ties. On CPU the max kernel is 2-2.5x faster
    than argmax's over vocabulary-sized bf16 rows, which is ~0.1 ms of every decoding step at batch size 1."""
    return logits.max(-1).indices


def sample_from(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: p [n, V] (unnormalised is fine), u [n] uniforms -> token ids [n]."""
    c = p.cumsum(-1)
    target = (u * c[:, -1]).unsqueeze(-1)
    return torch.searchsorted(c, target, right=True).squeeze(-1).clamp(max=p.shape[-1] - 1)


@dataclass
class Candidates:
    """One pass's candidate trees, one per row: n rows, T nodes (root = node 0), P paths, depth bound D.

    tokens:    [n, T] long, the root then each candidate, in node order
    paths:     [n, P, D+1] long, the paths the verifier searches (`RowTrees.paths`)
    path_len:  [n, P] long, non-root nodes on each path (0: a path that can accept nothing)
    children:  [n, T, C] long, each node's children in rank order, padded with -1
    parent:    [n, T] long, each node's parent (the root: 0)
    node_depth: [n, T] long, each node's depth (the root: 0)
    proposal:  [n, T-1, V] float or None: the distribution each candidate was drawn from (None: point
               masses, i.e. deterministic top-k picks)
    """

    tokens: torch.Tensor
    paths: torch.Tensor
    path_len: torch.Tensor
    children: torch.Tensor
    parent: torch.Tensor
    node_depth: torch.Tensor
    proposal: torch.Tensor | None = None

    @classmethod
    def shared(cls, tokens: torch.Tensor, tree: TreeBuffers, proposal: torch.Tensor | None = None) -> "Candidates":
        """Every row on the same static tree, tokens [n, T] (expanded views: no copies)."""
        return RowTrees.shared(tokens[:, 1:], tree, proposal).candidates(tokens)

    @property
    def depth_bound(self) -> int:
        """D: no path holds more than D candidates."""
        return self.paths.shape[2] - 1

    def along_paths(self, values: torch.Tensor, start: int) -> torch.Tensor:
        """values [n, T] read along every path from node index `start` on: [n, P, D+1-start]."""
        n, p, d1 = self.paths.shape
        return values.gather(1, self.paths[:, :, start:].reshape(n, -1)).view(n, p, d1 - start)

    def longest(self, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ok [n, P, D]: node k+1 of each path passes. The longest passing prefix per row: (accepted [n],
        its path [n, D+1]); paths past their length never pass."""
        ok = ok & (torch.arange(self.depth_bound, device=ok.device) < self.path_len[:, :, None])
        accepted, best = ok.long().cumprod(-1).sum(-1).max(-1)
        return accepted, self.paths[torch.arange(ok.shape[0], device=ok.device), best]


@dataclass
class RowTrees:
    """One step's draft: a candidate tree per row, what every proposer's `draft` returns. n rows, T nodes
    per row (root = node 0, the pending token the target chose last step), P paths, depth bound D.

    tokens:     [n, T-1] long, candidate token of each non-root node
    mask:       [n, T, T] bool, node i may attend to node j (j is i or an ancestor of i)
    node_depth: [n, T] long, each node's depth: its position offset after the committed prefix
    paths:      [n, P, D+1] long, root-to-node paths the verifier searches, padded by repeating the last
                node: a static tree's `leaf_paths` (one per leaf), a grown tree's `node_paths` (one per
                node, the root's and dead nodes' [0, 0, ..]; `dynamic_tree.row_trees`)
    path_len:   [n, P] long, non-root nodes on each path (0: a path that can accept nothing)
    children:   [n, T, C] long, each node's live children in rank order, padded with -1
    parent:     [n, T] long, each node's parent (the root and dead nodes: 0)
    proposal:   [n, T-1, V] float or None: the distribution each node's token was drawn from (None: all
                point masses, i.e. deterministic top-k picks)
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    node_depth: torch.Tensor
    paths: torch.Tensor
    path_len: torch.Tensor
    children: torch.Tensor
    parent: torch.Tensor
    proposal: torch.Tensor | None = None

    @classmethod
    def shared(cls, tokens: torch.Tensor, tree: TreeBuffers, proposal: torch.Tensor | None = None) -> "RowTrees":
        """Every row on one static tree: tokens [n, T-1] fill its nodes; the tree's tensors are expanded
        views of its precomputed buffers (no copies)."""
        n = tokens.shape[0]
        return cls(tokens, tree.mask.expand(n, -1, -1), tree.node_depth.expand(n, -1),
                   tree.leaf_paths.expand(n, -1, -1), tree.path_len.expand(n, -1), tree.children.expand(n, -1, -1),
                   tree.parent.expand(n, -1), proposal)

    def candidates(self, tokens: torch.Tensor) -> Candidates:
        """What the verifier reads, for tokens [n, T] (the roots, then `self.tokens`)."""
        return Candidates(tokens, self.paths, self.path_len, self.children, self.parent, self.node_depth, self.proposal)


@dataclass
class Verdict:
    accepted: torch.Tensor  # [n] candidates accepted (root excluded)
    path: torch.Tensor      # [n, D+1] node indices of the chosen root-to-leaf path
    next_token: torch.Tensor  # [n] the target's own token after the last accepted node


def _last(path: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The last accepted node of each row's path."""
    return path.gather(1, accepted[:, None])[:, 0]


def _matching(cand: Candidates, pred: torch.Tensor) -> Verdict:
    """pred [n, T]: the token the target chooses after each node. The longest path whose every candidate is
    the choice after its parent, and the choice after its last node."""
    accepted, path = cand.longest(cand.along_paths(cand.tokens, 1) == cand.along_paths(pred, 0)[..., :-1])
    return Verdict(accepted, path, pred.gather(1, _last(path, accepted)[:, None])[:, 0])


class Verifier:
    """Each row's longest accepted path under its acceptance rule, and the target's token after it.

    - greedy (lossless for greedy decoding): the longest path whose every candidate is the target's argmax
      after its parent; output equals plain argmax decoding token for token. A batch with only greedy rows
      takes this rule straight from the logits (no distributions are formed).
    - rejection (lossless): walk down the tree; at each node try its children in rank order, accepting
      child c with probability min(1, r(c) / q_c(c)) where r is the target distribution with the mass of
      already-rejected children removed (r <- norm(max(0, r - q_c)) after each rejection) and q_c the
      distribution child c was drawn from. Medusa's top-k picks are deterministic, so q_c is a point mass
      on c: the rule accepts c with probability r(c) and, on rejection, removes c from r. When no child is
      accepted the next token is drawn from r. Output tokens are distributed exactly as the target's own
      sampling, for any proposer.
    - match (seeded rows, lossless and reproducible): the target's token after each node is sampled with the
      uniform of the output position it decides (`RowSampling.uniform_at`), and the longest path of
      candidates equal to those samples wins, as in greedy verification. For deterministic drafts it accepts
      exactly as often as rejection (a child is accepted with probability r(c) either way); the output is
      what plain decoding with the same seed writes, whatever the tree.
    - typical (Medusa's, not lossless): a candidate is accepted when the target gives it probability above
      min(epsilon, delta * exp(-H(p))); the longest such path wins; the next token is sampled from p.

    In a batch with sampled rows every row follows its own rule (`RowSampling.acceptance`); greedy rows
    there see a one-hot p on the argmax, under which every rule reduces to the greedy one.
    """

    def verify(self, logits: torch.Tensor, cand: Candidates, sampling=None, rows: slice | None = None) -> Verdict:
        """logits [n, T, V]: the target's logits at every node. Without `sampling` (the batch's
        `RowSampling`, read at `rows`; the engine passes it only when a row samples), the greedy rule."""
        if sampling is None:
            return self.greedy(logits, cand)
        return self.by_rule(sampling.probs(logits, rows), cand, sampling, rows)

    @staticmethod
    def greedy(logits: torch.Tensor, cand: Candidates) -> Verdict:
        return _matching(cand, argmax(logits))

    def by_rule(self, p: torch.Tensor, cand: Candidates, sampling, rows: slice) -> Verdict:
        """p [n, T, V]: the target's sampling distribution at every node. Each rule present runs over the
        whole batch; a row keeps its own rule's verdict (greedy rows any one's)."""
        rule_of = sampling.acceptance[rows]
        present = set(rule_of.tolist()) - {ACCEPT_GREEDY} or {ACCEPT_REJECTION}
        verdict = None
        for r, rule in ((ACCEPT_REJECTION, self._rejection), (ACCEPT_MATCH, self._match),
                        (ACCEPT_TYPICAL, self._typical)):
            if r not in present:
                continue
            v = rule(p, cand, sampling, rows)
            if verdict is not None:
                mine = rule_of == r
                v = Verdict(torch.where(mine, v.accepted, verdict.accepted),
                            torch.where(mine[:, None], v.path, verdict.path),
                            torch.where(mine, v.next_token, verdict.next_token))
            verdict = v
        return verdict

    @staticmethod
    def _match(p, cand: Candidates, sampling, rows) -> Verdict:
        n, t, v = p.shape
        u = sampling.uniform_at(rows, cand.node_depth)  # the output position each node's successor takes
        return _matching(cand, sample_from(p.reshape(n * t, v), u.reshape(-1)).view(n, t))

    @staticmethod
    def _rejection(p, cand: Candidates, sampling, rows_slice) -> Verdict:
        n = p.shape[0]
        dev = p.device
        rows = torch.arange(n, device=dev)
        depth_max, width = cand.depth_bound, cand.children.shape[2]
        tokens, proposal = cand.tokens, cand.proposal
        u = sampling.uniform(rows_slice, depth_max * width + 1)
        cur = torch.zeros(n, dtype=torch.long, device=dev)
        path = torch.zeros(n, depth_max + 1, dtype=torch.long, device=dev)
        accepted = torch.zeros(n, dtype=torch.long, device=dev)
        searching = torch.ones(n, dtype=torch.bool, device=dev)  # still walking down
        residual = p[rows, cur].clone()
        for level in range(depth_max):
            moved = torch.zeros(n, dtype=torch.bool, device=dev)
            nxt = cur.clone()
            for i in range(width):
                child = cand.children[rows, cur, i]
                trying = searching & ~moved & (child >= 0)
                if not bool(trying.any()):
                    break
                c = child.clamp(min=0)
                tok = tokens[rows, c]
                r = residual / residual.sum(-1, keepdim=True).clamp(min=1e-30)
                if proposal is None:
                    q, q_tok = None, torch.ones(n, device=dev)
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
        return Verdict(accepted, path, sample_from(residual, u[:, -1]))

    @staticmethod
    def _typical(p, cand: Candidates, sampling, rows) -> Verdict:
        n = p.shape[0]
        entropy = -(p * torch.log(p.clamp(min=1e-20))).sum(-1)  # [n, T]
        threshold = torch.minimum(sampling.epsilon[rows, None], sampling.delta[rows, None] * torch.exp(-entropy))
        # Each node's token under its parent's distribution, and whether it clears the parent's bar.
        parent_p = p.gather(1, cand.parent[:, :, None].expand_as(p))
        node_prob = parent_p.gather(-1, cand.tokens[..., None])[..., 0]  # [n, T]
        node_ok = node_prob > threshold.gather(1, cand.parent)
        accepted, path = cand.longest(cand.along_paths(node_ok, 1))
        u = sampling.uniform_at(rows, accepted)  # the output position of the token after the accepted path
        return Verdict(accepted, path, sample_from(p[torch.arange(n, device=p.device), _last(path, accepted)], u))
