"""Slots: per tier and pool group, a free list of slot ids over pools of real memory.

A slot is one row of every pool of its pool group (one block of one life cycle); its memory is reserved up
front, so slot addresses never move while the manager lives."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import final

from .._model.layout import PoolGroupLayout
from .memory import MemoryBackend, PoolMemory, disk_bytes_available, disk_space_error
from .._base.types import NO_SLOT, CacheLevel, CacheTier, FrozenValue, SlotId


@final
@dataclass(frozen=True)
class StorageStatistics(FrozenValue):
    """Slot counts of one pool group in one tier; ``available = free + evictable``; ``slot_sizes``: bytes of one
    slot in each pool of the pool group."""

    total: int
    free: int
    evictable: int
    available: int
    unavailable: int
    slot_sizes: list[int] = field(default_factory=list)


class SlotAllocator:
    """Free-list of the slot ids ``[0, num_slots)``; allocation and release are O(1)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[SlotId] = [SlotId(slot) for slot in range(num_slots - 1, -1, -1)]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> SlotId:
        """A free slot id, lowest first on a fresh allocator, or -1 when none is left."""
        if not self._free:
            return NO_SLOT
        return self._free.pop()

    def allocate_below(self, limit: int) -> SlotId:
        """A free slot id below ``limit`` (for compaction before a shrink); O(free slots)."""
        for position in range(len(self._free) - 1, -1, -1):
            slot = self._free[position]
            if slot < limit:
                del self._free[position]
                return slot
        raise ValueError(f"no free slot below {limit}")

    def release(self, slot: SlotId) -> None:
        self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    def resize(self, num_slots: int) -> bool:
        """Grow, or shrink when every slot at or above ``num_slots`` is free; False (unchanged) otherwise."""
        if num_slots >= self.num_slots:
            self._free[0:0] = [SlotId(slot) for slot in range(num_slots - 1, self.num_slots - 1, -1)]
            self.num_slots = num_slots
            return True
        kept = [slot for slot in self._free if slot < num_slots]
        if self.num_slots - len(self._free) != num_slots - len(kept):
            return False
        self._free = kept
        self.num_slots = num_slots
        return True


class PoolGroupStorage:
    """One pool group in one tier: its slot allocator and one memory reservation per pool."""

    def __init__(self, layout: PoolGroupLayout, pools: list[PoolMemory], num_slots: int, max_slots: int) -> None:
        self.layout = layout
        self.pools = pools
        self.max_slots = max_slots
        self.allocator = SlotAllocator(num_slots)

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def reserve(self, num_slots: int) -> bool:
        """Back ``num_slots`` slots of every pool with real storage (disk blocks); False, backing only the
        current slots, when the storage is full."""
        for pool, size in zip(self.pools, self.layout.pool_slot_bytes):
            if not pool.reserve(num_slots * size):
                self.trim()
                return False
        return True

    def trim(self) -> None:
        """Give back the backing store past the current slots."""
        for pool, size in zip(self.pools, self.layout.pool_slot_bytes):
            pool.trim(self.num_slots * size)


class TierStorage:
    """One cache level: a ``PoolGroupStorage`` per pool group."""

    def __init__(
        self,
        level: CacheLevel,
        tier: CacheTier,
        quota: int,
        pool_groups: list[PoolGroupStorage],
    ) -> None:
        self.level = level
        self.tier = tier
        self.quota = quota
        self.pool_groups = pool_groups

    def reserve(self, slot_counts: list[int]) -> bool:
        """Back every pool group's new slot count with real storage before a resize; all or nothing."""
        for pool_group, count in zip(self.pool_groups, slot_counts):
            if not pool_group.reserve(count):
                self.trim()
                return False
        return True

    def trim(self) -> None:
        """Give back the backing store past every pool group's current slots (no copy may still read them)."""
        for pool_group in self.pool_groups:
            pool_group.trim()

    def close(self) -> None:
        for pool_group in self.pool_groups:
            for pool in pool_group.pools:
                pool.close()


def build_tier(
    backend: MemoryBackend,
    level: CacheLevel,
    tier: CacheTier,
    quota: int,
    max_quota: int | None,
    directory: str | None,
    layouts: list[PoolGroupLayout],
    slot_counts: list[int],
) -> TierStorage:
    """Reserve every pool of one tier for the most slots its pool group could ever get, so bases never move.

    Disk pools get real blocks for their current slots only (more when a resize grows them): a disk tier that
    its filesystem cannot hold raises ``OSError`` (ENOSPC) here, naming the shortfall, and leaves no file.
    """
    if directory is not None and not os.path.isdir(directory):
        raise ValueError(f"DiskCacheTierConfig.path {directory!r} is not an existing directory")
    if directory is not None and os.statvfs(directory).f_blocks == 0:  # before: an ENOSPC about "0 bytes available"
        raise ValueError(
            f"DiskCacheTierConfig.path {directory!r} is on a filesystem with no storage blocks (a kernel interface "
            f"such as /proc or /sys): give a directory on a disk"
        )
    # Lazily committed memory (NumPy/calloc, sparse disk files) can reserve a whole quota per pool group for free,
    # which lets rebalancing move slots between pool groups; device and pinned memory reserve only what max_quota
    # allows.
    if max_quota is not None:
        reserve = max_quota
    else:
        reserve = quota if backend.reserves_lazily(tier) else 0
    needed = sum(count * layout.slot_bytes for layout, count in zip(layouts, slot_counts))
    if directory is not None and needed > disk_bytes_available(directory):
        raise disk_space_error(directory, needed)
    pool_groups: list[PoolGroupStorage] = []
    try:
        for layout, num_slots in zip(layouts, slot_counts):
            max_slots = max(num_slots, reserve // layout.slot_bytes)
            pools = [backend.allocate(tier, max(1, max_slots * size), directory) for size in layout.pool_slot_bytes]
            pool_groups.append(PoolGroupStorage(layout, pools, num_slots, max_slots))
            if directory is not None and not pool_groups[-1].reserve(num_slots):
                TierStorage(level, tier, quota, pool_groups).close()  # first, so the error sees the space given back
                raise disk_space_error(directory, needed)
    except BaseException:
        TierStorage(level, tier, quota, pool_groups).close()
        raise
    return TierStorage(level, tier, quota, pool_groups)
