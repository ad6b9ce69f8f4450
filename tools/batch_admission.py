"""Batched two-phase admission vs one-by-one admission on a shared-prefix workload (SPEC §6).

Rounds of 8 requests arrive together; each request starts with one of 12 cached prefixes (4-8 blocks, most of
them pushed to the host tier by earlier rounds) and adds its own tokens. Admitted requests run a few decode
steps, commit, and close. The same seeded rounds run through ``create_kv_cache_batch`` and through
create/resume/resize one request at a time; the table compares pages onboarded, offloaded and copied, and
requests and tokens admitted.

    python tools/batch_admission.py [--rounds 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kv_cache_manager_v2 import (  # noqa: E402
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRequest,
    _KVCache,
)

TPB = 32
SLOT_BYTES = 2 * 4096


def run(batch: bool, rounds: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    layers = [AttentionLayerConfig(0, [BufferConfig("key", 4096), BufferConfig("value", 4096)])]
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        layers=layers,
        cache_tiers=[GpuCacheTierConfig(96 * SLOT_BYTES), HostCacheTierConfig(64 * SLOT_BYTES)],
        backend="cpu",
        max_util_for_resume=1.0,
    )
    manager = KVCacheManager(config)
    prefixes = [[rng.randrange(1, 10**6) for _ in range(rng.randrange(4, 9) * TPB)] for _ in range(12)]
    for prefix in prefixes:
        cache = manager.create_kv_cache(None, prefix)
        assert cache.resume() and cache.resize(len(prefix))
        cache.commit(prefix)
        cache.close()
    admitted = 0
    reused = 0
    refused = 0
    for _ in range(rounds):
        prompts = [rng.choice(prefixes) + [rng.randrange(1, 10**6) for _ in range(rng.randrange(8, 80))] for _ in range(8)]
        caches: list[_KVCache | None]
        if batch:
            caches = manager.create_kv_cache_batch([KVCacheRequest(prompt) for prompt in prompts])
        else:
            caches = []
            for prompt in prompts:
                created = manager.create_kv_cache(None, prompt)
                if created.resume() and created.resize(len(prompt)):
                    caches.append(created)
                else:
                    created.close()
                    caches.append(None)
        for maybe, prompt in zip(caches, prompts):
            if maybe is None:
                refused += 1
                continue
            admitted += 1
            reused += maybe.num_committed_tokens
            maybe.commit(prompt[maybe.num_committed_tokens :])
        for maybe in caches:
            if maybe is not None:
                maybe.close()
    counters = manager.movement_counters
    manager.shutdown()
    return {
        "admitted": admitted,
        "refused": refused,
        "reused_tokens": reused,
        "onboarded_pages": counters.onboarded_pages,
        "offloaded_pages": counters.offloaded_pages,
        "copied_pages": counters.copied_pages,
        "dropped_pages": counters.dropped_pages,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batch = run(True, args.rounds, args.seed)
    single = run(False, args.rounds, args.seed)
    print(f"{args.rounds} rounds of 8 requests, GPU 96 slots, host 64 slots, 12 shared prefixes of 4-8 blocks")
    print(f"{'':>16} {'batch':>10} {'one by one':>11}")
    for key in batch:
        print(f"{key:>16} {batch[key]:>10} {single[key]:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
