"""Disk <-> device moves through pinned staging on a GPU (issue #41; skipped without one): a write to the file waits
for the engine's earlier writes on the stream, a read returns while the stream is busy and lands before anything
later on that stream reads it, and a manager whose only tier below the GPU is a disk keeps every page's bytes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from kv_cache_manager_v2 import DiskCacheTierConfig, GpuCacheTierConfig
from kv_cache_manager_v2._storage.disk_staging import DiskStaging
from kv_cache_manager_v2._storage.memory import CudaPoolMemory, DiskPoolMemory, copy_rows
from tests.helpers import KIB
from tests.test_kernels_reference import random_bytes
from tests.test_offload_gpu import busy, check_round_trip

cupy = pytest.importorskip("cupy")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy.is_available(), reason="CuPy sees no CUDA device"),
]

ROW = 16 * KIB + 48
ROWS = 12


def pools(directory: str) -> tuple[CudaPoolMemory, DiskPoolMemory, Any]:
    """A device pool and a disk pool of ``ROWS`` rows whose staging moves 3 rows a chunk (several chunks per move),
    with the copy kernel loaded (the first move of a process compiles it)."""
    device = CudaPoolMemory(ROW * ROWS)
    disk = DiskPoolMemory(ROW * ROWS, os.path.join(directory, "pool"), DiskStaging(chunk_bytes=3 * ROW))
    assert disk.reserve(ROW * ROWS)
    copy_rows(disk, [0], device, [0], ROW)
    copy_rows(device, [0], disk, [0], ROW)
    cupy.cuda.Device().synchronize()
    return device, disk, cupy.asarray(device.array()).reshape(ROWS, ROW)


def test_a_write_to_disk_waits_for_the_streams_earlier_writes(tmp_path: os.PathLike[str]) -> None:
    device, disk, table = pools(os.fspath(tmp_path))
    content = random_bytes(np.random.default_rng(1), ROWS, ROW)
    table[...] = cupy.asarray(content)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    busy(stream, table[3], 0xA5)
    with stream:
        copy_rows(disk, [0, 7, 8, 9, 10, 11, 1], device, [3, 5, 6, 7, 8, 9, 10], ROW)
    on_file = disk.host_array().reshape(ROWS, ROW)
    assert np.all(on_file[0] == 0xA5)
    assert np.array_equal(on_file[[7, 8, 9, 10, 11, 1]], content[[5, 6, 7, 8, 9, 10]])
    disk.close()


def test_a_read_from_disk_returns_at_once_and_lands_before_the_next_read(tmp_path: os.PathLike[str]) -> None:
    device, disk, table = pools(os.fspath(tmp_path))
    content = random_bytes(np.random.default_rng(2), ROWS, ROW)
    disk.host_array().reshape(ROWS, ROW)[...] = content
    table[...] = 0
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    busy(stream, table[11], 1)
    with stream:
        copy_rows(device, [4, 0, 9, 1, 2], disk, [2, 6, 11, 3, 5], ROW)  # two chunks: the second waits for no one
        assert not stream.done
        read = table[[4, 0, 9, 1, 2]].copy()
    stream.synchronize()
    assert np.array_equal(cupy.asnumpy(read), content[[2, 6, 11, 3, 5]])
    assert np.all(cupy.asnumpy(table[11]) == 1)
    disk.close()


def test_a_manager_with_only_a_disk_below_the_gpu_keeps_every_byte(tmp_path: os.PathLike[str]) -> None:
    slot = 2 * 64 * KIB
    check_round_trip([GpuCacheTierConfig(4 * slot), DiskCacheTierConfig(8 * slot, os.fspath(tmp_path))])


def test_the_simulator_checks_every_page_with_a_disk_as_the_only_tier_below_the_gpu(tmp_path: os.PathLike[str]) -> None:
    from kv_cache_manager_v2.sim.options import SimulatorOptions
    from kv_cache_manager_v2.sim.simulator import simulate

    options = SimulatorOptions(num_requests=8, backend="cuda", check=True, host_mib=0, disk_mib=768,
                               disk_dir=os.fspath(tmp_path))
    result = simulate(options)
    assert result.backend == "cuda" and result.finished == 8
    assert result.offloaded_pages > 0 and result.onboarded_pages > 0  # pages went to the disk and came back
    assert result.checked_tokens > 0  # and a ContentError would have ended the run
