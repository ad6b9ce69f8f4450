"""A long-running server opens and closes caches, managers and connections for weeks: nothing a request or a
manager leaves behind may accumulate (objects, descriptors, threads). Counts, never timings
(``tests/steady_state.py``)."""

from __future__ import annotations

import ast
import gc
import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Sequence

import pytest

from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheEvent,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
    RemoteCacheTierConfig,
    ReuseScope,
)
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.fuzz.faulty_tiers import pool_files_cut
from tests.helpers import KIB, MIB, attention, compute_prompt, make_config, seeded_prompt, ssm
from tests.steady_state import grown_after, open_descriptors

needs_proc_fd = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")


def disk_manager(directory: Path) -> KVCacheManager:
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(4 * MIB),
        HostCacheTierConfig(4 * MIB),
        DiskCacheTierConfig(4 * MIB, str(directory)),
    ]
    return KVCacheManager(make_config([attention(0), attention(1, window=64)], tiers=tiers))


@needs_proc_fd
def test_a_manager_dropped_without_shutdown_closes_its_disk_pool_files(tmp_path: Path) -> None:
    """Before: each disk pool's descriptor stayed open once its manager was collected without ``shutdown``
    (an unlinked file: its disk blocks were never given back); three managers left 3 ``(deleted)`` pool files open."""
    gc.collect()
    before = open_descriptors()
    for seed in range(3):
        manager = disk_manager(tmp_path)
        compute_prompt(manager, FakeEngine(manager), seeded_prompt(seed)).close()
        del manager
        gc.collect()
    assert open_descriptors() == before


@pytest.mark.parametrize("gather", [None, "failing"], ids=["never_flushed", "gather_always_failing"])
def test_events_waiting_for_a_flush_are_bounded_like_the_delivered_ones(gather: str | None) -> None:
    """Before: ``KVCacheEventManager`` kept every event recorded since the last successful flush, without bound
    (an engine that never flushes, a rank that stays unreachable): the second 500 events grew KVCacheEvent by
    500 (gather_always_failing: the same) and KVCacheRemovedData by 500. A flush delivers at most
    ``max_kv_event_entries`` of them (the newest), so only those wait."""

    def unreachable(mine: list[KVCacheEvent]) -> list[list[KVCacheEvent]]:
        raise ConnectionError("a rank is unreachable")

    events = KVCacheEventManager(
        10, attention_dp_rank=0 if gather else None, attention_dp_gather=unreachable if gather else None
    )
    recorded = [0]

    def record(count: int) -> None:
        for _ in range(count):
            events.add_removed_event(recorded[0].to_bytes(32, "big"))
            recorded[0] += 1
        if gather:
            with pytest.raises(ConnectionError):
                events.flush_iteration_events()

    assert grown_after(record, 500) == {}
    if gather:
        return
    events.flush_iteration_events()
    latest = events.get_latest_events()
    assert [event.event_id for event in latest] == list(range(990, 1000))  # the newest, as before
    assert [event.data for event in latest] == [KVCacheRemovedData([i.to_bytes(32, "big")]) for i in range(990, 1000)]


class FailingStoredHook(KVCacheEventManager):
    def add_stored_event(
        self, parent_hash: bytes | None, blocks: Sequence[KVCacheStoredBlockData], layer_group_id: int | None = None
    ) -> None:
        raise RuntimeError("the hook failed")


def live_objects_named(name: str) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj).__name__ == name)


def test_a_hook_error_kept_for_the_next_flush_keeps_no_manager_alive() -> None:
    """Before: the kept error's traceback held the frames of the call it interrupted and, through ``f_back``,
    their callers': the ``KVCache`` handle that committed and the manager stayed alive as long as the (user's)
    event manager did without a flush (1 KVCacheManager and 1 KVCache live after both were dropped)."""
    events = FailingStoredHook(100)
    managers_before, handles_before = live_objects_named("KVCacheManager"), live_objects_named("KVCache")
    manager = KVCacheManager(make_config([attention(0)]), event_manager=events)
    cache = compute_prompt(manager, FakeEngine(manager), seeded_prompt(0))  # the commit's hook call raised
    cache.close()
    manager.shutdown()
    del manager, cache
    assert (live_objects_named("KVCacheManager"), live_objects_named("KVCache")) == (managers_before, handles_before)
    with pytest.raises(RuntimeError, match="the hook failed") as raised:
        events.flush_iteration_events()  # still raised by the next flush, still saying where it came from
    if sys.version_info >= (3, 11):
        assert "in add_stored_event" in "\n".join(getattr(raised.value, "__notes__", []))


@needs_proc_fd
def test_a_logged_disk_error_keeps_no_manager_alive(tmp_path: Path) -> None:
    """A handler may keep log records (``MemoryHandler``, a test's capture). Before: the remote tier logged the
    disk tier's ``OSError`` object itself as an argument, whose traceback held the failing call's frames and so
    the manager: still alive (1 KVCacheManager) after shutdown and del while the records were kept."""
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(128 * KIB),  # two prompts of 4 blocks of 16 KiB
        DiskCacheTierConfig(1 * MIB, str(tmp_path)),
        RemoteCacheTierConfig(0, MemoryStoreConfig(), "leaks", write_through=False),
    ]
    records = logging.handlers.MemoryHandler(capacity=10_000, flushLevel=logging.CRITICAL + 1)
    package_logger = logging.getLogger("kv_cache_manager_v2")
    package_logger.addHandler(records)
    try:
        managers_before = live_objects_named("KVCacheManager")
        manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
        engine = FakeEngine(manager)
        for seed in range(4):  # the first two prompts' pages pushed on to the disk tier
            compute_prompt(manager, engine, seeded_prompt(seed)).close()
        with pool_files_cut():
            manager.clear_reusable_blocks()  # storing the disk pages fails: logged
        assert any("failed" in record.getMessage() for record in records.buffer)
        manager.shutdown()
        del manager, engine
        assert live_objects_named("KVCacheManager") == managers_before
    finally:
        package_logger.removeHandler(records)


LOG_CALLS = {"debug", "info", "warning", "error", "critical", "exception", "log"}
PACKAGE_SOURCES = Path(__file__).resolve().parent.parent / "kv_cache_manager_v2"  # compiled mode too


def test_no_log_call_of_the_package_passes_a_caught_error_itself() -> None:
    """The shape of the case above, everywhere: a log argument that is the error an ``except`` caught keeps the
    traceback (and the frames of the failing call) in every record a handler keeps; pass ``str(error)``. Before:
    found 2 (``_remote/tier.py``)."""
    found: list[str] = []
    for path in sorted(PACKAGE_SOURCES.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for handler in ast.walk(tree):
            if not isinstance(handler, ast.ExceptHandler) or handler.name is None:
                continue
            for node in ast.walk(handler):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LOG_CALLS
                    and any(isinstance(arg, ast.Name) and arg.id == handler.name for arg in node.args)
                ):
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []



def test_events_only_an_event_manager_asked_for_are_not_queued_for_get_latest_events() -> None:
    """With an event manager attached and ``enable_kv_events`` off, nobody drains the manager's own queue.
    Before: every event went into it anyway (up to ``max_kv_events``, 10,000 by default, with their token tuples):
    the second 50 prompts left 400 more KVEvent objects alive, and ``get_latest_events`` returned them although
    it is documented as empty unless ``enable_kv_events``."""
    events = KVCacheEventManager(10)
    # 32 slots: the radix tree holds 8 prompts, so the first 50 fill it and the next 50 only replace what it holds
    manager = KVCacheManager(make_config([attention(0)], gpu_quota=256 * KIB), event_manager=events)
    engine = FakeEngine(manager)
    served = [0]

    def serve(count: int) -> None:
        for _ in range(count):
            compute_prompt(manager, engine, seeded_prompt(served[0])).close()
            served[0] += 1
        events.flush_iteration_events()

    assert grown_after(serve, 50) == {}
    assert manager.get_latest_events() == []
    assert len(events.get_latest_events()) == 10  # the event manager still gets every event
    manager.shutdown()


def test_a_serving_loop_over_every_tier_reaches_a_steady_state(tmp_path: Path) -> None:
    """Requests of every shape on a hybrid manager with host, disk and remote tiers and KV events (never drained):
    once the tiers are full, 300 more requests leave nothing behind per request. Counts move by a few dozen as the
    radix tree changes shape (a node's children dict comes and goes); a leak of one object every third request
    would be 100."""
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(2 * MIB),
        HostCacheTierConfig(2 * MIB),
        DiskCacheTierConfig(2 * MIB, str(tmp_path)),
        RemoteCacheTierConfig(0, MemoryStoreConfig(), "leaks"),
    ]
    manager = KVCacheManager(
        make_config(
            [attention(0), attention(1, window=64), ssm(2)],
            tiers=tiers,
            enable_kv_events=True,
            max_kv_events=500,
            commit_min_snapshot=True,
        )
    )
    engine = FakeEngine(manager)
    served = [0]

    def serve(count: int) -> None:
        for _ in range(count):
            served[0] += 1
            tokens = seeded_prompt(served[0] % 29, 40 + served[0] * 13 % 200)
            cache = manager.create_kv_cache(ReuseScope(salt=served[0] % 3), tokens[:-1], id=10**9 + served[0])
            if not cache.resume():
                cache.close()
                continue
            for end in (len(tokens) // 32 * 32, len(tokens)):  # a chunk ending on a block: an SSM snapshot there
                if end > cache.history_length and cache.resize(end, cache.history_length):
                    engine.step(cache, tokens)
                    cache.commit(tokens[cache.num_committed_tokens : end])
            cache.resize(10**6, cache.history_length)  # refused: kept as last_refusal
            if served[0] % 3 == 0:
                cache.suspend()
                cache.resume()  # back from wherever its pages went meanwhile (or refused: still suspended)
            if served[0] % 3 != 2:
                cache.close()
            # else: dropped without close (closed at the next call)

    grown = grown_after(serve, 300)
    assert {name: count for name, count in grown.items() if count >= 100} == {}
    manager.shutdown()
