"""Disk <-> device page moves through page-locked staging (cuda backend, issue #41).

A page read from the disk tier straight into a device slot used to go through the pool file's mapping (a NumPy
gather, faulting per 4 KiB), a pageable host copy, a synchronous ``cupy.asarray`` and a device scatter. Here it
is positioned vector I/O (``disk_io``) into a pinned buffer that the device reaches through its mapped address,
then one ``page_copy_rows`` launch per chunk (``kernels/mapped_copy``) on the current stream: one host copy, no
host wait for the device. Two buffers alternate, so the device copies one chunk while the next is read; a buffer
is refilled only after the event recorded behind its last copy completed. Writes run the other way and wait for
each chunk's copy before ``pwritev`` (the bytes must be on the host before the file gets them).

The pipeline is written against two seams, ``StagingBuffer`` and the row copy, so the CPU tests drive it with a
copy that only runs when waited for, which catches a buffer refilled before the device read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Final, Protocol, cast, final

import numpy as np
import numpy.typing as npt

from .cuda_allocations import mapped_pinned_bytes
from .disk_io import move_file_rows
from .._base.types import FrozenValue
from ..kernels._checks import IndexVector, check_unique, index_vector
from ..kernels.mapped_copy import copy_rows_mapped, row_ids

CHUNK_BYTES: Final = 32 << 20
"""Bytes of one staging buffer (two per backend): large enough for sequential I/O and a launch's worth of pages,
small enough that a backend's staging stays at 64 MiB of pinned memory (a buffer grows to one row if rows are
larger)."""

RowCopy = Callable[[int, int, npt.NDArray[np.int64], int, int, npt.NDArray[np.int64], int], None]
"""``copy(dst_address, dst_num_rows, dst_ids, src_address, src_num_rows, src_ids, row_bytes)``: queue a row copy
between device-visible addresses (``copy_rows_mapped``)."""


class StagingBuffer(Protocol):
    """A host buffer the device reaches at ``device_address``, with the ordering of the device work that uses it."""

    @property
    def nbytes(self) -> int: ...

    @property
    def device_address(self) -> int: ...

    def host_rows(self, row_bytes: int) -> npt.NDArray[np.uint8]:
        """The buffer as rows of ``row_bytes`` (as many whole rows as fit)."""
        ...

    def queued(self) -> None:
        """Device work reading or writing the buffer was just queued (on the current stream)."""
        ...

    def wait(self) -> None:
        """Block until the device work queued on the buffer finished."""
        ...


class PinnedStagingBuffer:
    """Page-locked host memory mapped into the device's address space; one reusable event orders its reuse."""

    def __init__(self, nbytes: int) -> None:
        import cupy

        self.nbytes = nbytes
        self._pinned: object = mapped_pinned_bytes(nbytes)
        self._host: npt.NDArray[np.uint8] = np.frombuffer(cast(memoryview, self._pinned), dtype=np.uint8, count=nbytes)
        runtime: Any = cupy.cuda.runtime
        self.device_address = int(runtime.pointerGetAttributes(int(self._host.ctypes.data)).devicePointer)
        self._event: Any = cupy.cuda.Event(block=False, disable_timing=True)
        self._pending = False

    def host_rows(self, row_bytes: int) -> npt.NDArray[np.uint8]:
        rows = self.nbytes // row_bytes
        return self._host[: rows * row_bytes].reshape(rows, row_bytes)

    def queued(self) -> None:
        import cupy

        self._event.record(cupy.cuda.get_current_stream())
        self._pending = True

    def wait(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False


@final
@dataclass(frozen=True)
class _Move(FrozenValue):
    """One checked move: the file's side, the device's side and the row size."""

    fd: int
    file_ids: npt.NDArray[np.int64]
    file_num_rows: int
    device_address: int
    device_num_rows: int
    device_ids: npt.NDArray[np.int64]
    row_bytes: int


class DiskStaging:
    """The two staging buffers one backend's disk pools share, and the chunked moves through them."""

    def __init__(
        self,
        make_buffer: Callable[[int], StagingBuffer] = PinnedStagingBuffer,
        copy: RowCopy = copy_rows_mapped,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self._make_buffer = make_buffer
        self._copy = copy
        self._chunk_bytes = chunk_bytes
        self._buffers: list[StagingBuffer] = []
        self._identity: npt.NDArray[np.int64] = np.arange(0, dtype=np.int64)

    def wait(self) -> None:
        """Block until no device work uses the staging any more (before a pool it copied into is released)."""
        for buffer in self._buffers:
            buffer.wait()

    def move(
        self,
        fd: int,
        file_rows: IndexVector,
        file_num_rows: int,
        device_address: int,
        device_num_rows: int,
        device_rows: IndexVector,
        row_bytes: int,
        to_file: bool,
        names: tuple[str, str] = ("file_rows", "device_rows"),
    ) -> None:
        """Device row ``device_rows[i]`` -> file row ``file_rows[i]`` when ``to_file`` (returns once the file holds
        every row; the device copies run on the current stream, after the work queued there before), else the
        other way (returns with the last chunk's copy queued). ``names``: the two row arguments' names in errors."""
        file_ids, device_ids = self._checked(file_rows, file_num_rows, device_rows, device_num_rows, to_file, names)
        order = np.argsort(file_ids, kind="stable")  # chunks of consecutive file rows: few, long runs per chunk
        file_ids, device_ids = file_ids[order], device_ids[order]
        per_chunk = self._rows_per_chunk(row_bytes)
        move = _Move(fd, file_ids, file_num_rows, device_address, device_num_rows, device_ids, row_bytes)
        chunks = [(start, min(per_chunk, len(file_ids) - start)) for start in range(0, len(file_ids), per_chunk)]
        if to_file:
            self._write(move, chunks)
        else:
            self._read(move, chunks)

    def _read(self, move: _Move, chunks: list[tuple[int, int]]) -> None:
        for index, (start, count) in enumerate(chunks):
            buffer = self._buffers[index % 2]
            buffer.wait()  # the device has read what this buffer held
            rows = buffer.host_rows(move.row_bytes)
            staged = self._identity[:count]
            move_file_rows(move.fd, move.file_ids[start : start + count], move.file_num_rows, rows, staged, False)
            self._copy(
                move.device_address, move.device_num_rows, move.device_ids[start : start + count],
                buffer.device_address, int(rows.shape[0]), staged, move.row_bytes,
            )
            buffer.queued()

    def _write(self, move: _Move, chunks: list[tuple[int, int]]) -> None:
        def stage(index: int) -> None:
            buffer = self._buffers[index % 2]
            start, count = chunks[index]
            buffer.wait()
            self._copy(
                buffer.device_address, int(buffer.host_rows(move.row_bytes).shape[0]), self._identity[:count],
                move.device_address, move.device_num_rows, move.device_ids[start : start + count], move.row_bytes,
            )
            buffer.queued()

        if chunks:
            stage(0)
        for index, (start, count) in enumerate(chunks):
            if index + 1 < len(chunks):
                stage(index + 1)  # the device fills the other buffer while this one goes to the file
            buffer = self._buffers[index % 2]
            buffer.wait()
            rows = buffer.host_rows(move.row_bytes)
            move_file_rows(move.fd, move.file_ids[start : start + count], move.file_num_rows, rows,
                           self._identity[:count], True)

    @staticmethod
    def _checked(
        file_rows: IndexVector,
        file_num_rows: int,
        device_rows: IndexVector,
        device_num_rows: int,
        to_file: bool,
        names: tuple[str, str],
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Both row lists checked before the first chunk moves (a bad id moves nothing; destinations must not
        repeat)."""
        count = len(file_rows)
        file_ids = index_vector(file_rows, names[0], count, 0, file_num_rows)
        device_ids = row_ids(device_rows, names[1], count, device_num_rows)
        if to_file:
            check_unique(file_ids, names[0])
        else:
            check_unique(device_ids, names[1])
        return file_ids, device_ids

    def _rows_per_chunk(self, row_bytes: int) -> int:
        """Rows per chunk, after making sure both buffers hold at least one row (and the identity row ids exist)."""
        size = max(self._chunk_bytes, row_bytes)
        if not self._buffers or self._buffers[0].nbytes < size:
            self.wait()
            self._buffers = [self._make_buffer(size), self._make_buffer(size)]
        per_chunk = self._buffers[0].nbytes // row_bytes
        if self._identity.shape[0] < per_chunk:
            self._identity = np.arange(per_chunk, dtype=np.int64)
        return per_chunk
