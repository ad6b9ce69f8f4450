"""The manager's caches: the live ones by id, the next automatic id, and the lengths recently closed ones had."""

from __future__ import annotations

from typing import Final

from .._model.planning import ObservedDemand, QuotaPlanner
from .cache_view import CacheView

# Closed caches whose (capacity, history) the quota rebalancing (``adjust``) looks at.
OBSERVED_CACHES: Final = 256


class CacheRegistry:
    """Owned by the manager and handed to what opens and closes caches (the services below know no cache)."""

    def __init__(self, planner: QuotaPlanner) -> None:
        self.live: dict[int, CacheView] = {}
        self.next_id = 0
        self.observed: ObservedDemand = ObservedDemand(planner, OBSERVED_CACHES)
        # Ids whose caches must not feed ``observed`` (warm-up and padding requests sized at the longest
        # context, not at what real requests use); a mark ends with its cache's close.
        self.stats_excluded: set[int] = set()

    def free_id(self) -> int:
        """The next automatic id that no live cache uses."""
        cache_id = self.next_id
        while cache_id in self.live:
            cache_id += 1
        return cache_id
