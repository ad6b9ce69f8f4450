"""A reference subscriber for vLLM-format KV events: live batches from a SUB socket, gaps in the sequence numbers
detected, (with a replay endpoint) missed batches fetched from the publisher's ROUTER socket, and a publisher that
restarted on the same endpoint (its numbers start again at 0) followed instead of ignored."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Final, TypeVar, final

import zmq

from .publisher import seq_frame
from .._base.types import FrozenValue, Sealed
from .._base.validation import as_int, as_non_negative_int
from .wire import END_SEQ, SEQ_BYTES, EventBatch, WireFormatError, decode_batch

DEFAULT_REPLAY_TIMEOUT_MS: Final = 2_000

# How many of the latest gaps, restarts and skip reasons a subscriber keeps (their counts are kept in full): a peer
# flooding a long-running router with bad frames must not grow its memory without bound.
KEPT_RECORDS: Final = 1_000

Record = TypeVar("Record")


def _keep(records: list[Record], record: Record) -> None:
    records.append(record)
    if len(records) > KEPT_RECORDS:
        del records[0]


@final
@dataclass(frozen=True)
class ReceivedBatch(FrozenValue):
    """One batch as received: ``replayed`` when it came from the replay socket after a gap."""

    seq: int
    batch: EventBatch
    replayed: bool = False


@final
@dataclass(frozen=True)
class Gap(FrozenValue):
    """Sequence numbers ``[first_missing, next_received)`` never arrived live; ``recovered`` of them were replayed."""

    first_missing: int
    next_received: int
    recovered: int


@final
@dataclass(frozen=True)
class Restart(FrozenValue):
    """A live batch numbered ``first_seq`` came after ``previous_seq``, not above it: a new publisher instance on
    the endpoint (live batches never repeat), whose numbering started again at 0."""

    previous_seq: int
    first_seq: int


@final
class EventSubscriber(Sealed):
    """Subscribes to ``endpoint`` (connects unless vLLM's bind rule says the publisher connects to us: then it
    binds) with a topic prefix; ``receive`` returns batches in sequence order, replayed ones included.
    ``last_seq``: the last batch seen before (a subscriber coming back after a drop), -1 for a new one.

    A restarted publisher is detected by its first live batch numbered at or below ``last_seq``: it is recorded
    in ``restarts``, ``on_restart`` is called with it (before that batch is handed out), and receiving goes on
    with the new numbering (batches of the new instance missed before it, from 0, are a ``Gap``). The callback may
    ``replay`` or ``close``, not ``receive`` (``RuntimeError``: the outer call is about to hand out that batch).

    What a peer sends never raises out of ``receive``: a malformed live message (not three frames, a sequence
    number not 8 bytes or below 0, a payload that is not a batch) is skipped, and a replay that fails (no
    answer, a malformed answer, batches out of order or outside the gap) recovers nothing; each is recorded in
    ``skipped`` with the reason, and the gap stays reported.

    ``gaps``, ``restarts`` and ``skipped`` hold the latest ``KEPT_RECORDS`` of each; ``num_gaps``,
    ``num_restarts`` and ``num_skipped`` count them all.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        last_seq: int = -1,
        on_restart: Callable[[Restart], None] | None = None,
    ) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub: zmq.Socket[bytes] = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self.topic: bytes = topic.encode()
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._replay_endpoint = replay_endpoint
        self.last_seq: int = last_seq  # the last sequence number handed out, -1 before the first
        self.gaps: list[Gap] = []
        self.restarts: list[Restart] = []
        self.skipped: list[str] = []  # why each malformed live message or failed replay was passed over
        self.num_gaps: int = 0
        self.num_restarts: int = 0
        self.num_skipped: int = 0
        self._on_restart = on_restart
        self._pending: list[ReceivedBatch] = []
        self._receiving = False  # a receive is in flight (its on_restart callback may not receive again)
        try:
            if "*" in endpoint:
                self._sub.bind(endpoint)
            else:
                self._sub.connect(endpoint)
        except BaseException:
            self.close()
            raise

    def receive(self, timeout_ms: int) -> ReceivedBatch | None:
        """The next batch, waiting at most ``timeout_ms`` in all (-1: no limit; skipped bad messages do not start
        the wait over); None when none came in time. A sequence number that skips
        ahead records a ``Gap`` and, with a replay endpoint, hands out the replayed batches first; one at or below
        ``last_seq`` records a ``Restart``. RuntimeError after ``close``."""
        if self._sub.closed:  # zmq's own error ("not a socket") would not say whose call was wrong
            raise RuntimeError("EventSubscriber.receive called after close(): subscribe again to go on receiving")
        if self._receiving:
            raise RuntimeError(
                "EventSubscriber.receive called from its on_restart callback while EventSubscriber.receive is in "
                "flight: that call hands out the restarted publisher's first batch once the callback returns"
            )
        self._receiving = True
        try:
            return self._receive(timeout_ms)
        finally:
            self._receiving = False

    def _receive(self, timeout_ms: int) -> ReceivedBatch | None:
        # One deadline for the whole call: a skipped message must not start the wait over, or a peer sending bad
        # messages more often than ``timeout_ms`` would keep the caller waiting without end.
        deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms >= 0 else -1.0
        wait_ms = timeout_ms
        while not self._pending:
            if not self._sub.poll(wait_ms):
                return None
            try:
                received = _live_batch(self._sub.recv_multipart())
            except WireFormatError as error:
                self._skip(f"a live message: {error}")
                if deadline >= 0:
                    wait_ms = math.ceil((deadline - time.monotonic()) * 1000)
                    if wait_ms <= 0:
                        return None
                continue
            seq = received.seq
            first_missing = self.last_seq + 1
            numbered_from = self.last_seq >= 0  # a new subscriber does not know what it missed before joining
            restart = None
            if seq < first_missing:
                restart = Restart(self.last_seq, seq)
                _keep(self.restarts, restart)
                self.num_restarts += 1
                first_missing, numbered_from = 0, True
            if numbered_from and seq > first_missing:
                replayed = self._try_replay(first_missing, seq) if self._replay_endpoint is not None else []
                _keep(self.gaps, Gap(first_missing, seq, len(replayed)))
                self.num_gaps += 1
                self._pending.extend(replayed)
            self._pending.append(received)
            if restart is not None and self._on_restart is not None:
                self._on_restart(restart)  # the batches are queued: a callback that raises loses none
        batch = self._pending.pop(0)
        self.last_seq = batch.seq
        return batch

    def _try_replay(self, start: int, stop: int) -> list[ReceivedBatch]:
        try:
            return self.replay(start, stop)
        except (WireFormatError, TimeoutError) as error:
            self._skip(f"the replay of batches {start}..{stop - 1}: {error}")
            return []

    def _skip(self, reason: str) -> None:
        _keep(self.skipped, reason)
        self.num_skipped += 1

    def replay(self, start: int, stop: int | None = None, timeout_ms: int = DEFAULT_REPLAY_TIMEOUT_MS) -> list[ReceivedBatch]:
        """Batches ``[start, stop)`` still buffered by the publisher (all from ``start`` when ``stop`` is None).
        ``WireFormatError`` for an answer that is malformed or lies (a batch below ``start`` or not above the one
        before it: a publisher replays its buffer in order), ``TimeoutError`` when the answer stops coming.
        ``ValueError`` for a ``start`` below 0, a ``stop`` below ``start`` or a ``timeout_ms`` below 0 (ZeroMQ
        reads a negative one as "wait forever", and a publisher that stops answering would hang the caller)."""
        start = as_non_negative_int(start, "start")
        if stop is not None and as_int(stop, "stop") < start:
            raise ValueError(f"stop must be None or >= start ({start}), got {stop}")
        timeout_ms = as_non_negative_int(timeout_ms, "timeout_ms")
        if self._replay_endpoint is None:
            raise ValueError("replay needs the publisher's replay endpoint")
        socket: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(self._replay_endpoint)
            socket.send_multipart((b"", seq_frame(start)))
            batches: list[ReceivedBatch] = []
            last = start - 1
            while True:
                if not socket.poll(timeout_ms):
                    raise TimeoutError(f"no answer from the replay endpoint {self._replay_endpoint} in {timeout_ms} ms")
                frames = socket.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
                    raise WireFormatError(f"a replay message is [b'', 8-byte seq, payload], got {len(frames)} frames")
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return batches
                if seq <= last:
                    raise WireFormatError(f"the replay from {start} answered batch {seq} after {last}")
                if stop is not None and seq >= stop:
                    return batches  # the rest is past the gap (the socket is closed unread)
                batches.append(ReceivedBatch(seq, decode_batch(frames[2]), replayed=True))
                last = seq
        finally:
            socket.close(linger=0)

    def close(self) -> None:
        """Close the socket at once (what is queued and not received is dropped); a later ``receive`` raises
        ``RuntimeError``. Closing again does nothing."""
        self._sub.close(linger=0)
        self._pending.clear()


def _live_batch(frames: list[bytes]) -> ReceivedBatch:
    """A live message ``[topic, seq, payload]`` as a batch; ``WireFormatError`` saying what is wrong otherwise."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        raise WireFormatError(f"a message is [topic, 8-byte seq, payload], got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=True)
    if seq < 0:
        raise WireFormatError(f"sequence number {seq} is below 0")
    return ReceivedBatch(seq, decode_batch(frames[2]))
