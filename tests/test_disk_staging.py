"""Disk <-> device moves through staging buffers (issue #41), on the CPU: the device is a NumPy pool whose copies
run only when the stream reaches them (a buffer's ``wait`` or the test's own sync), as a GPU's do. A pipeline that
refilled a staging buffer before the device read it, or wrote a chunk to the file before the device filled it,
leaves the wrong bytes behind here. The real pinned buffers, ``copy_rows_mapped`` and ``copy_rows``'s routing of a
disk <-> device pair to the staging run in ``test_disk_staging_gpu.py``."""

from __future__ import annotations

import os
from typing import Callable, Iterator

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2._storage.disk_staging import DiskStaging, StagingBuffer
from kv_cache_manager_v2._storage.memory import DiskPoolMemory, PoolMemory

ROW = 64


class FakeStream:
    """Queued row copies between host arrays known by address, run in order when the stream gets that far."""

    def __init__(self) -> None:
        self.arrays: dict[int, npt.NDArray[np.uint8]] = {}
        self.queue: list[Callable[[], None]] = []
        self.done = 0

    def register(self, array: npt.NDArray[np.uint8]) -> int:
        self.arrays[int(array.ctypes.data)] = array
        return int(array.ctypes.data)

    def copy(
        self,
        dst_address: int,
        dst_num_rows: int,
        dst_ids: npt.NDArray[np.int64],
        src_address: int,
        src_num_rows: int,
        src_ids: npt.NDArray[np.int64],
        row_bytes: int,
    ) -> None:
        dst = self.arrays[dst_address][: dst_num_rows * row_bytes].reshape(dst_num_rows, row_bytes)
        src = self.arrays[src_address][: src_num_rows * row_bytes].reshape(src_num_rows, row_bytes)
        dst_rows, src_rows = np.array(dst_ids), np.array(src_ids)  # the launch's row tables are copied at launch

        def run() -> None:
            dst[dst_rows] = src[src_rows]

        self.queue.append(run)

    def run_until(self, position: int) -> None:
        while self.done < position:
            self.queue[self.done]()
            self.done += 1

    def sync(self) -> None:
        self.run_until(len(self.queue))


class FakeBuffer:
    """A staging buffer on the fake stream: ``wait`` runs the stream up to the last copy queued on the buffer."""

    def __init__(self, stream: FakeStream, nbytes: int) -> None:
        self.stream = stream
        self.nbytes = nbytes
        self.host = np.zeros(nbytes, dtype=np.uint8)
        self.device_address = stream.register(self.host)
        self.mark = 0

    def host_rows(self, row_bytes: int) -> npt.NDArray[np.uint8]:
        rows = self.nbytes // row_bytes
        return self.host[: rows * row_bytes].reshape(rows, row_bytes)

    def queued(self) -> None:
        self.mark = len(self.stream.queue)

    def wait(self) -> None:
        self.stream.run_until(self.mark)


class FakeDevicePool:
    """A "device" pool: a plain ``PoolMemory`` (compiled classes take no interpreted subclass) at a NumPy array's
    address, which the fake stream's copies reach."""

    def __init__(self, stream: FakeStream, nbytes: int) -> None:
        self.data = np.zeros(nbytes, dtype=np.uint8)
        self.nbytes = nbytes
        self.memory = PoolMemory(nbytes, stream.register(self.data))


def to_device(device: FakeDevicePool, device_rows: list[int], disk: DiskPoolMemory, file_rows: list[int]) -> None:
    """What ``copy_rows(device, device_rows, disk, file_rows, ROW)`` does on the cuda backend."""
    disk.move_device_rows(file_rows, device.memory, device_rows, ROW, False, ("src_rows", "dst_rows"))


def to_disk(disk: DiskPoolMemory, file_rows: list[int], device: FakeDevicePool, device_rows: list[int]) -> None:
    """What ``copy_rows(disk, file_rows, device, device_rows, ROW)`` does on the cuda backend."""
    disk.move_device_rows(file_rows, device.memory, device_rows, ROW, True, ("dst_rows", "src_rows"))


def staging(stream: FakeStream, chunk_bytes: int) -> DiskStaging:
    def make(nbytes: int) -> StagingBuffer:
        return FakeBuffer(stream, nbytes)

    return DiskStaging(make, stream.copy, chunk_bytes)


@pytest.fixture
def parts(tmp_path: os.PathLike[str]) -> Iterator[tuple[FakeStream, DiskPoolMemory, FakeDevicePool]]:
    stream = FakeStream()
    disk = DiskPoolMemory(32 * ROW, os.path.join(os.fspath(tmp_path), "pool"), staging(stream, 3 * ROW))
    assert disk.reserve(32 * ROW)
    device = FakeDevicePool(stream, 32 * ROW)
    yield stream, disk, device
    disk.close()


def rows_of(memory: DiskPoolMemory | FakeDevicePool) -> npt.NDArray[np.uint8]:
    data = memory.data if isinstance(memory, FakeDevicePool) else memory.host_array()
    return data.reshape(-1, ROW)


@pytest.mark.parametrize("count", [1, 3, 7, 20])
def test_disk_to_device_through_staging_lands_every_row(
    parts: tuple[FakeStream, DiskPoolMemory, FakeDevicePool], count: int
) -> None:
    stream, disk, device = parts
    rng = np.random.default_rng(count)
    rows_of(disk)[:] = rng.integers(0, 256, (32, ROW), dtype=np.uint8)
    file_rows = rng.permutation(32)[:count].tolist()
    device_rows = rng.permutation(32)[:count].tolist()
    to_device(device, device_rows, disk, file_rows)  # chunks of 3 rows through two buffers
    stream.sync()
    assert np.array_equal(rows_of(device)[device_rows], rows_of(disk)[file_rows])


@pytest.mark.parametrize("count", [1, 3, 7, 20])
def test_device_to_disk_through_staging_writes_what_the_device_held(
    parts: tuple[FakeStream, DiskPoolMemory, FakeDevicePool], count: int
) -> None:
    stream, disk, device = parts
    rng = np.random.default_rng(100 + count)
    device.data[:] = rng.integers(0, 256, device.nbytes, dtype=np.uint8)
    file_rows = rng.permutation(32)[:count].tolist()
    device_rows = rng.permutation(32)[:count].tolist()
    to_disk(disk, file_rows, device, device_rows)
    assert not stream.queue[stream.done :], "the write returned with device copies still queued"
    assert np.array_equal(rows_of(disk)[file_rows], rows_of(device)[device_rows])


def test_rows_larger_than_a_chunk_grow_the_buffers_to_one_row(tmp_path: os.PathLike[str]) -> None:
    stream = FakeStream()
    disk = DiskPoolMemory(8 * ROW, os.path.join(os.fspath(tmp_path), "pool"), staging(stream, ROW // 2))
    device = FakeDevicePool(stream, 8 * ROW)
    assert disk.reserve(8 * ROW)
    device.data[:] = np.arange(8 * ROW, dtype=np.uint8)
    to_disk(disk, [4, 0, 6], device, [1, 2, 3])
    device.data[:] = 0
    to_device(device, [7, 5, 0], disk, [4, 0, 6])
    stream.sync()
    assert np.array_equal(rows_of(device)[[7, 5, 0]], np.arange(8 * ROW, dtype=np.uint8).reshape(8, ROW)[[1, 2, 3]])
    disk.close()


def test_a_bad_row_moves_nothing_and_names_the_argument(
    parts: tuple[FakeStream, DiskPoolMemory, FakeDevicePool],
) -> None:
    stream, disk, device = parts
    rows_of(disk)[:] = 7
    with pytest.raises(ValueError, match=r"src_rows\[4\] = 32 is outside \[0, 32\)"):
        to_device(device, [0, 1, 2, 3, 4], disk, [0, 1, 2, 3, 32])  # the bad id sits in the second chunk
    with pytest.raises(ValueError, match="dst_rows"):
        to_device(device, [5, 5], disk, [0, 1])
    with pytest.raises(ValueError, match="dst_rows"):
        to_disk(disk, [2, 2], device, [0, 1])
    stream.sync()
    assert not stream.queue and not device.data.any()
    assert (rows_of(disk) == 7).all()


def test_the_cpu_backend_has_no_staging_and_refuses_a_device_move(tmp_path: os.PathLike[str]) -> None:
    disk = DiskPoolMemory(4 * ROW, os.path.join(os.fspath(tmp_path), "pool"))
    device = FakeDevicePool(FakeStream(), 4 * ROW)
    with pytest.raises(RuntimeError, match="no staging"):
        to_device(device, [0], disk, [0])
    disk.close()
