"""Batched admission with a two-phase claim (SPEC §6, seed 004).

Admitting requests one by one lets one request's onboarding or allocation evict pages that a later request of
the same batch matched, so the batch copies data twice or fails to fit. Phase 1 matches every request and claims
every matched page of the whole batch (pinned where it is: no eviction, no drop); phase 2 admits each request in
order — onboard, copy-on-write, SSM snapshot copy, allocation up to its capacity — as one step that fits whole or
leaves no trace. Claims are released when the batch ends; a copy-on-write source shared by several requests is
held by each copier and so survives until the last one has copied it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mypy_extensions import mypyc_attr

from ._hashing import ReuseScope, Token, check_tokens
from ._kv_cache import _KVCache
from ._page import Page
from ._services import CacheServices, PriorityCallback
from ._types import CudaStream
from ._validation import coerce_fields


@mypyc_attr(native_class=False)
@dataclass
class KVCacheRequest:
    """One request of a batch; ``capacity=None`` means ``len(input_tokens)``."""

    input_tokens: Sequence[Token]
    reuse_scope: ReuseScope | None = None
    id: int | None = None
    capacity: int | None = None
    custom_priority_callback: PriorityCallback | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, optional_ints=("id", "capacity"))
        self.input_tokens = check_tokens(self.input_tokens, "KVCacheRequest.input_tokens")
        if self.capacity is not None and self.capacity < 0:
            raise ValueError(f"KVCacheRequest.capacity must be >= 0, got {self.capacity}")
        if self.reuse_scope is not None and not isinstance(self.reuse_scope, ReuseScope):
            raise TypeError(f"KVCacheRequest.reuse_scope must be a ReuseScope or None, got {self.reuse_scope!r}")


def admit_batch(services: CacheServices, caches: list[_KVCache], capacities: list[int], stream: CudaStream) -> list[_KVCache | None]:
    """Phase 1 has created ``caches`` (matched, holding their pages); claim, admit in order, release claims."""
    store = services.store
    claims: list[Page] = []
    for cache in caches:
        for page in cache._all_pages():  # a fresh cache: matched blocks, copy and snapshot sources
            store.claim(page)
            claims.append(page)
    results: list[_KVCache | None] = []
    try:
        for cache, capacity in zip(caches, capacities):
            if cache._admit(max(capacity, cache.capacity), stream):
                results.append(cache)
            else:
                cache.close()
                results.append(None)
    finally:
        for page in claims:
            store.unclaim(page)
    return results
