"""Regressions of the defects an outside random driver found (one test per behaviour, both modes).

Notation of the scenarios: one attention layer with key and value buffers of 512 bytes (one slot = 1 KiB),
``tokens_per_block`` 16, cpu backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kv_cache_manager_v2._introspection import state_of
from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheManager,
    KVCacheRequest,
    LifeCycle,
    Priority,
)
from kv_cache_manager_v2._cache.invariants import InvariantError
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, MIB, attention, make_config, ssm

TPB = 16


def small(
    tiers: list[CacheTierConfig],
    layers: list[LayerConfig] | None = None,
    ssm_reuse_interval: int = 512,
    max_util_for_resume: float = 0.97,
    enable_swa_scratch_reuse: bool = False,
) -> KVCacheManager:
    chosen: list[LayerConfig] = [attention(0, 512)] if layers is None else layers
    return KVCacheManager(make_config(
        chosen, tiers=tiers, tokens_per_block=TPB, ssm_reuse_interval=ssm_reuse_interval,
        max_util_for_resume=max_util_for_resume, enable_swa_scratch_reuse=enable_swa_scratch_reuse,
    ))


def tokens_of(seed: int, length: int) -> list[int]:
    return [seed * 100_000 + i for i in range(length)]


def fill(manager: KVCacheManager, tokens: list[int]) -> None:
    """Compute, commit and close ``tokens`` (cached, droppable content afterwards)."""
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()


def bad_priority(ordinal: int, life_cycle: LifeCycle) -> Priority:
    """Valid for the first two blocks, out of range after them."""
    return Priority(101 if ordinal >= 2 else 35)


def statistics(manager: KVCacheManager) -> list[object]:
    return [manager.get_storage_statistics(level) for level in range(manager.num_cache_levels)]


# --------------------------------------------------------------------------- 1: registered index buffers
def test_registered_index_buffer_follows_pages_across_suspend_and_resume() -> None:
    manager = small([GpuCacheTierConfig(8 * KIB), HostCacheTierConfig(32 * KIB)])
    cache = manager.create_kv_cache()
    assert cache.resume()
    buffer = np.full(8, -7, dtype=np.int32)
    cache.set_base_page_index_buf(0, 0, buffer)
    assert cache.resize(64)
    cache.commit(tokens_of(1, 64))
    cache.suspend()
    assert buffer.tolist() == [BAD_PAGE_INDEX] * 8  # nothing an engine could read as a page while suspended
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(128)  # pushes the suspended cache's pages to the host tier
    other.close()
    assert cache.resume()
    indices = list(cache.get_base_page_indices(0))
    assert buffer.tolist() == indices + [BAD_PAGE_INDEX] * 4
    cache.close()
    assert buffer.tolist() == [BAD_PAGE_INDEX] * 8
    manager.check_invariants()


def test_buffer_registered_while_suspended_reads_minus_one_until_resume() -> None:
    manager = small([GpuCacheTierConfig(8 * KIB)])
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(40)
    cache.suspend()
    buffer = np.full(6, 5, dtype=np.int32)
    cache.set_base_page_index_buf(0, 0, buffer)
    assert buffer.tolist() == [BAD_PAGE_INDEX] * 6
    assert cache.resume()
    assert buffer.tolist() == list(cache.get_base_page_indices(0)) + [BAD_PAGE_INDEX] * 3
    assert cache.resize(16)  # shrinking clears the entries of the blocks that went
    assert buffer.tolist() == list(cache.get_base_page_indices(0)) + [BAD_PAGE_INDEX] * 5
    cache.close()


# --------------------------------------------------------------------- 3 and 9: room across the tiers
def test_quota_shrink_through_a_host_tier_without_slots_refuses_and_keeps_cached_pages(tmp_path: Path) -> None:
    manager = small([GpuCacheTierConfig(8 * KIB), HostCacheTierConfig(512), DiskCacheTierConfig(8 * KIB, str(tmp_path))])
    prompt = tokens_of(1, 64)
    fill(manager, prompt)
    private = manager.create_kv_cache()
    assert private.resume() and private.resize(64)
    private.commit(tokens_of(2, 64))
    private.suspend()
    before = statistics(manager), manager.movement_counters.dropped_pages
    assert manager.resize(0, 2048) is False  # held pages cannot pass a host tier with no slot
    assert manager.get_quota(0) == 8 * KIB
    assert manager.probe_reuse(None, prompt) == 64
    assert (statistics(manager), manager.movement_counters.dropped_pages) == before
    manager.check_invariants()
    private.close()


def test_resume_passes_evicted_pages_through_a_host_tier_that_holds_its_own_pages(tmp_path: Path) -> None:
    manager = small([GpuCacheTierConfig(6 * KIB), HostCacheTierConfig(4 * KIB), DiskCacheTierConfig(16 * KIB, str(tmp_path))])
    engine = FakeEngine(manager)
    caches = []
    for seed in range(3):
        cache = manager.create_kv_cache()
        tokens = tokens_of(seed, 48)
        assert cache.resume() and cache.resize(48)
        engine.step(cache, tokens)
        cache.suspend()
        caches.append((cache, tokens))
    first, tokens = caches[0]
    # GPU: the second and third caches' held pages; host: the first cache's three pages and one free slot.
    assert manager.get_storage_statistics(1)[0].free == 1
    assert first.resume()  # the others' pages pass through the host's free slot to the disk
    engine.check(first, tokens)
    manager.check_invariants()
    for cache, _ in caches:
        cache.close()


@pytest.mark.parametrize("host_slots", [2, 1])
def test_resume_sends_its_own_waiting_pages_down_when_the_tier_below_holds_nothing_else(
    tmp_path: Path, host_slots: int,
) -> None:
    """Issue #35 item 19. GPU 8 / host ``host_slots`` / disk 4: the first cache's private pages fill the host
    (and part of the disk), the others' the GPU. Resuming the first cache used to be refused: nothing could leave
    the host to let a GPU page down, though the first cache's own pages could step down to the disk's free slots
    and come up from there (with one host slot: the page on its way up steps down first)."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(8 * KIB), HostCacheTierConfig(host_slots * KIB),
                                    DiskCacheTierConfig(4 * KIB, str(tmp_path))]
    manager = small(tiers)
    engine = FakeEngine(manager)
    suspended: list[tuple[KVCache, list[int]]] = []
    while True:
        tokens = tokens_of(len(suspended), 64)
        cache = manager.create_kv_cache(None, tokens)
        if not (cache.resume() and cache.resize(64)):
            cache.close()
            break
        engine.write(cache, tokens, 0, 64)
        cache.suspend()
        suspended.append((cache, tokens))
    first, tokens = suspended[0]
    assert manager.get_storage_statistics(1)[0].free == 0 and manager.get_storage_statistics(2)[0].free > 0
    assert first.resume()
    assert first.resize(64, 64)
    engine.check(first, tokens)  # every private page came back with its content
    manager.check_invariants()
    for cache, _ in suspended:
        cache.close()
    manager.check_invariants()


# -------------------------------------------------------------------------------- 17: best efforts
def test_best_efforts_grows_as_far_as_each_pool_group_can() -> None:
    """Issue #35 item 17. Two pool groups split unevenly, each reserved up to 4 MiB: growing to 10 MiB cannot be
    had, and best efforts used to try the sum of the reservations (8 MiB, over one group's 4 MiB), refusing."""
    manager = small([GpuCacheTierConfig(1 * MIB, max_quota=4 * MIB)], layers=[attention(0, 512), attention(1, 2048, window=256)])
    assert manager.resize(0, 2 * MIB)
    assert manager.resize(0, 10 * MIB, best_efforts=True)
    reached = manager.get_quota(0)
    assert 4 * MIB < reached < 10 * MIB
    assert manager.get_storage_statistics(0)[0].total == 4096  # the bigger group at its whole reservation
    assert not manager.resize(0, 10 * MIB)  # the target itself still cannot be had
    assert not manager.resize(0, 11 * MIB, best_efforts=True)  # no nearer quota to move to: False, nothing changed
    assert manager.get_quota(0) == reached
    manager.check_invariants()


# ------------------------------------------------------------------- 4 and 5: failing priority callbacks
@pytest.mark.parametrize("failure", ["out of range", "raises"])
def test_failing_priority_callback_during_resize_changes_nothing(failure: str) -> None:
    def raising(ordinal: int, life_cycle: LifeCycle) -> Priority:
        if ordinal >= 2:
            raise RuntimeError("engine callback failed")
        return Priority(35)

    manager = small([GpuCacheTierConfig(64 * KIB)])
    cache = manager.create_kv_cache(custom_priority_callback=bad_priority if failure == "out of range" else raising)
    assert cache.resume() and cache.resize(16)
    before = list(cache.get_base_page_indices(0)), cache.num_blocks, statistics(manager)
    with pytest.raises(ValueError if failure == "out of range" else RuntimeError):
        cache.resize(64)
    assert (list(cache.get_base_page_indices(0)), cache.num_blocks, statistics(manager)) == before
    manager.check_invariants()
    cache.close()
    assert manager.get_storage_statistics(0)[0].free == 64  # no slot lost


def test_failing_priority_callback_in_a_batch_leaves_no_cache_open() -> None:
    manager = small([GpuCacheTierConfig(64 * KIB)])
    prompt = tokens_of(1, 64)
    fill(manager, prompt)
    manager.get_iteration_stats()
    before = statistics(manager), manager.num_live_caches
    requests = [KVCacheRequest(tokens_of(2, 16)), KVCacheRequest(prompt + tokens_of(3, 48), custom_priority_callback=bad_priority)]
    with pytest.raises(ValueError, match="custom_priority_callback"):
        manager.create_kv_cache_batch(requests)
    assert (statistics(manager), manager.num_live_caches) == before
    assert manager.get_iteration_stats()[0].reused_full_blocks == 0
    manager.check_invariants()
    manager.shutdown()  # possible: nothing was left open


# --------------------------------------------------------------------------------- 6: absurd capacities
def test_absurd_capacity_on_a_windowed_layer_is_refused_without_unlocking_pages() -> None:
    manager = small([GpuCacheTierConfig(64 * KIB)], layers=[attention(0, 512, window=32)])
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(64)
    cache.commit(tokens_of(1, 64))
    indices = list(cache.get_base_page_indices(0))
    assert cache.resize(2**40, 2**40 - 1) is False
    assert list(cache.get_base_page_indices(0)) == indices and cache.capacity == 64
    manager.check_invariants()
    assert cache.resize(80, 64)  # the cache still works
    manager.check_invariants()
    cache.close()


def test_absurd_capacity_in_a_batch_is_a_refused_request() -> None:
    manager = small([GpuCacheTierConfig(64 * KIB)], layers=[attention(0, 512, window=32)])
    results = manager.create_kv_cache_batch([KVCacheRequest([1, 2, 3], capacity=2**40), KVCacheRequest([4, 5, 6])])
    assert results[0] is None and results[1] is not None
    results[1].close()
    assert manager.num_live_caches == 0


# ------------------------------------------------------------------------------------- 7: ssm interval 0
def test_zero_ssm_interval_without_ssm_layers_commits_normally() -> None:
    manager = small([GpuCacheTierConfig(64 * KIB)], ssm_reuse_interval=0)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(16)
    cache.commit(tokens_of(1, 16))
    assert (cache.num_committed_tokens, cache.history_length) == (16, 16)
    cache.close()
    assert manager.probe_reuse(None, tokens_of(1, 16)) == 16


# ------------------------------------------------------------------------------------ 8: batch ids
def test_batch_automatic_ids_skip_the_explicit_ids_of_the_same_batch() -> None:
    manager = small([GpuCacheTierConfig(64 * KIB)])
    first, second = manager.create_kv_cache_batch([KVCacheRequest([1, 2, 3]), KVCacheRequest([4, 5, 6], id=0)])
    assert first is not None and second is not None
    assert second.id == 0 and first.id != 0
    first.close()
    second.close()
    manager.shutdown()


def test_duplicate_ids_in_a_batch_raise_before_any_cache_opens() -> None:
    manager = small([GpuCacheTierConfig(64 * KIB)])
    with pytest.raises(ValueError, match="already used"):
        manager.create_kv_cache_batch([KVCacheRequest([1], id=5), KVCacheRequest([2]), KVCacheRequest([3], id=5)])
    assert manager.num_live_caches == 0
    manager.shutdown()


# ---------------------------------------------------------------------- 10: rejected requests, no trace
def test_rejected_batch_request_leaves_no_statistics_and_no_lru_change() -> None:
    manager = small([GpuCacheTierConfig(6 * KIB)])
    older, newer = tokens_of(1, 32), tokens_of(2, 32)
    fill(manager, older)
    fill(manager, newer)
    manager.get_iteration_stats()
    too_big = KVCacheRequest(older + tokens_of(3, 16), capacity=200)  # matches `older`, cannot fit
    assert manager.create_kv_cache_batch([too_big]) == [None]
    stats = manager.get_iteration_stats()[0]
    assert (stats.reused_full_blocks, stats.missed_blocks, stats.allocated_pages) == (0, 0, 0)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(48)  # three pages: the free ones, then the least recent prefix's last
    assert manager.probe_reuse(None, older) == 16 and manager.probe_reuse(None, newer) == 32
    manager.check_invariants()
    cache.close()


def test_debug_mode_checks_a_refused_batch_request_after_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debug mode ran its invariant check inside the batch when a request was refused, while the batch still had
    its claims out, and so failed every batch that refused a request."""
    monkeypatch.setenv("KV_CACHE_MANAGER_V2_DEBUG", "1")
    manager = small([GpuCacheTierConfig(6 * KIB)])
    older = tokens_of(1, 32)
    fill(manager, older)
    fits = KVCacheRequest(tokens_of(4, 8), capacity=16)
    too_big = KVCacheRequest(older + tokens_of(3, 16), capacity=200)
    admitted, refused = manager.create_kv_cache_batch([fits, too_big])
    assert admitted is not None and refused is None
    admitted.close()


# ------------------------------------------------------------------ hazards: ssm split commits, scratch
def test_ssm_snapshot_is_taken_only_at_the_end_of_the_computed_chunk() -> None:
    manager = small(
        [GpuCacheTierConfig(1024 * KIB)], layers=[ssm(0), attention(1, 512)], ssm_reuse_interval=TPB, max_util_for_resume=1.0
    )
    engine = FakeEngine(manager)
    tokens = tokens_of(1, 32)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(32)
    engine.step(cache, tokens)  # the live state now holds all 32 tokens
    cache.commit(tokens[:16])  # the state is ahead of token 16: no snapshot there
    cache.commit(tokens[16:])
    cache.close()
    assert manager.probe_reuse(None, tokens[:16] + tokens_of(2, 16)) == 0
    assert manager.probe_reuse(None, tokens) == 32
    reused = manager.create_kv_cache(None, tokens)
    assert reused.resume()
    engine.check(reused, tokens)
    reused.close()


def test_per_cache_scratch_reuse_needs_it_on_in_the_config() -> None:
    manager = small([GpuCacheTierConfig(64 * KIB)], layers=[attention(0, 512, window=32)])
    cache = manager.create_kv_cache()
    with pytest.raises(ValueError, match="KVCacheManagerConfig.enable_swa_scratch_reuse"):
        cache.enable_swa_scratch_reuse = True
    assert cache.enable_swa_scratch_reuse is False
    cache.close()


# ---------------------------------------------------------------------- 13: invariants check page tables
def test_invariant_check_catches_a_wrong_page_table_and_a_wrong_buffer() -> None:
    manager = small([GpuCacheTierConfig(64 * KIB)])
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(64)
    buffer = np.zeros(4, dtype=np.int32)
    cache.set_base_page_index_buf(0, 0, buffer)
    manager.check_invariants()
    buffer[1] = 60  # the engine's copy disagrees with the pages
    with pytest.raises(InvariantError, match="registered buffer"):
        manager.check_invariants()
    buffer[1] = cache.get_base_page_indices(0)[1]
    indices = state_of(cache).attention[0].indices
    right = indices[2]
    indices[2] = 61  # a bookkeeping bug: the mirror names a slot the cache does not own
    with pytest.raises(InvariantError, match="index 61"):
        manager.check_invariants()
    indices[2] = right
    cache.close()


# ------------------------------------------------------- found by the extended fuzzer: history inside scratch
def test_history_may_not_stop_inside_a_scratch_chunk() -> None:
    manager = small(
        [GpuCacheTierConfig(64 * KIB)], layers=[attention(0, 512, window=20), attention(1, 512)], enable_swa_scratch_reuse=True
    )
    engine = FakeEngine(manager)
    tokens = tokens_of(1, 57)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(57)
    engine.step(cache, tokens)
    scratch = cache.get_scratch_desc(0)
    assert scratch is not None and scratch  # blocks out of window at token 57 live only in scratch slots
    before = list(cache.get_base_page_indices(0)), cache.num_committed_tokens, cache.history_length
    with pytest.raises(ValueError, match="inside the scratch chunk"):
        cache.commit(tokens[:19])  # block 1 would be back in window at history 19, and its content is gone
    with pytest.raises(ValueError, match="inside the scratch chunk"):
        cache.resize(57, 19)
    assert (list(cache.get_base_page_indices(0)), cache.num_committed_tokens, cache.history_length) == before
    cache.commit(tokens)  # the whole chunk: fine
    engine.check(cache, tokens)
    cache.close()
