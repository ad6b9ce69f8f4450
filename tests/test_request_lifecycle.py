"""Request lifecycle: growth, shrink, commit, suspend/resume, close — content-checked end to end."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import BAD_PAGE_INDEX, KVCacheManager, OutOfPagesError, PageIndexMode
from kv_cache_manager_v2.testing import FakeEngine
from kv_cache_manager_v2._base.types import SlotId
from tests.helpers import KIB, attention, gemma_like_layers, make_config

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def test_single_request_grows_decodes_and_shrinks() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers()))
    engine = FakeEngine(manager)
    tokens = tokens_of(1, 400)
    cache = manager.create_kv_cache(input_tokens=tokens[:100])
    assert cache.capacity == cache.history_length == cache.num_committed_tokens == 0
    assert cache.resume()
    assert cache.resize(100)
    engine.step(cache, tokens)
    cache.commit(tokens[:100])
    assert cache.history_length == 100 and cache.num_blocks == 4
    for length in range(101, 300):
        assert cache.resize(length)
        engine.step(cache, tokens)
        cache.commit(tokens[length - 1 : length])
    assert cache.num_committed_tokens == 299
    engine.check(cache, tokens)
    # SWA layers (window 128) dropped their out-of-window pages; the full layer kept all 10 blocks.
    swa = cache.get_base_page_indices(0)
    full = cache.get_base_page_indices(1)
    assert list(swa[:5]) == [BAD_PAGE_INDEX] * 5 and BAD_PAGE_INDEX not in swa[5:]
    assert BAD_PAGE_INDEX not in full and len(full) == 10
    assert cache.resize(400)
    assert cache.resize(320)  # shrink back: uncommitted tail blocks released
    assert cache.num_blocks == 10
    engine.check(cache, tokens)
    cache.close()
    cache.close()  # idempotent
    manager.shutdown()


def test_capacity_below_history_names_the_capacity() -> None:
    """``resize(capacity)`` alone below the kept history named only the argument the caller did not pass: before,
    'history_length 10 exceeds capacity 5'."""
    manager = KVCacheManager(make_config([attention(0)]))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(20, 10)
    with pytest.raises(ValueError, match="capacity 5 is below history_length 10, which resize keeps"):
        cache.resize(5)
    with pytest.raises(ValueError, match="capacity 5 is below history_length 10"):
        cache.capacity = 5
    assert (cache.capacity, cache.history_length) == (20, 10)
    cache.close()
    manager.shutdown()


def test_lengths_and_closed_cache_errors() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    cache = manager.create_kv_cache()
    with pytest.raises(ValueError, match="suspended"):
        cache.resize(10)
    assert cache.resume()
    assert cache.resize(64, 10)
    with pytest.raises(ValueError, match="history_length 5 would move backwards"):
        cache.resize(64, 5)
    with pytest.raises(ValueError, match="exceeds capacity"):
        cache.resize(64, 65)
    with pytest.raises(ValueError, match="close the cache and create a new one whose input_tokens stop before"):
        cache.resize(64, 5)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        cache.resize(-1)
    with pytest.raises(TypeError, match="capacity"):
        cache.resize(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accepted_input_tokens: .* exceed capacity 64 .*resize"):
        cache.commit(list(range(65)))
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (64, 10, 0)
    assert cache.resize(np.int64(70), np.int32(12))
    assert (cache.capacity, cache.history_length) == (70, 12)
    cache.commit(np.arange(20))
    assert cache.history_length == 20
    cache.stop_committing()
    with pytest.raises(ValueError, match="after stop_committing"):
        cache.commit([1])
    cache.close()
    assert cache.status == cache.Status.CLOSED
    for call in (cache.resume, cache.suspend, lambda: cache.resize(1), lambda: cache.commit([1])):
        with pytest.raises(ValueError, match="closed"):
            call()
    open_cache = manager.create_kv_cache()
    assert not bool(open_cache.is_committing_stopped)  # bool(): keeps mypy from narrowing the property
    open_cache.close()  # closing ends committing too: both spellings of the commit state agree
    assert open_cache.is_committing_stopped and open_cache._commit_state == open_cache.CommitState.STOPPED
    held = manager.create_kv_cache(id=3)  # held: a dropped cache would be released, freeing its id
    with pytest.raises(ValueError):
        manager.create_kv_cache(id=3)
    held.close()
    manager.shutdown() if manager.num_live_caches == 0 else None


def test_shutdown_needs_every_cache_closed() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    cache = manager.create_kv_cache()
    with pytest.raises(RuntimeError, match="1 KV cache"):
        manager.shutdown()
    cache.close()
    manager.shutdown()
    with pytest.raises(ValueError, match="shut down"):
        manager.create_kv_cache()


def test_user_index_buffer_is_kept_in_place() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers()))
    cache = manager.create_kv_cache()
    assert cache.resume()
    buffer = np.full(8, 99, dtype=np.int32)
    cache.set_base_page_index_buf(0, 1, buffer)
    assert cache.resize(200)
    # Entries past the last block read BAD_PAGE_INDEX, as TensorRT-LLM's manager writes them.
    assert list(buffer[:7]) == list(cache.get_base_page_indices(1)) and buffer[7] == -1
    with pytest.raises(ValueError, match="fewer than the 9 blocks"):
        cache.resize(260)
    assert cache.capacity == 200
    with pytest.raises(ValueError, match="int32"):
        cache.set_base_page_index_buf(0, 1, np.zeros(8, dtype=np.int64))
    with pytest.raises(ValueError, match="fewer than"):
        cache.set_base_page_index_buf(0, 0, array("i", [0, 0]))
    with pytest.raises(ValueError, match="beam_id 1"):
        cache.get_base_page_indices(0, beam_id=1)
    cache.close()


def test_capacity_setter_raises_out_of_pages_and_changes_nothing() -> None:
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], gpu_quota=16 * 16 * KIB))
    cache = manager.create_kv_cache()
    assert cache.resume()
    cache.capacity = 10 * TPB
    before = list(cache.get_base_page_indices(0))
    assert not cache.resize(17 * TPB)
    with pytest.raises(OutOfPagesError):
        cache.capacity = 17 * TPB
    assert cache.capacity == 10 * TPB and list(cache.get_base_page_indices(0)) == before
    assert manager.get_storage_statistics(0)[0].free == 6
    cache.close()


def test_max_util_for_resume_refuses_without_side_effects() -> None:
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], gpu_quota=10 * 16 * KIB, max_util_for_resume=0.5))
    first = manager.create_kv_cache(input_tokens=[])
    assert first.resume() and first.resize(5 * TPB)
    second = manager.create_kv_cache()
    assert second.resume()  # needs nothing new: utilisation stays at 50%
    second.suspend()
    first.commit(list(range(5 * TPB)))
    first.close()
    third = manager.create_kv_cache(input_tokens=list(range(5 * TPB)) + [7])
    assert third.num_committed_tokens == 5 * TPB
    blocker = manager.create_kv_cache()
    assert blocker.resume() and blocker.resize(2 * TPB)
    stats = manager.get_storage_statistics(0)[0]
    assert not third.resume()  # 2 locked + 5 to lock = 70% > 50%
    assert manager.get_storage_statistics(0)[0] == stats
    blocker.close()
    assert third.resume()
    for cache in (second, third):
        cache.close()


def test_shared_mode_engine_matches_per_layer_mode() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers()))
    tokens = tokens_of(5, 300)
    shared = FakeEngine(manager, PageIndexMode.SHARED)
    per_layer = FakeEngine(manager, PageIndexMode.PER_LAYER)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(300)
    shared.step(cache, tokens)
    cache.resize(300, 300)
    per_layer.check(cache, tokens)
    cache.close()


def test_debug_mode_checks_invariants_after_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_cache_manager_v2 import InvariantError

    monkeypatch.setenv("KV_CACHE_MANAGER_V2_DEBUG", "1")
    manager = KVCacheManager(make_config([attention(0)]))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(64)
    # Corrupt the books on purpose: release a slot that a live page still occupies.
    used = cache.get_base_page_indices(0)[0]
    internals_of(manager).store.tiers[0].pool_groups[0].allocator.release(SlotId(used))
    with pytest.raises(InvariantError, match="share slot|used"):
        cache.resize(96)
    with pytest.raises(InvariantError, match="used"):  # the books stay corrupt: the check after close says so too
        cache.close()
