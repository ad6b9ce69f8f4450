"""One manager's NIXL agent for the handoff (``NixlEndpoint``), the handshake that introduces two of them, and the
device synchronization NIXL needs (it moves memory outside any CUDA stream). ``nixl``'s docstring describes the
protocol these serve."""

from __future__ import annotations

import itertools
import os
import time
from multiprocessing.connection import Connection
from typing import Callable, final

import numpy as np

from .._base.types import Handle
from .._manager.core import check_alive, internals_of
from .._manager.manager import KVCache, KVCacheManager
from .control_messages import Hello, TransferError, receive, send
from .kv_format import KVFormat
from .nixl_agent import CLOSED_AGENT, AgentFactory, NixlAgent, UnfinishedReads, new_agent, settled
from .same_layout import check_same_layout_summary, layout_summary
from .transfer import TransferPlan

POLL_S = 0.0001
_PEER_LEFT = "the prefill side closed the control connection (it died or gave up)"
_names = itertools.count()


def device_of(manager: KVCacheManager) -> tuple[str, int]:
    """NIXL's memory type and device id of the manager's GPU tier."""
    pools = internals_of(manager).store.gpu_pools()
    if not pools[0].on_device:
        return "DRAM", 0
    import cupy

    return "VRAM", int(cupy.cuda.runtime.getDevice())


@final
class NixlEndpoint(Handle):
    """One manager's NIXL agent: every GPU-tier pool registered once; batched READs from one peer at a time."""

    def __init__(self, manager: KVCacheManager, role: str, agent_factory: AgentFactory = new_agent) -> None:
        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager must be a KVCacheManager, got {manager!r}")
        check_alive(manager)
        self._manager = manager
        self.name: str = f"{role}-{os.getpid()}-{next(_names)}"
        mem_type, device = device_of(manager)
        self.mem_type: str = mem_type
        self.device: int = device
        self._agent: NixlAgent = agent_factory(self.name)
        self.unfinished: UnfinishedReads = UnfinishedReads(self._agent)
        pools = internals_of(manager).store.gpu_pools()
        regions = [(int(pool.address), int(pool.nbytes), self.device, "") for pool in pools]
        self.registered_bytes: int = sum(region[1] for region in regions)
        self._registration = self._agent.register_memory(regions, self.mem_type)
        self.peer: str | None = None  # the peer's agent, once NIXL loaded its metadata (``_reach_peer``)
        self._peer_metadata: bytes | None = None
        self.peer_mem_type: str = ""
        self.peer_device: int = 0
        self.peer_pools: tuple[tuple[tuple[int, int], ...], ...] = ()  # the peer's GPU pools, as its hello said
        self.closed: bool = False

    def metadata(self) -> bytes:
        """This agent's NIXL metadata: what the peer loads to reach the registered pools."""
        return self._agent.get_agent_metadata()

    def pools(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per pool group, per pool: the GPU tier's ``(address, nbytes)`` (what this side's hello declares)."""
        store = internals_of(self._manager).store
        return tuple(
            tuple((int(pool.address), int(pool.nbytes)) for pool in store.pools(0, pool_group))
            for pool_group in range(self._manager.num_pool_groups)
        )

    def keep_peer(self, metadata: bytes, mem_type: str, device: int) -> None:
        """Keep the peer's agent metadata: NIXL loads it (UCX connects then) only when this side's first READ
        needs it (``_reach_peer``), never at the handshake: UCX 1.23 aborts the process when a peer
        dies while a connection to it is being established (``nixl``'s docstring). The prefill side never needs
        it."""
        self._peer_metadata = metadata
        self.peer_mem_type = mem_type
        self.peer_device = device

    def read(
        self, plan: TransferPlan, notification: bytes, deadline: float, cache: KVCache, listen: Callable[[], bool]
    ) -> float:
        """Every descriptor of ``plan`` (into ``cache``'s slots) in ONE NIXL READ from the peer, notified with
        ``notification``; waits for completion and returns the seconds it took. ``listen``: called before the READ
        (``_reach_peer``) and while waiting, takes what the control connection brought; False when the peer closed
        it, which fails the READ unless NIXL says it is DONE (the peer may leave once notified). ``TransferError``
        on an error state, a gone peer or the deadline; a READ still in progress then keeps ``cache`` in
        ``unfinished`` (``_nixl_agent``: NIXL's release would not stop it). A READ seen DONE only after the
        deadline is not used either: the sender's wait may end right after the deadline (``KVSender.wait_released``),
        and its pages go to another request then, maybe before the READ read them."""
        peer = self._reach_peer(listen)
        descriptors = plan.descriptors
        local = np.array([(d.dst_address, d.num_bytes, self.device) for d in descriptors], dtype=np.uint64)
        remote = np.array([(d.src_address, d.num_bytes, self.peer_device) for d in descriptors], dtype=np.uint64)
        start = time.perf_counter()
        handle: object = None
        state = ""
        try:
            try:
                handle = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, self.mem_type),
                    self._agent.get_xfer_descs(remote, self.peer_mem_type),
                    peer,
                    notification,
                )
                state = self._agent.transfer(handle)
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TransferError(f"the READ of {len(descriptors)} descriptors did not complete in time")
                    if not listen():
                        if self._agent.check_xfer_state(handle) == "DONE":
                            state = "DONE"  # whole before the peer left: its notification came first
                            break
                        raise TransferError(_PEER_LEFT)
                    time.sleep(POLL_S)
                    state = self._agent.check_xfer_state(handle)
            except TransferError:
                raise
            except Exception as error:
                gone = "Disconnect" in type(error).__name__
                what = "the peer's NIXL agent is gone (it died or closed)" if gone else "NIXL READ failed"
                raise TransferError(f"{what}: {type(error).__name__}: {error}") from error
            if state != "DONE":
                raise TransferError(f"NIXL READ of {len(descriptors)} descriptors ended in state {state}")
            if time.monotonic() > deadline:
                raise TransferError(f"the READ of {len(descriptors)} descriptors was seen done only after its deadline")
            return time.perf_counter() - start
        finally:
            if handle is not None and not settled(self._agent, handle, state):
                self.unfinished.hold(handle, cache)  # it may still write there: its pages stay held

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call, from any peer."""
        received: list[bytes] = []
        for messages in self._agent.get_new_notifs().values():
            received.extend(messages)
        return received

    def close(self) -> None:
        """Forget the peer and deregister the pools (before the manager shuts down); idempotent. While NIXL still
        reports a READ in progress, nothing is torn down: its cache stays held (its pages never go to another
        request), the peer, the registration and the agent stay (forgetting the peer and deregistering did not stop
        one in our measurement); each later call asks again and tears down once NIXL let go of every READ."""
        if self._registration is None:  # torn down already
            return
        self.closed = True
        self.unfinished.retry()
        if self.unfinished.count:
            return
        if self.peer is not None:
            try:
                self._agent.remove_remote_agent(self.peer)
            except Exception:  # the peer may be gone already
                pass
            self.peer = None
        self._agent.deregister_memory(self._registration)
        self._agent = self.unfinished.agent = CLOSED_AGENT  # the real agent goes now, its threads and descriptors too
        self._registration = None

    def _reach_peer(self, listen: Callable[[], bool]) -> str:
        """The peer's agent name for a READ, loading its metadata on the first call (UCX connects then). The one
        way to the peer's agent, so ``listen`` is asked first every time: ``TransferError`` when the
        control connection shows the peer gone, with no connection attempted (UCX 1.23 aborts the process when the
        peer dies while it connects). A peer that dies after this check is the window left open."""
        if self.closed:
            raise ValueError("this NIXL endpoint is closed")
        if not listen():
            raise TransferError(_PEER_LEFT)
        if self.peer is None:
            if self._peer_metadata is None:
                raise ValueError("no peer connected: handshake first")
            try:
                name = self._agent.add_remote_agent(self._peer_metadata)
            except Exception as error:  # NIXL's binding errors derive from Exception only
                raise TransferError(f"cannot reach the peer's NIXL agent: {type(error).__name__}: {error}") from error
            self.peer = name.decode() if isinstance(name, bytes) else name
        return self.peer


def handshake(endpoint: NixlEndpoint, connection: Connection, receiver: bool, timeout_s: float, kv_format: KVFormat) -> None:
    """Exchange hellos (the receiver speaks first) and keep the peer's metadata; ``ValueError`` on both sides when the
    manager's layouts or the engines' ``KVFormat`` differ, naming each side's value."""
    ours = layout_summary(endpoint._manager) + kv_format.summary()
    hello = Hello(endpoint.metadata(), ours, endpoint.mem_type, endpoint.device, endpoint.pools())
    deadline = time.monotonic() + timeout_s
    if receiver:
        send(connection, hello)
    answer = receive(connection, deadline, "hello")
    if not isinstance(answer, Hello):
        raise TransferError(f"expected the peer's hello, got {answer!r}")
    if not receiver:
        send(connection, hello)
    if receiver:
        check_same_layout_summary(answer.layout, ours)
    else:
        check_same_layout_summary(ours, answer.layout)
    endpoint.keep_peer(answer.metadata, answer.mem_type, answer.device)
    endpoint.peer_pools = answer.pools


def synchronize(mem_type: str) -> None:
    """NIXL moves device memory outside any CUDA stream: every queued kernel or copy must be done first."""
    if mem_type == "VRAM":
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
