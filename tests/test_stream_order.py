"""Slot reuse is ordered across the caches' CUDA streams (``_stream_order.py``).

On the cpu backend a recording ``StreamOrder`` checks the protocol: pages leaving a cache fence its stream, and a
later call waits before its copies run on its own stream. On a GPU the real events keep an eviction copy from
reading a page before the previous owner's stream finished writing it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import numpy as np
import pytest

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager, RemoteCacheTierConfig
from kv_cache_manager_v2._storage.memory import cuda_device_available
from kv_cache_manager_v2._storage.stream_order import StreamOrder
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.disagg import KVSlice, execute, plan_transfer, prepare_receiver
from kv_cache_manager_v2.testing import MemoryStoreConfig
from tests.helpers import KIB, attention, make_config

SLOT = 2 * 4 * KIB  # one layer: K and V of 4 KiB per block


class RecordingOrder(StreamOrder):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def release(self, stream: int) -> None:
        self.calls.append(("release", stream))

    def acquire(self, stream: int) -> None:
        self.calls.append(("acquire", stream))

    def copies_on(self, stream: int) -> ContextManager[object]:
        self.calls.append(("copies", stream))
        return nullcontext()

    def host_access(self) -> ContextManager[object]:
        order = self

        class Recorded:
            def __enter__(self) -> None:
                order.calls.append(("host access", 0))

            def __exit__(self, *exception: object) -> None:
                order.calls.append(("host access done", 0))

        return Recorded()

    def take(self) -> list[tuple[str, int]]:
        calls, self.calls = self.calls, []
        return calls


def recording_manager() -> tuple[KVCacheManager, RecordingOrder]:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(2 * SLOT), HostCacheTierConfig(4 * SLOT)]
    manager = KVCacheManager(make_config([attention(0)], tiers=tiers, max_util_for_resume=1.0))
    order = RecordingOrder()
    internals_of(manager).store.stream_order = order  # the one seam: the backend's StreamOrder
    return manager, order


def test_pages_leaving_a_stream_are_fenced_and_the_next_stream_waits_before_copying() -> None:
    manager, order = recording_manager()
    a = manager.create_kv_cache()
    assert a.resume(11) and a.resize(64)  # both GPU slots, no copies
    assert order.take() == [("acquire", 11), ("acquire", 11)]
    a.suspend()
    assert order.take() == [("release", 11)]

    b = manager.create_kv_cache()
    assert b.resume(22) and b.resize(64)  # evicts a's two pages to the host: copies on stream 22
    assert order.take() == [("acquire", 22), ("acquire", 22), ("copies", 22), ("release", 22)]
    assert manager.movement_counters.offloaded_pages == 2

    b.close()
    assert order.take() == [("release", 22)]
    assert a.resume(11)  # onboards its pages on stream 11, after waiting for 22's fence
    assert order.take() == [("acquire", 11), ("copies", 11), ("release", 11)]

    assert a.resume(33)  # an active cache moving to another stream fences the old one first
    assert order.take() == [("release", 11), ("acquire", 33)]
    a.close()
    manager.shutdown()


def test_pages_an_active_cache_releases_as_stale_fence_its_stream() -> None:
    """An engine that resizes for step N + 1 while step N runs may still be reading the pages that leave the
    window: another stream reusing their slots must wait for that work, so the release fences the stream."""
    manager = KVCacheManager(make_config([attention(0, window=32)], tiers=[GpuCacheTierConfig(16 * SLOT)]))
    order = RecordingOrder()
    internals_of(manager).store.stream_order = order
    a = manager.create_kv_cache()
    assert a.resume(11) and a.resize(64)
    order.take()
    a.commit(list(range(64)))  # block 0 leaves the window
    assert order.take() == [("release", 11), ("acquire", 11)]
    assert a.resize(96)  # nothing leaves: no fence
    assert order.take() == [("acquire", 11)]
    a.close()
    manager.shutdown()


def test_the_remote_tier_touches_device_slots_only_inside_host_access() -> None:
    """The remote tier reads a page it stores (write-through at commit: the engine's stream may still be writing it)
    and writes a page it fetched from the host; neither knows the stream, so both wait for the whole device."""
    store = MemoryStoreConfig()
    orders = []
    managers = []
    for _ in range(2):
        tiers: list[CacheTierConfig] = [GpuCacheTierConfig(8 * SLOT), RemoteCacheTierConfig(0, store, "stream-order")]
        manager = KVCacheManager(make_config([attention(0)], tiers=tiers))
        order = RecordingOrder()
        internals_of(manager).store.stream_order = order
        orders.append(order)
        managers.append(manager)
    prompt = list(range(65))
    writer = managers[0].create_kv_cache(None, prompt)
    assert writer.resume(11) and writer.resize(64)
    orders[0].take()
    writer.commit(prompt[:64])  # two full blocks stored on commit
    calls = orders[0].take()
    assert calls.count(("host access", 0)) == 2 and calls.count(("host access done", 0)) == 2
    first = calls.index(("host access", 0))
    assert calls[first : first + 4] == [("host access", 0), ("acquire", 0), ("copies", 0), ("host access done", 0)]
    writer.close()

    reader = managers[1].create_kv_cache(None, prompt)  # fetches both blocks
    assert reader.num_committed_tokens == 64
    calls = orders[1].take()
    first = calls.index(("host access", 0))
    assert calls[first : first + 4] == [("host access", 0), ("acquire", 0), ("copies", 0), ("host access done", 0)]
    reader.close()
    for manager in managers:
        manager.shutdown()


def test_the_cpu_backend_orders_nothing() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    assert type(internals_of(manager).store.stream_order) is StreamOrder
    manager.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_device_available(), reason="CuPy sees no CUDA device")
def test_an_eviction_copy_waits_for_the_previous_owners_stream() -> None:
    import cupy

    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(2 * SLOT), HostCacheTierConfig(4 * SLOT)]
    manager = KVCacheManager(make_config([attention(0)], tiers=tiers, max_util_for_resume=1.0, backend="cuda"))
    first = cupy.cuda.Stream(non_blocking=True)
    second = cupy.cuda.Stream(non_blocking=True)
    keys = manager.get_page_view(0, "key")
    to_rows = manager.get_page_index_converter(0, "key")
    a = manager.create_kv_cache()
    assert a.resume(first.ptr) and a.resize(64)
    rows = to_rows(a.get_base_page_indices(0))
    with first:  # slow work, then the write the eviction must not overtake
        heavy = cupy.ones((4096, 4096), dtype=cupy.float32)
        for _ in range(20):
            heavy = heavy @ heavy / 4096
        for row in rows:
            keys[row] = 7  # type: ignore[index]
    a.suspend()
    b = manager.create_kv_cache()
    assert b.resume(second.ptr) and b.resize(64)  # a's pages go to the host, copied on `second`
    b.close()
    assert a.resume(first.ptr)  # and come back
    first.synchronize()
    for row in to_rows(a.get_base_page_indices(0)):
        assert np.all(cupy.asnumpy(keys[row]) == 7)  # type: ignore[index]
    a.close()
    manager.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_device_available(), reason="CuPy sees no CUDA device")
def test_write_through_stores_what_the_engines_stream_wrote_not_what_was_there_before() -> None:
    import cupy

    store = MemoryStoreConfig()
    managers = [
        KVCacheManager(make_config([attention(0)], tiers=[GpuCacheTierConfig(8 * SLOT), RemoteCacheTierConfig(0, store, "stream-order")],
                                   backend="cuda"))
        for _ in range(2)
    ]
    engine_stream = cupy.cuda.Stream(non_blocking=True)
    prompt = list(range(65))
    writer = managers[0].create_kv_cache(None, prompt)
    assert writer.resume(engine_stream.ptr) and writer.resize(64)
    keys = managers[0].get_page_view(0, "key")
    to_rows = managers[0].get_page_index_converter(0, "key")
    with engine_stream:  # slow work, then the write the store must not miss
        heavy = cupy.ones((4096, 4096), dtype=cupy.float32)
        for _ in range(20):
            heavy = heavy @ heavy / 4096
        for row in to_rows(writer.get_base_page_indices(0)):
            keys[row] = 7  # type: ignore[index]
    writer.commit(prompt[:64])  # write-through reads both pages now
    writer.close()
    reader = managers[1].create_kv_cache(None, prompt)
    assert reader.num_committed_tokens == 64 and reader.resume()
    read_keys = managers[1].get_page_view(0, "key")
    for row in managers[1].get_page_index_converter(0, "key")(reader.get_base_page_indices(0)):
        assert np.all(cupy.asnumpy(read_keys[row]) == 7)  # type: ignore[index]
    reader.close()
    for manager in managers:
        manager.shutdown()


def test_a_local_handoff_runs_on_the_given_stream_after_both_sides_fences() -> None:
    src, src_order = recording_manager()
    dst, dst_order = recording_manager()
    prompt = list(range(64))
    sender = src.create_kv_cache(None, prompt)
    assert sender.resume(5) and sender.resize(64)
    sender.commit(prompt)
    prepared = prepare_receiver(dst, prompt, cuda_stream=6)
    assert prepared is not None
    receiver, counts = prepared
    plan = plan_transfer(src, sender, dst, receiver, KVSlice(64), counts)
    assert plan.num_descriptors > 0
    src_order.take()
    dst_order.take()
    execute(plan, 7)
    assert src_order.take() == [("acquire", 7), ("acquire", 7), ("release", 7)]
    assert dst_order.take() == [("acquire", 7), ("copies", 7), ("release", 7)]
    again = plan_transfer(src, sender, dst, receiver, KVSlice(64), counts)  # a plan runs once
    dst_order.take()
    execute(again)  # the default: the receiving cache's stream
    assert dst_order.take() == [("acquire", 6), ("copies", 6), ("release", 6)]
    sender.close()
    receiver.close()
