"""Recorded slot copies and their execution.

The page store records every data movement as a slot copy and runs them later, in recording order, before a
public call returns. Running in order is always correct (a slot is rewritten only after the copy that read it was
recorded), so a source slot may be freed as soon as its copy is recorded. Consecutive copies in one direction
within one pool group become a single gather/scatter per pool; a move between the hot tier and a cold one
through a codec encodes or decodes per life cycle (``_storage/codec_copies.py``).

A run that fails (a disk tier's I/O error or short transfer, a cold-page codec raising) cannot be undone: the
bookkeeping already moved its pages. The runs after it still run (they move other pages), and every page whose
slot did not receive its bytes (a failed run's, or one copied from such a slot) is reported as lost, so the page
store can keep it from ever being served.
"""

from __future__ import annotations

import numpy as np

from ..kernels._checks import IndexVector
from .._model.tier_grouping import TierGrouping
from .._storage.codec_copies import decode_slots, encode_slots
from .._storage.memory import copy_rows
from .._storage.page_codec import ColdPageCodec
from .._storage.slots import PoolGroupStorage, TierStorage
from .page import Page


class SlotCopy:
    """One recorded copy: a slot of one life cycle's page at one level into the slot of ``page`` (the page
    moved, or the new copy) at another. The pool groups are each level's (the same one unless a cold-page codec
    groups the two levels differently); ``generation`` tells the page from the object's later content."""

    def __init__(
        self,
        page: Page,
        src_group: int,
        src_level: int,
        src_slot: int,
        dst_group: int,
        dst_level: int,
        dst_slot: int,
    ) -> None:
        self.page = page
        self.generation = page.generation
        self.life_cycle = page.life_cycle
        self.src_group = src_group
        self.src_level = src_level
        self.src_slot = src_slot
        self.dst_group = dst_group
        self.dst_level = dst_level
        self.dst_slot = dst_slot


class CopyFailure:
    """What a failed execution of recorded copies left: the pages whose slot holds no valid bytes, and what each
    failed run raised, for errors and the log."""

    def __init__(self, lost: list[Page], errors: list[BaseException]) -> None:
        self.lost = lost
        self.errors = errors

    def describe(self) -> str:
        """The distinct errors, in the order they happened."""
        texts = dict.fromkeys(f"{type(error).__name__}: {error}" for error in self.errors)
        return "; ".join(texts)


def run_slot_copies(
    tiers: list[TierStorage], copies: list[SlotCopy], grouping: TierGrouping, codec: ColdPageCodec | None
) -> CopyFailure | None:
    """Execute ``copies`` in order, one gather/scatter per run of copies that may move together (same pool groups
    and direction, no slot written twice, no slot read after a copy of the run wrote it; through the codec: the
    same life cycle too). None when every copy ran; else the pages left without their bytes."""
    start = 0
    bad: set[tuple[int, int, int]] = set()  # (level, pool group, slot) written by no successful copy
    failed: list[SlotCopy] = []
    errors: list[BaseException] = []
    while start < len(copies):
        first = copies[start]
        coded = codec is not None and grouping.crosses_codec(first.src_level, first.dst_level)
        end = start + 1
        targets = {first.dst_slot}
        while end < len(copies):
            op = copies[end]
            if (
                op.src_group != first.src_group
                or op.dst_group != first.dst_group
                or op.src_level != first.src_level
                or op.dst_level != first.dst_level
                or (coded and op.life_cycle != first.life_cycle)
                or op.dst_slot in targets
                or (op.src_level == op.dst_level and op.src_slot in targets)
            ):
                break
            targets.add(op.dst_slot)
            end += 1
        try:
            _copy_run(tiers, copies, start, end, codec if coded else None)
            ok = True
        except OSError as error:  # the disk tier (preadv / pwritev) failed
            ok = False
            errors.append(error)
        except BaseException as error:  # the user's codec may raise anything (the store defers an interrupt)
            if not coded:
                raise
            ok = False
            errors.append(error)
        if not ok or bad:  # (nothing to track while every copy so far ran)
            for index in range(start, end):
                op = copies[index]
                target = (op.dst_level, op.dst_group, op.dst_slot)
                if ok and (op.src_level, op.src_group, op.src_slot) not in bad:
                    bad.discard(target)
                else:
                    bad.add(target)
                    failed.append(op)
        start = end
    if not errors:
        return None
    lost = [op.page for op in failed if _still_at(op) and (op.dst_level, op.dst_group, op.dst_slot) in bad]
    return CopyFailure(lost, errors)


def _still_at(op: SlotCopy) -> bool:
    """Whether the copy's page still has the content and the slot it had when the copy was recorded."""
    page = op.page
    return (
        page.generation == op.generation
        and page.level == op.dst_level
        and page.pool_group == op.dst_group
        and page.slot == op.dst_slot
    )


def copy_pool_group_slots(
    dst: PoolGroupStorage, dst_slots: IndexVector, src: PoolGroupStorage, src_slots: IndexVector
) -> None:
    """Copy rows ``src_slots`` of every pool of ``src`` into rows ``dst_slots`` of the same pools of ``dst``."""
    for pool, slot_bytes in enumerate(src.layout.pool_slot_bytes):
        copy_rows(dst.pools[pool], dst_slots, src.pools[pool], src_slots, slot_bytes)


def _copy_run(tiers: list[TierStorage], copies: list[SlotCopy], start: int, end: int, codec: ColdPageCodec | None) -> None:
    first = copies[start]
    count = end - start  # slot ids as arrays once per run, not once per pool (the cuda path uses them as they are)
    src_slots = np.fromiter([copies[i].src_slot for i in range(start, end)], dtype=np.int64, count=count)
    dst_slots = np.fromiter([copies[i].dst_slot for i in range(start, end)], dtype=np.int64, count=count)
    src = tiers[first.src_level].pool_groups[first.src_group]
    dst = tiers[first.dst_level].pool_groups[first.dst_group]
    if codec is None:
        copy_pool_group_slots(dst, dst_slots, src, src_slots)
    elif first.src_level == 0:
        encode_slots(
            codec, first.life_cycle, dst.pools[0], dst_slots, dst.layout.slot_bytes,
            src.pools, src.layout.pool_slot_bytes, src_slots,
        )
    else:
        decode_slots(
            codec, first.life_cycle, dst.pools, dst.layout.pool_slot_bytes, dst_slots,
            src.pools[0], src_slots, src.layout.slot_bytes,
        )
