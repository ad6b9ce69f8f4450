"""Publisher and subscriber over real sockets (ipc:// and tcp://127.0.0.1 on a free port): batches arrive in
order with vLLM's three frames, a subscriber that dropped out gets the missed batches from the replay socket,
gaps without replay are reported, a publisher restarted on the same endpoint is followed, and the listener prints
decoded batches."""

from __future__ import annotations

import io
import math
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from tests.events_helpers import TCP_ANY_PORT, ipc_endpoint, require_events_extra

require_events_extra()

import msgspec  # noqa: E402
import zmq  # noqa: E402

from kv_cache_manager_v2.kv_events.listen import listen  # noqa: E402
from kv_cache_manager_v2.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from kv_cache_manager_v2.kv_events.subscriber import KEPT_RECORDS, EventSubscriber, Gap, Restart  # noqa: E402
from kv_cache_manager_v2.kv_events.wire import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireEvent,
    decode_batch,
    encode_batch,
)

# Long enough for a local SUB socket's subscription to reach the PUB socket (ZMQ's slow joiner).
JOIN_S = 0.3
RECEIVE_MS = 5_000


def batch_events(seq: int) -> list[WireEvent]:
    """A distinct batch per sequence number."""
    return [
        BlockStored((seq, seq + 1), None, (seq,) * 4, 2, None, "GPU", None, (None, None), 0, "full_attention"),
        BlockRemoved((seq,), "GPU", 0),
    ]


@pytest.fixture(params=["ipc", "tcp"])
def publisher(request: pytest.FixtureRequest) -> Iterator[ZmqEventPublisher]:
    if request.param == "ipc":
        live, replay = ipc_endpoint("live"), ipc_endpoint("replay")
    else:
        live, replay = TCP_ANY_PORT, TCP_ANY_PORT
    sockets = ZmqEventPublisher(live, replay, topic="kv", buffer_steps=4)
    yield sockets
    sockets.close()


def subscribe(publisher: ZmqEventPublisher, last_seq: int = -1, replay: bool = True) -> EventSubscriber:
    subscriber = EventSubscriber(publisher.endpoint, "kv", publisher.replay_endpoint if replay else None, last_seq)
    time.sleep(JOIN_S)
    return subscriber


def test_round_trip_then_a_dropped_subscriber_catches_up_by_replay(publisher: ZmqEventPublisher) -> None:
    assert "*" not in publisher.endpoint  # the free port was resolved
    first = subscribe(publisher)
    try:
        for seq in range(3):
            assert publisher.publish(batch_events(seq), ts=100.0 + seq) == seq
        for seq in range(3):
            received = first.receive(RECEIVE_MS)
            assert received is not None and received.seq == seq and not received.replayed
            assert received.batch.events == tuple(batch_events(seq))
            assert received.batch.ts == 100.0 + seq and received.batch.data_parallel_rank == 0
    finally:
        first.close()
    for seq in (3, 4):  # nobody listens
        publisher.publish(batch_events(seq), ts=0.0)
    assert publisher.wait_sent()
    back = subscribe(publisher, last_seq=2)
    try:
        publisher.publish(batch_events(5), ts=0.0)
        got = [back.receive(RECEIVE_MS) for _ in range(3)]
        assert [(r.seq, r.replayed) for r in got if r is not None] == [(3, True), (4, True), (5, False)]
        assert [r.batch.events for r in got if r is not None] == [tuple(batch_events(s)) for s in (3, 4, 5)]
        assert back.gaps == [Gap(3, 5, 2)]
        assert back.receive(50) is None
    finally:
        back.close()


def test_receive_after_close_says_so_and_a_second_close_does_nothing(publisher: ZmqEventPublisher) -> None:
    """Before: zmq.error.ZMQError: Operation not supported (nothing naming the closed subscriber)."""
    subscriber = subscribe(publisher)
    publisher.publish(batch_events(0), ts=0.0)
    received = subscriber.receive(RECEIVE_MS)
    assert received is not None and received.seq == 0
    subscriber.close()
    subscriber.close()
    with pytest.raises(RuntimeError, match=r"receive called after close\(\)"):
        subscriber.receive(0)


def test_replay_gives_only_what_is_still_buffered(publisher: ZmqEventPublisher) -> None:
    for seq in range(6):  # buffer_steps=4: 0 and 1 are gone
        publisher.publish(batch_events(seq), ts=0.0)
    subscriber = subscribe(publisher)
    try:
        # The publisher's thread answers replay requests while nothing is published.
        seqs: list[int] = []
        deadline = time.monotonic() + RECEIVE_MS / 1000
        request: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        request.setsockopt(zmq.LINGER, 0)
        try:
            request.connect(str(publisher.replay_endpoint))
            request.send_multipart((b"", (0).to_bytes(8, "big", signed=True)))
            while time.monotonic() < deadline:
                if request.poll(10):
                    frames = request.recv_multipart()
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq == -1:
                        assert frames[2] == b""
                        break
                    assert decode_batch(frames[2]).events == tuple(batch_events(seq))
                    seqs.append(seq)
        finally:
            request.close(linger=0)
        assert seqs == [2, 3, 4, 5]
    finally:
        subscriber.close()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((-1,), "start must be >= 0, got -1"),
        ((3, 2), r"stop must be None or >= start \(3\), got 2"),
        ((0, None, -1), "timeout_ms must be >= 0, got -1"),  # ZeroMQ: wait forever
    ],
)
def test_a_replay_of_a_bad_range_is_refused_before_asking(
    publisher: ZmqEventPublisher, arguments: tuple[int | None, ...], message: str
) -> None:
    """Before: a negative timeout waited for ever on a publisher that stopped answering, and a reversed range
    cost a round trip."""
    subscriber = subscribe(publisher)
    try:
        with pytest.raises(ValueError, match=message):
            subscriber.replay(*arguments)  # type: ignore[arg-type]
        assert [batch.seq for batch in subscriber.replay(0, 1)] == []  # still usable: nothing published yet
    finally:
        subscriber.close()


class Index:
    """An integer argument known only by ``__index__`` (``SupportsIndex``)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_a_replay_range_of_any_integers(publisher: ZmqEventPublisher) -> None:
    """Before: "TypeError: '>=' not supported between instances of 'int' and 'Index'" (the checked stop was read
    again, as given, for each answer); start and stop typed int (compiled mode refuses a NumPy integer there)."""
    subscriber = subscribe(publisher)
    try:
        for seq in range(4):
            publisher.publish(batch_events(seq), ts=0.0)
        assert publisher.wait_sent()
        assert [batch.seq for batch in subscriber.replay(np.int64(1), Index(3))] == [1, 2]
    finally:
        subscriber.close()


def test_gap_without_replay_is_reported_and_the_listener_prints_it(publisher: ZmqEventPublisher) -> None:
    subscriber = subscribe(publisher, last_seq=-1, replay=False)
    try:
        publisher.publish([AllBlocksCleared()], ts=1.0)
        assert subscriber.receive(RECEIVE_MS) is not None
        publisher.publish(batch_events(1), ts=1.0)  # dropped on purpose: seq 1 is never received
        assert subscriber._sub.poll(RECEIVE_MS)  # noqa: SLF001
        subscriber._sub.recv_multipart()  # noqa: SLF001
        publisher.publish(batch_events(2), ts=2.0)
        out = io.StringIO()
        assert listen(subscriber, count=1, timeout_s=RECEIVE_MS / 1000, out=out) == 1
        text = out.getvalue()
        assert "gap: batches 1..1 missed, 0 replayed" in text
        assert "batch seq=2 ts=2.000000 dp_rank=0 events=2" in text
        assert "BlockStored group=0 kind=full_attention medium=GPU hashes=[2, 3] parent=None" in text
        assert "BlockRemoved group=0 medium=GPU hashes=[2]" in text
        assert subscriber.gaps == [Gap(1, 2, 0)]
    finally:
        subscriber.close()


def test_a_restarted_publisher_is_reported_and_followed() -> None:
    live, replay = ipc_endpoint("live"), ipc_endpoint("replay")
    seen: list[Restart] = []
    first = ZmqEventPublisher(live, replay)
    subscriber = EventSubscriber(live, replay_endpoint=replay, on_restart=seen.append)
    time.sleep(JOIN_S)
    try:
        for seq in range(3):
            first.publish(batch_events(seq), ts=0.0)
        first.publish([AllBlocksCleared()], ts=0.0)  # what KVEventsPublisher.shutdown sends last
        assert [r.seq for r in (subscriber.receive(RECEIVE_MS) for _ in range(4)) if r is not None] == [0, 1, 2, 3]
        first.close()
        second = ZmqEventPublisher(live, replay)  # the engine came back on the same endpoints
        # The SUB socket reconnects on its own; it resubscribes once it is polled (ZMQ attaches the new pipe then).
        assert subscriber.receive(int(JOIN_S * 2000)) is None
        try:
            for seq in range(2):
                second.publish(batch_events(100 + seq), ts=1.0)
            out = io.StringIO()
            assert listen(subscriber, count=2, timeout_s=RECEIVE_MS / 1000, out=out) == 2
            assert seen == [Restart(3, 0)] and subscriber.restarts == seen and subscriber.gaps == []
            assert subscriber.last_seq == 1
            text = out.getvalue()
            assert "restart: the publisher began again at batch 0 after 3" in text
            assert "batch seq=0 " in text and "batch seq=1 " in text and "hashes=[101, 102]" in text
        finally:
            second.close()
    finally:
        subscriber.close()


@contextmanager
def _restarted(
    first: ZmqEventPublisher, subscriber: EventSubscriber, live: str, replay: str
) -> Iterator[ZmqEventPublisher]:
    """``subscriber`` reads ``first``'s batches 0 and 1, then ``first`` closes and a second publisher (a restart)
    binds the same endpoints; yields it once the SUB socket has reconnected, and closes both at the end."""
    time.sleep(JOIN_S)
    try:
        first.publish(batch_events(0), ts=0.0)
        first.publish(batch_events(1), ts=0.0)
        assert [r.seq for r in (subscriber.receive(RECEIVE_MS) for _ in range(2)) if r is not None] == [0, 1]
        first.close()
        second = ZmqEventPublisher(live, replay)
        assert subscriber.receive(int(JOIN_S * 2000)) is None  # the SUB socket reconnects meanwhile
        try:
            yield second
        finally:
            second.close()
    finally:
        subscriber.close()


def test_an_on_restart_callback_that_receives_again_is_refused_and_loses_nothing() -> None:
    """Before: the callback's ``receive`` handed out the restarted publisher's first batch from inside the outer
    call, which then waited its whole timeout for another and returned None ('DID NOT RAISE RuntimeError'). Now the
    inner call is refused (the callback's error propagates, as any callback's) and the batch stays queued."""
    live, replay = ipc_endpoint("live"), ipc_endpoint("replay")
    refusals: list[str] = []

    def receive_again(restart: Restart) -> None:
        try:
            subscriber.receive(0)
        except RuntimeError as error:
            refusals.append(str(error))
            raise

    first = ZmqEventPublisher(live, replay)
    subscriber = EventSubscriber(live, replay_endpoint=replay, on_restart=receive_again)
    with _restarted(first, subscriber, live, replay) as second:
        second.publish(batch_events(100), ts=1.0)
        with pytest.raises(RuntimeError, match="called from its on_restart callback"):
            subscriber.receive(RECEIVE_MS)
        assert len(refusals) == 1 and subscriber.restarts == [Restart(1, 0)]
        batch = subscriber.receive(0)  # queued before the callback ran: not lost
        assert batch is not None and batch.seq == 0 and subscriber.last_seq == 0


def test_an_on_restart_callback_that_closes_the_subscriber_ends_the_receive_with_none() -> None:
    """The callback may ``close``; the call it ran in then has nothing to hand out. Before: that call polled the
    closed socket ('zmq.error.ZMQError: Operation not supported')."""
    live, replay = ipc_endpoint("live"), ipc_endpoint("replay")
    first = ZmqEventPublisher(live, replay)
    subscriber = EventSubscriber(live, replay_endpoint=replay, on_restart=lambda restart: subscriber.close())
    with _restarted(first, subscriber, live, replay) as second:
        second.publish(batch_events(100), ts=1.0)
        assert subscriber.receive(RECEIVE_MS) is None
        assert subscriber.restarts == [Restart(1, 0)] and subscriber.last_seq == 1
        with pytest.raises(RuntimeError, match=r"receive called after close\(\)"):
            subscriber.receive(0)


TYPE, VALUE = TypeError, ValueError
PUBLISHER_NUMBERS = ("buffer_steps", "data_parallel_rank", "hwm")
BAD_SETTINGS: list[tuple[str, object, type]] = [
    *[(name, value, VALUE) for name in PUBLISHER_NUMBERS for value in (-1, 2**63, 2**64, np.uint64(2**64 - 1))],
    *[(name, value, TYPE) for name in PUBLISHER_NUMBERS for value in (True, np.bool_(True), 1.0, -0.0, math.nan, "1")],
    ("buffer_steps", 0, VALUE), ("hwm", 2**31, VALUE), ("topic", 5, TYPE), ("endpoint", None, TYPE),
    ("replay_endpoint", b"tcp://*:5557", TYPE),
]


@pytest.mark.parametrize(("name", "value", "error"), BAD_SETTINGS)
def test_a_bad_setting_is_refused_naming_it_before_any_socket(name: str, value: object, error: type) -> None:
    """Before, 2**63 steps raised OverflowError from the replay deque (its sockets already bound), a NumPy integer
    "an integer is required", hwm 2**31 pyzmq's OverflowError, and True, NaN or a huge rank passed."""
    settings: dict[str, object] = {"endpoint": TCP_ANY_PORT, "replay_endpoint": TCP_ANY_PORT, name: value}
    # Compiled, mypyc checks a ``str`` argument itself and names the type, not the argument (test_bad_inputs.py).
    with pytest.raises(error, match=f"{name}|str or None object expected|str object expected"):
        ZmqEventPublisher(**settings)  # type: ignore[arg-type]


def test_numpy_settings_are_accepted_and_a_rank_past_the_last_port_is_refused() -> None:
    ZmqEventPublisher(TCP_ANY_PORT, buffer_steps=np.int32(3), data_parallel_rank=np.int64(1), hwm=np.uint64(9)).close()
    with pytest.raises(ValueError, match="data_parallel_rank"):
        ZmqEventPublisher("tcp://127.0.0.1:65000", data_parallel_rank=536)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


@dataclass
class RoguePeer:
    """A hand-driven peer: ``pub`` sends whatever frames a test wants to ``subscriber``; ``router`` (when asked
    for) is bound at the subscriber's replay endpoint and answers only what the test makes it answer."""

    pub: zmq.Socket[bytes]
    subscriber: EventSubscriber
    router: zmq.Socket[bytes] | None


@contextmanager
def rogue_peer(
    name: str, *, replay: bool = False, last_seq: int = -1, queue_all: bool = False, replay_timeout_ms: int = 2_000
) -> Iterator[RoguePeer]:
    """Bind a rogue PUB (queueing all it sends with ``queue_all``: none dropped before the subscriber reads) and,
    with ``replay``, a ROUTER; subscribe to them, wait for the subscription to join; close all three after."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
    router: zmq.Socket[bytes] | None = None
    subscriber: EventSubscriber | None = None
    try:
        if queue_all:
            pub.setsockopt(zmq.SNDHWM, 0)
        live = ipc_endpoint(name)
        pub.bind(live)
        replay_endpoint = None
        if replay:
            replay_endpoint = ipc_endpoint("replay")
            router = context.socket(zmq.ROUTER)
            router.bind(replay_endpoint)
        subscriber = EventSubscriber(
            live, replay_endpoint=replay_endpoint, last_seq=last_seq, replay_timeout_ms=replay_timeout_ms
        )
        time.sleep(JOIN_S)
        yield RoguePeer(pub, subscriber, router)
    finally:
        if subscriber is not None:
            subscriber.close()
        if router is not None:
            router.close(linger=0)
        pub.close(linger=0)


def test_hostile_live_messages_are_skipped_and_the_listener_goes_on() -> None:
    """Each of these made ``receive`` raise WireFormatError out of the listener (events-listen died with a
    traceback), or, for a negative number, was handed out as a publisher restart."""
    good = encode_batch(EventBatch(1.0, tuple(batch_events(0)), 0))
    with rogue_peer("hostile") as peer:
        subscriber = peer.subscriber
        for frames in (
            [b"", seq_bytes(0), good, b"a fourth frame"],
            [b"", seq_bytes(0), good[:-3]],  # truncated msgpack
            [b"", b"\x00", good],  # a 1-byte sequence number
            [b"", seq_bytes(-7), good],
            [b"", seq_bytes(0), msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0])],
            [b"", seq_bytes(0), good],
        ):
            peer.pub.send_multipart(frames)
        out = io.StringIO()
        assert listen(subscriber, count=1, timeout_s=RECEIVE_MS / 1000, out=out) == 1
        lines = out.getvalue().splitlines()
        assert [line.split(": ", 2)[-1] for line in lines if line.startswith("skipped")] == [
            "a message is [topic, 8-byte seq, payload], got 4 frames",
            "not msgpack: Input data was truncated",
            "a message is [topic, 8-byte seq, payload], got 3 frames",
            "sequence number -7 is below 0",
            "BlockStored.block_size must be an int, got None",
        ]
        assert "batch seq=0 ts=1.000000 dp_rank=0 events=2" in lines
        assert subscriber.restarts == [] and subscriber.gaps == [] and subscriber.last_seq == 0


def test_a_flood_of_hostile_messages_keeps_the_latest_reasons_and_counts_them_all() -> None:
    """A peer sending bad frames without end made ``skipped`` (and ``restarts``/``gaps`` for lying numbers) grow
    without bound in a long-running router; the subscriber now keeps the latest ``KEPT_RECORDS`` and counts all."""
    good = encode_batch(EventBatch(1.0, tuple(batch_events(0)), 0))
    flood = KEPT_RECORDS + 200
    with rogue_peer("flood", queue_all=True) as peer:
        subscriber, rogue = peer.subscriber, peer.pub
        for _ in range(flood):
            rogue.send_multipart([b"", seq_bytes(0), good[:-3]])  # truncated msgpack
        rogue.send_multipart([b"", seq_bytes(0), good])
        out = io.StringIO()
        assert listen(subscriber, count=1, timeout_s=RECEIVE_MS / 1000, out=out) == 1
        assert subscriber.num_skipped == flood and len(subscriber.skipped) == KEPT_RECORDS
        text = out.getvalue()
        assert f"200 earlier skipped messages not kept (a subscriber keeps the latest {KEPT_RECORDS})" in text
        assert text.count("skipped: a live message: not msgpack") == KEPT_RECORDS
        for _ in range(flood):  # numbered 0 again after 0: a publisher restart each time
            rogue.send_multipart([b"", seq_bytes(0), good])
        for _ in range(flood):
            assert subscriber.receive(RECEIVE_MS) is not None
        assert subscriber.num_restarts == flood and len(subscriber.restarts) == KEPT_RECORDS
        assert subscriber.restarts[-1] == Restart(0, 0)


def test_bad_messages_more_often_than_the_timeout_do_not_restart_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """``receive(timeout_ms)`` keeps one deadline: each skipped bad message used to start the wait over at the full
    timeout, so a peer sending them more often than that kept the caller (and ``events-listen --timeout``) waiting
    without end. The clock here moves half the timeout at each reading, as if a bad message came every half
    timeout; before, the call skipped all 10 of them (``assert 10 < 10``), now it gives up past its deadline and
    leaves the rest for the next call."""
    bad = encode_batch(EventBatch(1.0, tuple(batch_events(0)), 0))[:-3]  # truncated msgpack
    timeout_ms = 1_000
    readings = [time.monotonic()]

    def half_a_timeout_later() -> float:
        readings.append(readings[-1] + timeout_ms / 2000)
        return readings[-2]

    with rogue_peer("deadline") as peer:
        subscriber = peer.subscriber
        for _ in range(10):
            peer.pub.send_multipart([b"", seq_bytes(0), bad])
        with monkeypatch.context() as patch:
            patch.setattr(time, "monotonic", half_a_timeout_later)
            assert subscriber.receive(timeout_ms) is None
        assert 0 < subscriber.num_skipped < 10, subscriber.num_skipped
        assert len(readings) > 2  # the clock was read again after a skip: the deadline is the call's
        while subscriber.num_skipped < 10:  # the rest are still there for the next calls, on the real clock
            assert subscriber.receive(200) is None
        assert subscriber.skipped == ["a live message: not msgpack: Input data was truncated"] * 10


def test_an_ipc_endpoint_directory_goes_when_the_process_exits() -> None:
    """Before: every ``ipc_endpoint`` left a ``kv_events_*`` directory in the temp directory for good."""
    made = subprocess.run(
        [sys.executable, "-c", "from tests.events_helpers import ipc_endpoint; print(ipc_endpoint('live'))"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, check=True,
    )
    endpoint = made.stdout.strip()
    assert endpoint.startswith("ipc://") and endpoint.endswith("/live")
    assert not Path(endpoint[len("ipc://") :]).parent.exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        # Each ended in a traceback (zmq.ZMQError, ValueError, OverflowError) or argparse's multi-line usage before;
        # --count 0 and --timeout -1 listened for nothing and exited 0.
        ([], "the following arguments are required: endpoint"),
        (["not an endpoint"], "endpoint 'not an endpoint': Invalid argument"),
        ([""], "endpoint '': Invalid argument"),
        (["tcp://127.0.0.1:1", "--timeout", "nan"], "--timeout must be seconds from 0 to 1,000,000, got nan"),
        (["tcp://127.0.0.1:1", "--timeout", "inf"], "--timeout must be seconds from 0 to 1,000,000, got inf"),
        (["tcp://127.0.0.1:1", "--timeout", "-1"], "--timeout must be seconds from 0 to 1,000,000, got -1.0"),
        (["tcp://127.0.0.1:1", "--count", "0"], "--count must be >= 1, got 0"),
        # Accepted before: the replay socket connects at the first gap, whose replay then failed into "skipped:".
        (["tcp://127.0.0.1:1", "--timeout", "0.1", "--replay", "bogus"], "--replay 'bogus': Invalid argument"),
        (["tcp://127.0.0.1:1", "--timeout", "0.1", "--replay", "nope://x"], "--replay 'nope://x': Protocol not supported"),
    ],
    ids=["no-endpoint", "bad-endpoint", "empty-endpoint", "nan", "inf", "negative-timeout", "zero-count",
         "bad-replay", "unknown-replay-protocol"],
)
def test_events_listen_usage_errors_are_one_line(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kv_cache_manager_v2.kv_events.listen import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err
    assert errors.startswith("error: ") and errors.count("\n") == 1 and words in errors, errors
