"""``KVCache.prefetch`` / ``offload`` (issue #38): placement hints for a suspended cache. By default they move pages
into free slots only (nothing evicted, nothing lost, locked pages stay); ``prefetch(evict=True)`` makes room as
``resume`` would, within the admission watermark. The content survives (FakeEngine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_cache_manager_v2 import CacheLevel, DiskCacheTierConfig, GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config, ssm

TPB = 32
SLOT_BYTES = 16 * KIB  # one layer's 8 KiB K + 8 KiB V


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def small(gpu_slots: int = 10, host_slots: int = 20) -> KVCacheManager:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_slots * SLOT_BYTES), HostCacheTierConfig(host_slots * SLOT_BYTES)]
    return KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))


def computed(manager: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> _KVCache:
    """A suspended cache whose ``tokens`` were computed (written by the engine) but not committed: private pages."""
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.suspend()
    return cache


def held(manager: KVCacheManager) -> tuple[int, int]:
    gpu, host = manager.get_usage()
    return gpu.held, host.held


def test_offload_then_prefetch_moves_pages_and_resume_finds_them_on_the_gpu() -> None:
    manager = small()
    engine = FakeEngine(manager)
    tokens = tokens_of(1, 4 * TPB)
    cache = computed(manager, engine, tokens)
    assert held(manager) == (4, 0)
    before = manager.movement_counters
    assert cache.offload() == 4
    assert held(manager) == (0, 4)
    after_offload = manager.movement_counters
    assert after_offload.offloaded_pages - before.offloaded_pages == 4
    assert cache.offload() == 0  # nothing left on the GPU
    assert cache.prefetch() == 4
    assert held(manager) == (4, 0)
    after_prefetch = manager.movement_counters
    assert after_prefetch.onboarded_pages - after_offload.onboarded_pages == 4
    stats = manager.get_and_reset_iteration_stats()
    assert sum(delta.iter_onboard_blocks for delta in stats.values()) == 4
    assert cache.resume()
    assert manager.movement_counters.onboarded_pages == after_prefetch.onboarded_pages  # already there
    engine.check(cache, tokens)
    cache.close()


def test_prefetch_uses_free_gpu_slots_only_and_never_evicts_a_running_cache() -> None:
    manager = small(gpu_slots=6)
    engine = FakeEngine(manager)
    waiting_tokens = tokens_of(2, 4 * TPB)
    waiting = computed(manager, engine, waiting_tokens)
    assert waiting.offload() == 4
    running_tokens = tokens_of(3, 4 * TPB)
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(len(running_tokens))  # 4 of 6 GPU slots locked
    engine.step(running, running_tokens)
    assert waiting.prefetch() == 2  # the two free slots, nothing evicted
    gpu, host = manager.get_usage()
    assert (gpu.used, gpu.held, gpu.free, host.held) == (4, 2, 0, 2)
    engine.check(running, running_tokens)
    running.close()
    assert waiting.prefetch() == 2
    assert waiting.resume()
    engine.check(waiting, waiting_tokens)
    waiting.close()


def test_hybrid_cache_round_trips_its_ssm_state() -> None:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(4096 * KIB), HostCacheTierConfig(8192 * KIB)]
    manager = KVCacheManager(make_config([ssm(0), attention(1, 2 * KIB), ssm(2)], tiers=tiers))
    engine = FakeEngine(manager)
    tokens = tokens_of(4, 3 * TPB)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens)
    cache.suspend()
    moved = cache.offload()
    assert moved >= 4  # three attention blocks and the live SSM state
    assert all(usage.held == 0 for usage in manager.get_usage() if usage.level == 0)
    assert cache.prefetch() == moved
    assert cache.resume()
    engine.check(cache, tokens)  # the SSM live state too
    cache.close()


def test_active_and_closed_caches_are_refused_changing_nothing() -> None:
    manager = small()
    engine = FakeEngine(manager)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(2 * TPB)
    engine.step(cache, tokens_of(5, 2 * TPB))
    counters = repr(manager.movement_counters)
    for hint in (cache.prefetch, cache.offload):
        with pytest.raises(ValueError, match=r"KVCache\.(prefetch|offload) needs a suspended cache"):
            hint()
    assert repr(manager.movement_counters) == counters and cache.is_active
    cache.close()
    for hint in (cache.prefetch, cache.offload):
        with pytest.raises(ValueError, match="closed"):
            hint()


def pressed(gpu_slots: int = 8, admission_watermark: float = 0.0) -> KVCacheManager:
    """A manager whose GPU tier fills up; ``max_util_for_resume`` 1.0, so budgets are whole tiers."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_slots * SLOT_BYTES), HostCacheTierConfig(40 * SLOT_BYTES)]
    config = make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=1.0,
                         admission_watermark=admission_watermark)
    return KVCacheManager(config)


def reusable(manager: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> None:
    """Committed blocks left in the GPU tier by a closed cache: reusable, droppable."""
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens)
    cache.close()


def test_evicting_prefetch_makes_room_so_resume_moves_nothing() -> None:
    manager = pressed()
    engine = FakeEngine(manager)
    waiting_tokens, other_tokens = tokens_of(6, 4 * TPB), tokens_of(7, 4 * TPB)
    waiting = computed(manager, engine, waiting_tokens)
    assert waiting.offload() == 4
    other = computed(manager, engine, other_tokens)  # suspended: its 4 pages held on the GPU
    reusable(manager, engine, tokens_of(8, 4 * TPB))  # 4 reusable pages: the GPU tier is full
    assert waiting.prefetch() == 0  # no free slot
    manager.check_invariants()
    assert waiting.prefetch(evict=True) == 4
    manager.check_invariants()
    gpu, host = manager.get_usage()
    assert (gpu.used, gpu.free, gpu.held + gpu.reusable) == (0, 0, 8)  # 4 of the other pages went to the host
    assert host.held + host.reusable == 4
    onboarded = manager.movement_counters.onboarded_pages
    assert waiting.resume()
    assert manager.movement_counters.onboarded_pages == onboarded  # resume found every page on the GPU
    engine.check(waiting, waiting_tokens)
    waiting.close()
    assert other.resume()  # whatever was sent down to make room comes back intact
    engine.check(other, other_tokens)
    other.close()
    manager.check_invariants()


def test_evicting_prefetch_never_moves_an_active_caches_pages() -> None:
    manager = pressed()
    engine = FakeEngine(manager)
    waiting_tokens, running_tokens = tokens_of(9, 4 * TPB), tokens_of(10, 6 * TPB)
    waiting = computed(manager, engine, waiting_tokens)
    assert waiting.offload() == 4
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(len(running_tokens))  # 6 of 8 GPU slots locked
    engine.step(running, running_tokens)
    slots = running.get_base_page_indices(0)
    assert waiting.prefetch(evict=True) == 2  # the rest is locked by a running cache
    assert running.get_base_page_indices(0) == slots
    engine.check(running, running_tokens)
    manager.check_invariants()
    running.close()
    assert waiting.resume()
    engine.check(waiting, waiting_tokens)
    waiting.close()


def test_evicting_prefetch_stops_at_the_admission_watermark() -> None:
    manager = pressed(gpu_slots=10, admission_watermark=0.5)  # resume may lock at most 5 of 10 pages
    engine = FakeEngine(manager)
    waiting_tokens, running_tokens = tokens_of(11, 4 * TPB), tokens_of(12, 3 * TPB)
    waiting = computed(manager, engine, waiting_tokens)
    assert waiting.offload() == 4
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(len(running_tokens))  # 3 locked
    engine.step(running, running_tokens)
    assert waiting.prefetch(evict=True) == 2  # 3 + 2 = 5: what resume could lock, though 7 slots are free
    manager.check_invariants()
    assert waiting.prefetch(evict=True) == 0
    running.close()
    assert waiting.prefetch(evict=True) == 2
    assert waiting.resume()
    engine.check(waiting, waiting_tokens)
    waiting.close()


def test_evicting_prefetch_refuses_a_non_bool_changing_nothing() -> None:
    manager = pressed()
    engine = FakeEngine(manager)
    cache = computed(manager, engine, tokens_of(13, 2 * TPB))
    assert cache.offload() == 2
    counters = repr(manager.movement_counters)
    with pytest.raises(TypeError, match="bool"):
        cache.prefetch(evict=1)  # type: ignore[call-overload]
    assert repr(manager.movement_counters) == counters
    cache.close()


def test_prefetch_to_a_level_moves_colder_pages_up_to_it_and_says_whether_all_arrived(tmp_path: Path) -> None:
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(10 * SLOT_BYTES),
        HostCacheTierConfig(4 * SLOT_BYTES),
        DiskCacheTierConfig(20 * SLOT_BYTES, str(tmp_path)),
    ]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    engine = FakeEngine(manager)
    first_tokens, second_tokens = tokens_of(21, 4 * TPB), tokens_of(22, 4 * TPB)
    first = computed(manager, engine, first_tokens)
    second = computed(manager, engine, second_tokens)
    assert first.offload() == 4 and second.offload() == 4  # the host takes the first cache's, the disk the second's
    assert [usage.held for usage in manager.get_usage()] == [0, 4, 4]
    assert second.prefetch(1) is False  # the host is full: nothing evicted, nothing moved
    assert [usage.held for usage in manager.get_usage()] == [0, 4, 4]
    assert first.prefetch() == 4
    assert second.prefetch(1) is True
    assert [usage.held for usage in manager.get_usage()] == [4, 4, 0]
    assert second.prefetch(CacheLevel(1)) is True  # nothing colder left
    assert second.resume()
    engine.check(second, second_tokens)
    second.close()
    first.close()


def test_prefetch_to_a_level_refuses_bad_targets_changing_nothing() -> None:
    manager = small()
    engine = FakeEngine(manager)
    cache = computed(manager, engine, tokens_of(23, 2 * TPB))
    assert cache.offload() == 2
    counters = repr(manager.movement_counters)
    with pytest.raises(ValueError, match="target must be a cache level in \\[0, 2\\), got 2"):
        cache.prefetch(2)
    with pytest.raises(ValueError, match="evict=True makes room on the GPU only"):
        cache.prefetch(1, evict=True)
    with pytest.raises(TypeError, match="target must be an integer, got bool"):
        cache.prefetch(True)  # the evict flag is keyword-only: a positional bool is not a level
    assert repr(manager.movement_counters) == counters
    assert cache.prefetch(0, evict=True) is True  # target 0 is the GPU: evicting allowed
    cache.close()


def test_prefetch_to_a_level_answering_false_says_why() -> None:
    """A False from ``prefetch(level)`` is a soft refusal like ``resume``'s: ``last_refusal`` names the tier and
    pool group, the pages left colder, the free (or, evicting, available) ones there, and whether they could fit."""
    manager = pressed()
    engine = FakeEngine(manager)
    waiting = computed(manager, engine, tokens_of(31, 4 * TPB))
    assert waiting.offload() == 4
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(8 * TPB)  # every GPU slot locked
    assert waiting.prefetch(0) is False
    refusal = waiting.last_refusal
    assert refusal is not None and manager.last_refusal == refusal
    assert (refusal.call, refusal.level, refusal.pool_group) == ("KVCache.prefetch", 0, 0)
    assert (refusal.pages_needed, refusal.pages_available, refusal.pages_total) == (4, 0, 8)
    assert refusal.fits_empty_manager and "free slots only" in refusal.detail and "evict=True" in refusal.detail
    assert waiting.prefetch(0, evict=True) is False  # a running cache's pages never leave
    evicting = waiting.last_refusal
    assert evicting is not None and evicting != refusal and evicting.pages_needed == 4
    assert "max_util_for_resume" in evicting.detail
    running.close()
    assert waiting.prefetch(0) is True and waiting.last_refusal == evicting  # kept until the next refusal
    waiting.close()
