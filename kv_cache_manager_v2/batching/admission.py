"""How the batcher lets a new request in: one ``create_kv_cache`` at a time, or one two-phase batch call.

A new cache starts suspended with the longest cached prefix of the prompt (its last token left out: the step that
computes it gives the next token's logits) and the request's prefix boundaries declared as ``snapshot_at``;
``resume`` locks it on the GPU and ``resize`` makes room for the first chunk after the reused prefix. A batch asks
for that chunk as ``num_new_tokens``, so the manager counts it from whatever each request reuses (the tree, or an
earlier request of the same batch) and ends it at the prompt's end at the latest (the token after those it may
reuse); the first chunk is then cut to where it must end (a snapshot point). Whatever does not fit is closed
again, leaving the request waiting, with the manager's reason in ``request.refusal``.
"""

from __future__ import annotations

from typing import Callable, Generic, Protocol, TypeVar

from .. import KVCache, KVCacheManager, KVCacheRequest, PageContentLostError, Refusal
from .engine import BatchEngine, R
from .options import BatchingOptions

_T = TypeVar("_T")


class AdmittingBatcher(Protocol, Generic[R]):
    """What admission needs of the batcher (``batcher.ContinuousBatcher``; a Protocol, so neither module imports
    the other both ways)."""

    @property
    def manager(self) -> KVCacheManager: ...

    @property
    def engine(self) -> BatchEngine[R]: ...

    @property
    def options(self) -> BatchingOptions: ...

    @property
    def waiting(self) -> list[R]: ...

    @property
    def running(self) -> list[R]: ...

    def timed(self, call: Callable[[], _T]) -> _T: ...

    def resize(self, cache: KVCache, capacity: int) -> bool: ...

    def admissible(self, limit: int) -> list[R]: ...

    def start(self, request: R) -> None: ...


def never_fits(refusal: Refusal | None) -> bool:
    """Whether a refusal says waiting cannot help: the step does not fit even an otherwise empty manager."""
    return refusal is not None and not refusal.fits_empty_manager


def first_target(batcher: AdmittingBatcher[R], request: R, cache: KVCache) -> int:
    """The capacity of ``request``'s first step after what its new ``cache`` already holds."""
    options = batcher.options
    return request.next_target(options.chunk, cache.history_length, options.snapshot_block, cache.snapshot_points)


def admit_one(batcher: AdmittingBatcher[R], request: R) -> bool:
    """create + resume + resize for the first chunk (after ``probe_reuse`` when the options ask for it); False,
    with nothing kept and ``request.refusal`` set, when it does not fit. On success ``request.cache`` is set; the
    caller starts it. The capacity asked is exactly the first step's, so the refusal's ``fits_empty_manager`` is
    the batcher's test of whether waiting can help. A matched prefix is locked whole by the first resume, which
    ``max_util_for_resume`` bounds and later resizes do not: when that alone makes the resume never fit, the
    request is admitted without reuse, computing the prefix again chunk by chunk."""
    engine = batcher.engine
    manager = batcher.manager
    engine.prepare(request)
    prompt = request.tokens[: request.prompt_length - 1]
    scope = request.scope
    boundaries = request.prefix_boundaries
    preempted = request.requeues > 0  # recomputed: its lookup counts apart, as vLLM's preempted_hits
    engine.before_admission()
    if batcher.options.probe_reuse:
        batcher.timed(lambda: manager.probe_reuse(scope, prompt))

    def created(matched_tokens: list[int]) -> KVCache:
        return batcher.timed(
            lambda: manager.create_kv_cache(
                scope, matched_tokens, id=request.request_id, snapshot_at=boundaries, preempted=preempted
            )
        )

    cache = created(prompt)
    admitted = resumed(batcher, cache)
    if not admitted and cache.num_committed_tokens > 0 and never_fits(cache.last_refusal):
        batcher.timed(cache.close)
        cache = created([])
        admitted = resumed(batcher, cache)
    if admitted:
        engine.after_admission()
        request.target = first_target(batcher, request, cache)
        engine.matched(request, cache)
        if batcher.resize(cache, request.target):
            request.cache = cache
            engine.admitted([request])
            return True
    request.refusal = cache.last_refusal
    batcher.timed(cache.close)
    return False


def resumed(batcher: AdmittingBatcher[R], cache: KVCache) -> bool:
    """``cache.resume``, False when it did not fit and also when pages its match found lost their content (a failed
    disk tier read: ``PageContentLostError``). Those pages left the tree, so the request's next admission matches
    without them and computes their tokens again."""
    try:
        return batcher.timed(cache.resume)
    except PageContentLostError:
        return False


def admit_batch(batcher: AdmittingBatcher[R]) -> list[R]:
    """Admit every admissible request that fits in one ``create_kv_cache_batch`` call, and start them.

    A request that does not fit gets None and stays waiting; later, smaller ones of the same batch may still be
    admitted. When none was admitted the head tries alone with ``admit_one`` (its exact first step), also when it
    was alone and its batch refusal says it never fits: a batch asks for a whole chunk after the reused prefix,
    possibly past a snapshot point where the first step ends, so only an exact request's refusal may condemn it."""
    candidates = batcher.admissible(batcher.options.max_batch - len(batcher.running))
    # A recomputed request goes in a batch of its own: what an engine counts at admission is then per request.
    repeats = [position for position, request in enumerate(candidates) if request.requeues]
    if repeats:
        candidates = candidates[: max(1, repeats[0])]
    scheduled = _admit_together(batcher, candidates)
    if scheduled or not candidates:
        return scheduled
    head = candidates[0]
    # Phase 1 pins every page the batch matched, so the pages later requests claimed can leave no room for the
    # head (no request may evict another's claim): give the head an admission of its own.
    if (len(candidates) > 1 or never_fits(head.refusal)) and admit_one(batcher, head):
        batcher.waiting.remove(head)
        batcher.start(head)
        return [head]
    return []


def _admit_together(batcher: AdmittingBatcher[R], candidates: list[R]) -> list[R]:
    if not candidates:
        return []
    engine = batcher.engine
    manager = batcher.manager
    options = batcher.options
    for request in candidates:
        engine.prepare(request)
    batch: list[KVCacheRequest] = []
    engine.before_admission()
    for request in candidates:
        # The manager counts the chunk from the reuse it finds, so no probe_reuse sizes it.
        batch.append(KVCacheRequest(
            request.tokens[: request.prompt_length - 1], id=request.request_id, num_new_tokens=options.chunk,
            reuse_scope=request.scope, snapshot_at=request.prefix_boundaries, preempted=request.requeues > 0,
        ))
    caches = batcher.timed(lambda: manager.create_kv_cache_batch(batch))
    refusals = manager.last_batch_refusals
    engine.after_admission()
    admitted: list[R] = []
    for request, cache, refusal in zip(candidates, caches, refusals):
        if cache is None:
            request.refusal = refusal
            continue
        request.target = first_target(batcher, request, cache)
        engine.matched(request, cache)
        if cache.capacity != request.target and not batcher.resize(cache, request.target):
            request.refusal = cache.last_refusal
            batcher.timed(cache.close)
            continue
        request.cache = cache
        batcher.waiting.remove(request)
        batcher.start(request)
        admitted.append(request)
    engine.admitted(admitted)
    return admitted
