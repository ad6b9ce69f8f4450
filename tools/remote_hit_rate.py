"""Prefix hit rate of N engine instances with private caches, and with a shared Mooncake remote tier below them.

Requests go round-robin to the instances (a router without prefix affinity: a chat's next turn usually lands on
another instance), one at a time: create the cache (reusing what it can), prefill and decode (bookkeeping only:
no K/V content is written, but the remote tier moves real page bytes through a real Mooncake Store on loopback),
commit prompt and output, close. Every instance has the same private GPU + host quota (in blocks); with
``--remote`` they also share one store (write-through, quota 0: a storage node lends the memory). The hit rate is
reused prompt tokens over all prompt tokens; the ideal is an infinite single cache.

    python tools/remote_hit_rate.py                                   # multi-turn workload, 1/2/4 instances
    python tools/remote_hit_rate.py --trace traces/mooncake_synthetic_trace.jsonl --trace-limit 1000
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Sequence

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
    RemoteTierStatistics,
)
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.sim.mooncake_trace import ideal_hit_rate, load_mooncake_trace
from kv_cache_manager_v2.testing.mooncake_cluster import MooncakeCluster, mooncake_bin_dir
from kv_cache_manager_v2.sim.workload import SimulatedRequest, ideal_prefix_hit_rate, simulator_workload

ROW_BYTES = 4  # per token and buffer: tiny pages, the figures are about which blocks are where


class Run:
    def __init__(self, hit_rate: float, fetched_pages: int, stored_pages: int, failures: int, seconds: float) -> None:
        self.hit_rate = hit_rate
        self.failures = failures
        self.fetched_pages = fetched_pages
        self.stored_pages = stored_pages
        self.seconds = seconds


def make_manager(tpb: int, gpu_blocks: int, host_blocks: int, remote: RemoteCacheTierConfig | None) -> KVCacheManager:
    slot = 2 * 2 * tpb * ROW_BYTES  # two layers, K and V
    layers = [AttentionLayerConfig(i, [BufferConfig("key", tpb * ROW_BYTES), BufferConfig("value", tpb * ROW_BYTES)])
              for i in range(2)]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_blocks * slot), HostCacheTierConfig(host_blocks * slot)]
    if remote is not None:
        tiers.append(remote)
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=tpb, layers=layers, cache_tiers=tiers, backend="cpu"))


def replay(requests: Sequence[SimulatedRequest], instances: int, tpb: int, gpu_blocks: int, host_blocks: int,
           cluster: MooncakeCluster | None) -> Run:
    namespace = f"hit-rate/{uuid.uuid4()}"  # a fresh key space per run: nothing left over from another
    managers = [
        make_manager(tpb, gpu_blocks, host_blocks,
                     None if cluster is None else RemoteCacheTierConfig(0, cluster.config(), namespace=namespace))
        for _ in range(instances)
    ]
    reused = 0
    prompted = 0
    start = time.perf_counter()
    for index, request in enumerate(requests):
        manager = managers[index % instances]
        tokens = request.token_ids()
        prompt = tokens[: request.prompt_length]
        cache = manager.create_kv_cache(input_tokens=prompt)
        done = cache.num_committed_tokens
        reused += done
        prompted += len(prompt)
        assert cache.resume()
        computed = tokens[: len(tokens) - 1]  # the last output token's K/V is never computed
        assert cache.resize(max(len(computed), done)), "a request does not fit one instance's GPU quota"
        cache.commit(computed[done:])
        cache.close()
    seconds = time.perf_counter() - start
    stats = [manager.get_remote_tier_statistics() for manager in managers]
    for manager in managers:
        manager.shutdown()
    fetched = sum(s.fetched_pages for s in stats if isinstance(s, RemoteTierStatistics))
    stored = sum(s.stored_pages for s in stats if isinstance(s, RemoteTierStatistics))
    failures = sum(s.store_failures + s.rejected_pages + s.fetch_failures
                   for s in stats if isinstance(s, RemoteTierStatistics))
    return Run(reused / max(1, prompted), fetched, stored, failures, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", default="1,2,4", help="instance counts to compare (default 1,2,4)")
    parser.add_argument("--trace", help="replay a Mooncake JSONL trace instead of the multi-turn workload")
    parser.add_argument("--trace-limit", type=int, default=1000, help="first N trace requests (default 1000)")
    parser.add_argument("--requests", type=int, default=400, help="multi-turn workload requests (default 400)")
    parser.add_argument("--tokens-per-block", type=int, help="default 32 (multi-turn) or 512 (trace)")
    parser.add_argument("--gpu-blocks", type=int, help="private GPU quota per instance in blocks")
    parser.add_argument("--host-blocks", type=int, help="private host quota per instance in blocks")
    args = parser.parse_args()
    requests: Sequence[SimulatedRequest]
    if args.trace:
        tpb = args.tokens_per_block or 512
        trace = load_mooncake_trace(args.trace, limit=args.trace_limit, closed_loop=True)
        requests, ideal = trace, ideal_hit_rate(trace, tpb)
        gpu_blocks, host_blocks = args.gpu_blocks or 512, args.host_blocks or 1024
        label = f"Mooncake trace, first {len(trace)} requests"
    else:
        tpb = args.tokens_per_block or 32
        workload = simulator_workload(0, args.requests)
        requests, ideal = workload, ideal_prefix_hit_rate(workload, tpb)
        gpu_blocks, host_blocks = args.gpu_blocks or 256, args.host_blocks or 512
        label = f"multi-turn workload, {len(workload)} requests"
    print(f"{label}; {tpb} tokens per block; private quota per instance: {gpu_blocks} GPU + {host_blocks} host "
          f"blocks; ideal (one infinite cache) {ideal:.1%}")
    print(f"{'instances':>9}{'private':>10}{'+ shared':>10}{'fetched':>10}{'stored':>10}{'failures':>10}"
          f"{'s private':>11}{'s shared':>10}")
    cluster = MooncakeCluster(mooncake_bin_dir(), segment_bytes=1 << 30)
    try:
        for instances in (int(part) for part in args.instances.split(",")):
            private = replay(requests, instances, tpb, gpu_blocks, host_blocks, None)
            shared = replay(requests, instances, tpb, gpu_blocks, host_blocks, cluster)
            print(f"{instances:>9}{private.hit_rate:>10.1%}{shared.hit_rate:>10.1%}{shared.fetched_pages:>10}"
                  f"{shared.stored_pages:>10}{shared.failures:>10}{private.seconds:>11.1f}{shared.seconds:>10.1f}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
