"""Disk tier faults degrade to misses or a clear error, never a wrong page: a failed read or write of the pool file
(provoked for real through the process's own descriptors, ``tests/fuzz/faulty_tiers.py``: the pool file opened
again write-only, ``/dev/full``, an empty file opened read-only) leaves the manager consistent and usable, no
later call serves a page whose bytes never arrived (FakeEngine checks the content), and the KV events name no block
whose pages were lost."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

import pytest

from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheRequest,
    RemoteCacheTierConfig,
)
from kv_cache_manager_v2._base.types import PageContentLostError
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.fuzz.faulty_tiers import disk_fault, pool_files_cut, pool_files_replaced
from tests.helpers import KIB, attention, make_config, seeded_prompt, serve_checked

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")

TPB = 32
SLOT = 16 * KIB  # one layer: 8 KiB K + 8 KiB V a block
BLOCKS = 4  # a prompt's blocks



def manager_on(directory: Path, gpu_slots: int = 2 * BLOCKS, events: bool = False) -> KVCacheManager:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_slots * SLOT), DiskCacheTierConfig(64 * SLOT, str(directory))]
    return KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, enable_kv_events=events))


def unreadable() -> contextlib.AbstractContextManager[None]:
    return disk_fault(0)  # preadv: EBADF; pwritev still lands in the file


def unwritable() -> contextlib.AbstractContextManager[None]:
    return disk_fault(1)  # /dev/full: pwritev ENOSPC (and preadv EBADF)


def serve(manager: KVCacheManager, engine: FakeEngine, seed: int) -> None:
    serve_checked(manager, engine, seeded_prompt(seed, BLOCKS * TPB))


def reused_and_checked(manager: KVCacheManager, engine: FakeEngine, seed: int) -> int:
    """Open the prompt again: what it reuses must hold the prompt's records."""
    tokens = seeded_prompt(seed)
    cache = manager.create_kv_cache(input_tokens=tokens[:-1])
    assert cache.resume()
    reused = cache.history_length
    engine.check(cache, tokens[:reused])
    cache.close()
    manager.check_invariants()
    return reused


def on_disk(manager: KVCacheManager, engine: FakeEngine) -> None:
    """Prompts 0 and 1 committed and pushed to the disk tier by prompts 2 and 3."""
    for seed in range(4):
        serve(manager, engine, seed)
    gpu, disk = manager.get_usage()
    assert gpu.reusable == 2 * BLOCKS and disk.reusable == 2 * BLOCKS


def test_failed_disk_read_on_resume_raises_and_the_pages_become_a_miss(tmp_path: Path) -> None:
    manager = manager_on(tmp_path)
    engine = FakeEngine(manager)
    on_disk(manager, engine)
    tokens = seeded_prompt(0)
    cache = manager.create_kv_cache(input_tokens=tokens[:-1])
    assert cache.history_length == BLOCKS * TPB - 1
    with unreadable(), pytest.raises(PageContentLostError, match=r"cache \d+ cannot resume.*EBADF|Bad file") as raised:
        cache.resume()
    assert "close it and create the request again" in str(raised.value)
    assert cache.status == _KVCache.Status.SUSPENDED
    manager.check_invariants()
    assert manager.movement_counters.lost_pages == BLOCKS
    with pytest.raises(PageContentLostError):  # never resumed with pages whose bytes never arrived
        cache.resume()
    assert manager.probe_reuse(None, tokens[:-1]) == 0  # the lost blocks left the tree
    cache.close()
    manager.check_invariants()
    assert reused_and_checked(manager, engine, 1) == BLOCKS * TPB - 1  # the disk works again: served, intact
    for seed in (2, 3):  # written to disk while reads failed: intact wherever they are
        assert reused_and_checked(manager, engine, seed) == BLOCKS * TPB - 1
    serve(manager, engine, 0)  # recomputed
    assert reused_and_checked(manager, engine, 0) == BLOCKS * TPB - 1


def test_short_reads_are_misses(tmp_path: Path) -> None:
    """An empty file in place of the pool file: every read comes back short (0 bytes), writes fail."""
    manager = manager_on(tmp_path)
    engine = FakeEngine(manager)
    on_disk(manager, engine)
    empty = tmp_path / "empty"
    empty.touch()
    with pool_files_replaced(str(empty), os.O_RDONLY), pytest.raises(PageContentLostError, match="read 0 of"):
        manager.create_kv_cache(input_tokens=seeded_prompt(1)[:-1]).resume()
    manager.check_invariants()
    assert manager.probe_reuse(None, seeded_prompt(1)[:-1]) == 0
    for seed in range(4, 8):
        serve(manager, engine, seed)
    assert reused_and_checked(manager, engine, 4) == BLOCKS * TPB - 1


def test_failed_disk_write_drops_the_evicted_pages(tmp_path: Path) -> None:
    manager = manager_on(tmp_path)
    engine = FakeEngine(manager)
    on_disk(manager, engine)
    dropped = manager.movement_counters.dropped_pages
    with unwritable():
        serve(manager, engine, 4)  # evicts prompt 2 to disk: the writes fail
    manager.check_invariants()
    assert manager.movement_counters.lost_pages == BLOCKS
    assert manager.movement_counters.dropped_pages == dropped + BLOCKS
    assert manager.probe_reuse(None, seeded_prompt(2)[:-1]) == 0  # a miss, not a page of zeros
    for seed in (0, 1, 3, 4):  # untouched
        assert reused_and_checked(manager, engine, seed) == BLOCKS * TPB - 1


def test_failed_disk_write_of_a_suspended_cache_refuses_its_resume(tmp_path: Path) -> None:
    manager = manager_on(tmp_path, gpu_slots=BLOCKS)
    engine = FakeEngine(manager)
    tokens = seeded_prompt(9)
    waiting = manager.create_kv_cache()
    assert waiting.resume() and waiting.resize(len(tokens))
    engine.step(waiting, tokens)
    waiting.suspend()
    with unwritable():
        serve(manager, engine, 1)  # pushes the suspended cache's pages to disk: lost
    manager.check_invariants()
    with pytest.raises(PageContentLostError, match="cannot resume"):
        waiting.resume()
    assert waiting.status == _KVCache.Status.SUSPENDED
    manager.check_invariants()
    waiting.close()
    manager.check_invariants()
    gpu, disk = manager.get_usage()
    assert gpu.held == disk.held == 0 and disk.used == 0
    serve(manager, engine, 2)


def test_failed_disk_read_on_prefetch_is_kept_from_the_resume(tmp_path: Path) -> None:
    manager = manager_on(tmp_path)
    engine = FakeEngine(manager)
    on_disk(manager, engine)
    manager.clear_reusable_blocks()  # room on the GPU
    serve(manager, engine, 5)
    cache = manager.create_kv_cache(input_tokens=seeded_prompt(5)[:-1])
    other = manager.create_kv_cache(input_tokens=seeded_prompt(5)[:-1])  # a second user of the same pages
    assert cache.offload() == BLOCKS
    with unreadable():
        assert cache.prefetch() == BLOCKS  # a hint: moved as far as the bookkeeping goes, the bytes did not
    manager.check_invariants()
    for user in (cache, other):
        with pytest.raises(PageContentLostError):
            user.resume()
    cache.close()
    other.close()
    manager.check_invariants()
    assert manager.get_usage()[0].held == 0
    serve(manager, engine, 5)


def test_failed_disk_read_in_a_batch_admission_refuses_that_request(tmp_path: Path) -> None:
    manager = manager_on(tmp_path)
    engine = FakeEngine(manager)
    on_disk(manager, engine)
    requests = [KVCacheRequest(seeded_prompt(0)[:-1], num_new_tokens=1), KVCacheRequest(seeded_prompt(50), num_new_tokens=TPB)]
    with unreadable():
        caches = manager.create_kv_cache_batch(requests)
    manager.check_invariants()
    assert caches[0] is None  # its matched pages were on disk
    # Explained like any refused request (before: last_batch_refusals[0] was None, "admitted", beside a None cache).
    lost = manager.last_batch_refusals[0]
    assert lost is not None and manager.last_refusal == lost and manager.last_batch_refusals[1] is None
    assert lost.call == "create_kv_cache_batch" and lost.fits_empty_manager and "lost their content" in lost.detail
    admitted = caches[1]
    assert admitted is not None and admitted.capacity == TPB
    engine.step(admitted, seeded_prompt(50)[:TPB])
    engine.check(admitted, seeded_prompt(50)[:TPB])
    admitted.close()
    manager.check_invariants()
    assert manager.probe_reuse(None, seeded_prompt(0)[:-1]) == 0
    serve(manager, engine, 0)


def two_instances_sharing_a_store(tmp_path: Path) -> tuple[KVCacheManager, Callable[[], KVCacheManager]]:
    """A GPU + disk instance with a shared store (no write-through: pages reach it when dropped), and how to make a
    second one sharing that store."""
    store = MemoryStoreConfig()

    def instance(directory: Path) -> KVCacheManager:
        directory.mkdir()
        tiers: list[CacheTierConfig] = [
            GpuCacheTierConfig(2 * BLOCKS * SLOT),
            DiskCacheTierConfig(64 * SLOT, str(directory)),
            RemoteCacheTierConfig(0, store, "disk-faults", write_through=False),
        ]
        return KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))

    return instance(tmp_path / "a"), lambda: instance(tmp_path / "b")


def test_a_page_lost_on_its_way_to_disk_never_reaches_the_remote_store(tmp_path: Path) -> None:
    """Without write-through, a page goes to the shared store when dropped; a page dropped because its disk write
    failed holds no valid bytes there, so it is not stored (another instance would be served it)."""
    manager, other_instance = two_instances_sharing_a_store(tmp_path)
    engine = FakeEngine(manager)
    on_disk(manager, engine)
    with unwritable():
        serve(manager, engine, 4)  # prompt 2's disk writes fail: dropped
    assert manager.movement_counters.lost_pages == BLOCKS
    other = other_instance()  # a second instance sharing the store
    assert reused_and_checked(other, FakeEngine(other), 2) == 0
    other.shutdown()
    manager.shutdown()


def test_a_disk_page_dropped_from_a_file_cut_short_is_not_stored_and_kills_nothing(tmp_path: Path) -> None:
    """The remote tier reads a dropped disk page by positioned I/O: from a pool file cut short that is an OSError
    and the page is not stored; through the file's mapping it killed the process (SIGBUS, exit 135)."""
    manager, other_instance = two_instances_sharing_a_store(tmp_path)
    on_disk(manager, FakeEngine(manager))
    with pool_files_cut():
        manager.clear_reusable_blocks()  # drops every cached page: the store gets the GPU ones only
    statistics = manager.get_remote_tier_statistics()
    assert statistics is not None and statistics.stored_pages == 2 * BLOCKS and statistics.warnings == 2 * BLOCKS
    other = other_instance()  # a second instance sharing the store
    engine = FakeEngine(other)
    assert reused_and_checked(other, engine, 0) == 0  # prompt 0 was on disk
    assert reused_and_checked(other, engine, 2) == (BLOCKS - 1) * TPB  # prompt 2 was on the GPU (full blocks)
    other.shutdown()
    manager.shutdown()


def test_a_commit_matching_a_block_cached_on_disk_keeps_its_own_gpu_page(tmp_path: Path) -> None:
    """A cache computes a block that meanwhile entered the tree from another request and went down to the disk. Its
    commit keeps its own page (the same tokens, already on the GPU) as the block's content instead of bringing the
    disk copy back into the cache: a read failing there would have left this active cache a page without bytes."""
    manager = manager_on(tmp_path)
    engine = FakeEngine(manager)
    tokens = seeded_prompt(0)
    late = manager.create_kv_cache(input_tokens=tokens[:-1])  # before prompt 0 is cached: it matches nothing
    for seed in range(4):  # prompt 0 committed, then pushed down to the disk by prompts 2 and 3
        serve(manager, engine, seed)
    assert manager.get_usage()[1].reusable == 2 * BLOCKS
    assert late.resume() and late.resize(len(tokens))
    engine.step(late, tokens)
    onboarded = manager.movement_counters.onboarded_pages
    with unreadable():
        late.commit(tokens)
    manager.check_invariants()
    assert manager.movement_counters.lost_pages == 0 and manager.movement_counters.onboarded_pages == onboarded
    engine.check(late, tokens)  # its own pages, bytes and all
    late.close()
    assert reused_and_checked(manager, engine, 0) == BLOCKS * TPB - 1  # the block holds the GPU copy now


class EventReplay:
    """What a KV-aware router knows from the manager's KV events: the blocks stored and not removed since."""

    def __init__(self) -> None:
        self.alive: dict[bytes, tuple[bytes | None, tuple[object, ...]]] = {}  # block hash -> (parent, tokens)

    def follow(self, manager: KVCacheManager) -> None:
        for event in manager.get_latest_events():
            if event.kind == "stored":
                assert event.block_hash not in self.alive, f"stored twice: {event}"
                self.alive[event.block_hash] = (event.parent_hash, tuple(event.tokens))
            else:
                assert event.block_hash in self.alive, f"{event.kind} for a block never stored: {event}"
                if event.kind == "removed":
                    del self.alive[event.block_hash]

    def blocks_of(self, tokens: list[int]) -> int:
        """How many of ``tokens``' leading blocks the events say are cached."""
        parent: bytes | None = None
        for index in range(len(tokens) // TPB):
            block = tuple(tokens[index * TPB : (index + 1) * TPB])
            found = [key for key, (up, held) in self.alive.items() if held == block and (index == 0 or up == parent)]
            if not found:
                return index
            parent = found[0]
        return len(tokens) // TPB


@pytest.mark.parametrize("fault", ["write", "read", "short read"])
def test_kv_events_name_no_block_whose_pages_a_disk_fault_lost(tmp_path: Path, fault: str) -> None:
    """A router following the KV events holds exactly the blocks a request can reuse, after each disk fault too: a
    page lost on its way to or from the disk is removed in the events as it leaves the tree."""
    manager = manager_on(tmp_path, events=True)
    engine = FakeEngine(manager)
    router = EventReplay()

    def agree() -> None:
        router.follow(manager)
        for seed in range(8):
            tokens = seeded_prompt(seed)
            assert router.blocks_of(tokens) == -(-manager.probe_reuse(None, tokens[:-1]) // TPB), seed

    on_disk(manager, engine)
    agree()
    lost = manager.movement_counters.lost_pages
    if fault == "write":
        with unwritable():
            serve(manager, engine, 4)  # evicts prompt 2 to disk: lost
    else:
        cache = manager.create_kv_cache(input_tokens=seeded_prompt(0)[:-1])
        empty = tmp_path / "empty"
        empty.touch()
        failing = unreadable() if fault == "read" else pool_files_replaced(str(empty), os.O_RDONLY)
        with failing, pytest.raises(PageContentLostError):
            cache.resume()
        cache.close()
    assert manager.movement_counters.lost_pages >= lost + BLOCKS  # a short read's file refuses writes as well
    agree()
    for seed in range(8):
        serve(manager, engine, seed)
    agree()
    manager.shutdown()


def test_a_shrink_whose_disk_file_refuses_to_be_cut_still_completes(tmp_path: Path) -> None:
    """A shrink gives the disk blocks past the kept slots back by cutting the pool file (``ftruncate``); a file that
    refuses (a filesystem remounted read-only, an I/O error; here ``/dev/full``, where it is EINVAL) keeps those
    blocks. Before, that ``OSError`` came out of ``manager.resize`` after the slots had shrunk (the quota not)."""
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(2 * BLOCKS * SLOT), DiskCacheTierConfig(8 * BLOCKS * SLOT, str(tmp_path), 16 * BLOCKS * SLOT)
    ]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    engine = FakeEngine(manager)
    assert manager.resize(1, 16 * BLOCKS * SLOT)
    for seed in range(14):  # 12 prompts' pages on disk: 48 of its 64 slots
        serve(manager, engine, seed)
    with unwritable():  # the compaction's reads fail too: what it moves is lost, what stays below is kept
        assert manager.resize(1, 8 * BLOCKS * SLOT)
    manager.check_invariants()
    assert manager.get_quota(1) == 8 * BLOCKS * SLOT and manager.get_storage_statistics(1)[0].total == 8 * BLOCKS
    kept = [seed for seed in range(14) if manager.probe_reuse(None, seeded_prompt(seed)[:-1]) > 0]
    assert kept and all(reused_and_checked(manager, engine, seed) == BLOCKS * TPB - 1 for seed in kept)
    for seed in range(20, 30):
        serve(manager, engine, seed)
    assert reused_and_checked(manager, engine, 20) == BLOCKS * TPB - 1
    manager.shutdown()


def test_growing_a_disk_tier_whose_file_refuses_more_blocks_is_a_refusal(tmp_path: Path) -> None:
    """Growing the disk tier reserves its blocks first (``posix_fallocate``); a file that refuses for another reason
    than a full filesystem (read-only, an I/O error; here ``/dev/full``: ENODEV) is refused the same way: False,
    explained, nothing changed. Before: ``OSError: [Errno 19] No such device`` out of ``manager.resize``."""
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(2 * BLOCKS * SLOT), DiskCacheTierConfig(16 * BLOCKS * SLOT, str(tmp_path))
    ]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    engine = FakeEngine(manager)
    for seed in range(6):
        serve(manager, engine, seed)
    assert manager.resize(1, 4 * BLOCKS * SLOT)
    with unwritable():
        assert not manager.resize(1, 16 * BLOCKS * SLOT)
    refusal = manager.last_refusal
    assert refusal is not None and refusal.level == 1 and "filesystem" in refusal.detail, refusal
    manager.check_invariants()
    assert manager.get_quota(1) == 4 * BLOCKS * SLOT and manager.get_storage_statistics(1)[0].total == 4 * BLOCKS
    assert all(reused_and_checked(manager, engine, seed) == BLOCKS * TPB - 1 for seed in (4, 5))
    assert manager.resize(1, 16 * BLOCKS * SLOT)  # the file works again
    for seed in range(6, 12):
        serve(manager, engine, seed)
    assert reused_and_checked(manager, engine, 6) == BLOCKS * TPB - 1
    manager.shutdown()
