"""Argument checks shared by the public API: clear errors naming the argument and its value (bad input changes nothing).

Public functions declare integer parameters as ``SupportsIndex``, never ``int``: compiled, an ``int`` parameter
rejects ``numpy.int64`` and turns ``True`` into a plain 1 before any check could refuse it. These helpers turn
NumPy numbers into plain ints and floats and refuse bools the same way in both modes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Callable, SupportsIndex

import numpy as np


def refuse_subclass(subclass: type, final: str) -> None:
    """``__init_subclass__`` of a class users construct but may not extend (``typing.final``). Compiled, mypyc checks
    such a class by exact type (``self`` of its inherited methods too), so a subclass would fail at its first use
    there and work interpreted; both modes refuse it where it is defined."""
    raise TypeError(
        f"{final} cannot be subclassed (got {subclass.__module__}.{subclass.__qualname__}): keep your own data beside it"
    )


def as_int(value: object, name: str) -> int:
    """``value`` as a plain int; TypeError for bools (NumPy's too: before NumPy 2.3 they still have ``__index__``),
    floats and non-integers. A plain int returns first: engines pass layer and group ids on every page query. An
    ``int`` subclass comes back as a plain int (``operator.index`` copies it without running its methods), so its
    ``__hash__`` or ``__eq__`` never runs inside a later call (a cache id kept in the registry)."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


# Every integer a config holds fits a signed 64-bit slot: sizes and counts end up in NumPy shapes, C sizes and
# int64 tables, where a larger one fails as an OverflowError or a NumPy error naming no field.
INT64_LIMIT = 1 << 63


def as_int64(value: object, name: str) -> int:
    """``as_int`` for a config field: also a ValueError naming ``name`` outside ``[-2**63, 2**63)``."""
    result = as_int(value, name)
    if not -INT64_LIMIT <= result < INT64_LIMIT:
        raise ValueError(f"{name} must fit 64 bits (within [-2**63, 2**63)), got {result}")
    return result


def as_int_in(value: object, name: str, low: int, high: int) -> int:
    """``as_int`` in ``[low, high)``: a setting handed on to a C field or a port, which would fail there naming none."""
    result = as_int(value, name)
    if not low <= result < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {result}")
    return result


def is_real_number(value: object) -> bool:
    """Whether ``value`` is a number a ``SupportsFloat`` parameter takes: anything with ``__float__`` (int, float,
    NumPy's numbers, ``Fraction``, ``Decimal``, a user's own), except bools (``numpy.bool_`` too), complex numbers
    (``float`` drops or refuses the imaginary part) and arrays (``float`` reads a one-item array as its item)."""
    if isinstance(value, (bool, np.bool_, complex, np.complexfloating, np.ndarray)):
        return False
    return isinstance(value, (int, float)) or hasattr(type(value), "__float__")


def as_float(value: object, name: str) -> float:
    """``value`` (any ``is_real_number``) as a finite float; TypeError for bools and non-numbers, ValueError for
    NaN, infinities and numbers beyond a float (``Fraction(10**400)``, ``Decimal('sNaN')``)."""
    if not is_real_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        result = float(value)  # type: ignore[arg-type]
    except (OverflowError, ValueError):
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None
    except TypeError:  # a user's ``__float__`` that refuses (or returns no float)
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}") from None
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return result


def as_bounded_float(value: object, name: str, bounds: str, accepts: Callable[[float], bool]) -> float:
    """``as_float`` for a setting with a range: NaN and infinities get the range's message too (out of any range)."""
    number = float(value) if isinstance(value, float) else as_float(value, name)
    if not (math.isfinite(number) and accepts(number)):
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")
    return number


def as_non_negative_int(value: SupportsIndex | object, name: str) -> int:
    result = as_int(value, name)
    if result < 0:
        raise ValueError(f"{name} must be >= 0, got {result}")
    return result


# A CUDA stream handle (``cudaStream_t``) is a pointer: it fits 64 bits.
STREAM_HANDLE_LIMIT = 1 << 64


def as_stream_handle(value: SupportsIndex | object, name: str) -> int:
    """``value`` as a CUDA stream handle: an integer in [0, 2**64). Every call taking a stream checks it here, so a
    handle no stream can have is refused when given, not where the CUDA backend first uses it."""
    result = as_non_negative_int(value, name)
    if result >= STREAM_HANDLE_LIMIT:
        raise ValueError(f"{name} must be a CUDA stream handle below 2**64, got {result}")
    return result


def as_positive_int(value: SupportsIndex | object, name: str) -> int:
    result = as_int(value, name)
    if result <= 0:
        raise ValueError(f"{name} must be > 0, got {result}")
    return result


def check_iterable(value: object, name: str) -> None:
    """TypeError naming ``name`` for a str, bytes or anything not iterable, where a sequence is meant (``list(5)``
    would say only "'int' object is not iterable"). Consumes nothing: a generator is still whole afterwards."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence, got {type(value).__name__} {value!r}")


def as_list(value: object, name: str) -> list[object]:
    """The items of a sequence argument (``check_iterable``), read as objects for the caller to check one by one."""
    check_iterable(value, name)
    assert isinstance(value, Iterable)
    return list(value)


def as_positions(value: object, name: str) -> tuple[int, ...]:
    """A sequence of token positions (each an integer >= 0, checked as ``name[i]``), as plain ints."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {type(value).__name__} {value!r}")
    return tuple(as_non_negative_int(item, f"{name}[{index}]") for index, item in enumerate(value))


def check_minimums(limits: tuple[tuple[str, int | float, int], ...]) -> None:
    """Raise ``ValueError`` naming the first ``(name, value, minimum)`` whose value is below its minimum."""
    for name, value, minimum in limits:
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def as_index(value: SupportsIndex | object, name: str, bound: int) -> int:
    """``value`` as an int in ``[0, bound)``; ValueError naming ``name`` otherwise. A plain int in range returns
    first: engines pass a layer group per layer at every step."""
    if type(value) is int and 0 <= value < bound:
        return value
    result = as_int(value, name)
    if not 0 <= result < bound:
        raise ValueError(f"{name} {result} out of range [0, {bound})")
    return result


def check_tensor_parallel_group(rank: int, size: int, owner: str) -> None:
    """A rank inside its group: both name which heads a page holds, so a rank left at its default while the group
    has more members would be keyed and compared as another group's rank."""
    if size < 1:
        raise ValueError(f"{owner}.tensor_parallel_size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(
            f"{owner}.tensor_parallel_rank must be in [0, tensor_parallel_size) = [0, {size}), got {rank}: "
            f"give the group's size as tensor_parallel_size"
        )


def as_optional_int(value: object, name: str) -> int | None:
    return None if value is None else as_int(value, name)


def as_bool(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def as_str(value: object, name: str) -> str:
    if isinstance(value, str):
        return value
    raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r}")


def coerce_fields(
    obj: object,
    ints: tuple[str, ...] = (),
    optional_ints: tuple[str, ...] = (),
    strs: tuple[str, ...] = (),
    bools: tuple[str, ...] = (),
    optional_ids: tuple[str, ...] = (),
) -> None:
    """Check and normalise fields of a (non-native) config dataclass in place, reading its raw ``__dict__``.

    Compiled code type-checks every typed attribute read, so a ``numpy.int64`` (or a wrong type) would fail with
    a message that names no field; reading the instance dictionary lets these checks name the field, and NumPy
    integers are stored back as plain ints. Sizes and counts must fit 64 bits (``as_int64``); ids an engine numbers
    itself (``optional_ids``: request and LoRA ids, unsigned 64-bit in TensorRT-LLM) may be any integer.
    """
    fields = obj.__dict__
    prefix = type(obj).__name__
    for name in ints:
        fields[name] = as_int64(fields[name], f"{prefix}.{name}")
    for name in optional_ints:
        value = fields[name]
        fields[name] = None if value is None else as_int64(value, f"{prefix}.{name}")
    for name in optional_ids:
        fields[name] = as_optional_int(fields[name], f"{prefix}.{name}")
    for name in strs:
        as_str(fields[name], f"{prefix}.{name}")
    for name in bools:
        as_bool(fields[name], f"{prefix}.{name}")
