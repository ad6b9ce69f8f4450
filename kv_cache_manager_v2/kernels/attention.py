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

Kernel variants: element type x head_dim in ``HEAD_DIMS`` x rows per CTA in ``ROW_TILES``; the launcher compiles
only the one it runs. Decode reads each K/V byte once per kv head (GQA groups up to 8 share one CTA); prefill is
correct but runs on CUDA cores, re-reading K/V per 8-row tile. The CUDA C also runs on the CPU in tests
(``kernels/paged_attention_cpu.cuh``, tests/test_attention_cuda_on_cpu.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ContextManager, Final, Protocol, cast

import numpy as np
import numpy.typing as npt
from mypy_extensions import mypyc_attr

from .._validation import coerce_fields
from ._source import kernel_directory, kernel_source

ELEMENT_TYPES: Final = ("float16", "bfloat16", "float32")
HEAD_DIMS: Final = (64, 128, 256)
"""Head sizes the CUDA kernel is built for (the twin takes any)."""

TOLERANCES: Final[dict[str, tuple[float, float]]] = {
    "float16": (1e-3, 2e-3),
    "bfloat16": (8e-3, 1.6e-2),
    "float32": (2e-5, 1e-4),
}
"""``(atol, rtol)`` between the CUDA kernel and the twin, per element type (see the module docstring)."""

ROW_TILES: Final = (1, 2, 4, 8)
"""Query rows one CTA serves (kernel variants ``_r1`` ... ``_r8``)."""
THREADS_PER_CTA: Final = 128
MIN_KEYS_PER_SPLIT: Final = 128
"""Split-K never cuts a tile's keys into chunks shorter than this (each chunk pays a merge)."""
REGISTERS_PER_SM: Final = 65536
MAX_CTAS_PER_SM: Final = 16
MAX_SPLITS: Final = 256
"""Split-K factor limit (``kMaxSplits`` in the kernel)."""

_NUMPY_TYPES: Final[dict[str, type[np.generic]]] = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
}
_KERNEL_DTYPE: Final[dict[str, int]] = {"float16": 0, "bfloat16": 1, "float32": 2}
_LOG2_E: Final = 1.4426950408889634

FloatArray = npt.NDArray[np.float64]
IndexArray = npt.NDArray[np.int32]


@mypyc_attr(native_class=False)
@dataclass
class AttentionParams:
    """What one attention layer fixes: K/V layout, element type, softmax scale, window and sinks.

    ``softmax_scale=None`` means ``1 / sqrt(head_dim)``; ``num_sink_tokens`` needs a ``sliding_window_size``
    (as in ``AttentionLayerConfig``).
    """

    num_kv_heads: int
    tokens_per_block: int
    element_type: str = "float16"
    expansion: int = 1
    softmax_scale: float | None = None
    sliding_window_size: int | None = None
    num_sink_tokens: int = 0

    def __post_init__(self) -> None:
        coerce_fields(
            self,
            ints=("num_kv_heads", "tokens_per_block", "expansion", "num_sink_tokens"),
            optional_ints=("sliding_window_size",),
            strs=("element_type",),
        )
        for name in ("num_kv_heads", "tokens_per_block", "expansion"):
            if self.__dict__[name] <= 0:
                raise ValueError(f"AttentionParams.{name} must be > 0, got {self.__dict__[name]}")
        if self.element_type not in ELEMENT_TYPES:
            raise ValueError(f"AttentionParams.element_type must be one of {ELEMENT_TYPES}, got {self.element_type!r}")
        if self.tokens_per_block % self.expansion:
            raise ValueError(
                f"AttentionParams.expansion {self.expansion} must divide tokens_per_block {self.tokens_per_block}"
            )
        window = self.sliding_window_size
        if window is not None and window <= 0:
            raise ValueError(f"AttentionParams.sliding_window_size must be > 0, got {window}")
        if self.num_sink_tokens < 0:
            raise ValueError(f"AttentionParams.num_sink_tokens must be >= 0, got {self.num_sink_tokens}")
        if self.num_sink_tokens > 0 and window is None:
            raise ValueError(f"AttentionParams.num_sink_tokens={self.num_sink_tokens} requires a sliding_window_size")
        scale = self.__dict__["softmax_scale"]
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
                raise TypeError(f"AttentionParams.softmax_scale must be a number or None, got {scale!r}")
            if not math.isfinite(float(scale)) or float(scale) <= 0.0:
                raise ValueError(f"AttentionParams.softmax_scale must be finite and > 0, got {scale!r}")
            self.__dict__["softmax_scale"] = float(scale)

    @property
    def tokens_per_page(self) -> int:
        return self.tokens_per_block // self.expansion

    @property
    def sink_blocks(self) -> int:
        """Leading table blocks a window-local table keeps in place: ``ceil(num_sink_tokens / tokens_per_block)``."""
        return -(-self.num_sink_tokens // self.tokens_per_block)

    def scale_for(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(head_dim)


class AttentionBatch:
    """One step's sequences, checked once on the host and shared by the twin and the launcher.

    Sequence ``s`` owns query tokens ``[query_start[s], query_start[s + 1])`` (``query_start[0] == 0``, non-
    decreasing; decode: one token each), token ``t`` sits at ``positions[t] >= 0``, and row ``s`` of the page
    tables (``[num_seqs, table_width]``) maps its keys to pages. ``value_page_table=None`` reuses the key table
    (SHARED mode, where only the base address differs); ``kv_page_offset=None`` means full tables (all 0).
    Arrays may be NumPy arrays or sequences of ints; they are kept as int32 NumPy arrays.
    """

    def __init__(
        self,
        query_start: object,
        positions: object,
        key_page_table: object,
        value_page_table: object | None = None,
        kv_page_offset: object | None = None,
    ) -> None:
        self.query_start = _int32_array(query_start, "query_start", 1)
        self.positions = _int32_array(positions, "positions", 1)
        self.key_page_table = _int32_array(key_page_table, "key_page_table", 2)
        value = key_page_table if value_page_table is None else value_page_table
        self.value_page_table = _int32_array(value, "value_page_table", 2)
        self.num_seqs = int(self.query_start.shape[0]) - 1
        self.num_tokens = int(self.positions.shape[0])
        offsets = np.zeros(max(self.num_seqs, 0), dtype=np.int32) if kv_page_offset is None else kv_page_offset
        self.kv_page_offset = _int32_array(offsets, "kv_page_offset", 1)
        self.table_width = int(self.key_page_table.shape[1])
        if self.num_seqs < 0:
            raise ValueError("query_start must hold num_seqs + 1 >= 1 entries, got 0")
        if int(self.query_start[0]) != 0 or int(self.query_start[-1]) != self.num_tokens:
            raise ValueError(
                f"query_start must run from 0 to num_tokens {self.num_tokens}, got {self.query_start.tolist()}"
            )
        counts = np.diff(self.query_start.astype(np.int64))
        if counts.size and int(counts.min()) < 0:
            raise ValueError(f"query_start must be non-decreasing, got {self.query_start.tolist()}")
        if self.num_tokens and int(self.positions.min()) < 0:
            raise ValueError(f"positions must be >= 0, got minimum {int(self.positions.min())}")
        for name, table in (("key_page_table", self.key_page_table), ("value_page_table", self.value_page_table)):
            if int(table.shape[0]) != self.num_seqs:
                raise ValueError(f"{name} must have num_seqs {self.num_seqs} rows, got shape {table.shape}")
            if table.size and int(table.min()) < -1:
                raise ValueError(f"{name} entries must be >= -1, got {int(table.min())}")
        if self.value_page_table.shape != self.key_page_table.shape:
            raise ValueError(
                f"value_page_table shape {self.value_page_table.shape} differs from key_page_table shape "
                f"{self.key_page_table.shape}"
            )
        if int(self.kv_page_offset.shape[0]) != self.num_seqs:
            raise ValueError(
                f"kv_page_offset must hold num_seqs {self.num_seqs} entries, got {self.kv_page_offset.shape[0]}"
            )
        if self.num_seqs and int(self.kv_page_offset.min()) < 0:
            raise ValueError(f"kv_page_offset must be >= 0, got minimum {int(self.kv_page_offset.min())}")
        self.max_query_len = int(counts.max()) if counts.size else 0
        self.max_context_len = int(self.positions.max()) + 1 if self.num_tokens else 0
        self._device: dict[int, tuple[object, ...]] = {}

    def device_arrays(self) -> tuple[object, ...]:
        """``(query_start, positions, key_page_table, value_page_table, kv_page_offset)`` on the current device,
        uploaded on first use (so a batch launched many times, e.g. once per layer, is uploaded once)."""
        import cupy

        device = int(cupy.cuda.runtime.getDevice())
        arrays = self._device.get(device)
        if arrays is None:
            host = (self.query_start, self.positions, self.key_page_table, self.value_page_table, self.kv_page_offset)
            arrays = tuple(cast(object, cupy.asarray(array)) for array in host)
            self._device[device] = arrays
        return arrays


def paged_attention_reference(
    query: npt.NDArray[np.generic],
    key_pages: npt.NDArray[np.uint8],
    value_pages: npt.NDArray[np.uint8],
    batch: AttentionBatch,
    params: AttentionParams,
) -> npt.NDArray[np.generic]:
    """Attention of every query token over its visible keys, read through the page tables (float64 math).

    ``query``: ``[num_tokens, num_heads, head_dim]`` of the element type (bf16 as uint16). Returns the output in
    the same shape and type. Raises ``ValueError`` when a visible key has no page.
    """
    for name, array in (("query", query), ("key_pages", key_pages), ("value_pages", value_pages)):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(array).__name__}")
    num_heads, head_dim = _check_query(query, batch, params)
    keys = _token_rows(key_pages, "key_pages", params, head_dim)
    values = _token_rows(value_pages, "value_pages", params, head_dim)
    _check_table_range(batch, int(keys.shape[0]), int(values.shape[0]))
    group_size = num_heads // params.num_kv_heads
    scale = params.scale_for(head_dim)
    queries = _to_float(query, params.element_type)
    result = np.zeros(queries.shape, dtype=np.float64)
    for seq in range(batch.num_seqs):
        begin = int(batch.query_start[seq])
        end = int(batch.query_start[seq + 1])
        if begin == end:
            continue
        positions = batch.positions[begin:end].astype(np.int64)
        visible = _visibility(positions, params)
        needed = np.flatnonzero(visible.any(axis=0))
        key_rows, value_rows, in_page = _locate(batch, seq, needed, params)
        k = _to_float(keys[key_rows, in_page], params.element_type)  # [keys, kv_heads, head_dim]
        v = _to_float(values[value_rows, in_page], params.element_type)
        # Query head h = kv_head * group_size + g reads kv head h // group_size.
        grouped = queries[begin:end].reshape(end - begin, params.num_kv_heads, group_size, head_dim)
        scores = np.einsum("tkgd,jkd->kgtj", grouped, k) * scale
        scores = np.where(visible[:, needed], scores, -np.inf)
        scores -= scores.max(axis=3, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=3, keepdims=True)
        result[begin:end] = np.einsum("kgtj,jkd->tkgd", weights, v).reshape(end - begin, num_heads, head_dim)
    return _from_float(result, params.element_type)


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


class _RawModule(Protocol):
    def get_function(self, name: str) -> _Kernel: ...


class LaunchPlan:
    """Kernel variant and grid for one batch: ``grid = (num_seqs * tiles_per_seq * num_kv_heads, num_splits, 1)``.

    A work item (``blockIdx.x``) is one (sequence, row tile, kv head), kv head fastest.
    """

    def __init__(self, rows: int, tiles_per_seq: int, num_splits: int, num_seqs: int, num_kv_heads: int) -> None:
        self.rows = rows
        self.tiles_per_seq = tiles_per_seq
        self.num_splits = num_splits
        self.grid = (num_seqs * tiles_per_seq * num_kv_heads, num_splits, 1)

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


def plan_launch(batch: AttentionBatch, params: AttentionParams, num_heads: int, resident_ctas: int) -> LaunchPlan:
    """Rows per CTA, tiles per sequence and split-K factor.

    Rows per CTA from ``row_tile``. Splits fill one wave of ``resident_ctas`` (all SMs) when the work items alone
    would not, without cutting a tile's keys below ``MIN_KEYS_PER_SPLIT``. Example: 1 sequence of 8k keys, 8 kv
    heads, 132 SMs x 3 CTAs -> 396 // 8 = 49 splits of 168 keys.
    """
    group_size = num_heads // params.num_kv_heads
    rows = row_tile(batch, group_size)
    tiles_per_seq = max(1, -(-batch.max_query_len * group_size // rows))
    work = max(1, batch.num_seqs * tiles_per_seq * params.num_kv_heads)
    keys = batch.max_context_len
    window = params.sliding_window_size
    if window is not None:
        keys = min(keys, window + params.num_sink_tokens + batch.max_query_len)
    splits = min(max(1, resident_ctas // work), max(1, keys // MIN_KEYS_PER_SPLIT), MAX_SPLITS)
    return LaunchPlan(rows, tiles_per_seq, splits, batch.num_seqs, params.num_kv_heads)


def cuda_launch_plan(batch: AttentionBatch, params: AttentionParams, num_heads: int, head_dim: int) -> LaunchPlan:
    """The plan ``paged_attention_cuda`` uses on the current device (compiles the kernel variant on first use)."""
    rows = row_tile(batch, num_heads // params.num_kv_heads)
    return plan_launch(batch, params, num_heads, _resident_ctas(params.element_type, head_dim, rows))


def paged_attention_cuda(
    query: object,
    key_pages: object,
    value_pages: object,
    batch: AttentionBatch,
    params: AttentionParams,
    out: object | None = None,
    stream: object | None = None,
) -> object:
    """``paged_attention_reference`` on CuPy arrays, in one launch; returns ``out`` (allocated when None).

    Asynchronous on ``stream`` (default: CuPy's current stream); a visible key without a page yields NaN.
    Split-K scratch is kept per (device, stream), so launches on different streams may overlap.
    """
    import cupy

    stream_context = stream if stream is not None else cupy.cuda.get_current_stream()
    with cast(ContextManager[object], stream_context):
        query_meta = _device_array(query, "query")
        num_heads, head_dim = _check_query(query_meta, batch, params)
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"query head_dim {head_dim} has no CUDA kernel; supported: {HEAD_DIMS}")
        if not bool(cast(_Contiguous, query).flags.c_contiguous):
            raise ValueError("query must be C-contiguous")
        key_meta = _device_array(key_pages, "key_pages")
        value_meta = _device_array(value_pages, "value_pages")
        num_key_pages, page_stride = _check_pages(key_meta, "key_pages", params, head_dim)
        num_value_pages, value_stride = _check_pages(value_meta, "value_pages", params, head_dim)
        if value_stride != page_stride:
            raise ValueError(
                f"value_pages stride {value_stride} bytes differs from key_pages stride {page_stride} bytes"
            )
        _check_table_range(batch, num_key_pages, num_value_pages)
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
        plan = cuda_launch_plan(batch, params, num_heads, head_dim)
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


# ------------------------------------------------------------------------------------------------------ checks
class _ArrayMeta(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[np.generic]: ...


class _Flags(Protocol):
    @property
    def c_contiguous(self) -> bool: ...


class _Contiguous(Protocol):
    @property
    def flags(self) -> _Flags: ...


def _int32_array(values: object, name: str, ndim: int) -> IndexArray:
    """``values`` as an int32 NumPy array of ``ndim`` dimensions (a copy the batch owns)."""
    try:
        array = np.array(values, copy=True)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an integer array, got {type(values).__name__}") from None
    if array.ndim != ndim or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {array.shape} dtype {array.dtype}")
    if array.size and (int(array.min()) < -(2**31) or int(array.max()) >= 2**31):
        raise ValueError(f"{name} must fit in int32, got range [{int(array.min())}, {int(array.max())}]")
    return np.ascontiguousarray(array, dtype=np.int32)


def _check_query(query: _ArrayMeta, batch: AttentionBatch, params: AttentionParams) -> tuple[int, int]:
    """``(num_heads, head_dim)`` of a query ``[num_tokens, num_heads, head_dim]`` that fits batch and params."""
    shape = tuple(int(size) for size in query.shape)
    if len(shape) != 3 or shape[0] != batch.num_tokens:
        raise ValueError(f"query must be [num_tokens {batch.num_tokens}, num_heads, head_dim], got shape {shape}")
    expected = np.dtype(_NUMPY_TYPES[params.element_type])
    if query.dtype != expected:
        raise ValueError(f"query dtype must be {expected} for element_type {params.element_type!r}, got {query.dtype}")
    num_heads = shape[1]
    head_dim = shape[2]
    if num_heads % params.num_kv_heads:
        raise ValueError(f"query num_heads {num_heads} must be a multiple of num_kv_heads {params.num_kv_heads}")
    return num_heads, head_dim


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
    _check_page_bytes(name, page_stride, params, head_dim)
    if page_stride % 16 or int(pages.data.ptr) % 16:
        raise ValueError(f"{name} must start on 16 bytes and have a stride that is a multiple of 16, got {page_stride}")
    return num_pages, page_stride


def _check_table_range(batch: AttentionBatch, num_key_pages: int, num_value_pages: int) -> None:
    for name, table, bound in (
        ("key_page_table", batch.key_page_table, num_key_pages),
        ("value_page_table", batch.value_page_table, num_value_pages),
    ):
        if table.size and int(table.max()) >= bound:
            raise ValueError(f"{name} entry {int(table.max())} is past the {bound} pages of its pages array")


def _check_page_bytes(name: str, page_stride: int, params: AttentionParams, head_dim: int) -> int:
    """Bytes of one page's ``[tokens_per_page, num_kv_heads, head_dim]`` elements, which must fit the stride."""
    itemsize = int(np.dtype(_NUMPY_TYPES[params.element_type]).itemsize)
    needed = params.tokens_per_page * params.num_kv_heads * head_dim * itemsize
    if page_stride < needed:
        raise ValueError(
            f"{name} pages of {page_stride} bytes cannot hold [{params.tokens_per_page}, {params.num_kv_heads}, "
            f"{head_dim}] {params.element_type} ({needed} bytes)"
        )
    return needed


# --------------------------------------------------------------------------------------------------------- twin
def _token_rows(
    pages: npt.NDArray[np.uint8], name: str, params: AttentionParams, head_dim: int
) -> npt.NDArray[np.generic]:
    """Pages seen as ``[num_pages, tokens_per_page, num_kv_heads, head_dim]`` of the element type (a view)."""
    if pages.ndim != 2 or pages.dtype != np.uint8 or pages.strides[1] != 1:
        raise ValueError(
            f"{name} must be a 2-D uint8 array [num_pages, page_stride] with contiguous rows, got shape "
            f"{pages.shape} dtype {pages.dtype}"
        )
    needed = _check_page_bytes(name, int(pages.shape[1]), params, head_dim)
    typed = pages[:, :needed].view(_NUMPY_TYPES[params.element_type])
    return typed.reshape(int(pages.shape[0]), params.tokens_per_page, params.num_kv_heads, head_dim)


def _visibility(positions: npt.NDArray[np.int64], params: AttentionParams) -> npt.NDArray[np.bool_]:
    """``[num_queries, max_position + 1]``: key ``j`` visible to query ``t``."""
    keys = np.arange(int(positions.max()) + 1, dtype=np.int64)[None, :]
    query_positions = positions[:, None]
    visible = keys <= query_positions
    window = params.sliding_window_size
    if window is not None:
        visible &= (keys > query_positions - window) | (keys < params.num_sink_tokens)
    return visible


def _locate(
    batch: AttentionBatch, seq: int, key_positions: npt.NDArray[np.int64], params: AttentionParams
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """K pages, V pages and rows in page of ``key_positions`` of sequence ``seq``; ``ValueError`` if one has none."""
    per_page = params.tokens_per_page
    ordinals = key_positions // per_page
    sink_pages = params.sink_blocks * params.expansion
    removed_pages = int(batch.kv_page_offset[seq]) * params.expansion
    entries = np.where(ordinals >= sink_pages, ordinals - removed_pages, ordinals)
    removed = (ordinals >= sink_pages) & (entries < sink_pages)
    past = entries >= batch.table_width
    usable = ~(removed | past)
    clipped = np.where(usable, entries, 0)
    key_rows = batch.key_page_table[seq, clipped].astype(np.int64)
    value_rows = batch.value_page_table[seq, clipped].astype(np.int64)
    missing = ~usable | (key_rows < 0) | (value_rows < 0)
    if missing.any():
        first = int(np.argmax(missing))
        position = int(key_positions[first])
        block = position // params.tokens_per_block
        if removed[first]:
            reason = f"block {block} was removed (kv_page_offset {int(batch.kv_page_offset[seq])})"
        elif past[first]:
            reason = f"table entry {int(entries[first])} is past table_width {batch.table_width}"
        else:
            reason = (
                f"table entry {int(entries[first])} holds key page {int(key_rows[first])} and value page "
                f"{int(value_rows[first])}"
            )
        raise ValueError(f"sequence {seq}: key position {position} is visible to a query but has no page: {reason}")
    return key_rows, value_rows, key_positions - ordinals * per_page


def _to_float(array: npt.NDArray[np.generic], element_type: str) -> FloatArray:
    if element_type == "bfloat16":
        bits = array.astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def _from_float(array: FloatArray, element_type: str) -> npt.NDArray[np.generic]:
    if element_type != "bfloat16":
        return array.astype(_NUMPY_TYPES[element_type])
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    nan = np.isnan(array)
    return np.where(nan, np.uint64(0x7FC0), rounded).astype(np.uint16)


# ------------------------------------------------------------------------------------------------------- launch
_MODULES: Final[dict[tuple[str, int, int], _RawModule]] = {}
_WORKSPACES: Final[dict[tuple[int, int], tuple[object, object]]] = {}
_RESIDENT: Final[dict[tuple[int, str, int, int], int]] = {}


def _kernel(element_type: str, head_dim: int, rows: int) -> _Kernel:
    """The one variant asked for, compiled on first use (about 1 s; CuPy also caches it on disk)."""
    key = (element_type, head_dim, rows)
    module = _MODULES.get(key)
    if module is None:
        import cupy

        options = (
            "--std=c++17",
            f"-I{kernel_directory()}",
            f"-DPAGED_ATTENTION_DTYPE={_KERNEL_DTYPE[element_type]}",
            f"-DPAGED_ATTENTION_HEAD_DIM={head_dim}",
            f"-DPAGED_ATTENTION_ROWS={rows}",
        )
        module = cast(_RawModule, cupy.RawModule(code=kernel_source("paged_attention.cu"), options=options))
        _MODULES[key] = module
    return module.get_function("paged_attention")


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
        partial_size = int(cast(_ArrayMeta, cached[0]).shape[0])
        counter_size = int(cast(_ArrayMeta, cached[1]).shape[0])
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
