"""``KVCacheManager.prefetch_remote`` (issue #38): a request waiting for admission has its prefix fetched from the
shared remote tier (the in-memory store) ahead of ``create_kv_cache``, which then finds it locally and asks the
store for nothing; the fill keeps its blocks while evicting for their slots, and bad input changes nothing."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, RemoteCacheTierConfig
from kv_cache_manager_v2._remote.statistics import RemoteTierStatistics
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.helpers import attention, make_config

TPB = 16


def manager_over(store: MemoryStoreConfig | None, gpu_slots: int) -> KVCacheManager:
    tiers = [GpuCacheTierConfig(gpu_slots * 1024)]
    if store is None:
        return KVCacheManager(make_config([attention(0, 512)], tiers=tiers, tokens_per_block=TPB))
    remote = RemoteCacheTierConfig(0, store, namespace="prefetch")
    return KVCacheManager(make_config([attention(0, 512)], tiers=[*tiers, remote], tokens_per_block=TPB))


def tokens_of(seed: int, length: int) -> list[int]:
    return [seed * 100_000 + i for i in range(length)]


def written(store: MemoryStoreConfig, tokens: list[int]) -> None:
    """Another instance computes ``tokens`` and commits them: their full blocks go to the store."""
    writer = manager_over(store, 16)
    engine = FakeEngine(writer)
    cache = writer.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens)
    cache.close()
    writer.shutdown()


def remote_stats(manager: KVCacheManager) -> RemoteTierStatistics:
    stats = manager.get_remote_tier_statistics()
    assert stats is not None
    return stats


def test_a_prefetched_prefix_is_found_locally_at_admission_with_its_content() -> None:
    store = MemoryStoreConfig()
    prompt = tokens_of(1, 3 * TPB + 5)
    written(store, prompt)
    manager = manager_over(store, 8)
    assert manager.probe_reuse(None, prompt) == 0
    assert manager.prefetch_remote(None, prompt) == 3 * TPB
    manager.check_invariants()
    fetched = remote_stats(manager).fetched_pages
    assert fetched == 3 and manager.probe_reuse(None, prompt) == 3 * TPB
    cache = manager.create_kv_cache(None, prompt)
    assert cache.num_committed_tokens == 3 * TPB
    assert remote_stats(manager).fetched_pages == fetched  # nothing more asked of the store
    assert cache.resume()
    FakeEngine(manager).check(cache, prompt)  # the other instance's K/V, byte for byte
    cache.close()
    assert manager.prefetch_remote(None, prompt) == 3 * TPB  # held locally now: no second fetch
    assert remote_stats(manager).fetched_pages == fetched
    manager.shutdown()


def test_prefetch_keeps_a_running_cache_and_makes_room_by_eviction() -> None:
    store = MemoryStoreConfig()
    prompt = tokens_of(2, 2 * TPB)
    written(store, prompt)
    manager = manager_over(store, 4)
    engine = FakeEngine(manager)
    running_tokens = tokens_of(3, 2 * TPB)
    running = manager.create_kv_cache(None, [])
    assert running.resume() and running.resize(len(running_tokens))  # 2 of 4 slots locked
    engine.step(running, running_tokens)
    other_tokens = tokens_of(4, 2 * TPB)
    other = manager.create_kv_cache(None, [])
    assert other.resume() and other.resize(len(other_tokens))
    engine.step(other, other_tokens)
    other.commit(other_tokens)
    other.close()  # 2 reusable pages: the GPU tier is full
    slots = running.get_base_page_indices(0)
    assert manager.probe_reuse(None, other_tokens) == 2 * TPB
    assert manager.prefetch_remote(None, prompt) == 2 * TPB
    assert manager.probe_reuse(None, other_tokens) == 0  # its reusable pages made room
    manager.check_invariants()
    assert running.get_base_page_indices(0) == slots
    engine.check(running, running_tokens)
    running.close()
    cache = manager.create_kv_cache(None, prompt)
    assert cache.num_committed_tokens == 2 * TPB and cache.resume()
    engine.check(cache, prompt)
    cache.close()
    manager.shutdown()


def test_without_a_remote_tier_it_only_probes_and_bad_input_changes_nothing() -> None:
    manager = manager_over(None, 8)
    assert manager.prefetch_remote(None, tokens_of(5, 3 * TPB)) == 0
    assert manager.prefetch_remote() == 0
    store = MemoryStoreConfig()
    written(store, tokens_of(6, 2 * TPB))
    remote = manager_over(store, 8)
    with pytest.raises(TypeError, match="reuse_scope|ReuseScope"):
        remote.prefetch_remote("scope", tokens_of(6, 2 * TPB))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input_tokens"):
        remote.prefetch_remote(None, [1.5, 2.5])  # type: ignore[list-item]
    assert remote_stats(remote).fetched_pages == 0 and remote.probe_reuse(None, tokens_of(6, 2 * TPB)) == 0
    manager.shutdown()
    remote.shutdown()
