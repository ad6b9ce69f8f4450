"""Recorded slot copies and their execution.

The page store records every data movement as a slot copy and runs them later, in recording order, before a
public call returns. Running in order is always correct (a slot is rewritten only after the copy that read it was
recorded), so a source slot may be freed as soon as its copy is recorded. Consecutive copies in one direction
within one pool group become a single gather/scatter per pool.
"""

from __future__ import annotations

import numpy as np

from ..kernels._checks import IndexVector
from .._storage.memory import copy_rows
from .._storage.slots import PoolGroupStorage, TierStorage


class SlotCopy:
    """One recorded copy: a slot of a pool group at one level into a slot of the same pool group at another."""

    def __init__(self, pool_group: int, src_level: int, src_slot: int, dst_level: int, dst_slot: int) -> None:
        self.pool_group = pool_group
        self.src_level = src_level
        self.src_slot = src_slot
        self.dst_level = dst_level
        self.dst_slot = dst_slot


def run_slot_copies(tiers: list[TierStorage], copies: list[SlotCopy]) -> None:
    """Execute ``copies`` in order, one gather/scatter per run of copies that may move together (same pool group
    and direction, no slot written twice, no slot read after a copy of the run wrote it)."""
    start = 0
    while start < len(copies):
        first = copies[start]
        end = start + 1
        targets = {first.dst_slot}
        while end < len(copies):
            op = copies[end]
            if (
                op.pool_group != first.pool_group
                or op.src_level != first.src_level
                or op.dst_level != first.dst_level
                or op.dst_slot in targets
                or (op.src_level == op.dst_level and op.src_slot in targets)
            ):
                break
            targets.add(op.dst_slot)
            end += 1
        _copy_run(tiers, copies, start, end)
        start = end


def copy_pool_group_slots(
    dst: PoolGroupStorage, dst_slots: IndexVector, src: PoolGroupStorage, src_slots: IndexVector
) -> None:
    """Copy rows ``src_slots`` of every pool of ``src`` into rows ``dst_slots`` of the same pools of ``dst``."""
    for pool, slot_bytes in enumerate(src.layout.pool_slot_bytes):
        copy_rows(dst.pools[pool], dst_slots, src.pools[pool], src_slots, slot_bytes)


def _copy_run(tiers: list[TierStorage], copies: list[SlotCopy], start: int, end: int) -> None:
    first = copies[start]
    count = end - start  # slot ids as arrays once per run, not once per pool (the cuda path uses them as they are)
    src_slots = np.fromiter([copies[i].src_slot for i in range(start, end)], dtype=np.int64, count=count)
    dst_slots = np.fromiter([copies[i].dst_slot for i in range(start, end)], dtype=np.int64, count=count)
    src = tiers[first.src_level].pool_groups[first.pool_group]
    dst = tiers[first.dst_level].pool_groups[first.pool_group]
    copy_pool_group_slots(dst, dst_slots, src, src_slots)
