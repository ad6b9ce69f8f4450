"""Re-entrancy and handles (issue #35, items 2-6): no manager code runs from a finalizer or a callback
in the middle of another manager call, and a ``KVCache`` handle cannot be copied or pickled.

The cycle collector is made to run at the k-th allocation of a call by setting the first generation's threshold
just above its current count (collection off while the cycle is built), for every k over a range: the old
``__del__`` closed the dropped cache at whichever allocation the collector happened to run, half way through
the call."""

from __future__ import annotations

import copy
import gc
import pickle
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheRequest,
    KVCacheStatus,
    LifeCycle,
    PlannedDropHandle,
    Priority,
    ReuseScope,
)
from kv_cache_manager_v2._cache.call_guard import CallGuard
from kv_cache_manager_v2._introspection import reuse_match_planned_drop_counts
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, compute_prompt, make_config

TPB = 32
SLOT = 2 * 4 * KIB  # one layer, K and V of 4 KiB per block
SCOPE = ReuseScope(lora_id=7)
ALLOCATION_POINTS = range(1, 120)


def manager_with(gpu_slots: int = 16, host_slots: int = 0) -> KVCacheManager:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_slots * SLOT)]
    if host_slots:
        tiers.append(HostCacheTierConfig(host_slots * SLOT))
    return KVCacheManager(make_config([attention(0)], tiers=tiers, max_util_for_resume=1.0))


def drop_in_a_cycle(cache: KVCache) -> None:
    """Leave ``cache`` reachable only from a reference cycle: only the collector can finalize it."""
    box: list[object] = [cache]
    box.append(box)


@contextmanager
def collector_at_allocation(k: int) -> Iterator[None]:
    """Run the collector at about the k-th allocation of the body (garbage made before it is in generation 0)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(gc.get_count()[0] + k, 1 << 30, 1 << 30)
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def slots_add_up(manager: KVCacheManager) -> None:
    for level in range(manager.num_cache_levels):
        for stats in manager.get_storage_statistics(level):
            assert stats.available + stats.unavailable == stats.total


def check_all(manager: KVCacheManager) -> None:
    gc.collect()  # a cycle the collector did not reach inside the call
    manager.check_invariants()  # also closes what a dropped handle left (the entry of a guarded call)
    slots_add_up(manager)


# ------------------------------------------------------------------------------------ items 2 and 3
def only_cache_of_the_scope(manager: KVCacheManager) -> None:
    cache = manager.create_kv_cache(SCOPE)
    assert cache.resume() and cache.resize(2 * TPB)
    drop_in_a_cycle(cache)


def publish_and_probe(manager: KVCacheManager, cache: KVCache, tokens: list[int]) -> None:
    """The new cache's committed blocks must be reusable in its scope once it closes."""
    if not cache.is_active:
        assert cache.resume()
    assert cache.resize(len(tokens))
    cache.commit(tokens)
    cache.close()
    check_all(manager)
    assert manager.num_live_caches == 0
    assert manager.probe_reuse(SCOPE, tokens) == len(tokens)


@pytest.mark.parametrize("k", ALLOCATION_POINTS)
def test_a_dropped_cache_is_not_closed_inside_create_kv_cache(k: int) -> None:
    manager = manager_with()
    tokens = list(range(100, 100 + 3 * TPB))
    with collector_off():
        only_cache_of_the_scope(manager)
        with collector_at_allocation(k):
            cache = manager.create_kv_cache(SCOPE, tokens)
    publish_and_probe(manager, cache, tokens)
    manager.shutdown()


@pytest.mark.parametrize("k", ALLOCATION_POINTS)
def test_a_dropped_cache_is_not_closed_inside_create_kv_cache_batch(k: int) -> None:
    manager = manager_with()
    tokens = list(range(100, 100 + 3 * TPB))
    with collector_off():
        only_cache_of_the_scope(manager)
        with collector_at_allocation(k):
            admitted = manager.create_kv_cache_batch([KVCacheRequest(tokens, SCOPE, capacity=len(tokens))])
    cache = admitted[0]
    assert cache is not None
    publish_and_probe(manager, cache, tokens)
    manager.shutdown()


# ------------------------------------------------------------------------------------------- item 4
@pytest.mark.parametrize("k", range(1, 60))
@pytest.mark.parametrize("committed_blocks, gpu_slots", [(0, 6), (4, 4)])
def test_a_dropped_cache_is_not_closed_inside_manager_resize(k: int, committed_blocks: int, gpu_slots: int) -> None:
    """Shrinking the GPU tier evicts and compacts the dropped cache's pages: closed half way, a freed page
    was moved (slots lost) or the compaction ran out of free slots."""
    manager = manager_with(gpu_slots=16, host_slots=16)
    with collector_off():
        caches = []
        for index in range(3):
            tokens = list(range(1000 * index, 1000 * index + 4 * TPB))
            cache = manager.create_kv_cache(None, tokens)
            assert cache.resume() and cache.resize(len(tokens))
            cache.commit(tokens[: committed_blocks * TPB])
            cache.suspend()
            caches.append(cache)
        drop_in_a_cycle(caches.pop())
        del cache
        with collector_at_allocation(k):
            assert manager.resize(0, gpu_slots * SLOT)
    check_all(manager)
    assert manager.num_live_caches == 2
    for cache in caches:
        cache.close()
    check_all(manager)
    manager.shutdown()


def test_a_dropped_handle_is_closed_by_the_next_call() -> None:
    manager = manager_with()
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(2 * TPB)
    with collector_off():
        drop_in_a_cycle(cache)
        del cache
        gc.collect()  # finalizes the handle: its cache is only queued
        other = manager.create_kv_cache()  # the entry closes it
    assert manager.get_storage_statistics(0)[0].unavailable == 0
    other.close()
    manager.shutdown()


def test_shutdown_closes_what_dropped_handles_left() -> None:
    manager = manager_with()
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(2 * TPB)
    with collector_off():
        drop_in_a_cycle(cache)
        del cache
        gc.collect()
    manager.shutdown()  # would refuse with a cache still open


# ------------------------------------------------------------------------------------------- item 5
def call_back_into(target: Callable[[], object], seen: list[str]) -> Callable[[int, LifeCycle], Priority]:
    def priority(ordinal: int, life_cycle: LifeCycle) -> Priority:
        try:
            target()
        except RuntimeError as error:
            seen.append(str(error))
        return Priority(35)

    return priority


def test_a_priority_callback_that_closes_its_cache_during_resize() -> None:
    manager = manager_with()
    seen: list[str] = []
    box: list[KVCache] = []
    cache = manager.create_kv_cache(custom_priority_callback=call_back_into(lambda: box[0].close(), seen))
    box.append(cache)
    assert cache.resume() and cache.resize(3 * TPB)
    assert seen and "KVCache.close" in seen[0] and "KVCache.resize" in seen[0]
    assert cache.status == KVCacheStatus.ACTIVE and cache.capacity == 3 * TPB
    check_all(manager)
    cache.close()
    check_all(manager)
    assert manager.get_storage_statistics(0)[0].unavailable == 0
    manager.shutdown()


def test_a_priority_callback_that_raises_the_refusal_changes_nothing() -> None:
    manager = manager_with(gpu_slots=16, host_slots=16)
    box: list[KVCache] = []

    def close_own(ordinal: int, life_cycle: LifeCycle) -> Priority:
        box[0].close()  # raises RuntimeError: the resume fails as a failing callback does
        return Priority(35)

    cache = manager.create_kv_cache(custom_priority_callback=close_own)
    box.append(cache)
    assert cache.resume()
    with pytest.raises(RuntimeError, match="KVCache.close was called while KVCache.resize"):
        cache.resize(2 * TPB)
    assert cache.status == KVCacheStatus.ACTIVE and cache.capacity == 0
    check_all(manager)
    cache.close()
    assert manager.num_live_caches == 0
    manager.shutdown()


@pytest.mark.parametrize(
    "call", ["create_kv_cache", "probe_reuse", "prefetch_remote", "prefetch", "resize", "shutdown", "batch", "commit"]
)
def test_a_callback_calling_the_manager_gets_runtime_error(call: str) -> None:
    manager = manager_with()
    other = manager.create_kv_cache()
    assert other.resume()
    targets: dict[str, Callable[[], object]] = {
        "create_kv_cache": manager.create_kv_cache,
        "probe_reuse": lambda: manager.probe_reuse(None, [1, 2, 3]),
        "prefetch_remote": lambda: manager.prefetch_remote(None, [1, 2, 3]),
        "prefetch": lambda: other.prefetch(evict=True),
        "resize": lambda: manager.resize(0, 8 * SLOT),
        "shutdown": manager.shutdown,
        "batch": lambda: manager.create_kv_cache_batch([KVCacheRequest([1, 2])]),
        "commit": lambda: other.commit([1]),
    }
    seen: list[str] = []
    cache = manager.create_kv_cache(custom_priority_callback=call_back_into(targets[call], seen))
    live = manager.num_live_caches
    assert cache.resume() and cache.resize(TPB)
    assert seen and all("while KVCache.resize is in flight" in message for message in seen)
    assert manager.num_live_caches == live and other.num_committed_tokens == 0
    check_all(manager)
    for each in (cache, other):
        each.close()
    manager.shutdown()


def test_a_callback_during_batch_admission_cannot_close_a_cache() -> None:
    manager = manager_with()
    victim = manager.create_kv_cache()
    seen: list[str] = []
    request = KVCacheRequest([1, 2, 3], custom_priority_callback=call_back_into(victim.close, seen))
    admitted = manager.create_kv_cache_batch([request])
    assert admitted[0] is not None and seen and "KVCacheManager.create_kv_cache_batch" in seen[0]
    assert victim.status == KVCacheStatus.SUSPENDED
    check_all(manager)
    for cache in (admitted[0], victim):
        cache.close()
    manager.shutdown()


class CallingBackEvents(KVCacheEventManager):
    """An event manager whose stored-event hook calls back into the manager (and catches the refusal)."""

    def __init__(self) -> None:
        super().__init__(100)
        self.manager: KVCacheManager | None = None
        self.refusals: list[str] = []

    def add_stored_event(self, *args: object, **kwargs: object) -> None:
        assert self.manager is not None
        try:
            self.manager.probe_reuse(None, list(range(TPB)))
        except RuntimeError as error:
            self.refusals.append(str(error))
        super().add_stored_event(*args, **kwargs)  # type: ignore[arg-type]


def test_an_event_manager_hook_calling_the_manager_gets_runtime_error() -> None:
    events = CallingBackEvents()
    manager = KVCacheManager(make_config([attention(0)]), event_manager=events)
    events.manager = manager
    tokens = list(range(2 * TPB))
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)
    assert len(events.refusals) == 2 and "while KVCache.commit is in flight" in events.refusals[0]
    cache.close()
    check_all(manager)
    assert manager.probe_reuse(None, tokens) == len(tokens)
    manager.shutdown()


# ------------------------------------------------------------------------------------------- item 6
@pytest.mark.parametrize(
    "operation",
    [copy.copy, copy.deepcopy, pickle.dumps, lambda cache: pickle.dumps(cache, protocol=0)],
    ids=["copy", "deepcopy", "pickle", "pickle-0"],
)
def test_a_handle_is_not_a_value(operation: Callable[[KVCache], object]) -> None:
    manager = manager_with()
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(TPB)
    with pytest.raises(TypeError, match="not a value"):
        operation(cache)
    assert manager.num_live_caches == 1 and cache.is_active
    cache.close()
    manager.shutdown()


def _handle_of(kind: str, manager: KVCacheManager, cache: KVCache) -> object:
    if kind == "manager":
        return manager
    if kind == "hold":
        return cache.hold("an outside writer")
    return cache.plan_committed_block_drop()


@pytest.mark.parametrize("handle", ["manager", "planned drop", "hold"])
@pytest.mark.parametrize(
    "operation",
    [copy.copy, copy.deepcopy, pickle.dumps, lambda handle: pickle.dumps(handle, protocol=0)],
    ids=["copy", "deepcopy", "pickle", "pickle-0"],
)
def test_no_handle_is_a_value(handle: str, operation: Callable[[object], object]) -> None:
    """Not only ``KVCache``: the manager, a ``PlannedDropHandle`` and a ``CacheHold`` stand for live state too. The
    manager copied, deep-copied and pickled: a shallow copy's ``shutdown()`` freed the pools the original then went
    on creating caches over (on the CUDA backend shutdown gives their device memory back to the driver), a deep copy
    or an unpickled twin duplicated every pool; a copied plan pickled the manager with it. Each raises
    ``TypeError`` naming its class, and the manager and cache go on as before."""
    manager = manager_with()
    cache = manager.create_kv_cache(None, list(range(TPB)))
    assert cache.resume() and cache.resize(TPB)
    cache.commit(list(range(TPB)))
    cache.stop_committing()
    target = _handle_of(handle, manager, cache)
    assert target is not None
    with pytest.raises(TypeError, match=f"a {type(target).__name__} is a handle to live state, not a value"):
        operation(target)
    assert manager.num_live_caches == 1 and cache.is_active
    if handle == "hold":
        target.release()  # type: ignore[attr-defined]
    cache.close()
    assert manager.probe_reuse(None, list(range(TPB))) == TPB
    manager.shutdown()


def test_every_class_owning_live_state_is_a_handle() -> None:
    """The handoff's endpoints and the event publisher own sockets, NIXL agents and registered memory: they refuse
    copy and pickle through the same base (``_base.types.Handle``) as the manager and its caches."""
    from kv_cache_manager_v2._base.types import Handle
    from kv_cache_manager_v2._handoff.nixl import KVReceiver
    from kv_cache_manager_v2._handoff.nixl_endpoint import NixlEndpoint
    from kv_cache_manager_v2._handoff.nixl_sender import KVSender
    from kv_cache_manager_v2._manager.planned_drop import PlannedDropHandle
    from kv_cache_manager_v2._cache.handle import CacheHold
    from kv_cache_manager_v2.kv_events.manager_publisher import KVEventsPublisher

    owners = [KVCacheManager, KVCache, CacheHold, PlannedDropHandle, KVReceiver, KVSender, NixlEndpoint, KVEventsPublisher]
    assert [owner.__name__ for owner in owners if not issubclass(owner, Handle)] == []


def test_call_guard_entering_leaves_on_error_and_refuses_without_leaving() -> None:
    """The handle's ``with guard.entering(...)``: the call is over after its block, even one that raised; a refused
    second call raises before its block and leaves the first one in flight."""
    guard = CallGuard()
    with pytest.raises(ValueError, match="inside"):
        with guard.entering("KVCache.close"):
            assert guard.current == "KVCache.close"
            raise ValueError("inside")
    assert guard.current == ""
    with guard.entering("KVCache.resume"):
        with pytest.raises(RuntimeError, match="KVCache.suspend was called while KVCache.resume is in flight"):
            with guard.entering("KVCache.suspend"):
                pytest.fail("the refused call's block ran")
        assert guard.current == "KVCache.resume" and guard.idle == []
    assert guard.current == "" and guard.idle == [None]  # the refused call took nothing and gave nothing back


# ---------------------------------------------------------------- planned drops (PlannedDropHandle)
def planned_turn(manager: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> PlannedDropHandle:
    """A finished, closed turn of a sliding-window model and the plan dropping its window blocks."""
    cache = compute_prompt(manager, engine, tokens)
    cache.stop_committing()
    handle = cache.plan_committed_block_drop()
    cache.close()
    assert handle is not None
    return handle


def swa_manager() -> KVCacheManager:
    return KVCacheManager(make_config([attention(0, window=8), attention(1)], tokens_per_block=8))


@pytest.mark.parametrize("k", range(1, 40))
def test_a_collected_planned_drop_is_not_applied_inside_create_kv_cache(k: int) -> None:
    """Applied by the finalizer, the plan dropped the matched blocks' pages between the match and the new cache
    adopting them (AssertionError: match pruning guarantees every needed block has a page)."""
    manager = swa_manager()
    engine = FakeEngine(manager)
    tokens = list(range(100, 124))
    with collector_off():
        box: list[object] = [planned_turn(manager, engine, tokens)]
        box.append(box)
        del box
        with collector_at_allocation(k):
            user = manager.create_kv_cache(None, tokens + [7])
    check_all(manager)
    assert user.resume()
    engine.check(user, tokens[: user.history_length])
    window_group = manager.get_layer_group_id(0)
    _, counts = reuse_match_planned_drop_counts(manager, None, tokens, window_group)
    assert all(count in (0, None) for count in counts), counts  # applied at a call boundary
    user.close()
    check_all(manager)
    manager.shutdown()


def test_a_planned_drop_from_a_priority_callback_gets_runtime_error() -> None:
    manager = swa_manager()
    engine = FakeEngine(manager)
    tokens = list(range(100, 124))
    handle = planned_turn(manager, engine, tokens)
    seen: list[str] = []
    user = manager.create_kv_cache(None, tokens + [7], custom_priority_callback=call_back_into(handle.drop, seen))
    assert user.resume() and user.resize(len(tokens) + 8, user.history_length)
    assert seen and "PlannedDropHandle.drop was called while KVCache.resize is in flight" in seen[0]
    assert not handle.is_dropped
    check_all(manager)
    engine.check(user, tokens[: user.history_length])
    user.close()
    handle.drop()
    assert manager.probe_reuse(None, tokens) == 16
    manager.shutdown()


def test_planning_a_drop_from_a_priority_callback_gets_runtime_error() -> None:
    manager = swa_manager()
    engine = FakeEngine(manager)
    tokens = list(range(100, 124))
    finished = compute_prompt(manager, engine, tokens)
    finished.stop_committing()
    seen: list[str] = []
    user = manager.create_kv_cache(custom_priority_callback=call_back_into(finished.plan_committed_block_drop, seen))
    assert user.resume() and user.resize(8)
    assert seen and "KVCache.plan_committed_block_drop was called while KVCache.resize" in seen[0]
    for cache in (user, finished):
        cache.close()
    check_all(manager)
    manager.shutdown()
