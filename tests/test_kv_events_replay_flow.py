"""Replays longer than ZeroMQ's high-water marks, from a real publisher, and replay answers with holes or ending
short of the gap from a hand-driven one: a subscriber hands out a gap's batches as one consecutive run reaching the
batch after the gap, or none of them."""

from __future__ import annotations

import threading
import time

import pytest

from tests.events_helpers import ipc_endpoint, require_events_extra

require_events_extra()

import zmq  # noqa: E402

from kv_cache_manager_v2.kv_events.publisher import MAX_REPLAY_ANSWERS, ZmqEventPublisher  # noqa: E402
from kv_cache_manager_v2.kv_events.subscriber import EventSubscriber, Gap  # noqa: E402
from kv_cache_manager_v2.kv_events.wire import BlockStored, WireEvent  # noqa: E402
from tests.test_kv_events_gap_replay import batch_frames  # noqa: E402
from tests.test_kv_events_transport import JOIN_S, RECEIVE_MS, rogue_peer, seq_bytes  # noqa: E402

# Far above what a ROUTER socket (1,000) and a DEALER socket (1,000) queue between them by default.
MISSED = 5_000


def small_batch(seq: int) -> list[WireEvent]:
    return [BlockStored((seq,), None, (seq, seq), 2, None, "GPU", None)]


def test_a_gap_longer_than_the_high_water_marks_is_replayed_whole_and_in_order() -> None:
    """Before: the publisher's ROUTER dropped what its pipe to the reader could not hold, the end marker among
    them; the replay waited for it until its timeout and recovered nothing ('Gap(first_missing=1,
    next_received=5001, recovered=0) != Gap(first_missing=1, next_received=5001, recovered=5000)'; with 20,000
    missed, the replay handed out 9,026 batches with 12 holes as recovered)."""
    live, replay = ipc_endpoint("live"), ipc_endpoint("replay")
    publisher = ZmqEventPublisher(live, replay)
    subscriber: EventSubscriber | None = None
    try:
        for seq in range(MISSED + 1):  # before the subscriber joins: it misses all but 0, which it saw before
            publisher.publish(small_batch(seq), ts=float(seq))
        assert publisher.wait_sent()
        subscriber = EventSubscriber(live, replay_endpoint=replay, last_seq=0)
        time.sleep(JOIN_S)
        publisher.publish(small_batch(MISSED + 1), ts=float(MISSED + 1))
        got = [subscriber.receive(RECEIVE_MS)]
        assert subscriber.gaps == [Gap(1, MISSED + 1, MISSED)] and subscriber.skipped == []
        while len(got) <= MISSED and got[-1] is not None:
            got.append(subscriber.receive(RECEIVE_MS))
        assert [(batch.seq, batch.replayed) for batch in got if batch is not None] == [
            (seq, seq <= MISSED) for seq in range(1, MISSED + 2)
        ]
        assert all(batch is not None and batch.batch.events == tuple(small_batch(batch.seq)) for batch in got)
    finally:
        if subscriber is not None:
            subscriber.close()
        publisher.close()


def answer_with(router: zmq.Socket[bytes], numbers: list[int]) -> None:
    """Answer one replay request with the batches ``numbers``, then the end marker."""
    identity, _, _ = router.recv_multipart()
    for seq in numbers:
        router.send_multipart([identity, *batch_frames(seq)])
    router.send_multipart([identity, b"", seq_bytes(-1), b""])


@pytest.mark.parametrize(
    ("numbers", "recovered", "reason"),
    [
        ([1, 3, 4], 0, "answered batch 3 after 1, a hole"),
        ([1, 2, 3, 5], 0, "answered batch 5 after 3, a hole"),
        ([1, 2], 0, "ended at batch 2, short of the gap's last 3"),
        ([2, 3, 4], 2, None),  # the buffer no longer reached back to 1: the last two, consecutive
        ([4, 5], 0, None),  # nothing of the gap is buffered any more
    ],
)
def test_a_gap_replay_with_a_hole_or_ending_short_recovers_nothing(
    numbers: list[int], recovered: int, reason: str | None
) -> None:
    """Before: the batches answered were handed out as recovered, the stream with a hole the ``Gap`` did not
    place ('assert [(1, True)] == [(4, False)]'); the last ``recovered`` batches of a gap are now the ones
    replayed, consecutive up to the batch after it."""
    with rogue_peer("holes", replay=True, last_seq=0) as peer:
        assert peer.router is not None
        answering = threading.Thread(target=answer_with, args=(peer.router, numbers))
        answering.start()
        try:
            peer.pub.send_multipart(batch_frames(4))
            got = [peer.subscriber.receive(RECEIVE_MS) for _ in range(recovered + 1)]
        finally:
            answering.join(5)
        assert [(batch.seq, batch.replayed) for batch in got if batch is not None] == [
            *[(seq, True) for seq in range(4 - recovered, 4)], (4, False)
        ]
        assert peer.subscriber.gaps == [Gap(1, 4, recovered)]
        skipped = peer.subscriber.skipped
        assert skipped == ([] if reason is None else [skipped[0]]) and (reason is None or reason in skipped[0])


def ask(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    """A DEALER socket that asked for every buffered batch (and reads nothing yet)."""
    dealer: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", seq_bytes(0)])
    return dealer


def read_answer(dealer: zmq.Socket[bytes], timeout_ms: int) -> tuple[int, bool]:
    """Batches read and whether the end marker came, waiting at most ``timeout_ms`` for each message."""
    count = 0
    while dealer.poll(timeout_ms):
        if dealer.recv_multipart()[1] == seq_bytes(-1):
            return count, True
        count += 1
    return count, False


@pytest.fixture
def full_publisher() -> ZmqEventPublisher:
    publisher = ZmqEventPublisher(ipc_endpoint("live"), ipc_endpoint("replay"))
    for seq in range(MISSED):
        publisher.publish(small_batch(seq), ts=float(seq))
    assert publisher.wait_sent()
    return publisher


def test_a_reader_that_leaves_mid_answer_does_not_stop_the_publisher(full_publisher: ZmqEventPublisher) -> None:
    """A replay reader gone with most of its answer unsent: the publisher drops that answer (ZeroMQ's
    EHOSTUNREACH, which the background thread must not die of) and goes on publishing and answering."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    publisher = full_publisher
    assert publisher.replay_endpoint is not None
    try:
        gone = ask(context, publisher.replay_endpoint)
        assert gone.poll(RECEIVE_MS)  # the answer began
        gone.close(linger=0)
        publisher.publish(small_batch(MISSED), ts=float(MISSED))
        assert publisher.wait_sent()
        reader = ask(context, publisher.replay_endpoint)
        try:
            assert read_answer(reader, RECEIVE_MS) == (MISSED + 1, True)
        finally:
            reader.close(linger=0)
        assert publisher.publish(small_batch(MISSED + 1), ts=float(MISSED + 1)) == MISSED + 1
        assert publisher.wait_sent()
    finally:
        publisher.close()


def test_readers_that_ask_and_never_read_hold_at_most_the_newest_answers(full_publisher: ZmqEventPublisher) -> None:
    """Each answer under way keeps the buffer's list as it was: a newer request beyond ``MAX_REPLAY_ANSWERS``
    abandons the oldest (its reader gets what its pipe held, never the end marker), and the newest are whole."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    publisher = full_publisher
    assert publisher.replay_endpoint is not None
    dealers: list[zmq.Socket[bytes]] = []
    try:
        for _ in range(MAX_REPLAY_ANSWERS + 1):
            dealers.append(ask(context, publisher.replay_endpoint))
            assert dealers[-1].poll(RECEIVE_MS)  # taken in this order
        count, ended = read_answer(dealers[0], 2_000)
        assert 0 < count < MISSED and not ended
        for dealer in dealers[1:]:
            assert read_answer(dealer, RECEIVE_MS) == (MISSED, True)
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        publisher.close()


def test_a_replay_asked_for_by_hand_with_a_hole_is_refused() -> None:
    """``replay(start)`` too: before, batches 0 and 2 came back as the buffer ('DID NOT RAISE')."""
    with rogue_peer("hand", replay=True) as peer:
        assert peer.router is not None
        answering = threading.Thread(target=answer_with, args=(peer.router, [0, 2]))
        answering.start()
        try:
            with pytest.raises(ValueError, match="answered batch 2 after 0, a hole"):
                peer.subscriber.replay(0)
        finally:
            answering.join(5)
