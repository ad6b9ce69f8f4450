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

from kv_cache_manager_v2 import KVCache
from kv_cache_manager_v2._handoff.nixl_agent import SOURCES_SENT
from kv_cache_manager_v2.disagg import TransferError
from tests.nixl_helpers import DecodeSide, PrefillSide, child_side, require_nixl, tokens_of

PROMPT = tokens_of(61, 300)


def decode_side(connection: Connection) -> None:
    """Receive ``PROMPT`` and check every token's KV (the child exits 1 on a wrong page)."""
    decode = DecodeSide(connection)
    cache, counts = decode.open(PROMPT)
    decode.receiver.receive(cache, PROMPT, counts)
    decode.engine.check(cache, PROMPT)
    cache.close()
    decode.close()


def test_a_sent_cache_is_held_until_the_decode_side_read_it() -> None:
    require_nixl()
    with child_side(decode_side) as side:
        prefill_side = PrefillSide(side.connection)
        request, cache = prefill_side.serve(send=True)
        sender = prefill_side.sender
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
        prefill_side.close()


READ_REFUSED = 3


def late_decode_side(connection: Connection) -> None:
    """Receive one prompt (the agents connect), then request ``PROMPT`` and read it 3 s later. Exits
    ``READ_REFUSED`` when the read is a ``TransferError``, 1 on a wrong page (ContentError), 0 when it arrives
    intact."""
    decode = DecodeSide(connection)
    first = tokens_of(62, 300)
    cache, counts = decode.open(first)
    decode.receiver.receive(cache, first, counts)
    cache.close()
    cache, counts = decode.open(PROMPT)
    request_id = decode.receiver.request(cache, PROMPT, counts)
    time.sleep(3)
    try:
        decode.receiver.read(cache, request_id)
    except TransferError:
        os._exit(READ_REFUSED)
    decode.engine.check(cache, PROMPT)
    cache.close()
    decode.close()


def test_the_pages_of_a_closed_sender_are_never_read() -> None:
    """The prefill side closes its sender while the decode side has yet to READ a request, then reuses the pages
    (its other senders go on serving). Before: ``close`` deregistered the pools and forgot the peer, yet the
    decode side's READ still ran, on the slots since refilled with other prompts: exit 1, 'wrong content at
    positions [0, 1, ...] (300 of 300 checked tokens)'. The closed endpoint's agent is gone now, and the READ
    fails (NIXL_ERR_REMOTE_DISCONNECT)."""
    require_nixl()
    with child_side(late_decode_side) as side:
        prefill_side = PrefillSide(side.connection, gpu_mib=2)
        manager, engine, sender = prefill_side.manager, prefill_side.engine, prefill_side.sender
        for ending in ("read", "closed"):
            request, cache = prefill_side.serve(commit=False, send=True)
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
        prefill_side.close()  # its sender closed already: a second close does nothing


def test_an_interrupted_wait_keeps_the_cache_held() -> None:
    """Ctrl-C lands while the prefill side waits for the decode side's READ. Before: ``wait_released`` released the
    hold on its way out, so the engine could close the cache and give its slots away while the READ was still to
    come (close() succeeded). The cache stays held until a later wait (or the sender's close) says the READ ended."""
    require_nixl()
    with child_side(late_decode_side) as side:
        prefill_side = PrefillSide(side.connection, gpu_mib=8)
        sender = prefill_side.sender
        request, cache = prefill_side.serve(commit=False, send=True)
        assert sender.wait_released(request, timeout_s=30)
        cache.close()
        request, cache = prefill_side.serve(commit=False, send=True)
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
        prefill_side.close()
