"""Paged attention on a GPU (SPEC §9.1, issue #42): the tensor-core kernel, the CUDA-core kernel it replaces, torch
SDPA (FlashAttention backend) on contiguous K/V of the same shapes, and a device copy of the K/V bytes.

Decode cases: every sequence decodes one token over ``context`` keys scattered over randomly permuted pages (8 kv
heads, head_dim 128; GQA 1/2/4/8 = 8/16/32/64 query heads). Reported: kernel time, split-K factor, K/V bytes read
per second as a fraction of the device's nominal peak DRAM bandwidth and of what a plain read of the same pools
achieves ("read": a streaming kernel that only loads them, the honest ceiling for a kernel that reads K/V once), the
CUDA-core kernel's time ("before"), SDPA flash's time and bandwidth on contiguous ``[batch, kv_heads, context,
head_dim]`` K/V (GQA without copies, ``enable_gqa``), and a device-to-device copy of the pools ("copy r+w": bytes
read plus bytes written per second). Prefill cases: ``chunk`` query tokens per sequence at the end of ``context``
keys, causal. The paged kernels' TFLOP/s count only the (query, key) pairs the causal mask lets through, 4 x
head_dim FLOPs each. SDPA flash has no bottom-right causal mask for a chunk shorter than its keys, so it runs
without a mask over all keys and its TFLOP/s count all pairs; the ratio compares TFLOP/s (the issue's goal: >= 50%
of SDPA's).

    python tools/bench_attention.py [--quick | --sweep] [--no-before] [--cases decode prefill]

``--quick`` covers the issue's table in about a minute on an H200. ``--sweep`` times every tensor-core variant
(``attention_variants.sweep_variants``: pipeline depth, keys per stage, split-K policy, 64- or 128-row prefill
CTAs) on a few representative cases in about a minute, each relative to the current default, to pick the
defaults in ``attention_variants.py``.
Without a GPU (or CuPy) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from kv_cache_manager_v2.kernels.attention import (  # noqa: E402
    AttentionBatch,
    AttentionParams,
    cuda_launch_plan,
    paged_attention_cuda,
)
from kv_cache_manager_v2.kernels.attention_variants import (  # noqa: E402
    VARIANT_ENV,
    default_variant,
    sweep_variants,
)
from tools.cuda_device import cupy_with_device, device_name  # noqa: E402

GB = 1e9
GRAPH_CALLS = 10  # calls per captured CUDA graph for calls shorter than SLOW_CALL
SLOW_CALL = 0.02  # seconds: a call this long is timed on its own (launch overhead is noise there)
NOTES: set[str] = set()  # each note (no graph, no torch, ...) said once
# Peak DRAM bandwidth in GB/s by device name, for drivers that no longer report the memory clock.
KNOWN_PEAKS = {"H100 80GB HBM3": 3352.0, "H100 PCIe": 2039.0, "H200": 4800.0, "A100-SXM4-80GB": 2039.0}


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "prefill"
    num_heads: int
    context: int  # keys per sequence (the last query sits at context - 1)
    batch: int
    chunk: int = 1  # query tokens per sequence
    element_type: str = "float16"
    tokens_per_block: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    def label(self) -> str:
        shape = f"{self.num_heads}/{self.kv_heads}h {self.context // 1024}k x{self.batch}"
        extra = "" if self.element_type == "float16" else " bf16"
        extra += "" if self.tokens_per_block == 32 else f" tpb{self.tokens_per_block}"
        return f"{self.kind} {shape}" + (f" chunk {self.chunk}" if self.kind == "prefill" else "") + extra


def quick_cases() -> list[Case]:
    """The issue's table: decode GQA 1-8 at 8k/32k keys x batch 32/128, bf16, tpb 16/64; two prefill shapes."""
    cases = [
        Case("decode", heads, context, batch)
        for heads in (8, 16, 32, 64)
        for context in (8192, 32768)
        for batch in (32, 128)
    ]
    cases += [
        Case("decode", 32, 8192, 128, element_type="bfloat16"),
        Case("decode", 32, 8192, 128, tokens_per_block=16),
        Case("decode", 32, 8192, 128, tokens_per_block=64),
        Case("prefill", 32, 8192, 4, chunk=2048),
        Case("prefill", 32, 32768, 1, chunk=4096),
    ]
    return cases


def full_cases() -> list[Case]:
    """The quick table plus short contexts and batch 1 (launch and split-K overhead) and a larger prefill."""
    cases = quick_cases()
    cases += [Case("decode", heads, context, 1) for heads in (8, 32, 64) for context in (1024, 8192, 32768)]
    cases += [Case("decode", 32, 1024, batch) for batch in (32, 128)]
    cases += [Case("decode", 32, 32768, 32, element_type="bfloat16"), Case("prefill", 32, 32768, 4, chunk=4096)]
    return cases


def sweep_cases() -> list[Case]:
    """Where the variants should differ: decode GQA 4 at batch 32 (too few items for the SMs) and 128, GQA 1 and 8
    at batch 32, batch 1 and a short context (split-K and launch overhead), and two prefills (GQA 4 and 1)."""
    return [
        Case("decode", 32, 8192, 32),
        Case("decode", 32, 8192, 128),
        Case("decode", 8, 8192, 32),
        Case("decode", 64, 8192, 32),
        Case("decode", 32, 8192, 1),
        Case("decode", 8, 1024, 32),
        Case("prefill", 32, 8192, 2, chunk=2048),
        Case("prefill", 8, 8192, 1, chunk=4096),
    ]


def run_sweep(cupy: ModuleType, case: Case, args: argparse.Namespace, peak: float | None) -> None:
    """One line per variant: its splits, time, K/V GB/s or TFLOP/s, and time relative to the default variant."""
    inputs = Inputs(cupy, case)
    rows = 16 if case.kind == "decode" else 64
    reference = sdpa(cupy, inputs, args.min_seconds)
    sdpa_text = f" | SDPA {reference[0] * 1e6:.1f} us" if reference is not None else ""
    read_gbps = 2 * inputs.pool_bytes / read_seconds(cupy, inputs, args.min_seconds) / GB if rows == 16 else 0.0
    read_text = f" | read-only {read_gbps:.0f} GB/s" if rows == 16 else ""
    print(f"{case.label()}{sdpa_text}{read_text}", flush=True)
    default_seconds = 0.0
    for index, variant in enumerate([default_variant(rows), *sweep_variants(rows)]):
        os.environ[VARIANT_ENV] = variant.env_text()
        try:
            seconds = seconds_per_call(cupy, inputs.paged("tensor_cores"), args.min_seconds)
            plan = cuda_launch_plan(inputs.batch, inputs.params, case.num_heads, case.head_dim, "tensor_cores")
        except Exception as error:  # one broken variant must not cost the rest of a one-shot GPU run
            print(f"  {variant.label():<20} failed: {type(error).__name__}: {error}", flush=True)
            continue
        finally:
            del os.environ[VARIANT_ENV]
        default_seconds = default_seconds or seconds  # (the first variant that ran, normally the default)
        name = f"default ({variant.label()})" if index == 0 else variant.label()
        if case.kind == "decode":
            gbps = inputs.kv_bytes / seconds / GB
            rate = f"{gbps:>6.0f} GB/s " + (f"{100 * gbps / peak:5.1f}%" if peak is not None else "    -")
            rate += f" {100 * gbps / read_gbps:5.1f}% of read"
        else:
            tflops = 4.0 * case.head_dim * causal_pairs(case) / seconds / 1e12
            rate = f"{tflops:>6.1f} TFLOP/s"
            if reference is not None:
                rate += f" = {tflops / (reference[1] / reference[0] / 1e12):.2f} of SDPA's"
        relative = f"x{seconds / default_seconds:.3f} of default"
        if reference is not None:
            relative += f", x{seconds / reference[0]:.2f} of SDPA"
        print(f"  {name:<20} {plan.num_splits:>3} {seconds * 1e6:>10.1f} us {rate}  {relative}", flush=True)
    del inputs
    cupy.get_default_memory_pool().free_all_blocks()


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


def note(text: str) -> None:
    if text not in NOTES:
        NOTES.add(text)
        print(f"  ({text})")


def seconds_per_call(cupy: ModuleType, call: Callable[[], object], min_seconds: float) -> float:
    """GPU time of one call, timed with CUDA events on a side stream: a slow call on its own; a fast one as
    ``GRAPH_CALLS`` calls captured in a CUDA graph (no Python launch gaps), replayed until ``min_seconds`` passed
    (plain back-to-back calls where capture is refused)."""
    cuda = cupy.cuda
    stream = cuda.Stream(non_blocking=True)
    with stream:
        call()  # compile, allocate scratch and upload tables outside the timing
        start, stop = cuda.Event(), cuda.Event()
        start.record(stream)
        call()
        stop.record(stream)
        stop.synchronize()
        single = float(cuda.get_elapsed_time(start, stop)) / 1e3
        if single >= SLOW_CALL:
            return single
        try:
            stream.begin_capture()
            try:
                for _ in range(GRAPH_CALLS):
                    call()
            finally:
                graph = stream.end_capture()  # the stream leaves capture mode even when a call refused it
            replay: Callable[[], object] = lambda: graph.launch(stream)  # noqa: E731
            per_replay = GRAPH_CALLS
        except Exception as error:  # capture unsupported: time plain calls
            note(f"no CUDA graph: {error}; timing includes launch overhead")
            replay, per_replay = call, 1
        replay()
        replays = max(1, int(min_seconds / max(single * per_replay, 1e-6)))
        start.record(stream)
        for _ in range(replays):
            replay()
        stop.record(stream)
        stop.synchronize()
        return float(cuda.get_elapsed_time(start, stop)) / 1e3 / (replays * per_replay)


def torch_seconds_per_call(torch: ModuleType, call: Callable[[], object], min_seconds: float) -> float:
    """``seconds_per_call`` for torch work, on torch's streams and events and with a torch CUDA graph."""
    cuda = torch.cuda
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):  # warm up off the default stream, as graph capture wants
        call()
    cuda.current_stream().wait_stream(side)
    start, stop = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    call()
    stop.record()
    stop.synchronize()
    single = float(start.elapsed_time(stop)) / 1e3
    if single >= SLOW_CALL:
        return single
    try:
        graph = cuda.CUDAGraph()
        with cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                call()
        replay: Callable[[], object] = graph.replay
        per_replay = GRAPH_CALLS
    except RuntimeError as error:
        note(f"no torch CUDA graph: {str(error).splitlines()[0]}; timing includes launch overhead")
        replay, per_replay = call, 1
    replay()
    replays = max(1, int(min_seconds / max(single * per_replay, 1e-6)))
    start.record()
    for _ in range(replays):
        replay()
    stop.record()
    stop.synchronize()
    return float(start.elapsed_time(stop)) / 1e3 / (replays * per_replay)


def causal_pairs(case: Case) -> float:
    """(query, key) pairs the causal mask lets through, over the batch and the query heads."""
    first = case.context - case.chunk
    per_sequence = sum(first + t + 1 for t in range(case.chunk))
    return float(per_sequence) * case.batch * case.num_heads


def random_halves(cupy: ModuleType, rng: Any, count: int, bf16: bool) -> Any:
    """``count`` 16-bit elements (fp16, or bf16 as raw bits) drawn from N(0, 0.25), made in slices so a pool of
    many GiB needs no fp32 copy of itself."""
    out = cupy.empty(count, dtype=cupy.uint16)
    step = 1 << 26
    for start in range(0, count, step):
        size = min(step, count - start)
        values = rng.standard_normal(size, dtype=cupy.float32) * 0.5
        if bf16:  # the top 16 bits of the fp32 value
            out[start : start + size] = (values.view(cupy.uint32) >> 16).astype(cupy.uint16)
        else:
            out[start : start + size] = values.astype(cupy.float16).view(cupy.uint16)
    return out


class Inputs:
    """One case's paged inputs (pages randomly permuted over the pool) and contiguous K/V for torch."""

    def __init__(self, cupy: ModuleType, case: Case) -> None:
        self.case = case
        itemsize = 2
        page_stride = case.tokens_per_block * case.kv_heads * case.head_dim * itemsize
        blocks = -(-case.context // case.tokens_per_block)
        num_pages = case.batch * blocks
        tables = np.random.default_rng(0).permutation(num_pages).astype(np.int32).reshape(case.batch, blocks)
        positions = np.concatenate([np.arange(case.context - case.chunk, case.context)] * case.batch)
        self.batch = AttentionBatch(np.arange(case.batch + 1) * case.chunk, positions, tables)
        self.params = AttentionParams(case.kv_heads, case.tokens_per_block, case.element_type)
        rng = cupy.random.RandomState(0)
        bf16 = case.element_type == "bfloat16"
        self.pages = [
            random_halves(cupy, rng, num_pages * page_stride // 2, bf16).reshape(num_pages, -1).view(cupy.uint8)
            for _ in range(2)
        ]
        shape = (case.batch * case.chunk, case.num_heads, case.head_dim)
        query = random_halves(cupy, rng, int(np.prod(shape)), bf16).reshape(shape)
        self.query = query if bf16 else query.view(cupy.float16)
        self.out = cupy.empty_like(self.query)
        self.pool_bytes = num_pages * page_stride
        self.kv_bytes = 2.0 * case.batch * case.context * case.kv_heads * case.head_dim * itemsize

    def paged(self, kernel: str) -> Callable[[], object]:
        return lambda: paged_attention_cuda(
            self.query, self.pages[0], self.pages[1], self.batch, self.params, out=self.out, kernel=kernel
        )


def sdpa(cupy: ModuleType, inputs: Inputs, min_seconds: float) -> tuple[float, float, str] | None:
    """(seconds, FLOPs counted, mask) of torch SDPA flash on contiguous K/V of the case's shapes; None without
    torch or when the flash backend refuses the shapes."""
    try:  # (imported by name: torch is optional and has no stubs here)
        torch = importlib.import_module("torch")
        attention = importlib.import_module("torch.nn.attention")
    except ImportError:
        note("torch not installed: no SDPA column")
        return None
    case = inputs.case
    dtype = torch.bfloat16 if case.element_type == "bfloat16" else torch.float16
    keys = torch.randn(case.batch, case.kv_heads, case.context, case.head_dim, device="cuda", dtype=dtype)
    values = torch.randn_like(keys)
    query = torch.randn(case.batch, case.num_heads, case.chunk, case.head_dim, device="cuda", dtype=dtype)
    flops = 4.0 * case.head_dim * case.batch * case.num_heads * case.chunk * case.context

    def attend() -> object:
        with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True)

    try:
        seconds = torch_seconds_per_call(torch, attend, min_seconds)
    except RuntimeError as error:
        note(f"SDPA flash refused {case.label()}: {str(error).splitlines()[0]}")
        return None
    finally:
        del keys, values, query
        torch.cuda.empty_cache()
    return seconds, flops, "no mask, all keys"


READ_SOURCE = r"""
extern "C" __global__ void read_pools(const uint4* __restrict__ keys, const uint4* __restrict__ values,
                                      long long vectors, unsigned* __restrict__ sink) {
    unsigned folded = 0;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
#pragma unroll 4
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < vectors; i += stride) {
        const uint4 k = keys[i];
        const uint4 v = values[i];
        folded ^= k.x ^ k.y ^ k.z ^ k.w ^ v.x ^ v.y ^ v.z ^ v.w;
    }
    if (folded == 0x9e3779b9u) {  // (almost) never: only keeps the loads alive
        sink[0] = folded;
    }
}
"""
READ_THREADS = 512
READ_CTAS_PER_SM = 4


def read_seconds(cupy: ModuleType, inputs: Inputs, min_seconds: float) -> float:
    """A streaming read of the K and V pools (each byte loaded once, nothing written): what the device really
    reads per second, the ceiling for a kernel that reads K/V once."""
    function = cupy.RawKernel(READ_SOURCE, "read_pools")
    runtime = cupy.cuda.runtime
    num_sms = int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, runtime.getDevice()))
    sink = cupy.zeros(1, dtype=cupy.uint32)
    vectors = np.int64(inputs.pool_bytes // 16)
    grid = (num_sms * READ_CTAS_PER_SM,)

    def read_both() -> None:
        function(grid, (READ_THREADS,), (inputs.pages[0], inputs.pages[1], vectors, sink))

    return seconds_per_call(cupy, read_both, min_seconds)


def copy_seconds(cupy: ModuleType, inputs: Inputs, min_seconds: float) -> float:
    """A device copy of the K and V pools (the K/V bytes read once and written once)."""
    target = cupy.empty_like(inputs.pages[0])

    def copy_both() -> None:
        target.data.copy_from_device_async(inputs.pages[0].data, inputs.pool_bytes)
        target.data.copy_from_device_async(inputs.pages[1].data, inputs.pool_bytes)

    seconds = seconds_per_call(cupy, copy_both, min_seconds)
    del target
    return seconds


def run_case(cupy: ModuleType, case: Case, args: argparse.Namespace, peak: float | None) -> None:
    inputs = Inputs(cupy, case)
    new = seconds_per_call(cupy, inputs.paged("tensor_cores"), args.min_seconds)
    old = seconds_per_call(cupy, inputs.paged("cuda_cores"), args.min_seconds) if args.before else 0.0
    plan = cuda_launch_plan(inputs.batch, inputs.params, case.num_heads, case.head_dim, "tensor_cores")
    copy = copy_seconds(cupy, inputs, args.min_seconds) if case.kind == "decode" else 0.0
    read = read_seconds(cupy, inputs, args.min_seconds) if case.kind == "decode" else 0.0
    reference = sdpa(cupy, inputs, args.min_seconds)
    line = f"{case.label():<36} {plan.num_splits:>3} {new * 1e6:>10.1f}"
    line += f" {old * 1e6:>10.1f} {old / new:>6.2f}x" if args.before else f" {'-':>10} {'-':>7}"
    if case.kind == "decode":
        gbps = inputs.kv_bytes / new / GB
        read_gbps = 2 * inputs.pool_bytes / read / GB
        fraction = f"{100 * gbps / peak:5.1f}%" if peak is not None else "    -"
        line += f" {gbps:>7.0f} GB/s {fraction} {100 * gbps / read_gbps:5.1f}% of read {read_gbps:>5.0f} GB/s"
        line += f" copy r+w {2 * 2 * inputs.pool_bytes / copy / GB:>5.0f} GB/s"
        if reference is not None:
            seconds = reference[0]
            line += f" | SDPA {seconds * 1e6:>9.1f} us {inputs.kv_bytes / seconds / GB:>5.0f} GB/s x{new / seconds:.2f}"
    else:
        tflops = 4.0 * case.head_dim * causal_pairs(case) / new / 1e12
        line += f" {tflops:>7.1f} TFLOP/s (causal)"
        if reference is not None:
            seconds, flops, mask_name = reference
            sdpa_tflops = flops / seconds / 1e12
            line += f" | SDPA {seconds * 1e3:>7.2f} ms {sdpa_tflops:>6.1f} TFLOP/s ({mask_name})"
            line += f" ratio {tflops / sdpa_tflops:.2f}"
    print(line, flush=True)
    del inputs
    cupy.get_default_memory_pool().free_all_blocks()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the issue's table only (about a minute on an H200)")
    parser.add_argument("--sweep", action="store_true", help="time every tensor-core variant (under a minute)")
    parser.add_argument("--no-before", dest="before", action="store_false", help="skip the CUDA-core kernel")
    parser.add_argument("--cases", nargs="+", choices=["decode", "prefill"], default=["decode", "prefill"])
    parser.add_argument("--min-seconds", type=float, default=None, help="time each fast call at least this long")
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak DRAM bandwidth")
    args = parser.parse_args(argv)
    if args.min_seconds is None:
        args.min_seconds = 0.03 if args.sweep else 0.05 if args.quick else 0.2
    cupy = cupy_with_device("bench_attention")
    if cupy is None:
        return 0
    peak = peak_bandwidth(cupy, args.peak_gbps)
    peak_text = f"{peak:.0f} GB/s" if peak is not None else "unknown (pass --peak-gbps)"
    print(f"{device_name(cupy)}: peak DRAM bandwidth {peak_text}; head_dim 128, fp16 unless said, pages permuted")
    if args.sweep:
        print("variant (s: stages, k: keys per stage, w: split-K waves, x: forced splits)  splits  time  rate")
        for case in sweep_cases():
            if case.kind in args.cases:
                run_sweep(cupy, case, args, peak)
        return 0
    print(
        f"{'case':<36} {'spl':>3} {'new us':>10} {'before us':>10} {'speedup':>7}  decode: K/V GB/s, % of nominal "
        "peak, % of a read-only kernel's GB/s over the same pools, device copy (read + write bytes); prefill: "
        "TFLOP/s | torch SDPA flash on contiguous K/V (decode: x = new time / SDPA time; prefill: ratio of TFLOP/s)"
    )
    cases = quick_cases() if args.quick else full_cases()
    for case in cases:
        if case.kind not in args.cases:
            continue
        try:
            run_case(cupy, case, args, peak)
        except (cupy.cuda.memory.OutOfMemoryError, MemoryError) as error:
            print(f"{case.label():<36} skipped: does not fit in GPU memory ({type(error).__name__})")
            cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
