"""The serving simulator of SPEC §10: a continuous-batching loop over a seeded multi-turn workload or a replayed
Mooncake trace (``mooncake_trace.py``).

Each step works like a vLLM-style scheduler:

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
rejected. Every figure the report shows is gathered here, in ``SimulationResult``.

Bookkeeping-only mode (for large traces) turns the content checks off and divides every buffer and quota by one
power of two (``presets.bookkeeping_divisor``): the same slot counts and decisions, page copies of a few bytes.
Request tokens exist only while a request is admitted.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from typing import Callable, Final, Sequence

from mypy_extensions import mypyc_attr

from ._batch import KVCacheRequest
from ._kv_cache import _KVCache
from ._manager import KVCacheManager
from ._validation import check_minimums
from .config import (
    BatchDesc,
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    SsmLayerConfig,
)
from .mooncake_trace import hash_block_hit_rate, ideal_hit_rate, load_mooncake_trace
from .presets import DEFAULT_PRESET, bookkeeping_divisor, preset_layers, shrink_layers
from .reuse_sources import EventForward, ReuseSources, needs_events
from .testing.fake_engine import FakeEngine
from .workload import SimulatedRequest, ideal_prefix_hit_rate, simulator_workload

MIB: Final = 1 << 20
# Room for the KV events of one step when they track tiers (the log is bounded; ReuseSources detects a loss).
MAX_KV_EVENTS: Final = 1 << 22


@mypyc_attr(native_class=False)
class SimulationSetupError(ValueError):
    """The options cannot make a run (the CLI reports it as a usage error, without a traceback)."""


@mypyc_attr(native_class=False)
class SimulationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; ``result`` holds the figures gathered until then (the CLI prints them)."""

    def __init__(self, result: SimulationResult) -> None:
        super().__init__("simulation interrupted")
        self.result = result

# Called after every step with (finished requests, total requests, step index).
ProgressCallback = Callable[[int, int, int], None]


class SimulatorOptions:
    """Everything a simulation is built from: the CLI's flags, then the workload's shape.

    The defaults are sized so that ``simulate`` finishes in well under a minute on the cpu backend, interpreted,
    with content checks on, while the GPU tier is small enough that requests are preempted and cached pages are
    offloaded to the host tier and onboarded back. The workload is ``simulator_workload`` with prompts of at
    most ``max_prompt_length`` tokens, mostly short answers (``output_length``, else ``long_output_length``)
    and a new chat every ``mean_arrival_gap`` steps on average.
    """

    def __init__(
        self,
        preset: str = DEFAULT_PRESET,
        num_requests: int = 32,
        seed: int = 0,
        gpu_mib: int = 384,
        host_mib: int = 768,
        disk_mib: int = 0,
        disk_dir: str | None = None,
        tokens_per_block: int = 32,
        max_batch: int = 16,
        chunk: int = 512,
        scratch: bool = False,
        ssm_interval: int = 512,
        batch_admission: bool = False,
        backend: str = "auto",
        check: bool = True,
        max_prompt_length: int = 2048,
        output_length: tuple[int, int] = (4, 24),
        long_output_length: tuple[int, int] = (32, 96),
        mean_arrival_gap: float = 0.5,
        trace: str | None = None,
        trace_limit: int | None = None,
        trace_speed: float = 1.0,
        closed_loop: bool = False,
        bookkeeping: bool = False,
    ) -> None:
        if trace_limit is not None and trace_limit < 1:
            raise ValueError(f"trace_limit must be >= 1, got {trace_limit}")
        if not (isinstance(trace_speed, (int, float)) and 0.0 < trace_speed < math.inf):
            raise ValueError(f"trace_speed must be a finite number > 0, got {trace_speed!r}")
        if trace is None and (trace_limit is not None or trace_speed != 1.0 or closed_loop):
            raise ValueError("trace_limit, trace_speed and closed_loop need a trace")
        if bookkeeping and check:
            raise ValueError("bookkeeping mode has no content checks (its tiny pages cannot hold the records)")
        check_minimums((
            ("num_requests", num_requests, 1),
            ("gpu_mib", gpu_mib, 1),
            ("host_mib", host_mib, 0),
            ("disk_mib", disk_mib, 0),
            ("tokens_per_block", tokens_per_block, 1),
            ("max_batch", max_batch, 1),
            ("chunk", chunk, 1),
        ))
        self.preset = preset
        self.num_requests = num_requests
        self.seed = seed
        self.gpu_mib = gpu_mib
        self.host_mib = host_mib
        self.disk_mib = disk_mib
        self.disk_dir = disk_dir
        self.tokens_per_block = tokens_per_block
        self.max_batch = max_batch
        self.chunk = chunk
        self.scratch = scratch
        self.ssm_interval = ssm_interval
        self.batch_admission = batch_admission
        self.backend = backend
        self.check = check
        self.mean_arrival_gap = mean_arrival_gap
        self.max_prompt_length = max_prompt_length
        self.output_length = output_length
        self.long_output_length = long_output_length
        self.trace = trace
        self.trace_limit = trace_limit
        self.trace_speed = float(trace_speed)
        self.closed_loop = closed_loop
        self.bookkeeping = bookkeeping

    @property
    def tier_names(self) -> list[str]:
        """Names of the run's cache tiers, warmest first (their levels)."""
        names = ["GPU"]
        if self.host_mib > 0:
            names.append("host")
        if self.disk_mib > 0:
            names.append("disk")
        return names

    def with_tiers(self, gpu_mib: int, host_mib: int) -> SimulatorOptions:
        """The same options with other GPU and host quotas (a point of a capacity sweep)."""
        return SimulatorOptions(
            self.preset, self.num_requests, self.seed, gpu_mib, host_mib, self.disk_mib, self.disk_dir,
            self.tokens_per_block, self.max_batch, self.chunk, self.scratch, self.ssm_interval,
            self.batch_admission, self.backend, self.check, self.max_prompt_length, self.output_length,
            self.long_output_length, self.mean_arrival_gap, self.trace, self.trace_limit, self.trace_speed,
            self.closed_loop, self.bookkeeping,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "preset": self.preset,
            "requests": self.num_requests,
            "seed": self.seed,
            "gpu_mib": self.gpu_mib,
            "host_mib": self.host_mib,
            "disk_mib": self.disk_mib,
            "tokens_per_block": self.tokens_per_block,
            "max_batch": self.max_batch,
            "chunk": self.chunk,
            "scratch": self.scratch,
            "ssm_interval": self.ssm_interval,
            "batch_admission": self.batch_admission,
            "backend": self.backend,
            "check": self.check,
            "max_prompt_length": self.max_prompt_length,
            "output_length": list(self.output_length),
            "long_output_length": list(self.long_output_length),
            "mean_arrival_gap": self.mean_arrival_gap,
            "trace": self.trace,
            "trace_limit": self.trace_limit,
            "trace_speed": self.trace_speed,
            "closed_loop": self.closed_loop,
            "bookkeeping": self.bookkeeping,
        }


class LayerGroupFigures:
    """Prefix reuse seen by one layer group. ``reused_tokens`` counts prompt tokens the engine did not recompute;
    ``reused_pages`` counts the cached pages the group got back (an SWA group needs only its window and sinks;
    an SSM group one snapshot per hit)."""

    def __init__(self, group_id: int, kind: str, window: int, num_layers: int, pool_group: int) -> None:
        self.group_id = group_id
        self.kind = kind  # "full", "swa" or "ssm"
        self.window = window  # sliding window in tokens, 0 without one
        self.num_layers = num_layers
        self.pool_group = pool_group
        self.reused_tokens = 0
        self.reused_pages = 0
        self.reused_pages_by_tier: list[int] = []  # per tier (GPU first): where the reused pages were found


class PoolGroupFigures:
    """GPU slots of one pool group. ``in_use`` = slots no one else can take (locked by scheduled requests, plus
    held ones with no colder tier); ``occupied`` also counts reusable cached pages. Peaks are sampled once per
    step after every resize and before the commits (the step's high-water mark)."""

    def __init__(self, pool_group: int, slot_bytes: int, gpu_slots: int) -> None:
        self.pool_group = pool_group
        self.slot_bytes = slot_bytes
        self.gpu_slots = gpu_slots
        self.peak_in_use = 0
        self.peak_occupied = 0
        self.peak_without_scratch = 0


class SimulationResult:
    """What a run measured; ``report.py`` turns it into a table, JSON and a plot."""

    def __init__(self, options: SimulatorOptions, backend: str, compiled: bool) -> None:
        self.options = options
        self.backend = backend
        self.compiled = compiled
        self.num_requests = 0
        self.finished = 0
        self.rejected = 0
        self.steps = 0
        self.idle_steps = 0
        self.request_steps = 0
        self.prompt_tokens = 0
        self.computed_tokens = 0
        self.generated_tokens = 0
        self.reused_tokens = 0
        # Reused tokens per tier they were found on (GPU first), counted on a full-attention layer group.
        self.reused_tokens_by_tier: list[int] = [0] * len(options.tier_names)
        self.ideal_hit_rate = 0.0
        self.hash_block_hit_rate: float | None = None  # a replayed trace's figure per 512-token hash block
        self.preemptions = 0
        self.resumes = 0
        self.recomputes = 0
        self.onboarded_pages = 0
        self.offloaded_pages = 0
        self.copied_pages = 0
        self.dropped_pages = 0
        self.onboarded_bytes = 0
        self.offloaded_bytes = 0
        self.manager_ns = 0
        self.checked_tokens = 0
        self.wall_s = 0.0
        self.layer_groups: list[LayerGroupFigures] = []
        self.pool_groups: list[PoolGroupFigures] = []
        # One sample per busy step: step index, cumulative hit rate, in-use and occupied slots per pool group.
        self.timeline_steps: list[int] = []
        self.timeline_hit_rate: list[float] = []
        self.timeline_in_use: list[list[int]] = []
        self.timeline_occupied: list[list[int]] = []

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def manager_us_per_step(self) -> float:
        busy = self.steps - self.idle_steps
        return self.manager_ns / 1000 / busy if busy else 0.0

    @property
    def manager_us_per_request_step(self) -> float:
        return self.manager_ns / 1000 / self.request_steps if self.request_steps else 0.0


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
        self.cache: _KVCache | None = None
        self.admitted = 0  # admission sequence number: the highest is the most recently admitted
        self.target = 0  # capacity scheduled for this step

    @property
    def tokens(self) -> list[int]:
        tokens = self._tokens
        if tokens is None:
            tokens = self._tokens = self.trace.token_ids()
        return tokens

    def release_tokens(self) -> None:
        self._tokens = None

    def next_target(self, chunk: int, history: int) -> int:
        if history < self.prompt_length:
            return min(self.prompt_length, history + chunk)
        return min(self.length, history + 1)


def resolve_backend(options: SimulatorOptions) -> str:
    """``auto`` means cpu while content checks are on (the FakeEngine reads NumPy page views) or in bookkeeping
    mode (nothing to gain from a GPU), else the manager's own ``auto`` (cuda when CuPy sees a device)."""
    if options.backend == "auto" and (options.check or options.bookkeeping):
        return "cpu"
    return options.backend


def byte_divisor(options: SimulatorOptions) -> int:
    """What every buffer and quota is divided by: ``bookkeeping_divisor`` in bookkeeping mode, else 1."""
    if not options.bookkeeping:
        return 1
    return bookkeeping_divisor(preset_layers(options.preset, options.tokens_per_block))


def build_config(
    options: SimulatorOptions, disk_dir: str | None, typical_length: int, kv_events: bool = False
) -> KVCacheManagerConfig:
    """The manager config of a run: preset layers, tiers from the quotas, and a typical step of ``max_batch``
    caches of the workload's mean sequence length (so the GPU quota is split across pool groups sensibly);
    ``kv_events``: record KV events for a publisher."""
    layers = preset_layers(options.preset, options.tokens_per_block)
    divisor = byte_divisor(options)
    if divisor > 1:
        layers = shrink_layers(layers, divisor)
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(options.gpu_mib * MIB // divisor)]
    if options.host_mib > 0:
        tiers.append(HostCacheTierConfig(options.host_mib * MIB // divisor))
    if options.disk_mib > 0:
        if disk_dir is None:
            raise ValueError("disk_mib needs a disk directory")
        tiers.append(DiskCacheTierConfig(options.disk_mib * MIB // divisor, disk_dir))
    length = max(1, typical_length)
    events = needs_events(len(tiers)) or kv_events
    return KVCacheManagerConfig(
        tokens_per_block=options.tokens_per_block,
        layers=layers,
        cache_tiers=tiers,
        backend=resolve_backend(options),
        enable_swa_scratch_reuse=options.scratch,
        ssm_reuse_interval=options.ssm_interval,
        typical_step=BatchDesc([KVCacheDesc(length, length - 1)] * options.max_batch),
        enable_kv_events=events,
        max_kv_events=MAX_KV_EVENTS if events else 10_000,
    )


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
        if options.check and manager.backend != "cpu":
            # FakeEngine reads and writes pages through NumPy views; on a GPU the pages are CuPy arrays.
            raise SimulationSetupError(
                f"content checks need the cpu backend (the FakeEngine reads NumPy page views), got backend "
                f"{manager.backend!r}: run with --backend cpu, or --no-check to time the manager on the GPU"
            )
        self.engine: FakeEngine | None = FakeEngine(manager) if options.check else None
        self.chunk = options.chunk
        self.max_batch = options.max_batch
        self.pending: list[_Request] = [_Request(trace) for trace in workload.requests]
        self.waiting: list[_Request] = []  # arrived, never admitted or to be recomputed; FCFS (request id) order
        self.suspended: list[_Request] = []  # preempted by suspension, FCFS order
        self.running: list[_Request] = []  # admission order
        self.finished_ids: set[int] = set()
        self.step_index = 0
        self.admissions = 0
        self.preempted_this_step = False
        self.refused_at: list[int] | None = None  # available GPU slots per pool group when admission last failed
        self.refused_step = 0
        self.num_groups = manager.num_layer_groups
        self.group_pool: list[int] = [manager.get_pool_group_index(group) for group in range(self.num_groups)]
        self.kinds: list[str] = [_group_kind(manager, group) for group in range(self.num_groups)]
        # The layer group whose reused pages cover every reused token: tokens per tier are counted on it.
        self.token_group = self.kinds.index("full") if "full" in self.kinds else -1
        self.sources = ReuseSources(manager, kv_events)
        import kv_cache_manager_v2

        result = SimulationResult(options, manager.backend, kv_cache_manager_v2.COMPILED)
        result.num_requests = len(workload.requests)
        result.ideal_hit_rate = workload.ideal_hit_rate
        result.hash_block_hit_rate = workload.hash_block_hit_rate
        self.byte_scale = byte_divisor(options)  # bytes are reported at the preset's real sizes
        stats = manager.get_storage_statistics(0)
        for group, layers in enumerate(manager.layer_grouping):
            window, _ = manager.get_layer_window(layers[0])
            figures = LayerGroupFigures(group, self.kinds[group], window, len(layers), self.group_pool[group])
            figures.reused_pages_by_tier = [0] * manager.num_cache_levels
            result.layer_groups.append(figures)
        for pool_group, stat in enumerate(stats):
            slot_bytes = sum(manager.get_slot_bytes(pool_group)) * self.byte_scale
            result.pool_groups.append(PoolGroupFigures(pool_group, slot_bytes, stat.total))
        self.result = result

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
                    progress(len(self.finished_ids), total, self.step_index)
        except KeyboardInterrupt as interrupt:
            self._gather(start)
            raise SimulationInterrupted(result) from interrupt
        self._gather(start)
        return result

    def _gather(self, start: float) -> None:
        """Copy the manager's and the engine's counters into the result (at the end, or when interrupted)."""
        result = self.result
        counters = self.manager.movement_counters
        result.onboarded_pages = counters.onboarded_pages
        result.offloaded_pages = counters.offloaded_pages
        result.copied_pages = counters.copied_pages
        result.dropped_pages = counters.dropped_pages
        result.onboarded_bytes = counters.onboarded_bytes * self.byte_scale
        result.offloaded_bytes = counters.offloaded_bytes * self.byte_scale
        if self.engine is not None:
            result.checked_tokens = self.engine.tokens_checked
        result.finished = len(self.finished_ids) - result.rejected  # rejected requests count as done
        result.wall_s = time.perf_counter() - start

    def step(self) -> None:
        """One scheduler step (see the module docstring)."""
        self.step_index += 1
        result = self.result
        result.steps += 1
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
        self._sample(scheduled)
        engine = self.engine
        for request in scheduled:
            cache = request.cache
            assert cache is not None
            if engine is not None:
                engine.step(cache, request.tokens)
            result.computed_tokens += request.target - cache.history_length
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
            request.target = request.next_target(self.chunk, cache.history_length)
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
            request.target = request.next_target(self.chunk, cache.history_length)
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
        manager.probe_reuse(None, prompt)
        cache = manager.create_kv_cache(None, prompt, id=request.request_id)
        resumed = cache.resume()
        self.result.manager_ns += time.perf_counter_ns() - t0
        if resumed:
            cold_pages = self.sources.after_admission()
            reused = cache.num_committed_tokens
            request.target = request.next_target(self.chunk, reused)
            reused_pages = self._reused_pages(cache, reused)
            if self._resize(cache, request.target):
                request.cache = cache
                if not request.counted:
                    self._count_reuse(request, reused, reused_pages)
                    self._count_sources(reused, reused_pages, cold_pages)
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
            target = request.next_target(self.chunk, manager.probe_reuse(None, prompt))
            batch.append(KVCacheRequest(prompt, id=request.request_id, capacity=target))
        caches = manager.create_kv_cache_batch(batch)
        self.result.manager_ns += time.perf_counter_ns() - t0
        # Per tier over the whole batch (a request that got None onboarded nothing).
        cold_pages = self.sources.after_admission()
        batch_reused = 0
        batch_pages = [0] * self.num_groups
        scheduled: list[_Request] = []
        for request, cache in zip(candidates, caches):
            if cache is None:
                continue
            reused = cache.num_committed_tokens
            reused_pages = self._reused_pages(cache, reused)
            request.target = request.next_target(self.chunk, reused)
            if cache.capacity != request.target and not self._resize(cache, request.target):
                self._close(cache)
                continue
            request.cache = cache
            if request.counted:  # alone in its batch (see _create_batch)
                batch_pages = []
            else:
                self._count_reuse(request, reused, reused_pages)
            batch_reused += reused
            for group in range(len(batch_pages)):
                batch_pages[group] += reused_pages[group]
            self.waiting.remove(request)
            self._start(request)
            scheduled.append(request)
        if batch_pages:
            self._count_sources(batch_reused, batch_pages, cold_pages)
        return scheduled

    def _count_reuse(self, request: _Request, reused: int, reused_pages: list[int]) -> None:
        """Reuse at a request's first admission (a recomputed request reusing its own earlier work is not a
        prefix hit any ideal would count)."""
        request.counted = True
        result = self.result
        result.prompt_tokens += request.prompt_length
        result.reused_tokens += reused
        for group, figures in enumerate(result.layer_groups):
            figures.reused_tokens += _reused_tokens_of_group(reused, group)
            figures.reused_pages += reused_pages[group]

    def _count_sources(self, reused: int, reused_pages: list[int], cold_pages: list[list[int]]) -> None:
        """Split reused pages (and, on the full-attention group, reused tokens) by the tier they were found on:
        those onboarded from a colder tier, the rest on the GPU."""
        result = self.result
        tpb = self.options.tokens_per_block
        for group, figures in enumerate(result.layer_groups):
            cold = cold_pages[group]
            by_tier = figures.reused_pages_by_tier
            by_tier[0] += reused_pages[group] - sum(cold)
            for level in range(1, len(cold)):
                by_tier[level] += cold[level]
        if self.token_group < 0:
            return
        cold = cold_pages[self.token_group]
        cold_tokens = 0
        for level in range(1, len(cold)):
            tokens = min(cold[level] * tpb, reused - cold_tokens)
            result.reused_tokens_by_tier[level] += tokens
            cold_tokens += tokens
        result.reused_tokens_by_tier[0] += reused - cold_tokens

    def _reused_pages(self, cache: _KVCache, reused: int) -> list[int]:
        """Cached pages each layer group got back: blocks of the reused prefix that have a GPU page."""
        blocks = -(-reused // self.options.tokens_per_block)
        counts: list[int] = []
        for group in range(self.num_groups):
            if self.kinds[group] == "ssm":
                counts.append(1 if reused > 0 else 0)  # SSM reuse always restores one snapshot
                continue
            indices = cache.get_base_page_indices(group)
            counts.append(sum(1 for index in indices[:blocks] if index >= 0))
        return counts

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
        if self.pending:  # nothing has arrived yet: skip ahead to the next arrival
            self.step_index = max(self.step_index, self.pending[0].arrival_step - 1)

    def _requeue(self, request: _Request) -> None:
        cache = request.cache
        assert cache is not None
        self._close(cache)
        request.cache = None
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

    # --------------------------------------------------------------------------------------- measurements
    def _sample(self, scheduled: list[_Request]) -> None:
        """Memory high-water mark of this step (after every resize, before any commit) and the hit rate so far."""
        result = self.result
        stats = self.manager.get_storage_statistics(0)
        in_use = [stat.unavailable for stat in stats]
        occupied = [stat.total - stat.free for stat in stats]
        savings = [0] * len(stats)
        if self.options.scratch:
            for request in scheduled:
                cache = request.cache
                assert cache is not None
                for group in range(self.num_groups):
                    if self.kinds[group] != "swa":
                        continue
                    desc = cache.get_scratch_desc(group)
                    if desc is not None and desc:
                        savings[self.group_pool[group]] += len(desc.range) - len(desc.slot_ids)
        for pool_group, figures in enumerate(result.pool_groups):
            figures.peak_in_use = max(figures.peak_in_use, in_use[pool_group])
            figures.peak_occupied = max(figures.peak_occupied, occupied[pool_group])
            figures.peak_without_scratch = max(figures.peak_without_scratch, in_use[pool_group] + savings[pool_group])
        result.timeline_steps.append(self.step_index)
        result.timeline_hit_rate.append(result.hit_rate)
        result.timeline_in_use.append(in_use)
        result.timeline_occupied.append(occupied)

    # --------------------------------------------------------------------------------- timed manager calls
    def _resize(self, cache: _KVCache, capacity: int) -> bool:
        t0 = time.perf_counter_ns()
        ok = cache.resize(capacity)
        self.result.manager_ns += time.perf_counter_ns() - t0
        return ok

    def _resume(self, cache: _KVCache) -> bool:
        t0 = time.perf_counter_ns()
        ok = cache.resume()
        self.result.manager_ns += time.perf_counter_ns() - t0
        return ok

    def _suspend(self, cache: _KVCache) -> None:
        t0 = time.perf_counter_ns()
        cache.suspend()
        self.result.manager_ns += time.perf_counter_ns() - t0

    def _close(self, cache: _KVCache) -> None:
        t0 = time.perf_counter_ns()
        cache.close()
        self.result.manager_ns += time.perf_counter_ns() - t0


def _reused_tokens_of_group(reused: int, group: int) -> int:
    """Tokens a layer group did not recompute. Today a cache reuses one prefix length for every group (the
    match is pruned until every group can serve it); the per-group figure is kept for when they differ."""
    return reused


def _group_kind(manager: KVCacheManager, group: int) -> str:
    """``"full"``, ``"swa"`` (sliding window) or ``"ssm"``."""
    layer_id = manager.layer_grouping[group][0]
    for layer in manager.config.layers:
        if layer.layer_id == layer_id and isinstance(layer, SsmLayerConfig):
            return "ssm"
    window, _ = manager.get_layer_window(layer_id)
    return "swa" if window > 0 else "full"


def _request_order(request: _Request) -> int:
    return request.request_id


def _admission_order(request: _Request) -> int:
    return request.admitted


def build_workload(options: SimulatorOptions) -> Workload:
    """The run's requests and their ideal hit rate: ``simulator_workload`` shaped by the options, or the trace file
    (ideal with the manager's block size and its partial-reuse setting, which SSM layers turn off)."""
    tpb = options.tokens_per_block
    if options.trace is None:
        requests = simulator_workload(
            options.seed,
            options.num_requests,
            max_prompt_length=options.max_prompt_length,
            mean_arrival_gap=options.mean_arrival_gap,
            output_length=options.output_length,
            long_output_length=options.long_output_length,
            prefill_chunk=options.chunk,
        )
        return Workload(requests, ideal_prefix_hit_rate(requests, tpb))
    trace = load_mooncake_trace(options.trace, options.trace_limit, options.trace_speed, options.closed_loop)
    partial_reuse = build_config(options, ".", 1).partial_reuse_enabled
    return Workload(trace, ideal_hit_rate(trace, tpb, partial_reuse), hash_block_hit_rate(trace))


def simulate(
    options: SimulatorOptions,
    progress: ProgressCallback | None = None,
    on_start: Callable[[KVCacheManager], None] | None = None,
    workload: Workload | None = None,
    kv_events: Callable[[KVCacheManager], EventForward] | None = None,
) -> SimulationResult:
    """Build the workload (unless given: a sweep loads a trace once) and the manager, run the loop to the end,
    shut the manager down.

    ``on_start`` sees the manager before the first step (e.g. to print its layout). ``kv_events`` turns the
    manager's KV events on and makes, from the manager, what receives them after every step (a publisher)."""
    if workload is None:
        workload = build_workload(options)
    requests = workload.requests
    typical = sum(request.prompt_length + request.output_length for request in requests) // max(1, len(requests))
    temporary: tempfile.TemporaryDirectory[str] | None = None
    disk_dir = options.disk_dir
    if options.disk_mib > 0 and disk_dir is None:
        temporary = tempfile.TemporaryDirectory(prefix="kv_cache_manager_v2_disk_")
        disk_dir = temporary.name
    if disk_dir is not None and options.disk_mib > 0:
        os.makedirs(disk_dir, exist_ok=True)
    try:
        manager = KVCacheManager(build_config(options, disk_dir, typical, kv_events is not None))
        try:
            simulation = Simulation(options, manager, workload, None if kv_events is None else kv_events(manager))
            if on_start is not None:
                on_start(manager)
            try:
                return simulation.run(progress)
            finally:
                simulation.close_all()
        finally:
            manager.shutdown()
    finally:
        if temporary is not None:
            temporary.cleanup()
