"""Command line: ``python -m kv_cache_manager_v2 simulate`` (the simulator grows here; SPEC §10)."""

from __future__ import annotations

import argparse
from typing import Sequence

from ._manager import KVCacheManager
from .config import GpuCacheTierConfig, HostCacheTierConfig
from .presets import DEFAULT_PRESET, PRESET_NAMES, preset_config

MIB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kv_cache_manager_v2", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    simulate = commands.add_parser("simulate", help="run a serving simulation on a model preset")
    simulate.add_argument("--preset", choices=PRESET_NAMES, default=DEFAULT_PRESET)
    simulate.add_argument("--gpu-mib", type=int, default=1024, help="GPU tier quota in MiB")
    simulate.add_argument("--host-mib", type=int, default=2048, help="host tier quota in MiB (0: no host tier)")
    simulate.add_argument("--tokens-per-block", type=int, default=32)
    simulate.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto")
    return parser


def describe_layout(manager: KVCacheManager) -> list[str]:
    """Human-readable lines: layer groups, pool groups and slot counts per tier."""
    lines: list[str] = [f"backend: {manager.backend}, tokens per block: {manager.tokens_per_block}"]
    for group_id, layers in enumerate(manager.layer_grouping):
        pool_group = manager.get_pool_group_index(group_id)
        lines.append(f"layer group {group_id}: {len(layers)} layer(s) -> pool group {pool_group}")
    for level in range(manager.num_cache_levels):
        stats = manager.get_storage_statistics(level)
        for pool_group, stat in enumerate(stats):
            slot_bytes = manager.get_slot_bytes(pool_group)
            lines.append(
                f"level {level} pool group {pool_group}: {stat.total} slots of {sum(slot_bytes) // 1024} KiB "
                f"(pools of {[size // 1024 for size in slot_bytes]} KiB)"
            )
    return lines


def run_simulate(args: argparse.Namespace) -> int:
    tiers: list[GpuCacheTierConfig | HostCacheTierConfig] = [GpuCacheTierConfig(args.gpu_mib * MIB)]
    if args.host_mib > 0:
        tiers.append(HostCacheTierConfig(args.host_mib * MIB))
    config = preset_config(args.preset, list(tiers), args.tokens_per_block, args.backend)
    manager = KVCacheManager(config)
    try:
        print(f"preset {args.preset}: planned layout")
        for line in describe_layout(manager):
            print(f"  {line}")
    finally:
        manager.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "simulate":
        return run_simulate(args)
    return 2
