"""The NIXL agent as the handoff sees it, and the reads whose landing spots must stay held.

``NixlAgent`` is the part of ``nixl_cu12.nixl_agent`` the transport calls; ``NixlEndpoint`` takes a factory of
them (``new_agent`` by default), so a test can wrap the real agent without patching anything.

``UnfinishedReads``: a READ that failed or was given up (timeout, error state, gone peer, ``abandon``) is released
only once NIXL reports it ended; while it is in progress it may still write into the receiving cache's slots (NIXL
accepts the release of a READ in progress but does not stop it: ``settled``). Freeing those slots then would hand
another request pages that the peer's late bytes overwrite, so the cache stays open
under a ``CacheHold`` (its pages out of every free list; the engine's own ``close``, ``suspend``, ``resize`` or
``commit`` of it raise ``RuntimeError``), until NIXL reports it DONE or ERR: each later
``read``, ``request`` and ``close`` of the receiver asks again, and then the hold is released and the cache
closed. Tearing the endpoint down (peer removed, memory deregistered) does not stop them either (measured: a READ
still landed after it), so ``KVReceiver.close`` first waits for them, at most its ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Final, Protocol, cast

from mypy_extensions import mypyc_attr

from .._cache.handle import CacheHold
from .._manager.manager import KVCache
from .control_messages import TransferError

NIXL_INSTALL = "pip install --no-deps nixl-cu12==1.5.1"


@mypyc_attr(native_class=False)
class NixlAgent(Protocol):
    """The part of ``nixl_cu12.nixl_agent`` the transport uses. A member answering a value raises when a class
    naming this Protocol as its base leaves it out (compiled, a bare ``...`` body would hand back an invalid
    value)."""

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str) -> object:
        raise NotImplementedError

    def deregister_memory(self, dereg_list: object) -> None: ...

    def get_agent_metadata(self) -> bytes:
        raise NotImplementedError

    def add_remote_agent(self, metadata: bytes) -> str | bytes:
        raise NotImplementedError

    def remove_remote_agent(self, agent: str) -> None: ...

    def get_xfer_descs(self, descs: object, mem_type: str) -> object:
        raise NotImplementedError

    def initialize_xfer(self, operation: str, local_descs: object, remote_descs: object, remote_agent: str, notif_msg: bytes) -> object:
        raise NotImplementedError

    def transfer(self, handle: object) -> str:
        raise NotImplementedError

    def check_xfer_state(self, handle: object) -> str:
        raise NotImplementedError

    def release_xfer_handle(self, handle: object) -> None: ...

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        raise NotImplementedError

    def send_notif(self, remote_agent_name: str, notif_msg: bytes) -> None: ...


AgentFactory = Callable[[str], NixlAgent]


def _closed() -> ValueError:
    return ValueError("this NIXL endpoint is closed")


@mypyc_attr(native_class=False)
class _ClosedAgent(NixlAgent):
    """What a closed endpoint keeps in place of its agent: dropping the real one ends the agent's threads and file
    descriptors at once (they lasted as long as a closed endpoint was referenced: about 15 descriptors and a thread
    each). Every call is a ``ValueError``; releasing a handle is a no-op (nothing can run any more)."""

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str) -> object:
        raise _closed()

    def deregister_memory(self, dereg_list: object) -> None:
        raise _closed()

    def get_agent_metadata(self) -> bytes:
        raise _closed()

    def add_remote_agent(self, metadata: bytes) -> str | bytes:
        raise _closed()

    def remove_remote_agent(self, agent: str) -> None:
        raise _closed()

    def get_xfer_descs(self, descs: object, mem_type: str) -> object:
        raise _closed()

    def initialize_xfer(self, operation: str, local_descs: object, remote_descs: object, remote_agent: str, notif_msg: bytes) -> object:
        raise _closed()

    def transfer(self, handle: object) -> str:
        raise _closed()

    def check_xfer_state(self, handle: object) -> str:
        raise _closed()

    def release_xfer_handle(self, handle: object) -> None:
        pass

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        raise _closed()

    def send_notif(self, remote_agent_name: str, notif_msg: bytes) -> None:
        raise _closed()


CLOSED_AGENT: Final[NixlAgent] = _ClosedAgent()


def nixl_available() -> bool:
    """Whether ``nixl_cu12`` imports (the transport's only extra dependency)."""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return False
    return True


def new_agent(name: str) -> NixlAgent:
    """A real NIXL agent named ``name`` (UCX backend)."""
    try:
        import nixl_cu12
    except ImportError as error:
        raise ImportError(f"the NIXL transport needs nixl_cu12: {NIXL_INSTALL}") from error
    if "NIXL_LOG_LEVEL" not in os.environ:
        logging.getLogger("nixl").setLevel(logging.WARNING)
    os.environ.setdefault("UCX_MODULES", "^efa")  # read when the UCX backend starts; see _nixl_transport's docstring
    return cast(NixlAgent, nixl_cu12.nixl_agent(name))


def released(agent: NixlAgent, handle: object) -> bool:
    """Release a transfer handle; False when NIXL refuses."""
    try:
        agent.release_xfer_handle(handle)
    except Exception:  # NIXL's binding errors derive from Exception only
        return False
    return True


def settled(agent: NixlAgent, handle: object, state: str = "") -> bool:
    """Whether a READ can no longer write (NIXL reports it DONE or ERR, or raises an error status for it, or
    ``state`` already was one); its handle is released then. A READ in progress is never released: NIXL accepts
    the release, yet the READ goes on landing (nixl-cu12 1.5.1 over UCX's TCP transport: 268 MB arrived after an
    accepted release), so only its end frees its landing pages. An ERR is an end: nothing landed after one in our
    measurement (``tools/nixl_late_writes.py``)."""
    if state not in ("DONE", "ERR"):
        try:
            state = agent.check_xfer_state(handle)
        except Exception:  # the binding raises for an error status: the READ ended
            state = "ERR"
        if state not in ("DONE", "ERR"):
            return False
    released(agent, handle)  # a refusal changes nothing: nothing more lands
    return True


# Why a receiving cache is held (``KVCache.held_for``).
UNFINISHED_READ: Final = (
    "an unfinished NIXL READ may still write into its pages; the receiver closes it once NIXL lets go"
)


class UnfinishedReads:
    """Receiving caches held (``KVCache.hold``) until NIXL releases the READ that may still write into them."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self._held: list[tuple[object, CacheHold[KVCache]]] = []

    def hold(self, handle: object, cache: KVCache) -> None:
        self._held.append((handle, cache.hold(UNFINISHED_READ)))

    def holds(self, cache: KVCache) -> bool:
        return any(hold.cache is cache for _, hold in self._held)

    @property
    def count(self) -> int:
        """How many READs are still unaccounted for (each holds its cache's pages)."""
        return len(self._held)

    def retry(self) -> None:
        """Release what NIXL now lets go of and close those caches (their pages return to the free lists). Each
        READ leaves the list as NIXL lets it go, so an error or interrupt part way (the agent, a close refused
        inside another call) never leaves a released handle listed, to be released again."""
        for handle, hold in list(self._held):
            if settled(self.agent, handle):
                # By the hold, not the tuple: compiled, a tuple is unboxed and boxed again, a new object each time.
                self._held = [held for held in self._held if held[1] is not hold]
                _release_and_close(hold)

def _release_and_close(hold: CacheHold[KVCache]) -> None:
    hold.release()
    hold.cache.close()


NOTIFICATION_PREFIX: Final = "kvm2-done:"


def notification_of(request_id: int) -> bytes:
    """The NIXL notification a READ for ``request_id`` is posted with."""
    return f"{NOTIFICATION_PREFIX}{request_id}".encode()


def notified_id(notification: bytes) -> int | None:
    """The request id of a ``kvm2-done:<id>`` notification; None for anything else (decimal ASCII digits only)."""
    text = notification.decode("ascii", errors="replace")
    digits = text[len(NOTIFICATION_PREFIX) :]
    if not text.startswith(NOTIFICATION_PREFIX) or not digits.isascii() or not digits.isdigit() or len(digits) > 19:
        return None
    return int(digits)


# Why a sending cache is held (``KVCache.held_for``).
SOURCES_SENT: Final = (
    "the decode side's NIXL READ may be reading its pages; KVSender.wait_released (or close) lets it go"
)


class SentSources:
    """Sending caches held (``KVCache.hold``) from ``KVSender.send_sources`` until ``wait_released`` ends (or the
    sender closes): the decode side READs their slots by address, so a suspend, shrink or close in between would
    hand those slots to another request and the READ would carry that request's bytes. How a request being served
    (returned by ``next_request``, not released yet) ended (its READ notification, or the decode side's abort, also
    one before its sources went out) is kept until its release, whichever request's wait it reached; that of any
    other request is not: it would wait for a ``wait_released`` that never comes.

    A notification or an abort names its request by id alone, so an id serves one request only (``check_new``):
    served again, the earlier READ's notification arriving late would end the new request's wait while nothing
    read its cache, and the engine would free pages the peer may still READ."""

    def __init__(self) -> None:
        self._held: dict[int, CacheHold[KVCache]] = {}
        self._serving: set[int] = set()  # requests returned by next_request and not released yet
        self._ended: dict[int, bool] = {}  # requests served the decode side is done with: True read, False aborted
        self._last_id = -1  # the largest request id served: ids only grow (``check_new``)

    def check_new(self, request_id: int) -> None:
        """``TransferError`` unless ``request_id`` is larger than every id served before (the receiver counts them
        up from 0; a request answered with an error is not served): the id is the only thing tying a late
        notification or abort to its request."""
        if request_id <= self._last_id:
            raise TransferError(
                f"request id {request_id} was already used (the last one served is {self._last_id}): a late "
                "notification of the earlier request would release this one"
            )
        self._last_id = request_id

    def holds(self, request_id: int) -> bool:
        return request_id in self._held

    def serve(self, request_id: int) -> None:
        self._serving.add(request_id)

    def hold(self, request_id: int, cache: KVCache) -> None:
        self._held[request_id] = cache.hold(SOURCES_SENT)

    def note_ended(self, request_id: int, read: bool) -> bool:
        """The decode side read ``request_id``'s pages (``read``) or gave it up: kept (True) only while it is
        served, and only the first word (a READ that ended stays read)."""
        if request_id not in self._serving:
            return False
        self._ended.setdefault(request_id, read)
        return True

    def ended(self, request_id: int) -> bool | None:
        """True: read; False: aborted; None: neither yet."""
        return self._ended.get(request_id)

    def release(self, request_id: int) -> None:
        self._serving.discard(request_id)
        self._ended.pop(request_id, None)
        hold = self._held.pop(request_id, None)
        if hold is not None:
            hold.release()

    def release_all(self) -> None:
        self._serving.clear()
        self._ended.clear()
        while self._held:
            _, hold = self._held.popitem()
            hold.release()
