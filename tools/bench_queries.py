"""Per-call cost of the per-layer page queries an engine makes at every step (ns per call).

An engine asks, per cache, per layer and per buffer (K, V) at every step: the layer's group
(``get_layer_group_id``), the cache's base page indices and scratch descriptor of that group
(``get_base_page_indices``, ``get_scratch_desc``), the buffer's ``PageIndexConverter`` and the converted indices,
and the buffer's base address (``get_mem_pool_base_address``). This times each of them alone, in a tight loop
over every (cache, layer, role), on a realistic model: ``--layers`` layers alternating full attention and a
1,024-token sliding window (two layer groups), K and V each, ``--caches`` active caches of ``--tokens`` tokens.

``--tree DIR`` imports the package from another checkout (e.g. ``/work/main``) to compare trees in one sitting:

    python tools/bench_queries.py                          # this tree, interpreted
    python tools/bench_queries.py --tree ../other --json   # another tree
    KV_CACHE_MANAGER_V2_MODE=compiled PYTHONPATH=build/compiled python tools/bench_queries.py   # compiled build
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=None, help="import kv_cache_manager_v2 from this checkout")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--caches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5, help="best of this many passes per query")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def best_ns_per_call(body: Callable[[], int], repeats: int) -> float:
    """The fastest of ``repeats`` passes of ``body`` (which returns how many calls it made), in ns per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        calls = body()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else REPO)
    import kv_cache_manager_v2 as kvm
    from kv_cache_manager_v2 import (
        AttentionLayerConfig,
        BufferConfig,
        GpuCacheTierConfig,
        KVCacheManager,
        KVCacheManagerConfig,
        PageIndexMode,
    )

    layers = [
        AttentionLayerConfig(
            layer,
            [BufferConfig("key", 4096), BufferConfig("value", 4096)],
            sliding_window_size=1024 if layer % 2 else None,
        )
        for layer in range(args.layers)
    ]
    block_bytes = args.layers * 2 * 4096
    blocks = args.caches * (args.tokens // 32 + 2) * 2
    config = KVCacheManagerConfig(
        tokens_per_block=32, layers=layers, cache_tiers=[GpuCacheTierConfig(block_bytes * blocks)], backend="cpu"
    )
    manager = KVCacheManager(config)
    caches = []
    for seed in range(args.caches):
        tokens = [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(args.tokens)]
        cache = manager.create_kv_cache(None, tokens)
        assert cache.resume() and cache.resize(args.tokens)
        caches.append(cache)
    layer_ids = list(range(args.layers))
    roles = ("key", "value")
    groups = [manager.get_layer_group_id(layer) for layer in layer_ids]
    keys = [(cache, layer, groups[layer], role) for cache in caches for layer in layer_ids for role in roles]
    bases = {(cache.id, group): cache.get_base_page_indices(group) for cache in caches for group in set(groups)}
    converters = {(layer, role): manager.get_page_index_converter(layer, role) for layer in layer_ids for role in roles}
    per_layer = PageIndexMode.PER_LAYER

    def layer_group_id() -> int:
        for _, layer, _, _ in keys:
            manager.get_layer_group_id(layer)
        return len(keys)

    def base_page_indices() -> int:
        for cache, _, group, _ in keys:
            cache.get_base_page_indices(group)
        return len(keys)

    def scratch_desc() -> int:
        for cache, _, group, _ in keys:
            cache.get_scratch_desc(group)
        return len(keys)

    def page_index_converter() -> int:
        for _, layer, _, role in keys:
            manager.get_page_index_converter(layer, role)
        return len(keys)

    def convert_shared() -> int:
        for cache, layer, group, role in keys:
            converters[layer, role](bases[cache.id, group])
        return len(keys)

    def convert_per_layer() -> int:
        for cache, layer, group, role in keys:
            converters[layer, role](bases[cache.id, group], per_layer)
        return len(keys)

    def mem_pool_base_address() -> int:
        for _, layer, _, role in keys:
            manager.get_mem_pool_base_address(layer, role)
        return len(keys)

    def engine_step() -> int:
        """What one engine step asks, all together: one call per cache, layer and role."""
        for cache, layer, _, role in keys:
            group = manager.get_layer_group_id(layer)
            manager.get_page_index_converter(layer, role)(cache.get_base_page_indices(group))
            cache.get_scratch_desc(group)
            manager.get_mem_pool_base_address(layer, role)
        return len(keys)

    queries: dict[str, Callable[[], int]] = {
        "get_layer_group_id": layer_group_id,
        "get_base_page_indices": base_page_indices,
        "get_scratch_desc": scratch_desc,
        "get_page_index_converter": page_index_converter,
        "converter(base) SHARED": convert_shared,
        "converter(base, PER_LAYER)": convert_per_layer,
        "get_mem_pool_base_address": mem_pool_base_address,
        "all of the above (one engine query set)": engine_step,
    }
    gc.collect()
    gc.freeze()
    result = {name: best_ns_per_call(body, args.repeats) for name, body in queries.items()}
    gc.unfreeze()
    for cache in caches:
        cache.close()
    manager.shutdown()
    blocks_per_cache = len(bases[caches[0].id, groups[0]])
    if args.json:
        print(json.dumps({"compiled": kvm.COMPILED, "blocks_per_cache": blocks_per_cache, "ns_per_call": result}))
    else:
        mode = "compiled" if kvm.COMPILED else "interpreted"
        print(f"{mode}, {args.layers} layers x K/V, {args.caches} caches of {blocks_per_cache} blocks: ns per call")
        for name, ns in result.items():
            print(f"  {name:42s} {ns:10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
