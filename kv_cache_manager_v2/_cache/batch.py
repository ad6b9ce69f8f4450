"""Batched admission with a two-phase claim.

Admitting requests one by one lets one request's onboarding or allocation evict pages that a later request of
the same batch matched, so the batch copies data twice or fails to fit. Phase 1 matches every request and claims
every matched page of the whole batch (pinned where it is: no eviction, no drop); phase 2 admits each request in
order — onboard, copy-on-write, SSM snapshot copy, allocation up to its capacity — as one step that fits whole or
leaves no trace. Claims are released when the batch ends; a copy-on-write source shared by several requests is
held by each copier and so survives until the last one has copied it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, final

from mypy_extensions import mypyc_attr

from .._base.hashing import ReuseScope, TokenSequence, check_scope, check_text_only, check_tokens
from .._model.life_cycle import ceil_div
from .batch_sharing import BatchShare, SharePlanner, batch_sharing_applies
from .cache_plans import AdmissionPlan, ResizePlan
from .kv_cache import CacheState, open_cache
from .._pages.lru_order import LruOrder
from .._pages.page import Page
from .._pages.page_store import PageStore
from .._pages.priority import PriorityCallback
from .refusal import content_lost_refusal
from .registry import CacheRegistry
from .services import CacheServices
from .._base.types import CudaStream, PageContentLostError
from .._base.validation import as_int, as_positions, coerce_fields, refuse_subclass


@final
@mypyc_attr(native_class=False)
@dataclass
class KVCacheRequest:
    """One request of a batch; ``input_tokens`` becomes a list. Its capacity is set one of two ways (not both):
    ``capacity``, absolute (None: ``len(input_tokens)``), or ``num_new_tokens``, counted from what the cache reuses,
    as a chunked-prefill scheduler plans a step: capacity = reused history + ``num_new_tokens``, but at most one
    token past ``input_tokens``. An engine passes the prompt without its last token (whose logits it needs, as for
    ``create_kv_cache``), so the prefill ends there; room past it would only be counted against admission and
    refuse requests that fit. The engine learns the reuse only from the admitted cache: ``resize`` down to an
    earlier stop (a ``KVCache.snapshot_points`` entry), up for the next chunk or drafted tokens.
    ``snapshot_at``: as ``KVCacheManager.create_kv_cache``'s (SSM snapshot positions), becomes a tuple.
    ``preempted`` (keyword-only): as ``create_kv_cache``'s, a readmission after a recompute preemption, whose
    lookup counts in the iteration statistics' preempted fields. ``lookup`` (keyword-only): as ``create_kv_cache``'s;
    False for a cache that stores rows the engine already has (a KV connector's save): no lookup is counted."""

    input_tokens: TokenSequence
    reuse_scope: ReuseScope | None = None
    id: int | None = None
    capacity: int | None = None
    custom_priority_callback: PriorityCallback | None = None
    snapshot_at: Sequence[int] = ()
    num_new_tokens: int | None = None
    preempted: bool = field(default=False, kw_only=True)
    lookup: bool = field(default=True, kw_only=True)

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "KVCacheRequest")

    def __post_init__(self) -> None:
        coerce_fields(self, optional_ints=("capacity", "num_new_tokens"), optional_ids=("id",))
        self.snapshot_at = as_positions(self.snapshot_at, "KVCacheRequest.snapshot_at")
        self.input_tokens = list(check_tokens(self.input_tokens, "KVCacheRequest.input_tokens"))
        _check_lengths(self.capacity, self.num_new_tokens, "KVCacheRequest")
        check_scope(self.reuse_scope, "KVCacheRequest.reuse_scope")
        check_lookup_flags(self.preempted, self.lookup, "KVCacheRequest.")


def check_lookup_flags(preempted: object, lookup: object, prefix: str) -> None:
    """``create_kv_cache``'s and ``KVCacheRequest``'s ``preempted`` and ``lookup``, named with ``prefix``: bools,
    and not ``preempted=True`` with ``lookup=False``: ``preempted`` says where a lookup counts, and a cache that
    counts none (a save of rows the engine has) is no readmission; a caller passing both confused the two."""
    if not isinstance(preempted, bool):
        raise TypeError(f"{prefix}preempted must be a bool, got {preempted!r}")
    if not isinstance(lookup, bool):
        raise TypeError(f"{prefix}lookup must be a bool, got {lookup!r}")
    if preempted and not lookup:
        raise ValueError(
            f"{prefix}preempted=True needs {prefix}lookup=True: a cache counting no lookup (lookup=False, a save of "
            "rows the engine already has) has none to count as a readmission's"
        )


def create_batch(
    services: CacheServices, registry: CacheRegistry, requests: Sequence[object], stream: CudaStream, text_only: bool
) -> list[CacheState | None]:
    """Validate the whole batch, open every cache (phase 1), plan each admission with its priorities, then claim
    every matched page and admit in order (phase 2). Bad input (multimodal tokens too, when ``text_only``: the
    caches are the manager's default kind) raises before any change; a failing priority
    callback raises after every opened cache was discarded; a rejected request leaves no trace (its statistics
    are not counted, the LRU positions of its matched pages are restored, its length is not observed)."""
    checked = _check_requests(services, requests, text_only)
    snapshot_points = [
        as_positions(request.snapshot_at, f"requests[{position}].snapshot_at") for position, request in enumerate(checked)
    ]
    ids = _batch_ids(registry, checked)
    order = LruOrder()
    caches = [
        open_cache(services, registry, request.reuse_scope, list(request.input_tokens), cache_id, request.custom_priority_callback, order)
        for request, cache_id in zip(checked, ids)
    ]
    for cache, points in zip(caches, snapshot_points):
        cache.declare_snapshots(points)
    tallies = [cache.reuse_tally() for cache in caches]  # what each reuses, before admission allocates
    try:
        shares = _plan_shares(services, checked, caches)
        plans = [
            cache.plan_admission(max(_capacity_of(request, _reused(cache, share, services)), cache.capacity))
            for cache, request, share in zip(caches, checked, shares)
        ]
    except BaseException:
        for cache in caches:
            cache.discard()
        order.restore()
        raise
    store = services.store
    held = [cache.held_pages() for cache in caches]  # a fresh cache: matched blocks, copy and snapshot sources
    claims = [page for pages in held for page in pages]
    for page in claims:
        store.claim(page)
    reservation = BatchReservation(claims, len(services.layout.pool_groups))
    results: list[CacheState | None] = []
    try:
        for cache, plan, share, request, tally, own in zip(caches, plans, shares, checked, tallies, held):
            if share is not None and plan.growth.itemised:
                shared = _take_share(services, cache, plan.growth, share, request, results)
                if shared:
                    tally.add_shared(shared, (share.begin + shared) * services.tokens_per_block)
            if _admitted(store, cache, plan, stream, reservation.for_others(cache.live_entries())):
                reservation.release_locked(own)
                cache.count_reuse(tally, request.preempted, request.lookup)
                results.append(cache)
            else:
                cache.discard()
                results.append(None)
    finally:
        for page in claims:
            store.unclaim(page)
    services.last_batch_refusals = tuple(None if result is not None else cache.last_refusal for cache, result in zip(caches, results))
    if None in results:  # the refused requests' matched pages go back; those an admitted one used stay filed
        order.restore({id(page) for pages, result in zip(held, results) if result is not None for page in pages})
    return results


class BatchReservation:
    """The GPU pages per pool group that the batch's claims alone keep out of the eviction lists (no cache locks
    them yet): ``num_locked`` counts them, but for a request's admission limit (``max_util_for_resume``, the
    watermark) those other requests matched are no pages it locks; it counts what its own create + resume would
    at that point. Pages leave the reservation once an admitted request locks them (``num_locked`` then counts
    them as locked, for the requests after it)."""

    def __init__(self, claims: list[Page], num_pool_groups: int) -> None:
        self._pages: dict[int, Page] = {id(page): page for page in claims if page.level == 0 and page.lock_count == 0}
        self._counts = [0] * num_pool_groups
        for page in self._pages.values():
            self._counts[page.pool_group] += 1

    def for_others(self, own: list[Page]) -> list[int]:
        """Per pool group, the reserved pages outside ``own`` (the asking request's own pages: its resume would
        count them; the sources it copies from it would not, so they stay reserved)."""
        counts = list(self._counts)
        for page in {id(page): page for page in own if id(page) in self._pages}.values():
            counts[page.pool_group] -= 1
        return counts

    def release_locked(self, own: list[Page]) -> None:
        """An admitted request locked its matched pages: ``num_locked`` counts them from now on."""
        for page in own:
            if page.lock_count > 0 and self._pages.pop(id(page), None) is not None:
                self._counts[page.pool_group] -= 1


def _admitted(store: PageStore, cache: CacheState, plan: AdmissionPlan, stream: CudaStream, reserved: list[int]) -> bool:
    """``cache.admit``; a cache whose matched pages lost their content (a failed disk read) is refused like one
    that does not fit, with a refusal saying so: discarded, so the request is created again and recomputes what it
    lost."""
    try:
        return cache.admit(plan, stream, reserved)
    except PageContentLostError:
        cache.note_refusal(content_lost_refusal(store, "create_kv_cache_batch"))
        return False


def _check_requests(services: CacheServices, requests: Sequence[object], text_only: bool) -> list[KVCacheRequest]:
    checked: list[KVCacheRequest] = []
    for position, request in enumerate(requests):
        if not isinstance(request, KVCacheRequest):
            raise TypeError(f"requests[{position}] must be a KVCacheRequest, got {request!r}")
        tokens = check_tokens(request.input_tokens, f"requests[{position}].input_tokens")
        if text_only:
            check_text_only(tokens, f"requests[{position}].input_tokens")
        scope = check_scope(request.reuse_scope, f"requests[{position}].reuse_scope")
        # Equal plain values in place of what may have been set since construction (a subclass's methods would
        # run inside the call: tokens of a bytes subclass, a ReuseScope subclass).
        request.input_tokens = tokens
        if scope is not None and type(scope) is not ReuseScope:
            request.reuse_scope = ReuseScope(scope.lora_id, scope.salt)
        callback = request.custom_priority_callback
        if callback is not None and not callable(callback):
            raise TypeError(f"requests[{position}].custom_priority_callback must be callable, got {callback!r}")
        capacity = None if request.capacity is None else as_int(request.capacity, f"requests[{position}].capacity")
        new = None if request.num_new_tokens is None else as_int(request.num_new_tokens, f"requests[{position}].num_new_tokens")
        _check_lengths(capacity, new, f"requests[{position}]")
        check_lookup_flags(request.preempted, request.lookup, f"requests[{position}].")
        checked.append(request)
    return checked


def _batch_ids(registry: CacheRegistry, requests: list[KVCacheRequest]) -> list[int]:
    """Every request's cache id, checked before any cache opens: explicit ids unique and unused, automatic ids
    taken in order from the manager's counter, skipping live ids and the batch's explicit ones."""
    explicit: set[int] = set()
    for position, request in enumerate(requests):
        if request.id is not None:
            cache_id = as_int(request.id, f"requests[{position}].id")
            if cache_id in explicit or cache_id in registry.live:
                raise ValueError(f"requests[{position}].id {cache_id} is already used")
            explicit.add(cache_id)
    ids: list[int] = []
    following = registry.next_id
    for request in requests:
        if request.id is not None:
            cache_id = int(request.id)
        else:
            cache_id = following
            while cache_id in registry.live or cache_id in explicit:
                cache_id += 1
            explicit.add(cache_id)
        ids.append(cache_id)
        following = cache_id + 1
    return ids


def _plan_shares(
    services: CacheServices, requests: list[KVCacheRequest], caches: list[CacheState]
) -> list[BatchShare | None]:
    """Which earlier request of the batch each request shares its common prefix with (``batch_sharing.py``)."""
    if len(requests) < 2 or not batch_sharing_applies(services):
        return [None] * len(requests)
    planner = SharePlanner(services.tokens_per_block)
    shares: list[BatchShare | None] = []
    for request, cache in zip(requests, caches):
        tokens = list(request.input_tokens)
        fixed = None if request.num_new_tokens is not None else _capacity_of(request, cache.history_length)
        share = planner.plan(len(shares), cache, tokens, fixed)
        shares.append(share)
        planner.offer(len(shares) - 1, cache, tokens, max(_capacity_of(request, _reused(cache, share, services)), cache.capacity))
    return shares


def _reused(cache: CacheState, share: BatchShare | None, services: CacheServices) -> int:
    """The history a request starts with if its planned share happens."""
    return cache.history_length if share is None else share.end * services.tokens_per_block


def _take_share(
    services: CacheServices,
    cache: CacheState,
    growth: ResizePlan,
    share: BatchShare,
    request: KVCacheRequest,
    admitted: list[CacheState | None],
) -> int:
    """Phase 2, just before admitting: hold the pages of the first candidate source that was admitted (none if
    all were refused) and narrow the plan to what is left to allocate; a request sized by ``num_new_tokens``
    counts from the history it really got. Returns how many blocks it shares."""
    tpb = services.tokens_per_block
    end = share.begin
    found = share.first_admitted(admitted)
    if found is not None:
        source = admitted[found[0]]
        assert source is not None
        end = cache.share_prefix(source, share.begin, found[1], list(request.input_tokens))
    history = cache.history_length if end == share.begin else end * tpb
    capacity = growth.capacity
    if request.num_new_tokens is not None:
        capacity = max(_capacity_of(request, history), cache.capacity)
    growth.narrow(capacity, history, ceil_div(capacity, tpb), range(share.begin, end))
    return end - share.begin


def _check_lengths(capacity: int | None, num_new_tokens: int | None, owner: str) -> None:
    """Bad lengths raise naming the field: each >= 0, and at most one of the two given."""
    if capacity is not None and capacity < 0:
        raise ValueError(f"{owner}.capacity must be >= 0, got {capacity}")
    if num_new_tokens is not None and num_new_tokens < 0:
        raise ValueError(f"{owner}.num_new_tokens must be >= 0, got {num_new_tokens}")
    if capacity is not None and num_new_tokens is not None:
        raise ValueError(
            f"{owner} takes capacity (absolute) or num_new_tokens (beyond the reused history), not both: got "
            f"capacity={capacity} and num_new_tokens={num_new_tokens}"
        )


def _capacity_of(request: KVCacheRequest, reused: int) -> int:
    """The capacity a request asks for, given the ``reused`` tokens its cache starts with: ``num_new_tokens`` past
    them, up to the prompt's last token, the one after ``input_tokens`` (see ``KVCacheRequest``)."""
    if request.num_new_tokens is not None:
        return min(reused + int(request.num_new_tokens), len(request.input_tokens) + 1)
    return len(request.input_tokens) if request.capacity is None else int(request.capacity)
