"""Read-only looks inside a manager and its caches, under the module name TensorRT-LLM's tests import.

Engines and tests that check what the manager did (where pages sit, what a match would reuse, how the GPU tier is
split) call these instead of reading private attributes; every answer is computed from the live state."""

from __future__ import annotations

from typing import TYPE_CHECKING, SupportsIndex

from ._base.hashing import ReuseScope, TokenSequence, check_tokens
from ._pages.page import Block
from ._base.types import LayerGroupId
from ._base.validation import as_int

if TYPE_CHECKING:
    from ._manager.manager import KVCache
    from ._manager.manager import KVCacheManager
    from ._pages.page import Page
    from ._storage.slots import StorageStatistics


def storage_statistics(manager: KVCacheManager, cache_level: SupportsIndex = 0) -> list[StorageStatistics]:
    """Slot counts of each pool group in tier ``cache_level``."""
    return manager.get_storage_statistics(cache_level)


def storage_utilization(manager: KVCacheManager, cache_level: SupportsIndex = 0) -> list[float]:
    """Fraction of each pool group's slots in tier ``cache_level`` that hold a page (0.0 for an empty group)."""
    return [(s.total - s.free) / s.total if s.total else 0.0 for s in manager.get_storage_statistics(cache_level)]


def current_gpu_ratio(manager: KVCacheManager) -> list[float]:
    """Share of the GPU tier's pool memory each pool group has now (sums to 1 unless the tier is empty)."""
    group_bytes = [s.total * sum(s.slot_sizes) for s in manager.get_storage_statistics(0)]
    total = sum(group_bytes)
    return [b / total if total else 0.0 for b in group_bytes]


def pool_group_index(manager: KVCacheManager, lc_id: SupportsIndex, cache_level: SupportsIndex = 0) -> int:
    """Pool group of layer group ``lc_id``; every tier groups layer groups the same way here."""
    manager.get_storage_statistics(cache_level)  # checks the level
    return manager.get_pool_group_index(lc_id)


def life_cycle_pool_group_indices(manager: KVCacheManager, cache_level: SupportsIndex = 0) -> list[int]:
    """``pool_group_index`` of every layer group, indexed by layer group id."""
    return [pool_group_index(manager, lc, cache_level) for lc in range(manager.num_layer_groups)]


def attention_life_cycle_ids(manager: KVCacheManager) -> list[LayerGroupId]:
    """Layer groups of attention layers (windowed or not), in id order."""
    return [lc.id for lc in manager.services.life_cycles if not lc.is_ssm]


def swa_life_cycle_ids(manager: KVCacheManager) -> list[LayerGroupId]:
    """Layer groups of sliding-window attention layers, in id order."""
    return [lc.id for lc in manager.services.life_cycles if not lc.is_ssm and lc.window_size is not None]


def ssm_life_cycle_id(manager: KVCacheManager) -> LayerGroupId | None:
    """The SSM layer group, None without SSM layers."""
    for lc in manager.services.life_cycles:
        if lc.is_ssm:
            return lc.id
    return None


def _is_evictable(page: Page, last_level: int) -> bool:
    """Whether eviction may move this page now: nobody locked it and it is either droppable or can go colder."""
    if page.lock_count > 0:
        return False
    droppable = page.block is not None and page.hold_count == 0 and page.claim_count == 0
    return droppable or page.level < last_level


def active_page_stats(kv_cache: KVCache) -> tuple[list[int], list[int]]:
    """Per tier: how many pages this cache uses, and how many of them eviction could move right now."""
    manager = kv_cache.manager
    last_level = manager.num_cache_levels - 1
    counts = [0] * manager.num_cache_levels
    evictable = [0] * manager.num_cache_levels
    for page in kv_cache.state.held_pages():
        counts[page.level] += 1
        if _is_evictable(page, last_level):
            evictable[page.level] += 1
    return counts, evictable


def committed_page_is_linked(kv_cache: KVCache, ordinal: SupportsIndex, lc_id: SupportsIndex) -> bool | None:
    """Whether the cache's page of committed block ``ordinal`` in layer group ``lc_id`` is still a tree block's
    page; None when there is no page there or the block is not committed yet."""
    state = kv_cache.state
    index = as_int(ordinal, "ordinal")
    lc = as_int(lc_id, "lc_id")
    if not 0 <= lc < len(state.groups):
        raise IndexError(f"lc_id {lc} out of range: the manager has {len(state.groups)} layer groups")
    group = state.attention_group(lc)
    if group is None or index < 0 or index >= len(group.entries):
        return None
    page = group.entries[index]
    tpb = kv_cache.manager.config.tokens_per_block
    if page is None or (index + 1) * tpb > state.num_committed_tokens:
        return None
    return page.block is not None


def all_tree_pages_droppable(manager: KVCacheManager) -> bool:
    """Whether every page of every cached block is unused (no lock, hold or claim): nothing pins the tree."""
    for root in manager.radix_tree.roots():
        pending = root.children()
        while pending:
            block = pending.pop()
            pending.extend(block.children())
            for page in block.pages:
                if page is not None and (page.lock_count or page.hold_count or page.claim_count):
                    return False
    return True


def is_commit_allowed(kv_cache: KVCache) -> bool:
    """Whether ``commit`` still adds blocks to the tree (False once committing stopped)."""
    return not kv_cache.state.is_committing_stopped


def _matched_blocks(
    manager: KVCacheManager, reuse_scope: ReuseScope | None, tokens: TokenSequence, enable_partial: bool
) -> tuple[int, list[Block]]:
    """Tree blocks along ``tokens`` (whole blocks, then with ``enable_partial`` the child sharing the longest start
    with the rest) and the tokens they cover, whatever pages they still have."""
    token_list = check_tokens(tokens, "tokens")
    tree = manager.radix_tree
    tpb = manager.config.tokens_per_block
    node = tree.find_root(reuse_scope)
    blocks: list[Block] = []
    if node is None:
        return 0, blocks
    for ordinal in range(len(token_list) // tpb):
        child = tree.child(node, tuple(token_list[ordinal * tpb : (ordinal + 1) * tpb]))
        if child is None:
            break
        blocks.append(child)
        node = child
    length = len(blocks) * tpb
    rest = token_list[length : length + tpb]
    if enable_partial and rest:
        source, shared = tree.longest_partial_child(node, rest)
        if source is not None and shared > 0:
            blocks.append(source)
            length += shared
    return length, blocks


def reuse_match_pages(
    manager: KVCacheManager,
    reuse_scope: ReuseScope | None,
    tokens: TokenSequence,
    lc_id: SupportsIndex,
    enable_partial: bool = False,
) -> tuple[int, list[tuple[int, int | None] | None]]:
    """Tokens the tree matches and, per matched block, ``(slot, tokens in the block)`` of its page of layer group
    ``lc_id`` (None where that page is gone)."""
    lc = as_int(lc_id, "lc_id")
    if not 0 <= lc < manager.num_layer_groups:
        raise ValueError(f"lc_id must be a layer group id below {manager.num_layer_groups}, got {lc}")
    length, blocks = _matched_blocks(manager, reuse_scope, tokens, enable_partial)
    pages: list[tuple[int, int | None] | None] = []
    for block in blocks:
        page = block.pages[lc]
        pages.append(None if page is None else (int(page.slot), block.num_tokens))
    return length, pages


__all__ = [
    "active_page_stats",
    "all_tree_pages_droppable",
    "attention_life_cycle_ids",
    "committed_page_is_linked",
    "current_gpu_ratio",
    "is_commit_allowed",
    "life_cycle_pool_group_indices",
    "pool_group_index",
    "reuse_match_pages",
    "ssm_life_cycle_id",
    "storage_statistics",
    "storage_utilization",
    "swa_life_cycle_ids",
]
