"""Following a refusal's explanation works: over seeded workloads (full attention on one or two pool groups, GPU
only, GPU + host, GPU + host + disk, priorities), at every refused growth of an active cache, ``pages_needed -
pages_available`` is exactly the shortfall: asking for that many pages fewer fits, one page more than that still
does not (a refused call changes nothing, so both can be asked of the same state). With several pool groups the
refusal names the first one short; the smaller request then fits or is refused for another one.

The figures are also those ``get_storage_statistics`` and ``get_usage`` read at that moment, and the refusal is
the call's own (``tests/fuzz/checks.check_refusal``; the stateful fuzzer checks every refusal of every config so).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
)
from kv_cache_manager_v2.config import CacheTierConfig
from tests.fuzz.checks import check_refusal
from tests.helpers import KIB, attention, make_config

TPB = 16
SLOT = 2 * KIB  # one layer of K and V of 1 KiB per block
PROMPTS = [[(seed * 7919 + position * 31) % 1000 for position in range(8 * TPB)] for seed in range(3)]


def config_for(shape: str, directory: Path) -> KVCacheManagerConfig:
    layers = [attention(0, KIB)]
    if shape == "two_pool_groups":
        layers.append(attention(1, 3 * KIB))  # another slot size: its own pool group
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(24 * SLOT * (1 if len(layers) == 1 else 4))]
    if shape in ("host", "host_disk"):
        tiers.append(HostCacheTierConfig(6 * SLOT))
    if shape == "host_disk":
        tiers.append(DiskCacheTierConfig(5 * SLOT, str(directory)))
    return make_config(layers, tiers=tiers, tokens_per_block=TPB, max_util_for_resume=1.0)


def _priority(block_ordinal: int, _: object) -> int:
    return (block_ordinal * 37) % 101


def check_following_the_refusal(manager: KVCacheManager, cache: KVCache, capacity: int) -> int:
    """``cache.resize(capacity)`` was just refused: check its figures and that they are the exact shortfall.
    Returns the shortfall in pages."""
    refusal = check_refusal(manager, None, "KVCache.resize", cache)
    # Whether waiting can help is what can_fit says of the same step on an empty manager.
    assert refusal.fits_empty_manager == manager.can_fit(capacity, capacity - cache.history_length), refusal
    if not refusal.fits_empty_manager:
        return 0
    missing = refusal.pages_needed - refusal.pages_available
    pages_per_block = 1  # one full-attention layer group per pool group
    current_blocks = -(-cache.capacity // TPB)
    asked_blocks = -(-capacity // TPB) - current_blocks
    assert 0 < missing <= asked_blocks * pages_per_block, (refusal, capacity, cache.capacity)
    fewer = (current_blocks + asked_blocks - missing) * TPB
    if missing > 1 or fewer >= cache.capacity:
        one_more = min(capacity, fewer + 1)
        if one_more > cache.capacity and one_more > fewer:
            assert not cache.resize(one_more, cache.history_length), ("one page more than the shortfall fitted", refusal)
            assert manager.last_refusal is not None and manager.last_refusal.pool_group == refusal.pool_group
    if fewer > cache.capacity and not cache.resize(fewer, cache.history_length):
        other = manager.last_refusal
        assert other is not None and other.pool_group != refusal.pool_group, ("the shortfall was not enough", refusal, other)
    return missing


@pytest.mark.parametrize("shape", ["gpu", "host", "host_disk", "two_pool_groups"])
def test_a_refusals_shortfall_is_exact_over_seeded_workloads(shape: str, tmp_path: Path) -> None:
    refusals = 0
    for seed in range(6):
        rng = random.Random(seed)
        manager = KVCacheManager(config_for(shape, tmp_path))
        active: list[KVCache] = []
        suspended: list[KVCache] = []
        for _ in range(120):
            kind = rng.randrange(6)
            if kind == 0 and len(active) + len(suspended) < 8:
                prompt = PROMPTS[rng.randrange(len(PROMPTS))][: rng.randrange(1, 8) * TPB]
                callback = _priority if rng.randrange(2) else None
                cache = manager.create_kv_cache(None, prompt, custom_priority_callback=callback)
                if cache.resume():
                    active.append(cache)
                else:
                    check_refusal(manager, None, "KVCache.resume", cache)
                    cache.close()
            elif kind in (1, 2) and active:
                cache = active[rng.randrange(len(active))]
                capacity = cache.capacity + rng.randrange(1, 12) * TPB
                if not cache.resize(capacity, cache.history_length):
                    refusals += check_following_the_refusal(manager, cache, capacity) > 0
            elif kind == 3 and active:
                cache = active.pop(rng.randrange(len(active)))
                cache.suspend()
                suspended.append(cache)
            elif kind == 4 and suspended:
                cache = suspended[rng.randrange(len(suspended))]
                if cache.resume():
                    suspended.remove(cache)
                    active.append(cache)
                else:
                    check_refusal(manager, None, "KVCache.resume", cache)
            elif kind == 5 and active + suspended:
                everyone = active + suspended
                cache = everyone[rng.randrange(len(everyone))]
                (active if cache in active else suspended).remove(cache)
                cache.close()
            manager.check_invariants()
        for cache in active + suspended:
            cache.close()
        manager.shutdown()
    assert refusals >= 5, refusals  # the workload does reach the limits


def test_a_refused_resume_fits_once_exactly_the_missing_pages_are_given_back(tmp_path: Path) -> None:
    """A suspended cache whose pages went to the host tier, a GPU tier full of active caches: each refused resume
    says how many pages are missing, closing that many one-page caches makes it fit, and no fewer."""
    manager = KVCacheManager(config_for("host", tmp_path))
    suspended = manager.create_kv_cache()
    assert suspended.resume() and suspended.resize(4 * TPB)
    suspended.suspend()
    assert suspended.offload() == 4
    active = []
    while True:
        cache = manager.create_kv_cache()
        if not (cache.resume() and cache.resize(TPB)):
            cache.close()
            break
        active.append(cache)
    missing = None
    while not suspended.resume():
        refusal = check_refusal(manager, None, "KVCache.resume", suspended)
        now = refusal.pages_needed - refusal.pages_available
        assert refusal.fits_empty_manager and (missing is None or now == missing - 1), (refusal, missing)
        missing = now
        active.pop().close()
    assert missing == 1  # the last close was exactly the one missing page
    for cache in [suspended, *active]:
        cache.close()
    manager.shutdown()
