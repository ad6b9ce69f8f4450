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
                    string pairs), "mem_type": "DRAM" | "VRAM", "device": int}`` (once; answered by the same)
decode -> prefill   ``{"kind": "request", "id": request id, "tokens": prompt token ids, "counts": per-group cached
                    counts}``: the decode side has already run ``prepare_receiver`` (its own prefix match,
                    ``resize(prompt_len, prompt_len)``)
prefill -> decode   ``{"kind": "sources", "id", "plan", "extra"}``: the ``SourcePlan`` (``disagg.plan_source``: only
                    the blocks the receiver lacks, SWA trimmed to window + sinks, SSM state when needed) as
                    ``prompt_len``, ``token_range`` [beg, end], ``tokens_per_block``, ``groups`` (one object per layer
                    group, ``GroupTransfer``'s fields) and ``sources`` (one int column per ``SourceBlock`` field);
                    ``extra``: any JSON value the engine adds, e.g. the first generated token (tuples arrive as
                    lists). Or ``{"kind": "error", "id", "message"}``
decode              ``disagg.complete_plan`` pairs the sources with its own slots (they must move exactly the
                    blocks the request's counts leave out, each pool once: ``check_sources_cover``), then ONE batched
                    NIXL READ of every descriptor, posted with the notification ``kvm2-done:<request id>``
prefill             NIXL delivers the notification once the READ completed: the sender closes the request's cache
decode -> prefill   ``{"kind": "abort", "id", "reason"}`` when the decode side gave up (the sender releases its cache):
                    a read failed, the receiving cache was closed before its read (sent by the next call), or the
                    receiver closed with requests unread
decode -> prefill   ``{"kind": "bye"}``: no more requests
==================  ==================================================================================================

Every field is checked on arrival: ids, tokens, counts, slots and sizes are integers in ``[0, 2**63)`` (counts at
most the prompt's length, a source block -1 for an SSM state, addresses below ``2**64``), the fields are exactly
those above, and anything else is a ``TransferError`` on the side that received it. A NIXL notification that is
not ``kvm2-done:`` and a decimal request id is ignored and counted (``KVSender.ignored_notifications``). A request
with nothing to move gets the notification through ``send_notif`` (no READ). Requests may be answered ahead, in any
order: the receiver keeps an answer until its ``read`` (``_open_requests``), which takes it only into the cache the
request was made for; an answer to a request whose read already failed is dropped.

Failures on the decode side are ``TransferError``: the peer closed the connection or died (NIXL reports a
disconnected agent; also before the hello or the request), a malformed control message, a transfer in error
state, no answer or no completion within ``timeout_s`` of the request, or the sender's own error. ``KVReceiver.receive`` then
closes the receiving cache: its pages (possibly half written) are freed, never committed, so nothing
half-written becomes reusable and the manager's invariants hold. Only once the READ is known stopped, though: a
READ that NIXL will not release keeps the cache open under a ``KVCache.hold`` until it does
(``_nixl_agent.UnfinishedReads``, retried by each later call and at ``close``), so late bytes never land in another
request's pages; meanwhile the engine's own ``close``/``suspend``/``resize``/``commit`` of it raise
``RuntimeError``. Bad arguments are ``ValueError``/``TypeError`` before anything is sent.

NIXL (``nixl_cu12``) is imported when the first endpoint is made: ``pip install --no-deps nixl-cu12==1.5.1``
(its declared torch dependency is not needed). Its Python logger is set to WARNING unless ``NIXL_LOG_LEVEL`` is
set (it logs INFO lines to stdout otherwise). ``UCX_MODULES`` defaults to ``^efa`` (set here unless the user set
it): UCX's AWS EFA module links the system's ``libefa`` (Debian's ``ibverbs-providers``, which comes with
``libibverbs1``), which loads a second ``libibverbs``/``libnl`` beside the wheel's own copies, and the process then
dies with SIGSEGV at exit in ``libnl-route``'s destructor (measured with nixl-cu12 1.5.1).
"""

from __future__ import annotations

import itertools
from collections import deque
import time
from multiprocessing.connection import Connection
from typing import Sequence, SupportsIndex, final

from .._manager.manager import KVCache, KVCacheManager
from .control_messages import (
    Abort, Bye, ControlMessage, Failed, Request, Sources, check_extra, decode, receive, receive_bytes, send,
    TransferError as TransferError,
)
from .open_requests import OpenRequests, check_answer
from .._base.hashing import TokenSequence, check_tokens
from .._cache.handle import state_of
from .._manager.core import internals_of
from .nixl_agent import NIXL_INSTALL as NIXL_INSTALL, nixl_available as nixl_available
from .nixl_agent import AgentFactory, SentSources, new_agent, notification_of, notified_id
from .nixl_endpoint import POLL_S, handshake, synchronize
from .nixl_endpoint import NixlEndpoint as NixlEndpoint
from .transfer import KVSlice, SourcePlan, TransferPlan
from .plan import check_counts, complete_plan, plan_source
from .._base.types import Sealed


def _check_timeout(timeout_s: float) -> float:
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


# ------------------------------------------------------------------------------------------------- prefill side


@final
class PrefillRequest(Sealed):
    """What the decode side asked for: a prompt and its per-group cached counts."""

    def __init__(self, request_id: int, tokens: list[int], cached_per_group: list[int]) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.cached_per_group = cached_per_group

    def __reduce__(self) -> tuple[type[PrefillRequest], tuple[int, list[int], list[int]]]:
        """Pickled as its constructor's arguments: compiled, the default pickling calls it with none."""
        return (PrefillRequest, (self.request_id, self.tokens, self.cached_per_group))


@final
class KVSender(Sealed):
    """The prefill side: answers requests with source descriptors and learns when it may release the pages.
    ``ignored_notifications`` counts NIXL notifications that were not a ``kvm2-done:<id>`` of a request whose
    sources are held (one never sent or already released: nothing would wait for it, so it is not kept)."""

    def __init__(self, manager: KVCacheManager, connection: Connection, timeout_s: float = 60.0) -> None:
        timeout = _check_timeout(timeout_s)
        self._connection = connection
        self._endpoint: NixlEndpoint = NixlEndpoint(manager, "prefill")
        self._manager = manager
        self.ignored_notifications: int = 0
        self._pending: deque[ControlMessage] = deque()
        self._sent = SentSources()
        try:
            handshake(self._endpoint, connection, False, timeout)
        except BaseException:
            self._endpoint.close()
            raise

    def next_request(self, timeout_s: float = 3600.0) -> PrefillRequest | None:
        """The next request, or None when the decode side said bye or closed the connection; ``TransferError``
        for a control message that is not one of the protocol's. A request whose counts do not fit this manager's
        layer groups is answered with an error here (the decode side's read raises it), never returned."""
        deadline = time.monotonic() + _check_timeout(timeout_s)
        while True:
            if self._pending:
                message = self._pending.popleft()
            else:
                try:
                    if not self._connection.poll(max(0.0, deadline - time.monotonic())):
                        raise TransferError("no request from the decode side in time")
                    data = receive_bytes(self._connection)
                except (EOFError, OSError):
                    return None
                message = decode(data)
            if isinstance(message, Abort):
                self._sent.note_ended(message.request_id, False)  # its wait returns at once (released ones: ignored)
                continue
            if isinstance(message, Bye):
                return None
            if not isinstance(message, Request):
                raise TransferError(f"expected a request, got {message!r}")
            manager = self._manager
            try:
                check_counts(message.counts, manager.num_layer_groups, len(message.tokens), manager.tokens_per_block)
            except ValueError as error:
                send(self._connection, Failed(message.request_id, f"malformed request: {error}"))
                continue
            self._sent.serve(message.request_id)
            return PrefillRequest(message.request_id, message.tokens, message.counts)

    def send_sources(self, request: PrefillRequest, cache: KVCache, extra: object = None) -> SourcePlan:
        """Plan the request's sources from ``cache`` (which must hold the whole prompt, and whose committed tokens,
        if any, must start it) and send them. The cache's pending copies run first, and the device is idle when
        the plan leaves: NIXL may read at once. ``extra`` must be JSON data (TypeError before anything is sent);
        ``TransferError`` when the decode side is gone. From then until ``wait_released`` returns the cache is held (``KVCache.held_for``): the decode
        side READs its slots, so its ``close``, ``suspend``, ``resize`` and ``commit`` raise ``RuntimeError``, and
        sending the request's sources again is a ``ValueError``."""
        check_extra(extra)
        if self._sent.holds(request.request_id):  # the decode side may be READing the first cache's slots
            raise ValueError(f"the sources of request {request.request_id} were sent already: wait_released first")
        with internals_of(self._manager).guard.entering("KVSender.send_sources"):  # refused inside another call
            sources = plan_source(self._manager, cache, KVSlice(len(request.tokens)), request.cached_per_group)
            committed = cache.committed_tokens
            if committed != request.tokens[: len(committed)]:
                raise ValueError(
                    f"cache {cache.id} committed {len(committed)} tokens that request {request.request_id}'s tokens do "
                    "not start with: its KV is another prompt's"
                )
            internals_of(self._manager).store.flush(int(cache.cuda_stream))
        synchronize(self._endpoint.mem_type)
        self._sent.hold(request.request_id, cache)
        try:
            send(self._connection, Sources(request.request_id, sources, extra))
        except BaseException:
            self._sent.release(request.request_id)
            raise
        return sources

    def send_error(self, request: PrefillRequest, message: str) -> None:
        self._sent.release(request.request_id)
        send(self._connection, Failed(request.request_id, str(message)))

    def wait_released(self, request: PrefillRequest, timeout_s: float = 60.0) -> bool:
        """Wait until the decode side read the request's KV (True: its NIXL notification came) or gave up (False:
        an abort, also one that came while another request was waited for, a closed connection, or the timeout).
        Either way the caller may close the cache now. The receiver's deadline is ``timeout_s`` after it sent the
        request, however late it reads, so with equal ``timeout_s`` it gives up (and cancels its READ) before this
        one releases pages it might still be reading; never give the sender a shorter one.
        ``TransferError`` for a control message that is not one of the protocol's; that or an interrupt while
        waiting leaves the cache held (the READ may still come): wait again, or ``close`` the sender."""
        deadline = time.monotonic() + _check_timeout(timeout_s)
        ended = self._wait_released(request, deadline)
        self._sent.release(request.request_id)  # the cache accepts every call again
        return ended

    def _wait_released(self, request: PrefillRequest, deadline: float) -> bool:
        while True:
            for notification in self._endpoint.notifications():
                notified = notified_id(notification)
                if notified is None or not self._sent.note_ended(notified, True):
                    self.ignored_notifications += 1
            ended = self._sent.ended(request.request_id)
            if ended is not None:
                return ended
            if time.monotonic() > deadline:
                return False
            try:
                if self._connection.poll(0):
                    message = decode(receive_bytes(self._connection))
                    if isinstance(message, Abort):  # this request's, or another's whose wait comes later
                        self._sent.note_ended(message.request_id, False)
                    elif isinstance(message, (Request, Bye)):
                        self._pending.append(message)  # the next request may overtake this one's NIXL notification
                    else:
                        raise TransferError(f"unexpected control message while waiting for the READ: {message!r}")
            except (EOFError, OSError):
                return False
            time.sleep(POLL_S)

    def close(self) -> None:
        """End the endpoint, then release every held cache: the agent is gone with it, so a READ the decode side
        starts later fails (NIXL_ERR_REMOTE_DISCONNECT); deregistering the pools and forgetting the peer alone
        did not stop one (tests/test_nixl_sender_hold.py)."""
        self._endpoint.close()
        self._sent.release_all()


# -------------------------------------------------------------------------------------------------- decode side


@final
class ReceivedKV(Sealed):
    """One finished handoff on the decode side: the plan that moved, the sender's extra, the READ's seconds."""

    def __init__(self, plan: TransferPlan, extra: object, seconds: float) -> None:
        self.plan = plan
        self.extra = extra
        self.seconds = seconds


@final
class KVReceiver(Sealed):
    """The decode side: requests a prompt's KV and READs it in one batched NIXL transfer. ``agent_factory``: see
    ``_nixl_agent`` (a test's wrapper; the real agent by default)."""

    def __init__(
        self, manager: KVCacheManager, connection: Connection, timeout_s: float = 60.0, agent_factory: AgentFactory = new_agent
    ) -> None:
        self.timeout_s: float = _check_timeout(timeout_s)
        self._connection = connection
        self._endpoint: NixlEndpoint = NixlEndpoint(manager, "decode", agent_factory)
        self._manager = manager
        self._ids = itertools.count()
        self._open = OpenRequests()
        try:
            handshake(self._endpoint, connection, True, self.timeout_s)
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
        changed): ``tokens`` must start with the cache's reused prefix, and a cache has one request at a time. A
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
        self._check_open()
        reused = cache.committed_tokens
        if reused != token_list[: len(reused)]:
            raise ValueError(f"tokens: cache {cache.id} reused a prefix of {len(reused)} tokens that tokens does not start with")
        self._open.refuse_a_second(cache)
        _refuse_inside_a_call(self._manager, "KVReceiver.request")
        self._endpoint.unfinished.retry()
        self._abort_abandoned()
        request_id = next(self._ids)
        deadline = time.monotonic() + self.timeout_s  # before the sender's wait starts (see OpenRequests)
        try:
            send(self._connection, Request(request_id, [int(token) for token in token_list], counts))
        except BaseException:
            cache.close()
            raise
        self._open.note(request_id, cache, len(token_list), counts, deadline)
        return request_id

    def read(self, cache: KVCache, request_id: int) -> ReceivedKV:
        """Wait for the request's sources, pair them with ``cache``'s slots and READ them all in one NIXL
        transfer. ``ValueError`` before anything, nothing changed, when ``request_id`` is no request of this
        receiver still to read or ``cache`` is not the cache it was made for. On any later failure: the cache is
        closed, the sender told (when it can still hear), ``TransferError`` (or the ValueError of a plan that does
        not fit the cache) raised. A READ that NIXL could not stop leaves the cache open instead, held by
        ``endpoint.unfinished`` and closed there once NIXL releases the READ (``cache.held_for`` says so; closing
        it yourself raises ``RuntimeError`` until then)."""
        _refuse_inside_a_call(self._manager, "KVReceiver.read")
        self._check_open()
        asked = self._open.take(request_id, cache)
        deadline = asked.deadline
        message: Sources | Failed | None = None
        try:  # from here on the request is this call's: whatever fails (an interrupt too) ends it, the sender told
            self._endpoint.unfinished.retry()
            self._abort_abandoned()
            message = self._open.answer_of(request_id)
            while message is None:  # another request's answer (they may come in any order) waits for its read
                received = receive(self._connection, deadline, f"the sources of request {request_id}")
                message = self._open.keep_answer(received, request_id)
            if isinstance(message, Failed):
                raise TransferError(f"the prefill side failed request {request_id}: {message.message}")
            check_answer(request_id, asked, message.plan)
            plan = complete_plan(self._manager, cache, message.plan)
            notification = notification_of(request_id)
            if not plan.descriptors:
                self._endpoint.notify(notification)
                return ReceivedKV(plan, message.extra, 0.0)
            with internals_of(self._manager).guard.entering("KVReceiver.read"):
                internals_of(self._manager).store.flush(int(cache.cuda_stream))  # e.g. a copy-on-write copy into a page we overwrite
            synchronize(self._endpoint.mem_type)
            seconds = self._endpoint.read(plan, notification, deadline, cache, self._listen)
            return ReceivedKV(plan, message.extra, seconds)
        except BaseException as error:
            if not self._endpoint.unfinished.holds(cache):
                cache.close()
            if message is None:
                self._open.give_up(request_id)  # its answer may still come: dropped then
            self._abort(request_id, str(error))
            raise

    def _listen(self) -> bool:
        """While a READ runs: keep the answers of other requests for their reads; False when the prefill side
        closed the connection, ``TransferError`` when it sent anything else."""
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

    def close(self) -> None:
        """Tell the sender which requests will not be read and that no more come, then close the endpoint;
        idempotent. Its ``request`` and ``read`` raise ``ValueError`` afterwards."""
        if self._endpoint.closed:
            return
        for request_id in self._open.forget_all():
            self._abort(request_id, "the receiver closed")
        try:
            send(self._connection, Bye())
        except TransferError:
            pass
        self._endpoint.close()


def _refuse_inside_a_call(manager: KVCacheManager, call: str) -> None:
    """``RuntimeError`` (nothing sent, nothing received) when ``call`` comes from user code inside another call of
    ``manager``: the handoff changes the manager's pages (its copies, the caches it closes)."""
    with internals_of(manager).guard.entering(call):
        pass


def receiver_endpoint(receiver: KVReceiver) -> NixlEndpoint:
    """The NIXL endpoint a receiver reads through (internal API: for white-box tests)."""
    return receiver._endpoint
