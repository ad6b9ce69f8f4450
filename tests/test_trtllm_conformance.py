"""What a TensorRT-LLM KVCacheManagerV2 user relies on: its names, signatures and behaviours (issue 26).

Each test is named after the behaviour; the README's compatibility section lists what deliberately differs.
"""

from __future__ import annotations

import gc
import math
import os
import numpy as np
import pytest

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    BufferId,
    CacheTier,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheEvent,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStoredData,
    LayerId,
    LifeCycle,
    OutOfMemoryError,
    OutOfPagesError,
    PageIndexMode,
    Priority,
    ReuseScope,
    gen_multimodal_cache_key_tokens,
    sequence_to_blockchain_keys,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import IMAGE_DIGEST, KIB, MIB, attention, gemma_like_layers, make_config, prefilled, ssm




# ------------------------------------------------------------------------------------------------- types
def test_cache_tier_and_page_index_mode_are_int_enums() -> None:
    assert isinstance(CacheTier.HOST_MEM, int) and int(CacheTier.DISK) == 2
    assert sorted([CacheTier.DISK, CacheTier.GPU_MEM])[0] is CacheTier.GPU_MEM
    assert isinstance(PageIndexMode.PER_LAYER, int) and PageIndexMode(0) is PageIndexMode.SHARED


def test_out_of_pages_error_is_an_out_of_memory_error() -> None:
    assert issubclass(OutOfPagesError, OutOfMemoryError) and issubclass(OutOfMemoryError, MemoryError)
    manager = KVCacheManager(make_config([attention(0)], gpu_quota=4 * 8 * KIB))
    cache = manager.create_kv_cache()
    assert cache.resume()
    with pytest.raises(OutOfMemoryError):
        cache.capacity = 10 * 32
    cache.close()


def test_buffer_id_names_one_buffer_of_one_layer() -> None:
    buffer = BufferId(LayerId(3), "key")  # type: ignore[arg-type]
    assert buffer.layer_id == 3 and buffer.role == "key" and buffer == (3, "key")


# ------------------------------------------------------------------------------------------------ layout
def test_page_stride_equals_the_size_of_one_override_page() -> None:
    # tpb 32, key paged by 8 tokens: 2 KiB per 8-token page, 4 pages per block; value 8 KiB per block.
    layer = AttentionLayerConfig(0, [BufferConfig("key", 2 * KIB, 8), BufferConfig("value", 8 * KIB)])
    manager = KVCacheManager(make_config([layer], gpu_quota=MIB))
    assert manager.get_page_stride(0, "key") == 2 * KIB
    assert manager.get_page_index_converter(0, "key").expansion == 4
    statistics = manager.get_storage_statistics(0)[0]
    assert statistics.slot_sizes == [16 * KIB]  # one block: 4 key pages and the value, coalesced
    # The 4 key pages of a block tile its 8 KiB of key bytes exactly: no page reaches a neighbour's bytes.
    view = np.asarray(manager.get_page_view(0, "key", PageIndexMode.PER_LAYER))
    pages = manager.get_page_index_converter(0, "key")([1, 2], PageIndexMode.PER_LAYER)
    for value, page in enumerate(pages):
        view[page] = value + 1
    for value, page in enumerate(pages):
        assert (view[page] == value + 1).all()
    manager.shutdown()


def test_storage_statistics_report_slot_sizes_per_pool() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers()))
    assert [stats.slot_sizes for stats in manager.get_storage_statistics(cache_level=0)] == [[160 * KIB], [64 * KIB]]


def test_attention_layer_config_window_size_is_the_sliding_window() -> None:
    assert attention(0, window=64).window_size == 64 and attention(1).window_size is None


# ------------------------------------------------------------------------------------------------ config
def test_seed_era_positional_config_order() -> None:
    layer = attention(0)
    config = KVCacheManagerConfig(32, 32_000, [GpuCacheTierConfig(MIB)], [layer], backend="cpu")
    assert config.vocab_size == 32_000 and config.layers == (layer,) and config.cache_tiers[0].quota == MIB
    with pytest.raises(ValueError, match="layers"):
        KVCacheManagerConfig(32, cache_tiers=[GpuCacheTierConfig(MIB)])


def test_tier_configs_accept_a_zero_quota() -> None:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(4 * 8 * KIB), HostCacheTierConfig(0)]
    manager = KVCacheManager(make_config([attention(0)], tiers=tiers))
    assert manager.get_storage_statistics(1)[0].total == 0 and manager.get_quota(1) == 0
    prefilled(manager, list(range(4 * 32)))
    prefilled(manager, list(range(1000, 1000 + 4 * 32)))  # evicts the first one: the host has no room, dropped
    assert manager.probe_reuse(None, list(range(4 * 32))) == 0
    with pytest.raises(ValueError, match="quota"):
        GpuCacheTierConfig(-1)


def test_manager_checks_its_config_again_at_construction() -> None:
    config = make_config([attention(0)])
    config.max_util_for_resume = math.nan
    with pytest.raises(ValueError, match="max_util_for_resume"):
        KVCacheManager(config)
    config.max_util_for_resume = 0.9
    config.layers[0].buffers[0].size = 0
    with pytest.raises(ValueError, match="BufferConfig.size"):
        KVCacheManager(config)
    config.layers[0].buffers[0].size = 4 * KIB
    config.cache_tiers[0].quota = -5
    with pytest.raises(ValueError, match="GpuCacheTierConfig.quota"):
        KVCacheManager(config)
    config.cache_tiers[0].quota = MIB
    manager = KVCacheManager(config)
    config.tokens_per_block = 7  # the manager built from a copy: a later change cannot reach it
    assert manager.config.tokens_per_block == 32 and manager.tokens_per_block == 32


def test_initial_pool_ratio_sets_the_first_split_in_bytes() -> None:
    quota = 64 * MIB
    manager = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=quota, initial_pool_ratio=[1.0, 3.0]))
    swa, full = manager.get_storage_statistics(0)
    swa_bytes, full_bytes = swa.total * swa.slot_sizes[0], full.total * full.slot_sizes[0]
    # Within a slot of each side: what rounding leaves over becomes one more slot.
    assert abs(full_bytes / swa_bytes - 3.0) < 0.02 and swa_bytes + full_bytes <= quota
    with pytest.raises(ValueError, match="initial_pool_ratio"):
        KVCacheManager(make_config(gemma_like_layers(), initial_pool_ratio=[1.0]))
    with pytest.raises(ValueError, match="initial_pool_ratio"):
        make_config(gemma_like_layers(), initial_pool_ratio=[1.0, 0.0])


# -------------------------------------------------------------------------------------------- cache names
def test_kv_cache_exposes_manager_committed_tokens_scope_and_block_size() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    scope = ReuseScope(lora_id=4)
    cache = manager.create_kv_cache(scope)
    assert cache.manager is manager and cache.reuse_scope == scope and cache.tokens_per_block == 32
    assert cache.resume() and cache.resize(40)
    cache.commit(list(range(40)))
    assert cache.committed_tokens == list(range(40))
    assert manager.create_kv_cache().reuse_scope == ReuseScope()


def test_cuda_stream_setter_picks_the_stream_of_the_next_resume() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    cache = manager.create_kv_cache()
    cache.cuda_stream = 7
    assert cache.resume() and cache.cuda_stream == 7
    cache.cuda_stream = 9  # active: moves the cache to the new stream
    assert cache.cuda_stream == 9 and cache.is_active


def test_commit_is_end_stops_committing_and_beam_indices_name_beam_zero() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(40)
    with pytest.raises(ValueError, match="beam width is 1"):
        cache.commit([1, 2], beam_search_indices=[1])
    assert cache.num_committed_tokens == 0
    cache.commit(list(range(40)), beam_search_indices=[0], is_end=True)
    assert cache.is_committing_stopped and cache.num_committed_tokens == 40
    assert list(cache.get_base_page_indices(0, beam_id=0)) == list(cache.get_base_page_indices(0))


def test_close_publishes_the_trailing_partial_block() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    tokens = list(range(1000))
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(1000)
    cache.commit(tokens)
    cache.close()  # no stop_committing: 31 full blocks and 8 tokens of a 32nd
    assert manager.probe_reuse(None, tokens) == 1000


def test_get_scratch_desc_is_none_when_a_group_has_no_scratch_blocks() -> None:
    layers: list[LayerConfig] = [attention(0, 8 * KIB, window=128), attention(1, 8 * KIB)]
    manager = KVCacheManager(make_config(layers, enable_swa_scratch_reuse=True))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(64)  # a chunk within the window: no scratch block
    assert cache.get_scratch_desc(0) is None and cache.get_scratch_desc(1) is None
    assert cache.resize(1024, 64)
    desc = cache.get_scratch_desc(0)
    assert desc is not None and len(desc.range) > 0 and cache.get_scratch_desc(1) is None


def test_text_only_caches_refuse_multimodal_tokens() -> None:
    manager = KVCacheManager(make_config([attention(0)], vocab_size=1000))
    image = manager.gen_multimodal_cache_key_tokens(IMAGE_DIGEST, 4)
    with pytest.raises(ValueError, match="text_only"):
        manager.create_kv_cache(input_tokens=image, text_only=True)
    cache = manager.create_kv_cache(text_only=True)
    assert cache.text_only and cache.resume() and cache.resize(8)
    with pytest.raises(ValueError, match="text_only"):
        cache.commit([1, 2, *image])
    assert cache.num_committed_tokens == 0
    cache.commit([1, 2])
    assert not manager.create_kv_cache(input_tokens=image).text_only


# --------------------------------------------------------------------------------------- open caches
def test_clear_reusable_blocks_and_shutdown_name_the_open_caches() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    prefilled(manager, list(range(64)))
    caches = [manager.create_kv_cache(), manager.create_kv_cache()]
    for call in (manager.clear_reusable_blocks, manager.shutdown):
        with pytest.raises(RuntimeError, match="2 KV cache"):
            call()
    assert manager.probe_reuse(None, list(range(64))) == 64
    for cache in caches:
        cache.close()
    manager.clear_reusable_blocks()
    manager.shutdown()


def test_a_cache_dropped_without_close_is_released() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    tokens = list(range(100))
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(100)
    cache.commit(tokens)
    del cache  # no close(): the manager holds no reference that would keep it open
    assert manager.num_live_caches == 0 and manager.probe_reuse(None, tokens) == 100  # published as close would
    stats = manager.get_storage_statistics(0)[0]
    assert stats.unavailable == 0
    manager.shutdown()


def test_a_cache_in_a_reference_cycle_is_released_by_the_collector() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    holder: list[object] = []

    def priority(ordinal: int, life_cycle: LifeCycle) -> Priority:
        assert holder  # the callback keeps the cache alive: a cycle only the collector can break
        return Priority(35)

    cache = manager.create_kv_cache(custom_priority_callback=priority)
    holder.append(cache)
    assert cache.resume() and cache.resize(64)
    del cache, holder, priority
    gc.collect()
    assert manager.num_live_caches == 0
    manager.shutdown()


# -------------------------------------------------------------------------------------------- priorities
def test_priority_callback_gets_the_block_life_cycle() -> None:
    layers: list[LayerConfig] = [attention(0, 4 * KIB, window=64, sinks=32), attention(1, 4 * KIB)]
    manager = KVCacheManager(make_config(layers))
    seen: list[tuple[int, int | None, int, int, int]] = []

    def in_window_first(ordinal: int, life_cycle: LifeCycle) -> Priority:
        stale = life_cycle.get_stale_range(256, 32)
        seen.append((ordinal, life_cycle.window_size, life_cycle.num_sink_blocks, stale.beg, stale.end))
        return Priority(10 if ordinal in stale else 60)

    cache = manager.create_kv_cache(custom_priority_callback=in_window_first)
    assert cache.resume() and cache.resize(256)
    windowed = {entry[0]: entry for entry in seen if entry[1] == 64}
    full = [entry for entry in seen if entry[1] is None]
    assert set(windowed) == set(range(8)) and len(full) == 8
    assert windowed[3] == (3, 64, 1, 1, 6)  # sink block 0, live window from block 6 at history 256
    assert all(entry[2:] == (0, 0, 0) for entry in full)


# ---------------------------------------------------------------------------------------------- hashing
def test_multimodal_key_tokens_continue_at_a_token_offset() -> None:
    whole = gen_multimodal_cache_key_tokens(1000, IMAGE_DIGEST, 6)
    assert whole == [IMAGE_DIGEST, 1001, 1002, 1003, 1004, 1005]
    chunks = gen_multimodal_cache_key_tokens(1000, IMAGE_DIGEST, 2) + gen_multimodal_cache_key_tokens(
        1000, IMAGE_DIGEST, 4, token_offset=2
    )
    assert chunks == whole
    with pytest.raises(ValueError, match="32 bytes"):
        gen_multimodal_cache_key_tokens(1000, IMAGE_DIGEST[:31], 4)
    with pytest.raises(ValueError, match="token_offset"):
        gen_multimodal_cache_key_tokens(1000, IMAGE_DIGEST, 4, token_offset=-1)


def test_multimodal_uuid_reaches_events_but_not_block_keys() -> None:
    events = KVCacheEventManager(100)
    manager = KVCacheManager(make_config([attention(0)], tokens_per_block=8), event_manager=events)
    named = [1, 2, *gen_multimodal_cache_key_tokens(5000, IMAGE_DIGEST, 6, uuid="image-7")]
    plain = [1, 2, *gen_multimodal_cache_key_tokens(5000, IMAGE_DIGEST, 6)]
    assert list(sequence_to_blockchain_keys(8, None, named))[0][1] == list(sequence_to_blockchain_keys(8, None, plain))[0][1]
    prefilled(manager, named)
    events.flush_iteration_events()
    stored = [event.data for event in events.get_latest_events() if isinstance(event.data, KVCacheStoredData)]
    assert stored[0].blocks[0].mm_keys == [(IMAGE_DIGEST, 2, "image-7")]
    assert stored[0].blocks[0].tokens[2].token_id == IMAGE_DIGEST.hex()


def test_sequence_to_blockchain_keys_are_the_keys_the_manager_publishes() -> None:
    events = KVCacheEventManager(100)
    manager = KVCacheManager(make_config([attention(0)], tokens_per_block=16), event_manager=events)
    scope = ReuseScope(lora_id=2, salt="tenant")
    tokens = list(range(40))
    prefilled(manager, tokens, scope)
    events.flush_iteration_events()
    published = [
        (event.data.parent_hash, event.data.blocks[0].block_hash, [t.token_id for t in event.data.blocks[0].tokens])
        for event in events.get_latest_events()
        if isinstance(event.data, KVCacheStoredData)
    ]
    chain = list(sequence_to_blockchain_keys(16, scope, tokens))
    assert [(key, block) for block, key in chain] == [(key, tokens) for _, key, tokens in published]
    assert [parent for parent, _, _ in published][1:] == [key for _, key in chain][:-1]


# --------------------------------------------------------------------------------------------- planning
def test_clamp_max_seq_len_for_one_window_32_layer_with_one_slot_is_96() -> None:
    manager = KVCacheManager(make_config([attention(0, 512, window=32)], gpu_quota=KIB, tokens_per_block=32))
    assert manager.get_storage_statistics(0)[0].total == 1
    # Up to 96 one page holds the window; 97 to 100 straddle two blocks of it.
    assert manager.clamp_max_seq_len_for_mem(1, 100) == 96


def test_constraints_count_shared_system_prompt_blocks_once_for_swa_too() -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=256)]
    alone = BatchDesc([KVCacheDesc(300, 299)] * 4)
    shared = BatchDesc([KVCacheDesc(300, 299)] * 4, system_prompt_length=256)
    floors = [KVCacheManager(make_config(layers, constraints=[batch], max_util_for_resume=1.0))._planner.floors[0] for batch in (alone, shared)]
    # Each cache holds blocks 1..9 at history 299 (window 256); the prompt's live blocks 1..7 are shared.
    assert floors == [4 * 9, 9 + 3 * 2]


def test_constraint_floors_leave_resume_headroom_for_every_cache() -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB)]
    batch = BatchDesc([KVCacheDesc(320, 319)] * 4)  # 40 blocks
    quota = math.ceil(40 / 0.9) * 4 * KIB  # 45 slots
    manager = KVCacheManager(make_config(layers, gpu_quota=quota, constraints=[batch], max_util_for_resume=0.9))
    assert internals_of(manager).planner.floors == [45] and manager.get_storage_statistics(0)[0].total == 45
    caches = [manager.create_kv_cache() for _ in range(4)]
    for cache in caches:
        assert cache.resume() and cache.resize(320, 319)  # each resumes under max_util_for_resume


def test_constraints_that_do_not_fit_a_tiny_quota_raise_the_gpu_quota_to_their_floors() -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=128), attention(1, 4 * KIB)]
    batch = BatchDesc([KVCacheDesc(1000, 999)] * 3)
    manager = KVCacheManager(make_config(layers, gpu_quota=64 * KIB, constraints=[batch], max_util_for_resume=1.0))
    stats = manager.get_storage_statistics(0)
    assert [group.total for group in stats] == [3 * 5, 3 * 32]  # the batch always fits: 3 x 5 SWA, 3 x 32 full blocks
    assert manager.get_quota(0) == sum(group.total * sum(group.slot_sizes) for group in stats) > 64 * KIB
    caches = [manager.create_kv_cache() for _ in range(3)]
    assert all(cache.resume() and cache.resize(1000, 999) for cache in caches)


def test_a_constraint_for_the_longest_request_gives_upstreams_clamp_answers_for_a_window_and_a_full_layer() -> None:
    """Upstream sizes this tiny quota up to a worst-case window in each attention group (4 slots) and answers 96 /
    32; here the quota's 2 slots answer 32 / 0, and declaring the request (the README's porting advice) gives 96 / 32."""
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=32, sinks=0), attention(1, 2 * KIB)]
    manager = KVCacheManager(make_config(layers, gpu_quota=8 * KIB, tokens_per_block=32, max_util_for_resume=1.0))
    assert manager.get_storage_statistics(0)[0].total == 2
    assert [manager.clamp_max_seq_len_for_mem(batch, 96) for batch in (1, 2)] == [32, 0]
    longest = [BatchDesc([KVCacheDesc(96, 95)])]
    manager = KVCacheManager(
        make_config(layers, gpu_quota=8 * KIB, tokens_per_block=32, max_util_for_resume=1.0, constraints=longest)
    )
    assert manager.get_storage_statistics(0)[0].total == 4
    assert [manager.clamp_max_seq_len_for_mem(batch, 96) for batch in (1, 2)] == [96, 32]


def test_a_pool_group_gets_no_slot_when_the_typical_step_needs_none() -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB, window=32), attention(1, 4 * KIB)]
    # The SWA group's share rounds to no slot: no error, unlike a group that the split starves while it needs one.
    typical = BatchDesc([KVCacheDesc(0, 0)] * 4)
    manager = KVCacheManager(make_config(layers, gpu_quota=20 * 8 * KIB, typical_step=typical, initial_pool_ratio=[1e-9, 1.0]))
    swa, full = (stats.total for stats in manager.get_storage_statistics(0))
    assert swa == 0 and full > 0
    cache = manager.create_kv_cache()
    assert cache.resume() and not cache.resize(32)  # the SWA group has no slot: a memory shortage, not an error


# ---------------------------------------------------------------------------------------------- SSM
@pytest.mark.parametrize("flag", ["commit_min_snapshot", "mamba_save_last_snapshot"])
def test_last_snapshot_makes_the_end_of_each_commit_reusable(flag: str) -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB), ssm(1, 4 * KIB, KIB)]
    config = make_config(
        layers,
        tokens_per_block=16,
        ssm_reuse_interval=0,
        commit_min_snapshot=flag == "commit_min_snapshot",
        mamba_save_last_snapshot=flag == "mamba_save_last_snapshot",
    )
    manager = KVCacheManager(config)
    engine = FakeEngine(manager)
    tokens = list(range(96))
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(96)
    engine.step(cache, tokens)
    cache.commit(tokens)
    cache.close()
    assert manager.probe_reuse(None, tokens + [7]) == 96
    periodic = KVCacheManager(make_config(layers, tokens_per_block=16, snapshot_prefill_chunks=False))  # every 512
    prefilled(periodic, tokens)
    assert periodic.probe_reuse(None, tokens + [7]) == 0
    with pytest.raises(ValueError, match="ssm_reuse_interval"):
        make_config(layers, tokens_per_block=16, ssm_reuse_interval=0, snapshot_prefill_chunks=False)


def test_reuse_match_backoff_trims_every_match() -> None:
    manager = KVCacheManager(make_config([attention(0)], reuse_match_backoff=5))
    tokens = list(range(64))
    prefilled(manager, tokens)
    assert manager.probe_reuse(None, tokens) == 59
    cache = manager.create_kv_cache(None, tokens)
    assert cache.num_committed_tokens == 59 and cache.committed_tokens == tokens[:59]
    with pytest.raises(ValueError, match="reuse_match_backoff"):
        make_config([attention(0)], reuse_match_backoff=-1)


def test_reuse_match_backoff_counts_back_from_the_tokens_the_tree_holds_not_from_a_shorter_match() -> None:
    # Full attention + an 8-token window, 8-token blocks: dropping the last cache's window leaves the full-attention
    # blocks of all 24 tokens, so a match can only end at 16 (the window of position 16 is still there).
    layers = [attention(0), attention(1, window=8)]
    manager = KVCacheManager(make_config(layers, tokens_per_block=8, reuse_match_backoff=1))
    tokens = list(range(24))
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(24)
    cache.commit(tokens)
    cache.stop_committing()
    handle = cache.plan_committed_block_drop()
    cache.close()
    assert manager.probe_reuse(None, tokens) == 23  # everything there: the last token backed off
    assert handle is not None
    handle.drop()
    # Positions before 16 read at most one token past them, and the tree agrees on all 24: nothing to back off.
    assert manager.probe_reuse(None, tokens) == 16
