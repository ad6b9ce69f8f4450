"""One continuous-batching loop (vLLM-style) over a manager, shared by the simulator and the model server.

Each step:

1. *Running* requests are scheduled in admission order: a prefill chunk (ending at the cache's snapshot points)
   or one decode token (``BatchedRequest.next_target``). ``resize`` grows the cache; when it returns False the
   refusal (``KVCache.last_refusal``) decides: a step that would not fit even an empty manager fails the request
   (``BatchEngine.reject``, with the reason in ``request.refusal``); otherwise the most recently admitted
   running request is preempted by ``suspend()`` (its pages stay cached and may be offloaded to a colder tier)
   or, when that made no GPU room (no colder tier, or none with room for its pages), closed and recomputed later
   (suspended, it would keep every GPU page it holds; closed, its committed blocks stay cached for the recompute
   to reuse while room allows) and the resize is retried; a request that is itself the most recent one preempts itself. ``resize`` is not
   bounded by ``max_util_for_resume``, so a running request can outgrow what a resume may lock: one whose cache
   is not ``resumable_alone`` is never the victim (suspended, it could never come back), the next most recent
   is, else the most recent of those already scheduled this step (its growth undone); when no running request
   can resume, suspended requests are recomputed later from scratch, the most recently admitted first (their
   held pages may be what pins the GPU), and once none is left the step of the one wanting room is refused
   (``reject``, though it may fit alone: its ``refusal.fits_empty_manager`` says so).
2. Arriving requests of known length (``max_length``) that would not fit even an empty manager computed in
   ``chunk`` chunks (``can_fit_in_chunks``) are rejected at once, none of their prompt computed in vain.
   If nothing was preempted, suspended requests are resumed (FCFS), then waiting requests are admitted (FCFS
   among those that have arrived and whose ``follows`` has finished): ``create_kv_cache`` + ``resume`` +
   ``resize`` for the first chunk, or one ``create_kv_cache_batch`` call (``admission.py``). A refusal that says
   the request never fits fails it at once; any other refusal makes it wait (no preemption for admission).
3. The engine computes the step, the computed tokens are committed, and finished requests ``stop_committing``
   and ``close`` (publishing their blocks for later requests).
4. With ``BatchingOptions.prefetch``, what the next step needs moves ahead (``prefetching.py``): the suspended
   request next in line to resume has its pages brought to the GPU, and with a remote tier the requests next in
   line for admission have their prefixes fetched.

When nothing can be scheduled because suspended caches pin the GPU with no colder tier to go to, the most
recently admitted suspended request is closed and recomputed later from scratch (as is one whose resume finds
pages lost by a failed disk tier move: ``PageContentLostError``); a request that cannot fit even alone goes to
``BatchEngine.reject``. Only manager calls are timed (``manager_ns``), never the engine.
"""

from __future__ import annotations

import time
from typing import Callable, Generic, Sequence, TypeVar

from .. import KVCache, KVCacheManager, PageContentLostError, Refusal
from .admission import admit_batch, admit_one, never_fits
from .engine import BatchEngine, R
from .options import BatchingOptions
from .prefetching import Prefetcher
from .request import check_requests

_T = TypeVar("_T")


class ContinuousBatcher(Generic[R]):
    """The queues (pending, waiting, suspended, running) and one step at a time (see the module docstring).

    ``requests`` are in arrival order (bad ones are refused here, naming the request and field: ``check_requests``).
    Counters: ``step_index`` (steps so far, idle ones included),
    ``idle_steps``, ``request_steps`` (requests scheduled, summed over steps), ``preemptions``, ``resumes``,
    ``recomputes``, ``rejected``, ``manager_ns`` (time inside manager calls); ``prefetcher`` counts what was
    prefetched."""

    def __init__(
        self, manager: KVCacheManager, requests: Sequence[R], engine: BatchEngine[R], options: BatchingOptions
    ) -> None:
        check_requests(requests)
        self.manager: KVCacheManager = manager
        self.engine: BatchEngine[R] = engine
        self.options: BatchingOptions = options
        self.total: int = len(requests)
        self.pending: list[R] = list(requests)  # not arrived yet
        self.waiting: list[R] = []  # arrived, never admitted or to be recomputed; FCFS (request id) order
        self.suspended: list[R] = []  # preempted by suspension, FCFS order
        self.running: list[R] = []  # admission order
        self.finished_ids: set[int] = set()  # finished or rejected
        self.step_index: int = 0
        self.idle_steps: int = 0
        self.request_steps: int = 0
        self.preemptions: int = 0
        self.resumes: int = 0
        self.recomputes: int = 0
        self.rejected: int = 0
        self.manager_ns: int = 0
        self.admissions: int = 0
        self.preempted_this_step: bool = False
        self.refused_at: list[int] | None = None  # available GPU slots per pool group when admission last failed
        self.refused_step: int = 0
        self.prefetcher: Prefetcher[R] = Prefetcher(manager, engine, self.timed)
        self._length_cap: tuple[tuple[int, ...], int] | None = None  # GPU slots per pool group, max_admissible then
        self._in_step: str | None = None  # the call in flight (step, close_all): an engine hook may not make another

    @property
    def done(self) -> bool:
        """Whether every request has finished or been rejected."""
        return len(self.finished_ids) >= self.total

    def step(self) -> list[R]:
        """One step (see the module docstring); returns the requests it computed (none: an idle step). An engine
        hook calling ``step`` or ``close_all`` while a step runs gets ``RuntimeError`` (the step in flight has
        scheduled and resized requests it has yet to commit), and nothing changes."""
        self._enter("step")
        try:
            return self._step()
        finally:
            self._in_step = None

    def _enter(self, call: str) -> None:
        if self._in_step is not None:
            raise RuntimeError(
                f"ContinuousBatcher.{call} called while ContinuousBatcher.{self._in_step} is in flight (from an engine "
                f"hook): nothing changed"
            )
        self._in_step = call

    def _step(self) -> list[R]:
        self.step_index += 1
        self._arrive()
        self.preempted_this_step = False
        scheduled = self._schedule_running()
        if not self.preempted_this_step:
            scheduled.extend(self._admit())
        if not scheduled:
            self._unblock()
            self.idle_steps += 1
            return scheduled
        self.request_steps += len(scheduled)
        engine = self.engine
        engine.compute(scheduled)
        for request in scheduled:
            cache = _cache_of(request)
            tokens = request.tokens[cache.num_committed_tokens : request.target]
            self.timed(lambda: cache.commit(tokens))
            if engine.is_done(request):
                self._finish(request)
        if self.options.prefetch:
            self._prefetch_ahead()
        engine.step_done()
        return scheduled

    def close_all(self) -> None:
        """Close every cache still open (after an error), so the manager can shut down."""
        self._enter("close_all")
        try:
            for request in self.running + self.suspended + self.waiting:
                if request.cache is not None:
                    request.cache.close()
                    request.cache = None
        finally:
            self._in_step = None

    def timed(self, call: Callable[[], _T]) -> _T:
        """``call()``, its time added to ``manager_ns`` (the admission module times its calls here too)."""
        start = time.perf_counter_ns()
        try:
            return call()
        finally:
            self.manager_ns += time.perf_counter_ns() - start

    def admissible(self, limit: int) -> list[R]:
        """Up to ``limit`` waiting requests in FCFS order whose ``follows`` has finished."""
        result: list[R] = []
        for request in self.waiting:
            if len(result) >= limit:
                break
            follows = request.follows
            if follows is None or follows in self.finished_ids:
                result.append(request)
        return result

    def resize(self, cache: KVCache, capacity: int) -> bool:
        """``cache.resize(capacity)``, timed (internal: the admission module calls it too)."""
        return self.timed(lambda: cache.resize(capacity))

    def start(self, request: R) -> None:
        """``request`` joins the running ones (internal: the admission module calls it)."""
        self.admissions += 1
        request.admitted = self.admissions
        self.running.append(request)

    def _arrive(self) -> None:
        """Move requests whose arrival step has come into the waiting queue (they stay in FCFS order)."""
        pending = self.pending
        moved = 0
        while moved < len(pending) and pending[moved].arrival_step <= self.step_index:
            moved += 1
        if moved:
            arrived = pending[:moved]
            del pending[:moved]
            self.waiting.extend(arrived)
            self.waiting.sort(key=_request_order)
            for request in arrived:
                if not self._fits_alone(request):
                    self._reject(request, self.waiting)

    def _fits_alone(self, request: R) -> bool:
        """Whether a request of known length (``max_length``) fits an empty manager computed in ``chunk`` chunks; one
        that does not is rejected on arrival, before any of its prompt is computed only to be thrown away. The
        manager's ``max_admissible`` is asked once per GPU tier size, so most requests cost no manager call."""
        length = request.max_length
        if length is None:
            return True
        manager = self.manager
        chunk = self.options.chunk
        slots = tuple(stat.total for stat in manager.get_storage_statistics(0))
        if self._length_cap is None or self._length_cap[0] != slots:
            self._length_cap = (slots, self.timed(lambda: manager.max_admissible(chunk)))
        if length <= self._length_cap[1]:
            return True
        # Above the cap a window's length may still fit (its pages are not monotone in the length): the exact answer,
        # and the reason when it does not.
        if self.timed(lambda: manager.can_fit_in_chunks(length, chunk)):
            return True
        request.refusal = manager.last_refusal
        return False

    def _schedule_running(self) -> list[R]:
        scheduled: list[R] = []
        position = 0
        options = self.options
        while position < len(self.running):
            request = self.running[position]
            cache = _cache_of(request)
            request.target = self._next_target(request, cache)
            while not self.resize(cache, request.target):
                if self._gave_up(request, cache, self.running):
                    break
                victim = self._victim(position)
                if victim is None and self.suspended:  # their held pages may be what pins the GPU
                    self._recompute_latest_suspended()
                    continue
                if victim is None:  # suspending any of them would strand it: this request's step is refused
                    self._reject(request, self.running)
                    break
                self._preempt(victim)
                if victim is request:
                    break
                if victim in scheduled:  # scheduled earlier this step: its growth undone, it no longer runs
                    scheduled.remove(victim)
                    position -= 1
            else:
                scheduled.append(request)
                position += 1
        return scheduled

    def _admit(self) -> list[R]:
        """Resume suspended requests, then admit new ones, while the batch has room and memory allows."""
        scheduled: list[R] = []
        if not self._room_grew():
            return scheduled
        options = self.options
        while self.suspended and len(self.running) < options.max_batch:
            request = self.suspended[0]
            cache = _cache_of(request)
            try:
                resumed = self.timed(cache.resume)
            except PageContentLostError:  # a failed disk tier move lost some of its pages: compute it again
                del self.suspended[0]
                self._requeue(request)
                self.recomputes += 1
                continue
            if not resumed:
                if self._gave_up(request, cache, self.suspended):
                    continue
                self._note_refusal()
                return scheduled
            request.target = self._next_target(request, cache)
            if not self.resize(cache, request.target):
                refusal = cache.last_refusal  # suspend keeps it, but read it before the call
                self.timed(cache.suspend)
                if self._gave_up(request, cache, self.suspended, refusal):
                    continue
                self._note_refusal()
                return scheduled
            del self.suspended[0]
            self.resumes += 1
            self.start(request)
            scheduled.append(request)
        if options.batch_admission:
            admitted = admit_batch(self)
            head = self.admissible(1)
            if not admitted and len(self.running) < options.max_batch and head:
                if never_fits(head[0].refusal):
                    self._reject(head[0], self.waiting)
                else:
                    self._note_refusal()
            scheduled.extend(admitted)
            return scheduled
        while len(self.running) < options.max_batch:
            candidates = self.admissible(1)
            if not candidates:
                break
            candidate = candidates[0]
            if not admit_one(self, candidate):
                if never_fits(candidate.refusal):
                    self._reject(candidate, self.waiting)
                    continue
                self._note_refusal()
                break
            self.waiting.remove(candidate)
            self.start(candidate)
            scheduled.append(candidate)
        return scheduled

    def _prefetch_ahead(self) -> None:
        """Before the next step: prefetch for the suspended request next in line to resume when the next step will try
        (a seat is free, this step did not preempt, the refusal back-off lets it), and (with a remote tier) for the
        waiting requests next in line (see ``prefetching.py``)."""
        options = self.options
        refused_at = self.refused_at
        will_try = self.suspended and len(self.running) < options.max_batch and not self.preempted_this_step
        if will_try and (refused_at is None or self._more_room(refused_at)):
            self.prefetcher.before_resume(self.suspended[0])
        if self.prefetcher.has_remote_tier:
            self.prefetcher.before_admission(self.admissible(options.max_batch))

    def _next_target(self, request: R, cache: KVCache) -> int:
        options = self.options
        history = cache.history_length
        stops = cache.snapshot_points if history < request.prompt_length else ()  # a decode step has none
        return request.next_target(options.chunk, history, options.snapshot_block, stops)

    def _gave_up(self, request: R, cache: KVCache, queue: list[R], refusal: Refusal | None = None) -> bool:
        """After a refused ``resize``/``resume`` of ``request`` (in ``queue``): keep the reason and, when it says the
        step never fits, reject the request (True) instead of preempting others or waiting for them."""
        request.refusal = cache.last_refusal if refusal is None else refusal
        if not never_fits(request.refusal):
            return False
        self._reject(request, queue)
        return True

    def _note_refusal(self) -> None:
        if self.options.refusal_backoff:
            self.refused_at = [stat.available for stat in self.manager.get_storage_statistics(0)]
            self.refused_step = self.step_index

    def _room_grew(self) -> bool:
        """Whether some pool group has more available GPU slots than at the last refusal (True without one)."""
        refused_at = self.refused_at
        if refused_at is None:
            return True
        if self._more_room(refused_at):
            self.refused_at = None
            return True
        return False

    def _more_room(self, refused_at: list[int]) -> bool:
        """Whether some pool group has more available GPU slots now than ``refused_at`` counted."""
        return any(stat.available > before for stat, before in zip(self.manager.get_storage_statistics(0), refused_at))

    def _victim(self, position: int) -> R | None:
        """The most recently admitted of ``running[position:]`` (the request wanting room, then those not yet
        scheduled this step) whose cache can resume once suspended (``KVCache.resumable_alone``), else the most
        recently admitted such one of those scheduled before it this step (the request wanting room outgrew the
        limit: rejecting it would fail a request that fits alone); None if no running request can resume."""
        for candidate in reversed(self.running[position:]):
            if _cache_of(candidate).resumable_alone:
                return candidate
        for candidate in reversed(self.running[:position]):
            if _cache_of(candidate).resumable_alone:
                return candidate
        return None

    def _preempt(self, victim: R) -> None:
        """Suspend a running request, undoing any growth it got this step; it resumes later (FCFS). When that made
        no GPU room (no colder tier, or none with room for its pages), the request is closed and recomputed later
        instead: its committed blocks stay cached for the recompute to reuse."""
        cache = _cache_of(victim)
        if cache.capacity > cache.history_length:
            self.resize(cache, cache.history_length)
        self.running.remove(victim)
        before = [stat.available for stat in self.manager.get_storage_statistics(0)]
        self.timed(cache.suspend)
        if self._more_room(before):
            self.suspended.append(victim)
            self.suspended.sort(key=_request_order)
        else:  # no colder tier has room for its pages: suspended, it would pin them on the GPU
            self._requeue(victim)
            self.recomputes += 1
        self.preemptions += 1
        self.preempted_this_step = True

    def _unblock(self) -> None:
        """Nothing could be scheduled this step: find out why and make sure a later step can progress."""
        if self.running or self.done:  # done: this step rejected the last request
            return
        if self.refused_at is not None and self.refused_step != self.step_index:
            self.refused_at = None  # admission was skipped, not refused, this step: try it for real next step
            return
        if len(self.suspended) > 1:  # suspended caches pin memory the head cannot get
            self._recompute_latest_suspended()
            return
        if self.suspended:
            self._reject(self.suspended[-1], self.suspended)  # alone on the machine and still does not fit
            return
        head = self.admissible(1)
        if head:
            self._reject(head[0], self.waiting)
            return
        if self.pending:  # nothing has arrived yet: skip ahead to the next arrival (idle steps, not simulated)
            skip_to = max(self.step_index, self.pending[0].arrival_step - 1)
            self.idle_steps += skip_to - self.step_index
            self.step_index = skip_to
            return
        raise RuntimeError("no request is running, suspended or admissible, yet some are unfinished")

    def _recompute_latest_suspended(self) -> None:
        """Close the most recently admitted suspended request, whose held pages may pin the GPU (no colder tier to
        take them), and queue it to be recomputed from scratch."""
        victim = max(self.suspended, key=_admission_order)
        self.suspended.remove(victim)
        self._requeue(victim)
        self.recomputes += 1

    def _requeue(self, request: R) -> None:
        cache = _cache_of(request)
        self.timed(cache.close)
        request.cache = None
        request.requeues += 1
        self.engine.requeued(request)
        self.waiting.append(request)
        self.waiting.sort(key=_request_order)

    def _reject(self, request: R, queue: list[R]) -> None:
        """The engine decides first (it may raise, leaving every queue as it was), then the request is dropped."""
        self.engine.reject(request)
        queue.remove(request)
        cache = request.cache
        if cache is not None:
            self.timed(cache.close)
            request.cache = None
        self.rejected += 1
        # Later turns of the chat embed this turn's output: let them run (their prompt is already known).
        self.finished_ids.add(request.request_id)

    def _finish(self, request: R) -> None:
        cache = _cache_of(request)
        self.timed(cache.stop_committing)
        self.timed(cache.close)
        request.cache = None
        self.running.remove(request)
        self.finished_ids.add(request.request_id)
        self.engine.finished(request)


def _cache_of(request: R) -> KVCache:
    cache = request.cache
    if cache is None:
        raise RuntimeError(f"request {request.request_id} has no cache")
    return cache


def _request_order(request: R) -> int:
    return request.request_id


def _admission_order(request: R) -> int:
    return request.admitted
