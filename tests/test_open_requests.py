"""The decode side's record of requests still to read (``_handoff/open_requests.py``), without NIXL."""

from __future__ import annotations

import tracemalloc

import pytest

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2._base.hashing import Token
from kv_cache_manager_v2._handoff.control_messages import Failed, TransferError
from kv_cache_manager_v2._handoff.open_requests import OpenRequests
from tests.helpers import attention, make_config


def test_an_answer_to_an_id_handed_out_and_no_longer_open_is_dropped_one_never_handed_out_refused() -> None:
    open_requests = OpenRequests()
    assert [open_requests.new_id(), open_requests.new_id()] == [0, 1]
    assert open_requests.keep_answer(Failed(1, "late"), None) is None  # given up, abandoned or read: dropped
    assert open_requests.keep_answer(Failed(1, "again"), None) is None
    with pytest.raises(TransferError, match="unexpected control message"):
        open_requests.keep_answer(Failed(2, "for a request never sent"), None)
    assert open_requests.kept == 0


def test_requests_given_up_leave_nothing_behind() -> None:
    """Each request abandoned before its answer came, whose answer never comes (the sender dropped it unserved, or
    hangs), leaves no entry. Before: its id stayed in a set until the receiver closed, 20,000 requests kept
    2 MB there ('given-up ids kept 2,097,472 bytes')."""
    manager = KVCacheManager(make_config([attention(0)]))
    tokens: list[Token] = list(range(100))
    cache = manager.create_kv_cache(None, tokens)
    open_requests = OpenRequests()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(20_000):
            request_id = open_requests.new_id()
            open_requests.note(request_id, cache, tokens, [0], 0.0, 0)
            assert open_requests.abandon(request_id, cache)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # Every file: compiled, the record's allocations are traced to this test's line.
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 64 * 1024, f"given-up ids kept {grown:,} bytes"
    assert open_requests.kept == 0
    cache.close()
    manager.shutdown()
