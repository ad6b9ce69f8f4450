"""The user's ``custom_priority_callback``: its type and the check of what it returns."""

from __future__ import annotations

from typing import Callable, SupportsIndex

from .._model.life_cycle import LifeCycle

from .._base.types import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from .._base.validation import as_int

# (block ordinal, the block's life cycle: ``window_size``, ``num_sink_blocks``, ``get_stale_range``) -> priority.
# The answer is whatever integer the user has at hand (a plain int, a ``Priority``, a NumPy integer): it is
# converted and range-checked here, so the type asks only for ``SupportsIndex``.
PriorityCallback = Callable[[int, LifeCycle], SupportsIndex]


def ask_priority(callback: PriorityCallback | None, ordinal: int, life_cycle: LifeCycle) -> int:
    """The eviction priority of a new page of block ``ordinal``: the callback's answer, checked, or the default."""
    if callback is None:
        return DEFAULT_PRIORITY
    value = as_int(callback(ordinal, life_cycle), "custom_priority_callback result")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"custom_priority_callback returned {value}, outside [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    return value
