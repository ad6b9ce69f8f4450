"""Paged attention (``kernels/paged_attention.cu``): the NumPy twin and the CuPy launcher.

Pages. ``key_pages`` / ``value_pages`` are page tables ``[num_pages, page_stride]`` of uint8 whose row ``i`` is
page index ``i`` — what ``KVCacheManager.get_page_view(layer_id, role, index_mode)`` returns (NumPy for the twin,
CuPy for the launcher; ``device_pages`` wraps a raw base address). Inside one page::

    [tokens_per_page, num_kv_heads, head_dim]   row-major, tokens_per_page = tokens_per_block / expansion

K and V share the page stride, the layout and the element type: ``"float16"``, ``"bfloat16"`` (raw bits in
uint16 arrays, also for the query and the output) or ``"float32"``.

Tables. Row ``s`` of ``key_page_table`` / ``value_page_table`` holds converted page indices (SHARED or PER_LAYER,
the latter reaching scratch slots; ``-1`` where a block has no page), ``expansion`` entries per block. It is
window-local when ``kv_page_offset[s] > 0``: the sink blocks (``ceil(num_sink_tokens /
tokens_per_block)``), then the blocks from ``sink blocks + kv_page_offset[s]`` on. Full tables use offset 0.

Visibility. Query token ``t`` at ``positions[t]`` sees key ``j`` iff ``j <= positions[t]`` and, with a
window ``W``, ``j > positions[t] - W`` or ``j < num_sink_tokens``. GQA: query head ``h`` reads kv head
``h // (num_heads // num_kv_heads)``. A visible key without a page (removed, ``-1``, past the table) is an error:
the twin raises ``ValueError``, the kernel (which cannot raise) writes NaN for that query instead of reading
stray memory.

Numerics. The twin computes in float64 and rounds once (bf16: to nearest even); the kernel accumulates in fp32
with an online (flash-decoding) softmax, split over the keys when few sequences would leave the GPU idle.
``TOLERANCES[element_type] = (atol, rtol)`` bounds ``|kernel - twin| <= atol + rtol * |twin|`` for inputs of
magnitude about 1 and softmax scale ``1/sqrt(head_dim)``: two units in the last place of the output type
(2^-11 relative for fp16, 2^-8 for bf16) plus fp32 rounding of the scores and sums (fp32: 1e-4 relative).

Two kernels. fp16/bf16 run on tensor cores (``kernels/paged_attention_mma.cu``: mma.sync with fp32 accumulation,
the GQA group's rows packed into a 16-row tile for decode, 64 or 128 rows for prefill, K/V tiles staged through
shared memory; it rounds the softmax weights to the element type before P V, as FlashAttention does, within
the same tolerances); fp32 (and any type with ``kernel="cuda_cores"``) runs ``kernels/paged_attention.cu`` on CUDA
cores. Variants: element type x head_dim in ``HEAD_DIMS`` x rows per CTA (``ROW_TILES`` / ``MMA_ROW_TILES``), and
for tensor cores the pipeline (``attention_variants.py``); the launcher compiles only the one it runs. Both CUDA sources also run on the CPU in tests
(``kernels/paged_attention_cpu.cuh``, tests/test_attention_cuda_on_cpu.py, tests/test_attention_mma_on_cpu.py).
Inputs and their checks live in ``attention_params.py``, the NumPy twin in ``attention_reference.py``.
"""

from __future__ import annotations

import os
from typing import ContextManager, Final, Protocol, cast

import numpy as np

from ._launch import kernel
from .attention_params import ELEMENT_TYPES as ELEMENT_TYPES
from .attention_params import HEAD_DIMS as HEAD_DIMS
from .attention_params import KERNEL_CHOICES as KERNEL_CHOICES
from .attention_params import KERNEL_ENV as KERNEL_ENV
from .attention_params import MMA_MAX_SPLITS as MMA_MAX_SPLITS
from .attention_params import MMA_ROW_TILES as MMA_ROW_TILES
from .attention_params import TENSOR_CORE_TYPES as TENSOR_CORE_TYPES
from .attention_params import MAX_CTAS_PER_SM as MAX_CTAS_PER_SM
from .attention_params import MAX_SPLITS as MAX_SPLITS
from .attention_params import MIN_KEYS_PER_SPLIT as MIN_KEYS_PER_SPLIT
from .attention_params import REGISTERS_PER_SM as REGISTERS_PER_SM
from .attention_params import ROW_TILES as ROW_TILES
from .attention_params import THREADS_PER_CTA as THREADS_PER_CTA
from .attention_params import TOLERANCES as TOLERANCES
from .attention_params import AttentionBatch as AttentionBatch
from .attention_params import AttentionParams as AttentionParams
from .attention_params import KERNEL_DTYPE_CODES, ArrayMeta, check_page_bytes, check_query, check_table_range
from .attention_reference import paged_attention_reference as paged_attention_reference
from .attention_variants import DECODE_ROWS, MmaVariant, choose_variant, cta_rows, default_variant, mma_kernel
from .attention_variants import mma_resident_ctas, mma_threads
from .attention_variants import shared_bytes, split_count

_LOG2_E: Final = 1.4426950408889634
QUERY_ALIGNMENT: Final = 4
"""Bytes the query's address must be a multiple of (``paged_attention_mma.cu`` loads it as 32-bit words)."""


class _Pointer(Protocol):
    @property
    def ptr(self) -> int: ...


class _DeviceArray(Protocol):
    """What the launcher reads of a CuPy array."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def strides(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[np.generic]: ...

    @property
    def data(self) -> _Pointer: ...


class _Kernel(Protocol):
    @property
    def num_regs(self) -> int: ...

    @property
    def shared_size_bytes(self) -> int: ...

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[object, ...]) -> None: ...


class LaunchPlan:
    """Kernel variant and grid for one batch: ``grid = (num_seqs * tiles_per_seq * num_kv_heads, num_splits, 1)``.

    A work item (``blockIdx.x``) is one (sequence, row tile, kv head), kv head fastest (the tensor-core kernel:
    then sequence, row tiles last tile first).
    """

    def __init__(
        self,
        rows: int,
        tiles_per_seq: int,
        num_splits: int,
        num_seqs: int,
        num_kv_heads: int,
        tensor_cores: bool = False,
        variant: MmaVariant | None = None,
    ) -> None:
        self.rows = rows
        self.tensor_cores = tensor_cores
        self.variant = variant  # the tensor-core kernel's variant (None on CUDA cores)
        self.tiles_per_seq = tiles_per_seq
        self.num_splits = num_splits
        self.grid: tuple[int, int, int] = (num_seqs * tiles_per_seq * num_kv_heads, num_splits, 1)

    @property
    def num_work_items(self) -> int:
        """CTAs per split, each work item with one split-K counter."""
        return self.grid[0]

    def partial_floats(self, head_dim: int) -> int:
        """fp32 scratch of split-K: per work item and split, ``rows x head_dim`` accumulators and ``rows``
        (max, sum) pairs padded to a multiple of 4 floats; 0 without split-K."""
        per_split = self.rows * head_dim + -(-2 * self.rows // 4) * 4
        return 0 if self.num_splits == 1 else self.num_work_items * self.num_splits * per_split


def row_tile(batch: AttentionBatch, group_size: int) -> int:
    """Query rows per CTA: decode serves one token's GQA group (smallest tile >= group size), prefill 8 rows."""
    if batch.max_query_len <= 1:
        return next((tile for tile in ROW_TILES if tile >= group_size), ROW_TILES[-1])
    return ROW_TILES[-1]


def mma_launch_kind(batch: AttentionBatch, group_size: int) -> int:
    """``DECODE_ROWS`` when a sequence's query rows fit one 16-row mma tile, else the smallest prefill CTA
    (``attention_variants``: the variant's ``prefill_rows`` then set the CTA's rows)."""
    return DECODE_ROWS if batch.max_query_len * group_size <= DECODE_ROWS else MMA_ROW_TILES[1]


def plan_launch(
    batch: AttentionBatch,
    params: AttentionParams,
    num_heads: int,
    resident_ctas: int,
    tensor_cores: bool = False,
    variant: MmaVariant | None = None,
) -> LaunchPlan:
    """Rows per CTA, tiles per sequence and split-K factor.

    Rows per CTA from ``row_tile`` (CUDA cores), or one 16-row mma tile when a sequence's query rows fit in it and
    the variant's ``prefill_rows`` otherwise (tensor cores). CUDA cores: splits fill at most one wave of
    ``resident_ctas`` (all SMs) when the work items alone would not, without cutting a tile's keys below
    ``MIN_KEYS_PER_SPLIT``. Example: 1
    sequence of 8k keys, 8 kv heads, 132 SMs x 3 CTAs -> 396 // 8 = 49 splits of 168 keys. Tensor cores: the
    variant's split policy (``attention_variants.split_count``; ``variant`` None: the default for the row tile,
    without ``VARIANT_ENV``): the wave-fit factor, 49 splits in that example (one wave).
    """
    group_size = num_heads // params.num_kv_heads
    rows = row_tile(batch, group_size)
    max_splits = MAX_SPLITS
    if tensor_cores:
        kind = mma_launch_kind(batch, group_size)
        variant = variant if variant is not None else default_variant(kind)
        rows = cta_rows(kind, variant)
        max_splits = MMA_MAX_SPLITS
    tiles_per_seq = max(1, -(-batch.max_query_len * group_size // rows))
    work = max(1, batch.num_seqs * tiles_per_seq * params.num_kv_heads)
    keys = batch.max_context_len
    window = params.sliding_window_size
    if window is not None:
        keys = min(keys, window + params.num_sink_tokens + batch.max_query_len)
    by_keys = max(1, keys // MIN_KEYS_PER_SPLIT)
    if tensor_cores and variant is not None:
        key_tiles = max(1, -(-keys // variant.tile_keys))
        splits = split_count(variant, work, resident_ctas, by_keys, max_splits, key_tiles)
        return LaunchPlan(rows, tiles_per_seq, splits, batch.num_seqs, params.num_kv_heads, True, variant)
    splits = min(max(1, resident_ctas // work), by_keys, max_splits)
    return LaunchPlan(rows, tiles_per_seq, splits, batch.num_seqs, params.num_kv_heads)


def uses_tensor_cores(params: AttentionParams, kernel: str | None = None) -> bool:
    """Whether ``paged_attention_cuda`` runs ``paged_attention_mma.cu``: ``kernel`` (None: the environment variable
    ``KERNEL_ENV``, else ``"auto"``) is one of ``KERNEL_CHOICES``; auto takes tensor cores for fp16/bf16."""
    choice = os.environ.get(KERNEL_ENV, "auto") if kernel is None else kernel
    if choice not in KERNEL_CHOICES:
        source = "kernel" if kernel is not None else f"environment variable {KERNEL_ENV}"
        raise ValueError(f"{source} must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "tensor_cores" and params.element_type not in TENSOR_CORE_TYPES:
        raise ValueError(
            f"kernel 'tensor_cores' serves element types {TENSOR_CORE_TYPES}, got {params.element_type!r}"
        )
    return choice == "tensor_cores" or (choice == "auto" and params.element_type in TENSOR_CORE_TYPES)


def cuda_launch_plan(
    batch: AttentionBatch, params: AttentionParams, num_heads: int, head_dim: int, kernel: str | None = None
) -> LaunchPlan:
    """The plan ``paged_attention_cuda`` uses on the current device (compiles the kernel variant on first use);
    computed once per shape and kept."""
    tensor_cores = uses_tensor_cores(params, kernel)
    window = params.sliding_window_size
    variant = None
    if tensor_cores:
        variant = choose_variant(head_dim, mma_launch_kind(batch, num_heads // params.num_kv_heads))
    key = (
        batch.num_seqs,
        batch.max_query_len,
        batch.max_context_len,
        num_heads,
        head_dim,
        params.num_kv_heads,
        params.element_type,
        -1 if window is None else window,
        params.num_sink_tokens,
        int(tensor_cores),
        "" if variant is None else variant.label(),
    )
    plan = _PLANS.get(key)
    if plan is None:
        if variant is not None:
            rows = cta_rows(mma_launch_kind(batch, num_heads // params.num_kv_heads), variant)
            resident = mma_resident_ctas(params.element_type, head_dim, rows, variant)
        else:
            rows = row_tile(batch, num_heads // params.num_kv_heads)
            resident = _resident_ctas(params.element_type, head_dim, rows)
        plan = plan_launch(batch, params, num_heads, resident, tensor_cores, variant)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def paged_attention_cuda(
    query: object,
    key_pages: object,
    value_pages: object,
    batch: AttentionBatch,
    params: AttentionParams,
    out: object | None = None,
    stream: object | None = None,
    kernel: str | None = None,
) -> object:
    """``paged_attention_reference`` on CuPy arrays, in one launch; returns ``out`` (allocated when None).

    Asynchronous on ``stream`` (default: CuPy's current stream); a visible key without a page yields NaN.
    ``kernel`` picks tensor cores or CUDA cores (see ``uses_tensor_cores``; the benchmark's before/after).
    Split-K scratch is kept per (device, stream), so launches on different streams may overlap.
    """
    import cupy

    tensor_cores = uses_tensor_cores(params, kernel)
    stream_context = stream if stream is not None else cupy.cuda.get_current_stream()
    with cast(ContextManager[object], stream_context):
        query_meta = _device_array(query, "query")
        num_heads, head_dim = check_query(query_meta, batch, params)
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"query head_dim {head_dim} has no CUDA kernel; supported: {HEAD_DIMS}")
        if not bool(cast(_Contiguous, query).flags.c_contiguous):
            raise ValueError("query must be C-contiguous")
        if int(query_meta.data.ptr) % QUERY_ALIGNMENT:
            # The tensor-core kernel reads the query as 32-bit words: a misaligned one faults the whole context.
            raise ValueError(
                f"query must start on {QUERY_ALIGNMENT} bytes, got address {int(query_meta.data.ptr):#x} (a view at "
                "an odd element offset: copy it)"
            )
        key_meta = _device_array(key_pages, "key_pages")
        value_meta = _device_array(value_pages, "value_pages")
        num_key_pages, page_stride = _check_pages(key_meta, "key_pages", params, head_dim)
        num_value_pages, value_stride = _check_pages(value_meta, "value_pages", params, head_dim)
        if value_stride != page_stride:
            raise ValueError(
                f"value_pages stride {value_stride} bytes differs from key_pages stride {page_stride} bytes"
            )
        check_table_range(batch, num_key_pages, num_value_pages)
        if out is None:
            out = cast(object, cupy.empty_like(query))
        out_meta = _device_array(out, "out")
        if out_meta.shape != query_meta.shape or out_meta.dtype != query_meta.dtype:
            raise ValueError(
                f"out must match query: got shape {out_meta.shape} dtype {out_meta.dtype}, expected "
                f"{query_meta.shape} {query_meta.dtype}"
            )
        if not bool(cast(_Contiguous, out).flags.c_contiguous):
            raise ValueError("out must be C-contiguous")
        if batch.num_tokens == 0:
            return out
        plan = cuda_launch_plan(batch, params, num_heads, head_dim, "tensor_cores" if tensor_cores else "cuda_cores")
        stream_ptr = int(cast(_Pointer, stream_context).ptr)
        partial, counters = _workspace(stream_ptr, plan.partial_floats(head_dim), plan.num_work_items)
        arguments = kernel_arguments(
            query,
            out,
            (int(key_meta.data.ptr), int(value_meta.data.ptr), page_stride, num_key_pages, num_value_pages),
            batch.device_arrays(),
            batch,
            params,
            (num_heads, head_dim),
            plan,
            (partial, counters),
        )
        if plan.variant is not None:
            launch = mma_kernel(params.element_type, head_dim, plan.rows, plan.variant)
            launch(plan.grid, (mma_threads(plan.rows),), arguments, shared_mem=shared_bytes(plan.variant, head_dim))
        else:
            _kernel(params.element_type, head_dim, plan.rows)(plan.grid, (THREADS_PER_CTA,), arguments)
    return out


def kernel_arguments(
    query: object,
    out: object,
    pages: tuple[int, int, int, int, int],
    batch_arrays: tuple[object, ...],
    batch: AttentionBatch,
    params: AttentionParams,
    heads: tuple[int, int],
    plan: LaunchPlan,
    workspace: tuple[object, object],
) -> tuple[object, ...]:
    """The arguments of ``kernels/paged_attention.cu`` in order, scalars as NumPy scalars of its C types.

    ``pages``: (key base address, value base address, page stride in bytes, number of key pages, number of value
    pages); ``batch_arrays``: (query_start, positions, key table, value table, kv_page_offset) as device arrays
    (``AttentionBatch.device_arrays``); ``heads``: (num_heads, head_dim); ``workspace``: (fp32 partial results,
    uint32 counters). Arrays pass through untouched, so tests can run the same argument list on the CPU.
    """
    key_base, value_base, page_stride, num_key_pages, num_value_pages = pages
    query_start, positions, key_table, value_table, offsets = batch_arrays
    num_heads, head_dim = heads
    window = params.sliding_window_size
    return (
        query,
        out,
        np.uint64(key_base),
        np.uint64(value_base),
        np.int64(page_stride),
        np.int32(num_key_pages),
        np.int32(num_value_pages),
        key_table,
        value_table,
        np.int32(batch.table_width),
        offsets,
        query_start,
        positions,
        np.int32(num_heads),
        np.int32(params.num_kv_heads),
        np.int32(params.tokens_per_block),
        np.int32(params.expansion),
        np.int32(0 if window is None else window),
        np.int32(params.num_sink_tokens),
        np.float32(params.scale_for(head_dim) * _LOG2_E),
        np.int32(plan.tiles_per_seq),
        workspace[0],
        workspace[1],
    )


def device_pages(base_address: int, page_stride: int, num_pages: int) -> object:
    """A CuPy uint8 ``[num_pages, page_stride]`` view of device memory the caller owns (e.g. from
    ``KVCacheManager.get_mem_pool_base_address``), so raw addresses can be passed to ``paged_attention_cuda``."""
    import cupy

    nbytes = int(page_stride) * int(num_pages)
    memory = cupy.cuda.UnownedMemory(int(base_address), nbytes, None)
    pointer = cupy.cuda.MemoryPointer(memory, 0)
    return cast(object, cupy.ndarray((int(num_pages), int(page_stride)), dtype=cupy.uint8, memptr=pointer))


class _Flags(Protocol):
    @property
    def c_contiguous(self) -> bool: ...


class _Contiguous(Protocol):
    @property
    def flags(self) -> _Flags: ...


def _check_pages(pages: _DeviceArray, name: str, params: AttentionParams, head_dim: int) -> tuple[int, int]:
    """``(num_pages, page_stride)`` of a 2-D uint8 page table whose rows are 16-byte aligned pages."""
    shape = pages.shape
    if len(shape) != 2 or pages.dtype != np.uint8 or pages.strides[1] != 1 or pages.strides[0] != shape[1]:
        raise ValueError(
            f"{name} must be a row-contiguous 2-D uint8 array [num_pages, page_stride], got shape {shape} dtype "
            f"{pages.dtype} strides {pages.strides}"
        )
    num_pages = int(shape[0])
    page_stride = int(shape[1])
    check_page_bytes(name, page_stride, params, head_dim)
    if page_stride % 16 or int(pages.data.ptr) % 16:
        raise ValueError(f"{name} must start on 16 bytes and have a stride that is a multiple of 16, got {page_stride}")
    return num_pages, page_stride


# ------------------------------------------------------------------------------------------------------- launch
_WORKSPACES: Final[dict[tuple[int, int], tuple[object, object]]] = {}
_RESIDENT: Final[dict[tuple[int, str, int, int], int]] = {}
_PLANS: Final[dict[tuple[int | str, ...], LaunchPlan]] = {}
_MAX_PLANS: Final = 4096


def _kernel(element_type: str, head_dim: int, rows: int) -> _Kernel:
    """The one variant asked for, compiled on first use by ``_launch.kernel`` (about 1 s; CuPy also caches it on
    disk, keyed with the shared headers' digest)."""
    defines = (
        f"-DPAGED_ATTENTION_DTYPE={KERNEL_DTYPE_CODES[element_type]}",
        f"-DPAGED_ATTENTION_HEAD_DIM={head_dim}",
        f"-DPAGED_ATTENTION_ROWS={rows}",
    )
    return cast(_Kernel, kernel("paged_attention.cu", "paged_attention", defines))


def _resident_ctas(element_type: str, head_dim: int, rows: int) -> int:
    """CTAs of one kernel variant the whole GPU holds at once (registers, shared memory, per-SM CTA limit)."""
    import cupy

    runtime = cupy.cuda.runtime
    device = int(runtime.getDevice())
    key = (device, element_type, head_dim, rows)
    resident = _RESIDENT.get(key)
    if resident is None:
        kernel = _kernel(element_type, head_dim, rows)
        num_sms = int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device))
        shared_per_sm = int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor, device))
        registers_per_warp = -(-int(kernel.num_regs) * 32 // 256) * 256  # allocated in units of 256 per warp
        by_registers = REGISTERS_PER_SM // (registers_per_warp * (THREADS_PER_CTA // 32))
        by_shared = shared_per_sm // (int(kernel.shared_size_bytes) + 1024)  # 1 KiB reserved per CTA
        resident = num_sms * max(1, min(MAX_CTAS_PER_SM, by_registers, by_shared))
        _RESIDENT[key] = resident
    return resident


def _workspace(stream_ptr: int, partial_floats: int, num_work_items: int) -> tuple[object, object]:
    """Split-K scratch of (device, stream): fp32 partial results and uint32 counters, zero between launches
    (each launch's last CTA resets its own). Grows, never shrinks."""
    import cupy

    key = (int(cupy.cuda.runtime.getDevice()), stream_ptr)
    cached = _WORKSPACES.get(key)
    if cached is not None:
        partial_size = int(cast(ArrayMeta, cached[0]).shape[0])
        counter_size = int(cast(ArrayMeta, cached[1]).shape[0])
        if partial_size >= partial_floats and counter_size >= num_work_items:
            return cached
        partial_floats = max(partial_floats, partial_size)
        num_work_items = max(num_work_items, counter_size)
    fresh = (
        cast(object, cupy.empty(max(1, partial_floats), dtype=cupy.float32)),
        cast(object, cupy.zeros(max(1, num_work_items), dtype=cupy.uint32)),
    )
    _WORKSPACES[key] = fresh
    return fresh


def _device_array(array: object, name: str) -> _DeviceArray:
    import cupy

    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array, got {type(array).__name__}")
    return cast(_DeviceArray, array)
