"""What a simulation is built from (``SimulatorOptions``) and the manager config those options make."""

from __future__ import annotations

import dataclasses
from typing import Final, Sequence

from .._base.validation import INT64_LIMIT, check_minimums
from ..config import (
    BatchDesc,
    CacheTierConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    LayerConfig,
)
from .mooncake_trace import MAX_REQUEST_TOKENS, check_trace_speed
from .presets import DEFAULT_PRESET, ModelShape, bookkeeping_divisor, preset_layers, shrink_layers
from .reuse_sources import needs_events
from .workload import TraceRequest, simulator_workload
from .workload_size import check_workload_size

MIB: Final = 1 << 20
# The most MiB a tier flag takes: its bytes must fit a 64-bit quota (the config would name only the bytes).
MAX_TIER_MIB: Final = (INT64_LIMIT - 1) // MIB
# The longest prefill chunk: a trace's longest prompt (the seeded workload's are shorter), which a longer chunk
# computes in one step just the same (--chunk 10**20 ran as this one).
MAX_CHUNK: Final = MAX_REQUEST_TOKENS
# Room for the KV events of one step when they track tiers (the log is bounded; ReuseSources detects a loss).
MAX_KV_EVENTS: Final = 1 << 22
# The typical step's lengths stop at this percentile of the requests': the mean, or a batch reaching the longest,
# let one request 50 times the others hand the full-attention pools the share the others' windows needed.
TYPICAL_PERCENTILE: Final = 90


@dataclasses.dataclass(frozen=True)
class SimulatorOptions:
    """Everything a simulation is built from: the CLI's flags, then the workload's shape.

    The defaults are sized so that ``simulate`` finishes in well under a minute on the cpu backend, interpreted,
    with content checks on, while the GPU tier is small enough that requests are preempted and cached pages are
    offloaded to the host tier and onboarded back. The workload is ``simulator_workload`` (its parameters of
    the same names) with prompts of at most ``max_prompt_length`` tokens, mostly short answers
    (``output_length``, else ``long_output_length``) and a new chat every ``mean_arrival_gap`` steps on average.
    ``model`` replaces the preset by a custom shape; ``reuse=False`` gives every request a reuse scope of its own
    (the no-reuse baseline: nothing is found in the cache). ``last_snapshot`` declares each prompt's last full block
    a snapshot boundary (``mamba_save_last_snapshot``; a prefill chunk stops there).
    """

    preset: str = DEFAULT_PRESET
    model: ModelShape | None = None
    num_requests: int = 32
    seed: int = 0
    gpu_mib: int = 384
    host_mib: int = 768
    disk_mib: int = 0
    disk_dir: str | None = None
    tokens_per_block: int = 32
    max_batch: int = 16
    chunk: int = 512
    scratch: bool = False
    ssm_interval: int = 512
    last_snapshot: bool = False
    batch_admission: bool = False
    backend: str = "auto"
    check: bool = True
    max_prompt_length: int = 2048
    output_length: tuple[int, int] = (4, 24)
    long_output_length: tuple[int, int] = (32, 96)
    long_output_fraction: float = 0.2
    user_length: tuple[int, int] = (16, 256)
    long_user_length: tuple[int, int] = (768, 2048)
    long_user_fraction: float = 0.2
    max_turns: int = 4
    num_system_prompts: int = 4
    system_prompt_length: tuple[int, int] = (256, 1024)
    system_prompt_fraction: float = 0.6
    mean_arrival_gap: float = 0.5
    reuse: bool = True
    trace: str | None = None
    trace_limit: int | None = None
    trace_speed: float = 1.0
    closed_loop: bool = False
    bookkeeping: bool = False

    def __post_init__(self) -> None:
        if self.trace_limit is not None and self.trace_limit < 1:
            raise ValueError(f"trace_limit must be >= 1, got {self.trace_limit}")
        check_trace_speed(self.trace_speed, "trace_speed")
        if self.trace is None and (self.trace_limit is not None or self.trace_speed != 1.0 or self.closed_loop):
            raise ValueError("trace_limit, trace_speed and closed_loop need a trace")
        if self.bookkeeping and self.check:
            raise ValueError("bookkeeping mode has no content checks (its tiny pages cannot hold the records)")
        seeded_workload(self, 0)  # the workload's shape is checked now, not when the run builds it
        check_minimums((
            ("num_requests", self.num_requests, 1),
            ("gpu_mib", self.gpu_mib, 1),
            ("host_mib", self.host_mib, 0),
            ("disk_mib", self.disk_mib, 0),
            ("tokens_per_block", self.tokens_per_block, 1),
            ("max_batch", self.max_batch, 1),
            ("chunk", self.chunk, 1),
        ))
        for name, mib in (("gpu_mib", self.gpu_mib), ("host_mib", self.host_mib), ("disk_mib", self.disk_mib)):
            if mib > MAX_TIER_MIB:
                raise ValueError(f"{name} must be <= {MAX_TIER_MIB:,} (a 64-bit byte quota), got {mib:,}")
        if self.chunk > MAX_CHUNK:
            raise ValueError(
                f"chunk must be <= {MAX_CHUNK:,} tokens (the longest prompt a run holds), got {self.chunk:,}"
            )
        if self.trace is None:  # the seeded workload's size (its system prompts were checked by seeded_workload)
            check_workload_size(
                self.num_requests, self.max_prompt_length, self.output_length, self.long_output_length,
                self.num_system_prompts, self.system_prompt_length,
            )

    @property
    def model_name(self) -> str:
        """The preset's name, or the custom shape in words."""
        return self.preset if self.model is None else self.model.describe()

    def layers(self) -> list[LayerConfig]:
        """The model's layers at their real buffer sizes."""
        if self.model is not None:
            return self.model.layers(self.tokens_per_block)
        return preset_layers(self.preset, self.tokens_per_block)

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
        return dataclasses.replace(self, gpu_mib=gpu_mib, host_mib=host_mib)

    def as_dict(self) -> dict[str, object]:
        """Every field by name (JSON-ready: tuples become lists)."""
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(self).items()
        }


def seeded_workload(options: SimulatorOptions, num_requests: int) -> list[TraceRequest]:
    """``simulator_workload`` shaped by the options."""
    return simulator_workload(
        options.seed,
        num_requests,
        max_prompt_length=options.max_prompt_length,
        num_system_prompts=options.num_system_prompts,
        system_prompt_length=options.system_prompt_length,
        system_prompt_fraction=options.system_prompt_fraction,
        max_turns=options.max_turns,
        user_length=options.user_length,
        long_user_length=options.long_user_length,
        long_user_fraction=options.long_user_fraction,
        output_length=options.output_length,
        long_output_length=options.long_output_length,
        long_output_fraction=options.long_output_fraction,
        mean_arrival_gap=options.mean_arrival_gap,
        prefill_chunk=options.chunk,
    )


def resolve_backend(options: SimulatorOptions) -> str:
    """``auto`` means cpu while content checks are on (each check reads pages back to the host, which the cpu
    backend does fastest; ``cuda`` checks on the GPU) or in bookkeeping mode (nothing to gain from a GPU), else the manager's own ``auto`` (cuda when CuPy sees a device)."""
    if options.backend == "auto" and (options.check or options.bookkeeping):
        return "cpu"
    return options.backend


def byte_divisor(options: SimulatorOptions) -> int:
    """What every buffer and quota is divided by: ``bookkeeping_divisor`` in bookkeeping mode, else 1."""
    if not options.bookkeeping:
        return 1
    return bookkeeping_divisor(options.layers())


def typical_lengths(request_lengths: Sequence[int], count: int) -> list[int]:
    """``count`` sequence lengths that follow the requests' own distribution (the quantiles at (i + 1/2) / count,
    by nearest rank), none above its ``TYPICAL_PERCENTILE``: a mix of short and long requests splits the pools for
    both, while a few outliers weigh no more than the percentile."""
    ordered = sorted(request_lengths)
    if not ordered:
        return [1] * count
    size = len(ordered)
    cap = ordered[(size * TYPICAL_PERCENTILE - 1) // 100]
    return [max(1, min(cap, ordered[(2 * index + 1) * size // (2 * count)])) for index in range(count)]


def build_config(
    options: SimulatorOptions, disk_dir: str | None, request_lengths: Sequence[int], kv_events: bool = False
) -> KVCacheManagerConfig:
    """The manager config of a run: preset layers, tiers from the quotas, and a typical step of ``max_batch``
    caches whose lengths follow the requests' (``request_lengths``: prompt plus output of each, see
    ``typical_lengths``), so that the GPU quota is split across pool groups for the workload;
    ``kv_events``: record KV events for a publisher."""
    layers = options.layers()
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
    events = needs_events(len(tiers)) or kv_events
    lengths = typical_lengths(request_lengths, options.max_batch)
    return KVCacheManagerConfig(
        tokens_per_block=options.tokens_per_block,
        layers=layers,
        cache_tiers=tiers,
        backend=resolve_backend(options),
        enable_swa_scratch_reuse=options.scratch,
        ssm_reuse_interval=options.ssm_interval,
        mamba_save_last_snapshot=options.last_snapshot,
        typical_step=BatchDesc([KVCacheDesc(length, length - 1) for length in lengths]),
        enable_kv_events=events,
        max_kv_events=MAX_KV_EVENTS if events else 10_000,
    )
