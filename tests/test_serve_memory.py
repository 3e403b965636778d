"""Memory given back after load: the allocator's free pages are returned when the engine goes idle after
work, and /metrics says what the server holds (RSS, the KV cache budget, what the last trim gave back)."""

from __future__ import annotations

import ctypes

import httpx
import pytest

from test_serve import _metric, _wait, serve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_free_heap_pages_pinned_by_a_live_block_are_given_back():
    """The retention itself: blocks freed below one still in use stay resident (glibc trims only the top
    of a heap) until malloc_trim hands them back."""
    from medusa.serve.memory import MALLOC_TRIM, MemoryGauges, resident_bytes
    from prometheus_client import CollectorRegistry

    if MALLOC_TRIM is None:
        pytest.skip("not glibc: no malloc_trim")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(3200)]  # 200 MB of blocks under the mmap threshold
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    for b in blocks[:-1]:
        libc.free(b)
    held = resident_bytes()
    gauges = MemoryGauges(CollectorRegistry(), 0)
    freed = gauges.trim()
    libc.free(blocks[-1])
    assert freed > 150 * 2**20, (held, freed)
    assert gauges.trimmed._value.get() == freed


def test_idle_after_load_trims_and_metrics_say_what_is_held(rt):
    with serve(rt, policy={"mode": "plain"}, max_batch=4, max_context=256) as url:
        text = httpx.get(url + "/metrics", timeout=10).text
        layers, kv_heads, head_dim = rt.model.config.num_hidden_layers, rt.model.config.num_key_value_heads, \
            rt.model.config.hidden_size // rt.model.config.num_attention_heads
        kv = _metric(text, "medusa_memory_kv_cache_bytes")
        assert kv >= layers * 2 * 4 * kv_heads * 256 * head_dim * 4 and _metric(text, "medusa_memory_resident_bytes") > 0
        trims = lambda: _metric(httpx.get(url + "/metrics", timeout=10).text, "medusa_memory_trims_total")  # noqa: E731
        assert _wait(lambda: trims() >= 1, 60)  # idle after start-up (loading, calibration)
        before = trims()
        for n in (1, 3):
            r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "word " * 100,
                                                           "max_tokens": 4, "n": n, "temperature": 0.5}, timeout=60)
            assert r.status_code == 200
        assert _wait(lambda: trims() >= before + 1, 60)  # once idle after the work


def test_a_cap_on_the_kernel_caches_bounds_what_new_shapes_hold():
    """Every matrix shape a packed layer meets keeps a compiled kernel in oneDNN's caches; capped
    (`--kernel-cache-entries`), a fresh process that meets 150 shapes holds far less once free memory is
    given back than one with the library's default caps."""
    import sys
    from pathlib import Path

    import torch

    from medusa.decoding.target.kernels import packing_available

    if not packing_available(torch.zeros(2, 2)):
        pytest.skip("no oneDNN weight packing on this machine: layers use F.linear, which keeps no kernel per shape")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from kernel_cache_memory import measure

    default, capped = (measure(cap, 576, 1536, 150) for cap in ("default", "8"))
    assert capped["caps"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 8, "LRU_CACHE_CAPACITY": 8}
    assert default["after_trim_mb"] > 20, default  # the growth being bounded is there to see
    assert capped["after_trim_mb"] < default["after_trim_mb"] / 3, (capped, default)


def test_a_kernel_cache_cap_set_in_the_environment_wins(monkeypatch):
    from medusa.decoding.target.hardware import KERNEL_CACHE_DEFAULT, limit_kernel_caches

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "100")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert limit_kernel_caches(None) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": KERNEL_CACHE_DEFAULT,
                                         "LRU_CACHE_CAPACITY": 100}
    assert limit_kernel_caches(64) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 64, "LRU_CACHE_CAPACITY": 100}
