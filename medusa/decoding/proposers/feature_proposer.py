"""The feature-head proposer: each engine step the head catches up on the row's newly committed positions
(their true features come from the verification pass that accepted them), then grows a dynamic tree
(`medusa.decoding.trees.dynamic_tree`) of `nodes` candidates, `depth` draft steps deep, expanding the `topk` best
frontier nodes each step. Also the tree budgets a head can fill and their expected acceptance.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from medusa.decoding.trees.dynamic_tree import DEFAULT_TOPK, NEG, Growth, Pool, TreeShape, expand, pool_size
from medusa.decoding.proposers.feature_heads import FeatureHead
from medusa.decoding.proposers.feature_runner import DraftBlock, FeatureState, HeadRunner, LayerTaps
from medusa.decoding.proposers import GrowingProposer, aux_state, catch_up, common_prefix, context, rewound
from medusa.decoding.target.transformer import Transformer, causal
from medusa.decoding.trees.tree import build_tree, expected_tau
from medusa.decoding.verifier import ACCEPT_REJECTION, sample_from
from medusa.errors import MedusaError

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch

AUX_KEY = "feature"


class FeatureProposer(GrowingProposer):
    """Drafts a dynamic tree per row with a feature head: `grow` runs the head, `draft` keeps the best nodes."""

    name = "feature"

    def __init__(self, head: FeatureHead, target: Transformer, shape: TreeShape | None = None,
                 sample_chain: bool = True, vocab: int | None = None, runner: HeadRunner | None = None):
        self.head = head
        self.target = target
        self.shape = (shape or TreeShape()).check()
        # Several proposers (tree shapes) of one head share its packed inference copy.
        self.runner = runner or HeadRunner(head, target.dtype, vocab).to(target.device)
        if self.shape.topk > self.runner.vocab:
            raise MedusaError(f"top-{self.shape.topk} expansions need more than the head's "
                              f"{self.runner.vocab} draft tokens")
        self.max_nodes, self.max_depth = self.shape.nodes + 1, self.shape.depth
        self.tree = self.shape.stand_in()
        # Rows sampled with rejection acceptance draft a chain sampled from the head's distribution and
        # hand it to the verifier (min(1, p/q) accepts more than a point mass when q is close to p).
        self.sample_chain = sample_chain
        self.taps = LayerTaps.install(target, head.config.feature_layers) if head.config.feature_layers else None

    # ---- engine protocol ------------------------------------------------------------------------
    def attach(self, batch: "Batch") -> None:
        """Create the per-row state before rows are added, so prompt features are kept at prefill."""
        self._state(batch)

    def _state(self, batch: "Batch") -> FeatureState:
        # Draft entries of any shape up to depth 8 and top-8 fit, so one state serves every planned shape.
        need = batch.cache.capacity + max(66, (self.shape.depth - 1) * self.shape.topk + self.shape.depth + 2)
        return aux_state(batch, AUX_KEY, lambda s: isinstance(s, FeatureState) and s.runner is self.runner
                         and s.cache.rows >= batch.cache.rows and s.cache.capacity >= need,
                         lambda: FeatureState(self.runner, batch.cache.rows, need, self.head.config.feature_dim,
                                              self.taps))

    @torch.inference_mode()
    def grow(self, batch: "Batch") -> Growth:
        """The step's whole pool of drafted nodes (`draft` keeps the best `nodes` of them)."""
        n = batch.n
        rows = slice(0, n)
        state = self._state(batch)
        lens = batch.cache.lens[rows]
        ctx = context(batch)
        width = ctx.shape[1]
        same = common_prefix(state.seq[rows, :width], ctx, lens + 1)
        state.seq[rows, :width] = ctx
        state.feat_len[rows] = torch.minimum(torch.minimum(state.feat_len[rows], same), lens)
        # Entry s reads x_{s+1}; at least the last committed entry is recomputed, so its output is at hand.
        state.cache.lens[rows] = torch.minimum(torch.minimum(state.cache.lens[rows], same - 1), lens - 1).clamp(min=0)
        if bool((state.feat_len[rows] < lens).any()):
            self._fill_features(batch, state, ctx, lens)
        last = self._catch_up(state, rows, ctx, lens)
        sampled = batch.sampling.acceptance[rows] == ACCEPT_REJECTION if self.sample_chain else None
        if sampled is not None and not bool(sampled.any()):
            sampled = None
        return self._grow(batch, state, rows, lens, last, sampled)

    # ---- pieces ---------------------------------------------------------------------------------
    def _fill_features(self, batch: "Batch", state: FeatureState, ctx: torch.Tensor, lens: torch.Tensor) -> None:
        """Target features of committed positions the state never saw (rows that decoded without this
        proposer, or joined before it was attached): the target's cache is rewound to them and caught up
        again over the same tokens, keeping the features."""
        n = lens.shape[0]
        rows = slice(0, n)
        r = torch.arange(n, device=lens.device)[:, None]

        def run(start: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            idx = (start[:, None] + j).clamp(max=ctx.shape[1] - 1)
            hidden = self.target(ctx.gather(1, idx), start[:, None] + j, batch.cache, rows, causal(len(j), lens.device))
            take = j[None, :] < (lens - start)[:, None]
            pos = idx.clamp(max=state.feats.shape[1] - 1)
            feats = state.features(hidden).to(state.feats.dtype)
            state.feats[r, pos] = torch.where(take[:, :, None], feats, state.feats[r, pos])
            return hidden

        with rewound(batch.cache, rows, state.feat_len[rows]):
            catch_up(batch.cache, rows, lens, None, run)
        state.feat_len[rows] = torch.maximum(state.feat_len[rows], lens)

    def _catch_up(self, state: FeatureState, rows: slice, ctx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Head entries for committed positions [cache.lens, lens): input (f_s, x_{s+1}); returns the output
        of entry lens-1 (the predicted feature of the root's position) [n, h]."""
        n = lens.shape[0]
        ar = torch.arange(n, device=lens.device)

        def run(hl: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            pos = hl[:, None] + j
            nxt = ctx.gather(1, (pos + 1).clamp(max=ctx.shape[1] - 1))
            feats = state.feats[ar[:, None], pos.clamp(max=state.feats.shape[1] - 1)]
            emb, x = self.runner.inputs(nxt, feats, fused=True)
            visible = causal(len(j), lens.device).expand(n, -1, -1)
            return self.runner(emb, x, state.cache, DraftBlock(pos, rows, 0, visible))

        last = torch.zeros(n, self.head.config.hidden_size, dtype=self.runner.dtype, device=lens.device)
        return catch_up(state.cache, rows, lens, last, run)

    def _full_probs(self, batch: "Batch", rows: slice, logits: torch.Tensor) -> torch.Tensor:
        """The row's sampling distribution over the full vocabulary from draft-vocabulary logits [n, Vd]."""
        full = torch.full((logits.shape[0], 1, self.head.config.vocab_size), NEG, device=logits.device)
        full[:, 0, self.runner.draft_ids] = logits.float()
        return batch.sampling.probs(full, rows)[:, 0]

    def _grow(self, batch: "Batch", state: FeatureState, rows: slice, lens: torch.Tensor, last: torch.Tensor,
              sampled: torch.Tensor | None) -> Growth:
        """EAGLE-2 expansion: D draft steps over the top-k frontier (`draft` keeps the N best nodes)."""
        k, depth = self.shape.topk, self.shape.depth
        n = lens.shape[0]
        dev = lens.device
        ids = self.runner.draft_ids
        pool = Pool([], [], [], [])
        logits = self.runner.logits(last)
        logp = torch.log_softmax(logits.float(), -1)
        top = logp.topk(k, -1)
        tok, score = ids[top.indices], top.values
        chain_q, chain_pool = [], []
        if sampled is not None:
            q = self._full_probs(batch, rows, logits)
            pick = sample_from(q, batch.sampling.uniform(rows, 1)[:, 0])
            tok, score = _chain_first(tok, score, pick, sampled)
            chain_q.append(q)
            chain_pool.append(torch.zeros(n, dtype=torch.long, device=dev))
        start = pool.add(tok, score, torch.full_like(tok, -1), 1)
        front_tok, front_score = tok, score
        front_pool = start + torch.arange(k, device=dev).expand(n, k)
        front_in = last[:, None, :].expand(n, k, last.shape[-1])
        vis = torch.zeros(n, k, 0, dtype=torch.bool, device=dev)  # each frontier node's ancestors' entries
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(n, k, k)
        used = 0
        longest = int(state.cache.lens[rows].max()) if depth > 1 else 0  # the same for every expansion
        for d in range(2, depth + 1):
            emb, x = self.runner.inputs(front_tok, front_in, fused=False)
            block_vis = torch.cat([vis, eye], dim=2)
            pos = (lens + d - 2)[:, None].expand(n, k)
            out = self.runner(emb, x, state.cache, DraftBlock(pos, rows, used, block_vis, longest))
            logits = self.runner.logits(out)  # [n, k, Vd]
            logp = torch.log_softmax(logits.float(), -1)
            ct, cs, slot = expand(logp, front_score, k)
            ct = ids[ct]
            parent_pool = front_pool.gather(1, slot)
            if sampled is not None:
                q = self._full_probs(batch, rows, logits[:, 0])  # the chain node is frontier slot 0
                pick = sample_from(q, batch.sampling.uniform(rows, 1)[:, 0])
                ct, cs = _chain_first(ct, cs, pick, sampled)
            start = pool.add(ct, cs, parent_pool, d)
            if sampled is not None:
                chain_q.append(q)
                chain_pool.append(torch.full((n,), start, dtype=torch.long, device=dev))
            best = cs.topk(k, -1).indices  # sorted: a sampled row's chain node stays in slot 0
            bslot = slot.gather(1, best)
            front_tok, front_score = ct.gather(1, best), cs.gather(1, best)
            front_pool = start + best
            front_in = out.gather(1, bslot[:, :, None].expand(n, k, out.shape[-1]))
            vis = block_vis.gather(1, bslot[:, :, None].expand(n, k, block_vis.shape[2]))
            used += k
        if sampled is None:
            return Growth(pool, depth)
        return Growth(pool, depth, lambda chosen, tokens: self._proposal(chosen, tokens, chain_q, chain_pool, sampled),
                      sampled)

    def _proposal(self, chosen: torch.Tensor, tokens: torch.Tensor, chain_q: list, chain_pool: list,
                  sampled: torch.Tensor) -> torch.Tensor:
        """q per kept node (pool indices `chosen`, tokens `tokens` [n, N]): the sampled chain's
        distributions on sampled rows, point masses elsewhere."""
        q = F.one_hot(tokens, self.head.config.vocab_size).float()
        cp = torch.stack(chain_pool, 1)  # [n, D]
        match = (chosen[:, :, None] == cp[:, None, :]) & sampled[:, None, None]  # [n, N, D]
        cq = torch.stack(chain_q, 1)  # [n, D, V]
        on_chain = match.any(-1)
        mixed = torch.einsum("bnd,bdv->bnv", match.float(), cq)
        return torch.where(on_chain[:, :, None], mixed, q)


def _chain_first(tok: torch.Tensor, score: torch.Tensor, pick: torch.Tensor, sampled: torch.Tensor):
    """On sampled rows, entry 0 becomes the sampled token (score 0: always kept) and the rest are dropped
    (-inf) when it descends from the chain; other rows are unchanged. Chain nodes have score 0 on every
    depth, so they are the frontier's slot 0 and a sampled row's tree is exactly the chain."""
    tok, score = tok.clone(), score.clone()
    on = sampled & (score[:, 0] > NEG)
    tok[:, 0] = torch.where(on, pick, tok[:, 0])
    score[:, 0] = torch.where(on, 0.0, score[:, 0])
    score[:, 1:] = torch.where(sampled[:, None], NEG, score[:, 1:])
    return tok, score


def shape_candidates(max_nodes: int = 64, max_depth: int = 8, topk: int = DEFAULT_TOPK) -> list[TreeShape]:
    sizes = [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64]
    out = []
    for depth in range(1, max_depth + 1):
        for n in sizes:
            if n <= max_nodes and n >= depth and pool_size(depth, topk) >= n:
                out.append(TreeShape(n, depth, min(topk, n)))
    return out


def expected_tau_dynamic(shape: TreeShape, accuracy: list[list[float]]) -> float:
    """Expected tokens per step of a `shape` tree from per-draft-step rank accuracies (eval.json), taken
    as the best static tree of that budget: a dynamic tree, chosen per row, does at least as well (on the
    shipped head's held-out texts it measured the same, within 0.01). accuracy[j][r]: the rank-r token at
    depth j + 1 is right given the path to it was accepted (`medusa.train.feature_eval.evaluate_head`
    counts it along the accepted paths); accuracies counted over every position instead (eval.json of
    heads evaluated before that) treat the depths as independent and come out lower."""
    return _expected_tau_dynamic(shape, tuple(tuple(row[: shape.topk]) for row in accuracy[: shape.depth]))


@functools.lru_cache(maxsize=4096)
def _expected_tau_dynamic(shape: TreeShape, acc: tuple[tuple[float, ...], ...]) -> float:
    # Cached: every new auto-mode planner (one per request or run) weighs the same ~100 shapes, and
    # building their trees costs more than a whole speculative step.
    if not acc:
        return 1.0
    rows = [list(r) for r in acc]
    return expected_tau(build_tree(rows, shape.nodes).nodes, rows)
