"""The prefill side keeps a sent cache's pages where the decode side READs them, over real NIXL agents on loopback.

The decode side (a spawned child) READs the sources by address whenever they arrive; until ``wait_released`` says
it is done, a ``close``, ``suspend`` or shrink of the sending cache would give its slots to another request, whose
bytes the READ would then carry. So from ``send_sources`` to the end of ``wait_released`` the cache is held.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import pytest

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2._handoff.nixl_agent import SOURCES_SENT
from kv_cache_manager_v2.disagg import KVReceiver, prepare_receiver
from kv_cache_manager_v2.testing import FakeEngine
from tests.nixl_helpers import child_side, hybrid_config, require_nixl, send_first_request, tokens_of

PROMPT = tokens_of(61, 300)


def decode_side(connection: Connection) -> None:
    """Receive ``PROMPT`` and check every token's KV (the child exits 1 on a wrong page)."""
    manager = KVCacheManager(hybrid_config(8))
    receiver = KVReceiver(manager, connection, timeout_s=30)
    received = prepare_receiver(manager, PROMPT)
    assert received is not None
    cache, counts = received
    receiver.receive(cache, PROMPT, counts)
    FakeEngine(manager).check(cache, PROMPT)
    cache.close()
    receiver.close()
    manager.shutdown()


def test_a_sent_cache_is_held_until_the_decode_side_read_it() -> None:
    require_nixl()
    with child_side(decode_side) as side:
        manager, sender, request, cache = send_first_request(side)
        assert list(cache.held_for) == [SOURCES_SENT]
        indices = list(cache.get_base_page_indices(0))
        for call in (cache.close, cache.suspend, lambda: cache.resize(32, 32)):
            with pytest.raises(RuntimeError, match="NIXL READ may be reading its pages"):
                call()
        assert cache.status.name == "ACTIVE" and list(cache.get_base_page_indices(0)) == indices
        assert sender.wait_released(request, timeout_s=30)
        assert not cache.held_for
        cache.close()
        assert sender.next_request() is None  # the decode side said bye
        assert side.wait_exit() == 0  # it read every page as written
        sender.close()
        manager.check_invariants()
        manager.shutdown()
