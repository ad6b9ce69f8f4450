"""``MooncakeStore``'s transfers past their deadline, over the fuzzer's in-memory Mooncake client
(``tests/fuzz/stalled_transfers.py``): what a late transfer may touch, and how long ``close`` waits. The same shapes on
the real store: ``tests/test_remote_tier.py``'s stalled-get and stalled-put tests."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

from kv_cache_manager_v2 import RemoteStoreError
from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2._remote.mooncake import MooncakeStore
from tests.fuzz.stalled_transfers import StallingClient, stalling_store


def stalled_get(store: MooncakeStore, client: StallingClient, key: str) -> None:
    buffers: list[HostBuffer] = [np.zeros(4096, dtype=np.uint8)]
    keys = [key]
    client.arm(keys, buffers, put=False)
    with pytest.raises(RemoteStoreError, match="did not answer within get_deadline_s"):
        store.get_batch(keys, buffers)


def test_a_get_past_its_deadline_writes_late_into_a_buffer_that_outlives_a_dropped_store() -> None:
    """An engine dropping its manager without ``shutdown`` drops the store: the buffers it kept for a get left
    inside Mooncake went with it, and the get, once its node answered, wrote into freed memory (here: noted in
    ``problems`` instead)."""
    objects = {"page": bytes(range(256)) * 16}
    store, client = stalling_store(objects)
    stalled_get(store, client, "page")
    del store
    gc.collect()
    client.complete_late()
    assert client.problems == [] and client.stalled_gets == 1


def test_close_waits_a_bounded_time_and_closes_the_client_once_the_transfer_ended() -> None:
    store, client = stalling_store({"page": bytes(4096)})
    stalled_get(store, client, "page")
    start = time.monotonic()
    store.close()
    assert time.monotonic() - start < 0.5 and not client.closed.is_set()
    client.complete_late()
    assert client.closed.wait(5.0) and client.problems == []
