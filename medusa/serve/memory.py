"""What the server's resident memory holds, and giving back what load left behind.

The budget: the model's weights, the batch's KV cache (`layers x 2 x max_batch x kv_heads x capacity x
head_dim` elements, allocated zeroed, so resident, at start), and the allocator's free memory. A step's
temporaries (attention scores of long prompts, trees, logits of wide batches) come from glibc's malloc,
which keeps freed blocks in per-thread arenas for reuse and returns them to the system only from the top
of a heap: after a burst of mixed shapes RSS stayed near its peak while idle. When the engine has been
idle for `RELEASE_AFTER_S` after work, `malloc_trim(0)` hands the free pages of every arena back.

/metrics: `medusa_memory_resident_bytes` (process RSS), `medusa_memory_kv_cache_bytes` (the KV budget),
`medusa_memory_trims_total` and `medusa_memory_trimmed_bytes` (RSS given back by the last trim).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from prometheus_client import Counter, Gauge

log = logging.getLogger("medusa.serve.scheduler")
RELEASE_AFTER_S = 1.0  # idle this long after work: free memory goes back to the system
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


MALLOC_TRIM = _libc_trim()


def resident_bytes() -> int:
    """This process's RSS (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


class MemoryGauges:
    """The memory series of a server's registry; `trim` gives free allocator memory back."""

    def __init__(self, registry, kv_cache_bytes: int):
        self.resident = Gauge("medusa_memory_resident_bytes", "Resident memory of the server process (RSS)",
                              registry=registry)
        self.resident.set_function(resident_bytes)
        self.kv = Gauge("medusa_memory_kv_cache_bytes", "The batch's KV cache: max_batch rows x the context, "
                        "every layer (allocated at start)", registry=registry)
        self.kv.set(kv_cache_bytes)
        self.trims = Counter("medusa_memory_trims", "Times free allocator memory was given back after load",
                             registry=registry)
        self.trimmed = Gauge("medusa_memory_trimmed_bytes", "RSS given back by the last trim", registry=registry)

    def trim(self) -> int:
        """malloc_trim(0): every arena's free pages back to the system; the RSS it gave back."""
        if MALLOC_TRIM is None:
            return 0
        before = resident_bytes()
        MALLOC_TRIM(0)
        freed = max(before - resident_bytes(), 0)
        self.trims.inc()
        self.trimmed.set(freed)
        log.debug("idle after load: gave %.1f MB of free allocator memory back", freed / 2**20)
        return freed
