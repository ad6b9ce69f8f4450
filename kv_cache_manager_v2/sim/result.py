"""What a simulation measured (``SimulationResult`` and its per-group figures) and how a run can stop early."""

from __future__ import annotations

from typing import Callable, Sequence

from .mooncake_trace import MooncakeRequest
from .options import SimulatorOptions
from .workload import SimulatedRequest, TraceRequest

# Called after every step with (finished requests, rejected requests, total requests, step index).
ProgressCallback = Callable[[int, int, int, int], None]


class SimulationSetupError(ValueError):
    """The options cannot make a run (the CLI reports it as a usage error, without a traceback)."""


class SimulationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; ``result`` holds the figures gathered until then (the CLI prints them)."""

    def __init__(self, result: SimulationResult) -> None:
        super().__init__("simulation interrupted")
        self.result = result


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


class Distribution:
    """Smallest, median, 90th percentile, largest and mean of a list of token counts; the percentiles by nearest
    rank (a length that occurs, not an interpolation between two: of an even count the lower middle one)."""

    def __init__(self, values: Sequence[int]) -> None:
        ordered = sorted(values)
        count = len(ordered)
        self.min: int = ordered[0] if ordered else 0
        self.median: int = ordered[(count - 1) // 2] if ordered else 0
        self.p90: int = ordered[(count * 9 - 1) // 10] if ordered else 0
        self.max: int = ordered[-1] if ordered else 0
        self.mean: float = sum(ordered) / count if ordered else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"min": self.min, "median": self.median, "p90": self.p90, "max": self.max, "mean": self.mean}


class WorkloadSummary:
    """What the requests of a run look like: counts, length distributions, chats and turns, shared system
    prompts (seeded workload only: a trace's shared prefixes show in its ideal hit rate) and arrivals; for a replayed
    trace, its clock: step 0 is its first request's timestamp, and each step ``step_ms`` of trace time after it (None
    with ``--closed-loop``)."""

    def __init__(self, requests: Sequence[SimulatedRequest], step_ms: float | None = None) -> None:
        self.num_requests: int = len(requests)
        self.prompt_length: Distribution = Distribution([request.prompt_length for request in requests])
        self.output_length: Distribution = Distribution([request.output_length for request in requests])
        turns: dict[int, int] = {}
        for request in requests:  # a parent precedes its child (FCFS order)
            parent = request.parent_id
            turns[request.request_id] = 1 if parent is None else turns.get(parent, 0) + 1
        self.num_chats: int = sum(1 for request in requests if request.parent_id is None)
        self.max_turns: int = max(turns.values(), default=0)
        seeded = [request for request in requests if isinstance(request, TraceRequest)]
        with_system = [request.system_prompt_id for request in seeded if request.system_prompt_id is not None]
        self.shared_prefixes: int = len(set(with_system))
        self.with_shared_prefix: int = len(with_system)
        arrivals = [request.arrival_step for request in requests]
        self.first_arrival: int = min(arrivals, default=0)
        self.last_arrival: int = max(arrivals, default=0)
        traced = [request for request in requests if isinstance(request, MooncakeRequest)]
        self.first_timestamp_ms: int | None = traced[0].timestamp_ms if traced else None  # as the trace wrote it
        self.step_ms: float | None = step_ms

    @property
    def arrival_rate(self) -> float:
        """Requests arriving per step, on average over the arrival span."""
        return self.num_requests / (self.last_arrival - self.first_arrival + 1) if self.num_requests else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.num_requests,
            "chats": self.num_chats,
            "max_turns": self.max_turns,
            "prompt_length": self.prompt_length.as_dict(),
            "output_length": self.output_length.as_dict(),
            "shared_prefixes": self.shared_prefixes,
            "requests_with_shared_prefix": self.with_shared_prefix,
            "first_arrival_step": self.first_arrival,
            "last_arrival_step": self.last_arrival,
            "arrival_rate": self.arrival_rate,
            "trace_first_timestamp_ms": self.first_timestamp_ms,
            "trace_step_ms": self.step_ms,
        }


class FollowerReuse:
    """A replayed trace's served requests that share a prefix with an earlier prompt (the ideal's ``reusable``
    tokens) and what they reused at their first admission, and the same for those of them admitted while the
    earlier request was still running: the ideal serves one request at a time, so there it had finished."""

    def __init__(self) -> None:
        self.requests: int = 0
        self.reusable_tokens: int = 0
        self.reused_tokens: int = 0
        self.overlapping: int = 0  # admitted while the ideal's earlier request still ran
        self.overlapping_reusable: int = 0
        self.overlapping_reused: int = 0

    def count(self, reusable: int, reused: int, overlapping: bool) -> None:
        self.requests += 1
        self.reusable_tokens += reusable
        self.reused_tokens += reused
        if overlapping:
            self.overlapping += 1
            self.overlapping_reusable += reusable
            self.overlapping_reused += reused

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "reusable_tokens": self.reusable_tokens,
            "reused_tokens": self.reused_tokens,
            "admitted_while_earlier_ran": self.overlapping,
            "admitted_while_earlier_ran_reusable_tokens": self.overlapping_reusable,
            "admitted_while_earlier_ran_reused_tokens": self.overlapping_reused,
        }


class SimulationResult:
    """What a run measured; ``report.py`` turns it into a table, JSON and a plot."""

    def __init__(self, options: SimulatorOptions, backend: str, compiled: bool) -> None:
        self.options = options
        self.backend = backend
        self.compiled = compiled
        self.num_requests = 0
        self.workload: WorkloadSummary = WorkloadSummary([])
        self.finished = 0
        self.rejected = 0
        # Steps of the simulated clock: busy ones and idle ones (nothing to schedule, or skipped while nothing had
        # arrived); the progress line shows the same clock.
        self.steps = 0
        self.idle_steps = 0
        self.request_steps = 0
        self.prompt_tokens = 0
        # Tokens the engine computed: prompt (prefill) and generated-token (decode) positions, recomputation after
        # a preemption that closed a cache included.
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.generated_tokens = 0
        self.reused_tokens = 0
        # Reused tokens per tier they were found on (GPU first), counted on a full-attention layer group.
        self.reused_tokens_by_tier: list[int] = [0] * len(options.tier_names)
        self.ideal_hit_rate: float = 0.0  # over served requests, like ``hit_rate``
        self.ideal_hit_rate_all_requests: float = 0.0  # rejected requests' prompts counted too
        self.hash_block_hit_rate: float | None = None  # a replayed trace's figure per 512-token hash block
        self.followers: FollowerReuse | None = None  # a replayed trace's: why the hit rate is below the ideal
        self.preemptions = 0
        self.resumes = 0
        self.recomputes = 0
        self.prefetched_pages = 0  # moved to the GPU a step before their suspended request resumed
        self.onboarded_pages = 0
        self.offloaded_pages = 0
        self.copied_pages = 0
        self.dropped_pages = 0
        self.onboarded_bytes = 0
        self.offloaded_bytes = 0
        self.manager_ns = 0
        self.manager_copy_ns = 0  # the part of manager_ns spent copying pages (``_memory.COPY_CLOCK``)
        self.checked_tokens = 0
        self.wall_s: float = 0.0
        self.layer_groups: list[LayerGroupFigures] = []
        self.pool_groups: list[PoolGroupFigures] = []
        # One sample per busy step: step index, cumulative hit rate (the last one also after the rejections of the
        # idle steps that follow it: the run's hit rate), GPU slots in use and occupied per pool group, occupied
        # slots per colder tier (host, disk) and pool group, running requests, preemptions so far.
        self.timeline_steps: list[int] = []
        self.timeline_hit_rate: list[float] = []
        self.timeline_in_use: list[list[int]] = []
        self.timeline_occupied: list[list[int]] = []
        self.timeline_colder: list[list[list[int]]] = []
        self.timeline_running: list[int] = []
        self.timeline_preemptions: list[int] = []
        self.colder_slots: list[list[int]] = []  # [tier - 1][pool group]: total slots of the host / disk tier
        self.no_reuse: SimulationResult | None = None  # the same workload without prefix reuse (--compare-no-reuse)

    @property
    def computed_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def bookkeeping_ns(self) -> int:
        """Manager time spent on anything but page copies."""
        return self.manager_ns - self.manager_copy_ns

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_ignores_ssm_snapshots(self) -> bool:
        """The ideal counts whole blocks of each common prefix; a model with SSM layers reuses only up to a
        snapshot (chunk ends, declared boundaries, intervals), so on a hybrid it is usually above what a run
        reaches, not the figure one request at a time on ample memory gives."""
        return any(group.kind == "ssm" for group in self.layer_groups)

    @property
    def manager_us_per_step(self) -> float:
        busy = self.steps - self.idle_steps
        return self.manager_ns / 1000 / busy if busy else 0.0

    @property
    def manager_us_per_request_step(self) -> float:
        return self.manager_ns / 1000 / self.request_steps if self.request_steps else 0.0
