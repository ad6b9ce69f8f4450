"""Bandwidth of the data-movement kernels as a fraction of a device-to-device memcpy of the same bytes (goal >= 85%).

Each case moves about ``--mib`` MiB in one launch (random rows of a pool, so the accesses really are scattered). The
kernel alone is timed with CUDA events over ``--repeat`` runs (median), next to ``cudaMemcpyAsync`` of the same byte
count between two contiguous buffers in the same run; both read and write every byte once, so the ratio compares
like with like. The wall time of the public launcher call (host checks, table uploads, kernel) is shown beside it.
Without a GPU it says so and exits 0.

    python tools/bench_kernels.py [--mib 1024] [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import ModuleType
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cuda_device import cupy_with_device, device_name  # noqa: E402

GOAL = 0.85
MIB = 1 << 20
ROW_SIZES = (4 * 1024, 16 * 1024, 64 * 1024, 160 * 1024, 1024 * 1024)


class Bench:
    """Two device buffers of twice the bytes per case, the timers, and the verdicts so far."""

    def __init__(self, cupy: ModuleType, mib: int, repeat: int) -> None:
        self.cupy = cupy
        self.total = mib * MIB
        self.repeat = repeat
        self.source = cupy.random.randint(0, 256, size=2 * self.total, dtype=cupy.uint8)
        self.target = cupy.zeros(2 * self.total, dtype=cupy.uint8)
        self.rng = np.random.default_rng(0)
        self.verdicts: list[bool] = []

    def gpu_seconds(self, run: Callable[[], None]) -> float:
        """Median GPU time of ``run`` between two events, after one warm-up."""
        cuda = self.cupy.cuda
        run()
        times: list[float] = []
        for _ in range(self.repeat):
            start, stop = cuda.Event(), cuda.Event()
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(cuda.get_elapsed_time(start, stop) / 1e3)
        return statistics.median(times)

    def wall_seconds(self, run: Callable[[], None]) -> float:
        """Median wall time of ``run`` until the GPU is done: host checks, uploads and the kernel."""
        times: list[float] = []
        for _ in range(self.repeat):
            start = time.perf_counter()
            run()
            self.cupy.cuda.get_current_stream().synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def memcpy(self, nbytes: int) -> None:
        runtime = self.cupy.cuda.runtime
        stream = self.cupy.cuda.get_current_stream().ptr
        runtime.memcpyAsync(self.target.data.ptr, self.source.data.ptr, nbytes, runtime.memcpyDeviceToDevice, stream)

    def report(self, name: str, nbytes: int, launch: Callable[[], None], call: Callable[[], None]) -> None:
        """``launch`` enqueues the bare kernel (GPU time); ``call`` is the public launcher (wall time)."""
        seconds = self.gpu_seconds(launch)
        baseline = self.gpu_seconds(lambda: self.memcpy(nbytes))
        ratio = baseline / seconds
        self.verdicts.append(ratio >= GOAL)
        verdict = "ok" if ratio >= GOAL else "BELOW GOAL"
        print(
            f"{name:<30} {nbytes / MIB:6.0f} MiB  kernel {nbytes / seconds / 1e9:7.1f} GB/s  "
            f"memcpy {nbytes / baseline / 1e9:7.1f} GB/s  {ratio:6.1%} {verdict:<10}  "
            f"launcher call {self.wall_seconds(call) * 1e3:7.2f} ms"
        )


def bare_kernel(file_name: str, name: str, count: int, row_bytes: int, *args: object) -> Callable[[], None]:
    """A launch of one row kernel with ready device arguments, in the launchers' geometry."""
    from kv_cache_manager_v2.kernels._launch import kernel, row_geometry

    function = kernel(file_name, name)
    grid, block = row_geometry(count, row_bytes)
    return lambda: function(grid, block, args)


def bench_rows(bench: Bench, row_bytes: int) -> None:
    """Pool to pool, gather to staging, SSM slot copies and the offset-based batched copy, for one page size."""
    from kv_cache_manager_v2.kernels.page_copy import batched_copy_cuda, copy_rows_cuda
    from kv_cache_manager_v2.kernels.ssm_copy import ssm_snapshot_copy_cuda

    cupy = bench.cupy
    count = bench.total // row_bytes
    rows = 2 * count
    src_table = bench.source[: rows * row_bytes].reshape(rows, row_bytes)
    dst_table = bench.target[: rows * row_bytes].reshape(rows, row_bytes)
    staging = bench.target[: count * row_bytes].reshape(count, row_bytes)
    src_rows = bench.rng.permutation(rows)[:count].astype(np.int32)
    dst_rows = bench.rng.permutation(rows)[:count].astype(np.int32)
    src_device, dst_device = cupy.asarray(src_rows), cupy.asarray(dst_rows)
    size, nbytes, half = f"{row_bytes // 1024} KiB", count * row_bytes, count // 2
    tail = (np.int64(row_bytes), np.int32(count))
    bench.report(
        f"page_copy_rows pool->pool {size}",
        nbytes,
        bare_kernel(
            "page_copy.cu", "page_copy_rows", count, row_bytes, dst_table, dst_device, src_table, src_device, *tail
        ),
        lambda: copy_rows_cuda(dst_table, dst_rows, src_table, src_rows),
    )
    gather = (staging, np.uint64(0), src_table, src_device, *tail)
    bench.report(
        f"page_copy_rows gather {size}",
        nbytes,
        bare_kernel("page_copy.cu", "page_copy_rows", count, row_bytes, *gather),
        lambda: copy_rows_cuda(staging, None, src_table, src_rows),
    )
    pairs = (src_device[:half], src_device[half : 2 * half], np.int64(row_bytes), np.int32(half))
    bench.report(
        f"ssm_snapshot_copy {size}",
        half * row_bytes,
        bare_kernel("ssm_copy.cu", "ssm_snapshot_copy", half, row_bytes, src_table, *pairs),
        lambda: ssm_snapshot_copy_cuda(src_table, src_rows[:half], src_rows[half : 2 * half]),
    )
    dst_offsets, src_offsets = dst_rows.astype(np.int64) * row_bytes, src_rows.astype(np.int64) * row_bytes
    sizes = np.full(count, row_bytes, dtype=np.int64)
    spans = [cupy.asarray(a) for a in (dst_offsets, src_offsets, sizes)]
    bench.report(
        f"page_copy_batched {size}",
        nbytes,
        bare_kernel(
            "page_copy.cu",
            "page_copy_batched",
            count,
            row_bytes,
            bench.target,
            spans[0],
            bench.source,
            spans[1],
            spans[2],
            np.int32(count),
        ),
        lambda: batched_copy_cuda(bench.target, dst_offsets, bench.source, src_offsets, sizes),
    )


def bench_kv_append(bench: Bench) -> None:
    """fp16 rows of 8 heads x 128 dims scattered to random (page, row) places of 32-token pages."""
    from kv_cache_manager_v2.kernels.kv_append import kv_append_cuda

    cupy = bench.cupy
    heads, head_dim, tokens_per_page = 8, 128, 32
    row_bytes = heads * head_dim * 2
    tokens = bench.total // row_bytes
    stride = tokens_per_page * row_bytes
    pages = bench.target.reshape(-1, stride)
    places = bench.rng.permutation(pages.shape[0] * tokens_per_page)[:tokens]
    page_indices, positions = (places // tokens_per_page).astype(np.int32), places.astype(np.int32)
    new_rows = bench.source[: bench.total].view(cupy.float16).reshape(tokens, heads, head_dim)
    device_indices = [cupy.asarray(a) for a in (page_indices, positions)]
    bench.report(
        "kv_append fp16 8x128 scattered",
        bench.total,
        bare_kernel(
            "kv_append.cu",
            "kv_append",
            tokens,
            row_bytes,
            pages,
            np.int64(stride),
            *device_indices,
            new_rows,
            np.int64(row_bytes),
            np.int32(tokens),
            np.int32(tokens_per_page),
        ),
        lambda: kv_append_cuda(pages, page_indices, positions, new_rows, tokens_per_page),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="bytes moved per case, in MiB")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per case (median reported)")
    args = parser.parse_args()
    cupy = cupy_with_device("bench_kernels")
    if cupy is None:
        return 0
    bench = Bench(cupy, args.mib, args.repeat)
    name = device_name(cupy)
    print(f"{name}: bytes moved per second vs cudaMemcpyAsync D2D of the same bytes (goal {GOAL:.0%})")
    for row_bytes in ROW_SIZES:
        bench_rows(bench, row_bytes)
    bench_kv_append(bench)
    print(f"{sum(bench.verdicts)} of {len(bench.verdicts)} cases reach {GOAL:.0%} of memcpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
