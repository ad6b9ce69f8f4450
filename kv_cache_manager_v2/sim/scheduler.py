"""The simulator's scheduler: ``batching.ContinuousBatcher`` over ``Workload`` requests, with an engine
that checks content and fills the figures.

The engine (``SimulatedEngine``): the ``FakeEngine`` checks every readable history token of every scheduled cache
and writes this step's tokens; ``metrics.Metrics`` samples memory each step and counts each request's reuse, per
tier, at its first admission. A request that cannot fit even alone is rejected (its later chat turns still run).
Only manager calls are timed, never the engine. Request tokens exist only while a request is admitted.
"""

from __future__ import annotations

import time
from typing import Sequence

from .. import KVCache, KVCacheManager, ReuseScope
from ..batching import BatchedRequest, BatchEngine, BatchingOptions, ContinuousBatcher, StepBoundaryInterrupts
from ..testing.contextual_tokens import ContextualTokens
from ..testing.fake_engine import FakeEngine
from .metrics import Metrics, share_cold_pages
from .mooncake_trace import IdealReuse, trace_step_ms
from .options import SimulatorOptions
from .result import FollowerReuse, ProgressCallback, SimulationInterrupted, SimulationResult, WorkloadSummary
from .reuse_sources import EventForward, ReuseSources
from .workload import SimulatedRequest


class Workload:
    """The requests of a run (FCFS order) and the ideal prefix hit rate they allow (an infinite cache); a trace's
    also each request's ideal reuse and where it came from (``ideal_reuse``)."""

    def __init__(
        self,
        requests: Sequence[SimulatedRequest],
        ideal_hit_rate: float,
        hash_block_hit_rate: float | None = None,
        ideal_reuse: IdealReuse | None = None,
    ) -> None:
        self.requests = requests
        self.ideal_hit_rate = ideal_hit_rate
        self.hash_block_hit_rate = hash_block_hit_rate
        self.ideal_reuse = ideal_reuse


class SimulatedBatchRequest(BatchedRequest):
    """One trace request in the batcher. It computes ``max_length`` tokens in all: the prompt, then one decode
    token per output token but the last (whose KV is never needed). Its tokens are built when first needed and
    released when it is done, so a long trace never holds them all."""

    def __init__(self, trace: SimulatedRequest, shared: bool) -> None:
        super().__init__(
            trace.request_id,
            trace.prompt_length,
            trace.arrival_step,
            trace.parent_id,
            trace.prompt_length + trace.output_length - 1,
        )
        self.trace: SimulatedRequest = trace
        self.output_length: int = trace.output_length
        self.shared: bool = shared  # False: a no-reuse run (see ``scope``)
        self.counted: bool = False  # its first admission's reuse is in the figures
        self.reused: int = 0  # tokens and pages per layer group its latest admission matched
        self.reused_pages: list[int] = []
        self.reused_first = 0  # what its first admission matched (in the figures while ``counted``)
        self.reused_pages_first: list[int] = []
        self.donor_running = False  # its first admission came while the ideal's earlier request still ran
        # Per layer group and tier, its share of the pages its first admission onboarded; None when that
        # admission's tier split was left out.
        self.cold_pages: list[list[int]] | None = None
        self._tokens: list[int] | None = None
        self._check_codes: tuple[int, list[int]] | None = None  # (requeues when made, codes)

    @property
    def scope(self) -> ReuseScope | None:
        """Where its prefix is looked up: the shared scope, or in a no-reuse run one of its own per admission (a
        recomputed request does not find its earlier work either)."""
        return None if self.shared else ReuseScope(salt=f"request-{self.request_id}-{self.requeues}".encode())

    @property
    def prefix_boundaries(self) -> tuple[int, ...]:
        """The end of its system prompt, when it starts with one (declared as a snapshot point)."""
        shared = self.trace.shared_prefix_length
        return (shared,) if 0 < shared < self.prompt_length else ()

    @property
    def tokens(self) -> list[int]:
        tokens = self._tokens
        if tokens is None:
            tokens = self._tokens = self.trace.token_ids()
        return tokens

    @property
    def check_codes(self) -> list[int]:
        """What the FakeEngine writes and checks for its tokens: per position a digest of its scope and the whole
        prefix (``ContextualTokens``), so a page computed for another prompt or scope fails the check even where it
        holds the same tokens at the same positions."""
        made = self._check_codes
        if made is None or made[0] != self.requeues:
            scope = self.scope
            context = "" if scope is None else repr(scope)
            made = self._check_codes = (self.requeues, ContextualTokens(context).of(self.tokens))
        return made[1]

    def release_tokens(self) -> None:
        self._tokens = None
        self._check_codes = None


class SimulatedEngine(BatchEngine[SimulatedBatchRequest]):
    """The simulator's side of each step: content checks (``FakeEngine``, unless off) and the run's figures."""

    def __init__(self, simulation: Simulation, check: bool) -> None:
        self.simulation: Simulation = simulation
        self.metrics: Metrics = simulation.metrics
        self.sources: ReuseSources = simulation.metrics.sources
        self.result: SimulationResult = simulation.metrics.result
        self.fake: FakeEngine | None = FakeEngine(simulation.manager) if check else None
        self.cold_pages: list[list[int]] = []  # per layer group and tier: what the latest admission onboarded

    def compute(self, scheduled: list[SimulatedBatchRequest]) -> None:
        simulation = self.simulation
        simulation.sync_result()
        result = self.result
        self.metrics.sample(simulation.batcher.step_index, [request.cache for request in scheduled if request.cache is not None])
        fake = self.fake
        for request in scheduled:
            cache = request.cache
            assert cache is not None
            if fake is not None:
                fake.step(cache, request.check_codes)
            history = cache.history_length
            prefill = max(0, min(request.target, request.prompt_length) - history)
            result.prefill_tokens += prefill
            result.decode_tokens += request.target - history - prefill

    def is_done(self, request: SimulatedBatchRequest) -> bool:
        return request.target == request.max_length

    def before_admission(self) -> None:
        self.sources.before_admission()

    def after_admission(self) -> None:
        self.cold_pages = self.sources.after_admission()

    def matched(self, request: SimulatedBatchRequest, cache: KVCache) -> None:
        request.reused = cache.num_committed_tokens
        request.reused_pages = self.metrics.reused_pages(cache, request.reused)

    def admitted(self, requests: list[SimulatedBatchRequest]) -> None:
        """Reuse counts each request's first admission; the tier split is known per admission call only (shared
        out among its requests, coldest tier first), so a call that admitted a recomputed request (alone in it)
        leaves the split out."""
        metrics = self.metrics
        first = [request for request in requests if not request.counted]
        ideal = self.simulation.ideal_reuse
        finished = self.simulation.finished_ids
        for request in first:
            request.counted = True
            if ideal is not None:
                donor = ideal.donor[request.request_id]
                request.donor_running = donor >= 0 and donor not in finished
            request.reused_first, request.reused_pages_first = request.reused, request.reused_pages
            metrics.count_reuse(request.prompt_length, request.reused, request.reused_pages)
        if len(first) < len(requests) or not first:
            return
        shares = share_cold_pages([request.reused_pages for request in first], self.cold_pages)
        for request, share in zip(first, shares):
            request.cold_pages = share
            metrics.count_sources(request.reused, request.reused_pages, share)

    def finished(self, request: SimulatedBatchRequest) -> None:
        self.result.generated_tokens += request.output_length
        request.release_tokens()

    def reject(self, request: SimulatedBatchRequest) -> None:
        """A request rejected after its first admission (its prompt or output outgrew the GPU tier) was never
        served: its reuse leaves the hit rate, which is over served requests."""
        if request.counted:
            metrics = self.metrics
            metrics.count_reuse(request.prompt_length, request.reused_first, request.reused_pages_first, sign=-1)
            if request.cold_pages is not None:
                metrics.count_sources(request.reused_first, request.reused_pages_first, request.cold_pages, sign=-1)
            request.counted = False
        request.release_tokens()

    def step_done(self) -> None:
        self.sources.sync()


class Simulation:
    """One manager, the batcher and the simulator's engine; ``run()`` drives it to the end."""

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
        self.metrics: Metrics = Metrics(options, manager, kv_events)
        self.result: SimulationResult = self.metrics.result
        self.result.num_requests = len(workload.requests)
        self.result.ideal_hit_rate = workload.ideal_hit_rate
        self.result.hash_block_hit_rate = workload.hash_block_hit_rate
        self.ideal_reuse: IdealReuse | None = workload.ideal_reuse
        step_ms = None if options.trace is None else trace_step_ms(options.trace_speed, options.closed_loop)
        self.result.workload = WorkloadSummary(workload.requests, step_ms)
        self.engine: SimulatedEngine = SimulatedEngine(self, options.check)
        batching = BatchingOptions(
            chunk=options.chunk,
            max_batch=options.max_batch,
            snapshot_block=options.tokens_per_block if options.last_snapshot else 0,
            batch_admission=options.batch_admission,
            probe_reuse=True,
        )
        requests = [SimulatedBatchRequest(trace, options.reuse) for trace in workload.requests]
        self.requests = requests
        self.batcher: ContinuousBatcher[SimulatedBatchRequest] = ContinuousBatcher(manager, requests, self.engine, batching)

    @property
    def served(self) -> list[bool]:
        """Per request, in arrival order: whether its first admission's reuse is in the hit rate (not rejected)."""
        return [request.counted for request in self.requests]

    @property
    def finished_ids(self) -> set[int]:
        """Finished and rejected requests."""
        return self.batcher.finished_ids

    @property
    def running(self) -> list[SimulatedBatchRequest]:
        return self.batcher.running

    @property
    def suspended(self) -> list[SimulatedBatchRequest]:
        return self.batcher.suspended

    @property
    def waiting(self) -> list[SimulatedBatchRequest]:
        return self.batcher.waiting

    def run(self, progress: ProgressCallback | None = None) -> SimulationResult:
        start = time.perf_counter()
        result = self.result
        batcher = self.batcher
        total = batcher.total
        # Every request either finishes or is rejected; a step budget turns a scheduling bug into an error.
        budget = 100 + 4 * sum((request.max_length or 0) + request.arrival_step for request in batcher.pending)
        try:
            with StepBoundaryInterrupts(terminate=True) as interrupts:
                while not batcher.done:
                    if batcher.step_index > budget:
                        raise RuntimeError(f"simulation made no progress within {budget} steps")
                    self.step()
                    if progress is not None:
                        rejected = result.rejected
                        progress(len(batcher.finished_ids) - rejected, rejected, total, batcher.step_index)
                    interrupts.check()
        except KeyboardInterrupt as interrupt:
            self.sync_result()
            self.gather(start)
            raise SimulationInterrupted(result) from interrupt
        self.gather(start)
        return result

    def gather(self, start: float) -> None:
        """The end-of-run figures (also of an interrupted run): the metrics', and a trace's followers."""
        self.metrics.gather(self.engine.fake, len(self.batcher.finished_ids), start)
        ideal = self.ideal_reuse
        if ideal is None:
            return
        followers = self.result.followers = FollowerReuse()
        for request in self.requests:
            reusable = ideal.reusable[request.request_id]
            if request.counted and reusable > 0:
                followers.count(reusable, request.reused_first, request.donor_running)

    def step(self) -> None:
        """One batcher step, its counters copied into the result."""
        try:
            self.batcher.step()
        finally:
            self.sync_result()

    def sync_result(self) -> None:
        """Copy the batcher's counters into the result (the timeline samples some of them mid-step)."""
        batcher = self.batcher
        result = self.result
        result.steps = batcher.step_index
        result.idle_steps = batcher.idle_steps
        result.request_steps = batcher.request_steps
        result.preemptions = batcher.preemptions
        result.resumes = batcher.resumes
        result.recomputes = batcher.recomputes
        result.prefetched_pages = batcher.prefetcher.prefetched_pages
        result.rejected = batcher.rejected
        result.manager_ns = batcher.manager_ns

    def close_all(self) -> None:
        """Close every cache still open (after an error), so the manager can shut down."""
        self.batcher.close_all()
