"""Manager cost of one decode step for 256 active caches: ``resize(+1)`` and ``commit(1 token)`` each.

Each cache starts from a 1,000-token prompt (committed), then 200 decode steps run; the figure is the mean
manager time per step (and per cache-step). Configs: ``full`` (one full-attention layer) and ``hybrid``
(one full + one 1,024-token sliding-window layer). Tiny buffers: bookkeeping only.

    python tools/bench_decode.py            # both modes, one subprocess each, one core
"""

from __future__ import annotations

import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.modes import measure_in_both_modes  # noqa: E402

CACHES = 256
PROMPT = 1000
STEPS = 200
TPB = 32


def measure(config_name: str) -> float:
    from kv_cache_manager_v2 import (
        AttentionLayerConfig,
        BufferConfig,
        GpuCacheTierConfig,
        KVCacheManager,
        KVCacheManagerConfig,
    )

    buffers = [BufferConfig("key", 64), BufferConfig("value", 64)]
    layers = [AttentionLayerConfig(0, buffers)]
    if config_name == "hybrid":
        layers.append(AttentionLayerConfig(1, list(buffers), sliding_window_size=1024))
    blocks = CACHES * ((PROMPT + STEPS) // TPB + 2)
    manager = KVCacheManager(
        KVCacheManagerConfig(
            tokens_per_block=TPB,
            layers=layers,
            cache_tiers=[GpuCacheTierConfig(blocks * 128 * len(layers) * 2)],
            backend="cpu",
        )
    )
    caches = []
    for index in range(CACHES):
        prompt = list(range(index * 10_000, index * 10_000 + PROMPT))
        cache = manager.create_kv_cache(None, prompt)
        assert cache.resume() and cache.resize(PROMPT)
        cache.commit(prompt)
        caches.append(cache)
    gc.collect()
    elapsed = 0
    for step in range(STEPS):
        start = time.perf_counter_ns()
        for index, cache in enumerate(caches):
            length = PROMPT + step + 1
            if not cache.resize(length):
                raise RuntimeError("out of memory")
            cache.commit([index * 10_000 + length])
        elapsed += time.perf_counter_ns() - start
    for cache in caches:
        cache.close()
    manager.shutdown()
    return elapsed / STEPS / 1000.0


def child() -> dict[str, float]:
    return {name: measure(name) for name in ("full", "hybrid")}


def main() -> int:
    results = measure_in_both_modes(__file__, __doc__, child)
    print(f"decode step of {CACHES} active caches (resize +1, commit 1 token each), mean of {STEPS} steps, one core")
    print(f"{'config':>7} {'interpreted µs/step':>20} {'compiled µs/step':>17} {'µs/cache (compiled)':>20} {'ratio':>6}")
    for name in results["fast"]:
        fast, compiled = results["fast"][name], results["compiled"][name]
        print(f"{name:>7} {fast:>20.0f} {compiled:>17.0f} {compiled / CACHES:>20.2f} {fast / compiled:>5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
