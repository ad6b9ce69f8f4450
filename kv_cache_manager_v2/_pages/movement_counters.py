"""Pages and bytes the page store moved since the manager started (``KVCacheManager.movement_counters``)."""

from __future__ import annotations

from typing import final

from .._base.types import Sealed


@final
class MovementCounters(Sealed):
    """Pages and bytes moved since the manager started: onboarded to the GPU, offloaded from it, copied
    (copy-on-write, snapshots), dropped from the last tier, and lost: whose move failed (a disk tier I/O error, a
    cold-page codec raising; dropped where unused, else kept from its cache's next resume)."""

    def __init__(self) -> None:
        self.onboarded_pages = 0
        self.onboarded_bytes = 0
        self.offloaded_pages = 0
        self.offloaded_bytes = 0
        self.copied_pages = 0
        self.dropped_pages = 0
        self.lost_pages = 0

    def __eq__(self, other: object) -> bool:
        """Equal counts: two snapshots taken around a call are equal when it moved nothing."""
        return isinstance(other, MovementCounters) and _counts(other) == _counts(self)

    def __hash__(self) -> int:
        return hash(_counts(self))

    def __repr__(self) -> str:
        return (
            f"MovementCounters(onboarded_pages={self.onboarded_pages}, onboarded_bytes={self.onboarded_bytes}, "
            f"offloaded_pages={self.offloaded_pages}, offloaded_bytes={self.offloaded_bytes}, "
            f"copied_pages={self.copied_pages}, dropped_pages={self.dropped_pages}, lost_pages={self.lost_pages})"
        )

    def snapshot(self) -> MovementCounters:
        """A copy that later movements do not change."""
        copy = MovementCounters()
        copy.onboarded_pages = self.onboarded_pages
        copy.onboarded_bytes = self.onboarded_bytes
        copy.offloaded_pages = self.offloaded_pages
        copy.offloaded_bytes = self.offloaded_bytes
        copy.copied_pages = self.copied_pages
        copy.dropped_pages = self.dropped_pages
        copy.lost_pages = self.lost_pages
        return copy


def _counts(counters: MovementCounters) -> tuple[int, int, int, int, int, int, int]:
    return (counters.onboarded_pages, counters.onboarded_bytes, counters.offloaded_pages, counters.offloaded_bytes,
            counters.copied_pages, counters.dropped_pages, counters.lost_pages)
