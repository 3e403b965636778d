"""Feature heads at inference (`medusa.decoding.proposers.feature_heads`): the proposer and what it runs.

Each engine step the head catches up on the row's newly committed positions (their true features come from
the verification pass that accepted them), then grows a dynamic tree (`medusa.decoding.trees.dynamic_tree`) of
`nodes` candidates, `depth` draft steps deep, expanding the `topk` best frontier nodes each step. The head runs
as `HeadRunner`, its packed copy in the target's dtype: the target's own layer architecture through
`medusa.decoding.target.transformer`'s fused, packed layer code and attention, over its own per-row KV cache
(`FeatureState`, kept beside a batch); its vocabulary projection reads only the draft vocabulary (`draft_ids`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from medusa.decoding.proposers import GrowingProposer, RowState, aux_state, catch_up, common_prefix, context, rewound
from medusa.decoding.proposers.feature_heads import FeatureHead
from medusa.decoding.target.kernels import LayerInputs, packed_linear, pass_mask, rows_linear, short_block_bias
from medusa.decoding.target.taps import LayerTaps
from medusa.decoding.target.transformer import (SHORT_BLOCK, DecoderLayer, KVCache, RMSNorm, RotaryTable, Transformer,
                                                attention_dtype, cache_dtype, causal)
from medusa.decoding.trees.dynamic_tree import NEG, Growth, Pool, TreeShape, expand
from medusa.decoding.verifier import ACCEPT_REJECTION, Verdict, sample_from
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


class _HeadLayer(DecoderLayer):
    """`medusa.decoding.target.transformer.DecoderLayer` (fused, packed projections, the shared attention) with the
    head's
    inputs: eagle1 attends over x itself (no input norm); eagle3 over [norm(emb), norm(x)], residual x."""

    def __init__(self, head: FeatureHead, head_dim: int):
        super().__init__(head.layer, head_dim)
        self.hnorm = RMSNorm(head.hidden_norm) if head.hidden_norm is not None else None

    def forward(self, emb: torch.Tensor, x: torch.Tensor, at: LayerInputs, kv: torch.Tensor) -> torch.Tensor:
        """DecoderLayer.forward with the head's embeddings `emb` beside x."""
        a_in = x if self.hnorm is None else torch.cat([self.ln1.forward(emb), self.hnorm.forward(x)], -1)
        return self.block(a_in, x, at, kv)


@dataclass
class DraftBlock:
    """Where one pass of a feature head writes its t entries per row, and what they see (`HeadRunner`).

    positions: [B, t] long, each entry's position in its sequence
    rows:      slice, the cache rows the B rows are
    used:      int, draft entries already written past each row's committed length (cache.lens); this
               block goes after them
    visible:   [B, t, used + t] bool, which of those draft entries and of this block each entry sees (every
               committed entry is seen)
    longest:   max(cache.lens[rows]) when the caller knows it (a draft's passes share it; reading it from
               the device each pass would wait for the device), else None
    """

    positions: torch.Tensor
    rows: slice
    used: int
    visible: torch.Tensor
    longest: int | None = None


class HeadRunner(nn.Module):
    """The head's inference copy in the target's dtype: packed weights, a pass over a ragged cache."""

    def __init__(self, head: FeatureHead, dtype: torch.dtype, vocab: int | None = None):
        super().__init__()
        original, embed, borrowed = head, head.embed, head._target
        original._target = []  # the target is borrowed: never copied
        try:
            head = copy.deepcopy(original).to(dtype)
        finally:
            original._target = borrowed
        cfg = head.layer_config
        self.config = head.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer = _HeadLayer(head, self.head_dim)
        self.fc = packed_linear(head.fc.requires_grad_(False))
        lm = head.lm_head.requires_grad_(False)
        ids = head.draft_ids
        if vocab is not None and vocab < len(ids):  # the first `vocab` draft ids (trained heads: most frequent)
            lm = rows_linear(head.lm_head.weight, slice(0, vocab), dtype)
            ids = ids[:vocab]
        self.lm_head = packed_linear(lm)
        self.norm = RMSNorm(head.norm) if head.norm is not None else None
        self.rotary = head.rotary
        self.rope = RotaryTable(self.rotary)
        self._embed = [embed]
        self.register_buffer("draft_ids", ids.clone(), persistent=False)
        self.vocab = len(ids)
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.draft_ids.device

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        kv_dtype = cache_dtype(self.device.type, self.dtype, rows)
        return KVCache(1, rows, self.n_kv, capacity, self.head_dim, kv_dtype, self.device)

    def inputs(self, tokens: torch.Tensor, feats: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding of tokens, the layer's residual input) for tokens [B, T], feats [B, T, F or h]."""
        emb = self._embed[0](tokens).to(self.dtype)
        if self.config.style == "eagle1":
            return emb, self.fc.forward(torch.cat([emb, feats.to(self.dtype)], -1))
        return emb, self.fc.forward(feats.to(self.dtype)) if fused else feats

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(out if self.norm is None else self.norm.forward(out))

    def forward(self, emb: torch.Tensor, x: torch.Tensor, cache: KVCache, block: DraftBlock) -> torch.Tensor:
        """One pass over emb, x [B, t, h] (`inputs`) written into `cache` where `block` says -> [B, t, h]."""
        positions, rows, used = block.positions, block.rows, block.used
        b, t = positions.shape
        hl = cache.lens[rows]
        span = used + t
        window = (int(hl.max()) if block.longest is None else block.longest) + span
        if window > cache.capacity:
            raise MedusaError(f"feature head cache of {cache.capacity} entries is too small for {window}")
        mask = pass_mask(hl, block.visible, window, window - span if b == 1 else None)
        bias = None
        if t <= SHORT_BLOCK:
            bias = short_block_bias(mask, self.n_kv, self.n_heads // self.n_kv,
                                    attention_dtype(x.device.type, self.dtype, cache.data.dtype, b * t))
        slots = window - span + used if b == 1 else hl[:, None] + used + torch.arange(t, device=x.device)
        at = LayerInputs(self.rope(x, positions, cache.capacity), cache.data[:, :, rows, :, :window],
                         torch.arange(b, device=x.device)[:, None], slots, mask, bias)
        return self.layer.forward(emb, x, at, at.kv[0])


class FeatureState(RowState):
    """Per-row state beside a batch: the head's cache, the target features of committed positions and the
    tokens both were computed from (`seq[r, s]` = x_s; the pending root included)."""

    def __init__(self, runner: HeadRunner, rows: int, capacity: int, feature_dim: int, taps: "LayerTaps | None" = None):
        self.runner = runner
        self.taps = taps  # fused multi-layer features: read from taps on the target's layers
        dev = runner.device
        self.cache = runner.new_cache(rows, capacity)
        self.seq = torch.full((rows, capacity), -1, dtype=torch.long, device=dev)
        self.feats = torch.zeros(rows, capacity, feature_dim, dtype=runner.dtype, device=dev)
        self.feat_len = torch.zeros(rows, dtype=torch.long, device=dev)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        self.cache.move_rows(src, dst)
        if src:
            s, d = torch.tensor(src, device=self.seq.device), torch.tensor(dst, device=self.seq.device)
            self.seq[d] = self.seq[s]
            self.feats[d] = self.feats[s]
            self.feat_len[d] = self.feat_len[s]

    def prefilled(self, rows: slice, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor,
                  start: int = 0) -> None:
        """The engine's prefill of new rows (or a chunk of one): keep their prompt features (so no second
        pass is needed)."""
        end = start + tokens.shape[1]
        self.seq[rows, start:end] = tokens
        self.feats[rows, start:end] = self.features(hidden).to(self.feats.dtype)
        self.feat_len[rows] = start + lengths
        self.cache.lens[rows] = 0

    def committed(self, lens: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor, verdict: Verdict) -> None:
        """An engine step over rows [0, n) at lengths `lens` [n] (speculative or plain, any proposer): keep
        the true features of the positions it commits (the accepted path, root first), so speculation that
        resumes after plain steps needs no second target pass. Rows whose features already lag keep lagging
        (the proposer refills them)."""
        n = hidden.shape[0]
        rows = torch.arange(n, device=hidden.device)[:, None]
        j = torch.arange(verdict.path.shape[1], device=hidden.device)
        keep = j[None, :] <= verdict.accepted[:, None]
        pos = (lens[:, None] + j).clamp(max=self.feats.shape[1] - 1)
        feats = self.features(hidden)[rows, verdict.path].to(self.feats.dtype)
        self.feats[rows, pos] = torch.where(keep[:, :, None], feats, self.feats[rows, pos])
        self.seq[rows, pos] = torch.where(keep, tokens.gather(1, verdict.path), self.seq[rows, pos])
        self.feat_len[:n] = torch.where(self.feat_len[:n] >= lens, lens + verdict.accepted + 1, self.feat_len[:n])

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input features of the target pass that just ran (its final hidden states `hidden`)."""
        return hidden if self.taps is None else self.taps.features(hidden)
