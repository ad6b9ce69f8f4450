"""The manager's caches: the live ones by id, the next automatic id, and the lengths recently closed ones had."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .kv_cache import CacheState

# Closed caches whose (capacity, history) rebalancing looks at (SPEC §8).
OBSERVED_CACHES: Final = 256


class CacheRegistry:
    def __init__(self) -> None:
        self.live: dict[int, CacheState] = {}
        self.next_id = 0
        self.observed_lengths: deque[tuple[int, int]] = deque(maxlen=OBSERVED_CACHES)

    def free_id(self) -> int:
        """The next automatic id that no live cache uses."""
        cache_id = self.next_id
        while cache_id in self.live:
            cache_id += 1
        return cache_id
