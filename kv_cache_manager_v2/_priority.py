"""The user's ``custom_priority_callback``: its type and the check of what it returns."""

from __future__ import annotations

from typing import Callable

from ._types import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, LayerGroupId, Priority
from ._validation import as_int

PriorityCallback = Callable[[int, LayerGroupId], Priority]


def ask_priority(callback: PriorityCallback | None, ordinal: int, life_cycle: int) -> int:
    """The eviction priority of a new page of block ``ordinal``: the callback's answer, checked, or the default."""
    if callback is None:
        return DEFAULT_PRIORITY
    value = as_int(callback(ordinal, LayerGroupId(life_cycle)), "custom_priority_callback result")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"custom_priority_callback returned {value}, outside [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    return value
