"""The simulator's scheduler (SPEC §10): a vLLM-style continuous-batching loop over ``Workload`` requests.

Each step:

1. *Running* requests are scheduled in admission order: a prefill chunk of at most ``chunk`` tokens, or one
   decode token. ``resize`` grows the cache; when it returns False the most recently admitted running request
   is preempted by ``suspend()`` (its pages stay cached and may be offloaded) and the resize is retried; a
   request that is itself the most recent one preempts itself.
2. If nothing was preempted, *suspended* requests are resumed (FCFS), then *waiting* requests are admitted
   (FCFS among those that have arrived and whose previous chat turn has finished): ``probe_reuse`` +
   ``create_kv_cache`` + ``resume`` + ``resize`` for the first chunk, or one ``create_kv_cache_batch`` call.
3. The ``FakeEngine`` checks every readable history token of every scheduled cache and writes this step's
   tokens, then the computed tokens are committed; finished requests ``stop_committing`` and ``close``.

Only manager calls are timed (``time.perf_counter_ns``), never the engine. When memory is so short that no
request can make progress (suspended caches pin the GPU with no colder tier to go to), the most recently
admitted suspended request is closed and recomputed later from scratch; a request that cannot fit even alone is
rejected. The figures are kept by ``metrics.Metrics``. Request tokens exist only while a request is admitted.
"""

from __future__ import annotations

import time
from typing import Sequence

from .. import KVCache, KVCacheManager, KVCacheRequest, ReuseScope
from ..testing.fake_engine import FakeEngine
from .metrics import Metrics
from .options import SimulatorOptions
from .result import ProgressCallback, SimulationInterrupted, SimulationResult, WorkloadSummary
from .reuse_sources import EventForward, ReuseSources
from .workload import SimulatedRequest


class Workload:
    """The requests of a run (FCFS order) and the ideal prefix hit rate they allow (an infinite cache)."""

    def __init__(
        self, requests: Sequence[SimulatedRequest], ideal_hit_rate: float, hash_block_hit_rate: float | None = None
    ) -> None:
        self.requests = requests
        self.ideal_hit_rate = ideal_hit_rate
        self.hash_block_hit_rate = hash_block_hit_rate


class _Request:
    """One request as the scheduler tracks it. It computes ``length`` tokens in all: the prompt, then one decode
    token per output token but the last (whose KV is never needed). Its tokens are built when first needed and
    released when it is done, so a long trace never holds them all."""

    def __init__(self, trace: SimulatedRequest) -> None:
        self.trace = trace
        self.request_id = trace.request_id
        self.arrival_step = trace.arrival_step
        self.parent_id = trace.parent_id
        self.prompt_length = trace.prompt_length
        self.output_length = trace.output_length
        self.length = trace.prompt_length + trace.output_length - 1
        self._tokens: list[int] | None = None
        self.counted = False  # its first admission's reuse is in the figures
        self.cache: KVCache | None = None
        self.admitted = 0  # admission sequence number: the highest is the most recently admitted
        self.target = 0  # capacity scheduled for this step
        self.shared = True  # False: a no-reuse run (see ``scope``)
        self.requeues = 0  # times it was closed to be recomputed from scratch

    @property
    def scope(self) -> ReuseScope | None:
        """Where its prefix is looked up: the shared scope, or in a no-reuse run one of its own per admission (a
        recomputed request does not find its earlier work either)."""
        return None if self.shared else ReuseScope(salt=f"request-{self.request_id}-{self.requeues}".encode())

    @property
    def tokens(self) -> list[int]:
        tokens = self._tokens
        if tokens is None:
            tokens = self._tokens = self.trace.token_ids()
        return tokens

    def release_tokens(self) -> None:
        self._tokens = None

    def next_target(self, chunk: int, history: int, snapshot_block: int = 0) -> int:
        """The capacity of the next step: a prefill chunk or one decode token. ``snapshot_block`` > 0 (the block
        size, with ``mamba_save_last_snapshot``): a chunk also stops where the prompt's last full block ends."""
        if history < self.prompt_length:
            target = min(self.prompt_length, history + chunk)
            last_block_end = self.prompt_length // snapshot_block * snapshot_block if snapshot_block else 0
            return last_block_end if history < last_block_end < target else target
        return min(self.length, history + 1)


class Simulation:
    """One manager, one fake engine and the scheduler's queues; ``run()`` drives it to the end."""

    def __init__(
        self,
        options: SimulatorOptions,
        manager: KVCacheManager,
        workload: Workload,
        kv_events: EventForward | None = None,
    ) -> None:
        """``kv_events`` gets every KV event the run records, once per step (and around admissions)."""
        self.options = options
        self.manager = manager
        self.engine: FakeEngine | None = FakeEngine(manager) if options.check else None
        self.chunk: int = options.chunk
        self.snapshot_block: int = options.tokens_per_block if options.last_snapshot else 0
        self.max_batch: int = options.max_batch
        self.pending: list[_Request] = [_Request(trace) for trace in workload.requests]
        for request in self.pending:
            request.shared = options.reuse
        self.waiting: list[_Request] = []  # arrived, never admitted or to be recomputed; FCFS (request id) order
        self.suspended: list[_Request] = []  # preempted by suspension, FCFS order
        self.running: list[_Request] = []  # admission order
        self.finished_ids: set[int] = set()
        self.step_index: int = 0
        self.admissions: int = 0
        self.preempted_this_step: bool = False
        self.refused_at: list[int] | None = None  # available GPU slots per pool group when admission last failed
        self.refused_step: int = 0
        self.metrics: Metrics = Metrics(options, manager, kv_events)
        self.sources: ReuseSources = self.metrics.sources
        self.result: SimulationResult = self.metrics.result
        self.result.num_requests = len(workload.requests)
        self.result.ideal_hit_rate = workload.ideal_hit_rate
        self.result.hash_block_hit_rate = workload.hash_block_hit_rate
        self.result.workload = WorkloadSummary(workload.requests)

    # ----------------------------------------------------------------------------------------------- driving
    def run(self, progress: ProgressCallback | None = None) -> SimulationResult:
        start = time.perf_counter()
        result = self.result
        total = len(self.pending)
        # Every request either finishes or is rejected; a step budget turns a scheduling bug into an error.
        budget = 100 + 4 * sum(request.length + request.arrival_step for request in self.pending)
        try:
            while len(self.finished_ids) < total:  # rejected requests are in finished_ids too
                if self.step_index > budget:
                    raise RuntimeError(f"simulation made no progress within {budget} steps")
                self.step()
                if progress is not None:
                    rejected = result.rejected
                    progress(len(self.finished_ids) - rejected, rejected, total, self.step_index)
        except KeyboardInterrupt as interrupt:
            self.metrics.gather(self.engine, len(self.finished_ids), start)
            raise SimulationInterrupted(result) from interrupt
        self.metrics.gather(self.engine, len(self.finished_ids), start)
        return result

    def step(self) -> None:
        """One scheduler step (see the module docstring)."""
        self.step_index += 1
        result = self.result
        result.steps = self.step_index
        self._arrive()
        self.preempted_this_step = False
        scheduled = self._schedule_running()
        if not self.preempted_this_step:
            scheduled.extend(self._admit())
        if not scheduled:
            self._unblock()
            result.idle_steps += 1
            return
        result.request_steps += len(scheduled)
        self.metrics.sample(self.step_index, [request.cache for request in scheduled if request.cache is not None])
        engine = self.engine
        for request in scheduled:
            cache = request.cache
            assert cache is not None
            if engine is not None:
                engine.step(cache, request.tokens)
            history = cache.history_length
            prefill = max(0, min(request.target, request.prompt_length) - history)
            result.prefill_tokens += prefill
            result.decode_tokens += request.target - history - prefill
        for request in scheduled:
            cache = request.cache
            assert cache is not None
            tokens = request.tokens[cache.num_committed_tokens : request.target]
            t0 = time.perf_counter_ns()
            cache.commit(tokens)
            result.manager_ns += time.perf_counter_ns() - t0
            if request.target == request.length:
                self._finish(request)
        self.sources.sync()

    def close_all(self) -> None:
        """Close every cache still open (after an error), so the manager can shut down."""
        for request in self.running + self.suspended + self.waiting:
            if request.cache is not None:
                request.cache.close()
                request.cache = None

    def _arrive(self) -> None:
        """Move requests whose arrival step has come into the waiting queue (they stay in FCFS order)."""
        pending = self.pending
        moved = 0
        while moved < len(pending) and pending[moved].arrival_step <= self.step_index:
            moved += 1
        if moved:
            self.waiting.extend(pending[:moved])
            del pending[:moved]
            self.waiting.sort(key=_request_order)

    # ------------------------------------------------------------------------------------------- scheduling
    def _schedule_running(self) -> list[_Request]:
        scheduled: list[_Request] = []
        position = 0
        while position < len(self.running):
            request = self.running[position]
            cache = request.cache
            assert cache is not None
            request.target = request.next_target(self.chunk, cache.history_length, self.snapshot_block)
            while not self._resize(cache, request.target):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append(request)
                position += 1
        return scheduled

    def _admit(self) -> list[_Request]:
        """Resume suspended requests, then admit new ones, while the batch has room and memory allows.

        After a refusal nothing is tried again until more GPU slots are available than then (a request
        finished, was preempted, or a window moved on): retrying a cache of thousands of pages every step
        would cost more than the whole run otherwise does."""
        scheduled: list[_Request] = []
        if not self._room_grew():
            return scheduled
        while self.suspended and len(self.running) < self.max_batch:
            request = self.suspended[0]
            cache = request.cache
            assert cache is not None
            if not self._resume(cache):
                self._note_refusal()
                return scheduled
            request.target = request.next_target(self.chunk, cache.history_length, self.snapshot_block)
            if not self._resize(cache, request.target):
                self._suspend(cache)
                self._note_refusal()
                return scheduled
            del self.suspended[0]
            self.result.resumes += 1
            self._start(request)
            scheduled.append(request)
        if self.options.batch_admission:
            admitted = self._create_batch()
            if not admitted and len(self.running) < self.max_batch and self._next_admissible() is not None:
                self._note_refusal()
            scheduled.extend(admitted)
            return scheduled
        while len(self.running) < self.max_batch:
            candidate = self._next_admissible()
            if candidate is None:
                break
            if not self._create(candidate):
                self._note_refusal()
                break
            self.waiting.remove(candidate)
            self._start(candidate)
            scheduled.append(candidate)
        return scheduled

    def _note_refusal(self) -> None:
        self.refused_at = [stat.available for stat in self.manager.get_storage_statistics(0)]
        self.refused_step = self.step_index

    def _room_grew(self) -> bool:
        """Whether some pool group has more available GPU slots than at the last refusal (True without one)."""
        refused_at = self.refused_at
        if refused_at is None:
            return True
        for stat, before in zip(self.manager.get_storage_statistics(0), refused_at):
            if stat.available > before:
                self.refused_at = None
                return True
        return False

    def _next_admissible(self) -> _Request | None:
        candidates = self._admissible(1)
        return candidates[0] if candidates else None

    def _admissible(self, limit: int) -> list[_Request]:
        """Up to ``limit`` waiting requests in FCFS order whose previous chat turn has finished."""
        result: list[_Request] = []
        for request in self.waiting:
            if len(result) >= limit:
                break
            parent = request.parent_id
            if parent is None or parent in self.finished_ids:
                result.append(request)
        return result

    def _create(self, request: _Request) -> bool:
        """probe + create + resume + resize for the first chunk; False (and nothing kept) when it does not fit."""
        manager = self.manager
        prompt = request.tokens[: request.prompt_length - 1]
        self.sources.before_admission()
        t0 = time.perf_counter_ns()
        manager.probe_reuse(request.scope, prompt)
        cache = manager.create_kv_cache(request.scope, prompt, id=request.request_id)
        resumed = cache.resume()
        self.result.manager_ns += time.perf_counter_ns() - t0
        if resumed:
            cold_pages = self.sources.after_admission()
            reused = cache.num_committed_tokens
            request.target = request.next_target(self.chunk, reused, self.snapshot_block)
            reused_pages = self.metrics.reused_pages(cache, reused)
            if self._resize(cache, request.target):
                request.cache = cache
                if not request.counted:
                    request.counted = True
                    self.metrics.count_reuse(request.prompt_length, reused, reused_pages)
                    self.metrics.count_sources(reused, reused_pages, cold_pages)
                return True
        self._close(cache)
        return False

    def _create_batch(self) -> list[_Request]:
        """Admit every admissible request that fits in one ``create_kv_cache_batch`` call (SPEC §6).

        Capacities come from ``probe_reuse`` (the first chunk after the reusable prefix). A request that does not
        fit gets None and stays waiting; later, smaller ones of the same batch may still be admitted.
        """
        candidates = self._admissible(self.max_batch - len(self.running))
        # A recomputed request goes in a batch of its own: reuse figures count first admissions only, and the
        # tier split is known per batch, not per request.
        repeats = [position for position, request in enumerate(candidates) if request.counted]
        if repeats:
            candidates = candidates[: max(1, repeats[0])]
        scheduled = self._admit_batch(candidates)
        if not scheduled and len(candidates) > 1:
            # Phase 1 pins every page the batch matched, so the pages later requests claimed can leave no room
            # for the head (SPEC §6 lets no request evict another's claim): give the head a batch of its own.
            scheduled = self._admit_batch(candidates[:1])
        return scheduled

    def _admit_batch(self, candidates: list[_Request]) -> list[_Request]:
        if not candidates:
            return []
        manager = self.manager
        batch: list[KVCacheRequest] = []
        self.sources.before_admission()
        t0 = time.perf_counter_ns()
        for request in candidates:
            prompt = request.tokens[: request.prompt_length - 1]
            target = request.next_target(self.chunk, manager.probe_reuse(request.scope, prompt), self.snapshot_block)
            batch.append(KVCacheRequest(prompt, id=request.request_id, capacity=target, reuse_scope=request.scope))
        caches = manager.create_kv_cache_batch(batch)
        self.result.manager_ns += time.perf_counter_ns() - t0
        # Per tier over the whole batch (a request that got None onboarded nothing).
        cold_pages = self.sources.after_admission()
        batch_reused = 0
        batch_pages = [0] * self.metrics.num_groups
        scheduled: list[_Request] = []
        for request, cache in zip(candidates, caches):
            if cache is None:
                continue
            reused = cache.num_committed_tokens
            reused_pages = self.metrics.reused_pages(cache, reused)
            request.target = request.next_target(self.chunk, reused, self.snapshot_block)
            if cache.capacity != request.target and not self._resize(cache, request.target):
                self._close(cache)
                continue
            request.cache = cache
            if request.counted:  # alone in its batch (see _create_batch)
                batch_pages = []
            else:
                request.counted = True
                self.metrics.count_reuse(request.prompt_length, reused, reused_pages)
            batch_reused += reused
            for group in range(len(batch_pages)):
                batch_pages[group] += reused_pages[group]
            self.waiting.remove(request)
            self._start(request)
            scheduled.append(request)
        if batch_pages:
            self.metrics.count_sources(batch_reused, batch_pages, cold_pages)
        return scheduled

    def _start(self, request: _Request) -> None:
        self.admissions += 1
        request.admitted = self.admissions
        self.running.append(request)

    def _preempt(self, victim: _Request) -> None:
        """Suspend a running request, undoing any growth it got this step; it resumes later (FCFS)."""
        cache = victim.cache
        assert cache is not None
        if cache.capacity > cache.history_length:
            self._resize(cache, cache.history_length)
        self._suspend(cache)
        self.running.remove(victim)
        self.suspended.append(victim)
        self.suspended.sort(key=_request_order)
        self.result.preemptions += 1
        self.preempted_this_step = True

    def _unblock(self) -> None:
        """Nothing could be scheduled this step: find out why and make sure a later step can progress."""
        if self.running:
            return
        if self.refused_at is not None and self.refused_step != self.step_index:
            self.refused_at = None  # admission was skipped, not refused, this step: try it for real next step
            return
        if len(self.suspended) > 1:
            # Suspended caches pin memory the head cannot get: recompute the most recently admitted one.
            victim = max(self.suspended, key=_admission_order)
            self.suspended.remove(victim)
            self._requeue(victim)
            self.result.recomputes += 1
            return
        if self.suspended:
            self._reject(self.suspended.pop())  # alone on the machine and still does not fit
            return
        head = self._next_admissible()
        if head is not None:
            self.waiting.remove(head)
            self._reject(head)
            return
        if self.pending:  # nothing has arrived yet: skip ahead to the next arrival (idle steps, not simulated)
            skip_to = max(self.step_index, self.pending[0].arrival_step - 1)
            self.result.idle_steps += skip_to - self.step_index
            self.step_index = skip_to
            self.result.steps = skip_to

    def _requeue(self, request: _Request) -> None:
        cache = request.cache
        assert cache is not None
        self._close(cache)
        request.cache = None
        request.requeues += 1
        self.waiting.append(request)
        self.waiting.sort(key=_request_order)

    def _reject(self, request: _Request) -> None:
        if request.cache is not None:
            self._close(request.cache)
            request.cache = None
        self.result.rejected += 1
        request.release_tokens()
        # Later turns of the chat embed this turn's output: let them run (their prompt is fixed by the trace).
        self.finished_ids.add(request.request_id)

    def _finish(self, request: _Request) -> None:
        cache = request.cache
        assert cache is not None
        t0 = time.perf_counter_ns()
        cache.stop_committing()
        cache.close()
        self.result.manager_ns += time.perf_counter_ns() - t0
        request.cache = None
        self.running.remove(request)
        self.finished_ids.add(request.request_id)
        self.result.generated_tokens += request.output_length
        request.release_tokens()

    # --------------------------------------------------------------------------------- timed manager calls
    def _resize(self, cache: KVCache, capacity: int) -> bool:
        t0 = time.perf_counter_ns()
        ok = cache.resize(capacity)
        self.result.manager_ns += time.perf_counter_ns() - t0
        return ok

    def _resume(self, cache: KVCache) -> bool:
        t0 = time.perf_counter_ns()
        ok = cache.resume()
        self.result.manager_ns += time.perf_counter_ns() - t0
        return ok

    def _suspend(self, cache: KVCache) -> None:
        t0 = time.perf_counter_ns()
        cache.suspend()
        self.result.manager_ns += time.perf_counter_ns() - t0

    def _close(self, cache: KVCache) -> None:
        t0 = time.perf_counter_ns()
        cache.close()
        self.result.manager_ns += time.perf_counter_ns() - t0


def _request_order(request: _Request) -> int:
    return request.request_id


def _admission_order(request: _Request) -> int:
    return request.admitted

