"""GPU <-> pinned host page moves against the link (issue #41): GB/s per page size and direction.

Per page size (1 GiB of scattered pages: 16 KiB x 65,536, 128 KiB x 8,192, 1 MiB x 1,024), both directions:
- ours: the manager's own ``copy_rows`` between a ``CudaPoolMemory`` and a ``PinnedPoolMemory`` (random row
  permutations on both sides, as the int64 arrays the page store makes once per run of copies), time to completion
  on a stream; ``launch us`` is how long the call itself took;
- per-page memcpy: one ``cudaMemcpyAsync`` per page on the stream (the alternative for large pages; not run for
  16 KiB pages, where 65,536 Python calls measure only the calls);
- torch: GPU gather + one pinned copy + host scatter (index tensors made outside the timing), where torch is here;
- link: one contiguous pinned copy of the same bytes.
Then a manager-level resume: a suspended request whose pages sit on the host (evicted by another request) comes
back on its stream; GB/s of the onboarded bytes, time to completion, and how long ``resume`` itself took.
Every figure is a median; every move is checked on a sample of pages. About 30-60 s on an H200.

    python tools/bench_offload.py [--repeat 5] [--resume-mib 512]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kv_cache_manager_v2 import (  # noqa: E402
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
)
from kv_cache_manager_v2._storage.memory import CudaPoolMemory, PinnedPoolMemory, copy_rows  # noqa: E402
from tools.cuda_device import cupy_with_device, device_name  # noqa: E402

GIB = 1 << 30
KIB = 1 << 10
PAGE_SIZES = (16 * KIB, 128 * KIB, 1024 * KIB)
PER_PAGE_MEMCPY_FROM = 128 * KIB


def median_seconds(run: Callable[[], None], finish: Callable[[], None], repeat: int) -> tuple[float, float]:
    """Median seconds to completion and median seconds until ``run`` returned, after one warm-up."""
    totals: list[float] = []
    returns: list[float] = []
    for index in range(repeat + 1):
        finish()
        start = time.perf_counter()
        run()
        returned = time.perf_counter()
        finish()
        if index:
            totals.append(time.perf_counter() - start)
            returns.append(returned - start)
    return statistics.median(totals), statistics.median(returns)


class Pools:
    """A 1 GiB device pool and a 1 GiB pinned pool of random bytes, viewed as rows of any page size."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self.device = CudaPoolMemory(GIB)
        self.pinned = PinnedPoolMemory(GIB)
        self.device_bytes: Any = self.cupy.asarray(self.device.array())
        self.device_bytes[...] = cupy.random.randint(0, 256, GIB, dtype=cupy.uint8)
        self.pinned.host_array()[...] = np.random.default_rng(0).integers(0, 256, GIB, dtype=np.uint8)
        self.stream: Any = cupy.cuda.Stream(non_blocking=True)

    def finish(self) -> None:
        self.cupy.cuda.Device().synchronize()

    def check(self, to_host: bool, page: int, dst: list[int], src: list[int]) -> None:
        """A sample of moved pages holds its source's bytes."""
        host = self.pinned.host_array().reshape(-1, page)
        device = self.device_bytes.reshape(-1, page)
        for i in range(0, len(dst), max(1, len(dst) // 16)):
            if to_host:
                same = np.array_equal(host[dst[i]], self.cupy.asnumpy(device[src[i]]))
            else:
                same = np.array_equal(self.cupy.asnumpy(device[dst[i]]), host[src[i]])
            if not same:
                raise SystemExit(f"bench_offload: page {i} of a {page}-byte move holds the wrong bytes")


def ours(pools: Pools, to_host: bool, page: int, dst: list[int], src: list[int]) -> Callable[[], None]:
    dst_ids, src_ids = np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64)

    def run() -> None:
        with pools.stream:
            if to_host:
                copy_rows(pools.pinned, dst_ids, pools.device, src_ids, page)
            else:
                copy_rows(pools.device, dst_ids, pools.pinned, src_ids, page)

    return run


def per_page_memcpy(pools: Pools, to_host: bool, page: int, dst: list[int], src: list[int]) -> Callable[[], None]:
    runtime = pools.cupy.cuda.runtime
    device, host = pools.device.address, pools.pinned.address
    if to_host:
        kind, dst_base, src_base = runtime.memcpyDeviceToHost, host, device
    else:
        kind, dst_base, src_base = runtime.memcpyHostToDevice, device, host

    def run() -> None:
        stream = pools.stream.ptr
        for d, s in zip(dst, src):
            runtime.memcpyAsync(dst_base + d * page, src_base + s * page, page, kind, stream)

    return run


def link(pools: Pools, to_host: bool) -> Callable[[], None]:
    runtime = pools.cupy.cuda.runtime
    device, host = pools.device.address, pools.pinned.address

    def run() -> None:
        if to_host:
            runtime.memcpyAsync(host, device, GIB, runtime.memcpyDeviceToHost, pools.stream.ptr)
        else:
            runtime.memcpyAsync(device, host, GIB, runtime.memcpyHostToDevice, pools.stream.ptr)

    return run


def torch_gather_copy_scatter(
    pools: Pools, to_host: bool, page: int, dst: list[int], src: list[int]
) -> Callable[[], None] | None:
    try:
        torch: Any = importlib.import_module("torch")  # optional, and typed or not depending on the install
    except ImportError:
        return None
    device_rows = torch.from_dlpack(pools.device_bytes).view(-1, page)
    host_rows = torch.from_numpy(pools.pinned.host_array()).view(-1, page)
    device_stage = torch.empty((len(dst), page), dtype=torch.uint8, device=device_rows.device)
    host_stage = torch.empty((len(dst), page), dtype=torch.uint8, pin_memory=True)
    dst_host, src_host = torch.tensor(dst), torch.tensor(src)
    dst_device, src_device = dst_host.to(device_rows.device), src_host.to(device_rows.device)

    def run() -> None:
        if to_host:
            torch.index_select(device_rows, 0, src_device, out=device_stage)
            host_stage.copy_(device_stage, non_blocking=True)
            torch.cuda.synchronize()
            host_rows.index_copy_(0, dst_host, host_stage)
        else:
            torch.index_select(host_rows, 0, src_host, out=host_stage)
            device_stage.copy_(host_stage, non_blocking=True)
            device_rows.index_copy_(0, dst_device, device_stage)
        torch.cuda.synchronize()

    return run


def page_table(pools: Pools, repeat: int) -> list[str]:
    rows = [
        "| page size | direction | ours GB/s | ours launch us | per-page memcpy GB/s | torch GB/s | link GB/s "
        "| ours / link |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(1)
    for page in PAGE_SIZES:
        count = GIB // page
        dst = [int(i) for i in rng.permutation(count)]
        src = [int(i) for i in rng.permutation(count)]
        for to_host in (True, False):
            direction = "GPU -> host" if to_host else "host -> GPU"
            mine, launch = median_seconds(ours(pools, to_host, page, dst, src), pools.finish, repeat)
            pools.check(to_host, page, dst, src)
            the_link, _ = median_seconds(link(pools, to_host), pools.finish, repeat)
            per_page = "-"
            if page >= PER_PAGE_MEMCPY_FROM:
                seconds, _ = median_seconds(per_page_memcpy(pools, to_host, page, dst, src), pools.finish, 2)
                per_page = f"{GIB / seconds / 1e9:.1f}"
            torch_run = torch_gather_copy_scatter(pools, to_host, page, dst, src)
            theirs = "-"
            if torch_run is not None:
                seconds, _ = median_seconds(torch_run, pools.finish, 2)
                theirs = f"{GIB / seconds / 1e9:.1f}"
            rows.append(
                f"| {page // KIB} KiB x {count:,} | {direction} | {GIB / mine / 1e9:.1f} | {launch * 1e6:.0f} "
                f"| {per_page} | {theirs} | {GIB / the_link / 1e9:.1f} | {the_link / mine:.0%} |"
            )
            print(rows[-1], flush=True)
    return rows


def resume_figures(cupy: Any, resume_mib: int, repeat: int) -> list[str]:
    """A suspended request's pages are evicted to the host by another request, then the request resumes."""
    tokens_per_block, layers, page_half = 16, 8, 64 * KIB
    block_bytes = layers * 2 * page_half
    blocks = resume_mib * (1 << 20) // block_bytes
    tokens = blocks * tokens_per_block
    config = KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        layers=[AttentionLayerConfig(i, [BufferConfig("key", page_half), BufferConfig("value", page_half)])
                for i in range(layers)],
        cache_tiers=[GpuCacheTierConfig(blocks * block_bytes * 9 // 8), HostCacheTierConfig(blocks * block_bytes * 5 // 4)],
        max_util_for_resume=1.0,
        backend="cuda",
    )
    manager = KVCacheManager(config)
    stream: Any = cupy.cuda.Stream(non_blocking=True)
    request = manager.create_kv_cache()
    assert request.resume(stream.ptr) and request.resize(tokens)
    totals: list[float] = []
    returns: list[float] = []
    moved: list[int] = []
    for _ in range(repeat + 1):
        request.suspend()
        other = manager.create_kv_cache()
        assert other.resume(stream.ptr) and other.resize(tokens)  # the request's pages go to the host
        other.close()
        cupy.cuda.Device().synchronize()
        before = manager.movement_counters.onboarded_bytes  # a snapshot
        start = time.perf_counter()
        assert request.resume(stream.ptr)
        returned = time.perf_counter()
        stream.synchronize()
        totals.append(time.perf_counter() - start)
        returns.append(returned - start)
        moved.append(manager.movement_counters.onboarded_bytes - before)
    request.close()
    manager.shutdown()
    seconds, nbytes = statistics.median(totals[1:]), statistics.median(moved[1:])
    return [
        f"resume of a suspended request with {nbytes / (1 << 20):.0f} MiB on the host ({layers} layers, "
        f"{page_half // KIB} KiB K and V pages): {nbytes / seconds / 1e9:.1f} GB/s, {seconds * 1e3:.1f} ms to "
        f"completion, resume() returned after {statistics.median(returns[1:]) * 1e3:.1f} ms",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure (default %(default)s)")
    parser.add_argument("--resume-mib", type=int, default=512, help="KV bytes of the resumed request")
    args = parser.parse_args(argv)
    cupy = cupy_with_device("bench_offload")
    if cupy is None:
        return 0
    print(f"device: {device_name(cupy)}", flush=True)
    pools = Pools(cupy)
    lines = page_table(pools, args.repeat)
    lines += ["", *resume_figures(cupy, args.resume_mib, args.repeat)]
    print("\n".join(["", f"device: {device_name(cupy)}", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
