"""Pool grouping per tier: which pool group a layer group's pages use at each cache level.

Without a cold-page codec every tier shares the layout's grouping. With one, the first (hot) tier keeps it and every
later (cold) tier stores one encoded page per slot: layer groups whose encoded pages have the same size share a
pool group there (one pool of that size), except an SSM layer group, which keeps a pool group of its own as it does
on the hot tier. A cold tier may so merge layer groups the hot tier keeps apart, or split ones it shares; a page
changes pool group when it crosses between the two (``PageStore`` moves it per layer group slot).
"""

from __future__ import annotations

from .layout import PoolGroupLayout, StorageLayout
from .._base.types import LayerGroupId, PoolGroupIndex


class TierGrouping:
    """The pool groups of every level and each layer group's pool group at each level."""

    def __init__(self, layout: StorageLayout, num_levels: int, encoded_bytes: list[int] | None) -> None:
        """``encoded_bytes[lc]``: the codec's page size of each layer group (None: no codec)."""
        self.encoded: bool = encoded_bytes is not None
        hot = layout.pool_groups
        hot_of = list(layout.life_cycle_pool_group)
        cold, cold_of = (hot, hot_of) if encoded_bytes is None else _cold_grouping(layout, encoded_bytes)
        self.levels: list[list[PoolGroupLayout]] = [hot] + [cold] * (num_levels - 1)
        self.group_of: list[list[PoolGroupIndex]] = [hot_of] + [cold_of] * (num_levels - 1)
        # How many GPU pool groups send pages into each cold pool group (1 without a codec, or where it splits).
        feeders = [len({hot_of[lc] for lc in group.life_cycle_ids}) for group in cold]
        self.gpu_feeders: list[list[int]] = [[1] * len(hot)] + [feeders] * (num_levels - 1)

    def crosses_codec(self, src_level: int, dst_level: int) -> bool:
        """Whether a move between these levels must encode or decode (one is hot, the other cold)."""
        return self.encoded and (src_level == 0) != (dst_level == 0)

    def page_bytes(self, level: int, life_cycle: int) -> int:
        """Bytes one page of ``life_cycle`` takes at ``level`` (what moves to or from it count)."""
        return self.levels[level][self.group_of[level][life_cycle]].slot_bytes


def _cold_grouping(layout: StorageLayout, encoded_bytes: list[int]) -> tuple[list[PoolGroupLayout], list[PoolGroupIndex]]:
    groups: list[PoolGroupLayout] = []
    group_of: list[PoolGroupIndex] = []
    by_size: dict[int, PoolGroupLayout] = {}
    for life_cycle, size in enumerate(encoded_bytes):
        is_ssm = layout.pool_groups[layout.life_cycle_pool_group[life_cycle]].is_ssm
        group = None if is_ssm else by_size.get(size)
        if group is None:
            group = PoolGroupLayout(PoolGroupIndex(len(groups)), [size], is_ssm)
            groups.append(group)
            if not is_ssm:
                by_size[size] = group
        group.life_cycle_ids.append(LayerGroupId(life_cycle))
        group_of.append(group.index)
    return groups, group_of


def split_cold_quota(quota: int, groups: list[PoolGroupLayout], life_cycle_weights: list[float]) -> list[int]:
    """Slot counts of a cold tier's pool groups: the quota shared in proportion to each layer group's weight (its
    share of the hot tier's pages) times its encoded page size; bytes left by the rounding become whole slots,
    largest pool group first."""
    weights = [sum(life_cycle_weights[lc] for lc in group.life_cycle_ids) * group.slot_bytes for group in groups]
    total = sum(weights)
    if total <= 0:
        weights = [float(group.slot_bytes) for group in groups]
        total = sum(weights)
    counts = [int(quota * weight / total) // group.slot_bytes for weight, group in zip(weights, groups)]
    left = quota - sum(count * group.slot_bytes for count, group in zip(counts, groups))
    for index in sorted(range(len(groups)), key=lambda i: -weights[i]):
        counts[index] += left // groups[index].slot_bytes
        left %= groups[index].slot_bytes
    return counts
