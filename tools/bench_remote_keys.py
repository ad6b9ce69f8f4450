"""What the remote tier's keys cost: lookups and offloads per second through the tier with and without a
``secret_key``, and the per-key work (the chained block key every lookup computes; naming a block in the store:
its hex without a secret, an HMAC of it with one, ``objects.KeySpace.name``).

The store is the in-process ``MemoryStoreConfig`` (no network), so the figures are the tier's own CPU work: block
keys, store keys, framing and checking objects, copies. One full-attention layer group (one key per block), pages
of 1 KiB (where per-key work shows most) and 64 KiB. Per secret setting and page size, best of ``--repeat``:

- offload: one cache commits ``--blocks`` blocks with write-through and closes (each page framed, one batch put);
- miss lookup: ``prefetch_remote`` of those blocks' tokens on an empty store (every block probed, none found);
- hit lookup: ``prefetch_remote`` on a fresh instance sharing the filled store (probed, fetched, checked, installed).

    python tools/bench_remote_keys.py [--blocks 2048] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
import timeit
from typing import Callable

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
)
from kv_cache_manager_v2._base.hashing import block_key, root_key
from kv_cache_manager_v2._remote.objects import KeySpace
from kv_cache_manager_v2.testing import MemoryStoreConfig

TOKENS_PER_BLOCK = 16
SECRET = bytes(range(1, 33))
PAGE_BYTES = {"1 KiB": 1 << 10, "64 KiB": 64 << 10}


def manager(store: MemoryStoreConfig, secret: bytes | None, page_bytes: int, blocks: int) -> KVCacheManager:
    layer = AttentionLayerConfig(0, [BufferConfig("key", page_bytes // 2), BufferConfig("value", page_bytes // 2)])
    remote = RemoteCacheTierConfig(0, store, namespace="bench", secret_key=secret)
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TOKENS_PER_BLOCK, layers=[layer],
        cache_tiers=[GpuCacheTierConfig((blocks + 64) * page_bytes), remote],
    ))


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def one_round(secret: bytes | None, page_bytes: int, blocks: int, seed: int) -> tuple[float, float, float]:
    """Seconds to offload, to miss and to hit ``blocks`` blocks (a prompt of its own each round)."""
    tokens = [seed * 1_000_000 + i for i in range(blocks * TOKENS_PER_BLOCK)]
    empty = manager(MemoryStoreConfig(), secret, page_bytes, blocks)
    miss = timed(lambda: empty.prefetch_remote(None, tokens))
    empty.shutdown()
    store = MemoryStoreConfig()
    writer = manager(store, secret, page_bytes, blocks)
    cache = writer.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))

    def offload() -> None:
        cache.commit(tokens)
        cache.close()

    stored = timed(offload)
    writer.shutdown()
    assert len(store.objects) == blocks, (len(store.objects), blocks)
    reader = manager(store, secret, page_bytes, blocks)
    fetched: list[int] = []
    hit = timed(lambda: fetched.append(reader.prefetch_remote(None, tokens)))
    assert fetched == [len(tokens)], fetched
    reader.shutdown()
    return stored, miss, hit


def per_key_us() -> tuple[float, float, float]:
    """Microseconds per block: its chained block key (SHA-256 of the parent's and its tokens), and its name in the
    store without a secret (hex) and with one (an HMAC-SHA256 from a keyed state copied per key)."""
    tokens = list(range(TOKENS_PER_BLOCK))
    parent = root_key(None)
    digest = block_key(parent, tokens)
    count = 100_000

    def best(run: Callable[[], object]) -> float:
        return min(timeit.repeat(run, number=count, repeat=5)) / count * 1e6

    plain, keyed = KeySpace([], None), KeySpace([], SECRET)
    return best(lambda: block_key(parent, tokens)), best(lambda: plain.name(digest)), best(lambda: keyed.name(digest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    chain, plain, keyed = per_key_us()
    print(f"per block: chained block key {chain:.2f} us; its name: without a secret {plain:.2f} us, with {keyed:.2f} us")
    print(f"{'page':<8}{'secret':<8}{'offload blocks/s':>18}{'miss lookups/s':>16}{'hit lookups/s':>15}")
    seed = 0
    for name, page_bytes in PAGE_BYTES.items():
        for secret in (None, SECRET):
            rounds = []
            for _ in range(args.repeat):
                seed += 1
                rounds.append(one_round(secret, page_bytes, args.blocks, seed))
            best = [min(round_[i] for round_ in rounds) for i in range(3)]
            rates = "".join(f"{args.blocks / seconds:>{width},.0f}" for seconds, width in zip(best, (18, 16, 15)))
            print(f"{name:<8}{'yes' if secret else 'no':<8}{rates}")


if __name__ == "__main__":
    main()
