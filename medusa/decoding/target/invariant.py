"""Batch-invariant attention: a query's output bits depend only on its own keys, never on the pass around it.

A row decoded alone, inside a batch, as one node of a candidate tree or as one token of a prompt chunk sees
the same keys (its committed prefix, then its own path); only the shape of the pass differs. CPU kernels
round differently for different shapes: an fp32 matmul's dot products change with the number of query rows
below 16, and a reduction over more than a few hundred keys is split into blocks whose partial sums are
added in an order that depends on the length. In bf16 the next rounding of the hidden state turns such a
last-bit difference into a visible one, and greedy decoding then parts from plain decoding at near-ties.

This attention keeps every reduction in a fixed order (`probe` checks that the machine's kernels give it):

- scores: fp32 matmuls with keys along the rows and at least MIN_ROWS query columns (padded with zeros),
  where each score is the same chain of multiply-adds over the head dimension whatever the shape (narrower
  products take other kernels: below 12 columns on AMD Zen 4);
- softmax: the exact row maximum, then exp elementwise;
- values: keys are summed in groups of GROUP *canonical* positions: a committed key's own position, a tree
  node's the position it will have once accepted (its row's length plus its depth). Within a group the
  weighted sum is one chain of multiply-adds, which keys the query does not see (weight 0) leave unchanged,
  so a node's ancestors, stored among their siblings, add up exactly as they do in a row of their own. The
  normaliser is the same chain over ones. The groups' sums are then added in order by one more chain.

The linear layers need one thing more: oneDNN's bf16 kernels give a row the same bits in a matmul of any
number of rows up to about 130, but above that (a batched prefill) they may split a long reduction
(1,536 inputs here) into blocks in an order that depends on the number of rows. With invariance on, every
projection runs at most ROW_BLOCK rows per matmul (`medusa.decoding.target.kernels.Linear.row_block`), and
never one row alone: some CPUs (AMD Zen 4) give a one-row product a matrix-vector kernel that rounds a long
reduction otherwise, so a lone row runs as two copies of itself.

Committed keys and prompt chunks sit at their canonical positions already: their groups are the cache's own
blocks of GROUP slots, read in place. Only a tree's nodes can sit in a later block than their group (a node
is stored at its index, which can exceed its depth); the two blocks around each row's length are then
summed again from the right keys (`Tail`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MIN_ROWS = 16  # fp32 matmuls with fewer rows take other kernels, with other rounding
GROUP = 64  # canonical positions per group of keys; cache windows are read in whole groups
ROW_BLOCK = 64  # rows per matmul of an invariant pass's projections (the kernels split long reductions above ~130)


@dataclass
class Tail:
    """The keys of the two groups at each row's length in a tree pass: the committed ones of its block,
    then the nodes of each group, in node order (tree order, so each path runs by depth).

    index:  [B, 2 * (GROUP + T)] window slots of group 0 then group 1 (GROUP + T entries each)
    weight: [B, 1, 1, 2 * (GROUP + T)] 1 where the slot belongs to the group, else 0
    block:  [B] the cache block of the row's length (group 0); group 1 is the next block
    """

    index: torch.Tensor
    weight: torch.Tensor
    block: torch.Tensor


@dataclass
class InvariantPlan:
    """What every layer's attention needs for one pass, built once (`plan`).

    bias: [B, 1, W, M] additive mask (0 or -inf), keys by the M = g x T query rows of each KV group (g query
          heads x T tokens); W a multiple of GROUP
    tail: the tree's regrouped keys, None when every key already sits in its group (no tree)
    """

    bias: torch.Tensor
    tail: Tail | None


def window(needed: int, capacity: int) -> int:
    """The cache window a pass reads: whole groups, within the cache."""
    return min(capacity, -(-needed // GROUP) * GROUP)


def plan(lens: torch.Tensor, mask: torch.Tensor, visible: torch.Tensor, heads_per_kv: int) -> InvariantPlan:
    """The plan of a pass whose T-token block starts at each row's `lens` [B]; `mask` [B, 1, T, W] is its
    attention mask (`pass_mask`), `visible` [T, T] or [B, T, T] which block entries each token sees."""
    b, _, t, w = mask.shape
    dev = lens.device
    seen = mask[:, :, None].expand(b, 1, heads_per_kv, t, w).reshape(b, 1, heads_per_kv * t, w)
    bias = torch.zeros(b, 1, w, heads_per_kv * t, device=dev).masked_fill_(~seen.transpose(2, 3), float("-inf"))
    vis = visible if visible.dim() == 3 else visible.expand(b, t, t)
    depth = vis.sum(-1) - 1  # [B, T]: a tree node's depth (a chunk token's offset)
    if bool((depth == torch.arange(t, device=dev)).all()):
        return InvariantPlan(bias, None)  # a chain or chunk: every slot is its canonical position
    block = lens // GROUP
    committed = block[:, None] * GROUP + torch.arange(GROUP, device=dev)  # [B, GROUP]
    nodes = lens[:, None] + torch.arange(t, device=dev)  # [B, T] node slots
    group = (lens[:, None] + depth) // GROUP - block[:, None]  # [B, T]: 0 or 1
    index = torch.cat([committed, nodes, committed, nodes], 1)
    weight = torch.cat([committed < lens[:, None], group == 0, torch.zeros_like(committed, dtype=torch.bool),
                        group == 1], 1)
    index = torch.where(weight, index, 0).clamp(max=w - 1)
    return InvariantPlan(bias, Tail(index, weight.float()[:, None, :, None], block))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: InvariantPlan, scale: float) -> torch.Tensor:
    """q [B, T, H, D] over the window k/v [B, KV, W, D] -> [B, T, H*D] in q's dtype, computed in fp32.

    Keys run along the rows of every matmul (W >= GROUP rows), queries along its columns: each score and
    each group's sum is then the same chain whatever the number of queries. A row of ones below the values
    gives the softmax's normaliser from the same chains."""
    b, t, h, d = q.shape
    kvh, w = k.shape[1], k.shape[2]
    g, nb = h // kvh, w // GROUP
    m = g * t
    mp = max(m, MIN_ROWS)  # query columns, padded: narrower products take other kernels (below 12 on AMD Zen 4)
    qt = q.float().reshape(b, t, kvh, g, d).permute(0, 2, 4, 3, 1).reshape(b, kvh, d, m) * scale
    s = torch.matmul(k.float(), F.pad(qt, (0, mp - m))) + F.pad(p.bias, (0, mp - m))  # [B, KV, W, Mp]
    e = (s - s.amax(2, keepdim=True)).exp_()
    vo = torch.ones(b, kvh, w, d + 1, device=q.device)
    vo[..., :d] = v  # [B, KV, W, D + 1]: values, then a one
    part = torch.matmul(vo.view(b, kvh, nb, GROUP, d + 1).transpose(-1, -2), e.view(b, kvh, nb, GROUP, mp))
    if p.tail is not None:  # part [B, KV, nb, D + 1, Mp]: each group's sums, one chain apiece
        tail_sums(e, vo, p.tail, part)
    chain = torch.ones(MIN_ROWS, nb, device=q.device)
    total = torch.matmul(chain, part.view(b, kvh, nb, (d + 1) * mp))[:, :, 0].view(b, kvh, d + 1, mp)[..., :m]
    o = total[:, :, :d] / total[:, :, d:]  # groups added in order, then normalised
    return o.view(b, kvh, d, g, t).permute(0, 4, 1, 3, 2).reshape(b, t, h * d).to(q.dtype)


def tail_sums(e: torch.Tensor, vo: torch.Tensor, tail: Tail, part: torch.Tensor) -> None:
    """Replace the sums of the two groups at each row's length (in `part` [B, KV, nb, D + 1, M]) by the
    sums over the keys that belong to them; `vo` [B, KV, W, D + 1] are the values and ones."""
    b, kvh, _, m = e.shape
    d1, nb, n = vo.shape[-1], part.shape[2], tail.index.shape[1]
    idx = tail.index[:, None, :, None]
    et = e.gather(2, idx.expand(b, kvh, n, m)) * tail.weight
    vals = vo.gather(2, idx.expand(b, kvh, n, d1)).view(b, kvh, 2, n // 2, d1)
    sums = torch.matmul(vals.transpose(-1, -2), et.view(b, kvh, 2, n // 2, m))
    r = torch.arange(b, device=e.device)
    nxt = tail.block + 1 < nb  # group 1 lies in the window (else it is empty)
    part[r[nxt], :, tail.block[nxt] + 1] = sums[nxt, :, 1]
    part[r, :, tail.block] = sums[:, :, 0]


@functools.lru_cache(maxsize=8)
def probe(device: str, dtype: torch.dtype) -> str | None:
    """Whether this machine's kernels give the fixed order the guarantee rests on (None), or why not: bf16
    projections of one row alone and among others (37 rows of 96 inputs; 133 rows of 1,536 inputs, a model's MLP
    down-projection, in blocks of ROW_BLOCK), and this attention for one query alone, in a batch and as a
    tree node whose ancestors straddle a group, must give the same bits."""
    from medusa.decoding.target.kernels import packed_linear, pass_mask
    from medusa.decoding.target.transformer import causal

    if torch.device(device).type != "cpu":
        return f"batch-invariant attention is measured on CPUs only, not on {device}"
    gen = torch.Generator().manual_seed(0)
    for n_in, n_out, rows in ((96, 80, 37), (1536, 576, 2 * ROW_BLOCK + 5)):  # a short reduction; a long one
        lin = torch.nn.Linear(n_in, n_out, bias=False).to(dtype)
        lin.weight.data = torch.randn(n_out, n_in, generator=gen).to(dtype)
        x = torch.randn(rows, 1, n_in, generator=gen).to(dtype)
        proj = packed_linear(lin)
        proj.row_block = ROW_BLOCK
        if not torch.equal(torch.cat([proj(r[None]) for r in x]), proj(x.view(1, rows, n_in)).view(rows, 1, -1)):
            return f"this CPU's {dtype} matrix products round a row differently beside other rows"
    kvh, g, d, lens = 1, 2, 16, [62, 9, 120]
    w = window(max(lens) + 6, 1 << 30)
    k = torch.randn(3, kvh, w, d, generator=gen)
    v = torch.randn(3, kvh, w, d, generator=gen)
    q = torch.randn(3, 6, kvh * g, d, generator=gen)  # fp32 outputs: no rounding to hide a difference
    # Row 0 as a chain of 3 at length 62 (slots 62-64), alone and among other rows; then as a tree whose
    # node 3 has the chain's last token's query and path (root, node 2 at slot 64, itself at slot 65), its
    # depth-1 ancestor crossing into the next group of slots.
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 1]], dtype=torch.bool)
    kt, vt, qt = k.clone(), v.clone(), q.clone()
    kt[0, :, 63], vt[0, :, 63] = torch.randn(kvh, d, generator=gen), torch.randn(kvh, d, generator=gen)
    kt[0, :, 64:66], vt[0, :, 64:66], qt[0, 3] = k[0, :, 63:65], v[0, :, 63:65], q[0, 2]
    outs = []
    for rows, vis, kk, vv, qq, node in ((1, causal(3, "cpu"), k, v, q, 2), (3, causal(3, "cpu"), k, v, q, 2),
                                        (3, tree, kt, vt, qt, 3)):
        lz = torch.tensor(lens[:rows])
        t = vis.shape[0]
        o = attention(qq[:rows, :t], kk[:rows], vv[:rows], plan(lz, pass_mask(lz, vis, w), vis, g), 0.25)
        outs.append(o[0, node])
    return None if all(torch.equal(outs[0], o) for o in outs[1:]) else (
        "this CPU's fp32 matrix products do not keep the order batch-invariant attention needs")
