"""Cross-stream ordering of slot reuse on the cuda backend: a slot is reused only after its last user finished.

A cache's GPU work runs on its ``cuda_stream`` (an integer handle, 0 = the default stream). When pages leave a
cache's hands (suspend, close, a stream change) a fence, an event, is recorded on that stream. Every call that hands
out slots or moves pages makes its own stream wait for every unfinished fence (its own stream's too: see
``acquire``), then runs its copies on that stream and fences it too (the copied pages may be read by any stream
next). The host never blocks; finished fences are dropped as they are found. The one exception is ``host_access``:
the remote tier reads and writes device slots from the host, in the middle of a call, without knowing which stream
last wrote them, so it waits for the whole device around that access. The cpu backend has no streams:
``StreamOrder`` does nothing there.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, cast

from mypy_extensions import mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True)
class StreamOrder:
    """The cpu backend's ordering: none needed, every method is a no-op (tests subclass it to record calls)."""

    def release(self, stream: int) -> None:
        """Pages just left the hands of work queued on ``stream``."""

    def acquire(self, stream: int) -> None:
        """Work queued on ``stream`` from now on may touch slots released by other streams."""

    def copies_on(self, stream: int) -> ContextManager[object]:
        """Context in which the manager's copies are queued on ``stream``."""
        return nullcontext()

    def host_access(self) -> ContextManager[object]:
        """Context in which the host reads or writes device slots itself: every stream's queued work (an engine
        still writing a page it commits) is done on entry, and the host's own device writes are done on exit."""
        return nullcontext()


class CudaStreamOrder(StreamOrder):
    """Events and stream waits through CuPy; ``cupy.cuda.ExternalStream`` wraps the caller's stream handles."""

    def __init__(self) -> None:
        self._fences: list[tuple[int, object]] = []

    def release(self, stream: int) -> None:
        import cupy

        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(cupy_stream(stream))
        self._fences.append((stream, event))

    def acquire(self, stream: int) -> None:
        """Waits on every unfinished fence, its own stream's too: a handle is only a number, and CUDA may give a
        destroyed stream's handle to a new stream while the old one's work is still queued; a wait on an event
        recorded on the waiting stream itself costs next to nothing."""
        if not self._fences:
            return
        waiter = cupy_stream(stream)
        unfinished: list[tuple[int, object]] = []
        for origin, event in self._fences:
            if bool(cast(Any, event).done):
                continue
            unfinished.append((origin, event))
            waiter.wait_event(event)
        self._fences = unfinished

    def copies_on(self, stream: int) -> ContextManager[object]:
        return cast(ContextManager[object], cupy_stream(stream))

    def host_access(self) -> ContextManager[object]:
        return DeviceSynchronized()

    @property
    def num_unfinished(self) -> int:
        """Fences not yet seen finished (for tests and debugging)."""
        return len(self._fences)


class DeviceSynchronized:
    """Synchronizes the current device on entry and on exit (``CudaStreamOrder.host_access``)."""

    def __enter__(self) -> None:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()


def cupy_stream(stream: int) -> Any:
    """CuPy's stream object for a raw handle (CuPy is untyped, hence ``Any``); internal, also the FakeEngine's."""
    import cupy

    if stream == 0:
        return cupy.cuda.Stream.null
    return cupy.cuda.ExternalStream(stream)
