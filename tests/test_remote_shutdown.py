"""How long ``shutdown`` and ``clear_reusable_blocks`` hand the pages they drop to the remote tier: one bound
(``bulk_write_back_deadline_s``) for the whole write-back, whatever ``retry_after_s`` says, left again afterwards,
over the fuzzer's in-memory store (``tests/fuzz/flaky_store.py``), whose stalled puts go through the real
``MooncakeStore``."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, RemoteCacheTierConfig, RemoteTierStatistics
from kv_cache_manager_v2._remote.tier import MAX_PENDING_BYTES
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import MemoryStoreConfig
from tests.fuzz.flaky_store import STALL_PUT, FlakyStoreConfig
from tests.helpers import MIB, attention, make_config

TPB = 16
PAGE_BYTES = 4 * MIB  # one layer's K and V of 2 MiB per block
BATCH = MAX_PENDING_BYTES // PAGE_BYTES  # pages that fill a put batch (with their headers)
NUM_PAGES = BATCH + 2  # two put batches at shutdown: a full one, then one of the last 2 pages


def _cached_write_back(backend: FlakyStoreConfig | MemoryStoreConfig, deadline_s: float = 10.0) -> KVCacheManager:
    """A manager storing pages only as they leave it (no write-through), holding ``NUM_PAGES`` cached blocks
    of a closed request: its ``shutdown`` (or ``clear_reusable_blocks``) hands them all to the store within
    ``deadline_s``."""
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(NUM_PAGES * PAGE_BYTES),
        RemoteCacheTierConfig(
            0,
            backend,
            namespace="shutdown",
            write_through=False,
            retry_after_s=0.0,
            bulk_write_back_deadline_s=deadline_s,
        ),
    ]
    manager = KVCacheManager(make_config([attention(0, 2 * MIB)], tiers=tiers, tokens_per_block=TPB))
    _cache_blocks(manager, list(range(NUM_PAGES * TPB + 1)))
    return manager


def _cache_blocks(manager: KVCacheManager, tokens: list[int]) -> None:
    """Commit the full blocks of ``tokens`` in a request that closes: they stay cached."""
    length = (len(tokens) - 1) // TPB * TPB
    cache = manager.create_kv_cache(input_tokens=tokens)
    assert cache.resume() and cache.resize(length)
    cache.commit(tokens[:length])
    cache.close()


def _after_shutdown(manager: KVCacheManager) -> RemoteTierStatistics:
    manager.shutdown()
    stats = manager.get_remote_tier_statistics()
    assert stats is not None
    return stats


def test_a_stalled_store_costs_shutdown_one_put_deadline_whatever_retry_after_s() -> None:
    """With ``retry_after_s`` 0 nothing kept the tier away after a failed put, so each 64 MiB batch of the write-back
    waited the stalled store's whole ``put_deadline_s`` (10 s by default): 2 stalled puts here, N for N batches.
    The write-back now ends at its first failed put; the pages left are counted as dropped, not stored."""
    backend = FlakyStoreConfig()
    manager = _cached_write_back(backend)
    backend.faults = [STALL_PUT] * 2
    stats = _after_shutdown(manager)
    client = backend.clients[0]
    client.complete_late()
    assert client.stalled_puts == 1 and client.problems == [], (client.stalled_puts, client.problems)
    assert (stats.stored_pages, stats.store_failures, stats.dropped_by_bulk_write_back) == (0, BATCH, 2), stats


def test_shutdown_deadline_bounds_the_write_back_and_counts_what_it_drops() -> None:
    """A healthy store takes the whole write-back within the default bound; ``bulk_write_back_deadline_s=0`` sends
    none of it and counts every page as dropped."""
    assert _after_shutdown(_cached_write_back(MemoryStoreConfig())).stored_pages == NUM_PAGES
    stats = _after_shutdown(_cached_write_back(MemoryStoreConfig(), deadline_s=0.0))
    assert (stats.stored_pages, stats.store_failures, stats.dropped_by_bulk_write_back) == (0, 0, NUM_PAGES), stats


def test_clear_reusable_blocks_has_the_same_bound_and_leaves_it_after() -> None:
    """``clear_reusable_blocks`` drops every cached page like ``shutdown`` but had no bound: each stalled batch
    waited a whole put deadline. It ends at its first failed put too, and the manager goes on: a page evicted
    after it is stored as usual (neither the deadline nor the failed put's stop sticks)."""
    backend = FlakyStoreConfig()
    manager = _cached_write_back(backend)
    backend.faults = [STALL_PUT] * 2
    manager.clear_reusable_blocks()
    client = backend.clients[0]
    client.complete_late()
    stats = manager.get_remote_tier_statistics()
    assert client.stalled_puts == 1 and client.problems == [], (client.stalled_puts, client.problems)
    assert stats is not None
    assert (stats.stored_pages, stats.store_failures, stats.dropped_by_bulk_write_back) == (0, BATCH, 2), stats
    backend.faults.clear()
    _cache_blocks(manager, list(range(1000, 1000 + NUM_PAGES * TPB + 1)))  # fills the GPU tier again
    _cache_blocks(manager, list(range(2000, 2000 + TPB + 1)))  # evicts one cached page: one put
    stats = manager.get_remote_tier_statistics()
    assert stats is not None and (stats.stored_pages, stats.dropped_by_bulk_write_back) == (1, 2), stats
    manager.shutdown()


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [
        (-1.0, ValueError, "bulk_write_back_deadline_s must be a finite float >= 0"),
        (True, TypeError, "must be a number"),
    ],
)
def test_bulk_write_back_deadline_s_is_checked(value: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        RemoteCacheTierConfig(0, MemoryStoreConfig(), "m", bulk_write_back_deadline_s=value)  # type: ignore[arg-type]
