"""TensorRT-LLM KVCacheManagerV2 conformance, continued: parameter names, stats, events and later upstream names.

Split from test_trtllm_conformance.py by concept; the README's compatibility section lists what deliberately differs.
"""

from __future__ import annotations

import math
import os
import threading
import numpy as np
import pytest

from kv_cache_manager_v2 import (
    CacheTier,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheCommitState,
    KVCacheCreatedData,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheEventManager,
    KVCacheIterationStatsDelta,
    KVCacheManager,
    KVCacheRemovedData,
    KVCacheStatsDelta,
    KVCacheStoredData,
    KVCacheUpdatedData,
    LayerGroupId,
    PageIndexMode,
    ReuseScope,
    Token,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from tests.helpers import IMAGE_DIGEST, KIB, MIB, attention, make_config, prefilled, ssm




# ------------------------------------------------------------------------------------- manager names
def test_manager_methods_take_trtllm_parameter_names() -> None:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(MIB), HostCacheTierConfig(MIB, max_quota=2 * MIB)]
    manager = KVCacheManager(make_config([attention(0)], tiers=tiers))
    assert manager.get_page_stride(layer_id=0, data_role="key") == 4 * KIB
    assert manager.get_page_index_converter(layer_id=0, data_role="value").layer_offset == 1
    assert manager.get_mem_pool_base_address(layer_id=0, data_role="key", index_mode=PageIndexMode.PER_LAYER) > 0
    assert manager.get_quota(cache_level=1) == MIB
    assert manager.get_storage_statistics(cache_level=1)[0].total == MIB // (8 * KIB)
    assert manager.probe_reuse() == 0 and manager.probe_reuse(input_tokens=[1, 2]) == 0
    assert not manager.resize(cache_level=1, quota=4 * MIB)  # beyond the reservation: refused
    assert manager.resize(cache_level=1, quota=4 * MIB, best_efforts=True)  # grown to the reservation instead
    assert manager.get_quota(1) == 2 * MIB
    assert manager.resize(1, 0) and manager.get_storage_statistics(1)[0].total == 0  # a tier with no room
    with pytest.raises(ValueError, match="quota"):
        manager.resize(0, 0)


def test_manager_answers_upstreams_config_and_layout_properties() -> None:
    """Names of TensorRT-LLM's public manager an engine reads its setup from (its ``__init__.pyi``)."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(4 * MIB), HostCacheTierConfig(4 * MIB)]
    layers: list[LayerConfig] = [attention(0), attention(1, size=2 * KIB, window=64), ssm(2)]
    manager = KVCacheManager(make_config(layers, tiers=tiers, commit_min_snapshot=True))
    assert manager.init_config is manager.config and manager.tokens_per_block == 32
    assert manager.cache_tier_list == [CacheTier.GPU_MEM, CacheTier.HOST_MEM]
    assert list(manager.layer_ids) == [0, 1, 2]
    assert manager.commit_min_snapshot
    assert not KVCacheManager(make_config([attention(0)])).commit_min_snapshot
    for buffer in manager.all_buffer_ids:
        converter = manager.get_page_index_converter(buffer.layer_id, buffer.role)
        assert manager.get_page_index_scale(buffer.layer_id, buffer.role) == converter.scale
    per_group = [manager.get_pool_group_index(group) for group in range(manager.num_layer_groups)]
    assert manager.get_life_cycle_pool_group_indices() == per_group == manager.get_life_cycle_pool_group_indices(1)


def test_iteration_stats_deltas_count_allocation_reuse_and_decode_per_layer_group() -> None:
    layers: list[LayerConfig] = [attention(0, 4 * KIB, window=64), attention(1, 4 * KIB)]
    manager = KVCacheManager(make_config(layers))
    prefilled(manager, list(range(128)))
    manager.get_and_reset_iteration_stats()
    cache = manager.create_kv_cache(None, list(range(160)))
    assert cache.resume() and cache.resize(160, 128)
    cache.commit(list(range(128, 160)))
    assert cache.resize(161, 160)  # a decode step into a new block
    deltas = manager.get_and_reset_iteration_stats()
    assert set(deltas) == {0, 1} and all(isinstance(delta, KVCacheIterationStatsDelta) for delta in deltas.values())
    full = deltas[LayerGroupId(1)]
    assert (full.iter_full_reused_blocks, full.iter_missed_blocks, full.iter_alloc_new_blocks) == (4, 1, 2)
    assert full.iter_alloc_total_blocks == 6 and full.iter_reused_blocks == 4 and full.iter_gen_alloc_blocks == 1
    assert deltas[LayerGroupId(0)].iter_full_reused_blocks == 2  # the window at 128 needs blocks 2 and 3 only
    assert manager.get_and_reset_iteration_stats()[LayerGroupId(1)] == KVCacheIterationStatsDelta()  # reset


def test_request_stats_count_one_request_until_committed_or_discarded() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    tokens = list(range(128))
    prefilled(manager, tokens[:64])
    cache = manager.create_kv_cache(None, tokens, enable_request_stats=True)
    assert cache.resume() and cache.resize(128, 64)  # blocks 2 and 3 are new
    cache.commit(tokens[64:])
    assert cache.resize(129, 128)  # and block 4
    assert cache.commit_pending_stats() == KVCacheStatsDelta(5, 3, 2, 2)
    assert cache.commit_pending_stats() == KVCacheStatsDelta()
    assert manager.get_committed_stats() == KVCacheStatsDelta(5, 3, 2, 2)
    retried = manager.create_kv_cache(None, tokens, enable_request_stats=True)
    retried.discard_pending_stats()  # e.g. a preempted attempt
    assert retried.commit_pending_stats() == KVCacheStatsDelta()
    assert manager.create_kv_cache(None, tokens).commit_pending_stats() == KVCacheStatsDelta()  # not asked for
    assert manager.get_committed_stats() == KVCacheStatsDelta(5, 3, 2, 2)


def test_disabled_stats_stay_empty() -> None:
    manager = KVCacheManager(make_config([attention(0)], enable_stats=False))
    prefilled(manager, list(range(64)))
    assert manager.get_and_reset_iteration_stats() == {} and manager.get_iteration_stats() == []


# ----------------------------------------------------------------------------------------------- events
def test_event_manager_gets_stored_updated_and_removed_events_with_layer_group_kind() -> None:
    events = KVCacheEventManager(1000)
    layers: list[LayerConfig] = [attention(0, 4 * KIB, window=64), attention(1, 4 * KIB)]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(8 * 16 * KIB), HostCacheTierConfig(MIB)]
    manager = KVCacheManager(make_config(layers, tiers=tiers), event_manager=events)
    assert manager.event_manager is events
    events.flush_iteration_events()
    created = events.get_latest_events()
    slots = [stats.total for level in range(2) for stats in manager.get_storage_statistics(level)]
    assert len(created) == 1 and created[0].data == KVCacheCreatedData(slots) and slots == [16, 128]
    prefilled(manager, list(range(128)), ReuseScope(lora_id=3, salt=b"\x01"))
    assert events.get_latest_events() == []  # nothing before a flush
    events.flush_iteration_events()
    stored = events.get_latest_events()
    assert {(e.layer_group_id, e.layer_group_kind, e.window_size) for e in stored} == {
        (0, "sliding_window", 64),
        (1, "full_attention", 0),
    }
    block = stored[0].data.blocks[0]  # type: ignore[union-attr]
    assert (block.medium, block.cache_level, block.lora_id, block.cache_salt) == ("GPU_MEM", 0, 3, "01")
    prefilled(manager, list(range(1000, 1256)))  # 16 pages while it prefills: the first request's go to the host
    events.flush_iteration_events()
    later = events.get_latest_events()
    moved = [e.data for e in later if isinstance(e.data, KVCacheUpdatedData)]
    assert len(moved) == 8  # 4 pages per layer group (SWA pages of committed blocks stay cached)
    assert all(data.cache_level == KVCacheEventDiff(0, 1) and data.priority is None for data in moved)
    manager.clear_reusable_blocks()
    events.flush_iteration_events()
    removed = {
        (block_hash, e.layer_group_id)
        for e in events.get_latest_events()
        if isinstance(e.data, KVCacheRemovedData)
        for block_hash in e.data.block_hashes
    }
    stored_pages = {
        (block.block_hash, e.layer_group_id)
        for e in stored + later
        if isinstance(e.data, KVCacheStoredData)
        for block in e.data.blocks
    }
    assert removed == stored_pages  # every page the tree got, and only those, left it


def test_event_reader_waits_for_a_flush_from_another_thread() -> None:
    events = KVCacheEventManager(10)
    taken: list[list[KVCacheEvent]] = []
    reader = threading.Thread(target=lambda: taken.append(events.get_latest_events(timeout_ms=5000)))
    reader.start()
    events.add_removed_event(b"k" * 32, layer_group_id=0)
    events.flush_iteration_events()
    reader.join(10)
    assert len(taken) == 1 and len(taken[0]) == 1 and taken[0][0].data == KVCacheRemovedData([b"k" * 32])


def test_event_manager_keeps_the_newest_entries_and_gathers_data_parallel_ranks() -> None:
    gathered: list[int] = []

    def gather(mine: list[KVCacheEvent]) -> list[list[KVCacheEvent]]:
        gathered.append(len(mine))
        return [mine, mine]  # two ranks with the same events

    events = KVCacheEventManager(3, attention_dp_rank=0, attention_dp_gather=gather)
    for index in range(2):
        events.add_removed_event(bytes([index]) * 32)
    events.flush_iteration_events()
    latest = events.get_latest_events()
    assert gathered == [2] and len(latest) == 3 and latest[0].attention_dp_rank == 0
    with pytest.raises(ValueError, match="max_kv_event_entries"):
        KVCacheEventManager(0)



# -------------------------------------------------------------------------------------- issue 37, round 2
def test_dirty_stats_ids_name_caches_with_unsettled_lookups() -> None:
    manager = KVCacheManager(make_config([ssm(0), attention(1)], commit_min_snapshot=True))
    tokens = list(range(48))
    looked_up = manager.create_kv_cache(input_tokens=tokens, id=101)
    blank = manager.create_kv_cache(id=102)  # no input tokens: no lookup to settle
    discarded = manager.create_kv_cache(input_tokens=tokens, id=103)
    assert manager.get_dirty_stats_kv_cache_ids() == {101, 103}
    looked_up.commit_pending_stats()
    discarded.discard_pending_stats()
    assert manager.get_dirty_stats_kv_cache_ids() == set()
    counted = manager.create_kv_cache(id=104, enable_request_stats=True)
    assert manager.get_dirty_stats_kv_cache_ids() == set()
    assert counted.resume() and counted.resize(64)
    assert manager.get_dirty_stats_kv_cache_ids() == {104}  # request blocks allocated, not yet committed
    counted.commit_pending_stats()
    assert manager.get_dirty_stats_kv_cache_ids() == set()
    for cache in (looked_up, blank, discarded, counted):
        cache.close()


def test_commit_state_and_reuse_scope_under_the_older_names() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    scope = ReuseScope(lora_id=3)
    cache = manager.create_kv_cache(scope)
    before = cache._commit_state
    assert before is cache.CommitState.ALLOWED
    assert cache._reuse_scope == scope == cache.reuse_scope
    cache.stop_committing()
    after = cache._commit_state
    assert after is KVCacheCommitState.STOPPED
    with pytest.raises(AttributeError):
        cache._commit_state = KVCacheCommitState.ALLOWED  # type: ignore[misc]
    cache.close()


# -------------------------------------------------------------------------------------- issue 37, round 3
def test_upstream_type_aliases_and_debug_flag_are_importable() -> None:
    from kv_cache_manager_v2 import NDEBUG, SlidingWindowSize, TokenIdExt

    window: SlidingWindowSize = None
    tokens: list[TokenIdExt] = [7, IMAGE_DIGEST]
    assert window is None and tokens == [7, IMAGE_DIGEST]
    assert NDEBUG is (os.environ.get("KV_CACHE_MANAGER_V2_DEBUG", "")[:1] != "1")  # debug mode at import: False


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_max_util_for_resume_gets_the_range_message(bad: float) -> None:
    config = make_config([attention(0)])
    config.max_util_for_resume = bad  # changed after construction: the manager's recheck refuses it
    with pytest.raises(ValueError, match=r"max_util_for_resume must be in \(0, 1\], got"):
        KVCacheManager(config)
    with pytest.raises(ValueError, match=r"admission_watermark must be in \[0, 1\), got nan"):
        make_config([attention(0)], admission_watermark=math.nan)


def test_turning_scratch_off_while_scratch_blocks_are_held_says_they_are_needed() -> None:
    layers = [attention(i, 8 * KIB, window=32) for i in range(8)]
    manager = KVCacheManager(make_config(layers, gpu_quota=16 * MIB, enable_swa_scratch_reuse=True))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(256)
    assert cache.has_scratch_slots
    with pytest.raises(ValueError, match="scratch blocks are needed"):
        cache.enable_swa_scratch_reuse = False
    assert cache.enable_swa_scratch_reuse  # refused: nothing changed
    cache.close()
