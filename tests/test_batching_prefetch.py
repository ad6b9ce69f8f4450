"""The continuous batcher prefetches as the README tells an engine to (issue #38): the suspended request next in line
to resume has its pages brought to the GPU a step ahead (``KVCache.prefetch``), so that its resume moves nothing, and
with a remote tier a waiting request's prefix is fetched (``prefetch_remote``) before its admission."""

from __future__ import annotations

from typing import Callable, TypeVar

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCache, KVCacheManager, RemoteCacheTierConfig
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.batching import BatchingOptions, ContinuousBatcher
from kv_cache_manager_v2.batching.prefetching import Prefetcher
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.helpers import attention, make_config
from tests.test_batching import TPB, Checked, Replayed, manager_with, run_to_end, workload

_T = TypeVar("_T")


class RecordingPrefetcher(Prefetcher[Replayed]):
    """Remembers the step in which the batcher last prefetched each suspended cache (by cache id)."""

    def __init__(self, batcher: ContinuousBatcher[Replayed]) -> None:
        super().__init__(batcher.manager, batcher.engine, batcher.timed)
        self.batcher = batcher
        self.prefetched: dict[int, int] = {}

    def before_resume(self, request: Replayed) -> None:
        assert request.cache is not None
        self.prefetched[request.cache.id] = self.batcher.step_index
        super().before_resume(request)


class ResumeRecorder(ContinuousBatcher[Replayed]):
    """Counts the pages each resume of a suspended request onboarded, and whether the batcher prefetched that cache
    at the end of the step before (the batcher times every manager call it makes through ``timed``)."""

    def __init__(self, manager: KVCacheManager, requests: list[Replayed], options: BatchingOptions) -> None:
        super().__init__(manager, requests, Checked(manager), options)
        self.recorder = RecordingPrefetcher(self)
        self.prefetcher = self.recorder
        self.resume_moves: list[tuple[bool, int]] = []  # (prefetched a step before, pages onboarded)

    def timed(self, call: Callable[[], _T]) -> _T:
        target = getattr(call, "__self__", None)
        resuming = isinstance(target, KVCache) and getattr(call, "__name__", "") == "resume"
        if not resuming or not any(request.cache is target for request in self.suspended):
            return super().timed(call)
        assert isinstance(target, KVCache)
        before = self.manager.movement_counters.onboarded_pages
        result = super().timed(call)
        prefetched = self.recorder.prefetched.get(target.id) == self.step_index - 1
        self.resume_moves.append((prefetched, self.manager.movement_counters.onboarded_pages - before))
        return result


def run_recorded(prefetch: bool, seed: int) -> tuple[ResumeRecorder, int]:
    """One memory-tight run (a host tier to suspend to); returns the batcher and the pages moved in all."""
    manager = manager_with(gpu_slots=20, host_slots=400)
    batcher = ResumeRecorder(manager, workload(12, seed=seed), BatchingOptions(chunk=48, max_batch=6, prefetch=prefetch))
    before = batcher.manager_ns
    run_to_end(batcher)
    assert batcher.manager_ns > before and len(batcher.finished_ids) == 12 and manager.num_live_caches == 0
    counters = manager.movement_counters
    moved = counters.onboarded_pages + counters.offloaded_pages
    manager.shutdown()
    return batcher, moved


@pytest.mark.parametrize("seed", [0, 1, 4])
def test_the_request_next_in_line_resumes_with_its_pages_already_on_the_gpu(seed: int) -> None:
    without, moved_without = run_recorded(False, seed)
    assert without.preemptions > 0 and without.prefetcher.prefetched_pages == 0
    assert sum(pages for _, pages in without.resume_moves) > 0  # resumes brought pages back from the host tier

    with_prefetch, moved_with = run_recorded(True, seed)
    assert with_prefetch.prefetcher.prefetched_pages > 0
    assert (with_prefetch.preemptions, with_prefetch.step_index) == (without.preemptions, without.step_index)
    resume_moves = sum(pages for _, pages in with_prefetch.resume_moves)
    assert resume_moves < sum(pages for _, pages in without.resume_moves)
    # Moved earlier, not moved twice: prefetching after a step that preempted, or for more than the head, sent the
    # pages to and fro (about 1.2-2x the pages moved here).
    assert moved_with <= moved_without


def test_a_prefetched_resume_moves_nothing() -> None:
    """Whenever the batcher prefetched a suspended cache, its resume in the next step found every page on the GPU."""
    batcher, _ = run_recorded(True, 0)
    assert batcher.recorder.prefetched_pages > 0
    prefetched = [pages for was_prefetched, pages in batcher.resume_moves if was_prefetched]
    assert prefetched and all(pages == 0 for pages in prefetched)


def remote_manager(store: MemoryStoreConfig, gpu_slots: int) -> KVCacheManager:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_slots * 1024), RemoteCacheTierConfig(0, store, namespace="batcher")]
    return KVCacheManager(make_config([attention(0, 512)], tiers=tiers, tokens_per_block=TPB))


def stored_by_another_instance(store: MemoryStoreConfig, tokens: list[int]) -> None:
    writer = remote_manager(store, 16)
    cache = writer.create_kv_cache(None, [])
    assert cache.resume() and cache.resize(len(tokens))
    FakeEngine(writer).step(cache, tokens)
    cache.commit(tokens)
    cache.close()
    writer.shutdown()


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_waiting_requests_prefix_is_fetched_from_the_remote_tier_before_its_admission(prefetch: bool) -> None:
    store = MemoryStoreConfig()
    shared = [50_000 + i for i in range(3 * TPB)]
    stored_by_another_instance(store, shared)
    manager = remote_manager(store, 16)
    running = Replayed(0, [70_000 + i for i in range(2 * TPB + 8)], TPB)  # decodes for a while, alone in the batch
    waiting = Replayed(1, shared + [60_000 + i for i in range(10)], 3 * TPB + 5)
    batcher = ContinuousBatcher(manager, [running, waiting], Checked(manager), BatchingOptions(chunk=64, max_batch=1, prefetch=prefetch))
    batcher.step()
    assert [request.request_id for request in batcher.waiting] == [1]
    prompt = waiting.tokens[: waiting.prompt_length - 1]
    stats = manager.get_remote_tier_statistics()
    assert stats is not None
    if prefetch:
        assert manager.probe_reuse(None, prompt) == 3 * TPB  # local before its admission
        assert (batcher.prefetcher.remote_prefetches, batcher.prefetcher.remote_fetched_pages) == (1, 3)
    else:
        assert manager.probe_reuse(None, prompt) == 0
        assert batcher.prefetcher.remote_prefetches == 0
    fetched = stats.fetched_pages
    batcher.step()
    assert batcher.prefetcher.remote_prefetches == (1 if prefetch else 0)  # once per request
    engine = batcher.engine
    assert isinstance(engine, Checked)
    run_to_end(batcher)
    assert engine.reused[1] == 3 * TPB  # its admission reused the other instance's blocks (content checked)
    after = manager.get_remote_tier_statistics()
    assert after is not None
    assert (after.fetched_pages == fetched) is prefetch  # with the prefetch, admission asked the store for nothing
    manager.shutdown()


def test_no_remote_prefetch_without_a_remote_tier_and_the_option_is_checked() -> None:
    manager = manager_with(gpu_slots=20)
    batcher = ContinuousBatcher(manager, workload(3), Checked(manager), BatchingOptions(max_batch=1))
    run_to_end(batcher)
    assert batcher.prefetcher.remote_prefetches == 0 and not batcher.prefetcher.has_remote_tier
    manager.shutdown()
    with pytest.raises(TypeError, match="prefetch"):
        BatchingOptions(prefetch=1)  # type: ignore[arg-type]
