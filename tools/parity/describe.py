"""A value as JSON with its exact type at every level, so two modes' answers compare as a user would see them:
``True`` and ``numpy.True_``, ``3`` and ``numpy.int64(3)``, a tuple and a list, a value object's public fields
and its repr all differ here."""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
import warnings
from typing import Callable

import numpy as np

# Objects with identity and state, not values: described by their type alone.
HANDLES = frozenset({
    "KVCacheManager", "KVCache", "_KVCache", "CacheHold", "PlannedDropHandle", "FakeEngine", "KVCacheEventManager",
    "PageIndexConverter", "ndarray_view",
})
# A memory address, a temporary path, a pool base, a port the system chose for a bound ``tcp://127.0.0.1:*``.
ADDRESS = re.compile(r"0x[0-9a-fA-F]+|/tmp/tmp\w+|(?<=base=)\d+|(?<=tcp://127\.0\.0\.1:)\d+")
# Fields holding a memory address: different in every process, compared by type only.
ADDRESS_FIELDS = frozenset({"base", "address", "base_address"})
MAX_DEPTH = 6


def type_name(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def describe(value: object, depth: int = 0) -> object:
    """``[type, content]``: content is the repr of a scalar, the items of a container, a value object's fields."""
    name = type_name(value)
    if value is None or isinstance(value, (bool, int, str, bytes, np.generic)) and not isinstance(value, enum.Enum):
        return [name, ADDRESS.sub("?", repr(value)) if isinstance(value, str) else repr(value)]
    if isinstance(value, float):
        return [name, "nan" if math.isnan(value) else repr(value)]
    if isinstance(value, enum.Enum):
        return [name, value.name, repr(value.value)]
    if isinstance(value, BaseException):
        return [name, ADDRESS.sub("0x?", str(value))]
    if isinstance(value, np.ndarray):
        return [name, str(value.dtype), list(value.shape), value.ravel().tolist()[:4096]]
    if depth >= MAX_DEPTH:
        return [name, "..."]
    if isinstance(value, (list, tuple)):
        return [name, [describe(item, depth + 1) for item in value]]
    if isinstance(value, (set, frozenset)):
        return [name, sorted((describe(item, depth + 1) for item in value), key=repr)]
    if isinstance(value, dict):
        return [name, [[describe(key, depth + 1), describe(item, depth + 1)] for key, item in value.items()]]
    if type(value).__name__ in HANDLES or callable(value):
        return [name]
    return [name, ADDRESS.sub("0x?", repr(value)), fields_of(value, depth)]


def fields_of(value: object, depth: int) -> list[object]:
    """A value object's public attributes (dataclass fields, properties, native getset descriptors), described."""
    if dataclasses.is_dataclass(value):
        names = [field.name for field in dataclasses.fields(value)]
    else:
        names = [name for name in dir(value) if not name.startswith("_")]
    described: list[object] = []
    for name in names:
        try:
            attribute = getattr(value, name)
        except Exception as error:  # noqa: BLE001 - a property raising is an observable answer too
            described.append([name, "raised", describe(error)])
            continue
        if callable(attribute) and not isinstance(attribute, type) and type(attribute).__name__ not in HANDLES:
            continue
        described.append([name, type_name(attribute) if name in ADDRESS_FIELDS else describe(attribute, depth + 1)])
    return described


class LogRecords(logging.Handler):
    """The package's log records (logger, level, message) since the last ``take``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[object] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append([record.name, record.levelname, ADDRESS.sub("0x?", record.getMessage())])

    def take(self) -> list[object]:
        taken, self.records = self.records, []
        return taken


LOGGED = LogRecords()
logging.getLogger("kv_cache_manager_v2").addHandler(LOGGED)


def outcome(call: Callable[[], object]) -> tuple[object, object]:
    """``(["returned", described], result)`` or ``(["raised", type, message], None)``, and after either the
    warnings the call issued and the package's log records, if any."""
    LOGGED.take()
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")
        try:
            result = call()
        except Exception as error:  # noqa: BLE001 - an exception is an observable answer
            return ["raised", type_name(error), ADDRESS.sub("0x?", str(error)), *side_effects(issued)], None
    return ["returned", describe(result), *side_effects(issued)], result


def side_effects(issued: list[warnings.WarningMessage]) -> list[object]:
    effects: list[object] = []
    if issued:
        effects.append(["warned", [[w.category.__name__, ADDRESS.sub("0x?", str(w.message))] for w in issued]])
    if logged := LOGGED.take():
        effects.append(["logged", logged])
    return effects
