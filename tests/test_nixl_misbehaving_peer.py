"""The NIXL handoff against a peer that misbehaves or is gone, over real NIXL agents and a real control connection.

The misbehaving side is a spawned child that does a genuine handshake (``KVSender`` / ``KVReceiver``), then writes
bytes of its own on the control connection or sends a malformed NIXL notification; the side under test is this
process. Whatever arrives, the answer is a ``TransferError`` (on either side), a receiving cache closed, and no
code run from the bytes: control messages are checked JSON, never pickles.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from kv_cache_manager_v2._introspection import receiver_endpoint, sender_endpoint
from kv_cache_manager_v2 import KVCacheManager, ReuseScope
from kv_cache_manager_v2._handoff.control_messages import Failed, Request, receive, send
from kv_cache_manager_v2._handoff.nixl_agent import NixlAgent
from kv_cache_manager_v2.disagg import KVReceiver, KVSender, TransferError, prepare_receiver
from tests.nixl_helpers import (
    FAKE_FORMAT, DecodeSide, PrefillSide, child_side, fake_prefill_side, hybrid_config, require_nixl, tokens_of,
    wait_for_the_end,
)
from tests.test_nixl_unfinished_read import StuckReadAgent

# A pickle that, unpickled, creates the directory it names (protocol 0 by hand: ``os.mkdir(path)``).
def mkdir_pickle(path: str) -> bytes:
    return b"cos\nmkdir\n(" + pickle.dumps(path, protocol=0)[:-1] + b"tR."


BROKEN_PICKLE = b"\x80\x05\x95garbage"
# Well-formed JSON, one field out of range: a source slot below 0.
NEGATIVE_SLOT = json.dumps(
    {
        "kind": "sources",
        "id": 0,
        "extra": None,
        "plan": {
            "prompt_len": 100,
            "token_range": [0, 100],
            "tokens_per_block": 32,
            "groups": [],
            "sources": {
                "layer_group": [1],
                "block": [0],
                "pool_group": [0],
                "pool": [0],
                "src_slot": [-1],
                "num_bytes": [4096],
                "src_address": [0],
            },
            "prompt_key": "",
        },
    }
).encode()


UNKNOWN_NOTIFICATIONS = 200
BAD_REQUEST_ID = 999
NOTIFYING_ACTS = ("bad_notification", "unknown_notifications")


def rogue_decode_side(connection: Connection, act: str, marker: str) -> None:
    """A decode side that handshakes, then: ``garbage``: a code-running pickle and broken bytes instead of a
    request; ``bad_notification``: a first request read whole, then a second whose READ is preceded by two
    ``kvm2-done:`` notifications without a number; ``unknown_notifications``: the same with
    ``UNKNOWN_NOTIFICATIONS`` well-formed ones for requests never made (notifications go over the NIXL connection
    the first READ made); ``bad_counts``: a request with one count for three layer groups and one asking for a
    day's READ deadline (both error answers checked), then a real one."""
    decode = DecodeSide(connection)
    manager, receiver, agent = decode.manager, decode.receiver, decode.nixl_agent()
    if act == "garbage":
        connection.send_bytes(mkdir_pickle(marker))
        connection.send_bytes(BROKEN_PICKLE)
    else:
        if act in NOTIFYING_ACTS:
            first = tokens_of(20, 100)
            opened = prepare_receiver(manager, first)
            assert opened is not None
            receiver.receive(opened[0], first, opened[1])
            opened[0].close()
        prompt = tokens_of(21, 100)
        received = prepare_receiver(manager, prompt)
        assert received is not None
        cache, counts = received
        if act == "bad_counts":  # a request for another layout, answered with an error before the good one
            send(connection, Request(BAD_REQUEST_ID, prompt, [0], ReuseScope(), receiver.timeout_s))
            answer = receive(connection, time.monotonic() + 30, "the answer")
            assert isinstance(answer, Failed) and answer.request_id == BAD_REQUEST_ID, answer
            assert "malformed request: cached_per_group has 1 entry, expected one per layer group (3)" in answer.message
            send(connection, Request(BAD_REQUEST_ID + 1, prompt, counts, ReuseScope(), 86400.0))
            answer = receive(connection, time.monotonic() + 30, "the answer")
            assert isinstance(answer, Failed) and answer.request_id == BAD_REQUEST_ID + 1, answer
            assert "read_timeout_s 86400.0 is above the prefill side's max_read_timeout_s 600.0" in answer.message
        request_id = receiver.request(cache, prompt, counts)
        peer = receiver_endpoint(receiver).peer
        if act == "unknown_notifications":
            assert peer is not None
            for unknown in range(request_id + 1, request_id + 1 + UNKNOWN_NOTIFICATIONS):
                agent.send_notif(peer, f"kvm2-done:{unknown}".encode())
        elif act == "bad_notification":
            assert peer is not None
            agent.send_notif(peer, b"kvm2-done:not-a-number")
            agent.send_notif(peer, b"kvm2-done:" + b"9" * 5000)
        receiver.read(cache, request_id)
        cache.close()
        receiver.close()
    decode.leave_without_a_word()


def rogue_prefill_side(connection: Connection, answer: bytes) -> None:
    """A prefill side that handshakes, then answers the first request with ``answer``."""
    manager = KVCacheManager(hybrid_config(16))
    sender = KVSender(manager, connection, kv_format=FAKE_FORMAT)
    connection.recv_bytes()
    connection.send_bytes(answer)
    wait_for_the_end(connection)
    sender.close()
    manager.shutdown()


def gone_prefill_side(connection: Connection, after_hello: bool) -> None:
    """A prefill side that exits before the hello, or right after it (before any request)."""
    if after_hello:
        manager = KVCacheManager(hybrid_config(16))
        KVSender(manager, connection, kv_format=FAKE_FORMAT)
        os._exit(0)  # no goodbye: as a crash
    connection.close()


def test_garbage_from_the_decode_side_is_a_transfer_error_and_runs_no_code(tmp_path: Path) -> None:
    require_nixl()
    marker = str(tmp_path / "pickle_ran")  # pytest's directory: mkdtemp left one behind per run
    with child_side(rogue_decode_side, "garbage", marker) as side:
        manager = KVCacheManager(hybrid_config(16))
        sender = KVSender(manager, side.connection, kv_format=FAKE_FORMAT)
        with pytest.raises(TransferError, match="not JSON"):
            sender.next_request()
        assert not os.path.exists(marker)  # the pickle was never unpickled
        with pytest.raises(TransferError, match="not JSON"):
            sender.next_request()
        sender.close()
        manager.shutdown()


def test_a_malformed_notification_is_ignored_and_counted() -> None:
    require_nixl()
    with child_side(rogue_decode_side, "bad_notification", "") as side:
        prefill_side = PrefillSide(side.connection)
        first, first_cache = prefill_side.serve(send=True)  # its READ connects the child's NIXL agent
        assert prefill_side.sender.wait_released(first, timeout_s=30)
        first_cache.close()
        request, cache = prefill_side.serve(send=True)
        sender = prefill_side.sender
        assert sender.wait_released(request, timeout_s=30)  # the real notification still releases the request
        assert sender.ignored_notifications == 2
        cache.close()
        assert sender.next_request() is None  # bye
        prefill_side.close()
        side.connection.close()  # the child waits for the end of the connection
        assert side.wait_exit() == 0


def test_a_request_for_another_layout_is_answered_with_an_error_not_returned() -> None:
    """Before: ``next_request`` returned a request with one count for three layer groups; the engine's
    ``send_sources`` then raised ValueError ('cached_per_group has 1 entries, expected one per layer group (3)')
    for the peer's mistake, and the decode side heard nothing. Also before: a request asking for a day's READ
    deadline was returned, and ``wait_released`` held its pages a day (the wire allows a year)."""
    require_nixl()
    with child_side(rogue_decode_side, "bad_counts", "") as side:
        prefill_side = PrefillSide(side.connection)
        request, cache = prefill_side.serve(send=True)  # the bad request is answered on the way
        assert request.request_id == 0
        assert prefill_side.sender.wait_released(request, timeout_s=30)
        cache.close()
        assert prefill_side.sender.next_request() is None  # bye
        prefill_side.close()
        side.connection.close()
        assert side.wait_exit() == 0  # it got the error answer


def test_notifications_for_requests_never_sent_are_ignored_not_kept() -> None:
    """Before: the sender kept the id of every well-formed notification until a ``wait_released`` of that id, so
    a peer naming requests this side never sent (or a READ finishing after its ``wait_released`` gave up) grew
    it for the sender's life; they were not even counted (ignored_notifications was 0, not 200). Only an id whose
    sources are held waits for its ``wait_released``."""
    require_nixl()
    with child_side(rogue_decode_side, "unknown_notifications", "") as side:
        prefill_side = PrefillSide(side.connection)
        first, first_cache = prefill_side.serve(send=True)  # its READ connects the child's NIXL agent
        assert prefill_side.sender.wait_released(first, timeout_s=30)
        first_cache.close()
        request, cache = prefill_side.serve(send=True)
        sender = prefill_side.sender
        assert sender.wait_released(request, timeout_s=30)
        assert sender.ignored_notifications == UNKNOWN_NOTIFICATIONS
        cache.close()
        assert sender.next_request() is None  # bye
        prefill_side.close()
        side.connection.close()
        assert side.wait_exit() == 0


@pytest.mark.parametrize("answer", [BROKEN_PICKLE, NEGATIVE_SLOT], ids=["broken_pickle", "negative_slot"])
def test_garbage_from_the_prefill_side_is_a_transfer_error_and_closes_the_cache(answer: bytes) -> None:
    require_nixl()
    with child_side(rogue_prefill_side, answer) as side:
        decode = DecodeSide(side.connection)
        prompt = tokens_of(22, 100)
        cache, counts = decode.open(prompt)
        message = "not JSON" if answer == BROKEN_PICKLE else r"sources.plan.sources.src_slot\[\] = -1 is outside"
        with pytest.raises(TransferError, match=message):
            decode.receiver.receive(cache, prompt, counts)
        assert cache.status.name == "CLOSED"
        decode.close()


class ConnectionCountingAgent(StuckReadAgent):
    """A real agent (READs never stalled) that counts the peer metadata loaded: each load makes UCX connect."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.loaded = 0

    def add_remote_agent(self, metadata: bytes) -> str | bytes:
        self.loaded += 1
        return super().add_remote_agent(metadata)


@pytest.mark.parametrize("after_hello", [False, True], ids=["before_the_hello", "before_the_request"])
def test_a_prefill_side_gone_early_is_a_transfer_error(after_hello: bool) -> None:
    """Before: the handshake loaded the peer's NIXL metadata, so UCX connected to a peer that may die right
    after its hello; a refusal arriving while UCX 1.23 still established that TCP connection aborted this whole
    process (SIGABRT, ``stubs.c:107 Assertion `0' failed`, on UCX's async thread: about 1 run in 30 under CPU
    load). Now no NIXL connection is made to a peer until a READ needs one, and the control connection says it
    is gone first (``agents[0].loaded`` was 1)."""
    require_nixl()
    agents: list[ConnectionCountingAgent] = []

    def counted(name: str) -> NixlAgent:
        agents.append(ConnectionCountingAgent(name))
        return agents[-1]

    with child_side(gone_prefill_side, after_hello) as side:
        manager = KVCacheManager(hybrid_config(8))
        if not after_hello:
            assert side.wait_exit() == 0
            with pytest.raises(TransferError, match="peer closed the control connection"):
                KVReceiver(manager, side.connection, timeout_s=30, kv_format=FAKE_FORMAT, agent_factory=counted)
            manager.shutdown()
            return
        receiver = KVReceiver(manager, side.connection, timeout_s=30, kv_format=FAKE_FORMAT, agent_factory=counted)
        assert side.wait_exit() == 0
        prompt = tokens_of(23, 100)
        received = prepare_receiver(manager, prompt)
        assert received is not None
        cache, counts = received
        with pytest.raises(TransferError, match="peer closed the control connection"):
            receiver.receive(cache, prompt, counts)
        assert agents[0].loaded == 0  # no NIXL connection to a peer that left
        assert cache.status.name == "CLOSED"
        manager.check_invariants()
        receiver.close()
        manager.shutdown()


def gone_decode_side(connection: Connection) -> None:
    """A decode side that exits right after the hello (before any request)."""
    manager = KVCacheManager(hybrid_config(8))
    KVReceiver(manager, connection, timeout_s=30, kv_format=FAKE_FORMAT)
    os._exit(0)  # no goodbye: as a crash


def test_a_decode_side_gone_after_the_hello_ends_the_requests_and_was_never_connected_to() -> None:
    """The prefill side never loads the decode side's NIXL metadata (the READ and its notification come over the
    decode side's connection), so UCX never connects to a decode side that may die right after its hello (UCX
    1.23 aborts the process when such a connection is refused while it is being established). Before: the
    handshake loaded it (``peer`` was 'decode-<pid>-0')."""
    require_nixl()
    with child_side(gone_decode_side) as side:
        manager = KVCacheManager(hybrid_config(16))
        sender = KVSender(manager, side.connection, kv_format=FAKE_FORMAT)
        assert sender_endpoint(sender).peer is None
        assert side.wait_exit() == 0
        assert sender.next_request() is None  # the connection closed: no more requests
        sender.close()
        manager.check_invariants()
        manager.shutdown()


def test_a_prefill_side_that_exits_as_it_answers_an_empty_plan_leaves_the_read_whole() -> None:
    """A request with nothing to move (the receiver holds the whole prompt) needs no NIXL: the answer is all there
    is, so a prefill side gone right after it changes nothing and nothing connects UCX to it. Before: the read
    released the sender by a NIXL notification alone; loading the peer for it made UCX connect to a peer that
    may be exiting just then (UCX 1.23 aborts this process if it dies mid-connect: 1 run in 33), and a peer
    already gone was 'TransferError: the prefill side closed the control connection (it died or gave up)'."""
    require_nixl()
    with child_side(fake_prefill_side, 16, "cpu", "exit_after_sources") as side:
        decode = DecodeSide(side.connection, agent_type=ConnectionCountingAgent)
        prompt = tokens_of(24, 256)
        decode.warm(prompt)
        cache, counts = decode.open(prompt)
        assert counts == [256, 256, 256]  # nothing to move
        request_id = decode.receiver.request(cache, prompt, counts)
        assert side.wait_exit() == 17  # answered (an empty plan), then gone
        received = decode.receiver.read(cache, request_id)
        assert received.plan.num_descriptors == 0 and received.extra == ["prefilled", 256]
        assert decode.agent(ConnectionCountingAgent).loaded == 0  # no NIXL connection to a peer that left
        decode.engine.check(cache, prompt)
        cache.close()
        decode.close()
