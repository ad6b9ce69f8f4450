"""A gap's replay answered by a publisher that restarted after the gap was seen (the wire carries no publisher
epoch): real publishers on ipc:// endpoints, the first closed and a second bound on the same endpoints while the
live batch that revealed the gap waits in the subscriber's queue. The replayed batches must belong to the stream
the gap came from: stamped no later than the live batch after the gap, from the same data-parallel rank."""

from __future__ import annotations

import time

from tests.events_helpers import ipc_endpoint, require_events_extra

require_events_extra()

from kv_cache_manager_v2.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from kv_cache_manager_v2.kv_events.subscriber import EventSubscriber, Gap, ReceivedBatch, Restart  # noqa: E402
from tests.test_kv_events_transport import JOIN_S, RECEIVE_MS, batch_events  # noqa: E402

# The first publisher's batches are stamped from 1000 s, the second's (a later process) from 2000 s.
FIRST_TS, SECOND_TS = 1000.0, 2000.0


def received(subscriber: EventSubscriber, count: int) -> list[ReceivedBatch]:
    got = [subscriber.receive(RECEIVE_MS) for _ in range(count)]
    assert all(batch is not None for batch in got)
    return [batch for batch in got if batch is not None]


def gap_then_restart(
    second_batches: int, first_last: int = 5
) -> tuple[ZmqEventPublisher, EventSubscriber, list[Restart]]:
    """The first publisher sends 0..``first_last``; a subscriber that last saw batch 1 joins before 5 only (a gap
    2..4 in its queue); the first publisher closes and a second binds the same endpoints and publishes
    ``second_batches`` batches (numbered from 0, their events those of 100 + seq) before the subscriber reads
    anything."""
    live, replay = ipc_endpoint("live"), ipc_endpoint("replay")
    first = ZmqEventPublisher(live, replay)
    for seq in range(5):
        first.publish(batch_events(seq), ts=FIRST_TS + seq)
    assert first.wait_sent()
    restarts: list[Restart] = []
    subscriber = EventSubscriber(live, replay_endpoint=replay, last_seq=1, on_restart=restarts.append)
    time.sleep(JOIN_S)
    for seq in range(5, first_last + 1):
        first.publish(batch_events(seq), ts=FIRST_TS + seq)
    first.close()  # sends batch 5 first (the PUB socket lingers until it is out)
    second = ZmqEventPublisher(live, replay)
    for seq in range(second_batches):
        second.publish(batch_events(100 + seq), ts=SECOND_TS + seq)
    assert second.wait_sent()
    return second, subscriber, restarts


def test_a_replay_answered_by_a_publisher_restarted_after_the_gap_recovers_nothing() -> None:
    """Before: the second publisher's batches 2..4 were handed out first, as the first one's, replayed ('assert
    [(2, True, 2002.0)] == [(5, False, 1005.0)]'). Now the replay is refused (recorded in ``skipped``), the gap
    reported with nothing recovered."""
    second, subscriber, restarts = gap_then_restart(5)
    try:
        got = received(subscriber, 1)
        assert [(batch.seq, batch.replayed, batch.batch.ts) for batch in got] == [(5, False, FIRST_TS + 5)]
        assert got[0].batch.events == tuple(batch_events(5))
        assert subscriber.gaps == [Gap(2, 5, 0)] and restarts == []
        assert subscriber.skipped == [
            "the replay of batches 2..4: batch 2 is stamped 2002.0, after the batch that revealed the gap "
            "(1005.0): a publisher restarted since answered"
        ]
    finally:
        subscriber.close()
        second.close()


def follows_the_second(
    second: ZmqEventPublisher, subscriber: EventSubscriber, restarts: list[Restart], previous_seq: int
) -> None:
    """Once the SUB socket reconnected, the second publisher's batch 10 is a ``Restart`` after ``previous_seq``
    (recorded before its first batch is handed out) and its batches 0..9 are replayed before it."""
    assert subscriber.receive(int(JOIN_S * 2000)) is None  # the SUB socket reconnects to the second meanwhile
    second.publish(batch_events(110), ts=SECOND_TS + 10)
    got = received(subscriber, 1)
    assert restarts == [Restart(previous_seq, 10)] and subscriber.restarts == restarts
    got += received(subscriber, 10)
    assert [(batch.seq, batch.replayed) for batch in got] == [(seq, seq < 10) for seq in range(11)]
    assert [batch.batch.events for batch in got] == [tuple(batch_events(100 + seq)) for seq in range(11)]
    assert subscriber.gaps == [Gap(2, 5, 0), Gap(0, 10, 10)] and subscriber.last_seq == 10


def test_after_a_replay_from_a_newer_publisher_its_next_live_batch_is_a_restart_whatever_its_number() -> None:
    """The second publisher numbered past the first (0..9 before the subscriber reconnected): its batch 10 after
    the first's 5 looked like a gap 6..9 of the same stream, the restart never reported ('assert [] ==
    [Restart(previous_seq=5, first_seq=10)]'). Now it is a restart, its batches from 0 replayed before it."""
    second, subscriber, restarts = gap_then_restart(10)
    try:
        assert [batch.seq for batch in received(subscriber, 1)] == [5]
        follows_the_second(second, subscriber, restarts, previous_seq=5)
    finally:
        subscriber.close()
        second.close()


def test_the_old_publishers_batches_read_after_a_newer_ones_replay_stay_on_its_stream() -> None:
    """The first publisher's batches 6 and 7 were queued behind 5 when the second answered the gap's replay: 6 was
    taken as the second's first batch, its gap 0..5 answered by the second again, and 7 taken as another restart
    ('Left contains 2 more items, first extra item: Restart(previous_seq=5, first_seq=6)'). Now 6 and 7 go on the
    first's stream; the second's 10, stamped after its refused answer, is the restart."""
    second, subscriber, restarts = gap_then_restart(10, first_last=7)
    try:
        got = received(subscriber, 3)
        assert [(batch.seq, batch.replayed, batch.batch.ts) for batch in got] == [
            (seq, False, FIRST_TS + seq) for seq in (5, 6, 7)
        ]
        assert restarts == [] and subscriber.gaps == [Gap(2, 5, 0)]
        follows_the_second(second, subscriber, restarts, previous_seq=7)
    finally:
        subscriber.close()
        second.close()


def test_a_constant_clock_hides_a_restart_and_its_replay_reads_as_recovered() -> None:
    """What the stamps check relies on, pinned: with ``clock=lambda: 0.0`` (every batch stamped 0) a replay that a
    restarted publisher answered cannot be told from the old stream's. The second publisher's 2..4 are handed out
    as the gap's recovered batches, and no ``Restart`` is recorded (README: the clock must be a wall clock,
    increasing across restarts)."""
    live, replay = ipc_endpoint("live"), ipc_endpoint("replay")
    first = ZmqEventPublisher(live, replay)
    for seq in range(5):
        first.publish(batch_events(seq), ts=0.0)
    assert first.wait_sent()
    subscriber = EventSubscriber(live, replay_endpoint=replay, last_seq=1)
    time.sleep(JOIN_S)
    first.publish(batch_events(5), ts=0.0)
    first.close()
    second = ZmqEventPublisher(live, replay)
    for seq in range(5):
        second.publish(batch_events(100 + seq), ts=0.0)
    assert second.wait_sent()
    try:
        got = received(subscriber, 4)
        assert [(batch.seq, batch.replayed) for batch in got] == [(2, True), (3, True), (4, True), (5, False)]
        assert [batch.batch.events for batch in got[:3]] == [tuple(batch_events(100 + seq)) for seq in (2, 3, 4)]
        assert subscriber.gaps == [Gap(2, 5, 3)] and subscriber.restarts == [] and subscriber.skipped == []
    finally:
        subscriber.close()
        second.close()


def test_a_replay_endpoint_of_another_rank_recovers_nothing() -> None:
    """A subscriber of rank 0 given rank 1's replay endpoint (vLLM offsets both per rank): before, rank 1's
    batches were handed out as rank 0's ('assert [(2, True, 1), (3, True, 1)] == [(5, False, 0), (6, False,
    0)]'). The replay is refused and the stream goes on: no restart."""
    live, replay = ipc_endpoint("live"), ipc_endpoint("replay")
    ranks = [ZmqEventPublisher(live, replay, data_parallel_rank=rank) for rank in (0, 1)]
    for publisher in ranks:
        for seq in range(5):  # before the subscriber joins: it misses them
            publisher.publish(batch_events(seq), ts=FIRST_TS + seq)
        assert publisher.wait_sent()
    subscriber = EventSubscriber(ranks[0].endpoint, replay_endpoint=ranks[1].replay_endpoint, last_seq=1)
    try:
        time.sleep(JOIN_S)
        ranks[0].publish(batch_events(5), ts=FIRST_TS + 5)
        ranks[0].publish(batch_events(6), ts=FIRST_TS + 6)
        got = received(subscriber, 2)
        assert [(batch.seq, batch.replayed, batch.batch.data_parallel_rank) for batch in got] == [
            (5, False, 0), (6, False, 0)
        ]
        assert subscriber.gaps == [Gap(2, 5, 0)] and subscriber.restarts == []
        assert subscriber.skipped == [
            "the replay of batches 2..4: batch 2 is of data_parallel_rank 1, the batch that revealed the gap of 0: "
            "the replay endpoint is another rank's"
        ]
    finally:
        subscriber.close()
        for publisher in ranks:
            publisher.close()
