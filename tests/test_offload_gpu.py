"""Device <-> pinned host page moves are one asynchronous launch on the caller's stream (issue #41; skipped without a
GPU): the call returns while the stream is still busy, the pages land before anything later on that stream reads
them, and the host never touches pinned bytes a queued move still reads or writes."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._storage.memory import CudaPoolMemory, PinnedPoolMemory, copy_rows
from kv_cache_manager_v2.config import CacheTierConfig
from tests.helpers import KIB, attention, make_config
from tests.test_kernels_reference import random_bytes

cupy = pytest.importorskip("cupy")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy.is_available(), reason="CuPy sees no CUDA device"),
]

ROW = 16 * KIB + 48  # not a power of two: the grid's last lanes are partly idle
ROWS = 12
SPIN_CYCLES = 1_000_000_000  # ~0.5 s at 2 GHz: the stream stays busy well past the move's return

_SPIN_THEN_FILL = r"""
extern "C" __global__ void spin_then_fill(unsigned char* rows, long long nbytes, long long cycles,
                                          unsigned char value) {
    if (threadIdx.x == 0) {
        const long long start = clock64();
        while (clock64() - start < cycles) {
        }
    }
    __syncthreads();
    for (long long i = threadIdx.x; i < nbytes; i += blockDim.x) {
        rows[i] = value;
    }
}
"""


def busy(stream: Any, device_rows: Any, value: int) -> None:
    """Queue on ``stream`` a kernel that spins, then writes ``value`` into every byte of ``device_rows``."""
    spin = cupy.RawKernel(_SPIN_THEN_FILL, "spin_then_fill")
    with stream:
        spin((1,), (256,), (device_rows, np.int64(device_rows.size), np.int64(SPIN_CYCLES), np.uint8(value)))


def pools() -> tuple[CudaPoolMemory, PinnedPoolMemory, Any, npt.NDArray[np.uint8]]:
    """A device pool and a pinned pool of ``ROWS`` rows, with the copy path warmed up: the process's first move
    compiles and loads ``page_copy_rows`` and allocates its row-table buffers, which can take longer than a spin,
    so a test timing a move against a busy stream would otherwise see the stream finish during the call."""
    device, pinned = CudaPoolMemory(ROW * ROWS), PinnedPoolMemory(ROW * ROWS)
    copy_rows(pinned, [0], device, [0], ROW)
    copy_rows(device, [0], pinned, [0], ROW)
    cupy.cuda.Device().synchronize()
    table = cupy.asarray(device.array()).reshape(ROWS, ROW)
    return device, pinned, table, pinned.host_array().reshape(ROWS, ROW)


def test_a_move_to_the_host_returns_at_once_and_lands_after_the_streams_earlier_work() -> None:
    device, pinned, table, host = pools()
    content = random_bytes(np.random.default_rng(1), ROWS, ROW)
    table[...] = cupy.asarray(content)
    cupy.cuda.Device().synchronize()
    host[...] = 0
    stream = cupy.cuda.Stream(non_blocking=True)
    busy(stream, table[3], 0xA5)  # the engine's last write of row 3 is still queued
    with stream:
        copy_rows(pinned, [0, 7], device, [3, 5], ROW)
    assert not stream.done  # queued behind the spinning kernel: the host did not wait
    landed = pinned.host_array().reshape(ROWS, ROW)  # host access waits for the move
    assert stream.done
    assert np.all(landed[0] == 0xA5)
    assert np.array_equal(landed[7], content[5])
    assert not landed[[1, 2, 3, 4, 5, 6, 8, 9, 10, 11]].any()


def test_a_move_to_the_device_is_read_only_after_it_landed_and_its_source_is_kept_until_then() -> None:
    device, pinned, table, host = pools()
    content = random_bytes(np.random.default_rng(2), ROWS, ROW)
    host[...] = content
    table[...] = 0
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    busy(stream, table[11], 1)
    with stream:
        copy_rows(device, [4, 0, 9], pinned, [2, 6, 11], ROW)
        assert not stream.done
        pinned.host_array()[...] = 0  # the host overwriting the source waits until the move has read it
        read = table[[4, 0, 9]].copy()  # the engine's next read, on the same stream
    stream.synchronize()
    assert np.array_equal(cupy.asnumpy(read), content[[2, 6, 11]])
    assert np.all(cupy.asnumpy(table[11]) == 1)


def test_moves_in_many_batches_reuse_the_row_tables_and_keep_their_order() -> None:
    device, pinned, table, host = pools()
    rng = np.random.default_rng(3)
    content = random_bytes(rng, ROWS, ROW)
    host[...] = content
    stream = cupy.cuda.Stream(non_blocking=True)
    expected = content.copy()
    with stream:
        for _ in range(40):  # more batches than the ring has slots: slots are reused once their event completed
            order = rng.permutation(ROWS)
            copy_rows(device, list(range(ROWS)), pinned, [int(i) for i in order], ROW)
            copy_rows(pinned, list(range(ROWS)), device, list(range(ROWS)), ROW)
            expected = expected[order]
    assert np.array_equal(pinned.host_array().reshape(ROWS, ROW), expected)
    assert np.array_equal(cupy.asnumpy(table), expected)


def test_many_moves_queue_behind_a_busy_stream_without_the_host_waiting() -> None:
    device, pinned, table, host = pools()
    content = random_bytes(np.random.default_rng(5), ROWS, ROW)
    host[...] = content
    stream = cupy.cuda.Stream(non_blocking=True)
    busy(stream, table[0], 0)
    with stream:
        for i in range(48):  # each move holds a row-table buffer until the stream reaches it
            copy_rows(device, [i % ROWS], pinned, [(i + 5) % ROWS], ROW)
    assert not stream.done
    stream.synchronize()
    assert np.array_equal(cupy.asnumpy(table), content[[(i + 5) % ROWS for i in range(ROWS)]])


def test_bad_rows_are_refused_before_anything_is_queued() -> None:
    device, pinned, table, host = pools()
    host[...] = 9
    table[...] = 0
    with pytest.raises(ValueError, match="src_rows"):
        copy_rows(device, [0, 1], pinned, [0, ROWS], ROW)
    with pytest.raises(ValueError, match="dst_rows"):
        copy_rows(device, [1, 1], pinned, [0, 2], ROW)
    cupy.cuda.Device().synchronize()
    assert not cupy.asnumpy(table).any()


def test_the_manager_offloads_and_onboards_pages_with_their_bytes() -> None:
    slot = 2 * 64 * KIB  # K and V of 64 KiB per block of 32 tokens
    check_round_trip([GpuCacheTierConfig(4 * slot), HostCacheTierConfig(8 * slot)])


def test_shutdown_gives_the_pools_device_and_pinned_memory_back() -> None:
    """Pools are allocated outside CuPy's caching pools, so a shut-down manager leaves the device's free memory and
    the pinned pool as they were (before, both stayed reserved for CuPy's next allocations)."""
    import gc

    gpu_bytes, host_bytes = 256 * 1024 * KIB, 64 * 1024 * KIB
    device_pool, pinned_pool = cupy.get_default_memory_pool(), cupy.get_default_pinned_memory_pool()
    cupy.cuda.Device().synchronize()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    cached_before, pinned_free_before = device_pool.total_bytes(), pinned_pool.n_free_blocks()
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_bytes), HostCacheTierConfig(host_bytes)]
    manager = KVCacheManager(make_config([attention(0, 64 * KIB)], tiers=tiers, backend="cuda"))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(256)
    cache.close()
    assert cupy.cuda.runtime.memGetInfo()[0] <= free_before - gpu_bytes // 2  # the GPU pools are on the device
    manager.shutdown()
    del manager, cache
    gc.collect()
    cupy.cuda.Device().synchronize()
    assert cupy.cuda.runtime.memGetInfo()[0] >= free_before - 32 * 1024 * KIB  # (kernels and row tables stay)
    assert device_pool.total_bytes() - cached_before < gpu_bytes // 4
    assert pinned_pool.n_free_blocks() == pinned_free_before


def test_a_pinned_pool_forgets_streams_whose_work_on_it_finished() -> None:
    _, pinned, _, _ = pools()
    device = CudaPoolMemory(ROW * ROWS)
    for _ in range(40):  # an engine that makes a stream per request
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            copy_rows(device, [1], pinned, [1], ROW)
        stream.synchronize()
    assert pinned.num_streams_tracked <= 8
    pinned.wait_for_device()


def check_round_trip(tiers: list[CacheTierConfig]) -> None:
    """A request's pages written behind a busy engine stream go down a tier when another request takes the GPU
    tier (blocks of 32 tokens, 64 KiB K and V pages), and come back on the engine's stream with their bytes."""
    manager = KVCacheManager(make_config([attention(0, 64 * KIB)], tiers=tiers, max_util_for_resume=1.0, backend="cuda"))
    views: dict[str, Any] = {role: manager.get_page_view(0, role) for role in ("key", "value")}
    to_rows = manager.get_page_index_converter(0, "key")
    engine, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(4)
    a = manager.create_kv_cache()
    assert a.resume(engine.ptr) and a.resize(128)
    rows = [int(r) for r in to_rows(a.get_base_page_indices(0))]
    written = {role: random_bytes(rng, len(rows), int(view.shape[1])) for role, view in views.items()}
    busy(engine, views["key"][rows[0]], 0)  # the engine is busy; its writes below are queued behind
    with engine:
        for role, view in views.items():
            view[rows] = cupy.asarray(written[role])
    a.suspend()
    b = manager.create_kv_cache()
    assert b.resume(other.ptr) and b.resize(128)  # a's pages go down a tier
    assert manager.movement_counters.offloaded_pages >= len(rows)
    with other:
        for view in views.values():
            view[[int(r) for r in to_rows(b.get_base_page_indices(0))]] = 0
    b.close()
    assert a.resume(engine.ptr)  # and come back, on the engine's stream
    back = [int(r) for r in to_rows(a.get_base_page_indices(0))]
    with engine:
        read = {role: view[back].copy() for role, view in views.items()}
    engine.synchronize()
    for role in views:
        assert np.array_equal(cupy.asnumpy(read[role]), written[role]), role
    a.close()
    manager.shutdown()


def test_the_simulator_checks_every_page_on_the_cuda_backend_with_moves_in_flight() -> None:
    from kv_cache_manager_v2.sim.options import SimulatorOptions
    from kv_cache_manager_v2.sim.simulator import simulate

    result = simulate(SimulatorOptions(num_requests=8, backend="cuda", check=True))
    assert result.backend == "cuda" and result.finished == 8
    assert result.offloaded_pages > 0 and result.onboarded_pages > 0  # pages made the round trip to the host
    assert result.checked_tokens > 0  # and a ContentError would have ended the run
