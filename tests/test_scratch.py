"""SWA sinks, out-of-window release and prefill scratch slots (seeds 000 and 002)."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2._introspection import state_of
from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    HalfOpenRange,
    KVCacheManager,
    PageIndexMode,
    SwaScratchReuseConfig,
)
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, MIB, attention, make_config

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def headline_layers() -> list[LayerConfig]:
    """32 SWA layers, K and V of 8 KiB per block each, window 128 (seed 000's headline)."""
    return [attention(i, 8 * KIB, window=128) for i in range(32)]


@pytest.mark.parametrize(("scratch", "expected_slots"), [(False, 32), (True, 5)])
def test_seed_headline_peak_slots(scratch: bool, expected_slots: int) -> None:
    manager = KVCacheManager(make_config(headline_layers(), gpu_quota=64 * MIB, enable_swa_scratch_reuse=scratch))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(1024)
    stats = manager.get_storage_statistics(0)[0]
    assert stats.total - stats.free == expected_slots
    desc = cache.get_scratch_desc(0)
    if scratch:
        assert desc is not None and desc.range == HalfOpenRange(0, 28) and len(desc.slot_ids) == 1
        assert cache.has_scratch_slots and not cache.supports_index_mode(PageIndexMode.SHARED)
        assert list(cache.get_base_page_indices(0)[:28]) == [BAD_PAGE_INDEX] * 28
    else:
        assert desc is None and not cache.has_scratch_slots
    cache.close()


def test_chunked_prefill_then_decode_then_second_round_with_content_checks() -> None:
    layers: list[LayerConfig] = [*(attention(i, 4 * KIB, window=96, sinks=8) for i in range(3)), attention(3, 8 * KIB)]
    manager = KVCacheManager(make_config(layers, enable_swa_scratch_reuse=True))
    engine = FakeEngine(manager)
    tokens = tokens_of(1, 2000)
    cache = manager.create_kv_cache()
    assert cache.resume()
    position = 0
    for chunk in (300, 17, 250, 64, 1, 400):
        assert cache.resize(position + chunk, position)
        swa = cache.get_scratch_desc(0)
        assert cache.get_scratch_desc(1) is None  # the full-attention group never gets scratch
        assert (swa is not None) == cache.has_scratch_slots  # None when the chunk has no scratch block
        engine.step(cache, tokens)
        position += chunk
        cache.commit(tokens[position - chunk : position])
        assert not cache.has_scratch_slots  # history reached capacity: scratch slots freed
        manager.check_invariants()
    with pytest.raises(ValueError, match="capacity setter"):
        cache.capacity = position + 1
    cache.enable_swa_scratch_reuse = False
    for _ in range(40):  # decode
        assert cache.resize(position + 1, position)
        engine.step(cache, tokens)
        position += 1
        cache.commit(tokens[position - 1 : position])
    cache.enable_swa_scratch_reuse = True
    assert cache.resize(position + 300, position)
    assert cache.has_scratch_slots
    with pytest.raises(ValueError, match="cannot turn scratch reuse off"):
        cache.enable_swa_scratch_reuse = False
    with pytest.raises(ValueError, match="each chunk starts where the previous one ended"):
        cache.resize(position + 400, position + 100)
    engine.step(cache, tokens)
    cache.suspend()
    assert not any(group.scratch_pages for group in state_of(cache).attention)
    assert cache.resume()
    assert cache.has_scratch_slots
    cache.commit(tokens[position : position + 300])
    manager.check_invariants()
    cache.close()


def test_rewind_keeps_the_last_tokens_out_of_scratch() -> None:
    manager = KVCacheManager(
        make_config(headline_layers()[:4], swa_scratch_reuse=SwaScratchReuseConfig(max_rewind_len=64))
    )
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(1024)
    desc = cache.get_scratch_desc(0)
    assert desc is not None and desc.range == HalfOpenRange(0, 26)
    # With rewind the next chunk may start up to 64 tokens early.
    assert cache.resize(1500, 1000)
    cache.close()


def test_scratch_blocks_are_never_committed_with_swa_data_so_reuse_is_cut_back() -> None:
    layers: list[LayerConfig] = [attention(0, 4 * KIB, window=128), attention(1, 4 * KIB)]
    results = {}
    for scratch in (False, True):
        manager = KVCacheManager(make_config(layers, enable_swa_scratch_reuse=scratch))
        engine = FakeEngine(manager)
        prompt = tokens_of(2, 1024)
        cache = manager.create_kv_cache(None, prompt)
        assert cache.resume() and cache.resize(1024)
        engine.step(cache, prompt)
        cache.commit(prompt)
        cache.close()
        # The whole prompt stays servable (its window at 1024 was never scratch) ...
        whole = manager.probe_reuse(None, prompt)
        # ... but a follower sharing 600 tokens needs the window at 600, which scratch discarded.
        partial = manager.probe_reuse(None, prompt[:600] + tokens_of(3, 50))
        results[scratch] = (whole, partial)
        follower = manager.create_kv_cache(None, prompt[:600] + tokens_of(3, 50))
        assert follower.resume()
        engine.check(follower, prompt)
        follower.close()
    assert results[False] == (1024, 600)  # 18 full blocks + 24 tokens reused partially
    assert results[True] == (1024, 0)


def test_a_declared_prefix_end_is_a_chunk_stop_so_scratch_keeps_its_window() -> None:
    """Scratch discards the blocks a chunk leaves behind its window, so a shared prefix ending inside a long chunk
    is not reusable (above). Declared as ``snapshot_at`` it is one of ``snapshot_points``, where the docs ask a
    prefill chunk to end: the window before it then keeps real pages and a follower reuses the whole prefix."""
    layers: list[LayerConfig] = [attention(0, 4 * KIB, window=128), attention(1, 4 * KIB)]
    manager = KVCacheManager(make_config(layers, enable_swa_scratch_reuse=True))
    engine = FakeEngine(manager)
    prompt = tokens_of(2, 1024)
    cache = manager.create_kv_cache(None, prompt, snapshot_at=[600])
    assert cache.snapshot_points == (576, 600)  # its block boundary, and (partial reuse) the position itself
    assert cache.resume()
    for end in [*cache.snapshot_points, len(prompt)]:
        assert cache.resize(end, cache.history_length)
        engine.step(cache, prompt)
        cache.commit(prompt[cache.num_committed_tokens : end])
    assert cache.get_scratch_desc(0) is None  # the last chunk (600..1024) had scratch blocks; committed now
    cache.close()
    follower_tokens = prompt[:600] + tokens_of(3, 50)
    assert manager.probe_reuse(None, follower_tokens) == 600
    follower = manager.create_kv_cache(None, follower_tokens)
    assert follower.resume()
    engine.check(follower, prompt)
    follower.close()
    without_scratch = KVCacheManager(make_config(layers)).create_kv_cache(None, prompt, snapshot_at=[600])
    assert without_scratch.snapshot_points == ()  # nothing is discarded: no chunk needs to stop


def test_decode_side_preset_history_never_allocates_stale_blocks() -> None:
    manager = KVCacheManager(make_config(headline_layers()[:2]))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(4096, 4096)
    stats = manager.get_storage_statistics(0)[0]
    assert stats.total - stats.free == 4  # blocks (4097 - 128) // 32 = 124 .. 127 only
    assert cache.get_num_front_blocks_removed(0) == 124
    cache.close()


def test_manager_index_mode_support_and_shared_base_refusal() -> None:
    manager = KVCacheManager(make_config(headline_layers()[:2], enable_swa_scratch_reuse=True))
    assert manager.supports_index_mode(PageIndexMode.SHARED) is None
    with pytest.raises(ValueError, match="index_mode=None"):
        manager.get_mem_pool_base_address(0, "key", None)
    cache = manager.create_kv_cache()
    assert cache.resume()
    assert cache.supports_index_mode(PageIndexMode.SHARED) and cache.supports_index_mode(PageIndexMode.PER_LAYER)
    assert cache.resize(512)
    assert not cache.supports_index_mode(PageIndexMode.SHARED)
    cache.close()
