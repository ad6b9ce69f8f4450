"""The ZMQ side of vLLM's KV event protocol: a PUB socket for live batches and an optional ROUTER socket that
replays buffered ones.

Each batch goes out as three frames: topic, an 8-byte big-endian sequence number (0, 1, 2, ... per publisher),
and the msgpack payload (``wire.encode_batch``). A subscriber that missed sequence numbers sends the first one it
wants (8 bytes, big-endian, behind an empty delimiter frame as a REQ socket sends it) to the replay socket and
gets ``[seq, payload]`` for every batch still buffered from there on, then ``[-1, b""]``.

Threading: ``publish`` encodes on the caller's thread and queues the message; one background thread owns both
sockets from then on, sends queued messages in order, and answers replay requests at any time (also while the
engine is idle). ``close`` sends what is queued, then stops the thread and closes the sockets.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Final, Sequence, Union, final

import zmq

from .wire import END_SEQ, SEQ_BYTES, EventBatch, WireEvent, encode_batch
from .._base.types import Sealed

DEFAULT_BUFFER_STEPS: Final = 10_000
DEFAULT_HWM: Final = 100_000
# How long the background thread waits for a message before looking at the replay socket again.
POLL_S: Final = 0.02
CLOSE_TIMEOUT_S: Final = 5.0
_STOP: Final = "stop"


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard host or a local transport binds (stable side), anything else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """vLLM's per-rank endpoints: rank r adds r to a tcp port, appends ``_dp<r>`` to inproc/ipc names."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port == "*":
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


@final
class ZmqEventPublisher(Sealed):
    """Sends event batches in vLLM's format and keeps the last ``buffer_steps`` of them for replay.

    ``endpoint`` follows vLLM's rule (``binds``): ``tcp://*:5557`` or ``ipc://...`` binds, ``tcp://host:5557``
    connects; ``tcp://127.0.0.1:*`` binds a free port, read back from ``endpoint``. The data-parallel rank
    offsets both endpoints (``offset_endpoint``) and goes into every batch.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        data_parallel_rank: int = 0,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be > 0, got {buffer_steps}")
        if data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
        self.topic: bytes = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[Union[tuple[int, bytes], str]] = queue.Queue()
        self._next_seq = 0
        self.sent: int = 0  # batches handed to the PUB socket (written by the background thread)
        self._closed = False
        # Not ``_thread``: mypyc names the C field ``__thread``, a C keyword, and the build fails.
        self._worker: threading.Thread | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._pub: zmq.Socket[bytes] = self._context.socket(zmq.PUB)
        try:
            self._pub.set_hwm(hwm)
            live = offset_endpoint(endpoint, data_parallel_rank)
            if binds(live):
                self._pub.bind(live)
                live = self._last_endpoint(self._pub)
            else:
                self._pub.connect(live)
            self.endpoint = live
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(offset_endpoint(replay_endpoint, data_parallel_rank))
                self.replay_endpoint = self._last_endpoint(self._replay)
        except BaseException:
            self._closed = True
            self._close_sockets()
            raise
        self._worker = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._worker.start()

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry (batches published so far)."""
        return self._next_seq

    def publish(self, events: Sequence[WireEvent], ts: float) -> int:
        """Queue one batch for sending; its sequence number."""
        if self._closed:
            raise ValueError("the publisher is closed")
        payload = encode_batch(EventBatch(ts, tuple(events), self.data_parallel_rank))
        seq = self._next_seq
        self._next_seq += 1
        self._queue.put((seq, payload))
        return seq

    def wait_sent(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every published batch has been handed to the PUB socket; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.sent < self._next_seq:
            if time.monotonic() > deadline or not self._thread_alive():
                return False
            time.sleep(POLL_S / 4)
        return True

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._queue.put(_STOP)
            self._worker.join(CLOSE_TIMEOUT_S)
        if not self._thread_alive():
            self._close_sockets()

    def _thread_alive(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def _close_sockets(self) -> None:
        self._pub.close(linger=int(CLOSE_TIMEOUT_S * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        """The background thread: send queued batches, answer replay requests, until ``close``."""
        while True:
            self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, str):
                return
            seq, payload = item
            self._pub.send_multipart((self.topic, seq_frame(seq), payload))
            self._buffer.append((seq, payload))
            self.sent = seq + 1

    def _serve_replay(self) -> None:
        """Answer every replay request waiting now; malformed requests are dropped."""
        replay = self._replay
        if replay is None:
            return
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    replay.send_multipart((client, b"", seq_frame(seq), payload))
            replay.send_multipart((client, b"", seq_frame(END_SEQ), b""))

    @staticmethod
    def _last_endpoint(socket: zmq.Socket[bytes]) -> str:
        value = socket.getsockopt(zmq.LAST_ENDPOINT)
        return value.decode() if isinstance(value, bytes) else str(value)
