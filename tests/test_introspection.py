"""``_introspection``: the read-only looks TensorRT-LLM's tests take inside a manager, answered from live state."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2 import _introspection
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, MIB, attention, compute_prompt, make_config, ssm

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def hybrid_manager() -> KVCacheManager:
    layers: list[LayerConfig] = [ssm(0), attention(1, 2 * KIB, window=64), attention(2, 4 * KIB)]
    return KVCacheManager(make_config(layers, ssm_reuse_interval=TPB))


def test_life_cycle_ids_follow_the_layer_kinds() -> None:
    manager = hybrid_manager()
    kinds = {lc: manager.get_layer_group_id(layer) for layer, lc in [(0, 0), (1, 1), (2, 2)]}
    assert _introspection.ssm_life_cycle_id(manager) == kinds[0]
    assert _introspection.swa_life_cycle_ids(manager) == [kinds[1]]
    assert _introspection.attention_life_cycle_ids(manager) == sorted([kinds[1], kinds[2]])
    plain = KVCacheManager(make_config([attention(0)]))
    assert _introspection.ssm_life_cycle_id(plain) is None
    assert _introspection.swa_life_cycle_ids(plain) == []


def test_gpu_ratio_and_utilization_reflect_the_pools() -> None:
    manager = hybrid_manager()
    ratio = _introspection.current_gpu_ratio(manager)
    assert len(ratio) == manager.num_pool_groups
    assert sum(ratio) == pytest.approx(1.0)
    assert _introspection.storage_utilization(manager) == [0.0] * manager.num_pool_groups
    engine = FakeEngine(manager)
    compute_prompt(manager, engine, tokens_of(1, 3 * TPB))
    used = _introspection.storage_utilization(manager)
    stats = _introspection.storage_statistics(manager)
    assert used == [(s.total - s.free) / s.total for s in stats]
    assert all(u > 0 for u in used)
    indices = _introspection.life_cycle_pool_group_indices(manager)
    assert indices == [manager.get_pool_group_index(lc) for lc in range(manager.num_layer_groups)]


def test_active_page_stats_follow_suspend_and_eviction() -> None:
    manager = KVCacheManager(
        make_config([attention(0, 4 * KIB)], tiers=[GpuCacheTierConfig(4 * MIB), HostCacheTierConfig(16 * MIB)])
    )
    engine = FakeEngine(manager)
    cache = compute_prompt(manager, engine, tokens_of(2, 4 * TPB))
    counts, evictable = _introspection.active_page_stats(cache)
    assert counts == [4, 0] and evictable == [0, 0]  # locked while active
    cache.suspend()
    counts, evictable = _introspection.active_page_stats(cache)
    assert counts == [4, 0] and evictable == [4, 0]  # held: may go to the host
    cache.close()


def test_commit_state_and_linked_pages() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    engine = FakeEngine(manager)
    tokens = tokens_of(3, 2 * TPB + 5)
    cache = compute_prompt(manager, engine, tokens)
    assert _introspection.is_commit_allowed(cache)
    assert _introspection.committed_page_is_linked(cache, 0, 0) is True
    assert _introspection.committed_page_is_linked(cache, 2, 0) is None  # the partial block is not committed
    assert _introspection.committed_page_is_linked(cache, 9, 0) is None
    assert not _introspection.all_tree_pages_droppable(manager)
    cache.stop_committing()
    assert not _introspection.is_commit_allowed(cache)
    cache.close()
    assert _introspection.all_tree_pages_droppable(manager)


def test_reuse_match_pages_reports_slots_and_partial_blocks() -> None:
    manager = KVCacheManager(make_config([attention(0)], enable_partial_reuse=True))
    engine = FakeEngine(manager)
    tokens = tokens_of(4, 3 * TPB)
    compute_prompt(manager, engine, tokens).close()
    length, pages = _introspection.reuse_match_pages(manager, None, tokens, 0)
    assert length == 3 * TPB and len(pages) == 3
    assert all(entry is not None and entry[1] == TPB for entry in pages)
    slots = {entry[0] for entry in pages if entry is not None}
    assert len(slots) == 3
    fork = tokens[: TPB + 10] + tokens_of(5, 40)
    assert _introspection.reuse_match_pages(manager, None, fork, 0)[0] == TPB
    length, pages = _introspection.reuse_match_pages(manager, None, fork, 0, enable_partial=True)
    assert length == TPB + 10 and len(pages) == 2
    with pytest.raises(ValueError, match="lc_id"):
        _introspection.reuse_match_pages(manager, None, tokens, 3)
