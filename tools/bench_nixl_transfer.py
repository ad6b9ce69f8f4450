"""The NIXL handoff on loopback: transfer GB/s and per-request latency vs pages per request and page size.

A prefill process (spawned) and this decode process each own a manager with one full-attention layer whose page
(K + V of one block) is the page size; every request is a fresh prompt of ``pages x tokens_per_block`` tokens, so
the decode side holds none of it and every page moves. A request runs the whole protocol of ``KVSender`` /
``KVReceiver``: the decode side's ``prepare_receiver``, the request message, the sender's ``plan_source``, the
decode side's ``complete_plan`` and ONE batched NIXL READ, the notification that releases the sender's pages.
``READ GB/s``: bytes over the READ's own seconds (post to completion, all repeats); ``READ ms`` and ``request
ms`` (the decode side's whole ``receive``: control messages, the sender's cache and planning, the READ): medians.
The bytes are checked: every page of the sender holds its slot number, the decode side compares.

    python tools/bench_nixl_transfer.py [--repeat 10] [--page-kib 16 64 256] [--pages 1 16 256]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCacheManager, KVCacheManagerConfig
from kv_cache_manager_v2.disagg import KVFormat, KVReceiver, KVSender, prepare_receiver

TOKENS_PER_BLOCK = 16
BENCH_FORMAT = KVFormat("uint8", "a byte pattern per page")  # both processes write the same kind of bytes


def config(page_bytes: int, max_pages: int) -> KVCacheManagerConfig:
    buffers = [BufferConfig("key", page_bytes // 2), BufferConfig("value", page_bytes // 2)]
    return KVCacheManagerConfig(
        tokens_per_block=TOKENS_PER_BLOCK,
        layers=[AttentionLayerConfig(0, buffers)],
        cache_tiers=[GpuCacheTierConfig(2 * max_pages * page_bytes + (1 << 20))],
        backend="cpu",
    )


def pool_pages(manager: KVCacheManager, page_bytes: int) -> np.ndarray:
    """The GPU tier's only pool as rows of one page (the cpu backend: host memory)."""
    pool = internals_of(manager).store.pools(0, 0)[0].array()
    assert isinstance(pool, np.ndarray)
    return pool[: pool.size // page_bytes * page_bytes].reshape(-1, page_bytes)


def prompt(request: int, pages: int) -> list[int]:
    return [(request * 7919 + i) % 49_999 + 1 for i in range(pages * TOKENS_PER_BLOCK)]


def sender_process(connection: Connection, page_bytes: int, max_pages: int) -> None:
    """The prefill side: per request a cache of the prompt's pages, each filled with the request's pattern."""
    manager = KVCacheManager(config(page_bytes, max_pages))
    pages = pool_pages(manager, page_bytes)
    pages[:] = (np.arange(len(pages)) % 251).astype(np.uint8)[:, None]  # page s holds s % 251 in every byte
    sender = KVSender(manager, connection, kv_format=BENCH_FORMAT)
    while True:
        request = sender.next_request()
        if request is None:
            break
        cache = manager.create_kv_cache(None, request.tokens)
        assert cache.resume() and cache.resize(len(request.tokens))
        cache.commit(request.tokens)
        sender.send_sources(request, cache)
        sender.wait_released(request)
        cache.close()
    sender.close()
    manager.shutdown()


def measure(page_bytes: int, counts: list[int], repeat: int) -> list[list[str]]:
    """One prefill process per page size; per pages-per-request count: a warm-up request, then ``repeat``."""
    max_pages = max(counts)
    context = multiprocessing.get_context("spawn")
    connection, child_end = context.Pipe()
    process = context.Process(target=sender_process, args=(child_end, page_bytes, max_pages), daemon=True)
    process.start()
    child_end.close()
    manager = KVCacheManager(config(page_bytes, max_pages))
    pages = pool_pages(manager, page_bytes)
    receiver = KVReceiver(manager, connection, kv_format=BENCH_FORMAT)
    rows: list[list[str]] = []
    request = 0
    try:
        for count in counts:
            read_s: list[float] = []
            request_s: list[float] = []
            for round_ in range(repeat + 1):
                tokens = prompt(request, count)
                received = prepare_receiver(manager, tokens)
                assert received is not None
                cache, cached = received
                start = time.perf_counter()
                result = receiver.receive(cache, tokens, cached)
                elapsed = time.perf_counter() - start
                assert result.plan.num_descriptors == count and result.plan.total_bytes == count * page_bytes
                src = np.array([d.src_slot for d in result.plan.descriptors]) % 251
                dst = [d.dst_slot for d in result.plan.descriptors]
                assert bool((pages[dst] == src.astype(np.uint8)[:, None]).all()), "a page arrived with the wrong bytes"
                cache.close()
                request += 1
                if round_ > 0:  # the first request of a count warms up
                    read_s.append(result.seconds)
                    request_s.append(elapsed)
            moved = count * page_bytes * repeat
            rows.append(
                [
                    f"{page_bytes >> 10} KiB",
                    f"{count}",
                    f"{count * page_bytes / (1 << 20):.2f}",
                    f"{moved / sum(read_s) / 1e9:.3f}",
                    f"{statistics.median(read_s) * 1e3:.3f}",
                    f"{statistics.median(request_s) * 1e3:.3f}",
                ]
            )
    finally:
        receiver.close()
        manager.shutdown()
        process.join(30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="requests per cell after one warm-up (default %(default)s)")
    parser.add_argument("--page-kib", type=int, nargs="+", default=[16, 64, 256], help="page sizes in KiB")
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16, 256], help="pages per request")
    args = parser.parse_args()
    headers = ["page", "pages/request", "MiB/request", "READ GB/s", "READ ms (median)", "request ms (median)"]
    rows: list[list[str]] = []
    for page_kib in args.page_kib:
        rows.extend(measure(page_kib << 10, list(args.pages), args.repeat))
    widths = [max(len(header), *(len(row[i]) for row in rows)) for i, header in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for row in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")


if __name__ == "__main__":
    main()
