"""A prefix cache: the K/V of token prefixes a batch has computed, kept in fixed-size token blocks and copied
into the row of any later prompt that starts with the same tokens, so only the rest of it is prefilled.

The batch's KV cache is contiguous per row (`medusa.decoding.target.transformer.KVCache`), so blocks are copies, not
shared pages: a block holds the keys and values of `block` consecutive positions of every layer, in a pool
tensor allocated once for the memory budget. Blocks form a tree: a block's key is (its parent block, its own
tokens), so a key stands for every token before it as a hash chain does, and two prompts share exactly the
blocks of their common block-aligned prefix. A lookup walks the prompt block by block while keys match; it
never takes the prompt's last token, so the pass that prefills the rest still gives the last position's
hidden state (the first token's logits, the proposers' input).

What a hit must give besides the K/V is what a prefill of those positions leaves behind: the row's committed
tokens (`batch.seq`, which retrieval's automata and draft models read) and, with a feature head, the
target's features of every prompt position (`FeatureState`), kept per block beside the K/V. Other proposer
state is rebuilt from the tokens by the proposers themselves (a draft model's cache catches up, retrieval
feeds its automaton).

Blocks are stored from a batch (`store`): a prompt's once it is prefilled, a row's prompt and output when it
leaves the batch. Eviction is LRU over blocks that no request holds (`lookup` with a `lease` pins the blocks a
running request was served from, until `release`) and that no cached block extends (leaves first, so the
cache never keeps a block its prefix no longer reaches). When everything is held, storing stops: the cache
never evicts a block in use, and a full cache only means fewer hits.

Greedy and batch-invariant outputs do not change: a hit's K/V are the ones a prefill of the same tokens
computes (bit for bit under `--batch-invariant on`, which makes them independent of the pass that computed
them; otherwise equal up to the rounding between pass shapes, as chunked prefill is).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from medusa.errors import MedusaError

if TYPE_CHECKING:
    from medusa.decoding.batch import Batch

DEFAULT_BLOCK = 16  # tokens per block
FEATURE_KEY = "feature"  # batch.aux key of a feature head's per-row state (medusa.decoding.proposers.feature_proposer)


@dataclass
class _Block:
    slot: int  # index into the pool
    key: tuple  # (parent block's slot or -1, tokens)
    parent: _Block | None
    depth: int  # blocks before it
    children: int = 0
    pins: int = 0
    stamp: int = 0  # last use (a counter)
    features: bool = False  # the feature head's features of its positions are kept too


@dataclass
class Hit:
    """The longest cached block-aligned prefix of a prompt: `tokens` positions in `blocks` (pool slots)."""

    tokens: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class PrefixStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # lookups that found at least one block
    looked_up_tokens: int = 0  # prompt tokens of those lookups
    hit_tokens: int = 0  # prompt tokens served from the cache
    stored_blocks: int = 0
    evictions: int = 0  # blocks evicted


def block_bytes(batch: Batch, block: int) -> int:
    """Bytes one block of `block` tokens takes for this batch's model: K/V of every layer, plus the feature
    head's features when the batch keeps them."""
    data = batch.cache.data
    layers, _, _, kv_heads, _, head_dim = data.shape
    size = layers * 2 * kv_heads * block * head_dim * data.element_size()
    feats = _feature_state(batch)
    if feats is not None:
        size += block * feats.feats.shape[2] * feats.feats.element_size()
    return size


def _feature_state(batch: Batch):
    state = batch.aux.get(FEATURE_KEY)
    return state if state is not None and hasattr(state, "feats") else None


class PrefixCache:
    """Blocks of prefix K/V for batches shaped like `batch` (same model, dtype and device), within
    `budget_bytes`.

    lookup(prompt, lease) -> Hit;  restore(batch, slot, prompt, hit);  store(batch, slot, lease);  release(lease)
    """

    def __init__(self, batch: Batch, budget_bytes: int, block: int = DEFAULT_BLOCK):
        if block < 1:
            raise MedusaError(f"prefix cache block must be at least 1 token, got {block}")
        self.block = block
        self.block_bytes = block_bytes(batch, block)
        self.capacity = int(budget_bytes // self.block_bytes)
        if self.capacity < 1:
            raise MedusaError(f"a prefix cache of {budget_bytes / 2**20:.2f} MiB holds no block: one block of {block} "
                              f"tokens takes {self.block_bytes / 2**20:.2f} MiB for this model")
        data = batch.cache.data
        layers, _, _, kv_heads, _, head_dim = data.shape
        self.layout = (layers, 2, kv_heads, head_dim)
        self.dtype, self.device = data.dtype, data.device
        # Allocated once, not zeroed: on a CPU its pages become resident as blocks are first written.
        self.kv = torch.empty(self.capacity, layers, 2, kv_heads, block, head_dim, dtype=data.dtype,
                              device=data.device)
        feats = _feature_state(batch)
        self.feats = None
        if feats is not None:
            self.feats = torch.empty(self.capacity, block, feats.feats.shape[2], dtype=feats.feats.dtype,
                                     device=feats.feats.device)
        self.free = list(range(self.capacity - 1, -1, -1))
        self.index: dict[tuple, _Block] = {}
        self.blocks: dict[int, _Block] = {}  # by slot
        self.leases: dict[Hashable, list[_Block]] = {}
        self.heap: list[tuple[int, int]] = []  # (stamp, slot) of blocks that may be evictable (checked on pop)
        self.clock = itertools.count(1)
        self.stats = PrefixStats()

    # ---- sizes --------------------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return len(self.blocks)

    @property
    def used_bytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    @property
    def budget_bytes(self) -> int:
        return self.capacity * self.block_bytes

    def fits(self, batch: Batch) -> bool:
        """Whether `batch` has the layout this cache was made for."""
        data = batch.cache.data
        feats = _feature_state(batch)
        return (data.dtype == self.dtype and data.device == self.device
                and (data.shape[0], 2, data.shape[3], data.shape[5]) == self.layout
                and (feats is None) == (self.feats is None)
                and (feats is None or feats.feats.shape[2] == self.feats.shape[2]))

    # ---- lookups ------------------------------------------------------------------------------------
    def _walk(self, tokens: list[int], limit: int) -> list[_Block]:
        """The cached blocks of tokens[:limit], block by block from the first, while they match."""
        chain: list[_Block] = []
        parent = -1
        b = self.block
        for start in range(0, limit - b + 1, b):
            blk = self.index.get((parent, tuple(tokens[start: start + b])))
            if blk is None or (self.feats is not None and not blk.features):
                break
            chain.append(blk)
            parent = blk.slot
        return chain

    def peek(self, prompt: list[int]) -> int:
        """Prompt tokens a lookup would serve now (nothing is pinned or counted)."""
        return len(self._walk(prompt, len(prompt) - 1)) * self.block

    def lookup(self, prompt: list[int], lease: Hashable | None = None) -> Hit:
        """The longest cached block-aligned prefix of `prompt`, leaving at least its last token to prefill.
        With a `lease` (a request id) its blocks are pinned until `release(lease)` (a lease held already is
        released first)."""
        if lease is not None:
            self.release(lease)
        chain = self._walk(prompt, len(prompt) - 1)
        self.stats.lookups += 1
        self.stats.looked_up_tokens += len(prompt)
        if chain:
            self.stats.hits += 1
            self.stats.hit_tokens += len(chain) * self.block
        self._use(chain)
        if lease is not None and chain:
            self._pin(lease, chain)
        return Hit(len(chain) * self.block, [blk.slot for blk in chain])

    def restore(self, batch: Batch, slot: int, prompt: list[int], hit: Hit) -> None:
        """Write a hit's positions into row `slot` of `batch` as a prefill of prompt[:hit.tokens] would
        leave them: the K/V, the row's committed tokens and the feature head's features."""
        if not hit.tokens:
            return
        n = hit.tokens
        idx = torch.tensor(hit.blocks, device=self.device)
        layers, _, kv_heads, head_dim = self.layout
        kv = self.kv[idx]  # [k, L, 2, KV, B, D]
        batch.cache.data[:, :, slot, :, :n] = kv.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, kv_heads, n, head_dim)
        tokens = torch.tensor(prompt[:n], dtype=torch.long, device=batch.seq.device)
        batch.seq[slot, :n] = tokens
        state = _feature_state(batch)
        if state is not None and self.feats is not None:
            state.seq[slot, :n] = tokens.to(state.seq.device)
            state.feats[slot, :n] = self.feats[idx].reshape(n, -1).to(state.feats.device)

    # ---- storing ------------------------------------------------------------------------------------
    def store(self, batch: Batch, slot: int, lease: Hashable | None = None) -> int:
        """Keep the full blocks of row `slot`'s committed positions (its prompt, and its output so far) that
        are not cached yet, evicting unheld blocks as needed; with a `lease`, the row's blocks are pinned for
        it (a running request's). Returns the blocks newly stored."""
        length = int(batch.cache.lens[slot])
        b = self.block
        full = length // b
        if not full:
            return 0
        tokens = batch.seq[slot, : full * b].tolist()
        state = _feature_state(batch)
        with_feats = self.feats is not None and state is not None
        if self.feats is not None and state is None:
            return 0
        if with_feats:  # positions whose features the state holds for these very tokens
            valid = min(int(state.feat_len[slot]), full * b)
            if valid:
                same = state.seq[slot, :valid].to(batch.seq.device) == batch.seq[slot, :valid]
                valid = int(same.long().cumprod(0).sum())
            full = min(full, valid // b)
        chain: list[_Block] = []
        new: list[_Block] = []
        parent: _Block | None = None
        for i in range(full):
            key = (parent.slot if parent is not None else -1, tuple(tokens[i * b: (i + 1) * b]))
            blk = self.index.get(key)
            if blk is None:
                # This chain holds its blocks so far: they are pinned while more are made room for.
                slot_id = self._allocate(chain)
                if slot_id is None:
                    break
                blk = _Block(slot_id, key, parent, i, features=with_feats)
                self.index[key] = blk
                self.blocks[slot_id] = blk
                if parent is not None:
                    parent.children += 1
                new.append(blk)
            chain.append(blk)
            parent = blk
        if new:
            first = new[0].depth
            count = len(new)
            idx = torch.tensor([blk.slot for blk in new], device=self.device)
            layers, _, kv_heads, head_dim = self.layout
            src = batch.cache.data[:, :, slot, :, first * b: (first + count) * b]
            self.kv[idx] = src.reshape(layers, 2, kv_heads, count, b, head_dim).permute(3, 0, 1, 2, 4, 5)
            if with_feats:
                f = state.feats[slot, first * b: (first + count) * b]
                self.feats[idx] = f.reshape(count, b, -1).to(self.feats.device)
            self.stats.stored_blocks += count
        self._use(chain)
        if lease is not None and chain:
            held = self.leases.get(lease, [])
            if len(chain) > len(held):  # a row's chain only grows: keep the longer one pinned
                self.release(lease)
                self._pin(lease, chain)
        return len(new)

    def _allocate(self, holding: list[_Block]) -> int | None:
        """A free pool slot, evicting the least recently used unheld leaf if none is free (never one of
        `holding`, the chain being stored); None when every block is held."""
        if self.free:
            return self.free.pop()
        for blk in holding:
            blk.pins += 1
        try:
            victim = self._victim()
        finally:
            for blk in holding:
                blk.pins -= 1
                self._maybe_evictable(blk)
        if victim is None:
            return None
        self._evict(victim)
        return self.free.pop()

    def _victim(self) -> _Block | None:
        """The least recently used block that no request holds and no cached block extends. Entries of
        blocks held or extended are dropped on the way: each is pushed again when it becomes evictable."""
        while self.heap:
            stamp, slot = heapq.heappop(self.heap)
            blk = self.blocks.get(slot)
            if blk is None or blk.stamp != stamp or blk.pins or blk.children:
                continue
            return blk
        return None

    def _evict(self, blk: _Block) -> None:
        del self.index[blk.key]
        del self.blocks[blk.slot]
        self.free.append(blk.slot)
        self.stats.evictions += 1
        parent = blk.parent
        if parent is not None:
            parent.children -= 1
            self._maybe_evictable(parent)

    # ---- use, pins ----------------------------------------------------------------------------------
    def _use(self, chain: list[_Block]) -> None:
        for blk in chain:
            blk.stamp = next(self.clock)
            heapq.heappush(self.heap, (blk.stamp, blk.slot))
        if len(self.heap) > 4 * len(self.blocks) + 64:  # drop stale entries
            self.heap = [(blk.stamp, blk.slot) for blk in self.blocks.values()]
            heapq.heapify(self.heap)

    def _maybe_evictable(self, blk: _Block) -> None:
        if not blk.pins and not blk.children and self.blocks.get(blk.slot) is blk:
            heapq.heappush(self.heap, (blk.stamp, blk.slot))

    def _pin(self, lease: Hashable, chain: list[_Block]) -> None:
        for blk in chain:
            blk.pins += 1
        self.leases[lease] = list(chain)

    def release(self, lease: Hashable) -> None:
        """The request `lease` no longer holds its blocks (it ended, or never started)."""
        for blk in self.leases.pop(lease, ()):
            blk.pins -= 1
            self._maybe_evictable(blk)

    def held(self) -> set[int]:
        """Pool slots of the blocks some request holds."""
        return {blk.slot for chain in self.leases.values() for blk in chain}

    def clear(self) -> None:
        """Forget every block (leases stay empty of them)."""
        for lease in list(self.leases):
            self.release(lease)
        self.index.clear()
        self.blocks.clear()
        self.heap.clear()
        self.free = list(range(self.capacity - 1, -1, -1))
