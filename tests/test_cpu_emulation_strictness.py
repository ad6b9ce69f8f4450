"""``kernels/paged_attention_cpu.cuh`` is never more forgiving than a GPU where that would hide a kernel bug.

Small probe kernels, compiled with the emulation as the attention kernels are, break one rule each: read a
cp.async destination before the wait that covers it, read dynamic shared memory before writing it, pass a
misaligned cp.async or ldmatrix address, or assume the order blocks run in. On a GPU each reads garbage, faults or
races; here each must show (poison bytes, launch result 2, a shuffled order), else the attention tests could pass
with that bug in the kernel.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2.kernels._source import kernel_directory

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"), reason="needs g++ on Linux"
)

PROBES = r"""
#include "paged_attention_cpu.cuh"

using attention::mma::cp_async_16;
using attention::mma::cp_async_commit;
using attention::mma::cp_async_wait;

// Each thread copies its 16 bytes of `src` into dynamic shared memory and reports what it sees there, before
// (wait_first == 0) or after (1) cp.async.wait_group 0 and a barrier.
__global__ void probe_cp_async(const unsigned char* src, unsigned char* out, int wait_first, int offset) {
    PAGED_ATTENTION_DYNAMIC_SHARED(shared);
    cp_async_16(attention::mma::shared_address(shared + 16 * threadIdx.x), src + offset + 16 * threadIdx.x, true);
    cp_async_commit();
    if (wait_first) {
        cp_async_wait<0>();
        __syncthreads();
    }
    for (int i = 0; i < 16; ++i) {
        out[16 * threadIdx.x + i] = shared[16 * threadIdx.x + i];
    }
    cp_async_wait<0>();
}

// Two groups in flight; wait_group 1 lands the older one only.
__global__ void probe_wait_group(const unsigned char* src, unsigned char* out) {
    PAGED_ATTENTION_DYNAMIC_SHARED(shared);
    cp_async_16(attention::mma::shared_address(shared), src, true);
    cp_async_commit();
    cp_async_16(attention::mma::shared_address(shared + 16), src + 16, true);
    cp_async_commit();
    cp_async_wait<1>();
    for (int i = 0; i < 32; ++i) {
        out[i] = shared[i];
    }
    cp_async_wait<0>();
}

// Every block reads the first byte of dynamic shared memory, then writes it.
__global__ void probe_shared_start(unsigned char* out) {
    PAGED_ATTENTION_DYNAMIC_SHARED(shared);
    const unsigned char first = shared[0];
    __syncthreads();
    shared[0] = 7;
    out[blockIdx.x] = first;
}

__global__ void probe_ldmatrix(const int offset, unsigned* out) {
    PAGED_ATTENTION_DYNAMIC_SHARED(shared);
    unsigned r[4];
    attention::mma::ldmatrix_x4(r, attention::mma::shared_address(shared + offset + 16 * (threadIdx.x % 32)));
    out[threadIdx.x] = r[0];
}

// Block (x, y) records when it ran.
__global__ void probe_order(unsigned* clock, unsigned* when) {
    if (threadIdx.x == 0) {
        when[blockIdx.y * gridDim.x + blockIdx.x] = atomicAdd(clock, 1u);
    }
}

CPU_EXPORT(probe_cp_async)
CPU_EXPORT(probe_wait_group)
CPU_EXPORT(probe_shared_start)
CPU_EXPORT(probe_ldmatrix)
CPU_EXPORT(probe_order)
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    directory = tmp_path_factory.mktemp("cpu_emulation_probes")
    source = directory / "probes.cpp"
    source.write_text(PROBES)
    target = directory / "probes.so"
    command = ["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", f"-I{kernel_directory()}"]
    subprocess.run([*command, str(source), "-o", str(target)], check=True)
    return ctypes.CDLL(str(target))


def launch(library: ctypes.CDLL, name: str, grid: tuple[int, int], threads: int, *args: object) -> int:
    values: list[ctypes.c_void_p | ctypes.c_int] = []
    for arg in args:
        if isinstance(arg, np.ndarray):
            values.append(ctypes.c_void_p(arg.ctypes.data))
        else:
            assert isinstance(arg, int), arg
            values.append(ctypes.c_int(arg))
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(value) for value in values])
    return int(getattr(library, f"cpu_{name}")(grid[0], grid[1], 1, threads, pointers))


def aligned_bytes(count: int) -> npt.NDArray[np.uint8]:
    buffer = np.arange(count + 64, dtype=np.uint8)
    start = -buffer.ctypes.data % 16
    return buffer[start : start + count]


def test_a_cp_async_destination_holds_nothing_before_its_wait(probes: ctypes.CDLL) -> None:
    src = aligned_bytes(32 * 16 + 16)
    out = np.zeros(32 * 16, dtype=np.uint8)
    assert launch(probes, "probe_cp_async", (1, 1), 32, src, out, 0, 0) == 0
    assert (out == 0xFF).all()  # on a GPU: stale or partial bytes; a kernel must wait before it reads
    assert launch(probes, "probe_cp_async", (1, 1), 32, src, out, 1, 0) == 0
    np.testing.assert_array_equal(out, src[: 32 * 16])


def test_wait_group_lands_only_the_groups_it_covers(probes: ctypes.CDLL) -> None:
    src = aligned_bytes(32)
    out = np.zeros(32, dtype=np.uint8)
    assert launch(probes, "probe_wait_group", (1, 1), 32, src, out) == 0
    np.testing.assert_array_equal(out[:16], src[:16])
    assert (out[16:] == 0xFF).all()


def test_dynamic_shared_memory_is_not_the_previous_blocks(probes: ctypes.CDLL) -> None:
    out = np.zeros(3, dtype=np.uint8)
    assert launch(probes, "probe_shared_start", (3, 1), 32, out) == 0
    assert (out == 0xFF).all()


def test_misaligned_cp_async_and_ldmatrix_fault(probes: ctypes.CDLL) -> None:
    src = aligned_bytes(32 * 16 + 16)
    out = np.zeros(32 * 16, dtype=np.uint8)
    assert launch(probes, "probe_cp_async", (1, 1), 32, src, out, 1, 4) == 2
    words = np.zeros(32, dtype=np.uint32)
    assert launch(probes, "probe_ldmatrix", (1, 1), 32, 0, words) == 0
    assert launch(probes, "probe_ldmatrix", (1, 1), 32, 8, words) == 2


def test_blocks_run_in_a_seeded_shuffled_order(probes: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = np.zeros(1, dtype=np.uint32)
    when = np.zeros(6 * 4, dtype=np.uint32)
    assert launch(probes, "probe_order", (6, 4), 32, clock, when) == 0
    np.testing.assert_array_equal(when, np.arange(24))  # x fastest without a seed
    orders = set()
    for seed in (1, 2, 3):
        monkeypatch.setenv("KVCM_CPU_BLOCK_ORDER_SEED", str(seed))
        clock[0] = 0
        assert launch(probes, "probe_order", (6, 4), 32, clock, when) == 0
        assert sorted(when.tolist()) == list(range(24))
        orders.add(tuple(when.tolist()))
    assert len(orders) == 3 and tuple(range(24)) not in orders
