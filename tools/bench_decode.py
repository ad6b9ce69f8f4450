"""Manager cost of one decode step for 256 active caches: ``resize(+1)`` and ``commit(1 token)`` each.

Each cache starts from a 1,000-token prompt (committed), then 200 decode steps run; the figures are the mean
manager time per step, per cache-step, and per cache-step split into steps that stay inside the last block (31 of
32: the O(1) path, issue #21's ≤ 1.0 µs goal) and steps whose new token opens a block. Configs: ``full`` (one
full-attention layer) and ``hybrid`` (one full + one 1,024-token sliding-window layer; its window also moves a
block out once per 32 steps). Tiny buffers: bookkeeping only.

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


def measure(config_name: str) -> dict[str, float]:
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
    inside = opening = 0  # ns of steps that stay inside the last block / that open a block
    opening_steps = 0
    for step in range(STEPS):
        length = PROMPT + step + 1
        start = time.perf_counter_ns()
        for index, cache in enumerate(caches):
            if not cache.resize(length):
                raise RuntimeError("out of memory")
            cache.commit([index * 10_000 + length])
        elapsed = time.perf_counter_ns() - start
        if (length - 1) % TPB == 0:
            opening += elapsed
            opening_steps += 1
        else:
            inside += elapsed
    for cache in caches:
        cache.close()
    manager.shutdown()
    return {
        "step_us": (inside + opening) / STEPS / 1000.0,
        "inside_us": inside / (STEPS - opening_steps) / CACHES / 1000.0,
        "opening_us": opening / opening_steps / CACHES / 1000.0,
    }


def child() -> dict[str, float]:
    return {f"{name} {key}": value for name in ("full", "hybrid") for key, value in measure(name).items()}


def main() -> int:
    results = measure_in_both_modes(__file__, __doc__, child)
    fast, compiled = results["fast"], results["compiled"]
    print(f"decode step of {CACHES} active caches (resize +1, commit 1 token each), mean of {STEPS} steps, one core")
    print(f"{'config':>7} {'mode':>12} {'µs/step':>9} {'µs/cache-step':>14} {'inside a block':>15} {'opening a block':>16}")
    for name in ("full", "hybrid"):
        for mode, values in (("interpreted", fast), ("compiled", compiled)):
            step = values[f"{name} step_us"]
            print(f"{name:>7} {mode:>12} {step:>9.0f} {step / CACHES:>14.2f} {values[f'{name} inside_us']:>15.2f} "
                  f"{values[f'{name} opening_us']:>16.2f}")
        print(f"{name:>7} {'ratio':>12} {fast[f'{name} step_us'] / compiled[f'{name} step_us']:>8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
