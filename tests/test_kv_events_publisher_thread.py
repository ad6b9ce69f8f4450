"""The publisher's background thread (real ZMQ sockets on loopback): a publisher dropped without ``close`` still
sends what it queued and its thread ends (closing the sockets), and a stream of replay requests neither holds
back live batches nor ``close``."""

from __future__ import annotations

import gc
import threading
import time
from typing import Callable, Iterator

import pytest

from tests.events_helpers import TCP_ANY_PORT, require_events_extra

require_events_extra()

import zmq  # noqa: E402

from kv_cache_manager_v2.kv_events.publisher import ZmqEventPublisher  # noqa: E402
from kv_cache_manager_v2.kv_events.subscriber import EventSubscriber  # noqa: E402
from kv_cache_manager_v2.kv_events.wire import AllBlocksCleared  # noqa: E402

JOIN_S = 0.3  # a local SUB socket's subscription reaching the PUB socket (ZMQ's slow joiner)
WAIT_S = 5.0


def started_thread(make: Callable[[], ZmqEventPublisher]) -> tuple[ZmqEventPublisher, threading.Thread]:
    """A new publisher and the background thread it started."""
    before = set(threading.enumerate())
    publisher = make()
    (thread,) = [thread for thread in threading.enumerate() if thread not in before]
    return publisher, thread


def test_a_dropped_publisher_sends_what_it_queued_and_its_thread_ends() -> None:
    publisher, thread = started_thread(lambda: ZmqEventPublisher(TCP_ANY_PORT, TCP_ANY_PORT, topic="kv"))
    subscriber = EventSubscriber(publisher.endpoint, "kv")
    time.sleep(JOIN_S)
    try:
        publisher.publish([AllBlocksCleared()], ts=1.0)
        del publisher
        gc.collect()
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the thread of a dropped publisher runs on (and keeps its sockets open)"
        received = subscriber.receive(int(WAIT_S * 1000))
        assert received is not None and received.seq == 0 and received.batch.events == (AllBlocksCleared(),)
    finally:
        subscriber.close()


def replay_client(publisher: ZmqEventPublisher) -> zmq.Socket[bytes]:
    client: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(str(publisher.replay_endpoint))
    return client


def ask_for_the_last_batch(client: zmq.Socket[bytes]) -> None:
    """A replay request for batch 999 and its two answers (the batch, the end)."""
    client.send_multipart((b"", (999).to_bytes(8, "big", signed=True)))
    for _ in range(2):
        assert client.poll(int(WAIT_S * 1000))
        client.recv_multipart()


@pytest.fixture
def replay_flood() -> Iterator[tuple[ZmqEventPublisher, threading.Thread]]:
    """A publisher with 1,000 batches buffered and a client asking for all of them again, without pause, from
    before the test's first line (the requests queued already reach ZMQ's high-water mark) to after its last. The
    client reads no answer (the ROUTER socket drops what goes over its high-water mark): each request still costs
    the publisher's thread its 1,001 sends."""
    publisher, thread = started_thread(lambda: ZmqEventPublisher(TCP_ANY_PORT, TCP_ANY_PORT, buffer_steps=1000))
    for _ in range(1000):
        publisher.publish([AllBlocksCleared()], ts=0.0)
    assert publisher.wait_sent(WAIT_S)
    client, probe = replay_client(publisher), replay_client(publisher)
    ask_for_the_last_batch(client)  # connected
    stop = threading.Event()
    backlog_full = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                client.send_multipart((b"", (0).to_bytes(8, "big", signed=True)), zmq.NOBLOCK)
            except zmq.Again:  # the requests queued reach ZMQ's high-water mark: plenty to answer
                backlog_full.set()
                time.sleep(0.001)

    flooding = threading.Thread(target=flood)
    flooding.start()
    try:
        assert backlog_full.wait(WAIT_S)
        ask_for_the_last_batch(probe)  # answered: the thread is busy with the flood's requests
        yield publisher, thread
    finally:
        stop.set()
        flooding.join()
        client.close(linger=0)
        probe.close(linger=0)
        publisher.close()


def test_replay_requests_do_not_hold_back_live_batches(
    replay_flood: tuple[ZmqEventPublisher, threading.Thread],
) -> None:
    publisher, _ = replay_flood
    for _ in range(3):
        publisher.publish([AllBlocksCleared()], ts=1.0)
        assert publisher.wait_sent(WAIT_S), "live batches wait for replay requests to stop coming"


def test_close_ends_the_thread_while_replay_requests_keep_coming(
    replay_flood: tuple[ZmqEventPublisher, threading.Thread],
) -> None:
    publisher, thread = replay_flood
    publisher.close()
    assert not thread.is_alive(), "close returned with the thread still serving replay requests"
