"""Byte ranges that several buffers share inside one pool slot, for engines that move pages in bulk.

Buffers of one layer group with equal sizes sit back to back in each slot of one pool (``_layout``). A transfer of
many buffers can then copy one range per slot instead of one per buffer: ``aggregate`` finds those ranges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, final

from .layout import BufferPlacement, StorageLayout
from .._base.types import BufferId, DataRole, FrozenValue, LayerGroupId, MemAddress
from .._base.validation import as_int, as_list


@final
@dataclass(frozen=True)
class ExpandedBuffer(FrozenValue):
    """One buffer inside an aggregated range; ``expansion``: pages of it per block (``tokens_per_block_override``)."""

    id: BufferId
    expansion: int


@final
@dataclass(frozen=True)
class AggregatedPageDesc(FrozenValue):
    """The bytes ``[base + stride * i, base + stride * i + size)`` of GPU slot ``i`` hold ``buffers``, in order, for
    every slot ``i`` of layer group ``layer_group_id`` (a cache's base page indices)."""

    base: MemAddress
    size: int
    stride: int
    layer_group_id: LayerGroupId
    buffers: list[ExpandedBuffer] = field(default_factory=list)


def aggregate(
    layout: StorageLayout,
    buffers: Iterable[BufferId],
    pool_address: Callable[[int, int], int],
) -> list[AggregatedPageDesc]:
    """Maximal runs of adjacent buffers among ``buffers`` (any order, duplicates ignored), one description per run;
    ``pool_address(pool_group, pool)`` is where the GPU tier's pool starts."""
    runs: dict[tuple[int, int, int], list[BufferPlacement]] = {}
    items = as_list(buffers, "buffers")  # read as objects: compiled, a BufferId loop variable would refuse a bad one
    for position, buffer in enumerate(items):
        if not isinstance(buffer, tuple) or len(buffer) != 2:
            raise TypeError(f"buffers must hold BufferId (layer_id, role) pairs, got {buffer!r}")
        name = f"buffers[{position}]"
        placement = layout.placement(as_int(buffer[0], f"{name}.layer_id"), buffer[1], f"{name}.role")
        members = runs.setdefault((placement.life_cycle_id, placement.pool_group, placement.pool), [])
        if placement not in members:
            members.append(placement)
    result: list[AggregatedPageDesc] = []
    for (life_cycle, pool_group, pool), members in sorted(runs.items()):
        members.sort(key=lambda member: member.layer_offset)
        stride = layout.pool_groups[pool_group].pool_slot_bytes[pool]
        start = 0
        for end in range(1, len(members) + 1):
            if end < len(members) and members[end].layer_offset == members[end - 1].layer_offset + 1:
                continue
            run = members[start:end]
            first = run[0]
            result.append(
                AggregatedPageDesc(
                    MemAddress(pool_address(pool_group, pool) + first.layer_offset * first.size),
                    first.size * len(run),
                    stride,
                    LayerGroupId(life_cycle),
                    [ExpandedBuffer(BufferId(m.layer_id, DataRole(m.role)), m.expansion) for m in run],
                )
            )
            start = end
    return result


def all_buffer_ids(layout: StorageLayout) -> list[BufferId]:
    """Every (layer, role) buffer of the layout, in config order."""
    return [BufferId(p.layer_id, DataRole(p.role)) for p in layout.placements()]
