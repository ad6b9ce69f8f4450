"""Bytes a prefill -> decode handoff moves vs a naive full-prompt transfer (SPEC §7), Gemma-like preset.

The decode instance has already served a 4k-token prompt (its own prefix cache holds it); the prefill instance
computes an 8k-token prompt that starts with those 4k tokens and hands it over. The naive transfer sends every
block of the prompt for every layer group; the planned one sends only what the receiver lacks: full attention
from its reused 4k prefix on, sliding-window layers only the blocks inside the window at the prompt's end.
Real preset buffer sizes, cpu backend (NumPy reserves the quotas lazily). With ``--check`` (the default) both
sides run the FakeEngine, so the decode side's content check proves every transferred token landed right.

    python tools/disagg_bytes.py [--prompt 8192] [--cached 4096] [--chunk 2048] [--no-check] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager  # noqa: E402
from kv_cache_manager_v2._manager.manager import _KVCache  # noqa: E402
from kv_cache_manager_v2.disagg import KVSlice, cached_tokens_per_layer_group, execute, plan_transfer  # noqa: E402
from kv_cache_manager_v2.sim.presets import preset_config  # noqa: E402
from kv_cache_manager_v2.testing import FakeEngine  # noqa: E402

GIB = 1024**3
MIB = 1024**2
QUOTA = 4 * GIB  # per manager; the cpu backend commits only the pages that are touched


def prompt_tokens(length: int) -> list[int]:
    return [(i * 7919 + 13) % 50_000 for i in range(length)]


def prefill(manager: KVCacheManager, engine: FakeEngine | None, tokens: list[int], chunk: int) -> _KVCache:
    """Chunked prefill with commits after each chunk (as an engine would); the cache stays active."""
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume(), "resume failed"
    while cache.history_length < len(tokens):
        end = min(len(tokens), cache.history_length + chunk)
        assert cache.resize(end, cache.history_length), f"resize to {end} failed"
        if engine is not None:
            engine.step(cache, tokens)
        cache.commit(tokens[cache.num_committed_tokens : end])
    return cache


def measure(prompt_len: int, cached_len: int, chunk: int, check: bool) -> dict[str, object]:
    config = preset_config("gemma", [GpuCacheTierConfig(QUOTA)], backend="cpu")
    sender = KVCacheManager(config)
    receiver = KVCacheManager(preset_config("gemma", [GpuCacheTierConfig(QUOTA)], backend="cpu"))
    src_engine = FakeEngine(sender) if check else None
    dst_engine = FakeEngine(receiver) if check else None
    tokens = prompt_tokens(prompt_len)
    started = time.perf_counter()
    prefill(receiver, dst_engine, tokens[:cached_len], chunk).close()  # the decode side's own earlier request
    src_cache = prefill(sender, src_engine, tokens, chunk)
    # Decode side, SPEC §7 order: own prefix match -> resume -> resize(prompt_len, prompt_len) -> counts.
    dst_cache = receiver.create_kv_cache(None, tokens)
    assert dst_cache.resume() and dst_cache.resize(prompt_len, prompt_len)
    counts = cached_tokens_per_layer_group(dst_cache, prompt_len)
    plan = plan_transfer(sender, src_cache, receiver, dst_cache, KVSlice(prompt_len), counts)
    copy_started = time.perf_counter()
    execute(plan)
    copy_seconds = time.perf_counter() - copy_started
    tokens_checked = 0
    if dst_engine is not None:
        dst_engine.check(dst_cache, tokens)
        tokens_checked = dst_engine.tokens_checked
    total_seconds = time.perf_counter() - started
    tpb = sender.tokens_per_block
    prompt_blocks = -(-prompt_len // tpb)
    rows: list[dict[str, object]] = []
    for group, layers in zip(plan.groups, sender.layer_grouping):
        slot = sum(sender.get_slot_bytes(sender.get_pool_group_index(group.layer_group)))
        rows.append(
            {
                "layer_group": group.layer_group,
                "kind": group.kind,
                "layers": len(layers),
                "slot_bytes": slot,
                "receiver_cached_tokens": group.cached_tokens,
                "naive_blocks": prompt_blocks,
                "naive_bytes": prompt_blocks * slot,
                "planned_blocks": group.num_blocks,
                "planned_bytes": group.num_bytes,
            }
        )
    src_cache.close()
    dst_cache.close()
    sender.shutdown()
    receiver.shutdown()
    return {
        "preset": "gemma",
        "prompt_len": prompt_len,
        "receiver_prefix": cached_len,
        "tokens_per_block": tpb,
        "groups": rows,
        "naive_bytes": sum(int(str(row["naive_bytes"])) for row in rows),
        "planned_bytes": plan.total_bytes,
        "descriptors": plan.num_descriptors,
        "execute_seconds": copy_seconds,
        "content_checked_tokens": tokens_checked,
        "seconds": total_seconds,
    }


def print_table(result: dict[str, object]) -> None:
    rows = result["groups"]
    assert isinstance(rows, list)
    print(
        f"Gemma-like preset, prompt {result['prompt_len']} tokens, receiver holds a {result['receiver_prefix']}-token "
        f"prefix, tokens_per_block {result['tokens_per_block']}"
    )
    header = f"{'layer group':<34} {'cached':>7} {'naive blocks':>12} {'naive MiB':>10} {'planned blocks':>14} {'planned MiB':>11} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for row in rows:
        naive = int(row["naive_bytes"])
        planned = int(row["planned_bytes"])
        name = f"{row['layer_group']}: {row['kind']} x{row['layers']}"
        print(
            f"{name:<34} {row['receiver_cached_tokens']:>7} {row['naive_blocks']:>12} {naive / MIB:>10.1f} "
            f"{row['planned_blocks']:>14} {planned / MIB:>11.1f} {planned / naive:>6.3f}"
        )
    naive_total = int(str(result["naive_bytes"]))
    planned_total = int(str(result["planned_bytes"]))
    print("-" * len(header))
    print(
        f"{'total':<34} {'':>7} {'':>12} {naive_total / MIB:>10.1f} {'':>14} {planned_total / MIB:>11.1f} "
        f"{planned_total / naive_total:>6.3f}"
    )
    print(f"{result['descriptors']} descriptors; execute (cpu backend): {float(str(result['execute_seconds'])):.3f} s")
    checked = int(str(result["content_checked_tokens"]))
    if checked:
        print(f"FakeEngine content check on the decode side: OK ({checked} token records), whole run {float(str(result['seconds'])):.1f} s")
    else:
        print("FakeEngine content check skipped (--no-check)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--cached", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the FakeEngine writes and check")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.prompt, args.cached, args.chunk, args.check)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
