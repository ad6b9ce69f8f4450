"""Batched page copies (``kernels/page_copy.cu``): NumPy twins and CuPy launchers taking the same arguments.

Many small pages moved one ``memcpy`` at a time cost one call each; these move all of them in one launch. A move
between pageable host memory and the device goes through a contiguous staging table: ``copy_rows_*(staging, None,
pool, rows)`` gathers on the source side, one transfer moves ``staging``, ``copy_rows_*(pool, rows, staging, None)``
scatters on the destination side; ``kv_cache_manager_v2._memory.copy_rows`` does that for the disk tier. Pinned host
pools are reached directly through their mapped address instead (``mapped_copy.py``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ._checks import (
    ArrayMeta,
    HostRows,
    IndexVector,
    as_int32,
    byte_buffer,
    check_range,
    check_unique,
    index_vector,
    int_array,
    require_host,
    row_table,
)
from ._launch import NULL, device_address, device_array, kernel, on_stream, row_geometry, upload
from .._base.wording import counted


def copy_rows_reference(
    dst: HostRows, dst_rows: IndexVector | None, src: HostRows, src_rows: IndexVector | None
) -> None:
    """Row ``dst_rows[i]`` of ``dst`` <- row ``src_rows[i]`` of ``src``, for every ``i``.

    ``dst``/``src``: C-contiguous uint8 tables ``[num_rows, row_bytes]`` with equal ``row_bytes``. ``None`` for a
    row table means the identity (row ``i``); a row id of ``-1`` skips the pair. Destinations must be distinct, and
    when ``dst`` and ``src`` are the same table no row may be both a source and a destination.
    """
    require_host(dst, "dst")
    require_host(src, "src")
    # may_share_memory is a cheap bounds test; addresses (slow to read from NumPy) only when it says yes.
    same = bool(np.may_share_memory(dst, src)) and _same_table(int(dst.ctypes.data), dst, int(src.ctypes.data), src)
    dst_ids, src_ids = _checked_rows(dst, dst_rows, src, src_rows, same)
    keep = (dst_ids >= 0) & (src_ids >= 0)
    dst[dst_ids[keep]] = src[src_ids[keep]]


def copy_rows_cuda(
    dst: object, dst_rows: IndexVector | None, src: object, src_rows: IndexVector | None, stream: object | None = None
) -> None:
    """``copy_rows_reference`` on CuPy tables, in one launch on ``stream`` (default: the current stream).

    Row tables are host data (sequences or NumPy arrays), checked on the host and uploaded with the launch.
    """
    dst_meta = device_array(dst, "dst")
    src_meta = device_array(src, "src")
    same = _same_table(device_address(dst), dst_meta, device_address(src), src_meta)
    dst_ids, src_ids = _checked_rows(dst_meta, dst_rows, src_meta, src_rows, same)
    count = int(dst_ids.shape[0])
    if count == 0:
        return
    row_bytes = int(dst_meta.shape[1])
    grid, block = row_geometry(count, row_bytes)
    with on_stream(stream):
        dst_table = NULL if dst_rows is None else upload(as_int32(dst_ids, "dst_rows"))
        src_table = NULL if src_rows is None else upload(as_int32(src_ids, "src_rows"))
        kernel("page_copy.cu", "page_copy_rows")(
            grid, block, (dst, dst_table, src, src_table, np.int64(row_bytes), np.int32(count))
        )


def batched_copy_reference(
    dst: npt.NDArray[np.uint8],
    dst_offsets: IndexVector,
    src: npt.NDArray[np.uint8],
    src_offsets: IndexVector,
    sizes: IndexVector,
) -> None:
    """``dst[dst_offsets[i]:][:sizes[i]] = src[src_offsets[i]:][:sizes[i]]`` for every ``i`` (byte offsets).

    ``dst``/``src``: C-contiguous 1-D uint8 buffers that do not overlap; destination spans must not overlap either.
    For pages of mixed sizes; equal-size pages are simpler with ``copy_rows_reference``.
    """
    require_host(dst, "dst")
    require_host(src, "src")
    _check_disjoint_buffers(int(dst.ctypes.data), int(dst.nbytes), int(src.ctypes.data), int(src.nbytes))
    dst_at, src_at, lengths = _checked_spans(dst, dst_offsets, src, src_offsets, sizes)
    for i in range(int(lengths.shape[0])):
        size = int(lengths[i])
        dst_begin = int(dst_at[i])
        src_begin = int(src_at[i])
        dst[dst_begin : dst_begin + size] = src[src_begin : src_begin + size]


def batched_copy_cuda(
    dst: object,
    dst_offsets: IndexVector,
    src: object,
    src_offsets: IndexVector,
    sizes: IndexVector,
    stream: object | None = None,
) -> None:
    """``batched_copy_reference`` on CuPy buffers, in one launch; offsets and sizes are host data."""
    dst_meta = device_array(dst, "dst")
    src_meta = device_array(src, "src")
    _check_disjoint_buffers(
        device_address(dst), byte_buffer(dst_meta, "dst"), device_address(src), byte_buffer(src_meta, "src")
    )
    dst_at, src_at, lengths = _checked_spans(dst_meta, dst_offsets, src_meta, src_offsets, sizes)
    count = int(lengths.shape[0])
    if count == 0:
        return
    grid, block = row_geometry(count, int(np.max(lengths)))
    with on_stream(stream):
        kernel("page_copy.cu", "page_copy_batched")(
            grid, block, (dst, upload(dst_at), src, upload(src_at), upload(lengths), np.int32(count))
        )


def _same_table(dst_address: int, dst: ArrayMeta, src_address: int, src: ArrayMeta) -> bool:
    """True when ``dst`` and ``src`` are one table; ValueError when they overlap in any other way."""
    dst_rows, dst_row_bytes = row_table(dst, "dst")
    src_rows, src_row_bytes = row_table(src, "src")
    if dst_address == src_address and dst_row_bytes == src_row_bytes:
        return True
    if dst_address < src_address + src_rows * src_row_bytes and src_address < dst_address + dst_rows * dst_row_bytes:
        raise ValueError("dst and src overlap without being the same table")
    return False


def _checked_rows(
    dst: ArrayMeta, dst_rows: IndexVector | None, src: ArrayMeta, src_rows: IndexVector | None, same_table: bool
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Row ids of both sides (the identity for None), after every check of ``copy_rows_reference``."""
    dst_count, dst_row_bytes = row_table(dst, "dst")
    src_count, src_row_bytes = row_table(src, "src")
    if dst_row_bytes != src_row_bytes:
        raise ValueError(f"dst rows of {dst_row_bytes} bytes cannot take src rows of {src_row_bytes} bytes")
    if dst_rows is None:
        if src_rows is None:
            raise ValueError("dst_rows and src_rows cannot both be None")
        src_ids = index_vector(src_rows, "src_rows", len(src_rows), -1, src_count)
        dst_ids = _identity(len(src_rows), dst_count, "dst")
    else:
        dst_ids = index_vector(dst_rows, "dst_rows", len(dst_rows), -1, dst_count)
        if src_rows is None:
            src_ids = _identity(len(dst_rows), src_count, "src")
        else:
            src_ids = index_vector(src_rows, "src_rows", len(dst_rows), -1, src_count)
    live = (dst_ids >= 0) & (src_ids >= 0)
    check_unique(dst_ids[live], "dst_rows")
    if same_table:
        shared = np.intersect1d(dst_ids[live], src_ids[live])
        if shared.size:
            raise ValueError(
                f"row {int(shared[0])} of the same table is both a source and a destination (in src_rows and dst_rows)"
            )
    return dst_ids, src_ids


def _identity(count: int, num_rows: int, side: str) -> npt.NDArray[np.int64]:
    """Rows ``0..count-1`` of a side whose row table is None (a staging table)."""
    if count > num_rows:
        raise ValueError(f"{side}_rows=None addresses {counted(count, 'row')} but {side} has {num_rows}")
    return np.arange(count, dtype=np.int64)


def _check_disjoint_buffers(dst_address: int, dst_bytes: int, src_address: int, src_bytes: int) -> None:
    if dst_address < src_address + src_bytes and src_address < dst_address + dst_bytes:
        raise ValueError("dst and src overlap; copy within one buffer with copy_rows instead")


def _checked_spans(
    dst: ArrayMeta, dst_offsets: IndexVector, src: ArrayMeta, src_offsets: IndexVector, sizes: IndexVector
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Offsets and sizes as int64, each span inside its buffer and destination spans pairwise disjoint."""
    dst_bytes = byte_buffer(dst, "dst")
    src_bytes = byte_buffer(src, "src")
    lengths = int_array(sizes, "sizes", 1)
    count = int(lengths.shape[0])
    check_range(lengths, "sizes", 0, max(dst_bytes, src_bytes) + 1)
    dst_at = index_vector(dst_offsets, "dst_offsets", count, 0, dst_bytes + 1)
    src_at = index_vector(src_offsets, "src_offsets", count, 0, src_bytes + 1)
    check_range(dst_at + lengths, "dst_offsets + sizes", 0, dst_bytes + 1)
    check_range(src_at + lengths, "src_offsets + sizes", 0, src_bytes + 1)
    order = np.argsort(dst_at[lengths > 0], kind="stable")
    starts = dst_at[lengths > 0][order]
    ends = (dst_at + lengths)[lengths > 0][order]
    clash = np.flatnonzero(starts[1:] < ends[:-1])
    if clash.size:
        raise ValueError(f"destination spans overlap at byte offset {int(starts[int(clash[0]) + 1])}")
    return dst_at, src_at, lengths
