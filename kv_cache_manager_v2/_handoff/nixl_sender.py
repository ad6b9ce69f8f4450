"""The prefill side of the NIXL handoff: ``KVSender`` answers the decode side's requests with source descriptors and
holds each sending cache until the decode side read it or gave up. ``nixl``'s docstring describes the protocol."""

from __future__ import annotations

from collections import deque
import time
from multiprocessing.connection import Connection
from typing import Final, Sequence, SupportsFloat, SupportsIndex, final

from .._manager.manager import KVCache, KVCacheManager
from .control_messages import Abort, Bye, ControlMessage, Failed, Request, Sources, check_extra, decode, receive_bytes, send
from .control_messages import MAX_INT, TransferError, check_timeout
from .kv_format import KVFormat
from .._base.hashing import ReuseScope, Token, TokenSequence, check_scope, check_tokens, root_key
from .._manager.core import internals_of
from .nixl_agent import SentSources, notified_id
from .nixl_endpoint import POLL_S, NixlEndpoint, handshake, synchronize
from .transfer import KVSlice, SourcePlan
from .plan import check_cache, check_counts, check_prompt_rows, plan_source
from .._cache.handle import state_of
from .._base.types import Handle, Sealed
from .._base.validation import as_int_in, as_positions


def check_format(kv_format: KVFormat) -> None:
    if not isinstance(kv_format, KVFormat):
        raise TypeError(f"kv_format must be a KVFormat (what the engine's page bytes mean), got {kv_format!r}")


# The default of every timeout of the handoff: the receiver's READ deadline, a request's wait for its READ.
DEFAULT_TIMEOUT_S: Final = 60.0
# The longest READ deadline a sender accepts by default: a request's pages stay held that long after the answer, so
# a decode side asking for more (the wire allows a year) would pin the prefill side's GPU for as long.
DEFAULT_MAX_READ_TIMEOUT_S: Final = 600.0


@final
class PrefillRequest(Sealed):
    """What the decode side asked for: a prompt, its per-group cached counts, and the reuse scope (LoRA, tenant
    salt) the decode side matched its prefix in: prefill the prompt in a cache of that scope
    (``create_kv_cache(request.reuse_scope, request.tokens)``), since blocks of another scope hold other KV.
    ``read_timeout_s``: how long after sending the request the decode side may still READ its pages
    (``KVReceiver.timeout_s``), so how long ``wait_released`` holds them at least.

    ``next_request`` builds it from a checked control message; built by hand (a test, a bridge from another
    transport) every field is checked the same way: ``ValueError``/``TypeError`` naming the field."""

    def __init__(
        self,
        request_id: SupportsIndex,
        tokens: TokenSequence,
        cached_per_group: Sequence[SupportsIndex],
        reuse_scope: ReuseScope | None = None,
        read_timeout_s: SupportsFloat = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.request_id: int = as_int_in(request_id, "PrefillRequest.request_id", 0, MAX_INT + 1)
        token_list = check_tokens(tokens, "PrefillRequest.tokens")
        for position, token in enumerate(token_list):
            if type(token) is not int:
                raise TypeError(f"PrefillRequest.tokens[{position}] must be an int (a text token), got {token!r}")
        self.tokens: list[int] = [int(token) for token in token_list]  # a copy: the caller's list stays theirs
        counts = list(as_positions(cached_per_group, "PrefillRequest.cached_per_group"))
        for group, count in enumerate(counts):
            if count > len(self.tokens):
                raise ValueError(
                    f"PrefillRequest.cached_per_group[{group}] = {count} is more than the prompt's {len(self.tokens)} "
                    "tokens"
                )
        self.cached_per_group: list[int] = counts
        scope = check_scope(reuse_scope, "PrefillRequest.reuse_scope")
        self.reuse_scope: ReuseScope = ReuseScope() if scope is None else scope
        self.read_timeout_s: float = check_timeout(read_timeout_s, "PrefillRequest.read_timeout_s")

    def __reduce__(self) -> tuple[type[PrefillRequest], tuple[int, list[int], list[int], ReuseScope, float]]:
        """Pickled as its constructor's arguments: compiled, the default pickling calls it with none."""
        return (
            PrefillRequest,
            (self.request_id, self.tokens, self.cached_per_group, self.reuse_scope, self.read_timeout_s),
        )


@final
class KVSender(Handle):
    """The prefill side: answers requests with source descriptors and learns when it may release the pages.
    ``max_read_timeout_s``: the longest READ deadline (``PrefillRequest.read_timeout_s``) a request may carry, since
    its pages stay held that long; a request asking for more is answered with an error, never returned.
    ``ignored_notifications`` counts NIXL notifications that were not a ``kvm2-done:<id>`` of a request whose
    sources are held (one never sent or already released: nothing would wait for it, so it is not kept)."""

    def __init__(
        self, manager: KVCacheManager, connection: Connection, *, kv_format: KVFormat,
        timeout_s: SupportsFloat = DEFAULT_TIMEOUT_S, max_read_timeout_s: SupportsFloat = DEFAULT_MAX_READ_TIMEOUT_S,
    ) -> None:
        timeout = check_timeout(timeout_s)
        self.max_read_timeout_s: float = check_timeout(max_read_timeout_s, "max_read_timeout_s")
        check_format(kv_format)
        self._connection = connection
        self._endpoint: NixlEndpoint = NixlEndpoint(manager, "prefill")
        self._manager = manager
        self.ignored_notifications: int = 0
        self._pending: deque[ControlMessage] = deque()
        self._sent = SentSources()
        try:
            handshake(self._endpoint, connection, False, timeout, kv_format)
        except BaseException:
            self._endpoint.close()
            raise

    def next_request(self, timeout_s: SupportsFloat = 3600.0) -> PrefillRequest | None:
        """The next request, or None when the decode side said bye or closed the connection; ``TransferError``
        for a control message that is not one of the protocol's. A request whose counts do not fit this manager's
        layer groups, or whose ``read_timeout_s`` is above ``max_read_timeout_s``, is answered with an error here
        (the decode side's read raises it), never returned. The engine
        must end every request returned, with ``send_error`` or ``send_sources`` then ``wait_released``: the sender
        cannot tell a slow prefill from a forgotten request, so one left unended stays recorded (its cache held once
        its sources went out) until ``close``."""
        deadline = time.monotonic() + check_timeout(timeout_s)
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
            if message.read_timeout_s > self.max_read_timeout_s:
                send(self._connection, Failed(message.request_id, (
                    f"read_timeout_s {message.read_timeout_s} is above the prefill side's max_read_timeout_s "
                    f"{self.max_read_timeout_s}: it would hold the pages that long (use a shorter KVReceiver.timeout_s "
                    "or raise KVSender's max_read_timeout_s)"
                )))
                continue
            self._sent.check_new(message.request_id)
            self._sent.serve(message.request_id)
            return PrefillRequest(
                message.request_id, message.tokens, message.counts, message.reuse_scope, message.read_timeout_s
            )

    def send_sources(self, request: PrefillRequest, cache: KVCache, extra: object = None) -> SourcePlan:
        """Plan the request's sources from ``cache`` (which must hold the whole prompt, be of the request's reuse
        scope, and be known to hold the request's tokens in every row: committed, or given to ``create_kv_cache``
        past them; ``disagg.plan_transfer``'s check) and send them. The cache's pending copies run first, and the device is idle when
        the plan leaves: NIXL may read at once. ``extra`` must be JSON data (TypeError before anything is sent);
        ``TransferError`` when the decode side is gone. From then until ``wait_released`` returns the cache is held (``KVCache.held_for``): the decode
        side READs its slots, so its ``close``, ``suspend``, ``resize`` and ``commit`` raise ``RuntimeError``, and
        sending the request's sources again is a ``ValueError``."""
        check_extra(extra)
        if self._sent.holds(request.request_id):  # the decode side may be READing the first cache's slots
            raise ValueError(f"the sources of request {request.request_id} were sent already: wait_released first")
        with internals_of(self._manager).guard.entering("KVSender.send_sources"):  # refused inside another call
            check_cache(self._manager, cache, "src_cache")
            if root_key(cache.reuse_scope) != root_key(request.reuse_scope):
                raise ValueError(
                    f"cache {cache.id} is of {cache.reuse_scope!r}, request {request.request_id} of "
                    f"{request.reuse_scope!r}: blocks it reused or committed hold another scope's KV"
                )
            tokens: list[Token] = list(request.tokens)
            check_prompt_rows(state_of(cache), f"cache {cache.id}", tokens, f"request {request.request_id}'s")
            sources = plan_source(self._manager, cache, KVSlice(len(request.tokens)), request.cached_per_group)
            internals_of(self._manager).store.flush(int(cache.cuda_stream))
        synchronize(self._endpoint.mem_type)
        self._sent.hold(request.request_id, cache)
        try:
            send(self._connection, Sources(request.request_id, sources, extra))
        except BaseException:
            self._sent.release(request.request_id)
            raise
        if not sources.sources:  # nothing to READ, so no notification comes (nor any NIXL traffic): read already
            self._sent.note_ended(request.request_id, True)
        return sources

    def send_error(self, request: PrefillRequest, message: str) -> None:
        """Tell the decode side this request's KV will not come (its ``receive`` raises ``TransferError`` quoting
        ``message``) and stop holding any cache sent for it."""
        self._sent.release(request.request_id)
        send(self._connection, Failed(request.request_id, str(message)))

    def wait_released(self, request: PrefillRequest, timeout_s: SupportsFloat | None = None) -> bool:
        """Wait until the decode side read the request's KV (True: its NIXL notification came, or at once when the
        plan sent had no sources: nothing will read the cache) or gave up (False:
        an abort, also one that came while another request was waited for, a closed connection, or the timeout).
        Either way the caller may close the cache now. ``timeout_s`` defaults to the request's ``read_timeout_s``
        and may not be shorter (``ValueError``, nothing changed): the receiver uses a READ only when it ended by
        ``read_timeout_s`` after the request went out, which is before this wait (started later, at the answer)
        can time out, so no page is released while a READ the decode side will use may still read it.
        ``TransferError`` for a control message that is not one of the protocol's; that or an interrupt while
        waiting leaves the cache held (the READ may still come): wait again, or ``close`` the sender."""
        if not isinstance(request, PrefillRequest):
            raise TypeError(f"request must be a PrefillRequest, got {request!r}")
        wait_s = request.read_timeout_s if timeout_s is None else check_timeout(timeout_s)
        if wait_s < request.read_timeout_s:
            raise ValueError(
                f"timeout_s {wait_s} is shorter than request {request.request_id}'s read_timeout_s "
                f"{request.read_timeout_s}: the decode side may still READ its pages after this wait gave them up "
                "(leave timeout_s out to wait that long)"
            )
        deadline = time.monotonic() + wait_s
        ended = self._wait_released(request, deadline)
        self._sent.release(request.request_id)  # the cache accepts every call again
        return ended

    def _wait_released(self, request: PrefillRequest, deadline: float) -> bool:
        while True:
            closed = self._take_control_messages()
            for notification in self._endpoint.notifications():
                notified = notified_id(notification)
                if notified is None or not self._sent.note_ended(notified, True):
                    self.ignored_notifications += 1
            ended = self._sent.ended(request.request_id)
            if ended is not None:
                return ended
            if closed or time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)

    def _take_control_messages(self) -> bool:
        """Every control message that came, before the NIXL notifications that came with them: an abort sent
        before a READ it could not stop ended wins over that READ's notification, however late this process looks
        (the first word is kept). True when the connection closed."""
        try:
            while self._connection.poll(0):
                message = decode(receive_bytes(self._connection))
                if isinstance(message, Abort):  # this request's, one whose wait comes later, or a queued one's
                    if not self._sent.note_ended(message.request_id, False):
                        self._drop_queued(message.request_id)
                elif isinstance(message, (Request, Bye)):
                    self._pending.append(message)  # the next request may overtake this one's NIXL notification
                else:
                    raise TransferError(f"unexpected control message while waiting for the READ: {message!r}")
        except (EOFError, OSError):
            return True
        return False

    def _drop_queued(self, request_id: int) -> None:
        """The decode side gave up ``request_id`` before ``next_request`` handed it out: it never is (nobody would
        READ it or abort it again, so its wait would hold the engine's pages for the whole timeout)."""
        self._pending = deque(
            message for message in self._pending
            if not (isinstance(message, Request) and message.request_id == request_id)
        )

    def close(self) -> None:
        """End the endpoint, then release every held cache: the agent is gone with it, so a READ the decode side
        starts later fails (NIXL_ERR_REMOTE_DISCONNECT); deregistering the pools and forgetting the peer alone
        did not stop one (tests/test_nixl_sender_hold.py)."""
        self._endpoint.close()
        self._sent.release_all()


def sender_endpoint(sender: KVSender) -> NixlEndpoint:
    """The NIXL endpoint a sender serves through (internal API: for white-box tests)."""
    return sender._endpoint
