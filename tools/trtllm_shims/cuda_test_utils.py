"""CPU stand-in for TensorRT-LLM's ``cuda_test_utils`` (its tests' CUDA stream pool and index helpers).

Upstream's helpers drive the CUDA driver; here nothing runs asynchronously (the cpu backend copies at once), so a
stream is just a distinct integer handle and its finish event is our ``CachedCudaEvent``, complete when made. The
index helpers are written here from their names and uses; no upstream code.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, MutableSequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, NewType, TypeVar

from kv_cache_manager_v2._introspection import CachedCudaEvent

T = TypeVar("T")
U = TypeVar("U")

NDEBUG: bool = os.environ.get("TLLM_DEBUG_MODE", "")[0:1] != "1"
CudaStream = NewType("CudaStream", int)
_handles = itertools.count(0x1000)


def div_up(x: int, y: int) -> int:
    return (x + y - 1) // y


def round_up(x: int, y: int) -> int:
    return div_up(x, y) * y


def exact_div(x: int, y: int) -> int:
    assert x % y == 0, f"{x} is not a multiple of {y}"
    return x // y


class HalfOpenRange(tuple[int, int]):
    """``[beg, end)``; false when empty, and every empty range equals every other."""

    def __new__(cls, beg: int, end: int) -> HalfOpenRange:
        return tuple.__new__(cls, (beg, end))

    @property
    def beg(self) -> int:
        return self[0]

    @property
    def end(self) -> int:
        return self[1]

    def __bool__(self) -> bool:
        return self[0] < self[1]

    def __len__(self) -> int:
        return max(0, self[1] - self[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HalfOpenRange):
            return NotImplemented
        return (not self and not other) or tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash((0, 0)) if not self else hash(tuple(self))

    def __contains__(self, item: object) -> bool:
        return isinstance(item, int) and self[0] <= item < self[1]


def intersect(a: tuple[int, int], b: tuple[int, int]) -> HalfOpenRange:
    """Called per page per layer at every decode step: built without ``HalfOpenRange.__new__``'s extra frame."""
    a_beg, a_end = a
    b_beg, b_end = b
    return _new_range(HalfOpenRange, (a_beg if a_beg > b_beg else b_beg, a_end if a_end < b_end else b_end))


_new_range = tuple.__new__


def overlap(a: tuple[int, int], b: tuple[int, int]) -> HalfOpenRange | tuple[()]:
    """The common part of two ranges, or ``()`` when they share nothing (so iterating it yields no bounds)."""
    common = intersect(a, b)
    return common if common else ()


def value_or(value: T | None, default: T) -> T:
    return default if value is None else value


def remove_if(items: MutableSequence[T], predicate: Callable[[T], bool]) -> list[T]:
    """Drop the items ``predicate`` accepts, keeping the others in order; returns the dropped ones."""
    removed = [item for item in items if predicate(item)]
    items[:] = [item for item in items if not predicate(item)]
    return removed


def get_uniform_attribute(items: Iterable[T], attribute: Callable[[T], U]) -> U:
    values = [attribute(item) for item in items]
    assert all(value == values[0] for value in values)
    return values[0]


def typed_range(*args: int) -> range:
    return range(*args)


def init_cuda_once() -> None:
    """Nothing to initialise without a device."""


@contextmanager
def temporary_sys_path(path: str) -> Iterator[None]:
    added = path not in sys.path
    if added:
        sys.path.insert(0, path)
    try:
        yield
    finally:
        if added:
            sys.path.remove(path)


class CachedCudaStream:
    """A stream handle: a fresh integer (the cpu backend orders nothing by stream)."""

    def __init__(self) -> None:
        self._handle: int | None = next(_handles)

    @property
    def handle(self) -> CudaStream:
        assert self._handle is not None, "stream closed"
        return CudaStream(self._handle)

    def get(self) -> CudaStream:
        return self.handle

    def record_event(self) -> CachedCudaEvent:
        return CachedCudaEvent(self.handle)

    def wait_events(self, events: Iterable[CachedCudaEvent]) -> None:
        for event in set(events):
            event.wait_in_stream(self.handle)

    def synchronize(self) -> None:
        """Work on a cpu stream is already done when queued."""

    def close(self) -> None:
        self._handle = None

    def is_closed(self) -> bool:
        return self._handle is None


class TemporaryCudaStream(CachedCudaStream):
    """A worker stream for a ``with`` block; a normal exit records the finish event ``take_finish_event`` hands out."""

    def __init__(self, prior_events: Iterable[CachedCudaEvent]) -> None:
        super().__init__()
        self.wait_events(prior_events)
        self._finish_event: CachedCudaEvent | None = None

    def __enter__(self) -> TemporaryCudaStream:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if kind is None:
            self._finish_event = self.record_event()

    def take_finish_event(self) -> CachedCudaEvent:
        event = self._finish_event
        assert event is not None, "no finish event: the with block did not end normally"
        self._finish_event = None
        return event


def unwrap_rawref(ref: Any) -> Any:
    raise NotImplementedError("unwrap_rawref dereferences upstream's internal page references; none exist here")
