"""The prefill -> decode handoff across processes: KV bytes over NIXL, small control messages beside them.

Each side owns a ``NixlEndpoint``: one NIXL agent (UCX backend) for one manager, with every pool of the manager's
GPU tier registered once at construction (DRAM on the cpu backend, VRAM on cuda; pools never move, so the
registration lasts the manager's life). The prefill side wraps its endpoint in a ``KVSender``, the decode side in
a ``KVReceiver``; they talk over one ``multiprocessing.connection.Connection`` (a ``Pipe`` to a spawned child, or
``Listener``/``Client`` with an authkey between machines), whose ``send_bytes``/``recv_bytes`` carry one JSON
object per message (``_control_messages``; never a pickle, so a peer cannot make this process run code; at most
1 GiB, ``MAX_MESSAGE_BYTES``: a longer length header is a ``TransferError`` before anything is allocated). The KV
bytes move only through NIXL:

==================  ==================================================================================================
decode -> prefill   ``{"kind": "hello", "metadata": agent metadata (base64), "layout": layout summary ([what, value]
                    string pairs: the manager's ``layout_summary``, then the engine's ``KVFormat``), "mem_type":
                    "DRAM" | "VRAM", "device": int, "pools": per pool group, per pool, the GPU tier's [address,
                    nbytes]}`` (once; answered by the same; both sides refuse a layout difference; every source
                    must be a whole slot of a pool the sender declared, none twice: ``check_source_addresses``)
decode -> prefill   ``{"kind": "request", "id": request id, "tokens": prompt token ids, "counts": per-group cached
                    counts, "scope": {"lora_id": int | null, "salt": null | int | str | {"bytes": base64}},
                    "read_timeout_s": the receiver's ``timeout_s``}``: the READ is used only when it ended by then
                    (counted from sending), and ``wait_released`` holds the pages at least that long: the
                    decode side has already run ``prepare_receiver`` (its own prefix match in the receiving
                    cache's ``ReuseScope``, ``resize(prompt_len, prompt_len)``); the prefill side computes the prompt
                    in that scope (``PrefillRequest.reuse_scope``; ``send_sources`` refuses a cache of another);
                    each served id is larger than the last (the receiver counts from 0): a notification names its
                    request by id alone, so the sender refuses a smaller one (``TransferError``)
prefill -> decode   ``{"kind": "sources", "id", "plan", "extra"}``: the ``SourcePlan`` (``disagg.plan_source``: only
                    the blocks the receiver lacks, SWA trimmed to window + sinks, SSM state when needed) as
                    ``prompt_len``, ``token_range`` [beg, end], ``tokens_per_block``, ``groups`` (one object per layer
                    group, ``GroupTransfer``'s fields) and ``sources`` (one int column per ``SourceBlock`` field);
                    ``extra``: any JSON value the engine adds, e.g. the first generated token (tuples arrive as
                    lists). Or ``{"kind": "error", "id", "message"}``
decode              ``disagg.complete_plan`` pairs the sources with its own slots (they must move exactly the
                    blocks the request's counts leave out, each pool once: ``check_sources_cover``), then ONE batched
                    NIXL READ of every descriptor, posted with the notification ``kvm2-done:<request id>``; a plan
                    with no sources (the decode side holds the whole prompt) is no READ and no notification
prefill             NIXL delivers the notification once the READ completed: the sender closes the request's cache
                    (at once for a plan with no sources: nothing will read it)
decode -> prefill   ``{"kind": "abort", "id", "reason"}`` when the decode side gave up (the sender releases its cache,
                    or drops the request unserved when it is still queued behind the one being waited for):
                    a read failed, ``KVReceiver.abandon`` gave the request up (sent at once), the receiving cache
                    was closed before its read (sent by the next call), or the receiver closed with requests unread
decode -> prefill   ``{"kind": "bye"}``: no more requests
==================  ==================================================================================================

Every field is checked on arrival: ids, counts, slots and sizes are integers in ``[0, 2**63)`` (tokens any integer, as
the manager takes them; counts at most the prompt's length, a source block -1 for an SSM state, addresses below
``2**64``, ``read_timeout_s`` a number of seconds in ``(0, MAX_READ_TIMEOUT_S]``, a year), the fields are exactly those
above, and anything else is a ``TransferError`` on the side that received it. A NIXL notification that is not
``kvm2-done:`` and a decimal request id is ignored and counted (``KVSender.ignored_notifications``). A request with
nothing to move needs no NIXL at all: both sides see the empty plan, so no word goes back for it (an earlier version
sent the notification alone, which made UCX connect to a peer that may be exiting). Requests may be answered ahead, in
any order: the receiver keeps an answer until its ``read`` (``_open_requests``), which takes it only into the cache the
request was made for; an answer to a request whose read already failed is dropped.

Failures on the decode side are ``TransferError``: the peer closed the connection or died (NIXL reports a
disconnected agent; also before the hello or the request), a malformed control message, a transfer in error
state, no answer or no completion within ``timeout_s`` of the request, the sender's own error, or the request
abandoned (``abandon`` from another thread) while its read ran. ``KVReceiver.receive`` then
closes the receiving cache: its pages (possibly half written) are freed, never committed, so nothing
half-written becomes reusable and the manager's invariants hold. Only once the READ is known ended, though (NIXL
accepts the release of a READ in progress without stopping it): a READ still in progress keeps the cache open under
a ``KVCache.hold`` until NIXL reports it DONE or ERR
(``_nixl_agent.UnfinishedReads``, retried by each later call and at ``close``), so late bytes never land in another
request's pages; meanwhile the engine's own ``close``/``suspend``/``resize``/``commit`` of it raise
``RuntimeError``. Bad arguments are ``ValueError``/``TypeError`` before anything is sent.

Only the decode side connects NIXL to its peer, and only at its first READ, once the control
connection shows the prefill side still there: the hello's metadata is kept, not loaded (loading it makes UCX
connect). UCX 1.23 (nixl-cu12 1.5.1) aborts the whole process when a peer dies while a TCP connection to it is being
established (README); a peer that dies after its hello is then found by the control connection, with no NIXL
connection to it.

NIXL (``nixl_cu12``) is imported when the first endpoint is made: ``pip install --no-deps nixl-cu12==1.5.1``
(its declared torch dependency is not needed). Its Python logger is set to WARNING unless ``NIXL_LOG_LEVEL`` is
set (it logs INFO lines to stdout otherwise). ``UCX_MODULES`` defaults to ``^efa`` (set here unless the user set
it): UCX's AWS EFA module links the system's ``libefa`` (Debian's ``ibverbs-providers``, which comes with
``libibverbs1``), which loads a second ``libibverbs``/``libnl`` beside the wheel's own copies, and the process then
dies with SIGSEGV at exit in ``libnl-route``'s destructor (measured with nixl-cu12 1.5.1).
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Sequence, SupportsFloat, SupportsIndex, final

from .._manager.manager import KVCache, KVCacheManager
from .control_messages import (
    Abort, Bye, ControlMessage, Failed, Request, Sources, check_timeout, decode, receive, receive_bytes, send,
    TransferError as TransferError,
)
from .kv_format import KVFormat
from .open_requests import OpenRequests, check_answer, check_source_addresses
from .._base.hashing import TokenSequence, check_tokens
from .._cache.handle import state_of
from .._manager.core import internals_of
from .nixl_agent import NIXL_INSTALL as NIXL_INSTALL, nixl_available as nixl_available
from .nixl_agent import AgentFactory, new_agent, notification_of
from .nixl_endpoint import synchronize
from .nixl_endpoint import NixlEndpoint as NixlEndpoint
from .nixl_endpoint import handshake
from .nixl_sender import DEFAULT_TIMEOUT_S, KVSender as KVSender, PrefillRequest as PrefillRequest, check_format
from .transfer import TransferPlan
from .plan import check_cache, check_counts, check_prompt_rows, complete_plan
from .._base.types import Handle, Sealed
from .._base.validation import as_int
from .._base.wording import counted

logger = logging.getLogger("kv_cache_manager_v2")

# How often a read waiting for its answer looks whether ``abandon`` (on another thread) gave it up, and ``close``
# whether the READs given up have ended.
ABANDON_POLL_S = 0.01


# -------------------------------------------------------------------------------------------------- decode side


@final
class ReceivedKV(Sealed):
    """One finished handoff on the decode side: the plan that moved, the sender's extra, the READ's seconds."""

    def __init__(self, plan: TransferPlan, extra: object, seconds: float) -> None:
        self.plan = plan
        self.extra = extra
        self.seconds = seconds


@final
class KVReceiver(Handle):
    """The decode side: requests a prompt's KV and READs it in one batched NIXL transfer. ``agent_factory``: see
    ``_nixl_agent`` (a test's wrapper; the real agent by default)."""

    def __init__(
        self,
        manager: KVCacheManager,
        connection: Connection,
        *,
        kv_format: KVFormat,
        timeout_s: SupportsFloat = DEFAULT_TIMEOUT_S,
        agent_factory: AgentFactory = new_agent,
    ) -> None:
        self.timeout_s: float = check_timeout(timeout_s)
        check_format(kv_format)
        self._connection = connection
        self._endpoint: NixlEndpoint = NixlEndpoint(manager, "decode", agent_factory)
        self._manager = manager
        self._open = OpenRequests()
        # ``abandon`` from another thread reaches a running read only through these, under the lock.
        self._lock = threading.Lock()
        self._read_ended = threading.Condition(self._lock)
        self._reading: int | None = None  # the request a read is working on, its cache and thread
        self._reading_cache: KVCache | None = None
        self._reading_thread = 0
        self._stopping: set[int] = set()  # requests whose running read abandon asked to stop
        try:
            handshake(self._endpoint, connection, True, self.timeout_s, kv_format)
        except BaseException:
            self._endpoint.close()
            raise

    def receive(self, cache: KVCache, tokens: TokenSequence, cached_per_group: Sequence[SupportsIndex]) -> ReceivedKV:
        """The whole exchange for a cache that ``prepare_receiver`` made for ``tokens``: ``request``, then
        ``read``. On ``TransferError`` the cache is closed (nothing it received is committed) and the sender told."""
        request_id = self.request(cache, tokens, cached_per_group)
        return self.read(cache, request_id)

    def request(self, cache: KVCache, tokens: TokenSequence, cached_per_group: Sequence[SupportsIndex]) -> int:
        """Send the request (prompt and counts); returns its id. Checks the arguments first (nothing sent, nothing
        changed): ``cache`` must be known to hold ``tokens`` (its input or committed tokens, as ``prepare_receiver``
        makes it: ``disagg.plan_transfer``'s check), and a cache has one request at a time. A
        peer already gone is a ``TransferError`` and the cache is closed, as ``read`` does."""
        token_list = list(check_tokens(tokens, "tokens"))
        if not all(isinstance(token, int) for token in token_list):
            raise TypeError("tokens: the NIXL transport sends text tokens (ints) only")
        if not isinstance(cache, KVCache) or cache.manager is not self._manager:
            raise ValueError("cache must be a KVCache of this receiver's manager")
        if not cache.is_active or cache.history_length != len(token_list):
            raise ValueError(
                f"cache {cache.id} must be active at history_length {len(token_list)} (prepare_receiver), it is "
                f"{cache.status.name} at {cache.history_length}"
            )
        counts = check_counts(cached_per_group, len(state_of(cache).groups), len(token_list), cache.tokens_per_block)
        read_timeout_s = check_timeout(self.timeout_s, "KVReceiver.timeout_s")  # an attribute the engine may set
        self._check_open()
        check_prompt_rows(state_of(cache), f"cache {cache.id}", token_list, "the request's")  # its prompt is what it reads
        self._open.refuse_a_second(cache)
        _refuse_inside_a_call(self._manager, "KVReceiver.request")
        self._endpoint.unfinished.retry()
        self._abort_abandoned()
        request_id = self._open.new_id()
        deadline = time.monotonic() + read_timeout_s  # before the sender's wait starts (see OpenRequests)
        try:
            send(
                self._connection,
                Request(request_id, [int(token) for token in token_list], counts, cache.reuse_scope, read_timeout_s),
            )
        except BaseException:
            cache.close()
            raise
        with self._lock:  # abandon on another thread asks whether it is open
            self._open.note(request_id, cache, token_list, counts, deadline, threading.get_ident())
        return request_id

    def read(self, cache: KVCache, request_id: SupportsIndex) -> ReceivedKV:
        """Wait for the request's sources, pair them with ``cache``'s slots and READ them all in one NIXL
        transfer. ``ValueError`` before anything, nothing changed, when ``request_id`` is no request of this
        receiver still to read or ``cache`` is not the cache it was made for; as a failure below (the cache closed)
        when the cache is no longer known to hold the request's tokens (a commit of others since ``request``). On any later failure: the cache is
        closed, the sender told (when it can still hear), ``TransferError`` (or the ValueError of a plan that does
        not fit the cache) raised. A READ that NIXL could not stop leaves the cache open instead, held by
        ``endpoint.unfinished`` and closed there once NIXL releases the READ (``cache.held_for`` says so; closing
        it yourself raises ``RuntimeError`` until then)."""
        _refuse_inside_a_call(self._manager, "KVReceiver.read")
        self._check_open()
        request_id = as_int(request_id, "request_id")
        with self._lock:  # one step for abandon on another thread: the request is open or its read runs
            asked = self._open.take(request_id, cache)
            self._reading, self._reading_cache, self._reading_thread = request_id, cache, threading.get_ident()
        deadline = asked.deadline
        try:  # from here on the request is this call's: whatever fails (an interrupt too) ends it, the sender told
            self._endpoint.unfinished.retry()
            self._abort_abandoned()
            message = self._open.answer_of(request_id)
            while message is None:  # another request's answer (they may come in any order) waits for its read
                message = self._open.keep_answer(self._next_message(request_id, deadline), request_id)
            if isinstance(message, Failed):
                raise TransferError(f"the prefill side failed request {request_id}: {message.message}")
            check_answer(request_id, asked, message.plan)
            check_cache(self._manager, cache, "dst_cache")
            check_prompt_rows(state_of(cache), f"cache {cache.id}", asked.tokens, "the request's")  # a commit since `request`
            plan = complete_plan(self._manager, cache, message.plan)  # its sources computed for these tokens too
            check_source_addresses(request_id, message.plan, self._endpoint.peer_pools)
            if not plan.descriptors:  # the sender released it on sending: no READ, no word back, no NIXL at all
                self._stop_if_abandoned(request_id)
                return ReceivedKV(plan, message.extra, 0.0)
            notification = notification_of(request_id)

            def listen() -> bool:  # asked before the READ connects NIXL to the peer and while it runs
                return self._listen(request_id)

            with internals_of(self._manager).guard.entering("KVReceiver.read"):
                internals_of(self._manager).store.flush(int(cache.cuda_stream))  # e.g. a copy-on-write copy into a page we overwrite
            synchronize(self._endpoint.mem_type)
            seconds = self._endpoint.read(plan, notification, deadline, cache, listen)
            self._stop_if_abandoned(request_id)  # abandoned as the READ ended: the engine gave the cache up
            return ReceivedKV(plan, message.extra, seconds)
        except BaseException as error:
            if not self._endpoint.unfinished.holds(cache):
                cache.close()
            self._abort(request_id, str(error))
            raise
        finally:
            with self._lock:
                self._reading, self._reading_cache = None, None
                self._stopping.discard(request_id)
                self._read_ended.notify_all()

    def abandon(self, cache: KVCache, request_id: SupportsIndex) -> bool:
        """Give up ``request_id`` (e.g. its client disconnected): its receiving ``cache`` is closed (its pages
        freed; those a READ that NIXL cannot stop may still write stay held until it does, as after a failed
        read) and the prefill side is told at once (its ``wait_released`` returns False and it may reuse the
        pages it offered). Its answer, if it comes later, is dropped; so is a READ that completes meanwhile.
        Returns True when the request was given up here; False, changing nothing, when it had already ended: its
        ``read`` returned (the cache is the engine's to commit or close) or failed, it was abandoned before, or
        the receiver closed. ``ValueError``, nothing changed, for an id this receiver never gave out or a cache
        other than the request's.

        Call it from the thread that drives the manager (the one that sent the request), as every other call,
        with one exception: while the request's ``read`` runs on another thread (waiting for the answer, or
        READing), ``abandon`` asks that read to stop and returns once it has; that ``read`` raises
        ``TransferError`` ('request N was abandoned'). From any other thread: ``RuntimeError``, nothing changed,
        while the request is still to read (closing its cache there would race the manager's thread); False once
        it is not."""
        if not isinstance(cache, KVCache) or cache.manager is not self._manager:
            raise ValueError("cache must be a KVCache of this receiver's manager")
        request_id = as_int(request_id, "request_id")
        if not 0 <= request_id < self._open.issued:
            raise ValueError(f"request_id {request_id!r} names no request this receiver sent")
        with self._lock:
            if self._read_running(request_id):
                if self._reading_cache is not cache:
                    raise ValueError(f"cache {cache.id} is not the cache request {request_id} was made for")
                self._stopping.add(request_id)
                if self._reading_thread != threading.get_ident():  # from inside the read: it stops on return
                    while self._read_running(request_id):
                        self._read_ended.wait()
                return True
            sender_thread = self._open.thread_of(request_id)
            if sender_thread is None:
                return False  # read, failed or given up before: nothing to do, from any thread
            if sender_thread != threading.get_ident():
                raise RuntimeError(
                    f"KVReceiver.abandon of request {request_id} from thread {threading.get_ident()}, while no read "
                    f"of it runs: call it from the thread that sent it ({sender_thread}), which drives the manager "
                    "(another thread may only stop a running read); nothing changed"
                )
            _refuse_inside_a_call(self._manager, "KVReceiver.abandon")
            self._open.abandon(request_id, cache)  # open: under the lock, so no read takes it meanwhile
        cache.close()
        self._abort(request_id, "the decode side abandoned it")
        return True

    def _read_running(self, request_id: int) -> bool:
        """Whether a read works on ``request_id`` now (under ``_lock``). A method, not an inline test: the read's
        thread sets ``_reading`` to None while ``abandon`` waits, and compiled code unboxes an attribute that an
        ``==`` against an int narrowed to int (``TypeError: int object expected; got None``)."""
        return self._reading == request_id

    def _stop_if_abandoned(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._stopping:
                raise TransferError(f"request {request_id} was abandoned (KVReceiver.abandon)")

    def _next_message(self, request_id: int, deadline: float) -> ControlMessage:
        """The next control message by ``deadline``, looking every ``ABANDON_POLL_S`` whether the read was
        abandoned meanwhile."""
        while True:
            self._stop_if_abandoned(request_id)
            remaining = deadline - time.monotonic()
            try:
                if remaining > 0 and not self._connection.poll(min(remaining, ABANDON_POLL_S)):
                    continue
            except (EOFError, OSError):
                pass  # receive says so
            return receive(self._connection, deadline, f"the sources of request {request_id}")

    def _listen(self, request_id: int) -> bool:
        """While a READ runs: keep the answers of other requests for their reads; False when the prefill side
        closed the connection, ``TransferError`` when it sent anything else or the read was abandoned."""
        self._stop_if_abandoned(request_id)
        while self._connection.poll(0):
            try:
                data = receive_bytes(self._connection)
            except (EOFError, OSError):
                return False
            self._open.keep_answer(decode(data), None)  # no read waits for an answer meanwhile
        return True

    def _check_open(self) -> None:
        if self._endpoint.closed:
            raise ValueError("this KVReceiver is closed")

    def _abort_abandoned(self) -> None:
        for request_id in self._open.abandoned():
            self._abort(request_id, "its receiving cache was closed before the read")

    def _abort(self, request_id: int, reason: str) -> None:
        try:
            send(self._connection, Abort(request_id, reason))
        except TransferError:  # the peer is gone: nothing to tell
            pass

    @property
    def unfinished_reads(self) -> int:
        """READs given up (abandoned, failed, timed out) that NIXL still reports in progress: each keeps its
        receiving cache held, so its pages go to no other request until NIXL lets go (the next ``request``,
        ``read`` or ``close`` asks again)."""
        return self._endpoint.unfinished.count

    def close(self) -> None:
        """Tell the sender which requests will not be read and that no more come, wait (at most ``timeout_s``)
        for the READs given up but still in progress to end, then close the endpoint. Its ``request`` and ``read``
        raise ``ValueError`` afterwards. A READ NIXL still reports in progress after ``timeout_s`` keeps its cache
        held and the endpoint's NIXL agent and registered memory alive (it could still land: ``unfinished_reads``,
        a warning, and the manager's ``shutdown`` refuses while that cache is open); call ``close`` again later to
        finish once NIXL let go. Otherwise idempotent."""
        if self._endpoint.closed:
            self._endpoint.close()  # READs kept at an earlier close: tears down once NIXL let go of them
            return
        for request_id in self._open.forget_all():
            self._abort(request_id, "the receiver closed")
        try:
            send(self._connection, Bye())
        except TransferError:
            pass
        deadline = time.monotonic() + self.timeout_s  # a READ goes on landing after its peer is forgotten (measured)
        while self._endpoint.unfinished.count and time.monotonic() < deadline:
            self._endpoint.unfinished.retry()
            time.sleep(ABANDON_POLL_S)
        self._endpoint.close()
        unfinished = self._endpoint.unfinished.count
        if unfinished:
            one = unfinished == 1
            logger.warning(
                "KVReceiver.close: %s still in progress after %.1f s %s and the NIXL agent alive (%s could still "
                "land); call close() again once %s ended, before shutdown()",
                counted(unfinished, "NIXL READ"), self.timeout_s,
                "keeps its cache held" if one else "keep their caches held", "it" if one else "they",
                "it" if one else "they",
            )


def _refuse_inside_a_call(manager: KVCacheManager, call: str) -> None:
    """``RuntimeError`` (nothing sent, nothing received) when ``call`` comes from user code inside another call of
    ``manager``: the handoff changes the manager's pages (its copies, the caches it closes)."""
    with internals_of(manager).guard.entering(call):
        pass


def receiver_endpoint(receiver: KVReceiver) -> NixlEndpoint:
    """The NIXL endpoint a receiver reads through (internal API: for white-box tests)."""
    return receiver._endpoint
