"""Storage layout: coalesced buffers, pools and pool groups, and where each (layer, role) buffer sits.

Within a life cycle, buffers of equal per-block size are concatenated into one coalesced buffer (layer order,
then buffer order: K0 V0 K1 V1 ...). Each coalesced buffer becomes a pool; one slot holds one block of every
pool of its pool group. Example (Gemma-like): 5 SWA layers with K/V of 16 KiB -> one pool of 160 KiB slots;
1 full layer with K/V of 32 KiB -> another pool group with one pool of 64 KiB slots. Attention life cycles with
the same slot layout share a pool group; each SSM life cycle gets its own.
"""

from __future__ import annotations

from typing import Sequence

from .addressing import PageIndexConverter
from .life_cycle import LifeCycleRegistry, ceil_div
from .._base.types import LayerGroupId, LayerId, PoolGroupIndex, PoolIndex
from ..config import LayerConfig


class BufferPlacement:
    """Where one (layer, role) buffer lives: pool group, pool, and its position in the coalesced slot."""

    def __init__(
        self,
        layer_id: LayerId,
        role: str,
        life_cycle_id: LayerGroupId,
        size: int,
        expansion: int,
    ) -> None:
        self.layer_id = layer_id
        self.role = role
        self.life_cycle_id = life_cycle_id
        self.size = size
        self.expansion = expansion
        self.pool_group: PoolGroupIndex = PoolGroupIndex(0)
        self.pool: PoolIndex = PoolIndex(0)
        self.scale = 1
        self.layer_offset = 0
        self.pages_per_block = 1
        self.page_in_block = 0

    @property
    def stride(self) -> int:
        """Bytes of one page as addressed by kernels (one expansion sub-page)."""
        return self.size // self.expansion


class CoalescedBuffer:
    """Equal-size buffers of one life cycle laid out back to back in one pool slot."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.members: list[BufferPlacement] = []

    @property
    def slot_bytes(self) -> int:
        return self.size * len(self.members)


class PoolGroupLayout:
    """Pools whose slots are allocated together; a slot id indexes the same row in every pool."""

    def __init__(self, index: PoolGroupIndex, pool_slot_bytes: list[int], is_ssm: bool) -> None:
        self.index = index
        self.pool_slot_bytes = pool_slot_bytes
        self.is_ssm = is_ssm
        self.life_cycle_ids: list[LayerGroupId] = []

    @property
    def slot_bytes(self) -> int:
        return sum(self.pool_slot_bytes)


class StorageLayout:
    """The whole layout, derived once from the layer configs."""

    def __init__(self, layers: Sequence[LayerConfig], registry: LifeCycleRegistry, tokens_per_block: int) -> None:
        self.pool_groups: list[PoolGroupLayout] = []
        self.life_cycle_pool_group: list[PoolGroupIndex] = []
        # ceil(n * f) scratch slots per life cycle, f kept exact as (numerator, denominator).
        self.scratch_fraction: list[tuple[int, int]] = []
        self._placements: dict[tuple[int, str], BufferPlacement] = {}
        self._layer_roles: dict[int, list[str]] = {}
        self._converters: dict[tuple[int, str], PageIndexConverter] = {}
        by_life_cycle: list[list[BufferPlacement]] = [[] for _ in range(len(registry))]
        for layer in layers:
            life_cycle = registry.of_layer(layer.layer_id)
            roles: list[str] = []
            for config in layer.buffers:
                override = config.tokens_per_block_override
                expansion = 1 if override is None else tokens_per_block // override
                # With an override, ``size`` is the bytes of one page of ``override`` tokens; a block holds
                # ``expansion`` of them.
                placement = BufferPlacement(
                    LayerId(layer.layer_id), config.role, life_cycle.id, config.size * expansion, expansion
                )
                by_life_cycle[life_cycle.id].append(placement)
                self._placements[(layer.layer_id, config.role)] = placement
                roles.append(config.role)
            self._layer_roles[layer.layer_id] = roles
        attention_pool_groups: dict[tuple[int, ...], PoolGroupLayout] = {}
        for life_cycle in registry.life_cycles:
            coalesced = _coalesce(by_life_cycle[life_cycle.id])
            key = tuple(buffer.slot_bytes for buffer in coalesced)
            pool_group = None if life_cycle.is_ssm else attention_pool_groups.get(key)
            if pool_group is None:
                pool_group = PoolGroupLayout(PoolGroupIndex(len(self.pool_groups)), list(key), life_cycle.is_ssm)
                self.pool_groups.append(pool_group)
                if not life_cycle.is_ssm:
                    attention_pool_groups[key] = pool_group
            pool_group.life_cycle_ids.append(life_cycle.id)
            self.life_cycle_pool_group.append(pool_group.index)
            for pool, buffer in enumerate(coalesced):
                for offset, member in enumerate(buffer.members):
                    member.pool_group = pool_group.index
                    member.pool = PoolIndex(pool)
                    member.scale = len(buffer.members)
                    member.layer_offset = offset
            self.scratch_fraction.append(_assign_pages_per_block(by_life_cycle[life_cycle.id]))

    def placement(self, layer_id: int, role: object, name: str = "data_role") -> BufferPlacement:
        """The placement of the (layer, role) buffer; errors name the caller's argument ``name``."""
        if not isinstance(role, str):
            raise TypeError(f"{name} must be a str, got {type(role).__name__} {role!r}")
        placement = self._placements.get((layer_id, role))
        if placement is None:
            known = self.roles_of(layer_id)
            raise ValueError(f"{name}: unknown role {role!r} for layer {layer_id}; known roles: {known}")
        return placement

    def page_index_converter(self, layer_id: int, role: object) -> PageIndexConverter:
        """The (immutable) converter of one buffer, made once: an engine asks for it per layer at every step."""
        if isinstance(role, str):
            made = self._converters.get((layer_id, role))
            if made is not None:
                return made
        placement = self.placement(layer_id, role)
        key = (placement.layer_id, placement.role)
        converter = self._converters.get(key)
        if converter is None:
            converter = PageIndexConverter(
                placement.scale,
                placement.expansion,
                placement.layer_offset,
                placement.pages_per_block,
                placement.page_in_block,
            )
            self._converters[key] = converter
        return converter

    def roles_of(self, layer_id: int) -> list[str]:
        roles = self._layer_roles.get(layer_id)
        if roles is None:
            raise ValueError(f"unknown layer_id {layer_id!r}")
        return roles

    def placements(self) -> list[BufferPlacement]:
        return list(self._placements.values())

    def scratch_slots(self, life_cycle_id: int, num_scratch_blocks: int) -> int:
        """``ceil(n * f)`` coalesced slots that hold ``n`` scratch blocks of one life cycle: scratch blocks are
        packed into shared slots, ``f`` being the largest fraction of a slot one block takes in any pool."""
        numerator, denominator = self.scratch_fraction[life_cycle_id]
        return ceil_div(num_scratch_blocks * numerator, denominator)


def _coalesce(members: list[BufferPlacement]) -> list[CoalescedBuffer]:
    """Group by per-block size (first appearance order), then order pools by slot bytes, largest first."""
    by_size: dict[int, CoalescedBuffer] = {}
    for member in members:
        buffer = by_size.get(member.size)
        if buffer is None:
            buffer = CoalescedBuffer(member.size)
            by_size[member.size] = buffer
        buffer.members.append(member)
    return sorted(by_size.values(), key=lambda buffer: -buffer.slot_bytes)


def _assign_pages_per_block(members: list[BufferPlacement]) -> tuple[int, int]:
    """Set each member's (ppb, k) and return f = max over layers and pools of ppb / scale."""
    counts: dict[tuple[int, int], int] = {}
    for member in members:
        key = (member.layer_id, member.pool)
        member.page_in_block = counts.get(key, 0)
        counts[key] = member.page_in_block + 1
    best = (0, 1)
    for member in members:
        member.pages_per_block = counts[(member.layer_id, member.pool)]
        if member.pages_per_block * best[1] > best[0] * member.scale:
            best = (member.pages_per_block, member.scale)
    return best
