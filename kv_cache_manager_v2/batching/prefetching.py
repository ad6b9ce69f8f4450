"""What the batcher moves toward the GPU a step before it is needed, as the README tells an engine to.

Between steps (after the commits), the suspended request next in line to resume gets ``KVCache.prefetch(evict=True)``
when the next step will try its ``resume`` (a seat is free, the refusal back-off lets it): its pages on colder tiers
come to the GPU, making room as its resume would (reusable pages and later suspended requests' pages step down a
tier), so that the resume finds them there; on a GPU the copies overlap the step in between instead of delaying the
resume. Not after a step that preempted (memory was short: the next step's growth would send them down again), and
only the head: prefetching several suspended requests made them evict each other's pages when the GPU could not hold
them all, doubling the pages moved in ``tests/test_batching.py``'s workloads, where the head alone moves no more than
without prefetching. Waiting requests next in line for admission get ``prefetch_remote`` once each when a remote
tier is configured: their prefix is then local when ``create_kv_cache`` matches it.
"""

from __future__ import annotations

from typing import Callable, Generic

from .. import KVCacheManager
from .engine import BatchEngine, R


class Prefetcher(Generic[R]):
    """Prefetches for the batcher and counts it: ``prefetched_pages`` (pages ``KVCache.prefetch`` started moving to
    the GPU), ``remote_prefetches`` (waiting requests whose prefix ``prefetch_remote`` looked up) and
    ``remote_fetched_pages`` (pages the remote tier fetched for them)."""

    def __init__(
        self, manager: KVCacheManager, engine: BatchEngine[R], timed: Callable[[Callable[[], int]], int]
    ) -> None:
        self.manager: KVCacheManager = manager
        self.engine: BatchEngine[R] = engine
        self.timed: Callable[[Callable[[], int]], int] = timed
        self.has_remote_tier: bool = manager.get_remote_tier_statistics() is not None
        self.prefetched_pages: int = 0
        self.remote_prefetches: int = 0
        self.remote_fetched_pages: int = 0
        self._remote_done: set[tuple[int, int]] = set()  # (request id, requeues): looked up for this admission

    def before_resume(self, request: R) -> None:
        """``request`` (suspended) is next in line to resume: bring its colder pages to the GPU now."""
        cache = request.cache
        if cache is not None:
            self.prefetched_pages += self.timed(lambda: cache.prefetch(evict=True))

    def before_admission(self, requests: list[R]) -> None:
        """``requests`` wait next in line for admission: fetch each one's prefix from the remote tier (there is one),
        once."""
        manager = self.manager
        for request in requests:
            key = (request.request_id, request.requeues)
            if key in self._remote_done:
                continue
            self._remote_done.add(key)
            self.engine.prepare(request)
            prompt = request.tokens[: request.prompt_length - 1]  # what its create_kv_cache will pass
            scope = request.scope
            before = self._remote_fetched()
            self.timed(lambda: manager.prefetch_remote(scope, prompt))
            self.remote_prefetches += 1
            self.remote_fetched_pages += self._remote_fetched() - before

    def _remote_fetched(self) -> int:
        stats = self.manager.get_remote_tier_statistics()
        return 0 if stats is None else stats.fetched_pages
