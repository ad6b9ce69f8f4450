"""Peak GPU slots of one prefill with and without SWA scratch reuse (SPEC §3; issue: scratch table).

32 sliding-window layers (K and V per layer), tokens_per_block 32, one request on an empty manager, prefilled
either in one chunk or in 2,048-token chunks (each chunk committed before the next). The peak is the largest
``unavailable`` count of the GPU tier (slots locked by the request; committed out-of-window pages stay cached
but evictable, so they do not count) seen after any ``resize``. For one chunk from an empty manager this equals
``total - free`` (the headline's measure). Slot counts do not depend on buffer sizes, so tiny buffers keep the
run light.

    python tools/scratch_table.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kv_cache_manager_v2 import (  # noqa: E402
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)

TPB = 32
LAYERS = 32
BUFFER_BYTES = 256


def peak_slots(prompt: int, window: int, chunk: int, scratch: bool) -> int:
    layers = [
        AttentionLayerConfig(i, [BufferConfig("key", BUFFER_BYTES), BufferConfig("value", BUFFER_BYTES)], window)
        for i in range(LAYERS)
    ]
    slot_bytes = 2 * LAYERS * BUFFER_BYTES
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        layers=layers,
        cache_tiers=[GpuCacheTierConfig((prompt // TPB + 64) * slot_bytes)],
        backend="cpu",
        enable_swa_scratch_reuse=scratch,
    )
    manager = KVCacheManager(config)
    cache = manager.create_kv_cache()
    assert cache.resume()
    peak = 0
    position = 0
    while position < prompt:
        end = min(prompt, position + chunk)
        if not cache.resize(end, position):
            raise RuntimeError(f"out of slots at {end}")
        stats = manager.get_storage_statistics(0)[0]
        peak = max(peak, stats.unavailable)
        cache.commit(list(range(position, end)))
        position = end
    cache.close()
    manager.shutdown()
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for prompt in (1024, 8192, 32768):
        for window in (128, 1024):
            for chunk_name, chunk in (("one chunk", prompt), ("2,048-token chunks", 2048)):
                without = peak_slots(prompt, window, chunk, scratch=False)
                with_scratch = peak_slots(prompt, window, chunk, scratch=True)
                rows.append((prompt, window, chunk_name, without, with_scratch))
    if args.json:
        keys = ("prompt", "window", "chunking", "peak_slots_without_scratch", "peak_slots_with_scratch")
        print(json.dumps([dict(zip(keys, row)) for row in rows], indent=2))
        return 0
    print(f"{LAYERS} SWA layers, tokens_per_block {TPB}: peak GPU slots of one prefill")
    print(f"{'prompt':>7} {'window':>7} {'chunking':>20} {'no scratch':>11} {'scratch':>8} {'saved':>7}")
    for prompt, window, chunk_name, without, with_scratch in rows:
        saved = 1 - with_scratch / without
        print(f"{prompt:>7} {window:>7} {chunk_name:>20} {without:>11} {with_scratch:>8} {saved:>7.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
