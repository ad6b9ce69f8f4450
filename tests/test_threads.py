"""The threading contract (README "Threads"): one scheduler thread drives the manager; another thread may read
events and statistics beside it without losing or duplicating any.

The interpreter is told to switch threads every microsecond while the two run, so a read-then-reset that is
not atomic loses updates within a few hundred iterations.
"""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from contextlib import contextmanager

import pytest

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    KVCache,
    KVCacheEvent,
    KVCacheEventManager,
    KVCacheManager,
    KVEvent,
    RemoteCacheTierConfig,
    RemoteStore,
    RemoteStoreError,
)
from kv_cache_manager_v2.config import CacheTierConfig
from tests.helpers import KIB, attention, make_config

TPB = 16
ROUNDS = 3000


@contextmanager
def frequent_thread_switches() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def run_beside(scheduler: Callable[[], None], reader: Callable[[], None]) -> None:
    """Run ``reader`` in a loop on another thread for as long as ``scheduler`` runs on this one."""
    done = threading.Event()
    failures: list[BaseException] = []

    def read_until_done() -> None:
        try:
            while not done.is_set():
                reader()
        except BaseException as error:  # reported on the main thread
            failures.append(error)

    thread = threading.Thread(target=read_until_done)
    with frequent_thread_switches():
        thread.start()
        try:
            scheduler()
        finally:
            done.set()
            thread.join()
    assert not failures, failures


def serve(manager: KVCacheManager, rounds: int, commit: bool) -> None:
    for round_index in range(rounds):
        tokens = [round_index * 10 + i for i in range(2 * TPB)]
        cache = manager.create_kv_cache(input_tokens=tokens)
        assert cache.resume() and cache.resize(len(tokens))
        if commit:
            cache.commit(tokens)
        cache.close()


def test_events_drained_from_another_thread_are_never_lost_or_duplicated() -> None:
    manager = KVCacheManager(
        make_config(
            [attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB, enable_kv_events=True,
            max_kv_events=10 * ROUNDS,
        )
    )
    received: list[KVEvent] = []
    run_beside(lambda: serve(manager, ROUNDS, commit=True), lambda: received.extend(manager.get_latest_events()))
    received.extend(manager.get_latest_events())
    ids = [event.event_id for event in received]
    # Every round stores 2 blocks; once the 16 slots are full, each round also removes 2 older ones.
    assert len(ids) > 2 * ROUNDS
    assert ids == list(range(len(ids)))


def test_iteration_stats_taken_from_another_thread_add_up() -> None:
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB))
    prompt = list(range(2 * TPB))
    first = manager.create_kv_cache(input_tokens=prompt)
    assert first.resume() and first.resize(len(prompt))
    first.commit(prompt)
    first.close()
    manager.get_iteration_stats()
    taken: list[tuple[int, int, int]] = []

    def scheduler() -> None:
        for round_index in range(ROUNDS):  # reuses the prompt's 2 blocks, misses 1, allocates 1
            tokens = prompt + [10_000 + round_index] * TPB
            cache = manager.create_kv_cache(input_tokens=tokens)
            assert cache.resume() and cache.resize(len(tokens))
            cache.close()

    def take() -> None:
        for stats in manager.get_iteration_stats():
            taken.append((stats.reused_full_blocks, stats.missed_blocks, stats.allocated_pages))

    run_beside(scheduler, take)
    take()
    assert [sum(column) for column in zip(*taken)] == [2 * ROUNDS, ROUNDS, ROUNDS]


def test_an_event_reader_whose_events_another_reader_took_waits_on_for_the_next_flush() -> None:
    events = KVCacheEventManager(10)
    taken: list[list[KVCacheEvent]] = []
    readers = [
        threading.Thread(target=lambda: taken.append(events.get_latest_events(timeout_ms=60_000))) for _ in range(2)
    ]
    for reader in readers:
        reader.start()
    time.sleep(0.2)  # both readers waiting (a reader that starts later is not woken early: the test still holds)
    for flush in range(2):
        events.add_removed_event(bytes([flush]) * 32)
        events.flush_iteration_events()
        deadline = time.monotonic() + 10
        while len(taken) <= flush and time.monotonic() < deadline:
            time.sleep(0.001)
    for reader in readers:
        reader.join(10)
    assert sorted(len(batch) for batch in taken) == [1, 1], f"a reader woke up to nothing: {taken}"


@pytest.mark.parametrize(
    ("timeout_ms", "error"), [("5", TypeError), (True, TypeError), (float("nan"), ValueError)]
)
def test_an_event_reader_timeout_that_is_not_a_number_of_milliseconds_is_refused(
    timeout_ms: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="timeout_ms"):  # the parameter is SupportsFloat: no mypyc check before ours
        KVCacheEventManager(10).get_latest_events(timeout_ms)  # type: ignore[arg-type]


def test_an_event_reader_may_wait_without_limit() -> None:
    events = KVCacheEventManager(10)
    taken: list[list[KVCacheEvent]] = []
    reader = threading.Thread(target=lambda: taken.append(events.get_latest_events(timeout_ms=math.inf)))
    reader.start()
    events.add_removed_event(b"k" * 32)
    events.flush_iteration_events()
    reader.join(10)
    assert [len(batch) for batch in taken] == [1]


class PausingEventManager(KVCacheEventManager):
    """Holds a stored event's hook on a thread other than the main one until the main thread made its call: user
    code run by a close that a read on that thread started."""

    def __init__(self) -> None:
        super().__init__(100)
        self.hook_threads: list[str] = []
        self.inside = threading.Event()
        self.main_called = threading.Event()

    def add_stored_event(self, *args: Any, **kwargs: Any) -> None:
        self.hook_threads.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            self.inside.set()
            self.main_called.wait(10)
        super().add_stored_event(*args, **kwargs)


def manager_with_a_partial_block_cache() -> tuple[KVCacheManager, PausingEventManager, KVCache]:
    """A manager whose stored-event hook pauses off the main thread, and a cache with a committed partial last block: closing it
    stores that block, so a close runs a hook (on whatever thread does the close)."""
    events = PausingEventManager()
    manager = KVCacheManager(
        make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB, enable_partial_reuse=True),
        events,
    )
    tokens = list(range(TPB + 4))
    cache = manager.create_kv_cache(input_tokens=tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)
    return manager, events, cache


def test_counting_live_caches_on_another_thread_closes_nothing_beside_the_scheduler() -> None:
    """``num_live_caches`` on a metrics thread while a dropped handle waits to be closed: the close (and the hooks
    it runs) stays on the scheduler thread, whose next call is never refused as re-entrant."""
    manager, events, cache = manager_with_a_partial_block_cache()
    del cache  # dropped without close: queued for the scheduler thread's next call
    counted: list[int] = []
    reader = threading.Thread(target=lambda: counted.append(manager.num_live_caches), name="metrics")
    reader.start()
    while reader.is_alive() and not events.inside.is_set():
        reader.join(0.001)
    try:
        manager.create_kv_cache(input_tokens=[1, 2, 3]).close()  # the scheduler thread's next call
    finally:
        events.main_called.set()
        reader.join(10)
    assert counted == [1]  # the dropped cache counted as open: the metrics thread closed nothing
    assert "metrics" not in events.hook_threads and manager.num_live_caches == 0


def test_a_call_from_a_second_thread_during_a_call_is_refused_naming_the_threads() -> None:
    """A state-changing call made on another thread while the scheduler thread's call is in flight (here: waiting in
    its priority callback) is refused, and the error says it is a second thread, not a re-entrant callback."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB))
    refusals: list[str] = []
    other = threading.Thread(name="intruder", target=lambda: refusals.append(refused(manager)))

    def priority(ordinal: int, life_cycle: object) -> int:
        if not other.is_alive() and not refusals:
            other.start()
            other.join(10)
        return 50

    cache = manager.create_kv_cache(input_tokens=list(range(TPB)), custom_priority_callback=priority)
    assert cache.resume() and cache.resize(TPB)
    cache.close()
    assert len(refusals) == 1 and "on thread 'intruder'" in refusals[0] and "on another thread" in refusals[0]
    assert "KVCache.resume" in refusals[0] or "KVCache.resize" in refusals[0], refusals[0]
    assert manager.num_live_caches == 0


def test_two_threads_driving_one_manager_are_never_inside_calls_at_once() -> None:
    """Misuse the guard diagnoses: two threads making state-changing calls. Each call is either refused or runs
    alone, never beside the other thread's (the guard's test and mark are one step: a thread switch between a test
    and a mark let both threads in, and their closes then pruned one radix tree node twice)."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=64 * KIB, tokens_per_block=TPB))
    inside: set[int] = set()
    overlaps: list[int] = []
    watch = threading.Lock()

    def priority(ordinal: int, life_cycle: object) -> int:  # asked inside resize, for each new block
        with watch:
            overlaps.extend([len(inside)] if inside else [])
            inside.add(threading.get_ident())
        time.sleep(0)  # the other thread runs while this one is inside a call
        with watch:
            inside.discard(threading.get_ident())
        return 50

    def insist(call: Callable[[], object]) -> Any:
        while True:
            try:
                return call()
            except RuntimeError as error:
                if "in flight" not in str(error):
                    raise
                time.sleep(0)  # let the call in flight end

    def drive(first_token: int) -> None:
        for round_index in range(200):
            tokens = [first_token + round_index] * (2 * TPB)
            cache = insist(lambda: manager.create_kv_cache(input_tokens=tokens, custom_priority_callback=priority))
            assert insist(cache.resume) and insist(lambda: cache.resize(len(tokens)))
            insist(cache.close)

    run_beside(lambda: drive(0), lambda: drive(10_000))
    assert len(overlaps) == 0, f"{len(overlaps)} times two threads were inside manager calls at once"
    assert manager.num_live_caches == 0
    manager.check_invariants()


def refused(manager: KVCacheManager) -> str:
    try:
        manager.create_kv_cache(input_tokens=[1, 2, 3]).close()
    except RuntimeError as error:
        return str(error)
    return "not refused"


def test_get_usage_on_another_thread_is_refused_naming_it() -> None:
    """``get_usage`` sums counts the scheduler thread changes (a page dropped between two of its reads is counted
    reusable and free): on a metrics thread it is refused, even between two calls, and says what that thread may
    read instead; the scheduler thread reads it as before."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB))
    serve(manager, 3, commit=True)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            manager.get_usage()
        except BaseException as error:
            errors.append(error)

    reader = threading.Thread(target=read, name="metrics")
    reader.start()
    reader.join(10)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "on thread 'metrics', not the scheduler thread" in str(errors[0])
    assert "get_storage_statistics" in str(errors[0])
    (usage,) = manager.get_usage()
    assert usage.used == 0 and usage.reusable == 6 and usage.free == usage.total - 6
    assert manager.num_live_caches == 0


def test_dirty_stats_ids_on_another_thread_are_refused_naming_it() -> None:
    """``get_dirty_stats_kv_cache_ids`` copied the set the scheduler thread's calls change, on any thread and in the
    middle of a call: a metrics thread got ids for ``commit_pending_stats`` calls only the scheduler thread may
    make, possibly of a cache a failing call was about to take back. Refused there as ``get_usage`` is."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB))
    looked_up = manager.create_kv_cache(input_tokens=list(range(TPB)), id=4)
    errors: list[BaseException] = []
    answers: list[set[int]] = []

    def read() -> None:
        try:
            answers.append(manager.get_dirty_stats_kv_cache_ids())
        except BaseException as error:
            errors.append(error)

    reader = threading.Thread(target=read, name="metrics")
    reader.start()
    reader.join(10)
    assert answers == [] and len(errors) == 1 and isinstance(errors[0], RuntimeError), (answers, errors)
    assert "get_dirty_stats_kv_cache_ids was called on thread 'metrics', not the scheduler thread" in str(errors[0])
    assert manager.get_dirty_stats_kv_cache_ids() == {4}
    looked_up.commit_pending_stats()
    assert manager.get_dirty_stats_kv_cache_ids() == set()
    looked_up.close()
    manager.shutdown()


def test_a_read_on_another_thread_between_calls_leaves_the_scheduler_its_get_usage() -> None:
    """A router thread asking ``probe_reuse`` (or a debug thread ``check_invariants``) between two scheduler calls
    changes nothing, so it does not become the scheduler thread. Before: it did, and the scheduler thread's next
    ``get_usage`` was refused ('get_usage was called on thread 'MainThread', not the scheduler thread')."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB))
    serve(manager, 3, commit=True)
    probed: list[int] = []

    def route() -> None:
        probed.append(manager.probe_reuse(None, list(range(3 * TPB))))
        manager.check_invariants()

    router = threading.Thread(target=route, name="router")
    router.start()
    router.join(10)
    assert probed == [2 * TPB]  # round 0's two committed blocks
    (usage,) = manager.get_usage()
    assert usage.used == 0 and usage.reusable == 6
    assert manager.num_live_caches == 0


def test_get_usage_from_a_callback_mid_call_is_refused() -> None:
    """Inside a priority callback the pages are half moved: ``get_usage`` there is refused like any other call."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB))
    seen: list[str] = []

    def priority(ordinal: int, life_cycle: object) -> int:
        try:
            manager.get_usage()
        except RuntimeError as error:
            seen.append(str(error))
        return 50

    cache = manager.create_kv_cache(input_tokens=list(range(TPB)), custom_priority_callback=priority)
    assert cache.resume() and cache.resize(TPB)
    cache.close()
    assert seen and all("KVCacheManager.get_usage was called while" in text for text in seen), seen


def test_a_handle_collected_on_another_thread_mid_call_is_closed_at_the_next_call() -> None:
    """The cycle collector finalizes a dropped ``KVCache`` on a user's thread while the scheduler thread's call is
    stopped in its priority callback: the finalizer only queues the cache (nothing runs beside the call in flight,
    no hook on that thread), and the scheduler thread's next call closes it."""
    manager, events, dropped = manager_with_a_partial_block_cache()
    box: list[object] = [dropped]
    box.append(box)  # reachable only from a cycle: only the collector finalizes it
    del dropped, box
    live_mid_call: list[int] = []
    collector = threading.Thread(name="metrics", target=gc.collect)

    def priority(ordinal: int, life_cycle: object) -> int:
        if not collector.is_alive() and not live_mid_call:
            gc.disable()  # the collector runs on the other thread only
            try:
                collector.start()
                collector.join(10)
            finally:
                gc.enable()
            live_mid_call.append(manager.num_live_caches)
        return 50

    cache = manager.create_kv_cache(input_tokens=[1, 2, 3], custom_priority_callback=priority)
    assert cache.resume() and cache.resize(3)
    assert live_mid_call == [2]  # collected on "metrics", still open inside the call
    assert manager.num_live_caches == 1  # the read after the call, on the scheduler thread, closed it
    assert "metrics" not in events.hook_threads
    cache.close()
    manager.shutdown()


def assert_shutdown_ends_an_unlimited_wait(events: KVCacheEventManager, manager: KVCacheManager) -> None:
    """A reader waiting in ``get_latest_events(math.inf)`` (the created event taken first) returns with nothing
    once ``manager``, the last one feeding ``events``, shuts down."""
    events.flush_iteration_events()
    events.get_latest_events()  # the created event
    taken: list[list[KVCacheEvent]] = []
    reader = threading.Thread(target=lambda: taken.append(events.get_latest_events(timeout_ms=math.inf)), daemon=True)
    reader.start()
    manager.shutdown()
    reader.join(10)
    stuck = reader.is_alive()
    if stuck:  # release it for the next tests
        events.add_removed_event(b"k" * 32)
        events.flush_iteration_events()
    assert not stuck and taken == [[]]


def test_an_event_reader_waiting_without_limit_returns_when_the_manager_shuts_down() -> None:
    """An engine's events thread waits in ``get_latest_events(math.inf)``; after the scheduler shuts the manager
    down no flush will ever come, so the wait ends (the engine can join that thread) and later reads do not wait."""
    events = KVCacheEventManager(10)
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB), events)
    assert_shutdown_ends_an_unlimited_wait(events, manager)
    assert events.get_latest_events(timeout_ms=math.inf) == []  # nothing comes: no wait


def test_event_readers_wait_until_the_last_manager_feeding_them_shuts_down() -> None:
    """Two managers record into one event manager: the first one's shutdown leaves readers waiting for the
    other's flushes; the second one's ends the wait."""
    events = KVCacheEventManager(10)
    first, second = (
        KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB), events)
        for _ in range(2)
    )
    events.flush_iteration_events()
    events.get_latest_events()
    first.shutdown()
    taken: list[list[KVCacheEvent]] = []
    reader = threading.Thread(target=lambda: taken.append(events.get_latest_events(timeout_ms=math.inf)), daemon=True)
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # the second manager may still flush
    second.shutdown()
    reader.join(10)
    assert not reader.is_alive() and taken == [[]]


class UnreachableStoreConfig:
    """A remote store whose master is not up yet: ``open`` fails the manager's construction."""

    def open(self, quota: int) -> RemoteStore:
        raise RemoteStoreError("the store's master is not reachable")


class FailingCreatedHook(KVCacheEventManager):
    """An event manager whose hook fails the first manager built on it (at its created event)."""

    def __init__(self) -> None:
        super().__init__(10)
        self.fail = True

    def add_created_event(self, num_blocks_per_cache_level: Sequence[int], layer_group_ids: Sequence[int] | None = None) -> None:
        if self.fail:
            self.fail = False
            raise RuntimeError("the created event's hook failed")
        super().add_created_event(num_blocks_per_cache_level, layer_group_ids)


@pytest.mark.parametrize("failure", ["remote store open", "created event hook"])
def test_a_manager_whose_construction_failed_leaves_readers_to_the_next_managers_shutdown(failure: str) -> None:
    """A construction that fails once the manager counts among the event manager's feeders (its remote store not
    reachable yet, a hook raising) must not stay counted: the manager built next (the engine's retry) is then the
    last feeder, and its shutdown ends the readers' waits. Before the fix the failed one stayed counted and a
    reader waiting without limit was never released (the engine could not join its events thread)."""
    events = FailingCreatedHook() if failure == "created event hook" else KVCacheEventManager(10)
    if failure == "remote store open":
        tiers: list[CacheTierConfig] = [
            GpuCacheTierConfig(16 * KIB), RemoteCacheTierConfig(0, UnreachableStoreConfig(), namespace="t")
        ]
        with pytest.raises(RemoteStoreError, match="not reachable"):
            KVCacheManager(make_config([attention(0, 512)], tiers=tiers, tokens_per_block=TPB), events)
    else:
        with pytest.raises(RuntimeError, match="hook failed"):
            KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB), events)
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=16 * KIB, tokens_per_block=TPB), events)
    assert_shutdown_ends_an_unlimited_wait(events, manager)
