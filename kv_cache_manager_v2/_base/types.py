"""Public scalar types, constants, enums and errors shared by every layer of the package."""

from __future__ import annotations

import enum
import os
from dataclasses import fields
from typing import TYPE_CHECKING, Callable, Final, NamedTuple, NewType, NoReturn, Optional, SupportsIndex, cast, final

from mypy_extensions import mypyc_attr

from .validation import as_int, refuse_subclass

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LayerId = NewType("LayerId", int)
TokenId = NewType("TokenId", int)
CacheLevel = NewType("CacheLevel", int)
LayerGroupId = NewType("LayerGroupId", int)
LifeCycleId = LayerGroupId
BeamIndex = NewType("BeamIndex", int)
CudaStream = NewType("CudaStream", int)
MemAddress = NewType("MemAddress", int)
Priority = NewType("Priority", int)
PoolGroupIndex = NewType("PoolGroupIndex", int)
PoolIndex = NewType("PoolIndex", int)
SlotId = NewType("SlotId", int)
BlockOrdinal = NewType("BlockOrdinal", int)
DataRole = NewType("DataRole", str)
# TensorRT-LLM's name for a layer's window: tokens it attends to, None for full attention.
SlidingWindowSize = Optional[int]
# TensorRT-LLM's flag: True unless debug mode (KV_CACHE_MANAGER_V2_DEBUG=1) was set when the package was imported.
NDEBUG: Final[bool] = os.environ.get("KV_CACHE_MANAGER_V2_DEBUG", "")[:1] != "1"


PACKAGE_PREFIX: Final = "kv_cache_manager_v2."


class Sealed:
    """Base of the package's native public classes: a class defined outside the package may not extend one.
    Compiled, mypyc takes such a subclass's definition and refuses it only when one is made ("interpreted classes
    cannot inherit from compiled"), while interpreted it works; both modes refuse it where it is defined."""

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_foreign_subclass(cls)


def refuse_foreign_subclass(subclass: type) -> None:
    """``Sealed``'s check (a function of ``type``: compiled, a class method cannot read ``cls.__module__``)."""
    if not subclass.__module__.startswith(PACKAGE_PREFIX):
        sealed = next(base for base in subclass.__mro__[1:] if base.__module__.startswith(PACKAGE_PREFIX))
        refuse_subclass(subclass, sealed.__name__)


class Handle(Sealed):
    """Base of the package's handles (the manager, a cache, a hold, a planned drop, the handoff's endpoints, the
    event publisher): each stands for live state (pages, slots, device memory, sockets) that exactly one object
    owns, so a copy or an unpickled twin would act on it a second time (a copied manager's ``shutdown`` closed the
    disk tier's files under the original, which went on serving and lost every page it moved there: EBADF):
    ``copy``, ``deepcopy`` and ``pickle`` raise ``TypeError``."""

    def __copy__(self) -> NoReturn:
        raise TypeError(_not_a_value(self, "copied"))

    def __deepcopy__(self, memo: object) -> NoReturn:
        raise TypeError(_not_a_value(self, "deep-copied"))

    def __reduce__(self) -> NoReturn:
        raise TypeError(_not_a_value(self, "pickled"))

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(_not_a_value(self, "pickled"))

    def __getstate__(self) -> NoReturn:
        raise TypeError(_not_a_value(self, "pickled"))


def _not_a_value(handle: object, verb: str) -> str:
    return f"a {type(handle).__name__} is a handle to live state, not a value: it cannot be {verb}"


class FrozenValue(Sealed):
    """Base of the frozen dataclasses handed out as values (events, statistics): they pickle and copy by calling
    their class again with their field values. Compiled, the default way (set each attribute on a blank object)
    is refused by the frozen class's ``__setattr__``."""

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        values = tuple(getattr(self, value_field.name) for value_field in fields(cast("DataclassInstance", self)))
        return (type(self), values)


GPU_LEVEL: Final = CacheLevel(0)

# Most blocks one cache may span. Its per-block tables grow with the capacity even where a sliding window keeps
# the pages few, so a larger capacity is a memory shortage (resize returns False) found by arithmetic alone.
MAX_BLOCKS_PER_CACHE: Final = 1 << 24
BAD_PAGE_INDEX: Final = -1
DEFAULT_BEAM_INDEX: Final = BeamIndex(0)
MIN_PRIORITY: Final = 0
MAX_PRIORITY: Final = 100
DEFAULT_PRIORITY: Final = Priority(35)
# A page without a slot: freed, or not placed yet.
NO_SLOT: Final = SlotId(-1)
NO_LEVEL: Final = CacheLevel(-1)


class CacheTier(enum.IntEnum):
    """Kind of memory a cache level lives in (ordered warm to cold in a config)."""

    GPU_MEM = 0
    HOST_MEM = 1
    DISK = 2


class PageIndexMode(enum.IntEnum):
    """How converted page indices relate to the base address handed to a kernel.

    SHARED: the base address already points at this (layer, role) buffer inside the coalesced slot, so one
    converted table serves every layer with the same scale. PER_LAYER: the base is the pool's start and the
    layer's position is baked into each index; required for scratch blocks.
    """

    SHARED = 0
    PER_LAYER = 1


@final
class HalfOpenRange(Sealed):
    """The integers ``[beg, end)``; empty when ``end <= beg``. Immutable; ``beg`` and ``end`` are plain ints (NumPy
    integers are accepted, bools, floats and other non-integers refused, naming the bound, in both modes: compiled,
    an ``int`` field would refuse a NumPy integer and a float would make ``len`` fail far from where it came in)."""

    def __init__(self, beg: SupportsIndex, end: SupportsIndex) -> None:
        self._beg = as_int(beg, "HalfOpenRange.beg")
        self._end = as_int(end, "HalfOpenRange.end")

    @property
    def beg(self) -> int:
        """The first integer of the range."""
        return self._beg

    @property
    def end(self) -> int:
        """One past the last integer of the range."""
        return self._end

    def __len__(self) -> int:
        return max(0, self._end - self._beg)

    def __bool__(self) -> bool:
        return self._end > self._beg

    def __contains__(self, value: object) -> bool:
        """Whether ``value`` is an integer (a NumPy one too; not a bool) in the range."""
        try:
            number = as_int(value, "value")
        except TypeError:
            return False
        return self._beg <= number < self._end

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HalfOpenRange) and other.beg == self._beg and other.end == self._end

    def __hash__(self) -> int:
        return hash((self._beg, self._end))

    def __repr__(self) -> str:
        return f"HalfOpenRange(beg={self._beg}, end={self._end})"

    def __reduce__(self) -> tuple[type[HalfOpenRange], tuple[int, int]]:
        return (HalfOpenRange, (self._beg, self._end))


class BufferId(NamedTuple):
    """One buffer of one layer: the pair that names it in addressing calls."""

    layer_id: LayerId
    role: DataRole


@mypyc_attr(native_class=False)
class OutOfMemoryError(MemoryError):
    """Base of the manager's memory-shortage errors (as in TensorRT-LLM)."""


@mypyc_attr(native_class=False)
class OutOfPagesError(OutOfMemoryError):
    """Raised when held pages cannot fit anywhere or a setter cannot report a memory shortage as False."""


@mypyc_attr(native_class=False)
class PageContentLostError(OSError):
    """A cache's pages lost their content (a disk tier read or write, or the cold-page codec, failed while moving
    them): the cache cannot be resumed; its tokens must be computed again (close it, create the request again)."""
