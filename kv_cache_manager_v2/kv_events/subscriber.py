"""A reference subscriber for vLLM-format KV events: live batches from a SUB socket, gaps in the sequence numbers
detected, (with a replay endpoint) missed batches fetched from the publisher's ROUTER socket, and a publisher that
restarted on the same endpoint (its numbers start again at 0) followed instead of ignored."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Final, SupportsIndex, TypeVar, final

import zmq

from .publisher import seq_frame
from .._base.types import FrozenValue, Sealed
from .._base.validation import as_int, as_int_in, as_non_negative_int, as_str
from .wire import END_SEQ, SEQ_BYTES, EventBatch, WireFormatError, decode_batch

DEFAULT_REPLAY_TIMEOUT_MS: Final = 2_000
# The longest wait a timeout may ask for (about 11.6 days): longer is a mistake, not a wish (None waits without limit).
MAX_TIMEOUT_MS: Final = 1_000_000_000

# How many of the latest gaps, restarts and skip reasons a subscriber keeps (their counts are kept in full): a peer
# flooding a long-running router with bad frames must not grow its memory without bound.
KEPT_RECORDS: Final = 1_000
# Sequence numbers are signed 64-bit on the wire: a ``last_seq`` at or above this no publisher can follow.
SEQ_LIMIT: Final = 1 << 63

Record = TypeVar("Record")


def _keep(records: list[Record], record: Record) -> None:
    records.append(record)
    if len(records) > KEPT_RECORDS:
        del records[0]


def as_timeout_ms(value: object, name: str) -> int:
    """A timeout in whole milliseconds, in ``[0, MAX_TIMEOUT_MS]``: ValueError naming ``name`` for a negative one
    (ZeroMQ reads it as "wait forever"), TypeError for a bool, a float (NaN and infinities included) or a non-number."""
    result = as_non_negative_int(value, name)
    if result > MAX_TIMEOUT_MS:
        raise ValueError(f"{name} must be at most {MAX_TIMEOUT_MS:,} ms (None: no limit), got {result}")
    return result


def replay_endpoint_error(endpoint: str) -> str | None:
    """Why ZeroMQ cannot connect to ``endpoint`` (its reason), None when it can: a probe is connected once and
    closed at once. The replay socket connects at the first gap only, where a bad endpoint would raise
    ``ZMQError`` out of ``receive`` and lose the live batch; the subscriber and ``events-listen --replay`` both
    check here first."""
    probe: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        probe.connect(endpoint)
    except zmq.ZMQError as error:
        return str(error)
    finally:
        probe.close(linger=0)
    return None


def _checked_replay_endpoint(endpoint: object) -> str:
    """``endpoint`` as a str ZeroMQ can connect to: ``TypeError``/``ValueError`` naming ``replay_endpoint``."""
    checked = as_str(endpoint, "replay_endpoint")
    error = replay_endpoint_error(checked)
    if error is not None:
        raise ValueError(f"replay_endpoint {checked!r}: {error}")
    return checked


def _wait_ms(until: float) -> int:
    """Whole milliseconds from now to the monotonic time ``until`` (rounded up: a wait never ends early), 0 past it."""
    return max(0, math.ceil((until - time.monotonic()) * 1000))


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
    """Sequence numbers ``[first_missing, next_received)`` never arrived live; the last ``recovered`` of them were
    replayed (a publisher's buffer may no longer reach back to ``first_missing``)."""

    first_missing: int
    next_received: int
    recovered: int


@final
@dataclass(frozen=True)
class Restart(FrozenValue):
    """A live batch numbered ``first_seq`` came after ``previous_seq``, not above it: a new publisher instance on
    the endpoint (live batches never repeat), whose numbering started again at 0. Also the first live batch after
    a gap whose replay a newer instance answered and stamped no earlier than that answer (``first_seq`` may then be
    above ``previous_seq``)."""

    previous_seq: int
    first_seq: int


@final
class EventSubscriber(Sealed):
    """Subscribes to ``endpoint`` (connects unless vLLM's bind rule says the publisher connects to us: then it
    binds) with a topic prefix; ``receive`` returns batches in sequence order, replayed ones included.
    ``last_seq``: the last batch seen before (a subscriber coming back after a drop), -1 for a new one (an
    integer in ``[-1, 2**63)``, the wire's signed 64-bit numbers; ``TypeError`` for a bool or a non-integer).
    ``replay_endpoint`` is connected once at construction (``replay_endpoint_error``): one ZeroMQ cannot use is a
    ``ValueError`` naming it, with no socket left open.

    A restarted publisher is detected by its first live batch numbered at or below ``last_seq``: it is recorded
    in ``restarts``, ``on_restart`` is called with it (before that batch is handed out), and receiving goes on
    with the new numbering (batches of the new instance missed before it, from 0, are a ``Gap``). The callback may
    ``replay`` or ``close``, not ``receive`` (``RuntimeError``: the outer call is about to hand out that batch).

    The wire carries no publisher instance, so a gap's replay checks that its batches belong to the stream the gap
    came from: each stamped no later than the live batch after the gap (vLLM stamps batches with the wall clock as
    it makes them) and from its data-parallel rank. A replay stamped later was answered by a publisher that
    restarted after the gap: it recovers nothing, and the next live batch stamped no earlier than that answer is
    taken as that instance's (a ``Restart``, whatever its number: the new instance may have numbered past the old
    one already); the old instance's last batches, read after the replay, go on its stream. This relies on the
    publisher's stamps: a wall clock, increasing across restarts. With a coarse or constant clock (``clock=lambda:
    0.0``) a new instance's replay reads as the old stream's and its batches are handed out as recovered.

    What a peer sends never raises out of ``receive``: a malformed live message (not three frames, a sequence
    number not 8 bytes or below 0, a payload that is not a batch) is skipped, and a replay that fails (no
    answer, a malformed answer, batches out of order, with a hole, outside the gap or ending short of it)
    recovers nothing; each is recorded in ``skipped`` with the reason, and the gap stays reported.

    A gap's replay waits for the publisher's answers within the ``receive`` call's own ``timeout_ms``: a call
    that runs out of time in it returns None, and the next call goes on reading the same replay (the live batch
    after the gap waits for it, and the ``Gap`` is recorded once it ends). A replay fails when no answer comes for
    ``replay_timeout_ms`` (across calls). ``replay_timeout_ms``: whole milliseconds, ``ValueError`` below 0 or
    above ``MAX_TIMEOUT_MS``, ``TypeError`` for a non-integer, refused before any socket exists.

    ``gaps``, ``restarts`` and ``skipped`` hold the latest ``KEPT_RECORDS`` of each; ``num_gaps``,
    ``num_restarts`` and ``num_skipped`` count them all.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        last_seq: SupportsIndex = -1,
        on_restart: Callable[[Restart], None] | None = None,
        replay_timeout_ms: SupportsIndex = DEFAULT_REPLAY_TIMEOUT_MS,
    ) -> None:
        # Every setting is checked before the SUB socket exists: a refused one leaves no socket open, no port bound.
        self._replay_timeout_ms = as_timeout_ms(replay_timeout_ms, "replay_timeout_ms")
        checked_last_seq = as_int_in(last_seq, "last_seq", -1, SEQ_LIMIT)
        self._replay_endpoint = None if replay_endpoint is None else _checked_replay_endpoint(replay_endpoint)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub: zmq.Socket[bytes] = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self.topic: bytes = topic.encode()
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.last_seq: int = checked_last_seq  # the last sequence number handed out, -1 before the first
        self.gaps: list[Gap] = []
        self.restarts: list[Restart] = []
        self.skipped: list[str] = []  # why each malformed live message or failed replay was passed over
        self.num_gaps: int = 0
        self.num_restarts: int = 0
        self.num_skipped: int = 0
        self._on_restart = on_restart
        self._pending: list[ReceivedBatch] = []
        self._gap: _GapReplay | None = None  # a gap whose replay is under way, when a receive ran out of time in it
        # A gap's replay was answered by a publisher instance newer than the live batch after the gap: the stamp
        # of its first such answer. The next live batch stamped no earlier is that instance's, a restart whatever
        # its number; one stamped earlier is still the old instance's (sent before it closed, read only now).
        self._newer_from: float | None = None
        self._receiving = False  # a receive is in flight (its on_restart callback may not receive again)
        try:
            if "*" in endpoint:
                self._sub.bind(endpoint)
            else:
                self._sub.connect(endpoint)
        except BaseException:
            self.close()
            raise

    def receive(self, timeout_ms: SupportsIndex | None) -> ReceivedBatch | None:
        """The next batch, waiting at most ``timeout_ms`` in all (None: no limit); None when none came in time.
        Skipped bad messages and a gap's replay spend that time, never start it over. A sequence number that
        skips ahead records a ``Gap`` and, with a replay endpoint, hands out the replayed batches first; one at
        or below ``last_seq`` records a ``Restart``. ``ValueError`` for a ``timeout_ms`` below 0 or above
        ``MAX_TIMEOUT_MS``, ``TypeError`` for one that is not an integer; ``RuntimeError`` after ``close``."""
        limit = None if timeout_ms is None else as_timeout_ms(timeout_ms, "timeout_ms")
        if self._sub.closed:  # zmq's own error ("not a socket") would not say whose call was wrong
            raise RuntimeError("EventSubscriber.receive called after close(): subscribe again to go on receiving")
        if self._receiving:
            raise RuntimeError(
                "EventSubscriber.receive called from its on_restart callback while EventSubscriber.receive is in "
                "flight: that call hands out the restarted publisher's first batch once the callback returns"
            )
        self._receiving = True
        try:
            return self._receive(limit)
        finally:
            self._receiving = False

    def _receive(self, timeout_ms: int | None) -> ReceivedBatch | None:
        # One deadline for the whole call: neither a skipped message nor a gap's replay may start the wait over, or
        # a peer sending bad messages more often than ``timeout_ms`` (or a replay endpoint that never answers)
        # would keep the caller waiting past it.
        deadline = -1.0 if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        wait_ms = -1 if timeout_ms is None else timeout_ms
        while not self._pending:
            if self._sub.closed:  # by the on_restart callback (which emptied the queue): nothing left to hand out
                return None
            if self._gap is not None:
                if not self._finish_gap(self._gap, deadline):
                    return None  # the replay goes on at the next call
                continue
            if not self._sub.poll(wait_ms):
                return None
            try:
                received = _live_batch(self._sub.recv_multipart())
            except WireFormatError as error:
                self._skip(f"a live message: {error}")
                if deadline >= 0:
                    wait_ms = _wait_ms(deadline)
                    if wait_ms <= 0:
                        return None
                continue
            self._take_live(received)
        batch = self._pending.pop(0)
        self.last_seq = batch.seq
        return batch

    def _take_live(self, received: ReceivedBatch) -> None:
        """Queue a live batch, after the gap before it is replayed (``_gap`` until then) or recorded."""
        seq = received.seq
        first_missing = self.last_seq + 1
        numbered_from = self.last_seq >= 0  # a new subscriber does not know what it missed before joining
        restart = None
        newer = self._newer_from is not None and received.batch.ts >= self._newer_from
        if seq < first_missing or newer:
            self._newer_from = None
            restart = Restart(self.last_seq, seq)
            _keep(self.restarts, restart)
            self.num_restarts += 1
            first_missing, numbered_from = 0, True
        gap = numbered_from and seq > first_missing
        if gap and self._replay_endpoint is not None:
            request = _ReplayRequest(
                self._context, self._replay_endpoint, first_missing, seq, self._replay_timeout_ms, received.batch
            )
            self._gap = _GapReplay(request, received, restart)
            return
        if gap:
            _keep(self.gaps, Gap(first_missing, seq, 0))
            self.num_gaps += 1
        self._queue([], received, restart)

    def _finish_gap(self, gap: _GapReplay, deadline: float) -> bool:
        """Read the gap's replay until it ends (its batches and the live one queued: True) or ``deadline``
        passes first (False, the replay kept for the next call); a replay that fails recovers nothing."""
        request = gap.request
        try:
            if not request.advance(deadline):
                return False
            replayed = request.batches
        except (WireFormatError, TimeoutError) as error:
            self._skip(f"the replay of batches {request.start}..{gap.live.seq - 1}: {error}")
            if request.newer_from is not None and self._newer_from is None:
                self._newer_from = request.newer_from
            replayed = []
        self._gap = None
        request.close()
        _keep(self.gaps, Gap(request.start, gap.live.seq, len(replayed)))
        self.num_gaps += 1
        self._queue(replayed, gap.live, gap.restart)
        return True

    def _queue(self, replayed: list[ReceivedBatch], live: ReceivedBatch, restart: Restart | None) -> None:
        self._pending.extend(replayed)
        self._pending.append(live)
        if restart is not None and self._on_restart is not None:
            self._on_restart(restart)  # the batches are queued: a callback that raises loses none

    def _skip(self, reason: str) -> None:
        _keep(self.skipped, reason)
        self.num_skipped += 1

    def replay(
        self,
        start: SupportsIndex,
        stop: SupportsIndex | None = None,
        timeout_ms: SupportsIndex = DEFAULT_REPLAY_TIMEOUT_MS,
    ) -> list[ReceivedBatch]:
        """Batches ``[start, stop)`` still buffered by the publisher (all from ``start`` when ``stop`` is None).
        ``WireFormatError`` for an answer that is malformed or lies (a batch below ``start`` or not the one right
        after the one before it: a publisher replays its buffer, which has no holes, in order), ``TimeoutError``
        when no answer comes for ``timeout_ms``. ``ValueError`` for a ``start`` below 0, a ``stop`` below ``start``
        or a ``timeout_ms`` below 0 (ZeroMQ reads it as "wait forever", and a publisher that stops answering would
        hang the caller) or above ``MAX_TIMEOUT_MS``."""
        first = as_non_negative_int(start, "start")
        end = None if stop is None else as_int(stop, "stop")  # read once: the request compares this plain int
        if end is not None and end < first:
            raise ValueError(f"stop must be None or >= start ({first}), got {end}")
        limit = as_timeout_ms(timeout_ms, "timeout_ms")
        if self._replay_endpoint is None:
            raise ValueError("replay needs the publisher's replay endpoint")
        request = _ReplayRequest(self._context, self._replay_endpoint, first, end, limit, None)
        try:
            request.advance(-1.0)
            return request.batches
        finally:
            request.close()

    def close(self) -> None:
        """Close the sockets at once (what is queued and not received is dropped, a gap's replay under way too); a
        later ``receive`` raises ``RuntimeError``. Closing again does nothing."""
        self._sub.close(linger=0)
        self._pending.clear()
        gap = self._gap
        self._gap = None
        if gap is not None:
            gap.request.close()


@final
class _ReplayRequest:
    """One request to the publisher's replay socket, its answers read as they come: ``advance`` may stop at its
    caller's deadline and go on at a later call (the socket stays open meanwhile, so no answer is lost; one
    arriving after ``close`` is dropped with the socket, never read by another request). With ``after``, the live
    batch after a gap, every answer must be of its stream: stamped no later, from its data-parallel rank."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        start: int,
        stop: int | None,
        timeout_ms: int,
        after: EventBatch | None,
    ) -> None:
        self.endpoint = endpoint
        self.start = start
        self.stop = stop
        self.timeout_ms = timeout_ms
        self.after = after
        self.newer_from: float | None = None  # the stamp of an answer later than ``after``: a restarted publisher's
        self.batches: list[ReceivedBatch] = []
        self.last = start - 1
        self.socket: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.connect(endpoint)
            self.socket.send_multipart((b"", seq_frame(start)))
        except BaseException:
            self.socket.close(linger=0)
            raise
        self.give_up_at = time.monotonic() + timeout_ms / 1000  # ``timeout_ms`` after the request or last answer

    def advance(self, deadline: float) -> bool:
        """Read answers until the replay ended (True) or the monotonic ``deadline`` (-1: none) passed first
        (False). ``TimeoutError`` once ``timeout_ms`` passed without an answer, ``WireFormatError`` for an answer
        that is malformed or lies."""
        while True:
            until = self.give_up_at if deadline < 0 else min(self.give_up_at, deadline)
            if not self.socket.poll(_wait_ms(until)):
                now = time.monotonic()
                if now >= self.give_up_at:
                    raise TimeoutError(f"no answer from the replay endpoint {self.endpoint} in {self.timeout_ms} ms")
                if 0 <= deadline <= now:
                    return False
                continue
            frames = self.socket.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
                raise WireFormatError(f"a replay message is [b'', 8-byte seq, payload], got {len(frames)} frames")
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == END_SEQ:
                if self.batches and self.after is not None and self.stop is not None and self.last < self.stop - 1:
                    raise WireFormatError(
                        f"the replay from {self.start} ended at batch {self.last}, short of the gap's last "
                        f"{self.stop - 1} (the publisher had buffered the batch after it)"
                    )
                return True
            if seq <= self.last:
                raise WireFormatError(f"the replay from {self.start} answered batch {seq} after {self.last}")
            if self.batches and seq != self.last + 1:
                raise WireFormatError(
                    f"the replay from {self.start} answered batch {seq} after {self.last}, a hole (a publisher's "
                    "buffer has none: answers past its high-water mark dropped?)"
                )
            if self.stop is not None and seq >= self.stop:
                return True  # the rest is past the gap (the socket is closed unread)
            batch = decode_batch(frames[2])
            if self.after is not None:
                self._check_stream(seq, batch, self.after)
            self.batches.append(ReceivedBatch(seq, batch, replayed=True))
            self.last = seq
            self.give_up_at = time.monotonic() + self.timeout_ms / 1000

    def _check_stream(self, seq: int, batch: EventBatch, after: EventBatch) -> None:
        """``WireFormatError`` unless ``batch`` is of ``after``'s stream (one stamped later sets ``newer_from``)."""
        if batch.data_parallel_rank != after.data_parallel_rank:
            raise WireFormatError(
                f"batch {seq} is of data_parallel_rank {batch.data_parallel_rank}, the batch that revealed the gap "
                f"of {after.data_parallel_rank}: the replay endpoint is another rank's"
            )
        if batch.ts > after.ts:
            self.newer_from = batch.ts
            raise WireFormatError(
                f"batch {seq} is stamped {batch.ts}, after the batch that revealed the gap ({after.ts}): a publisher "
                "restarted since answered"
            )

    def close(self) -> None:
        self.socket.close(linger=0)


@final
class _GapReplay:
    """A gap whose replay is under way: the live batch after it (and the restart it revealed) wait for its end."""

    def __init__(self, request: _ReplayRequest, live: ReceivedBatch, restart: Restart | None) -> None:
        self.request = request
        self.live = live
        self.restart = restart


def _live_batch(frames: list[bytes]) -> ReceivedBatch:
    """A live message ``[topic, seq, payload]`` as a batch; ``WireFormatError`` saying what is wrong otherwise."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        raise WireFormatError(f"a message is [topic, 8-byte seq, payload], got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=True)
    if seq < 0:
        raise WireFormatError(f"sequence number {seq} is below 0")
    return ReceivedBatch(seq, decode_batch(frames[2]))
