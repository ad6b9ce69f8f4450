"""The bad values the edge sweep (``tests/test_edge_sweep.py``) generates per kind of parameter, each with the
exception types a refusal of it may raise."""

from __future__ import annotations

import math

import numpy as np

HUGE = 2**63


class Opaque:
    """Not a number, not a sequence: the wrong type for every parameter."""

    def __repr__(self) -> str:
        return "Opaque()"


# ------------------------------------------------------------------------------------------- values per kind
# Each kind: the bad values (value, accepted exception types). A value that may be a legal *soft* answer
# (2**63 tokens does not fit: ``can_fit`` says False) is listed under SOFT_OK for that kind instead.
TYPE: tuple[type, ...] = (TypeError,)
VALUE: tuple[type, ...] = (ValueError,)
WRONG_TYPES: list[tuple[str, object]] = [
    ("str", "1"), ("float", 1.0), ("bool", True), ("np-float", np.float64(1.0)), ("object", Opaque()),
    ("np-bool", np.bool_(True)), ("list", [1]),
]


def int_values(minimum: int | None, bound: int | None, optional: bool) -> list[tuple[str, object, tuple[type, ...]]]:
    """Bad values for an integer parameter in ``[minimum, bound)`` (None: unbounded on that side)."""
    values: list[tuple[str, object, tuple[type, ...]]] = [(name, value, TYPE) for name, value in WRONG_TYPES]
    if not optional:
        values.append(("None", None, TYPE))
    values.append(("nan", math.nan, TYPE))
    if minimum is not None and minimum >= 0:
        values.append(("minus-one", -1, VALUE))
        values.append(("np-minus-one", np.int64(-1), VALUE))
        values.append(("minus-huge", -HUGE, VALUE))
    if minimum is not None and minimum >= 1:
        values.append(("zero", 0, VALUE))
    if bound is not None:
        values.append(("bound", bound, VALUE))
        values.append(("huge", HUGE, VALUE))
        values.append(("huge-squared", HUGE * HUGE, VALUE))
    return values


def beyond_int64_values() -> list[tuple[str, object, tuple[type, ...]]]:
    """A config's sizes and counts must fit 64 bits: past that they failed deep inside (NumPy's "Maximum allowed
    dimension exceeded", an OverflowError from a C size) instead of naming the field."""
    return [
        ("2**63", HUGE, VALUE), ("2**64", HUGE * 2, VALUE), ("np-uint64-max", np.uint64(2**64 - 1), VALUE),
        ("below-int64", -HUGE - 1, VALUE),
    ]


def float_values() -> list[tuple[str, object, tuple[type, ...]]]:
    return [
        ("str", "0.5", TYPE), ("bool", True, TYPE), ("None", None, TYPE), ("object", Opaque(), TYPE),
        ("nan", math.nan, VALUE), ("inf", math.inf, VALUE), ("minus-inf", -math.inf, VALUE),
        ("np-nan", np.float32("nan"), VALUE), ("huge-int", 10**400, VALUE),
    ]


def token_values() -> list[tuple[str, object, tuple[type, ...]]]:
    return [
        ("str", "hello", TYPE), ("int", 5, TYPE), ("object", Opaque(), TYPE), ("float-token", [1, 2.5], TYPE),
        ("bool-token", [1, True], TYPE), ("None-token", [1, None], TYPE), ("np-float-array", np.array([1.5]), TYPE),
        ("nested", [[1, 2]], TYPE), ("bytes", b"hello", TYPE), ("2-D", np.ones((2, 2), np.int64), TYPE),
    ]  # any int is a token (negative and huge ones too: hashed by value, see ``encode_tokens``)


def flag_values() -> list[tuple[str, object, tuple[type, ...]]]:
    return [("str", "yes", TYPE), ("int", 1, TYPE), ("object", Opaque(), TYPE)]


def mode_values() -> list[tuple[str, object, tuple[type, ...]]]:
    return [("int", 0, TYPE), ("str", "SHARED", TYPE), ("None", None, TYPE), ("object", Opaque(), TYPE)]
