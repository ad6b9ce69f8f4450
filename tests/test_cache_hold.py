"""``KVCache.hold``: while something outside the manager may still write into an active cache's pages, no call
may free, move or share them (the class of defect behind a stuck NIXL READ's landing pages being reused)."""

from __future__ import annotations

import copy
import gc
import pickle
from typing import Callable

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCache, KVCacheManager
from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, compute_prompt, make_config

TPB = 32


def small_manager() -> KVCacheManager:
    slot = 2 * 4 * KIB
    return KVCacheManager(
        make_config([attention(0)], tiers=[GpuCacheTierConfig(16 * slot), HostCacheTierConfig(16 * slot)])
    )


def observed(manager: KVCacheManager, cache: KVCache) -> tuple[object, ...]:
    return (
        cache.status,
        cache.capacity,
        cache.history_length,
        cache.num_committed_tokens,
        list(cache.get_base_page_indices(0)),
        [(s.free, s.total) for s in manager.get_storage_statistics(0)],
    )


def page_changing_calls(cache: KVCache, prompt: list[int]) -> dict[str, Callable[[], object]]:
    def set_capacity() -> None:
        cache.capacity = 200

    return {
        "KVCache.close": cache.close,
        "KVCache.suspend": cache.suspend,
        "KVCache.resize": lambda: cache.resize(40, 40),
        "KVCache.commit": lambda: cache.commit(prompt[:8]),
        "KVCache.stop_committing": cache.stop_committing,
        "KVCache.capacity": set_capacity,
        "KVCache.resume": cache.resume,
        "KVCache.cuda_stream": lambda: setattr(cache, "cuda_stream", 0),
    }


def test_every_page_changing_call_on_a_held_cache_raises_and_changes_nothing() -> None:
    manager = small_manager()
    engine = FakeEngine(manager)
    prompt = list(range(1000, 1100))
    cache = compute_prompt(manager, engine, prompt)
    cache.resize(cache.capacity + 8)
    hold = cache.hold("a transfer still writing")
    assert list(cache.held_for) == ["a transfer still writing"]
    before = observed(manager, cache)
    for call, attempt in page_changing_calls(cache, list(range(2000, 2100))).items():
        with pytest.raises(RuntimeError, match=f"{call} on KVCache {cache.id}, which is held \\(a transfer still"):
            attempt()
        assert observed(manager, cache) == before, call
    # Reads and statistics stay available; the content is still the prompt's.
    cache.commit_pending_stats()
    engine.check(cache, prompt)
    with pytest.raises(RuntimeError, match="still open"):
        manager.shutdown()
    for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="a CacheHold is a handle to live state, not a value: it cannot be"):
            duplicate(hold)
    hold.release()
    hold.release()  # idempotent
    assert hold.released and not cache.held_for
    assert cache.resize(cache.capacity + 8)
    cache.close()
    manager.shutdown()


def test_holds_stack_and_the_cache_is_ordinary_once_the_last_is_released() -> None:
    manager = small_manager()
    cache = compute_prompt(manager, FakeEngine(manager), list(range(64)))
    first, second = cache.hold("one"), cache.hold("two")
    with pytest.raises(RuntimeError, match=r"held \(one; two\)"):
        cache.suspend()
    first.release()
    with pytest.raises(RuntimeError, match=r"held \(two\)"):
        cache.suspend()
    second.release()
    cache.suspend()
    cache.close()
    manager.shutdown()


def test_only_an_active_cache_can_be_held_and_the_reason_is_a_text() -> None:
    manager = small_manager()
    cache = compute_prompt(manager, FakeEngine(manager), list(range(64)))
    with pytest.raises(TypeError, match="reason"):
        cache.hold("")
    with pytest.raises(TypeError, match="reason|str object expected"):  # compiled: mypyc's own check
        cache.hold(3)  # type: ignore[arg-type]
    cache.suspend()
    with pytest.raises(ValueError, match="only an active cache can be held"):
        cache.hold("late")
    assert cache.held_for == ()
    cache.close()
    manager.shutdown()


def test_a_held_cache_whose_handle_is_dropped_stays_open_until_released() -> None:
    manager = small_manager()
    engine = FakeEngine(manager)
    prompt = list(range(300, 364))
    cache = compute_prompt(manager, engine, prompt)
    hold = cache.hold("outside writer")
    del cache
    gc.collect()
    manager.get_iteration_stats()  # a public call: a dropped handle would be closed here
    assert hold.cache.is_active  # the hold keeps the handle, so nothing freed the pages
    engine.check(hold.cache, prompt)
    hold.release()
    del hold
    gc.collect()
    manager.check_invariants()
    manager.shutdown()  # refuses while a cache is open: the released, dropped one was closed at its entry


def test_a_held_cache_dropped_with_its_hold_is_closed_and_no_longer_listed_as_held() -> None:
    """Dropping a hold unreleased together with its cache's handle lets the collector close the cache (nobody can
    release that hold any more); the close must also take the cache off the manager's list of held caches, which
    refusals read. Before the fix every such cache stayed listed by id with its closed state, one more per drop."""
    manager = small_manager()
    engine = FakeEngine(manager)
    held_caches = internals_of(manager).services.held_caches
    for turn in range(3):
        cache = compute_prompt(manager, engine, list(range(400 + 100 * turn, 464 + 100 * turn)))
        hold = cache.hold("outside writer")
        assert list(held_caches) == [cache.id]
        del cache, hold
        gc.collect()
        assert manager.num_live_caches == 0  # closed at this read, on the scheduler thread
        assert held_caches == {}
    manager.shutdown()


def test_a_hold_dropped_unreleased_is_lifted_at_the_next_call() -> None:
    """A hold is a handle: dropped without ``release`` (nobody can release it any more), it is lifted at the entry
    of the next call, as a dropped cache is closed, never inside the call the collector happens to run in. Before
    the fix it stayed for good: every page-changing call of the cache raised and the manager could not shut down
    while the cache's handle lived."""
    manager = small_manager()
    engine = FakeEngine(manager)
    prompt = list(range(700, 764))
    cache = compute_prompt(manager, engine, prompt)
    kept = cache.hold("kept writer")
    cache.hold("forgotten writer")  # dropped at once, unreleased
    gc.collect()
    before = list(cache.held_for)
    with pytest.raises(RuntimeError, match=r"which is held \(kept writer\)"):
        cache.suspend()  # its entry lifted the forgotten hold; the kept one still refuses
    assert before == ["kept writer", "forgotten writer"]  # queued until that entry
    assert list(cache.held_for) == ["kept writer"]
    kept.release()
    engine.check(cache, prompt)
    cache.close()
    assert internals_of(manager).services.held_caches == {}
    manager.shutdown()
