"""``_introspection``: the read-only looks TensorRT-LLM's tests take inside a manager, answered from live state."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kv_cache_manager_v2 import BatchDesc, GpuCacheTierConfig, HostCacheTierConfig, KVCacheDesc, KVCacheManager
from kv_cache_manager_v2 import SwaScratchReuseConfig
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


def test_active_page_stats_count_pages_per_tier_and_unqueued_evictable_ones() -> None:
    """The second list is TensorRT-LLM's "unscheduled evictable": pages eviction may move that sit in no eviction
    list, which it would then never find. Sound bookkeeping keeps it at zero whether pages are locked (active),
    held (suspended, free to leave the GPU) or moved to the host."""
    manager = KVCacheManager(
        make_config([attention(0, 4 * KIB)], tiers=[GpuCacheTierConfig(4 * MIB), HostCacheTierConfig(16 * MIB)])
    )
    engine = FakeEngine(manager)
    cache = compute_prompt(manager, engine, tokens_of(2, 4 * TPB))
    assert _introspection.active_page_stats(cache) == ([4, 0], [0, 0])  # locked while active
    cache.suspend()
    assert _introspection.active_page_stats(cache) == ([4, 0], [0, 0])  # evictable, and queued for it
    assert cache.offload() == 4
    assert _introspection.active_page_stats(cache) == ([0, 4], [0, 0])
    assert cache.prefetch(0)
    assert _introspection.active_page_stats(cache) == ([4, 0], [0, 0])
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
    assert _introspection.committed_page_is_linked(cache, 2, 0) is True  # published by stop_committing
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
    assert _introspection.reuse_match_pages(manager, None, fork, 0, enable_partial=False)[0] == TPB
    length, pages = _introspection.reuse_match_pages(manager, None, fork, 0)  # the manager's partial reuse
    assert length == TPB + 10 and len(pages) == 2
    whole_blocks_only = KVCacheManager(make_config([attention(0)], enable_partial_reuse=False))
    compute_prompt(whole_blocks_only, FakeEngine(whole_blocks_only), tokens).close()
    assert _introspection.reuse_match_pages(whole_blocks_only, None, fork, 0)[0] == TPB
    with pytest.raises(ValueError, match="lc_id"):
        _introspection.reuse_match_pages(manager, None, tokens, 3)


def test_grain_arithmetic_rounds_each_pool_up_to_whole_grains() -> None:
    grain = 16 << 20
    sizes = [16_252_928, 4_063_232]
    grains = _introspection.grains_for_slots(157, sizes, grain)
    assert grains == -(-157 * sizes[0] // grain) + -(-157 * sizes[1] // grain)
    slots, used = _introspection.grains_to_slots(grains, sizes, grain)
    assert slots >= 157 and used <= grains
    assert _introspection.grains_for_slots(slots + 1, sizes, grain) > grains  # the most that fit
    assert _introspection.grains_to_slots(0, sizes, grain) == (0, 0)
    for bad_sizes, bad_grain, name in (([0], grain, "slot_size_list"), ([grain], 0, "granularity")):
        with pytest.raises(ValueError, match=f"{name}.* must be positive"):
            _introspection.grains_to_slots(1, bad_sizes, bad_grain)


def test_ratio_split_keeps_every_minimum_and_follows_the_ratio_above_it() -> None:
    grain = 16 << 20
    lists = [[16_252_928, 4_063_232], [491_520, 126_720, 15_872], [31_457_280, 7_864_320]]
    minimums = [157, 3907, 157]
    floor = sum(_introspection.grains_for_slots(n, s, grain) for n, s in zip(minimums, lists))
    tight = _introspection.ratio_to_slot_count_list(floor * grain, lists, [0.2, 0.5, 0.3], grain, minimums)
    assert all(count >= minimum for count, minimum in zip(tight, minimums))
    roomy = _introspection.ratio_to_slot_count_list(10 * floor * grain, lists, [0.2, 0.5, 0.3], grain, minimums)
    spent = [_introspection.grains_for_slots(n, s, grain) for n, s in zip(roomy, lists)]
    assert sum(spent) <= 10 * floor
    assert [round(g / sum(spent), 1) for g in spent] == [0.2, 0.5, 0.3]
    with pytest.raises(ValueError, match="min_slots"):
        _introspection.ratio_to_slot_count_list(grain, lists, [0.2, 0.5, 0.3], grain, minimums)


def test_slots_for_batch_count_pages_and_one_ssm_state_per_cache() -> None:
    manager = KVCacheManager(make_config([ssm(0), attention(1)], commit_min_snapshot=True))
    ssm_group = _introspection.pool_group_index(manager, 0)
    attention_group = _introspection.pool_group_index(manager, 1)
    batch = BatchDesc([KVCacheDesc(2 * TPB, 2 * TPB - 1), KVCacheDesc(0, 0)])
    slots = _introspection.compute_slots_for_batch(manager, batch, TPB)
    assert slots[ssm_group] == 2 and slots[attention_group] == 2
    with pytest.raises(ValueError, match="tokens_per_block"):
        _introspection.compute_slots_for_batch(manager, batch, 16)
    with pytest.raises(TypeError, match="batch"):
        _introspection.compute_slots_for_batch(manager, [KVCacheDesc(1, 0)], TPB)  # type: ignore[arg-type]


def test_slots_for_batch_with_scratch_share_out_of_window_blocks() -> None:
    manager = KVCacheManager(make_config([attention(i, window=TPB) for i in range(8)]))
    batch = BatchDesc([KVCacheDesc(8 * TPB, 0)])
    assert _introspection.compute_slots_for_batch(manager, batch, TPB) == [8]
    assert _introspection.compute_slots_for_batch(manager, batch, TPB, SwaScratchReuseConfig()) == [2]


def test_planned_drop_counts_follow_the_handles() -> None:
    manager = KVCacheManager(make_config([attention(0, window=TPB), attention(1, 8 * KIB)]))
    engine = FakeEngine(manager)
    tokens = tokens_of(6, 3 * TPB)
    swa, full = _introspection.swa_life_cycle_ids(manager)[0], manager.get_layer_group_id(1)
    handles = []
    for _ in range(2):
        cache = compute_prompt(manager, engine, tokens)
        cache.stop_committing()
        handles.append(cache.plan_committed_block_drop())
        cache.close()
    length, counts = _introspection.reuse_match_planned_drop_counts(manager, None, tokens, swa)
    assert length == 3 * TPB and counts == [0, 0, 2]  # only the block inside the window is planned, twice
    assert _introspection.reuse_match_planned_drop_counts(manager, None, tokens, full)[1] == [0, 0, 0]
    first, second = handles
    assert first is not None and second is not None
    first.drop()  # the other handle still plans that page: it stays
    assert _introspection.reuse_match_planned_drop_counts(manager, None, tokens, swa)[1] == [0, 0, 1]
    second.drop()
    assert _introspection.reuse_match_planned_drop_counts(manager, None, tokens, swa)[1] == [0, 0, None]


def two_pool_group_manager(**gates: Any) -> KVCacheManager:
    layers: list[LayerConfig] = [attention(0, 16 * KIB, window=128, sinks=0), attention(1, 4 * KIB)]
    typical = BatchDesc([KVCacheDesc(160, 0)])
    config = make_config(layers, gpu_quota=64 * MIB, typical_step=typical, constraints=[typical])
    return KVCacheManager(dataclasses.replace(config, **gates))


def test_forced_rebalance_moves_the_split_towards_the_skew() -> None:
    manager = two_pool_group_manager()
    before = _introspection.current_gpu_ratio(manager)
    slots_before = [s.total for s in _introspection.storage_statistics(manager)]
    assert not manager.need_adjustment
    _introspection.force_rebalance_precondition(manager, skew=2.0)
    assert bool(manager.need_adjustment)  # bool(): keeps mypy from narrowing the property
    assert manager.adjust()
    after = _introspection.current_gpu_ratio(manager)
    slots_after = [s.total for s in _introspection.storage_statistics(manager)]
    assert after[0] / after[1] > before[0] / before[1]
    assert slots_after[0] > slots_before[0] and slots_after[1] < slots_before[1]
    assert not manager.need_adjustment  # the target was applied and cleared
    single = KVCacheManager(make_config([attention(0)]))
    with pytest.raises(ValueError, match="at least 2 pool groups"):
        _introspection.force_rebalance_precondition(single)
    with pytest.raises(ValueError, match="skew"):
        _introspection.force_rebalance_precondition(manager, skew=0.0)


def test_declared_samples_open_the_rebalance_gate_for_few_observations() -> None:
    manager = two_pool_group_manager()
    _introspection.set_num_sampled_kv_caches(manager, 2001)
    _introspection.set_last_adjustment_time(manager, 0.0)
    assert not manager.need_adjustment  # nothing observed yet: nothing to follow
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(64 * TPB, 64 * TPB - 1)
    cache.close()
    assert bool(manager.need_adjustment)  # one long request is enough once the samples are declared
    undeclared = two_pool_group_manager()
    cache = undeclared.create_kv_cache()
    assert cache.resume() and cache.resize(64 * TPB, 64 * TPB - 1)
    cache.close()
    assert not undeclared.need_adjustment
    with pytest.raises(ValueError, match="value"):
        _introspection.set_num_sampled_kv_caches(manager, -1)
    with pytest.raises(ValueError, match="value"):
        _introspection.set_last_adjustment_time(manager, float("nan"))
    with pytest.raises(ValueError, match="ratios"):
        _introspection.set_target_ratio_list_gpu(manager, [1.0])


def test_cached_event_is_complete_once_waited_for() -> None:
    event = _introspection.CachedCudaEvent(0)
    assert not event.is_closed()  # open until waited for, on any backend
    event.wait_in_stream(0)
    event.synchronize()
    assert event.is_closed() and event.query_complete()
    null = _introspection.CachedCudaEvent.NULL
    assert null.is_closed() and null.query_complete()
    null.synchronize()
    null.wait_in_stream(0)
    with pytest.raises(TypeError, match="stream"):
        _introspection.CachedCudaEvent(True)


def test_stats_excluded_caches_do_not_feed_the_rebalancing() -> None:
    manager = two_pool_group_manager()
    _introspection.set_num_sampled_kv_caches(manager, 2001)
    padding = manager.create_kv_cache(id=1)
    manager.mark_stats_excluded(1)
    assert manager.is_stats_excluded(1) and not manager.is_stats_excluded(None)
    assert padding.resume() and padding.resize(64 * TPB, 64 * TPB - 1)
    padding.close()
    assert not manager.need_adjustment  # the padding request was not observed
    assert not manager.is_stats_excluded(1)  # the mark ended with its cache
    real = manager.create_kv_cache(id=1)
    assert real.resume() and real.resize(64 * TPB, 64 * TPB - 1)
    real.close()
    assert bool(manager.need_adjustment)
    manager.mark_stats_excluded(7)
    manager.clear_stats_excluded(7)
    assert not manager.is_stats_excluded(7)
    with pytest.raises(TypeError, match="kv_cache_id"):
        manager.mark_stats_excluded("7")  # type: ignore[arg-type]
