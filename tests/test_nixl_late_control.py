"""The prefill side against words that reach it for a request other than the one being waited for: an abort of a
request it has not served yet, and a notification whose request id the decode side used again.

A ``kvm2-done:<id>`` notification or an abort names its request by id alone, so whatever arrives must reach the
request it was sent for, and only that one. The decode side is a spawned child over real NIXL agents and a real
control connection; the prefill side under test is this process.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import pytest

from kv_cache_manager_v2._handoff.control_messages import Request, send
from kv_cache_manager_v2._introspection import receiver_endpoint
from kv_cache_manager_v2 import ReuseScope
from kv_cache_manager_v2.disagg import TransferError, prepare_receiver
from tests.nixl_helpers import DecodeSide, PrefillSide, child_side, prefill, require_nixl, tokens_of

FIRST, SECOND = tokens_of(901, 100), tokens_of(902, 100)


def abandoning_decode_side(connection: Connection) -> None:
    """Requests two prompts, then abandons the second and the first (in that order) before reading either; the
    receiver then closes (bye)."""
    decode = DecodeSide(connection)
    manager, receiver = decode.manager, decode.receiver
    requested = []
    for prompt in (FIRST, SECOND):
        received = prepare_receiver(manager, prompt)
        assert received is not None
        requested.append((received[0], receiver.request(received[0], prompt, received[1])))
    for cache, request_id in reversed(requested):
        assert receiver.abandon(cache, request_id)
    receiver.close()
    decode.leave_without_a_word()


def test_an_abort_of_a_request_queued_while_waiting_for_another_drops_it() -> None:
    """The second request and its abort both arrive while the sender waits for the first one's READ: the request is
    queued for the next ``next_request``, the abort named a request not served yet. Before: the abort was dropped and
    ``next_request`` handed out the abandoned request, whose prefill then ran for nothing and whose ``wait_released``
    held its pages for the whole ``timeout_s`` (nobody would ever READ or abort it again)."""
    require_nixl()
    with child_side(abandoning_decode_side) as side:
        prefill_side = PrefillSide(side.connection)
        sender = prefill_side.sender
        first, cache = prefill_side.serve(send=True)
        assert first.tokens == FIRST
        assert not sender.wait_released(first, timeout_s=30)  # aborted; the second request and its abort came first
        cache.close()
        queued = sender.next_request(timeout_s=30)
        assert queued is None, f"request {queued and queued.request_id} was handed out after the decode side abandoned it"
        prefill_side.close()
        side.connection.close()
        assert side.wait_exit() == 0


def reusing_decode_side(connection: Connection) -> None:
    """Receives one prompt whole (its READ connects the agents), then requests another prompt under the same id and
    notifies that id as done without reading anything, as the first READ's notification would, coming late."""
    decode = DecodeSide(connection)
    manager, receiver = decode.manager, decode.receiver
    received = prepare_receiver(manager, FIRST)
    assert received is not None
    request_id = receiver.request(received[0], FIRST, received[1])
    receiver.read(received[0], request_id)
    received[0].close()
    second = prepare_receiver(manager, SECOND)
    assert second is not None
    peer = receiver_endpoint(receiver).peer
    assert peer is not None
    send(connection, Request(request_id, SECOND, second[1], ReuseScope(), receiver.timeout_s))
    try:
        decode.nixl_agent().send_notif(peer, f"kvm2-done:{request_id}".encode())
    except Exception:  # NIXL's binding errors: the prefill side refused the request and closed its agent already
        pass
    second[0].close()
    decode.leave_without_a_word()


def test_a_request_id_used_again_is_refused_so_a_late_notification_releases_nothing() -> None:
    """Before: ``next_request`` served a request under an id already served; the earlier READ's notification (here
    sent at once) then ended its ``wait_released`` with True though nothing had read the new cache, and the engine
    closed a cache the peer could still READ."""
    require_nixl()
    with child_side(reusing_decode_side) as side:
        prefill_side = PrefillSide(side.connection)
        sender = prefill_side.sender
        first, cache = prefill_side.serve(send=True)
        assert sender.wait_released(first, timeout_s=30)
        cache.close()
        with pytest.raises(TransferError, match=f"request id {first.request_id} was already used"):
            request = sender.next_request(timeout_s=30)
            assert request is not None
            reused = prefill(prefill_side.manager, prefill_side.engine, request)
            reused.commit(request.tokens)
            sender.send_sources(request, reused)
            start = time.monotonic()
            read = sender.wait_released(request, timeout_s=30)
            reused.close()
            pytest.fail(f"request id {request.request_id} served again: wait_released answered {read} after "
                        f"{time.monotonic() - start:.3f} s with nothing read")
        prefill_side.close()
        side.connection.close()
        assert side.wait_exit() == 0
