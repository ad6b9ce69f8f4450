"""Disk tier page moves against a plain file read/write of the same bytes (issue #41): GB/s per page size.

Per page size, half the slots of a disk pool (scattered: random file slots, random host slots) move between a
host-side pool and the disk pool through the manager's own ``copy_rows`` (positioned vector I/O, one call per run
of consecutive file slots), through the pool file's mapping (a NumPy gather and scatter: the former path), and as
one plain ``pwrite`` / ``pread`` of the same number of bytes of another file; ours again with a ``zlib.crc32`` of
every moved page (what a per-page checksum would cost). The host pool is pinned when CuPy sees a
GPU (the cuda backend's host tier), else plain NumPy memory. With a GPU, a second table moves the same pages
between a device pool and the disk pool (a tier setup without host memory, or a page onboarded straight from
disk): through the cuda backend's pinned staging (ours) and through pageable staging (the former path: a gather
on the file's mapping, a synchronous copy, a device scatter), time to completion. The files were just written, so
reads come from the page cache: the figures compare copies and system calls on this machine, not the drive.
Then a manager-level resume: a suspended request whose pages another request pushed down to the disk tier (no host
tier) comes back to the GPU tier (host memory on the cpu backend), against a plain read of as many bytes.
Medians, after a warm-up.

    python tools/bench_disk_tier.py [--mib 1024] [--repeat 3] [--directory DIR] [--resume-mib 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zlib
from typing import Callable

import numpy as np
import numpy.typing as npt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kv_cache_manager_v2 import (  # noqa: E402
    AttentionLayerConfig,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)
from kv_cache_manager_v2._storage.disk_staging import DiskStaging  # noqa: E402
from kv_cache_manager_v2._storage.memory import (  # noqa: E402
    CudaPoolMemory,
    DiskPoolMemory,
    HostPoolMemory,
    PinnedPoolMemory,
    copy_rows,
    cuda_device_available,
)

KIB = 1 << 10
MIB = 1 << 20
PAGE_SIZES = (16 * KIB, 64 * KIB, 1024 * KIB)


def median_seconds(run: Callable[[], None], repeat: int) -> float:
    timings: list[float] = []
    for index in range(repeat + 1):
        start = time.perf_counter()
        run()
        if index:
            timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def page_rows(
    host: HostPoolMemory, disk: DiskPoolMemory, page: int, rng: np.random.Generator
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Both pools as rows of ``page`` bytes, and half the file's slots (random) paired with random host slots."""
    count = disk.nbytes // page
    file_rows = np.sort(rng.choice(count, count // 2, replace=False)).astype(np.int64)
    rng.shuffle(file_rows)
    host_rows = rng.permutation(count)[: count // 2].astype(np.int64)
    return host.host_array().reshape(-1, page), disk.host_array().reshape(-1, page), file_rows, host_rows


def table(host: HostPoolMemory, disk: DiskPoolMemory, plain_fd: int, repeat: int) -> list[str]:
    rows = [
        "| page size | direction | ours GB/s | ours + crc32 GB/s | through the mapping GB/s | plain file GB/s "
        "| ours / plain |",
        "|---|---|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(1)
    for page in PAGE_SIZES:
        host_table, disk_table, file_rows, host_rows = page_rows(host, disk, page, rng)
        nbytes = int(file_rows.shape[0]) * page
        contiguous = host.host_array()[:nbytes].data  # a memoryview
        for to_file in (True, False):

            def ours() -> None:
                if to_file:
                    copy_rows(disk, file_rows, host, host_rows, page)
                else:
                    copy_rows(host, host_rows, disk, file_rows, page)

            def checked() -> None:
                """Ours plus what a per-page checksum would cost: ``zlib.crc32`` of every moved page."""
                ours()
                for row in host_rows.tolist():
                    zlib.crc32(host_table[row])

            def mapped() -> None:
                if to_file:
                    disk_table[file_rows] = host_table[host_rows]
                else:
                    host_table[host_rows] = disk_table[file_rows]

            def plain() -> None:
                done = os.pwrite(plain_fd, contiguous, 0) if to_file else os.preadv(plain_fd, [contiguous], 0)
                assert done == nbytes

            mine, with_crc, theirs, the_file = (
                nbytes / median_seconds(run, repeat) / 1e9 for run in (ours, checked, mapped, plain)
            )
            if not np.array_equal(host_table[host_rows[::97]], disk_table[file_rows[::97]]):
                raise SystemExit(f"bench_disk_tier: a {page}-byte move left different bytes on the two sides")
            direction = "host -> disk" if to_file else "disk -> host"
            rows.append(
                f"| {page // KIB} KiB x {file_rows.shape[0]:,} | {direction} | {mine:.2f} | {with_crc:.2f} | {theirs:.2f} "
                f"| {the_file:.2f} | {mine / the_file:.0%} |"
            )
            print(rows[-1], flush=True)
    return rows


def device_table(
    device: CudaPoolMemory, staged: DiskPoolMemory, pageable: DiskPoolMemory, plain_fd: int, repeat: int
) -> list[str]:
    """Half the disk pool's slots (random) <-> random device slots, through pinned and through pageable staging."""
    import cupy

    rows = [
        "| page size | direction | ours (pinned staging) GB/s | pageable staging GB/s | plain file GB/s | ours / plain |",
        "|---|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(2)
    for page in PAGE_SIZES:
        count = staged.nbytes // page
        file_rows = rng.permutation(count)[: count // 2].astype(np.int64)
        device_rows = rng.permutation(device.nbytes // page)[: count // 2].astype(np.int64)
        nbytes = int(file_rows.shape[0]) * page
        contiguous = np.empty(nbytes, dtype=np.uint8)
        for to_file in (True, False):

            def through(disk: DiskPoolMemory) -> Callable[[], None]:
                def run() -> None:
                    if to_file:
                        copy_rows(disk, file_rows, device, device_rows, page)
                    else:
                        copy_rows(device, device_rows, disk, file_rows, page)
                    cupy.cuda.Device().synchronize()

                return run

            def plain() -> None:
                done = os.pwrite(plain_fd, contiguous.data, 0) if to_file else os.preadv(plain_fd, [contiguous.data], 0)
                assert done == nbytes

            mine, former, the_file = (
                nbytes / median_seconds(run, repeat) / 1e9 for run in (through(staged), through(pageable), plain)
            )
            on_device = cupy.asnumpy(cupy.asarray(device.array()).reshape(-1, page)[device_rows[::97]])
            for disk in (staged, pageable):
                if not np.array_equal(disk.host_array().reshape(-1, page)[file_rows[::97]], on_device):
                    raise SystemExit(f"bench_disk_tier: a {page}-byte device move left different bytes on the two sides")
            direction = "device -> disk" if to_file else "disk -> device"
            rows.append(
                f"| {page // KIB} KiB x {file_rows.shape[0]:,} | {direction} | {mine:.2f} | {former:.2f} "
                f"| {the_file:.2f} | {mine / the_file:.0%} |"
            )
            print(rows[-1], flush=True)
    return rows


def device_figures(nbytes: int, pageable: DiskPoolMemory, directory: str, plain_fd: int, repeat: int) -> list[str]:
    """The device table, with a device pool and a disk pool whose moves go through pinned staging (the cuda
    backend's); ``pageable`` has no staging, so its device moves take the former path."""
    import cupy

    device = CudaPoolMemory(nbytes)
    cupy.asarray(device.array())[...] = cupy.random.randint(0, 256, nbytes, dtype=cupy.uint8)
    staged = DiskPoolMemory(nbytes, os.path.join(directory, f"bench_disk_tier-{os.getpid()}-staged.pool"), DiskStaging())
    if not staged.reserve(nbytes):
        raise SystemExit(f"bench_disk_tier: no room for another {nbytes} bytes in {directory}")
    print(f"device pool: {nbytes >> 20} MiB", flush=True)
    try:
        return [f"device pool {nbytes >> 20} MiB:", *device_table(device, staged, pageable, plain_fd, repeat)]
    finally:
        staged.close()
        device.close()


def resume_figures(backend: str, directory: str, plain_fd: int, resume_mib: int, repeat: int) -> list[str]:
    """A suspended request's pages go to the disk tier (another request takes the GPU tier), then it resumes."""
    tokens_per_block, layers, page_half = 16, 8, 64 * KIB
    block_bytes = layers * 2 * page_half
    blocks = max(1, resume_mib * MIB // block_bytes)
    tokens = blocks * tokens_per_block
    config = KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        layers=[AttentionLayerConfig(i, [BufferConfig("key", page_half), BufferConfig("value", page_half)])
                for i in range(layers)],
        cache_tiers=[GpuCacheTierConfig(blocks * block_bytes * 9 // 8),
                     DiskCacheTierConfig(blocks * block_bytes * 5 // 4, directory)],
        max_util_for_resume=1.0,
        backend=backend,
    )
    manager = KVCacheManager(config)
    stream: int | None = None
    finish: Callable[[], None] = lambda: None  # noqa: E731
    if backend == "cuda":
        import cupy

        cuda_stream = cupy.cuda.Stream(non_blocking=True)
        stream, finish = int(cuda_stream.ptr), cuda_stream.synchronize
    request = manager.create_kv_cache()
    assert request.resume(stream) and request.resize(tokens)
    totals: list[float] = []
    returns: list[float] = []
    moved: list[int] = []
    for _ in range(repeat + 1):
        request.suspend()
        other = manager.create_kv_cache()
        assert other.resume(stream) and other.resize(tokens)  # the request's pages go to the disk
        other.close()
        finish()
        before = manager.movement_counters.onboarded_bytes
        start = time.perf_counter()
        assert request.resume(stream)
        returned = time.perf_counter()
        finish()
        totals.append(time.perf_counter() - start)
        returns.append(returned - start)
        moved.append(manager.movement_counters.onboarded_bytes - before)
    request.close()
    manager.shutdown()
    seconds, nbytes = statistics.median(totals[1:]), int(statistics.median(moved[1:]))
    into = np.empty(max(1, nbytes), dtype=np.uint8)
    os.pwrite(plain_fd, into.data, 0)

    def plain() -> None:
        assert os.preadv(plain_fd, [into.data], 0) == into.shape[0]

    plain_seconds = median_seconds(plain, repeat)
    return [
        f"resume of a suspended request with {nbytes / MIB:.0f} MiB on the disk tier ({backend} backend, no host "
        f"tier; {layers} layers, {page_half // KIB} KiB K and V pages): {nbytes / seconds / 1e9:.2f} GB/s, "
        f"{seconds * 1e3:.1f} ms to completion, resume() returned after {statistics.median(returns[1:]) * 1e3:.1f} ms;"
        f" a plain read of as many bytes: {nbytes / plain_seconds / 1e9:.2f} GB/s (ours / plain: "
        f"{plain_seconds / seconds:.0%})",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of each pool in MiB (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per figure (default %(default)s)")
    parser.add_argument("--directory", default=tempfile.gettempdir(), help="where the pool files go")
    parser.add_argument("--resume-mib", type=int, default=256, help="KV bytes of the resumed request")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.repeat < 1 or args.resume_mib < 1:
        parser.error("--mib, --repeat and --resume-mib must be at least 1")
    nbytes = args.mib * MIB
    pinned = cuda_device_available()
    host = PinnedPoolMemory(nbytes) if pinned else HostPoolMemory(nbytes)
    disk = DiskPoolMemory(nbytes, os.path.join(args.directory, f"bench_disk_tier-{os.getpid()}.pool"))
    if not disk.reserve(nbytes):
        raise SystemExit(f"bench_disk_tier: no room for {nbytes} bytes in {args.directory}")
    host.host_array()[...] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    with tempfile.TemporaryFile(dir=args.directory) as plain_file:
        plain_file.truncate(nbytes)
        print(f"host pool: {'pinned (CuPy sees a GPU)' if pinned else 'NumPy'}; files in {args.directory}", flush=True)
        lines = table(host, disk, plain_file.fileno(), args.repeat)
        if pinned:
            lines += ["", *device_figures(nbytes, disk, args.directory, plain_file.fileno(), args.repeat)]
        backend = "cuda" if pinned else "cpu"
        lines += ["", *resume_figures(backend, args.directory, plain_file.fileno(), args.resume_mib, args.repeat)]
    disk.close()
    host.close()
    print("\n".join(["", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
