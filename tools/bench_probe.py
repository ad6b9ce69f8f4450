"""Per-call cost of ``probe_reuse``, the call a longest-prefix-match scheduler (SGLang's LPM policy) makes for every
waiting request at every step (README's "What a probe costs").

The tree: ``--chats`` chats of ``--chat-blocks`` blocks after one ``--system-blocks``-block system prompt (16 tokens a
block; 200 x 20 + 32 = 4,032 cached blocks by default). Each probe is timed as the best of five passes: a prompt
matched in full, one missing at its first block (the token check alone), both as a list and as a NumPy array, and
``probe_reuse_by_tier`` as a list (on this GPU-only manager it walks no block past the match).

    python tools/bench_probe.py                          # this tree, interpreted
    python tools/bench_probe.py --tree ../other          # another checkout, for a same-sitting before/after
    KV_CACHE_MANAGER_V2_MODE=compiled PYTHONPATH=build/compiled python tools/bench_probe.py   # compiled build
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any, Callable

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPB = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=None, help="import kv_cache_manager_v2 from this checkout")
    parser.add_argument("--chats", type=int, default=200)
    parser.add_argument("--chat-blocks", type=int, default=20)
    parser.add_argument("--system-blocks", type=int, default=32)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else REPO)
    from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCacheManager,
                                     KVCacheManagerConfig)

    blocks = args.system_blocks + args.chats * args.chat_blocks
    kv = [BufferConfig("key", TPB * 8), BufferConfig("value", TPB * 8)]
    manager = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=[AttentionLayerConfig(0, kv)],
        cache_tiers=[GpuCacheTierConfig(2 * blocks * 2 * TPB * 8)]))
    rng = random.Random(0)
    system = list(range(1, args.system_blocks * TPB + 1))
    chats = []
    for chat in range(args.chats):
        tokens = system + [10_000 + chat] + [rng.randrange(100, 30_000) for _ in range(args.chat_blocks * TPB - 1)]
        cache = manager.create_kv_cache(input_tokens=tokens)
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens[cache.num_committed_tokens:])
        cache.close()
        chats.append(tokens)
    cached = sum(usage.reusable for usage in manager.get_usage() if usage.level == 0)
    print(f"{cached:,} cached blocks of {TPB} tokens")

    def best_us(probe: Callable[[None, Any], object], tokens: object, calls: int) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                probe(None, tokens)
            best = min(best, (time.perf_counter() - start) / calls)
        return best * 1e6

    # ``probe_reuse_by_tier`` (the same match, split by tier; absent from an older --tree), as a list.
    by_tier: Callable[[None, Any], object] | None = getattr(manager, "probe_reuse_by_tier", None)
    hit = chats[len(chats) // 2]
    cases = [("matched in full", hit), ("missing at once", [77_777] * len(hit)), ("missing at once", [77_777] * 8192)]
    for name, tokens in cases:
        reused = manager.probe_reuse(None, tokens)
        as_list, as_array = best_us(manager.probe_reuse, tokens, 50), best_us(manager.probe_reuse, np.array(tokens), 50)
        split = "" if by_tier is None else f", by tier (list) {best_us(by_tier, tokens, 50):8.1f} us"
        print(f"{len(tokens):>6,} tokens, {name} ({reused:,} reused): list {as_list:8.1f} us, "
              f"NumPy array {as_array:8.1f} us{split}")
    manager.shutdown()


if __name__ == "__main__":
    main()
