"""Paged attention's inputs (see ``attention.py`` for the layout, tables and numerics): ``AttentionParams`` (one
layer's fixed choices), ``AttentionBatch`` (one step's sequences, checked once), the element types and kernel
limits, and the input checks the NumPy twin and the CuPy launcher share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Protocol, cast, final

import numpy as np
import numpy.typing as npt
from mypy_extensions import mypyc_attr

from .._base.validation import coerce_fields, refuse_subclass
from .._base.wording import counted

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

KERNEL_DTYPE_CODES: Final[dict[str, int]] = {"float16": 0, "bfloat16": 1, "float32": 2}
"""The kernels' element type codes (``attention::kFloat16`` ... in ``paged_attention_common.cuh``)."""
TENSOR_CORE_TYPES: Final = ("float16", "bfloat16")
"""Element types ``kernels/paged_attention_mma.cu`` serves (fp32 stays on the CUDA-core kernel)."""
MMA_ROW_TILES: Final = (16, 64, 128)
"""Query rows one tensor-core CTA serves: one 16-row mma tile (decode), four or eight (prefill)."""
MMA_MAX_SPLITS: Final = 64
"""Split-K factor limit of the tensor-core kernel (``attention::mma::kMaxSplits``)."""
KERNEL_CHOICES: Final = ("auto", "tensor_cores", "cuda_cores")
"""``paged_attention_cuda(kernel=...)``: auto takes tensor cores for fp16/bf16, CUDA cores for fp32."""
KERNEL_ENV: Final = "KV_CACHE_MANAGER_V2_ATTENTION_KERNEL"
"""Environment variable giving the default of ``kernel`` (e.g. ``cuda_cores`` for a before/after comparison)."""


_INT32_MAX: Final = 2**31 - 1
MAX_POSITION: Final = 2**31 - 2**16 - 1
"""Largest query position: the kernels add a split chunk, a key tile and 2 to positions in int32."""

NUMPY_TYPES: Final[dict[str, type[np.generic]]] = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
}

FloatArray = npt.NDArray[np.float64]
IndexArray = npt.NDArray[np.int32]


@final
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

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "AttentionParams")

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
        self.query_start: IndexArray = _int32_array(query_start, "query_start", 1)
        self.positions: IndexArray = _int32_array(positions, "positions", 1)
        self.key_page_table: IndexArray = _int32_array(key_page_table, "key_page_table", 2)
        value = key_page_table if value_page_table is None else value_page_table
        self.value_page_table: IndexArray = _int32_array(value, "value_page_table", 2)
        self.num_seqs: int = int(self.query_start.shape[0]) - 1
        self.num_tokens: int = int(self.positions.shape[0])
        offsets = np.zeros(max(self.num_seqs, 0), dtype=np.int32) if kv_page_offset is None else kv_page_offset
        self.kv_page_offset: IndexArray = _int32_array(offsets, "kv_page_offset", 1)
        self.table_width: int = int(self.key_page_table.shape[1])
        if self.num_seqs < 0:
            raise ValueError("query_start must hold num_seqs + 1 >= 1 entries, got 0")
        if int(self.query_start[0]) != 0 or int(self.query_start[-1]) != self.num_tokens:
            raise ValueError(
                f"query_start must run from 0 to num_tokens {self.num_tokens}, got {self.query_start.tolist()}"
            )
        counts = np.diff(self.query_start.astype(np.int64))
        if counts.size and int(np.min(counts)) < 0:
            raise ValueError(f"query_start must be non-decreasing, got {self.query_start.tolist()}")
        if self.num_tokens and int(np.min(self.positions)) < 0:
            raise ValueError(f"positions must be >= 0, got minimum {int(np.min(self.positions))}")
        for name, table in (("key_page_table", self.key_page_table), ("value_page_table", self.value_page_table)):
            if int(table.shape[0]) != self.num_seqs:
                raise ValueError(f"{name} must have num_seqs {counted(self.num_seqs, 'row')}, got shape {table.shape}")
            if table.size and int(np.min(table)) < -1:
                raise ValueError(f"{name} entries must be >= -1, got {int(np.min(table))}")
        if self.value_page_table.shape != self.key_page_table.shape:
            raise ValueError(
                f"value_page_table shape {self.value_page_table.shape} differs from key_page_table shape "
                f"{self.key_page_table.shape}"
            )
        if int(self.kv_page_offset.shape[0]) != self.num_seqs:
            raise ValueError(
                f"kv_page_offset must hold num_seqs {counted(self.num_seqs, 'entry', 'entries')}, got "
                f"{self.kv_page_offset.shape[0]}"
            )
        if self.num_seqs and int(np.min(self.kv_page_offset)) < 0:
            raise ValueError(f"kv_page_offset must be >= 0, got minimum {int(np.min(self.kv_page_offset))}")
        self.max_query_len: int = int(np.max(counts)) if counts.size else 0
        self.max_context_len: int = int(np.max(self.positions)) + 1 if self.num_tokens else 0
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


class ArrayMeta(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[np.generic]: ...


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


def check_query(query: ArrayMeta, batch: AttentionBatch, params: AttentionParams) -> tuple[int, int]:
    """``(num_heads, head_dim)`` of a query ``[num_tokens, num_heads, head_dim]`` that fits batch and params."""
    shape = tuple(int(size) for size in query.shape)
    if len(shape) != 3 or shape[0] != batch.num_tokens:
        raise ValueError(f"query must be [num_tokens {batch.num_tokens}, num_heads, head_dim], got shape {shape}")
    expected = np.dtype(NUMPY_TYPES[params.element_type])
    if query.dtype != expected:
        raise ValueError(f"query dtype must be {expected} for element_type {params.element_type!r}, got {query.dtype}")
    num_heads = shape[1]
    head_dim = shape[2]
    if num_heads % params.num_kv_heads:
        raise ValueError(f"query num_heads {num_heads} must be a multiple of num_kv_heads {params.num_kv_heads}")
    check_int32_arithmetic(batch, params)
    return num_heads, head_dim


def check_int32_arithmetic(batch: AttentionBatch, params: AttentionParams) -> None:
    """The kernels compute page ordinals and key counts in int32: refuse what would wrap (a wrapped
    ``kv_page_offset * expansion`` reads pages the table does not give, where the contract says NaN)."""
    if batch.num_seqs and int(np.max(batch.kv_page_offset)) * params.expansion > _INT32_MAX:
        raise ValueError(
            f"kv_page_offset {int(np.max(batch.kv_page_offset))} x expansion {params.expansion} overflows int32"
        )
    sink_pages = (params.num_sink_tokens + params.tokens_per_block - 1) // params.tokens_per_block * params.expansion
    if params.num_sink_tokens + params.tokens_per_block - 1 > _INT32_MAX or sink_pages > _INT32_MAX:
        raise ValueError(f"num_sink_tokens {params.num_sink_tokens} overflows the kernels' int32 page arithmetic")
    if batch.max_context_len > MAX_POSITION + 1:
        raise ValueError(f"positions must be <= {MAX_POSITION}, got {batch.max_context_len - 1}")


def check_table_range(batch: AttentionBatch, num_key_pages: int, num_value_pages: int) -> None:
    for name, table, bound in (
        ("key_page_table", batch.key_page_table, num_key_pages),
        ("value_page_table", batch.value_page_table, num_value_pages),
    ):
        if table.size and int(np.max(table)) >= bound:
            raise ValueError(
                f"{name} entry {int(np.max(table))} is past the {counted(bound, 'page')} of its pages array"
            )


def check_page_bytes(name: str, page_stride: int, params: AttentionParams, head_dim: int) -> int:
    """Bytes of one page's ``[tokens_per_page, num_kv_heads, head_dim]`` elements, which must fit the stride."""
    itemsize = int(np.dtype(NUMPY_TYPES[params.element_type]).itemsize)
    needed = params.tokens_per_page * params.num_kv_heads * head_dim * itemsize
    if page_stride < needed:
        raise ValueError(
            f"{name} pages of {page_stride} bytes cannot hold [{params.tokens_per_page}, {params.num_kv_heads}, "
            f"{head_dim}] {params.element_type} ({needed} bytes)"
        )
    return needed
