"""Prefix hit rate and snapshot memory of a hybrid (attention + SSM) model against ``ssm_reuse_interval`` (SPEC §5).

Runs the simulator's workload on the ``hybrid-ssm`` preset once per interval, content checks on, and counts the
SSM layer groups' cached snapshots from the manager's KV events (stored minus removed; a snapshot moved to another
tier stays counted): the peak over the run and what is left at the end, in pages and MiB.

    python tools/ssm_reuse.py [--intervals 32 128 512] [--requests 32] [--host-mib 768]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kv_cache_manager_v2 import KVCacheManager, SsmLayerConfig  # noqa: E402
from kv_cache_manager_v2.sim.options import SimulatorOptions, build_config  # noqa: E402
from kv_cache_manager_v2.sim.scheduler import Simulation  # noqa: E402
from kv_cache_manager_v2.sim.simulator import build_workload  # noqa: E402

MIB = 1 << 20


class SnapshotCounter:
    """Drains the manager's KV events after every step and tracks cached SSM snapshot pages."""

    def __init__(self, manager: KVCacheManager, ssm_groups: set[int]) -> None:
        self.manager = manager
        self.ssm_groups = ssm_groups
        self.cached = 0
        self.peak = 0

    def __call__(self, finished: int, rejected: int, total: int, step: int) -> None:
        for event in self.manager.get_latest_events():
            if event.layer_group_id not in self.ssm_groups:
                continue
            if event.kind == "stored":
                self.cached += 1
            elif event.kind == "removed":
                self.cached -= 1
        self.peak = max(self.peak, self.cached)


def run(interval: int, requests: int, host_mib: int) -> tuple[float, float, int, int, int]:
    """(hit rate, ideal hit rate, snapshot slot bytes, peak snapshots, snapshots at the end) of one run."""
    options = SimulatorOptions(preset="hybrid-ssm", num_requests=requests, ssm_interval=interval, host_mib=host_mib)
    workload = build_workload(options)
    traced = workload.requests
    config = build_config(options, None, [request.prompt_length + request.output_length for request in traced])
    config = dataclasses.replace(config, enable_kv_events=True, max_kv_events=1 << 20)
    manager = KVCacheManager(config)
    try:
        ssm_layers = {layer.layer_id for layer in config.layers if isinstance(layer, SsmLayerConfig)}
        ssm_groups = {group for group, layers in enumerate(manager.layer_grouping) if layers[0] in ssm_layers}
        counter = SnapshotCounter(manager, ssm_groups)
        simulation = Simulation(options, manager, workload)
        try:
            result = simulation.run(counter)
        finally:
            simulation.close_all()
        slot_bytes = sum(sum(manager.get_slot_bytes(manager.get_pool_group_index(group))) for group in ssm_groups)
        return result.hit_rate, result.ideal_hit_rate, slot_bytes, counter.peak, counter.cached
    finally:
        manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--intervals", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--host-mib", type=int, default=768)
    args = parser.parse_args()
    print(f"hybrid-ssm, {args.requests} requests, tokens_per_block 32, content checks on")
    print(f"{'interval':>8}  {'hit rate':>8}  {'ideal':>6}  {'peak snapshots':>15}  {'at end':>14}")
    for interval in args.intervals:
        hit, ideal, slot_bytes, peak, end = run(interval, args.requests, args.host_mib)
        print(
            f"{interval:>8}  {hit:>8.1%}  {ideal:>6.1%}  {peak:>4} ({peak * slot_bytes / MIB:>7.1f} MiB)"
            f"  {end:>3} ({end * slot_bytes / MIB:>7.1f} MiB)"
        )


if __name__ == "__main__":
    main()
