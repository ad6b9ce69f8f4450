"""Looks inside a manager and its caches, under the module name TensorRT-LLM's tests import.

Engines and tests that check what the manager did (where pages sit, what a match would reuse, how the GPU tier is
split) call these instead of reading private attributes; every answer is computed from the live state. A few hooks
set what a rebalancing follows (``force_rebalance_precondition``); the grain arithmetic and ``CachedCudaEvent``
are the helpers those tests use beside them. White-box tests reach a manager's collaborators (page store, radix
tree, quota planner) through ``internals_of``, a cache's state through ``state_of`` and the NIXL endpoints of a
receiver and a sender through ``receiver_endpoint`` and ``sender_endpoint``, re-exported here."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping, Sequence, SupportsIndex

from ._base.hashing import ReuseScope, TokenSequence, check_tokens
from ._cache.handle import state_of
from ._manager.core import check_alive, internals_of
from ._handoff.nixl import receiver_endpoint
from ._handoff.nixl_sender import sender_endpoint
from ._pages.page import Block
from ._base.types import LayerGroupId
from ._base.validation import as_float, as_int
from ._model.grains import grains_for_slots, grains_to_slots, ratio_to_slot_count_list
from ._storage.cached_event import CachedCudaEvent
from ._storage.page_codec import PaddingColdPageCodec
from .config import BatchDesc, SwaScratchReuseConfig
from ._base.wording import counted

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
    """Pool group of layer group ``lc_id`` in tier ``cache_level`` (the cold tiers of a manager with a cold-page
    codec group layer groups by their encoded page size; otherwise every tier groups them alike)."""
    manager.get_storage_statistics(cache_level)  # checks the level
    manager.get_pool_group_index(lc_id)  # checks the layer group
    return int(internals_of(manager).store.grouping.group_of[as_int(cache_level, "cache_level")][as_int(lc_id, "lc_id")])


def create_test_padding_cold_page_codec(cold_page_bytes_by_layer: Mapping[int, SupportsIndex]) -> PaddingColdPageCodec:
    """The test codec of TensorRT-LLM's tests (its parameter name): each layer group's cold pages padded with zeros
    to the given bytes."""
    return PaddingColdPageCodec(cold_page_bytes_by_layer)


def life_cycle_pool_group_indices(manager: KVCacheManager, cache_level: SupportsIndex = 0) -> list[int]:
    """``pool_group_index`` of every layer group, indexed by layer group id (``KVCacheManager.
    get_life_cycle_pool_group_indices``, kept under this name for TensorRT-LLM's tests)."""
    return manager.get_life_cycle_pool_group_indices(cache_level)


def attention_life_cycle_ids(manager: KVCacheManager) -> list[LayerGroupId]:
    """Layer groups of attention layers (windowed or not), in id order."""
    return [lc.id for lc in internals_of(manager).services.life_cycles if not lc.is_ssm]


def swa_life_cycle_ids(manager: KVCacheManager) -> list[LayerGroupId]:
    """Layer groups of sliding-window attention layers, in id order."""
    return [lc.id for lc in internals_of(manager).services.life_cycles if not lc.is_ssm and lc.window_size is not None]


def ssm_life_cycle_id(manager: KVCacheManager) -> LayerGroupId | None:
    """The SSM layer group, None without SSM layers."""
    for lc in internals_of(manager).services.life_cycles:
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
    """Per tier: how many pages this cache uses, and how many of them eviction could move but no eviction list
    holds (so eviction would never find them: a bookkeeping fault, zero in a sound state)."""
    manager = kv_cache.manager
    last_level = manager.num_cache_levels - 1
    counts = [0] * manager.num_cache_levels
    unscheduled_evictable = [0] * manager.num_cache_levels
    for page in state_of(kv_cache).held_pages():
        counts[page.level] += 1
        if page.queue is None and _is_evictable(page, last_level):
            unscheduled_evictable[page.level] += 1
    return counts, unscheduled_evictable


def committed_page_is_linked(kv_cache: KVCache, ordinal: SupportsIndex, lc_id: SupportsIndex) -> bool | None:
    """Whether the cache's page of committed block ``ordinal`` in layer group ``lc_id`` is still a tree block's
    page; None when there is no page there or the block is not committed yet. A partial last block counts as
    committed once published (``stop_committing``) or when the cache reused it (its copy-on-write source, until
    copied): its page may then have given way to a wider one (False)."""
    state = state_of(kv_cache)
    index = as_int(ordinal, "ordinal")
    lc = as_int(lc_id, "lc_id")
    if not 0 <= lc < len(state.groups):
        raise IndexError(f"lc_id {lc} out of range: the manager has {counted(len(state.groups), 'layer group')}")
    group = state.attention_group(lc)
    if group is None or index < 0 or index >= len(group.entries):
        return None
    page = group.entries[index]
    tpb = kv_cache.manager.config.tokens_per_block
    committed = state.num_committed_tokens
    if (index + 1) * tpb > committed:  # the partial last block, or past the committed tokens
        if index * tpb >= committed:
            return None
        if page is None:
            page = group.cow_source
        elif not state.is_committing_stopped:
            return None
    if page is None:
        return None
    return page.block is not None


def all_tree_pages_droppable(manager: KVCacheManager) -> bool:
    """Whether every page of every cached block is unused (no lock, hold or claim): nothing pins the tree."""
    for root in internals_of(manager).tree.roots():
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
    return not state_of(kv_cache).is_committing_stopped


def kept_input_tokens(kv_cache: KVCache) -> int:
    """How many of its input tokens ``kv_cache`` keeps a copy of for ``known_tokens`` (those past its reused prefix,
    until its commits cover them; 8 bytes a token in the list alone)."""
    return state_of(kv_cache).kept_input_tokens


def _matched_blocks(
    manager: KVCacheManager, reuse_scope: ReuseScope | None, tokens: TokenSequence, enable_partial: bool
) -> tuple[int, list[Block]]:
    """Tree blocks along ``tokens`` (whole blocks, then with ``enable_partial`` the child sharing the longest start
    with the rest, without it a partial child holding exactly the rest) and the tokens they cover, whatever pages
    they still have."""
    token_list = check_tokens(tokens, "tokens")
    tree = internals_of(manager).tree
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
    elif 0 < len(rest) < tpb:
        exact = tree.child(node, tuple(rest))
        if exact is not None:
            blocks.append(exact)
            length += len(rest)
    return length, blocks


def reuse_match_pages(
    manager: KVCacheManager,
    reuse_scope: ReuseScope | None,
    tokens: TokenSequence,
    lc_id: SupportsIndex,
    enable_partial: bool | None = None,
) -> tuple[int, list[tuple[int, int | None] | None]]:
    """Tokens the tree matches and, per matched block, ``(slot, tokens the page holds)`` of its page of layer group
    ``lc_id`` (None where that page is gone). ``enable_partial`` defaults to the manager's partial reuse."""
    lc = as_int(lc_id, "lc_id")
    if not 0 <= lc < manager.num_layer_groups:
        raise ValueError(f"lc_id must be a layer group id below {manager.num_layer_groups}, got {lc}")
    partial = manager.config.partial_reuse_enabled if enable_partial is None else enable_partial
    length, blocks = _matched_blocks(manager, reuse_scope, tokens, partial)
    pages: list[tuple[int, int | None] | None] = []
    for block in blocks:
        page = block.pages[lc]
        pages.append(None if page is None else (int(page.slot), page.num_tokens))
    return length, pages


def reuse_match_planned_drop_counts(
    manager: KVCacheManager,
    reuse_scope: ReuseScope | None,
    tokens: TokenSequence,
    lc_id: SupportsIndex,
    enable_partial: bool = False,
) -> tuple[int, list[int | None]]:
    """Tokens the tree matches and, per matched block, how many undropped ``PlannedDropHandle``s name its page of
    layer group ``lc_id`` (None where that page is gone)."""
    lc = as_int(lc_id, "lc_id")
    if not 0 <= lc < manager.num_layer_groups:
        raise ValueError(f"lc_id must be a layer group id below {manager.num_layer_groups}, got {lc}")
    length, blocks = _matched_blocks(manager, reuse_scope, tokens, enable_partial)
    counts: list[int | None] = []
    for block in blocks:
        page = block.pages[lc]
        counts.append(None if page is None else page.planned_drop_count)
    return length, counts


def compute_slots_for_batch(
    manager: KVCacheManager,
    batch: BatchDesc,
    tokens_per_block: SupportsIndex,
    swa_scratch_reuse: SwaScratchReuseConfig | None = None,
) -> list[int]:
    """Slots each pool group needs to hold ``batch`` at once (one SSM state per cache), as the quota planner
    counts them for a constraint; ``swa_scratch_reuse`` plans with prefill scratch slots, None without."""
    if not isinstance(batch, BatchDesc):
        raise TypeError(f"batch must be a BatchDesc, got {type(batch).__name__}")
    tpb = as_int(tokens_per_block, "tokens_per_block")
    if tpb != manager.config.tokens_per_block:
        raise ValueError(f"tokens_per_block must be the manager's {manager.config.tokens_per_block}, got {tpb}")
    if swa_scratch_reuse is not None and not isinstance(swa_scratch_reuse, SwaScratchReuseConfig):
        raise TypeError(f"swa_scratch_reuse must be a SwaScratchReuseConfig or None, got {swa_scratch_reuse!r}")
    rewind = None if swa_scratch_reuse is None else swa_scratch_reuse.max_rewind_len
    return internals_of(manager).planner.pages(batch, 1, rewind)


def set_num_sampled_kv_caches(manager: KVCacheManager, value: SupportsIndex) -> None:
    """Declare ``value`` requests sampled (TensorRT-LLM's sample-count gate): with
    ``rebalance_min_sampled_kv_caches`` or more declared, rebalancing follows the closed requests observed so far,
    however few (at least one)."""
    count = as_int(value, "value")
    if count < 0:
        raise ValueError(f"value must be >= 0, got {count}")
    check_alive(manager)
    internals_of(manager).planner.declared_samples = count


def set_last_adjustment_time(manager: KVCacheManager, value: float) -> None:
    """Pretend the last rebalancing happened at ``value`` on the rebalance clock (``time.monotonic`` unless a test
    replaced it): ``rebalance_cooldown_secs`` counts from there."""
    seconds = as_float(value, "value")
    if not math.isfinite(seconds) or seconds < 0.0:
        raise ValueError(f"value must be a finite time >= 0, got {value!r}")
    check_alive(manager)
    internals_of(manager).planner.rebalance.last_adjustment = seconds


def set_target_ratio_list_gpu(manager: KVCacheManager, ratios: Sequence[float]) -> None:
    """Make the next ``need_adjustment`` / ``adjust`` split the GPU tier by ``ratios`` (one share of its bytes per
    pool group) instead of the observed demand, until an ``adjust`` applies it."""
    check_alive(manager)
    count = len(internals_of(manager).planner.layout.pool_groups)
    values = [as_float(ratio, "ratios[]") for ratio in ratios]
    if len(values) != count:
        raise ValueError(f"ratios must have one share per pool group ({count}), got {len(values)}")
    if not all(math.isfinite(ratio) and ratio > 0.0 for ratio in values):
        raise ValueError(f"ratios must be finite and positive, got {values}")
    internals_of(manager).planner.target_ratio = values


def force_rebalance_precondition(manager: KVCacheManager, skew: float = 2.0) -> None:
    """Make the next ``adjust`` really move pool groups: the sample gate opened (whatever
    ``rebalance_min_sampled_kv_caches`` is) and a target split whose first
    pool group's share is ``skew`` times today's (renormalized). ValueError with fewer than two pool groups,
    where no split can move."""
    factor = as_float(skew, "skew")
    if not math.isfinite(factor) or factor <= 0.0:
        raise ValueError(f"skew must be finite and positive, got {skew!r}")
    current = current_gpu_ratio(manager)
    if len(current) < 2:
        raise ValueError(f"force_rebalance_precondition needs at least 2 pool groups, the manager has {len(current)}")
    skewed = [current[0] * factor] + current[1:]
    total = sum(skewed)
    set_num_sampled_kv_caches(manager, max(2001, internals_of(manager).planner.rebalance.min_samples))
    set_target_ratio_list_gpu(manager, [share / total for share in skewed])


__all__ = [
    "CachedCudaEvent",
    "check_alive",
    "internals_of",
    "receiver_endpoint",
    "sender_endpoint",
    "state_of",
    "compute_slots_for_batch",
    "force_rebalance_precondition",
    "grains_for_slots",
    "grains_to_slots",
    "ratio_to_slot_count_list",
    "reuse_match_planned_drop_counts",
    "set_last_adjustment_time",
    "set_num_sampled_kv_caches",
    "set_target_ratio_list_gpu",
    "active_page_stats",
    "all_tree_pages_droppable",
    "attention_life_cycle_ids",
    "committed_page_is_linked",
    "current_gpu_ratio",
    "is_commit_allowed",
    "life_cycle_pool_group_indices",
    "pool_group_index",
    "create_test_padding_cold_page_codec",
    "reuse_match_pages",
    "ssm_life_cycle_id",
    "storage_statistics",
    "storage_utilization",
    "swa_life_cycle_ids",
]
