"""Batched admission with a two-phase claim (SPEC §6): claimed pages stay put, each is onboarded at most once,
a request that does not fit leaves no trace."""

from __future__ import annotations

from pathlib import Path

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheRequest,
)
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config, ssm

TPB = 32
SLOT = 2 * 4 * KIB


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def manager_with(gpu_slots: int, host_slots: int, layers: list[LayerConfig] | None = None) -> KVCacheManager:
    tiers: list[GpuCacheTierConfig | HostCacheTierConfig] = [GpuCacheTierConfig(gpu_slots * SLOT)]
    if host_slots:
        tiers.append(HostCacheTierConfig(host_slots * SLOT))
    return KVCacheManager(
        make_config(layers or [attention(0, 4 * KIB)], tiers=tiers, max_util_for_resume=1.0)
    )


def publish(manager: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> None:
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()


def scenario(batch: bool) -> tuple[list[int], int, int, int]:
    """GPU of 13 slots holding cached prompts A, B (matched by the batch) and C (not matched), oldest first.
    R1 reuses A and needs 4 new blocks; R2 reuses B. One by one, R1's allocation evicts B (least recently
    used) to host and R2 must onboard it again; claimed, B stays and C goes instead."""
    manager = manager_with(13, 4)
    engine = FakeEngine(manager)
    prompts = [tokens_of(seed, 4 * TPB) for seed in (1, 2, 3)]
    for prompt in prompts:
        publish(manager, engine, prompt)
    r1 = prompts[0] + tokens_of(11, 4 * TPB)
    r2 = prompts[1] + tokens_of(12, 1)
    if batch:
        admitted = manager.create_kv_cache_batch([KVCacheRequest(r1), KVCacheRequest(r2)])
    else:
        admitted = []
        for tokens in (r1, r2):
            created = manager.create_kv_cache(None, tokens)
            assert created.resume() and created.resize(len(tokens))
            admitted.append(created)
    reused = []
    for cache, tokens in zip(admitted, (r1, r2)):
        assert cache is not None and cache.is_active and cache.capacity == len(tokens)
        reused.append(cache.num_committed_tokens)
        engine.step(cache, tokens)
    manager.check_invariants()
    counters = manager.movement_counters
    for cache in admitted:
        assert cache is not None
        cache.close()
    return reused, counters.onboarded_pages, counters.offloaded_pages, manager.probe_reuse(None, prompts[2])


def test_batch_keeps_matched_pages_where_one_by_one_reonboards_them() -> None:
    batch_reused, batch_onboarded, batch_offloaded, batch_c = scenario(batch=True)
    single_reused, single_onboarded, single_offloaded, single_c = scenario(batch=False)
    assert batch_reused == single_reused == [4 * TPB, 4 * TPB]
    assert batch_onboarded == 0  # every claimed page was already on the GPU and stayed there
    assert single_onboarded == 3  # 3 of B's pages went to host under R1's allocation and came back for R2
    assert (batch_offloaded, single_offloaded) == (4, 7)  # C's 4 pages vs B's 3 and then C's 4
    assert batch_c == single_c == 4 * TPB  # C moved to host but stays reusable


def test_shared_prefix_on_host_is_onboarded_once() -> None:
    manager = manager_with(16, 16)
    engine = FakeEngine(manager)
    shared = tokens_of(5, 4 * TPB)
    publish(manager, engine, shared)
    for seed in range(6, 9):  # push the shared prompt to host with newer cached prompts
        publish(manager, engine, tokens_of(seed, 4 * TPB))
    requests = [KVCacheRequest(shared + tokens_of(20 + i, 10)) for i in range(3)]
    before = manager.movement_counters.onboarded_pages
    caches = manager.create_kv_cache_batch(requests)
    assert all(cache is not None for cache in caches)
    assert manager.movement_counters.onboarded_pages - before <= 4
    for cache, request in zip(caches, requests):
        assert cache is not None and cache.num_committed_tokens == 4 * TPB
        engine.step(cache, list(request.input_tokens))
        cache.close()
    manager.check_invariants()


def test_partial_matches_share_one_copy_source() -> None:
    manager = manager_with(32, 0)
    engine = FakeEngine(manager)
    base = tokens_of(30, 2 * TPB)
    publish(manager, engine, base)
    requests = [KVCacheRequest(base[: TPB + 5 + i] + tokens_of(40 + i, 7)) for i in range(3)]
    caches = manager.create_kv_cache_batch(requests)
    copied = manager.movement_counters.copied_pages
    assert copied == 3  # each request copied the partially matched block once
    for cache, request in zip(caches, requests):
        assert cache is not None and cache.num_committed_tokens == TPB + 5 + requests.index(request)
        engine.step(cache, list(request.input_tokens))
    for cache in caches:
        assert cache is not None
        cache.close()
    manager.check_invariants()
    assert manager.probe_reuse(None, base) == 2 * TPB  # the source block survived


def test_a_request_that_does_not_fit_leaves_no_trace() -> None:
    manager = manager_with(12, 0)
    engine = FakeEngine(manager)
    small = [tokens_of(50 + i, TPB + 3) for i in range(3)]
    huge = tokens_of(60, 20 * TPB)
    caches = manager.create_kv_cache_batch(
        [KVCacheRequest(small[0]), KVCacheRequest(huge, id=77), KVCacheRequest(small[1]), KVCacheRequest(small[2])]
    )
    assert caches[1] is None and all(cache is not None for i, cache in enumerate(caches) if i != 1)
    assert manager.num_live_caches == 3
    stats = manager.get_storage_statistics(0)[0]
    assert stats.total - stats.free == 6  # only the three small requests' pages
    again = manager.create_kv_cache(id=77)  # the refused request's id is free again
    again.close()
    for cache, tokens in zip([caches[0], caches[2], caches[3]], small):
        assert cache is not None
        engine.step(cache, tokens)
        cache.close()
    manager.check_invariants()


def test_batch_covers_ssm_snapshots_and_swa_windows(tmp_path: Path) -> None:
    layers: list[LayerConfig] = [ssm(0), attention(1, 4 * KIB, window=64), attention(2, 4 * KIB)]
    manager = KVCacheManager(make_config(layers, ssm_reuse_interval=TPB))
    engine = FakeEngine(manager)
    prompt = tokens_of(70, 6 * TPB)
    publish(manager, engine, prompt)
    requests = [KVCacheRequest(prompt + tokens_of(71 + i, 9), capacity=6 * TPB + 20) for i in range(2)]
    caches = manager.create_kv_cache_batch(requests)
    for cache, request in zip(caches, requests):
        assert isinstance(cache, _KVCache) and cache.num_committed_tokens == 6 * TPB
        assert cache.capacity == 6 * TPB + 20
        engine.step(cache, list(request.input_tokens) + [0] * 11)
    manager.check_invariants()
    for cache in caches:
        assert cache is not None
        cache.close()


def reuse_statistics(batch: bool) -> list[tuple[int, int, int]]:
    """Per admission round, (reused full, reused partial, missed) blocks as the iteration statistics count them."""
    manager = KVCacheManager(
        make_config([attention(0, 4 * KIB)], tiers=[GpuCacheTierConfig(64 * SLOT)], max_util_for_resume=1.0,
                    enable_stats=True, enable_partial_reuse=True)
    )
    engine = FakeEngine(manager)
    shared = tokens_of(5, 2 * TPB)
    rounds = [[tokens_of(6, 3 * TPB)], [shared + tokens_of(7, TPB + 5), shared[: TPB + 9] + tokens_of(8, 40)]]
    publish(manager, engine, shared)
    manager.get_iteration_stats()
    counted = []
    for prompts in rounds:
        if batch:
            admitted = manager.create_kv_cache_batch([KVCacheRequest(prompt) for prompt in prompts])
        else:
            admitted = []
            for prompt in prompts:
                created = manager.create_kv_cache(None, prompt)
                assert created.resume() and created.resize(len(prompt))
                admitted.append(created)
        (stats,) = manager.get_iteration_stats()
        counted.append((stats.reused_full_blocks, stats.reused_partial_blocks, stats.missed_blocks))
        for cache, prompt in zip(admitted, prompts):
            assert cache is not None
            engine.step(cache, prompt)
            cache.close()
    return counted


def test_batch_admission_counts_reuse_as_one_by_one_creation_does() -> None:
    """Blocks a batch admission allocates are new, not reused: its statistics match creating the same caches one
    by one (they were once counted after allocation, so a fresh 3-block prompt read as 3 reused, 0 missed)."""
    one_by_one = reuse_statistics(batch=False)
    assert one_by_one[0] == (0, 0, 3)  # a fresh prompt: every block missed
    assert reuse_statistics(batch=True) == one_by_one


def test_blocks_an_earlier_request_of_the_batch_computes_count_as_reused() -> None:
    """A later request sharing the prefix an earlier request of the same batch computes in this step computes none
    of those blocks, so the statistics count them as reused, not missed (as vLLM's prefix-cache hits do); they
    once read as missed, and a hit rate from these statistics fell below the compute the batch saved."""
    manager = KVCacheManager(make_config([attention(0, 4 * KIB)], tiers=[GpuCacheTierConfig(64 * SLOT)], enable_stats=True))
    engine = FakeEngine(manager)
    system = tokens_of(11, 3 * TPB)
    prompts = [system + tokens_of(12, TPB + 3), system + tokens_of(13, 2 * TPB)]
    manager.get_iteration_stats()
    first, second = manager.create_kv_cache_batch([KVCacheRequest(prompt) for prompt in prompts])
    assert first is not None and second is not None
    assert (first.history_length, second.history_length) == (0, 3 * TPB)  # the second shares the system prompt
    (stats,) = manager.get_iteration_stats()
    assert (stats.reused_full_blocks, stats.reused_partial_blocks, stats.missed_blocks) == (3, 0, 5 + 2)
    for cache, prompt in zip((first, second), prompts):  # in batch order: the first writes what the second reads
        engine.step(cache, prompt)
        cache.commit(prompt[cache.num_committed_tokens :])
    for cache, prompt in zip((first, second), prompts):
        engine.check(cache, prompt)
        cache.close()
