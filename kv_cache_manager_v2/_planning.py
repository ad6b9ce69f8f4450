"""Quota planning: how each tier's bytes are split across pool groups (SPEC §8).

A ``BatchDesc`` says what a typical step looks like; each pool group gets a share of the quota proportional to
the bytes that step needs from it (stale SWA blocks excluded, shared system-prompt blocks counted once).
"""

from __future__ import annotations

from typing import Final

from ._layout import StorageLayout
from ._life_cycle import LifeCycleRegistry
from .config import BatchDesc, KVCacheDesc

# Without a typical step: 8 caches of 4,096 tokens, a plausible serving step for sizing pool groups.
DEFAULT_TYPICAL_STEP: Final = BatchDesc([KVCacheDesc(4096, 4095)] * 8)

# SSM demand per cache: its live state plus one snapshot.
SSM_SLOTS_PER_CACHE: Final = 2


def pages_per_pool_group(
    batch: BatchDesc, registry: LifeCycleRegistry, layout: StorageLayout
) -> list[int]:
    """Slots each pool group needs to hold ``batch`` at once."""
    needed = [0] * len(layout.pool_groups)
    tpb = registry.life_cycles[0].tokens_per_block if registry.life_cycles else 1
    shared_blocks = batch.system_prompt_length // tpb
    for life_cycle in registry.life_cycles:
        group = layout.life_cycle_pool_group[life_cycle.id]
        for position, desc in enumerate(batch.kv_caches):
            if life_cycle.is_ssm:
                needed[group] += SSM_SLOTS_PER_CACHE
                continue
            pages = life_cycle.pages_needed(desc.capacity, desc.history_length)
            if position > 0 and life_cycle.window < 0:
                pages -= min(shared_blocks, pages)
            needed[group] += pages
    return needed


def split_quota(quota: int, demand_pages: list[int], layout: StorageLayout) -> list[int]:
    """Slot counts per pool group: the quota split in proportion to the bytes of ``demand_pages``."""
    demand_bytes = [pages * group.slot_bytes for pages, group in zip(demand_pages, layout.pool_groups)]
    total = sum(demand_bytes)
    if total == 0:
        demand_bytes = [group.slot_bytes for group in layout.pool_groups]
        total = sum(demand_bytes)
    return [quota * share // total // group.slot_bytes for share, group in zip(demand_bytes, layout.pool_groups)]
