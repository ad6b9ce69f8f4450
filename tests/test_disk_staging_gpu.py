"""Disk <-> device moves through pinned staging on a GPU (issue #41; skipped without one): a write to the file waits
for the engine's earlier writes on the stream, a read returns while the stream is busy and lands before anything
later on that stream reads it, and a manager whose only tier below the GPU is a disk keeps every page's bytes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from kv_cache_manager_v2 import DiskCacheTierConfig, GpuCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._storage.disk_staging import DiskStaging
from kv_cache_manager_v2._storage.memory import CudaPoolMemory, DiskPoolMemory, copy_rows
from kv_cache_manager_v2.config import CacheTierConfig
from tests.helpers import KIB, attention, make_config
from tests.test_kernels_reference import random_bytes
from tests.test_offload_gpu import busy

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
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(4 * slot), DiskCacheTierConfig(8 * slot, os.fspath(tmp_path))]
    manager = KVCacheManager(make_config([attention(0, 64 * KIB)], tiers=tiers, max_util_for_resume=1.0, backend="cuda"))
    views: dict[str, Any] = {role: manager.get_page_view(0, role) for role in ("key", "value")}
    to_rows = manager.get_page_index_converter(0, "key")
    engine, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(4)
    a = manager.create_kv_cache()
    assert a.resume(engine.ptr) and a.resize(128)
    rows = [int(r) for r in to_rows(a.get_base_page_indices(0))]
    written = {role: random_bytes(rng, len(rows), int(view.shape[1])) for role, view in views.items()}
    busy(engine, views["key"][rows[0]], 0)
    with engine:
        for role, view in views.items():
            view[rows] = cupy.asarray(written[role])
    a.suspend()
    b = manager.create_kv_cache()
    assert b.resume(other.ptr) and b.resize(128)  # a's pages go to the disk, after the engine's writes
    assert manager.movement_counters.offloaded_pages >= len(rows)
    with other:
        for view in views.values():
            view[[int(r) for r in to_rows(b.get_base_page_indices(0))]] = 0
    b.close()
    assert a.resume(engine.ptr)
    back = [int(r) for r in to_rows(a.get_base_page_indices(0))]
    with engine:
        read = {role: view[back].copy() for role, view in views.items()}
    engine.synchronize()
    for role in views:
        assert np.array_equal(cupy.asnumpy(read[role]), written[role]), role
    a.close()
    manager.shutdown()


def test_the_simulator_checks_every_page_with_a_disk_as_the_only_tier_below_the_gpu(tmp_path: os.PathLike[str]) -> None:
    from kv_cache_manager_v2.sim.options import SimulatorOptions
    from kv_cache_manager_v2.sim.simulator import simulate

    options = SimulatorOptions(num_requests=8, backend="cuda", check=True, host_mib=0, disk_mib=768,
                               disk_dir=os.fspath(tmp_path))
    result = simulate(options)
    assert result.backend == "cuda" and result.finished == 8
    assert result.offloaded_pages > 0 and result.onboarded_pages > 0  # pages went to the disk and came back
    assert result.checked_tokens > 0  # and a ContentError would have ended the run
