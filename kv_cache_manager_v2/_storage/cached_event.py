"""``CachedCudaEvent`` (TensorRT-LLM's name): a point in a CUDA stream that the host or another stream can wait for.

Engines mark "the work queued so far on this stream" (before handing pages to another stream, before releasing a
gate) and later wait for it. On the cuda backend it is a CuPy event recorded on the caller's stream handle; where
no CUDA device is visible nothing runs asynchronously, so the mark is complete when made (yet open until waited
for, as on a device). Waiting for it on the host (``synchronize``) releases the event: a closed event is complete
and waiting for it costs nothing."""

from __future__ import annotations

from typing import Any, ClassVar, SupportsIndex

from .._base.validation import as_optional_int
from .memory import cuda_device_available
from .stream_order import cupy_stream


class CachedCudaEvent:
    """Work queued on ``stream`` up to now (``None``: the null event, complete from the start: ``NULL``)."""

    NULL: ClassVar[CachedCudaEvent]

    def __init__(self, stream: SupportsIndex | None) -> None:
        handle = as_optional_int(stream, "stream")
        self._event: Any = None
        self._closed: bool = handle is None
        if handle is not None and cuda_device_available():
            import cupy

            self._event = cupy.cuda.Event(block=False, disable_timing=True)
            self._event.record(cupy_stream(handle))

    def is_closed(self) -> bool:
        """Whether the event was released: waited for on the host (``synchronize``), or ``NULL``."""
        return self._closed

    def query_complete(self) -> bool:
        """Whether the marked work finished, without waiting."""
        return self._event is None or bool(self._event.done)

    def synchronize(self) -> None:
        """Block the host until the marked work finished, then release the event."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._closed = True

    def wait_in_stream(self, stream: SupportsIndex) -> None:
        """Make work queued on ``stream`` from now on wait for the marked work (nothing to wait for once closed)."""
        handle = as_optional_int(stream, "stream")
        if handle is None:
            raise TypeError("stream must be a CUDA stream handle, got None")
        if self._event is not None:
            cupy_stream(handle).wait_event(self._event)


# Assigned after the class (a class cannot make an instance of itself in its body); kept a native class: compiled
# as a non-native one, a ClassVar set this way crashes the module's import.
CachedCudaEvent.NULL = CachedCudaEvent(None)
