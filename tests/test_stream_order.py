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
from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._storage.memory import cuda_device_available
from kv_cache_manager_v2._storage.stream_order import StreamOrder
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.disagg import KVSlice, execute, plan_transfer, prepare_receiver
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
