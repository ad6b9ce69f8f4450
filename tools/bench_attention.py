"""Decode paged attention bandwidth on a GPU (SPEC §9.1): bytes of K/V read per second, next to the peak.

For each context length x batch size, every sequence decodes one token over ``context`` keys scattered over
randomly permuted pages (Llama-3-8B-like layer by default: 32 query heads, 8 kv heads, head_dim 128, fp16,
tokens_per_block 32). Reported per case: kernel time, split-K factor, K/V bytes read / time in GB/s, that as a
fraction of the device's peak DRAM bandwidth, a CuPy device-to-device copy of the same bytes (its read + write
traffic / time, the practical ceiling), and the baseline an engine without paged kernels would run: dense
attention of the same shapes in CuPy (cuBLAS batched matrix products and a softmax over contiguous K/V,
fp16/fp32 only). The goal is >= 80% of peak at 8k keys and longer.

    python tools/bench_attention.py [--contexts 1024 8192 32768] [--batches 1 32 128] [--element-type float16]

Without a GPU (or CuPy) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from kv_cache_manager_v2.kernels.attention import (  # noqa: E402
    AttentionBatch,
    AttentionParams,
    cuda_launch_plan,
    paged_attention_cuda,
)
from tools.cuda_device import cupy_with_device, device_name  # noqa: E402

GB = 1e9
MIN_SECONDS = 0.2  # time each case at least this long
GRAPH_CALLS = 20  # calls per captured CUDA graph
UNCAPTURED: set[str] = set()  # why capture failed, each said once
# Peak DRAM bandwidth in GB/s by device name, for drivers that no longer report the memory clock.
KNOWN_PEAKS = {"H100 80GB HBM3": 3352.0, "H100 PCIe": 2039.0, "H200": 4800.0, "A100-SXM4-80GB": 2039.0}


def peak_bandwidth(cupy: ModuleType, override: float | None) -> float | None:
    """GB/s: 2 (double data rate) x memory clock x bus width, or the name table, or ``--peak-gbps``."""
    if override is not None:
        return override
    runtime = cupy.cuda.runtime
    device = runtime.getDevice()
    try:
        clock_khz = int(runtime.deviceGetAttribute(runtime.cudaDevAttrMemoryClockRate, device))
        bus_bits = int(runtime.deviceGetAttribute(runtime.cudaDevAttrGlobalMemoryBusWidth, device))
        if clock_khz > 0 and bus_bits > 0:
            return 2.0 * clock_khz * 1e3 * bus_bits / 8 / GB
    except Exception:  # CUDA 13 dropped the memory clock attribute on some drivers
        pass
    name = runtime.getDeviceProperties(device)["name"].decode()
    return next((peak for key, peak in KNOWN_PEAKS.items() if key in name), None)


def seconds_per_call(cupy: ModuleType, call: Callable[[], object]) -> float:
    """GPU time of one call: ``GRAPH_CALLS`` calls captured in a CUDA graph (no Python launch gaps between
    kernels), replayed until ``MIN_SECONDS`` have passed, timed with CUDA events. Falls back to timing plain
    back-to-back calls (launch overhead included) where capture is unsupported."""
    cuda = cupy.cuda
    stream = cuda.Stream(non_blocking=True)
    with stream:
        call()  # compile, allocate scratch and upload tables outside the capture
        stream.synchronize()
        try:
            stream.begin_capture()
            try:
                for _ in range(GRAPH_CALLS):
                    call()
            finally:
                graph = stream.end_capture()  # the stream leaves capture mode even when a call refused it
            replay: Callable[[], object] = lambda: graph.launch(stream)  # noqa: E731
            per_replay = GRAPH_CALLS
        except Exception as error:  # capture unsupported (CuPy's cuBLAS calls refuse it): time plain calls
            if str(error) not in UNCAPTURED:
                UNCAPTURED.add(str(error))
                print(f"  (no CUDA graph: {error}; timing includes launch overhead)")
            replay, per_replay = call, 1
        replay()
        start, stop = cuda.Event(), cuda.Event()
        replays, elapsed = 1, 0.0
        while True:
            start.record(stream)
            for _ in range(replays):
                replay()
            stop.record(stream)
            stop.synchronize()
            elapsed = float(cuda.get_elapsed_time(start, stop)) / 1e3
            if elapsed >= MIN_SECONDS:
                return elapsed / (replays * per_replay)
            replays *= 16 if elapsed == 0 else max(2, min(16, int(MIN_SECONDS / elapsed) + 1))


def bench_case(cupy: ModuleType, args: argparse.Namespace, context: int, batch_size: int) -> dict[str, float]:
    """One decode step of ``batch_size`` sequences at ``context`` keys each, and a copy of the same pools."""
    params = AttentionParams(args.kv_heads, args.tokens_per_block, args.element_type)
    itemsize = 4 if args.element_type == "float32" else 2
    page_stride = args.tokens_per_block * args.kv_heads * args.head_dim * itemsize
    blocks = -(-context // args.tokens_per_block)
    num_pages = batch_size * blocks
    tables = np.random.default_rng(0).permutation(num_pages).astype(np.int32).reshape(batch_size, blocks)
    batch = AttentionBatch(np.arange(batch_size + 1), np.full(batch_size, context - 1), tables)
    # Every 16-bit element 0.1 (fp16 0x2E66, bf16 0x3DCD; tiny fp32 values): the traffic does not depend on it.
    pattern = 0x3DCD if args.element_type == "bfloat16" else 0x2E66
    pages = [cupy.full((num_pages, page_stride // 2), pattern, dtype=cupy.uint16).view(cupy.uint8) for _ in range(2)]
    shape = (batch_size, args.num_heads, args.head_dim)
    query = cupy.full(shape, pattern, dtype=cupy.uint16)
    if args.element_type == "float32":
        query = cupy.full(shape, 0.1, dtype=cupy.float32)
    elif args.element_type == "float16":
        query = query.view(cupy.float16)
    out = cupy.empty_like(query)
    attention = seconds_per_call(
        cupy, lambda: paged_attention_cuda(query, pages[0], pages[1], batch, params, out=out)
    )
    target = cupy.empty_like(pages[0])
    pool_bytes = num_pages * page_stride

    def copy_both() -> None:
        target.data.copy_from_device_async(pages[0].data, pool_bytes)
        target.data.copy_from_device_async(pages[1].data, pool_bytes)

    copy = seconds_per_call(cupy, copy_both)
    del pages, target
    kv_bytes = 2.0 * batch_size * context * args.kv_heads * args.head_dim * itemsize
    dense = dense_seconds(cupy, args, context, batch_size)
    return {
        "seconds": attention,
        "bytes": kv_bytes,
        "gbps": kv_bytes / attention / GB,
        "copy_gbps": 2.0 * (2 * pool_bytes) / copy / GB,  # read + write of both pools
        "dense_gbps": kv_bytes / dense / GB if dense > 0 else 0.0,
        "splits": float(cuda_launch_plan(batch, params, args.num_heads, args.head_dim).num_splits),
    }


def dense_seconds(cupy: ModuleType, args: argparse.Namespace, context: int, batch_size: int) -> float:
    """GPU time of one decode step as dense CuPy attention over contiguous ``[batch, kv_heads, context, head_dim]``
    K/V: scores by cuBLAS, an fp32 softmax, values by cuBLAS; 0.0 for bf16, which CuPy's matmul does not take."""
    if args.element_type == "bfloat16":
        return 0.0
    dtype = cupy.float16 if args.element_type == "float16" else cupy.float32
    group = args.num_heads // args.kv_heads
    keys = cupy.full((batch_size, args.kv_heads, context, args.head_dim), 0.1, dtype=dtype)
    values = cupy.full_like(keys, 0.1)
    query = cupy.full((batch_size, args.kv_heads, group, args.head_dim), 0.1, dtype=dtype)
    scale = 1.0 / float(np.sqrt(args.head_dim))

    def attend() -> object:
        scores = cupy.matmul(query, keys.transpose(0, 1, 3, 2)).astype(cupy.float32) * scale
        weights = cupy.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        return cupy.matmul(weights.astype(dtype), values)

    return seconds_per_call(cupy, attend)


def dense_text(result: dict[str, float]) -> str:
    """The dense baseline's columns: its bandwidth and how many times faster the paged kernel is."""
    if result["dense_gbps"] <= 0:
        return f"{'-':>10} {'-':>8}"
    return f"{result['dense_gbps']:>10.0f} {result['gbps'] / result['dense_gbps']:>7.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--element-type", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak DRAM bandwidth")
    args = parser.parse_args(argv)
    cupy = cupy_with_device("bench_attention")
    if cupy is None:
        return 0
    name = device_name(cupy)
    peak = peak_bandwidth(cupy, args.peak_gbps)
    peak_text = f"{peak:.0f} GB/s" if peak is not None else "unknown (pass --peak-gbps)"
    print(
        f"{name}: peak DRAM bandwidth {peak_text}; {args.element_type}, {args.num_heads} heads / {args.kv_heads} "
        f"kv heads, head_dim {args.head_dim}, tokens_per_block {args.tokens_per_block}"
    )
    print(
        f"{'context':>8} {'batch':>6} {'splits':>6} {'KV MiB':>9} {'time us':>9} {'GB/s':>7} {'% peak':>7} "
        f"{'copy GB/s':>9} {'% copy':>7} {'dense GB/s':>10} {'vs dense':>8}"
    )
    for context in args.contexts:
        for batch_size in args.batches:
            try:
                result = bench_case(cupy, args, context, batch_size)
            except cupy.cuda.memory.OutOfMemoryError:
                print(f"{context:>8} {batch_size:>6}  skipped: does not fit in GPU memory")
                continue
            fraction = f"{100 * result['gbps'] / peak:6.1f}%" if peak is not None else "      -"
            print(
                f"{context:>8} {batch_size:>6} {int(result['splits']):>6} {result['bytes'] / 2**20:>9.1f} "
                f"{result['seconds'] * 1e6:>9.1f} {result['gbps']:>7.0f} {fraction} {result['copy_gbps']:>9.0f} "
                f"{100 * result['gbps'] / result['copy_gbps']:6.1f}% {dense_text(result)}"
            )
            cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
