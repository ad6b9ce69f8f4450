"""The prefill side keeps a sent cache's pages where the decode side READs them, over real NIXL agents on loopback.

The decode side (a spawned child) READs the sources by address whenever they arrive; until ``wait_released`` says
it is done, a ``close``, ``suspend`` or shrink of the sending cache would give its slots to another request, whose
bytes the READ would then carry. So from ``send_sources`` to the end of ``wait_released`` the cache is held.
"""

from __future__ import annotations

import _thread
import os
import threading
import time
from multiprocessing.connection import Connection

import pytest

from kv_cache_manager_v2 import KVCache, KVCacheManager
from kv_cache_manager_v2._handoff.nixl_agent import SOURCES_SENT
from kv_cache_manager_v2.disagg import KVReceiver, KVSender, PrefillRequest, TransferError, prepare_receiver
from kv_cache_manager_v2.testing import FakeEngine
from tests.nixl_helpers import FAKE_FORMAT, child_side, hybrid_config, prefill, require_nixl, send_first_request, tokens_of

PROMPT = tokens_of(61, 300)


def decode_side(connection: Connection) -> None:
    """Receive ``PROMPT`` and check every token's KV (the child exits 1 on a wrong page)."""
    manager = KVCacheManager(hybrid_config(8))
    receiver = KVReceiver(manager, connection, timeout_s=30, kv_format=FAKE_FORMAT)
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


READ_REFUSED = 3


def late_decode_side(connection: Connection) -> None:
    """Receive one prompt (the agents connect), then request ``PROMPT`` and read it 3 s later. Exits
    ``READ_REFUSED`` when the read is a ``TransferError``, 1 on a wrong page (ContentError), 0 when it arrives
    intact."""
    manager = KVCacheManager(hybrid_config(8))
    receiver = KVReceiver(manager, connection, timeout_s=30, kv_format=FAKE_FORMAT)
    first = tokens_of(62, 300)
    received = prepare_receiver(manager, first)
    assert received is not None
    receiver.receive(received[0], first, received[1])
    received[0].close()
    received = prepare_receiver(manager, PROMPT)
    assert received is not None
    cache, counts = received
    request_id = receiver.request(cache, PROMPT, counts)
    time.sleep(3)
    try:
        receiver.read(cache, request_id)
    except TransferError:
        os._exit(READ_REFUSED)
    FakeEngine(manager).check(cache, PROMPT)
    cache.close()
    receiver.close()
    manager.shutdown()


def test_the_pages_of_a_closed_sender_are_never_read() -> None:
    """The prefill side closes its sender while the decode side has yet to READ a request, then reuses the pages
    (its other senders go on serving). Before: ``close`` deregistered the pools and forgot the peer, yet the
    decode side's READ still ran, on the slots since refilled with other prompts: exit 1, 'wrong content at
    positions [0, 1, ...] (300 of 300 checked tokens)'. The closed endpoint's agent is gone now, and the READ
    fails (NIXL_ERR_REMOTE_DISCONNECT)."""
    require_nixl()
    with child_side(late_decode_side) as side:
        manager = KVCacheManager(hybrid_config(2))
        engine = FakeEngine(manager)
        sender = KVSender(manager, side.connection, kv_format=FAKE_FORMAT)
        for ending in ("read", "closed"):
            request, cache = serve_next(sender, manager, engine)
            if ending == "read":
                assert sender.wait_released(request, timeout_s=30)
            else:
                sender.close()  # its held cache is released: the pages go to other requests
            cache.close()
        fillers: list[KVCache] = []
        while len(fillers) < 100:
            filler = manager.create_kv_cache()
            if not filler.resume() or not filler.resize(len(PROMPT), 0):
                filler.close()
                break
            engine.step(filler, tokens_of(200 + len(fillers), len(PROMPT)))
            fillers.append(filler)
        assert fillers
        assert side.wait_exit() == READ_REFUSED
        for filler in fillers:
            filler.close()
        manager.check_invariants()
        manager.shutdown()


def serve_next(sender: KVSender, manager: KVCacheManager, engine: FakeEngine) -> tuple[PrefillRequest, KVCache]:
    """Prefill the next request (not published) and send its sources."""
    request = sender.next_request()
    assert request is not None
    cache = prefill(manager, engine, request)
    sender.send_sources(request, cache)
    return request, cache


def test_an_interrupted_wait_keeps_the_cache_held() -> None:
    """Ctrl-C lands while the prefill side waits for the decode side's READ. Before: ``wait_released`` released the
    hold on its way out, so the engine could close the cache and give its slots away while the READ was still to
    come (close() succeeded). The cache stays held until a later wait (or the sender's close) says the READ ended."""
    require_nixl()
    with child_side(late_decode_side) as side:
        manager = KVCacheManager(hybrid_config(8))
        engine = FakeEngine(manager)
        sender = KVSender(manager, side.connection, kv_format=FAKE_FORMAT)
        request, cache = serve_next(sender, manager, engine)
        assert sender.wait_released(request, timeout_s=30)
        cache.close()
        request, cache = serve_next(sender, manager, engine)
        timer = threading.Timer(0.5, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            sender.wait_released(request, timeout_s=30)  # the decode side reads 3 s after its request
        timer.join()
        with pytest.raises(RuntimeError, match="NIXL READ may be reading its pages"):
            cache.close()
        assert sender.wait_released(request, timeout_s=30)
        cache.close()
        assert side.wait_exit() == 0  # it read every page as written
        sender.close()
        manager.check_invariants()
        manager.shutdown()
