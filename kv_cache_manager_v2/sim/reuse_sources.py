"""Which cache tier the pages a newly admitted request reuses came from (the simulator's hit rate per tier).

Reused pages found on the GPU stay where they are; those found on a colder tier are onboarded when the new cache
resumes. With one colder tier, the onboard count of ``get_iteration_stats`` during the admission is the count
from that tier. With two (host and disk) the count does not say which, so the manager's KV events track every
cached page's tier and an admission's onboarding events are looked up there (events cost some manager time:
only runs with both tiers turn them on).

Pages reused by copy rather than by move (a partially reused last block, an SSM snapshot) count as GPU hits.
"""

from __future__ import annotations

from typing import Callable

from .. import KV_EVENT_REMOVED, KV_EVENT_UPDATED, KVCacheManager, KVEvent

# Also handed every event drained (the simulator's KV event publisher), so that one reader drains the log.
EventForward = Callable[[list[KVEvent]], None]


class ReuseSources:
    """Reset before an admission, read after it: pages onboarded per (layer group, tier they came from)."""

    def __init__(self, manager: KVCacheManager, forward: EventForward | None = None) -> None:
        self.manager = manager
        self.forward = forward
        self.num_levels: int = manager.num_cache_levels
        self.num_groups: int = manager.num_layer_groups
        self.tracks_events: bool = needs_events(self.num_levels)
        if self.tracks_events and not manager.config.enable_kv_events:
            raise ValueError("telling host from disk hits needs KVCacheManagerConfig.enable_kv_events")
        self.levels: dict[tuple[int, bytes], int] = {}  # (layer group, block hash) -> tier of its cached page
        self.next_event_id: int = 0

    def before_admission(self) -> None:
        if self.tracks_events:
            self._apply(self.manager.get_latest_events(), None)
        elif self.num_levels > 1:
            self.manager.get_iteration_stats()

    def after_admission(self) -> list[list[int]]:
        """``[layer group][tier]``: reused pages that came from each colder tier (index 0, the GPU, stays 0)."""
        counts = [[0] * self.num_levels for _ in range(self.num_groups)]
        if self.tracks_events:
            self._apply(self.manager.get_latest_events(), counts)
        elif self.num_levels > 1:
            for group, stats in enumerate(self.manager.get_iteration_stats()):
                counts[group][1] += stats.onboarded_pages
        return counts

    def sync(self) -> None:
        """Keep the tier map current (call between steps so the bounded event log never overflows)."""
        if self.tracks_events or self.forward is not None:
            self._apply(self.manager.get_latest_events(), None)

    def _apply(self, events: list[KVEvent], counts: list[list[int]] | None) -> None:
        if self.forward is not None:
            self.forward(events)
        if not self.tracks_events:
            return
        levels = self.levels
        for event in events:
            if event.event_id != self.next_event_id:
                raise RuntimeError(
                    f"KV event {self.next_event_id} was lost (the log is bounded by max_kv_events): "
                    "sync more often or raise the bound"
                )
            self.next_event_id += 1
            key = (event.layer_group_id, event.block_hash)
            if event.kind == KV_EVENT_REMOVED:
                levels.pop(key, None)
                continue
            if counts is not None and event.kind == KV_EVENT_UPDATED and event.level == 0:
                source = levels.get(key, -1)
                if source < 0:
                    raise RuntimeError(f"KV event {event.event_id} updates a page that no event stored")
                counts[event.layer_group_id][source] += 1
            levels[key] = event.level


def needs_events(num_levels: int) -> bool:
    """Whether a run with this many tiers needs KV events to tell where reused pages came from."""
    return num_levels > 2
