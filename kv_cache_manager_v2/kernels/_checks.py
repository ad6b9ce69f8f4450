"""Argument checks shared by the NumPy twins and the CuPy launchers, so both reject the same input the same way.

The CUDA kernels trust their input (a kernel cannot raise); everything a host can check cheaply is checked here,
with a message naming the argument and the value. Array checks read only what NumPy and CuPy arrays share.
"""

from __future__ import annotations

from typing import Protocol, Sequence, SupportsIndex, Union

import numpy as np
import numpy.typing as npt

from .._base.wording import counted

IndexVector = Union[Sequence[SupportsIndex], npt.NDArray[np.integer]]
"""Row ids, page indices, positions: a sequence of ints (``list``, ``array('i')``) or an integer NumPy array."""

HostRows = npt.NDArray[np.uint8]
"""A C-contiguous 2-D uint8 table ``[num_rows, row_bytes]``: pages or slots of a pool, or a staging buffer."""

_INT32_MAX = 2**31 - 1


class _Flags(Protocol):
    @property
    def c_contiguous(self) -> bool: ...


class ArrayMeta(Protocol):
    """What NumPy and CuPy arrays both offer; the checks read nothing else."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[np.generic]: ...

    @property
    def flags(self) -> _Flags: ...


def require_host(array: object, name: str) -> None:
    """Twins run on NumPy arrays only (a NumPy memmap is one)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(array).__name__}")


def row_table(array: ArrayMeta, name: str) -> tuple[int, int]:
    """``(num_rows, row_bytes)`` of a C-contiguous 2-D uint8 table."""
    if len(array.shape) != 2 or array.dtype != np.uint8 or not array.flags.c_contiguous:
        raise ValueError(
            f"{name} must be a C-contiguous 2-D uint8 array [num_rows, row_bytes], got shape {array.shape} "
            f"dtype {array.dtype}"
        )
    return int(array.shape[0]), int(array.shape[1])


def byte_buffer(array: ArrayMeta, name: str) -> int:
    """Length of a C-contiguous 1-D uint8 buffer."""
    if len(array.shape) != 1 or array.dtype != np.uint8 or not array.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous 1-D uint8 array, got shape {array.shape} dtype {array.dtype}")
    return int(array.shape[0])


def int_array(values: object, name: str, ndim: int) -> npt.NDArray[np.int64]:
    """A host integer array of ``ndim`` dimensions as int64; TypeError for non-integers, ValueError for a wrong
    number of dimensions. An empty sequence is an empty integer array."""
    array = np.asarray(values)
    if array.size == 0 and array.dtype.kind not in "iu":
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {array.shape}")
    return array.astype(np.int64)


def as_int32(array: npt.NDArray[np.int64], name: str) -> npt.NDArray[np.int32]:
    """C-contiguous int32 copy for a kernel argument; ValueError when a value does not fit."""
    check_range(array, name, -_INT32_MAX - 1, _INT32_MAX + 1)
    return np.ascontiguousarray(array, dtype=np.int32)


def index_vector(values: IndexVector, name: str, length: int, low: int, high: int) -> npt.NDArray[np.int64]:
    """A 1-D host vector of ``length`` ints in ``[low, high)``."""
    array = int_array(values, name, 1)
    if int(array.shape[0]) != length:
        raise ValueError(f"{name} must have {counted(length, 'entry', 'entries')}, got {int(array.shape[0])}")
    check_range(array, name, low, high)
    return array


def check_range(array: npt.NDArray[np.int64], name: str, low: int, high: int) -> None:
    """ValueError naming the first entry outside ``[low, high)``."""
    if not array.size or (int(np.min(array)) >= low and int(np.max(array)) < high):
        return
    flat = array.reshape(-1)
    first = int(np.flatnonzero((flat < low) | (flat >= high))[0])
    where = ", ".join(str(int(p)) for p in np.unravel_index(first, array.shape))
    raise ValueError(f"{name}[{where}] = {int(flat[first])} is outside [{low}, {high})")


def check_unique(array: npt.NDArray[np.int64], name: str) -> None:
    """ValueError when a non-negative entry repeats (two writers of one place race on the GPU)."""
    used = np.sort(array[array >= 0])
    repeated = used[1:][used[1:] == used[:-1]]
    if repeated.size:
        raise ValueError(f"{name} names {int(repeated[0])} more than once")
