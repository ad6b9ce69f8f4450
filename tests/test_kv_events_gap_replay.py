"""A gap's replay against a hand-driven replay endpoint: one that lies recovers nothing and is reported; one that
answers late or never keeps to each ``receive`` call's deadline and goes on at the next call; and the timeouts
the events package takes, refused when they are no wait at all (negative, NaN, infinite, not a number)."""

from __future__ import annotations

import io
import math
import socket
import threading
import time

import numpy as np
import pytest

from tests.events_helpers import TCP_ANY_PORT, require_events_extra

require_events_extra()

import zmq  # noqa: E402

from kv_cache_manager_v2.kv_events.listen import listen  # noqa: E402
from kv_cache_manager_v2.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from kv_cache_manager_v2.kv_events.subscriber import MAX_TIMEOUT_MS, EventSubscriber, Gap, ReceivedBatch  # noqa: E402
from kv_cache_manager_v2.kv_events.wire import EventBatch, encode_batch  # noqa: E402
from tests.test_kv_events_transport import RECEIVE_MS, RoguePeer, batch_events, rogue_peer, seq_bytes  # noqa: E402


def lying_replay(router: zmq.Socket[bytes], answer: str) -> None:
    """Answer one replay request the way ``answer`` says (every batch carries valid events)."""
    identity, _, start_frame = router.recv_multipart()
    start = int.from_bytes(start_frame, "big", signed=True)
    payload = encode_batch(EventBatch(1.0, tuple(batch_events(start)), 0))
    numbers = {"below_start": [start - 5, start], "repeated": [start, start, start], "silent": []}.get(answer, [start])
    for seq in numbers:
        router.send_multipart([identity, b"", seq_bytes(seq), b"\xc1" if answer == "garbage" else payload])
    if answer != "silent":
        router.send_multipart([identity, b"", seq_bytes(-1), b""])


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("below_start", "the replay from 1 answered batch -4 after 0"),
        ("repeated", "the replay from 1 answered batch 1 after 1"),
        ("garbage", "not msgpack"),
        ("silent", "no answer from the replay endpoint"),
    ],
)
def test_a_replay_that_lies_recovers_nothing_and_is_reported(answer: str, reason: str) -> None:
    """A replay answering batches out of order or below the gap handed them out (last_seq went backwards); a
    malformed or missing answer raised out of the listener."""
    with rogue_peer("live", replay=True, last_seq=0) as peer:
        subscriber = peer.subscriber
        liar = threading.Thread(target=lying_replay, args=(peer.router, answer))
        liar.start()
        try:
            peer.pub.send_multipart([b"", seq_bytes(3), encode_batch(EventBatch(3.0, tuple(batch_events(3)), 0))])
            out = io.StringIO()
            assert listen(subscriber, count=1, timeout_s=RECEIVE_MS / 1000, out=out) == 1
            text = out.getvalue()
            assert f"skipped: the replay of batches 1..2: {reason}" in text
            assert "gap: batches 1..2 missed, 0 replayed" in text and "batch seq=3 ts=3.000000" in text
            assert subscriber.gaps == [Gap(1, 3, 0)] and subscriber.last_seq == 3
        finally:
            liar.join(5)


# A bound ROUTER nobody reads is a replay endpoint that never answers: the request waits in its queue.
SILENT_REPLAY_MS = 30_000
# Far above a receive(200) on a loaded machine, far below the silent replay's timeout.
WELL_UNDER_S = 10.0


def batch_frames(seq: int) -> list[bytes]:
    return [b"", seq_bytes(seq), encode_batch(EventBatch(float(seq), tuple(batch_events(seq)), 0))]


def start_a_gap(peer: RoguePeer) -> None:
    """Send batch 3 after 0 and call ``receive(200)`` until the replay request for 1..2 reached the router; each
    call returns None (the replay is not answered yet) well under the replay's timeout."""
    assert peer.router is not None
    peer.pub.send_multipart(batch_frames(3))
    for _ in range(RECEIVE_MS // 200):
        began = time.monotonic()
        received = peer.subscriber.receive(200)
        assert time.monotonic() - began < WELL_UNDER_S
        assert received is None
        if peer.router.poll(0):
            return
    raise AssertionError("the subscriber never asked for the replay")


def test_a_replay_that_never_answers_keeps_to_the_receive_deadline() -> None:
    """Before: the gap's replay waited its own timeout inside ``receive(200)`` (30 s here:
    'assert (10380.868394687 - 10350.765763152) < 10.0'); now the call returns None at its deadline, the gap
    stays open (nothing recorded, ``last_seq`` unchanged) and ``close`` drops the replay under way."""
    with rogue_peer("live", replay=True, last_seq=0, replay_timeout_ms=SILENT_REPLAY_MS) as peer:
        subscriber = peer.subscriber
        start_a_gap(peer)
        began = time.monotonic()
        assert subscriber.receive(200) is None
        assert time.monotonic() - began < WELL_UNDER_S
        assert subscriber.gaps == [] and subscriber.skipped == [] and subscriber.last_seq == 0
        subscriber.close()
        with pytest.raises(RuntimeError, match=r"receive called after close\(\)"):
            subscriber.receive(0)


def test_a_replay_answered_after_the_receive_gave_up_is_handed_out_by_the_next() -> None:
    """The replay request stays open across calls: its answer, late for the first call, is read by the next, the
    replayed batches first. Before: the first call waited for the answer (its whole replay timeout), got none,
    handed out batch 3 and recorded nothing replayed ('assert ReceivedBatch(seq=3, ...) is None')."""
    with rogue_peer("live", replay=True, last_seq=0, replay_timeout_ms=SILENT_REPLAY_MS) as peer:
        subscriber, router = peer.subscriber, peer.router
        assert router is not None
        start_a_gap(peer)
        identity, _, start = router.recv_multipart()
        assert start == seq_bytes(1)
        for seq in (1, 2):
            router.send_multipart([identity, *batch_frames(seq)])
        router.send_multipart([identity, b"", seq_bytes(-1), b""])
        got = [subscriber.receive(RECEIVE_MS) for _ in range(3)]
        assert [(r.seq, r.replayed, r.batch.events) for r in got if r is not None] == [
            (1, True, tuple(batch_events(1))), (2, True, tuple(batch_events(2))), (3, False, tuple(batch_events(3)))
        ]
        assert subscriber.gaps == [Gap(1, 3, 2)] and subscriber.skipped == [] and subscriber.last_seq == 3


def test_a_replay_silent_past_its_own_timeout_fails_at_a_later_receive_and_the_gap_is_reported() -> None:
    """``replay_timeout_ms`` runs across calls: once it passed without an answer, the next call records the
    failed replay and the gap, and hands out the batch after it, as a replay that failed within one call did."""
    with rogue_peer("live", replay=True, last_seq=0, replay_timeout_ms=300) as peer:
        subscriber = peer.subscriber
        peer.pub.send_multipart(batch_frames(3))
        # The call that sends the request ends within 100 ms of it, before the replay's 300 ms: 2 calls at least.
        calls: list[ReceivedBatch | None] = []
        for _ in range(RECEIVE_MS // 100):
            calls.append(subscriber.receive(100))
            if calls[-1] is not None:
                break
        received = calls[-1]
        assert len(calls) >= 2 and calls[-2] is None
        assert received is not None and received.seq == 3 and not received.replayed
        assert subscriber.gaps == [Gap(1, 3, 0)] and subscriber.last_seq == 3
        assert subscriber.skipped == [
            f"the replay of batches 1..2: no answer from the replay endpoint {subscriber_replay(peer)} in 300 ms"
        ]


def subscriber_replay(peer: RoguePeer) -> str:
    assert peer.router is not None
    endpoint = peer.router.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


NOT_INTEGERS: list[object] = [True, 1.5, math.nan, math.inf, "5", None]
BAD_TIMEOUTS: list[tuple[object, type, str]] = [
    (-1, ValueError, "timeout_ms must be >= 0, got -1"),
    (-1_000, ValueError, "timeout_ms must be >= 0, got -1000"),
    (MAX_TIMEOUT_MS + 1, ValueError, f"timeout_ms must be at most {MAX_TIMEOUT_MS:,} ms"),
    *[(value, TypeError, "timeout_ms must be an integer") for value in NOT_INTEGERS[:-1]],
]


@pytest.mark.parametrize(("value", "error", "message"), BAD_TIMEOUTS)
def test_a_bad_receive_timeout_is_refused_and_changes_nothing(value: object, error: type, message: str) -> None:
    """Before: any negative number waited without limit and True or 1.5 were taken (here: the batch handed out,
    'DID NOT RAISE'), NaN and infinity failed inside ZeroMQ's poll naming nothing ('cannot convert float NaN to
    integer'). None is the wait without limit now."""
    with rogue_peer("timeouts") as peer:
        subscriber = peer.subscriber
        peer.pub.send_multipart(batch_frames(0))
        with pytest.raises(error, match=message):
            subscriber.receive(value)  # type: ignore[arg-type]
        received = subscriber.receive(None)
        assert received is not None and received.seq == 0 and received.batch.events == tuple(batch_events(0))
        assert subscriber.last_seq == 0 and subscriber.gaps == [] and subscriber.skipped == []


@pytest.mark.parametrize(("value", "error", "message"), [*BAD_TIMEOUTS[1:], (None, TypeError, "must be an integer")])
def test_a_bad_replay_timeout_is_refused_before_asking(value: object, error: type, message: str) -> None:
    with rogue_peer("timeouts", replay=True) as peer:
        assert peer.router is not None
        with pytest.raises(error, match=message):
            peer.subscriber.replay(0, None, value)  # type: ignore[arg-type]
        assert not peer.router.poll(100)  # no request went out


@pytest.mark.parametrize(("value", "error", "message"), [*BAD_TIMEOUTS, (None, TypeError, "must be an integer")])
def test_a_bad_replay_timeout_setting_is_refused_before_any_socket(value: object, error: type, message: str) -> None:
    """The subscriber's ``replay_timeout_ms`` is checked first: the port it would have bound is still free."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://*:{port}"
    with pytest.raises(error, match=message.replace("timeout_ms", "replay_timeout_ms")):
        EventSubscriber(
            endpoint, replay_endpoint="tcp://127.0.0.1:1", replay_timeout_ms=value  # type: ignore[arg-type]
        )
    EventSubscriber(endpoint, replay_endpoint="tcp://127.0.0.1:1").close()


@pytest.mark.parametrize("value", [-1.0, -0.001, math.nan, math.inf, 2e6, "1"])
def test_a_bad_listen_timeout_is_refused_and_the_subscriber_goes_on(value: object) -> None:
    """Before: a negative timeout was taken as 0 and 2e6 s as given ('DID NOT RAISE'), NaN and infinity raised
    int()'s ValueError and OverflowError, a string an OverflowError deep in ``receive``."""
    with rogue_peer("timeouts") as peer:
        peer.pub.send_multipart(batch_frames(0))
        out = io.StringIO()
        # Compiled, mypyc checks a ``float | None`` argument itself and names the type, not the argument.
        with pytest.raises((ValueError, TypeError), match=r"timeout_s must be (in \[0, 1,000,000\]|a number)|expected"):
            listen(peer.subscriber, count=1, timeout_s=value, out=out)  # type: ignore[arg-type]
        assert out.getvalue() == "" and peer.subscriber.last_seq == -1
        assert listen(peer.subscriber, count=1, timeout_s=RECEIVE_MS / 1000, out=out) == 1
        assert "batch seq=0 " in out.getvalue()


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_a_bad_wait_sent_timeout_is_refused_and_the_publisher_goes_on(value: float) -> None:
    """Before: NaN waited without end while a batch was unsent (``now > nan`` is never true), and -1 answered."""
    publisher = ZmqEventPublisher(TCP_ANY_PORT)
    try:
        with pytest.raises(ValueError, match=r"timeout_s must be in \[0, inf\), got"):
            publisher.wait_sent(value)
        assert publisher.publish(batch_events(0), ts=0.0) == 0
        assert publisher.wait_sent() and publisher.sent == 1
    finally:
        publisher.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("bogus", ValueError, "replay_endpoint 'bogus': Invalid argument"),
        ("nope://x", ValueError, "replay_endpoint 'nope://x': Protocol not supported"),
        # Compiled, mypyc checks a ``str | None`` argument itself and names the type, not the argument.
        (b"tcp://127.0.0.1:1", TypeError, "replay_endpoint must be a str|str or None object expected"),
    ],
)
def test_a_bad_replay_endpoint_is_refused_at_construction_before_any_socket(
    value: object, error: type, message: str
) -> None:
    """Before: accepted ('DID NOT RAISE'), and the first gap's replay raised ``ZMQError`` out of ``receive``, the
    live batch after the gap lost. Refused before the SUB socket exists: the port it would bind is still free."""
    endpoint = f"tcp://*:{free_port()}"
    with pytest.raises(error, match=message):
        EventSubscriber(endpoint, replay_endpoint=value)  # type: ignore[arg-type]
    EventSubscriber(endpoint, replay_endpoint="tcp://127.0.0.1:1").close()


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-2, ValueError, r"last_seq must be in \[-1, 9223372036854775808\), got -2"),
        (2**63, ValueError, "last_seq must be in"),
        (True, TypeError, "last_seq must be an integer, got bool"),
        (1.0, TypeError, "last_seq must be an integer|int object expected"),
        ("3", TypeError, "last_seq must be an integer|int object expected"),
    ],
)
def test_a_bad_last_seq_is_refused_before_any_socket(value: object, error: type, message: str) -> None:
    """Before: kept as given ('DID NOT RAISE'): -2 took batch 0 as a gap from -1, True compared as 1, a float or
    a str raised TypeError at the first batch, deep in ``receive``."""
    endpoint = f"tcp://*:{free_port()}"
    with pytest.raises(error, match=message):
        EventSubscriber(endpoint, last_seq=value)  # type: ignore[arg-type]
    subscriber = EventSubscriber(endpoint, last_seq=np.int64(4))
    try:
        assert subscriber.last_seq == 4 and type(subscriber.last_seq) is int
    finally:
        subscriber.close()


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError)])
def test_a_listen_count_below_one_is_refused_and_the_subscriber_goes_on(value: object, error: type) -> None:
    """Before: ``listen(count=0)`` printed nothing and returned 0 ('DID NOT RAISE'), where ``--count 0`` is a
    usage error."""
    with rogue_peer("count") as peer:
        peer.pub.send_multipart(batch_frames(0))
        out = io.StringIO()
        with pytest.raises(error, match="count must be"):
            listen(peer.subscriber, count=value, timeout_s=RECEIVE_MS / 1000, out=out)  # type: ignore[arg-type]
        assert out.getvalue() == "" and peer.subscriber.last_seq == -1
        assert listen(peer.subscriber, count=1, timeout_s=RECEIVE_MS / 1000, out=out) == 1
        assert "batch seq=0 " in out.getvalue()
