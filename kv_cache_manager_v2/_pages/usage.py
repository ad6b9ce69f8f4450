"""Where the memory is, in one call: per tier and pool group, the pages caches use now, the pages kept for
suspended caches, the committed pages nobody uses (reusable, evicted first when room is needed), and the free
ones, in pages and bytes. ``StorageStatistics`` folds held and reusable into "evictable"; an engine deciding
whether to wait, preempt or shrink a request needs them apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from .page_store import PageStore
from .._base.types import CacheTier, FrozenValue


@final
@dataclass(frozen=True)
class PoolGroupUsage(FrozenValue):
    """One pool group of one tier: ``used`` pages are locked by active caches, ``held`` ones kept for suspended
    caches (they may move to a colder tier, never be lost), ``reusable`` ones hold committed blocks no cache uses
    (dropped when room is needed), ``free`` ones are empty; the four add up to ``total``. ``slot_bytes``: the
    bytes of one page (a slot across every pool of the pool group)."""

    level: int
    tier: CacheTier
    pool_group: int
    slot_bytes: int
    total: int
    used: int
    held: int
    reusable: int
    free: int

    @property
    def used_bytes(self) -> int:
        """``used`` in bytes."""
        return self.used * self.slot_bytes

    @property
    def held_bytes(self) -> int:
        """``held`` in bytes."""
        return self.held * self.slot_bytes

    @property
    def reusable_bytes(self) -> int:
        """``reusable`` in bytes."""
        return self.reusable * self.slot_bytes

    @property
    def free_bytes(self) -> int:
        """``free`` in bytes."""
        return self.free * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        """``total`` in bytes."""
        return self.total * self.slot_bytes


def usage_of(store: PageStore) -> list[PoolGroupUsage]:
    """Every tier's pool groups, warmest tier first."""
    result: list[PoolGroupUsage] = []
    for level, tier in enumerate(store.tiers):
        for pool_group, storage in enumerate(tier.pool_groups):
            queues = store.queues[level][pool_group]
            held = queues.held.size
            reusable = queues.droppable.size
            free = storage.allocator.num_free
            used = storage.num_slots - free - held - reusable
            slot_bytes = sum(storage.layout.pool_slot_bytes)
            result.append(
                PoolGroupUsage(level, tier.tier, pool_group, slot_bytes, storage.num_slots, used, held, reusable, free)
            )
    return result
