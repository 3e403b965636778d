"""The server's prefix cache (`medusa.decoding.prefix_cache`): which prompts it serves, what it keeps, its
memory budget and its metrics.

A queued request's cost at admission is the part of its prompt the cache does not hold (`cost`). When it is
admitted, its prompt is looked up (the blocks served are held for it until it leaves the batch), the hit is
copied into its row, and the engine prefills the rest (`Engine.add(..., start=)`, `Engine.begin(...,
start=)`). What the batch computes is kept through the batch's `retain` hook: a prompt's blocks once it is
prefilled (held for its request, so a request's own blocks are never evicted while it runs), its prompt and
output when its row leaves. A failure inside the cache never fails a request: a lookup that cannot be
restored is a miss, a store that raises keeps nothing; both are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import torch

from medusa.decoding.batch import Batch
from medusa.decoding.prefix_cache import DEFAULT_BLOCK, Hit, PrefixCache
from medusa.decoding.target.transformer import Transformer, cache_dtype
from medusa.errors import MedusaError
from medusa.serve.metrics import Metrics
from medusa.serve.request import Request

log = logging.getLogger("medusa.serve.prefix")
DEFAULT_SHARE = 0.10  # of the memory available at start-up, by default
DEFAULT_MAX_BYTES = 2 << 30  # and at most this much
MISS = Hit()


def available_bytes(device) -> int | None:
    """Memory available for new allocations on `device` (a CUDA device's free memory, else the host's
    MemAvailable); None when it cannot be read."""
    if getattr(device, "type", str(device)) == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001 (no reading: the caller falls back)
            return None
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def kv_block_bytes(model: Transformer, rows: int, block: int) -> int:
    """Bytes of the K/V of `block` tokens in a batch of `rows` rows of `model` (a feature head adds a little)."""
    dtype = cache_dtype(model.device.type, model.dtype, rows)
    size = torch.empty(0, dtype=dtype).element_size()
    return len(model.layers) * 2 * model.n_kv * block * model.head_dim * size


def default_budget(device) -> int:
    """min(10% of the memory available now, 2 GiB); 256 MiB when nothing can be read."""
    free = available_bytes(device)
    if free is None:
        return 256 << 20
    return int(min(DEFAULT_SHARE * free, DEFAULT_MAX_BYTES))


class ServedPrefixes:
    """The prefix cache of one scheduler's batches. `budget_bytes` None: the default from free memory."""

    def __init__(self, metrics: Metrics, budget_bytes: int | None = None, block: int = DEFAULT_BLOCK,
                 model: Transformer | None = None, rows: int = 1):
        """`model` and `rows` (the batch's): a given budget is checked against the size of one block now,
        so a budget too small for any is refused at start-up, naming the flag."""
        self.metrics = metrics
        self.budget_bytes, self.block = budget_bytes, block
        self.cache: PrefixCache | None = None
        self._seen = (0, 0, 0, 0, 0)  # stats already counted into the metrics
        if model is not None and budget_bytes is not None:
            need = kv_block_bytes(model, rows, block)
            if budget_bytes < need:
                raise MedusaError(f"--prefix-cache-mb (prefix_cache_mb): {budget_bytes / 2**20:g} MiB holds no block "
                                  f"of {block} tokens, which takes {need / 2**20:.3g} MiB for this model; give at "
                                  "least that, or --prefix-cache off")

    def attach(self, batch: Batch) -> None:
        """Serve `batch` (made at start-up, and again after a failed step reset the batch): the cache is
        made for the first one and kept while batches keep its layout."""
        if self.cache is None or not self.cache.fits(batch):
            budget = self.budget_bytes if self.budget_bytes is not None else default_budget(batch.cache.data.device)
            try:
                self.cache = PrefixCache(batch, budget, self.block)
            except MedusaError as exc:
                raise MedusaError(f"--prefix-cache-mb (prefix_cache_mb): {exc}") from None
            log.info("prefix cache: %.0f MiB, %d blocks of %d tokens (%.2f MiB each)%s",
                     self.cache.budget_bytes / 2**20, self.cache.capacity, self.block,
                     self.cache.block_bytes / 2**20, ", with the feature head's features"
                     if self.cache.feats is not None else "")
            self.metrics.prefix_capacity.set(self.cache.budget_bytes)
        batch.retain = self._retain

    # ---- admission ---------------------------------------------------------------------------------
    def cost(self, req: Request) -> int:
        """Prompt tokens a prefill of `req` would run now."""
        return len(req.prompt) - self.cache.peek(req.prompt)

    def lookup(self, req: Request) -> Hit:
        """The cached prefix of `req`'s prompt, held for it until it leaves the batch."""
        try:
            return self.cache.lookup(req.prompt, lease=req.id)
        except Exception:  # the cache never fails a request
            log.warning("prefix cache lookup failed for request %s; prefilling it whole", req.tag, exc_info=True)
            self.cache.release(req.id)
            return MISS

    def restore(self, batch: Batch, slot: int, req: Request, hit: Hit) -> int:
        """Copy the hit into row `slot`: the prompt positions the engine need not prefill (0 on failure)."""
        req.cached_tokens = 0
        if not hit.tokens:
            return 0
        try:
            self.cache.restore(batch, slot, req.prompt, hit)
        except Exception:  # a prefill from position 0 overwrites what was half copied
            log.warning("prefix cache restore failed for request %s; prefilling it whole", req.tag, exc_info=True)
            self.cache.release(req.id)
            return 0
        req.cached_tokens = hit.tokens
        return hit.tokens

    # ---- what the batch computed -------------------------------------------------------------------
    def _retain(self, batch: Batch, slots: list[int], ids: list[Hashable], leaving: bool) -> None:
        for slot, rid in zip(slots, ids):
            try:
                self.cache.store(batch, slot, lease=None if leaving else rid)
            except Exception:
                log.warning("prefix cache could not keep request %s's blocks", rid, exc_info=True)
            if leaving:
                self.cache.release(rid)

    def sweep(self, alive: set[Hashable]) -> None:
        """Release the blocks of requests that left without leaving the batch through `remove` (refused,
        cancelled while prefilled in chunks, failed with the batch)."""
        for lease in [lease for lease in self.cache.leases if lease not in alive]:
            self.cache.release(lease)

    def update_metrics(self) -> None:
        s = self.cache.stats
        now = (s.lookups, s.hits, s.hit_tokens, s.looked_up_tokens, s.evictions)
        seen = self._seen
        m = self.metrics
        if now != seen:
            m.prefix_lookups.inc(now[0] - seen[0])
            m.prefix_hits.inc(now[1] - seen[1])
            m.prefix_cached_tokens.inc(now[2] - seen[2])
            m.vllm_prefix_queries.inc(now[3] - seen[3])
            m.vllm_prefix_hits.inc(now[2] - seen[2])
            m.prefix_evictions.inc(now[4] - seen[4])
            m.prefix_hit_rate.set(s.hits / s.lookups if s.lookups else 0.0)
            self._seen = now
        m.prefix_bytes.set(self.cache.used_bytes)
        m.prefix_blocks.set(self.cache.used_blocks)
        m.prefix_held.set(len(self.cache.held()))


def parse_megabytes(value) -> int | None:
    """A `prefix_cache_mb` value as bytes (None: the default)."""
    if value is None:
        return None
    return int(float(value) * 2**20)

