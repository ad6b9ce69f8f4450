"""Transfers that miss their deadline, for the fuzzer's store (``FlakyStore``'s ``STALL`` fault).

The real ``MooncakeStore`` runs over ``StallingClient``, an in-memory stand-in for ``MooncakeDistributedStore``
that moves bytes by address as Mooncake does (``batch_put_from`` / ``batch_get_into``). An armed call blocks until
the store's ``get_deadline_s`` / ``put_deadline_s`` (milliseconds) passed, so the tier sees a ``RemoteStoreError``
(a miss, the store down); the call then completes late, when the next store call comes or after the client is
closed: a put stores its object after the tier was told it failed, a get writes into the buffer it was handed. A
late transfer into a buffer nobody keeps any more would be a write into freed memory (a wrong page, or heap
corruption): the client checks every such buffer is still alive, and that a late put stores the bytes its caller
handed it (not a half-written or reused buffer's), and notes each violation in ``problems``.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Final

from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2._remote.mooncake import OBJECT_NOT_FOUND, MooncakeStore

DEADLINE_S: Final = 0.002
"""The fuzzer's get and put deadline; a stalled call waits until released, never in real time beyond this."""


class StalledCall:
    """One transfer held past its deadline: released by ``StallingClient.complete_late``. ``sent``: the bytes a
    put was handed, as they were when it was called (a late put must store those, not what the buffer holds now)."""

    def __init__(self, buffers: list[weakref.ref[HostBuffer]], sent: list[bytes]) -> None:
        self.buffers = buffers
        self.sent = sent
        self.release = threading.Event()
        self.arrived = threading.Event()  # the store's transfer thread reached the client (``thread``)
        self.thread: threading.Thread | None = None


class StallingClient:
    """A ``MooncakeDistributedStore`` over ``objects`` (a ``MemoryStoreConfig``'s dict): the calls
    ``MooncakeStore`` makes. ``arm(keys, buffers, put)`` makes that put or get stall (``buffers``: what the caller
    hands it, watched through weak references). Armed calls are told by their ``keys`` list (the one object
    ``MooncakeStore`` passes on) and released even before their transfer thread got here (a loaded machine may start
    it after the deadline passed)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.armed: dict[int, tuple[list[str], StalledCall]] = {}
        self.stalled: list[StalledCall] = []
        self.problems: list[str] = []
        self.stalled_gets = self.stalled_puts = 0  # calls that missed their deadline
        self.closed = threading.Event()

    def arm(self, keys: list[str], buffers: list[HostBuffer], put: bool) -> None:
        sent = [buffer.tobytes() for buffer in buffers] if put else []
        call = StalledCall([weakref.ref(buffer) for buffer in buffers], sent)
        self.armed[id(keys)] = (keys, call)
        self.stalled.append(call)

    def complete_late(self) -> None:
        """Let every stalled call complete, and wait until its thread ended (milliseconds; a call that never
        reached the client, refused before its transfer started, is waited for 1 s)."""
        stalled, self.stalled = self.stalled, []
        for call in stalled:
            call.release.set()
        for call in stalled:
            if call.arrived.wait(1.0) and call.thread is not None:
                call.thread.join()

    def _stall(self, what: str, keys: list[str]) -> StalledCall | None:
        """Block an armed call until ``complete_late``; then every buffer it was handed must still be alive."""
        armed = self.armed.pop(id(keys), None)
        if armed is None:
            return None
        call = armed[1]
        call.thread = threading.current_thread()
        call.arrived.set()
        if what == "get":
            self.stalled_gets += 1
        else:
            self.stalled_puts += 1
        call.release.wait()
        dead = sum(buffer() is None for buffer in call.buffers)
        if dead:
            self.problems.append(f"a late {what} touched {dead} freed buffer(s)")
            raise RuntimeError("freed buffers")  # the transfer's thread ends; nothing is written
        return call

    def batch_put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        call = self._stall("put", keys)
        for index, (key, address, size) in enumerate(zip(keys, addresses, sizes)):
            data = ctypes.string_at(address, size)
            if call is not None and data != call.sent[index]:
                self.problems.append(f"a late put stored other bytes under {key} than its caller handed it")
            self.objects[key] = data
        return [0] * len(keys)

    def batch_get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        call = self._stall("get", keys)
        codes: list[int] = []
        for key, address, size in zip(keys, addresses, sizes):
            data = self.objects.get(key)
            if data is None:
                codes.append(OBJECT_NOT_FOUND)
            elif len(data) > size:
                codes.append(-600)  # BUFFER_TOO_SMALL
            else:
                ctypes.memmove(address, data, len(data))
                codes.append(len(data))
        return codes

    def health_check(self) -> int:
        return 0

    def close(self) -> None:
        self.closed.set()


def stalling_store(objects: dict[str, bytes]) -> tuple[MooncakeStore, StallingClient]:
    """The real ``MooncakeStore`` over a ``StallingClient`` of ``objects``, its deadlines and close wait
    ``DEADLINE_S``."""
    client = StallingClient(objects)
    return MooncakeStore(client, DEADLINE_S, DEADLINE_S, close_wait_s=DEADLINE_S), client

