"""Mooncake Store on loopback (tcp), as the remote tier uses it: batched put/get GB/s and per-page latency.

Starts ``mooncake_master`` and one storage node (``kv_cache_manager_v2.testing.mooncake_cluster``), connects one
client lending no memory (as the managers do) and moves page objects through ``MooncakeStore`` (zero-copy
``batch_put_from`` / ``batch_get_into`` on NumPy arrays), checking every byte read back. For comparison it also
times the bytes API (``put`` / ``get``) the issue measured. Page sizes: a SmolLM2-135M block of 32 tokens
(30 layers x K/V x 3 heads x 64 x fp16 = 1.4 MiB), a 64 KiB page and a 16 MiB object.

    python tools/bench_remote_store.py [--pages 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from kv_cache_manager_v2 import MooncakeStoreConfig
from kv_cache_manager_v2._remote.mooncake import MooncakeStore
from kv_cache_manager_v2.testing.mooncake_cluster import MooncakeCluster, mooncake_bin_dir

SIZES = {"64 KiB page": 64 << 10, "SmolLM2 block (1.4 MiB)": 30 * 2 * 3 * 64 * 2 * 32, "16 MiB object": 16 << 20}


def batch_figures(store: MooncakeStore, size: int, pages: int, repeat: int, tag: str) -> tuple[float, float]:
    """GB/s of one batch put and one batch get of ``pages`` objects (best of ``repeat``), bytes checked."""
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(pages)]
    targets = [np.empty(size, dtype=np.uint8) for _ in range(pages)]
    put_s: list[float] = []
    get_s: list[float] = []
    for round_ in range(repeat):
        keys = [f"bench/{tag}/{round_}/{i}" for i in range(pages)]
        start = time.perf_counter()
        stored = store.put_batch(keys, sources)
        put_s.append(time.perf_counter() - start)
        assert all(stored), "the store refused pages: give the storage node more memory"
        start = time.perf_counter()
        lengths = store.get_batch(keys, targets)
        get_s.append(time.perf_counter() - start)
        assert lengths == [size] * pages
        assert all(np.array_equal(a, b) for a, b in zip(sources, targets))
        store.remove_batch(keys)
    total = size * pages / 1e9
    return total / min(put_s), total / min(get_s)


def page_latency(store: MooncakeStore, size: int, trials: int, tag: str) -> tuple[float, float, float]:
    """Median ms of one single-page put, get and exists round trip."""
    page = np.ones(size, dtype=np.uint8)
    back = np.empty(size, dtype=np.uint8)
    put_ms: list[float] = []
    get_ms: list[float] = []
    exists_ms: list[float] = []
    for trial in range(trials):
        key = f"latency/{tag}/{trial}"
        start = time.perf_counter()
        store.put_batch([key], [page])
        put_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        store.get_batch([key], [back])
        get_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        store.exists_batch([key])
        exists_ms.append((time.perf_counter() - start) * 1e3)
        store.remove_batch([key])
    return statistics.median(put_ms), statistics.median(get_ms), statistics.median(exists_ms)


def bytes_api(client: Any, size: int, pages: int) -> tuple[float, float]:
    """GB/s of ``put(key, bytes)`` / ``get(key)`` one object at a time (the Python bytes copies included)."""
    payload = np.ones(size, dtype=np.uint8).tobytes()
    start = time.perf_counter()
    for i in range(pages):
        assert client.put(f"bytes/{size}/{i}", payload) == 0
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(pages):
        assert len(client.get(f"bytes/{size}/{i}")) == size
    get_s = time.perf_counter() - start
    client.batch_remove([f"bytes/{size}/{i}" for i in range(pages)], True)
    total = size * pages / 1e9
    return total / put_s, total / get_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=16, help="objects per batch (default 16)")
    parser.add_argument("--repeat", type=int, default=3, help="batches per size, best taken (default 3)")
    parser.add_argument("--trials", type=int, default=50, help="single-page round trips per size (default 50)")
    args = parser.parse_args()
    cluster = MooncakeCluster(mooncake_bin_dir(), segment_bytes=1 << 30)
    try:
        config: MooncakeStoreConfig = cluster.config()
        config.local_buffer_size = 64 << 20
        store = config.open(0)
        assert isinstance(store, MooncakeStore)
        from mooncake.store import MooncakeDistributedStore

        raw: Any = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", cluster.metadata_url, 0, 64 << 20, "tcp", "", cluster.master_address) == 0
        print(f"{'object':<26}{'batch':>6}{'put GB/s':>10}{'get GB/s':>10}{'bytes put':>11}{'bytes get':>11}"
              f"{'put ms':>8}{'get ms':>8}{'exists ms':>10}")
        for name, size in SIZES.items():
            pages = max(1, min(args.pages, (512 << 20) // size))
            put_rate, get_rate = batch_figures(store, size, pages, args.repeat, name)
            bytes_put, bytes_get = bytes_api(raw, size, pages)
            put_ms, get_ms, exists_ms = page_latency(store, size, args.trials, name)
            print(f"{name:<26}{pages:>6}{put_rate:>10.2f}{get_rate:>10.2f}{bytes_put:>11.2f}{bytes_get:>11.2f}"
                  f"{put_ms:>8.2f}{get_ms:>8.2f}{exists_ms:>10.2f}")
        store.close()
        raw.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
