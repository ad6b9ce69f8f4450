"""The bookkeeping benchmark's scheduling loop and model (``tools/bench_manager.py`` describes both and times it).

Kept apart from the benchmark's driver so tests can run the loop on a tiny trace without the subprocesses.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kv_cache_manager_v2 import KVCacheManager
    from kv_cache_manager_v2._manager.manager import _KVCache
    from kv_cache_manager_v2.sim.workload import TraceRequest

TOKENS_PER_BLOCK = 32
GPU_BLOCKS = 20_000
CHUNK = 2048
STEP_BUDGET = 8192
BUFFER_BYTES = 256
SWA_WINDOW = 1024
CONFIGS = ("full", "hybrid")

def make_manager(
    config: str,
    gpu_blocks: int = GPU_BLOCKS,
    tokens_per_block: int = TOKENS_PER_BLOCK,
    max_util_for_resume: float | None = None,
) -> KVCacheManager:
    """The benchmark's manager: ``gpu_blocks`` GPU slots in every pool group, tiny buffers, cpu backend;
    ``max_util_for_resume`` None keeps the manager's default."""
    from kv_cache_manager_v2 import (
        AttentionLayerConfig,
        BufferConfig,
        GpuCacheTierConfig,
        KVCacheManager,
        KVCacheManagerConfig,
    )

    def layer(layer_id: int, window: int | None) -> AttentionLayerConfig:
        buffers = [BufferConfig("key", BUFFER_BYTES), BufferConfig("value", BUFFER_BYTES)]
        return AttentionLayerConfig(layer_id, buffers, sliding_window_size=window)

    if config == "full":
        layers = [layer(0, None)]
    elif config == "hybrid":
        layers = [layer(0, None), layer(1, SWA_WINDOW)]
    else:
        raise ValueError(f"unknown config {config!r}; choose one of {CONFIGS}")
    slot_bytes = 2 * BUFFER_BYTES  # every life cycle here coalesces one K and one V into slots of this size
    config_object = KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        layers=layers,
        cache_tiers=[GpuCacheTierConfig(gpu_blocks * slot_bytes * len(layers))],
        backend="cpu",
    )
    if max_util_for_resume is not None:
        config_object = dataclasses.replace(config_object, max_util_for_resume=max_util_for_resume)  # revalidated
    manager = KVCacheManager(config_object)
    slots = [stat.total for stat in manager.get_storage_statistics(0)]
    if any(count < gpu_blocks for count in slots) or sum(slots) > gpu_blocks * len(layers):
        manager.shutdown()
        raise AssertionError(f"config {config}: GPU slots per pool group {slots}, wanted {gpu_blocks} each")
    return manager


class BenchRequest:
    """A trace request as the scheduler tracks it. It computes ``length`` tokens: the prompt, then one decode
    token per output token but the last. ``prefill_end`` is what it knows when (re-)admitted: the prompt, or after
    a recompute everything up to and including its last generated token."""

    def __init__(self, trace: TraceRequest) -> None:
        self.tokens: list[int] = trace.prompt + trace.output_tokens
        self.prompt_length = trace.prompt_length
        self.length = trace.prompt_length + trace.output_length - 1
        self.prefill_end = self.prompt_length
        self.cache: _KVCache | None = None
        self.computed = 0
        self.target = 0
        self.admitted_once = False


# Manager time by kind of call, named as ../shared/peerbench's driver names them so the two tables line up:
# lookup = probe_reuse; admit = create_kv_cache + resume + the first chunk's resize (or the close of an admission
# that did not fit); prefill = a running request's resize by a later prompt chunk; decode = its resize by one
# token; update = commit; free = close (finished or preempted).
BUCKETS = ("lookup", "admit", "prefill", "decode", "update", "free")


class LoopResult:
    """Counts of one loop; manager time and calls per bucket (``BUCKETS``)."""

    def __init__(self) -> None:
        self.steps = 0
        self.request_steps = 0
        self.manager_ns = 0
        self.bucket_ns = dict.fromkeys(BUCKETS, 0)
        self.calls = dict.fromkeys(BUCKETS, 0)
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.preemptions = 0
        self.finished = 0
        self.max_running = 0

    def add(self, bucket: str, ns: int) -> None:
        self.bucket_ns[bucket] += ns
        self.calls[bucket] += 1

    @property
    def us_per_request_step(self) -> float:
        return self.manager_ns / 1000.0 / self.request_steps if self.request_steps else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_loop(
    manager: KVCacheManager,
    trace: list[TraceRequest],
    max_running: int,
    chunk: int = CHUNK,
    step_budget: int = STEP_BUDGET,
    clock: Callable[[], int] = time.perf_counter_ns,
    after_step: Callable[[], None] | None = None,
) -> LoopResult:
    """Replay ``trace`` through the vLLM-like loop (module docstring); only manager calls are timed."""
    result = LoopResult()
    waiting: list[BenchRequest] = [BenchRequest(request) for request in trace]
    waiting.reverse()  # a stack: the FCFS head is at the end, a preempted request goes back on top
    running: list[BenchRequest] = []
    scheduled: list[BenchRequest] = []
    while waiting or running:
        result.steps += 1
        if result.steps > 100 * len(trace) + 1000:
            raise RuntimeError("the scheduling loop made no progress")
        budget = step_budget
        scheduled.clear()
        preempted = False
        # Running requests first, in admission order.
        position = 0
        while position < len(running) and budget > 0:
            request = running[position]
            cache = request.cache
            assert cache is not None
            if request.computed < request.prefill_end:
                count = min(request.prefill_end - request.computed, chunk, budget)
                bucket = "prefill"
            else:
                count = 1
                bucket = "decode"
            request.target = request.computed + count
            start = clock()
            ok = cache.resize(request.target)
            result.add(bucket, clock() - start)
            while not ok:
                victim = running.pop()  # the most recently admitted
                victim_cache = victim.cache
                assert victim_cache is not None
                start = clock()
                victim_cache.close()
                result.add("free", clock() - start)
                victim.cache = None
                if victim.computed >= victim.prompt_length:
                    victim.prefill_end = victim.computed + 1
                victim.computed = 0
                waiting.append(victim)
                result.preemptions += 1
                preempted = True
                if victim is request:
                    break
                start = clock()
                ok = cache.resize(request.target)
                result.add(bucket, clock() - start)
            if not ok:
                break
            scheduled.append(request)
            budget -= count
            position += 1
        # Then waiting requests, FCFS, unless this step had to preempt.
        while not preempted and waiting and len(running) < max_running and budget > 0:
            request = waiting[-1]
            tokens = request.tokens[: request.prefill_end - 1]
            start = clock()
            hit = manager.probe_reuse(None, tokens)
            result.add("lookup", clock() - start)
            start = clock()
            cache = manager.create_kv_cache(None, tokens)
            ok = cache.resume()
            admit_ns = clock() - start
            if ok:
                reused = cache.num_committed_tokens
                count = min(request.prefill_end - hit, chunk, budget)
                request.target = min(reused + count, request.prefill_end)
                start = clock()
                ok = cache.resize(request.target)
                admit_ns += clock() - start
            if not ok:
                start = clock()
                cache.close()
                admit_ns += clock() - start
            result.add("admit", admit_ns)
            if not ok:
                break
            waiting.pop()
            request.cache = cache
            request.computed = reused
            if not request.admitted_once:
                request.admitted_once = True
                result.prompt_tokens += request.prompt_length
                result.hit_tokens += reused
            running.append(request)
            scheduled.append(request)
            budget -= count
        result.max_running = max(result.max_running, len(running))
        result.request_steps += len(scheduled)
        # The model runs; its tokens are committed; finished requests close.
        finished = False
        for request in scheduled:
            cache = request.cache
            assert cache is not None
            new_tokens = request.tokens[request.computed : request.target]
            start = clock()
            cache.commit(new_tokens)
            result.add("update", clock() - start)
            request.computed = request.target
            if request.computed == request.length:
                start = clock()
                cache.close()
                result.add("free", clock() - start)
                request.cache = None
                result.finished += 1
                finished = True
        if finished:
            running = [request for request in running if request.cache is not None]
        if after_step is not None:
            after_step()
    result.manager_ns = sum(result.bucket_ns.values())
    return result


# ------------------------------------------------------------------------------------------ one measurement
