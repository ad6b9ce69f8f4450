"""How the batcher lets a new request in: one ``create_kv_cache`` at a time, or one two-phase batch call.

A new cache starts suspended with the longest cached prefix of the prompt (its last token left out: the step that
computes it gives the next token's logits); ``resume`` locks it on the GPU and ``resize`` makes room for the first
chunk after the reused prefix. Whatever does not fit is closed again, leaving the request waiting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import KVCacheRequest
from .engine import R

if TYPE_CHECKING:
    from .batcher import ContinuousBatcher


def admit_one(batcher: ContinuousBatcher[R], request: R) -> bool:
    """create + resume + resize for the first chunk (after ``probe_reuse`` when the options ask for it); False,
    with nothing kept, when it does not fit. On success ``request.cache`` is set; the caller starts it."""
    engine = batcher.engine
    manager = batcher.manager
    options = batcher.options
    engine.prepare(request)
    prompt = request.tokens[: request.prompt_length - 1]
    scope = request.scope
    engine.before_admission()
    if options.probe_reuse:
        batcher.timed(lambda: manager.probe_reuse(scope, prompt))
    cache = batcher.timed(lambda: manager.create_kv_cache(scope, prompt, id=request.request_id))
    if batcher.timed(cache.resume):
        engine.after_admission()
        reused = cache.num_committed_tokens
        request.target = request.next_target(options.chunk, reused, options.snapshot_block)
        engine.matched(request, cache)
        if batcher.resize(cache, request.target):
            request.cache = cache
            engine.admitted([request])
            return True
    batcher.timed(cache.close)
    return False


def admit_batch(batcher: ContinuousBatcher[R]) -> list[R]:
    """Admit every admissible request that fits in one ``create_kv_cache_batch`` call, and start them.

    Capacities come from ``probe_reuse`` (the first chunk after the reusable prefix). A request that does not fit
    gets None and stays waiting; later, smaller ones of the same batch may still be admitted."""
    candidates = batcher.admissible(batcher.options.max_batch - len(batcher.running))
    # A recomputed request goes in a batch of its own: what an engine counts at admission is then per request.
    repeats = [position for position, request in enumerate(candidates) if request.requeues]
    if repeats:
        candidates = candidates[: max(1, repeats[0])]
    scheduled = _admit_together(batcher, candidates)
    if not scheduled and len(candidates) > 1:
        # Phase 1 pins every page the batch matched, so the pages later requests claimed can leave no room for
        # the head (no request may evict another's claim): give the head a batch of its own.
        scheduled = _admit_together(batcher, candidates[:1])
    return scheduled


def _admit_together(batcher: ContinuousBatcher[R], candidates: list[R]) -> list[R]:
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
        prompt = request.tokens[: request.prompt_length - 1]
        reusable = batcher.timed(lambda: manager.probe_reuse(request.scope, prompt))
        target = request.next_target(options.chunk, reusable, options.snapshot_block)
        batch.append(KVCacheRequest(prompt, id=request.request_id, capacity=target, reuse_scope=request.scope))
    caches = batcher.timed(lambda: manager.create_kv_cache_batch(batch))
    engine.after_admission()
    admitted: list[R] = []
    for request, cache in zip(candidates, caches):
        if cache is None:
            continue
        request.target = request.next_target(options.chunk, cache.num_committed_tokens, options.snapshot_block)
        engine.matched(request, cache)
        if cache.capacity != request.target and not batcher.resize(cache, request.target):
            batcher.timed(cache.close)
            continue
        request.cache = cache
        batcher.waiting.remove(request)
        batcher.start(request)
        admitted.append(request)
    engine.admitted(admitted)
    return admitted
