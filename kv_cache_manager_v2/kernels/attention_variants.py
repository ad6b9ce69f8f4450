"""Launch-time variants of the tensor-core attention kernel (issue #42): pipeline depth, keys per stage, query rows
per prefill CTA and how split-K fills the GPU; compiling one and how many of its CTAs the GPU holds. They are picked
per launch, not per build, so one GPU run of ``tools/bench_attention.py --sweep`` can time each of them and the
defaults below can then be set in one line.

``MmaVariant.stages`` / ``tile_keys`` become the kernel's ``STAGES`` / ``TILE_KEYS`` template parameters and
``prefill_rows`` its ``ROW_WARPS`` for prefill (one compiled variant each); ``split_waves`` / ``splits`` only change
the launch plan. Launches are of two kinds, named by their ``rows`` argument below: ``DECODE_ROWS`` (a sequence's
query rows fit one 16-row mma tile) or anything larger (prefill, whose CTAs have ``prefill_rows`` rows). The
environment variable ``VARIANT_ENV`` (``"stages=3,tile_keys=64,split_waves=2,splits=0,prefill_rows=128"``, any
subset) replaces the default for every tensor-core launch: meant for the benchmark and the GPU tests, not for
serving.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Final, Protocol, cast, final

from ._launch import kernel
from .._base.types import FrozenValue
from .attention_params import KERNEL_DTYPE_CODES, MAX_CTAS_PER_SM, REGISTERS_PER_SM

MAX_SHARED_BYTES: Final = 232448
"""Shared memory one CTA may use on sm_90 (227 KiB; ``kMaxSharedBytes`` in the kernel)."""
VARIANT_ENV: Final = "KV_CACHE_MANAGER_V2_ATTENTION_VARIANT"
_FIELDS: Final = ("stages", "tile_keys", "split_waves", "splits", "prefill_rows")
DECODE_ROWS: Final = 16
"""Rows of a decode CTA: one mma tile holding a token's GQA group."""
MIN_WARPS: Final = 4
"""Warps of a 16- or 64-row CTA; a 128-row CTA has one warp per 16-row tile (``kMinWarps`` in the kernel)."""
_MMA_READY: Final[set[tuple[int, str, int, int, int, int]]] = set()


@final
@dataclass(frozen=True)
class MmaVariant(FrozenValue):
    """One choice of the tensor-core kernel's tunables.

    ``stages``: K/V tiles the cp.async pipeline holds (2-4: more bytes in flight per CTA, fewer CTAs per SM).
    ``tile_keys``: keys per stage (32, 64 or 128). ``split_waves``: 0 picks the split-K factor with the least
    estimated time (``wave_fit_splits``: whole waves of resident CTAs, each split's fixed cost counted); n >= 1
    makes at least n waves of resident CTAs when the work items alone fill fewer (1: batch 32 x 8 kv heads = 256
    items on 132 SMs x 3 CTAs splits in 2). ``splits``: when > 0, exactly this split-K factor (the sweep's override), still capped by
    the keys and ``MMA_MAX_SPLITS``. ``prefill_rows``: query rows of a prefill CTA, 64 (4 warps of 16 rows) or 128
    (8 warps of 16 rows sharing each K/V tile, FlashAttention-2's shape: half the K/V traffic per FLOP); decode
    CTAs always have ``DECODE_ROWS``.
    """

    stages: int = 2
    tile_keys: int = 64
    split_waves: int = 1
    splits: int = 0
    prefill_rows: int = 64

    def label(self) -> str:
        """Short name for tables: ``s3 k64 w1``, ``s2 k64 x4`` (a forced split factor), ``s2 k64 w1 r128``
        (128-row prefill CTAs)."""
        split = f"x{self.splits}" if self.splits > 0 else f"w{self.split_waves}" if self.split_waves else "fit"
        rows = "" if self.prefill_rows == 64 else f" r{self.prefill_rows}"
        return f"s{self.stages} k{self.tile_keys} {split}{rows}"

    def env_text(self) -> str:
        """This variant as a ``VARIANT_ENV`` value."""
        return (
            f"stages={self.stages},tile_keys={self.tile_keys},split_waves={self.split_waves},splits={self.splits},"
            f"prefill_rows={self.prefill_rows}"
        )


# The defaults: change these lines after a sweep.
# Decode, from the H200 sweeps of 2026-11-26 (`bench_attention.py --sweep`): 2 stages of 64 keys (3-4 stages and
# 128-key stages were slower: fewer CTAs fit). Split-K: forced factors showed that whole waves decide (batch 32 x 8
# kv heads x 8k keys: 3 splits 396 us, 4 splits 427, 1-2 splits 507-518; batch 1: 50 splits 31 us, 64 splits 40;
# 1k keys: 1 split best), which the wave-fit policy reproduces.
DECODE_DEFAULT: Final = MmaVariant(stages=2, tile_keys=64, split_waves=0)
# Prefill: 128-row CTAs (8 warps sharing each K/V tile) took 0.30-0.32 of SDPA flash's TFLOP/s to 0.37-0.40 (same
# sweep). Once each key's page lookup was done once per warp instead of by every lane (2026-11-27, H200 sweep), 64-row
# CTAs with 3 stages were ahead: 0.54 of SDPA's TFLOP/s against 0.51-0.52 at 128 rows, on both prefill shapes.
PREFILL_DEFAULT: Final = MmaVariant(stages=3, tile_keys=64, split_waves=1, prefill_rows=64)
SPLIT_FIXED_TILES: Final = 6
"""A split's fixed cost (query load, CTA start, its share of the split-K combine) in key tiles' worth of time;
fitted to the forced-split timings above (1k and 8k keys)."""

DECODE_VARIANTS: Final = ((2, 64), (3, 64), (4, 64), (2, 128))
"""(stages, tile_keys) compiled for 16-row (decode) CTAs; head_dim 256 only the first two (shared memory)."""
PREFILL_VARIANTS: Final = ((2, 64), (3, 64), (2, 32))
"""(stages, tile_keys) compiled for 64-row (prefill) CTAs."""
WIDE_PREFILL_VARIANTS: Final = ((2, 64), (3, 64))
"""(stages, tile_keys) compiled for 128-row (prefill) CTAs (32-key stages leave no room for the 8 warps' merge)."""
PREFILL_ROWS: Final = (64, 128)
"""The ``prefill_rows`` the kernel is compiled for."""


def cta_rows(rows: int, variant: MmaVariant) -> int:
    """Query rows of one CTA for a launch of kind ``rows`` (``DECODE_ROWS`` or prefill)."""
    return DECODE_ROWS if rows == DECODE_ROWS else variant.prefill_rows


def mma_threads(rows: int) -> int:
    """Threads of a CTA of ``rows`` query rows (``MmaShape::kThreads``): 128, or 256 for 128 rows."""
    return 32 * max(MIN_WARPS, rows // 16)


def pipeline_choices(variant: MmaVariant, rows: int) -> tuple[tuple[int, int], ...]:
    """The (stages, tile_keys) compiled for ``variant``'s CTAs in a launch of kind ``rows``."""
    if rows == DECODE_ROWS:
        return DECODE_VARIANTS
    return PREFILL_VARIANTS if variant.prefill_rows == 64 else WIDE_PREFILL_VARIANTS


def shared_bytes(variant: MmaVariant, head_dim: int) -> int:
    """Dynamic shared memory of a variant: ``stages`` K and V tiles, rows padded by 8 elements
    (``MmaShape::kSharedBytes``)."""
    return variant.stages * 2 * variant.tile_keys * (head_dim + 8) * 2


def unfit_reason(variant: MmaVariant, head_dim: int, rows: int) -> str | None:
    """Why the kernel has no such variant for a launch of kind ``rows`` (``DECODE_ROWS`` or prefill), or None
    when it has."""
    if variant.prefill_rows not in PREFILL_ROWS:
        return f"prefill_rows must be one of {PREFILL_ROWS}"
    choices = pipeline_choices(variant, rows)
    if (variant.stages, variant.tile_keys) not in choices:
        return f"(stages, tile_keys) must be one of {choices} for {cta_rows(rows, variant)}-row CTAs"
    if shared_bytes(variant, head_dim) + variant.stages * variant.tile_keys * 4 > MAX_SHARED_BYTES:
        return f"{shared_bytes(variant, head_dim)} bytes of shared memory at head_dim {head_dim}"
    if variant.split_waves < 0 or variant.splits < 0:
        return "split_waves and splits must be >= 0"
    return None


def parse_variant(text: str, base: MmaVariant) -> MmaVariant:
    """``base`` with the ``name=value`` pairs of ``text`` (comma-separated) applied; ValueError naming
    ``VARIANT_ENV`` on anything else."""
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in _FIELDS or not value.strip().isdigit():
            raise ValueError(f"{VARIANT_ENV} takes name=integer pairs with names {_FIELDS}, got {item!r}")
        values[name] = int(value)
    return replace(
        base,
        stages=values.get("stages", base.stages),
        tile_keys=values.get("tile_keys", base.tile_keys),
        split_waves=values.get("split_waves", base.split_waves),
        splits=values.get("splits", base.splits),
        prefill_rows=values.get("prefill_rows", base.prefill_rows),
    )


def default_variant(rows: int) -> MmaVariant:
    """The default for a launch of kind ``rows`` (``DECODE_ROWS`` or prefill)."""
    return DECODE_DEFAULT if rows == DECODE_ROWS else PREFILL_DEFAULT


def choose_variant(head_dim: int, rows: int) -> MmaVariant:
    """The variant a launch of kind ``rows`` (``DECODE_ROWS`` or prefill) uses: the default for its kind, with
    ``VARIANT_ENV`` applied when set (an override the kernel lacks raises ValueError naming it). A default the
    head_dim has no room for falls back to 2 stages of 64 keys."""
    default = default_variant(rows)
    text = os.environ.get(VARIANT_ENV, "")
    if text:
        variant = parse_variant(text, default)
        reason = unfit_reason(variant, head_dim, rows)
        if reason is not None:
            raise ValueError(f"{VARIANT_ENV}={text!r} has no kernel variant at head_dim {head_dim}: {reason}")
        return variant
    if unfit_reason(default, head_dim, rows) is None:
        return default
    return replace(default, stages=2, tile_keys=64)


def split_count(
    variant: MmaVariant, work_items: int, resident_ctas: int, by_keys: int, max_splits: int, key_tiles: int
) -> int:
    """Split-K factor: ``variant.splits`` when set; ``wave_fit_splits`` for ``split_waves`` 0; else enough splits
    that ``work_items x splits`` reaches ``split_waves`` waves of ``resident_ctas`` (1 when the items alone do).
    Never more than ``by_keys`` (chunks of at least ``MIN_KEYS_PER_SPLIT`` keys) or ``max_splits``."""
    limit = max(1, min(by_keys, max_splits))
    if variant.splits > 0:
        wanted = variant.splits
    elif variant.split_waves == 0:
        return wave_fit_splits(work_items, resident_ctas, key_tiles, limit)
    else:
        target = variant.split_waves * resident_ctas
        wanted = 1 if work_items >= target else -(-target // max(1, work_items))
    return max(1, min(wanted, limit))


def wave_fit_splits(work_items: int, resident_ctas: int, key_tiles: int, limit: int) -> int:
    """The split factor (1..``limit``) with the least estimated time: the waves of resident CTAs it makes (a partly
    filled last wave costs a whole one) times each CTA's share, ``SPLIT_FIXED_TILES`` plus its key tiles; the
    fewest splits on a tie. 256 items on 396 resident CTAs over 128 key tiles: 3 (two full waves)."""
    best, best_cost = 1, -1.0
    residents = max(1, resident_ctas)
    for splits in range(1, limit + 1):
        waves = -(-work_items * splits // residents)
        cost = waves * (SPLIT_FIXED_TILES + key_tiles / splits)
        if best_cost < 0 or cost < best_cost:
            best, best_cost = splits, cost
    return best


def sweep_variants(rows: int) -> list[MmaVariant]:
    """What ``bench_attention.py --sweep`` times (and tests/test_attention_gpu.py checks) for launches of kind
    ``rows``: every compiled (stages, tile_keys) with the default split policy (prefill: at 64 and 128 rows per
    CTA), then the default kernel with the other split policy (1 or 2 waves) and with forced split factors 1 to 4
    (decode)."""
    default = default_variant(rows)
    if rows != DECODE_ROWS:
        return [
            replace(default, stages=stages, tile_keys=tile_keys, prefill_rows=prefill_rows)
            for prefill_rows in PREFILL_ROWS
            for stages, tile_keys in pipeline_choices(replace(default, prefill_rows=prefill_rows), rows)
        ]
    variants = [replace(default, stages=stages, tile_keys=tile_keys) for stages, tile_keys in DECODE_VARIANTS]
    variants += [replace(default, split_waves=waves) for waves in (0, 1, 2) if waves != default.split_waves]
    variants += [replace(default, splits=splits) for splits in (1, 2, 3, 4)]
    return variants


class _MmaKernel(Protocol):
    max_dynamic_shared_size_bytes: int

    @property
    def num_regs(self) -> int: ...

    @property
    def shared_size_bytes(self) -> int: ...

    def __call__(
        self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[object, ...], shared_mem: int = 0
    ) -> None: ...


def mma_kernel(element_type: str, head_dim: int, rows: int, variant: MmaVariant) -> _MmaKernel:
    """The tensor-core variant asked for (``rows``: query rows of its CTAs, ``cta_rows``), compiled on first use
    and allowed its dynamic shared memory (over the 48 KiB default) once per device."""
    import cupy

    defines = (
        f"-DPAGED_ATTENTION_MMA_DTYPE={KERNEL_DTYPE_CODES[element_type]}",
        f"-DPAGED_ATTENTION_HEAD_DIM={head_dim}",
        f"-DPAGED_ATTENTION_ROW_WARPS={rows // 16}",
        f"-DPAGED_ATTENTION_MMA_STAGES={variant.stages}",
        f"-DPAGED_ATTENTION_MMA_TILE_KEYS={variant.tile_keys}",
    )
    function = cast(_MmaKernel, kernel("paged_attention_mma.cu", "paged_attention_mma", defines))
    key = (int(cupy.cuda.runtime.getDevice()), element_type, head_dim, rows, variant.stages, variant.tile_keys)
    if key not in _MMA_READY:
        function.max_dynamic_shared_size_bytes = shared_bytes(variant, head_dim)
        _MMA_READY.add(key)
    return function


def mma_resident_ctas(element_type: str, head_dim: int, rows: int, variant: MmaVariant) -> int:
    """CTAs of one tensor-core variant (``rows`` per CTA) the whole GPU holds at once (registers, shared memory,
    per-SM limit)."""
    import cupy

    function = mma_kernel(element_type, head_dim, rows, variant)
    runtime = cupy.cuda.runtime
    device = int(runtime.getDevice())
    num_sms = int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device))
    shared_per_sm = int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor, device))
    num_regs = int(function.num_regs)
    static_shared = int(function.shared_size_bytes)
    registers_per_warp = -(-num_regs * 32 // 256) * 256
    by_registers = REGISTERS_PER_SM // (registers_per_warp * (mma_threads(rows) // 32))
    by_shared = shared_per_sm // (static_shared + shared_bytes(variant, head_dim) + 1024)
    return num_sms * max(1, min(MAX_CTAS_PER_SM, by_registers, by_shared))
