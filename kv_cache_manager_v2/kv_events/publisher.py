"""The ZMQ side of vLLM's KV event protocol: a PUB socket for live batches and an optional ROUTER socket that
replays buffered ones.

Each batch goes out as three frames: topic, an 8-byte big-endian sequence number (0, 1, 2, ... per publisher),
and the msgpack payload (``wire.encode_batch``). A subscriber that missed sequence numbers sends the first one it
wants (8 bytes, big-endian, behind an empty delimiter frame as a REQ socket sends it) to the replay socket and
gets ``[seq, payload]`` for every batch still buffered from there on, then ``[-1, b""]``.

Threading: ``publish`` encodes on the caller's thread and queues the message; one background thread owns both
sockets from then on, sends queued messages in order, and answers replay requests at any time (also while the
engine is idle), one new request between two rounds of live sends.

A replay answer longer than the ROUTER socket's high-water mark is sent as its reader takes it (``ROUTER_MANDATORY``:
a full pipe refuses the message instead of dropping it, the end marker included), the rest kept for the next
rounds; it is the buffer as it was at the request (references to the same payloads), so it has no holes when the
buffer moves on meanwhile. ``close`` (or dropping the publisher) sends what
is queued, then stops the thread, which closes the sockets.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Final, Sequence, SupportsFloat, SupportsIndex, Union, final

import zmq

from .wire import END_SEQ, SEQ_BYTES, EventBatch, WireEvent, encode_batch
from .._base.types import Sealed
from .._base.validation import INT64_LIMIT, as_bounded_float, as_float, as_int_in, as_str

DEFAULT_BUFFER_STEPS: Final = 10_000
DEFAULT_HWM: Final = 100_000
# How long the background thread waits for a message before looking at the replay socket again.
POLL_S: Final = 0.02
CLOSE_TIMEOUT_S: Final = 5.0
# Replay answers being sent at once: a newer request abandons the oldest (its reader gets no end marker and times
# out), so peers that ask and never read cannot pin more than this many copies of the buffer's list.
MAX_REPLAY_ANSWERS: Final = 16
_STOP: Final = "stop"


def _not_negative(seconds: float) -> bool:
    return seconds >= 0.0


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard host or a local transport binds (stable side), anything else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


MAX_PORT: Final = 65535
# ZeroMQ keeps the high-water mark in a C int.
HWM_LIMIT: Final = 1 << 31


def check_tcp_port(endpoint: str, name: str) -> str:
    """``endpoint`` as it is; ``ValueError`` naming ``name`` for a tcp port past ``MAX_PORT`` (ZeroMQ bound
    ``tcp://*:99999`` to port 34463, the number modulo 2**16, and connected likewise, without a word)."""
    port = endpoint.rpartition(":")[2] if endpoint.startswith("tcp://") else ""
    digits = port.lstrip("0")
    if port.isascii() and port.isdigit() and (len(digits) > len(str(MAX_PORT)) or int(digits or "0") > MAX_PORT):
        raise ValueError(f"{name} {endpoint}: port {port} is past the last TCP port {MAX_PORT}")
    return endpoint


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """vLLM's per-rank endpoints: rank r adds r to a tcp port, appends ``_dp<r>`` to inproc/ipc names."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port == "*":
            return endpoint
        if int(port) + data_parallel_rank > MAX_PORT:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} moves {endpoint!r} past the last TCP port {MAX_PORT}"
            )
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


@final
class ZmqEventPublisher(Sealed):
    """Sends event batches in vLLM's format and keeps the last ``buffer_steps`` of them for replay.

    ``endpoint`` follows vLLM's rule (``binds``): ``tcp://*:5557`` or ``ipc://...`` binds, ``tcp://host:5557``
    connects; ``tcp://127.0.0.1:*`` binds a free port, read back from ``endpoint``. The data-parallel rank
    offsets both endpoints (``offset_endpoint``) and goes into every batch.

    A publisher dropped without ``close`` stops its thread, which then closes the sockets: the thread holds the
    ``_SocketWorker`` only, never the publisher, so the publisher can be collected.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: SupportsIndex = DEFAULT_BUFFER_STEPS,
        data_parallel_rank: SupportsIndex = 0,
        hwm: SupportsIndex = DEFAULT_HWM,
    ) -> None:
        self._closed = True  # until the thread runs (``__del__`` of a half-made publisher has nothing to stop)
        # All checked before a socket exists: the replay buffer is a deque (its length a C size), hwm a C int, the
        # rank an integer of every batch (MessagePack: 64 bits) and an offset of the TCP ports.
        steps = as_int_in(buffer_steps, "buffer_steps", 1, INT64_LIMIT)
        rank = as_int_in(data_parallel_rank, "data_parallel_rank", 0, INT64_LIMIT)
        high_water_mark = as_int_in(hwm, "hwm", 0, HWM_LIMIT)
        as_str(topic, "topic")
        offset_endpoint(check_tcp_port(as_str(endpoint, "endpoint"), "endpoint"), rank)
        if replay_endpoint is not None:
            offset_endpoint(check_tcp_port(as_str(replay_endpoint, "replay_endpoint"), "replay_endpoint"), rank)
        self.topic: bytes = topic.encode()
        self.data_parallel_rank = rank
        self._next_seq = 0
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
        replay: zmq.Socket[bytes] | None = None
        try:
            pub.set_hwm(high_water_mark)
            live = offset_endpoint(endpoint, rank)
            if binds(live):
                pub.bind(live)
                live = _last_endpoint(pub)
            else:
                pub.connect(live)
            self.endpoint = live
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                replay.bind(offset_endpoint(replay_endpoint, rank))
                self.replay_endpoint = _last_endpoint(replay)
        except BaseException:
            _close_sockets(pub, replay)
            raise
        self._sockets = _SocketWorker(self.topic, pub, replay, steps)
        # Not ``_thread``: mypyc names the C field ``__thread``, a C keyword, and the build fails.
        self._worker: threading.Thread = threading.Thread(
            target=self._sockets.run, name="kv-events-publisher", daemon=True
        )
        self._worker.start()
        self._closed = False

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry (batches published so far)."""
        return self._next_seq

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (nothing can be published any more)."""
        return self._closed

    @property
    def sent(self) -> int:
        """Batches handed to the PUB socket (by the background thread)."""
        return self._sockets.sent

    def publish(self, events: Sequence[WireEvent], ts: SupportsFloat) -> int:
        """Queue one batch for sending, stamped ``ts`` (seconds; a finite number); its sequence number. Subscribers
        tell a restarted publisher's replay by its stamps (``EventSubscriber``): stamp with a wall clock that keeps
        increasing across restarts, as vLLM does (``time.time()``)."""
        stamp = as_float(ts, "ts")
        if self._closed:
            raise ValueError("the publisher is closed")
        payload = encode_batch(EventBatch(stamp, tuple(events), self.data_parallel_rank))
        seq = self._next_seq
        self._next_seq += 1
        self._sockets.queue.put((seq, payload))
        return seq

    def wait_sent(self, timeout_s: SupportsFloat = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every published batch has been handed to the PUB socket; False on timeout. ``ValueError``
        for a ``timeout_s`` below 0, NaN or infinite (NaN waited without end), ``TypeError`` for a non-number."""
        deadline = time.monotonic() + as_bounded_float(timeout_s, "timeout_s", "[0, inf)", _not_negative)
        while self._sockets.sent < self._next_seq:
            if time.monotonic() > deadline or not self._worker.is_alive():
                return False
            time.sleep(POLL_S / 4)
        return True

    def close(self) -> None:
        """Send what is queued, stop the thread (which closes the sockets); calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._sockets.queue.put(_STOP)
        self._worker.join(CLOSE_TIMEOUT_S)

    def __del__(self) -> None:
        # Only queue the stop (the collector may run this on any thread, the publisher's own included): the thread
        # sends what is queued and closes the sockets on its way out.
        try:
            closed = self._closed
        except AttributeError:  # compiled, mypyc's own argument check refused the construction: nothing was set
            return
        if not closed:
            self._closed = True
            self._sockets.queue.put(_STOP)


class _SocketWorker:
    """What the background thread owns: both sockets, the queue of batches to send, the replay buffer and the
    replay answers under way.

    Fair to both sides: each round goes on with the answers under way as far as their readers' pipes take them,
    reads at most one new replay request, then sends the batches queued by then, so neither a stream of replay
    requests nor a busy engine holds the other back (and ``close`` ends in time)."""

    def __init__(
        self, topic: bytes, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None, buffer_steps: int
    ) -> None:
        self.topic = topic
        self.pub = pub
        self.replay = replay
        self.queue: queue.Queue[Union[tuple[int, bytes], str]] = queue.Queue()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.sent: int = 0  # batches handed to the PUB socket
        self.answers: list[_ReplayAnswer] = []  # oldest first; one client's answers go out in that order

    def run(self) -> None:
        """The background thread: send queued batches, answer replay requests, until stopped; then close."""
        try:
            while self._round():
                pass
        finally:
            _close_sockets(self.pub, self.replay)

    def _round(self) -> bool:
        """Answer one replay request, then send what is queued (waiting briefly when nothing was); False at stop."""
        answered = self._answer_replay()
        for _ in range(max(1, self.queue.qsize())):
            try:  # wait for a batch only when no replay request was answered (more may be waiting)
                item = self.queue.get_nowait() if answered else self.queue.get(timeout=POLL_S)
            except queue.Empty:
                return True
            if isinstance(item, str):
                return False
            seq, payload = item
            self.pub.send_multipart((self.topic, seq_frame(seq), payload))
            self.buffer.append((seq, payload))
            self.sent = seq + 1
        return True

    def _answer_replay(self) -> bool:
        """Go on with the answers under way, then take one new replay request if one waits (a malformed one is
        dropped); whether anything was sent or read."""
        replay = self.replay
        if replay is None:
            return False
        progressed = self._send_answers(replay)
        if not replay.poll(0):
            return progressed
        frames = replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
            return True
        client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        if len(self.answers) >= MAX_REPLAY_ANSWERS:
            del self.answers[0]
        self.answers.append(_ReplayAnswer(client, [(seq, payload) for seq, payload in self.buffer if seq >= start]))
        self._send_answers(replay)
        return True

    def _send_answers(self, replay: zmq.Socket[bytes]) -> bool:
        """Send what each client's oldest answer has left until its pipe is full; whether any message went."""
        progressed = False
        busy: set[bytes] = set()
        for answer in list(self.answers):
            if answer.client in busy:
                continue
            busy.add(answer.client)
            try:
                while answer.sent <= len(answer.batches):
                    seq, payload = answer.batches[answer.sent] if answer.sent < len(answer.batches) else (END_SEQ, b"")
                    replay.send_multipart((answer.client, b"", seq_frame(seq), payload), zmq.DONTWAIT)
                    answer.sent += 1
                    progressed = True
            except zmq.Again:
                continue  # its pipe is full: the rest at a later round
            except zmq.ZMQError:
                pass  # EHOSTUNREACH: the client left, nobody to answer
            self.answers.remove(answer)
        return progressed


@final
class _ReplayAnswer:
    """What is left to send of one replay request's answer: the buffered batches from its start, as the buffer was
    when the request came, then the end marker."""

    def __init__(self, client: bytes, batches: list[tuple[int, bytes]]) -> None:
        self.client = client
        self.batches = batches
        self.sent = 0  # messages sent: ``batches[:sent]``, the end marker too once ``sent > len(batches)``


def _close_sockets(pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
    pub.close(linger=int(CLOSE_TIMEOUT_S * 1000))
    if replay is not None:
        replay.close(linger=0)


def _last_endpoint(socket: zmq.Socket[bytes]) -> str:
    value = socket.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
