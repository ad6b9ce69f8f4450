"""Cost of one eviction at 1k, 10k and 100k cached pages (issue: eviction must be O(1) or O(log n)).

The GPU tier is filled with N committed, unused (droppable) pages of N/64 cached prompts; then one cache grows by
M blocks in one ``resize``, so each new page evicts one cached page. Two set-ups: GPU only (evicted pages are
dropped: pure bookkeeping) and GPU + host (evicted pages move down: bookkeeping plus one batched copy).
Tiny buffers keep copies cheap; the per-eviction time should stay flat as N grows.

    python tools/bench_eviction.py            # both modes, one subprocess each
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.modes import measure_in_both_modes  # noqa: E402

TPB = 16
BLOCKS_PER_PROMPT = 64
EVICTIONS = 1000


def measure(cached_pages: int, with_host: bool) -> float:
    from kv_cache_manager_v2 import (
        AttentionLayerConfig,
        BufferConfig,
        GpuCacheTierConfig,
        HostCacheTierConfig,
        KVCacheManager,
        KVCacheManagerConfig,
    )

    slot = 2 * 64
    tiers: list[GpuCacheTierConfig | HostCacheTierConfig] = [GpuCacheTierConfig(cached_pages * slot)]
    if with_host:
        tiers.append(HostCacheTierConfig((EVICTIONS + 1) * slot))
    layers = [AttentionLayerConfig(0, [BufferConfig("key", 64), BufferConfig("value", 64)])]
    manager = KVCacheManager(
        KVCacheManagerConfig(tokens_per_block=TPB, layers=layers, cache_tiers=tiers, backend="cpu", max_util_for_resume=1.0)
    )
    token = 0
    for _ in range(cached_pages // BLOCKS_PER_PROMPT):
        prompt = list(range(token, token + TPB * BLOCKS_PER_PROMPT))
        token += len(prompt)
        cache = manager.create_kv_cache(None, prompt)
        assert cache.resume() and cache.resize(len(prompt))
        cache.commit(prompt)
        cache.close()
    cache = manager.create_kv_cache()
    assert cache.resume()
    start = time.perf_counter_ns()
    assert cache.resize(EVICTIONS * TPB)
    elapsed = time.perf_counter_ns() - start
    cache.close()
    manager.shutdown()
    return elapsed / EVICTIONS / 1000.0


def child() -> dict[str, float]:
    result: dict[str, float] = {}
    for with_host in (False, True):
        for cached in (1_000, 10_000, 100_000):
            result[f"{'host' if with_host else 'drop'}/{cached}"] = min(measure(cached, with_host) for _ in range(3))
    return result


def main() -> int:
    results = measure_in_both_modes(__file__, __doc__, child)
    print(f"µs per eviction ({EVICTIONS} evictions in one resize, best of 3, one core)")
    print(f"{'set-up':>8} {'cached pages':>13} {'interpreted':>12} {'compiled':>9} {'ratio':>6}")
    for key in results["fast"]:
        setup, cached = key.split("/")
        fast, compiled = results["fast"][key], results["compiled"][key]
        print(f"{setup:>8} {int(cached):>13,} {fast:>12.2f} {compiled:>9.2f} {fast / compiled:>5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
