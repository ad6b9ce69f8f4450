"""What a simulation measured (``SimulationResult`` and its per-group figures) and how a run can stop early."""

from __future__ import annotations

from typing import Callable

from .options import SimulatorOptions

# Called after every step with (finished requests, total requests, step index).
ProgressCallback = Callable[[int, int, int], None]


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
