"""Everything observable of a manager and its caches, public answers and introspected internals, as plain values:
two managers that made the same calls must give equal ``deep_state`` (``tests/fuzz/twin.py``).

Draining reads (KV events, iteration statistics taken) are read on both twins alike, so they compare what
happened since the previous observation. A public read that raises is recorded as its exception's type and
text: twins must refuse alike too.
"""

from __future__ import annotations

from array import array
from typing import Callable, Sequence

from kv_cache_manager_v2 import KVCacheManager, KVCacheStatus, KVEvent, _KVCache
from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2._pages.page import Block, Page, PriorityLru
from tools.parity.describe import describe


def answer(read: Callable[[], object]) -> object:
    """``read()``, or its exception as (type name, text); value objects compare by their fields (``describe``)."""
    try:
        value = read()
    except (ValueError, TypeError, RuntimeError) as error:
        return (type(error).__name__, str(error))
    return list(value) if isinstance(value, (list, tuple, array)) else value


def page_state(page: Page | None) -> object:
    if page is None:
        return None
    return (
        page.life_cycle,
        page.pool_group,
        page.level,
        page.slot,
        page.priority,
        page.lock_count,
        page.hold_count,
        page.claim_count,
        page.num_tokens,
        page.planned_drop_count,
        page.lost,
        page.stamp,
    )


def tree_state(manager: KVCacheManager) -> list[object]:
    """Each block (depth first, children in the tree's order): ordinal, tokens, snapshot flag, its pages."""
    blocks: list[object] = []
    stack: list[Block] = list(reversed(internals_of(manager).tree.roots()))
    while stack:
        block = stack.pop()
        blocks.append((block.ordinal, block.tokens, block.saved_snapshot, [page_state(p) for p in block.pages]))
        stack.extend(reversed(block.children()))
    return blocks


def lru_state(queue: PriorityLru) -> list[object]:
    return [(page.life_cycle, page.level, page.slot, page.priority, page.stamp) for page in queue]


def store_state(manager: KVCacheManager) -> dict[str, object]:
    store = internals_of(manager).store
    state: dict[str, object] = {}
    for level, groups in enumerate(store.queues):
        for pool_group, queues in enumerate(groups):
            state[f"lru {level}/{pool_group}"] = (lru_state(queues.held), lru_state(queues.droppable))
    state["spare pages"] = len(store.spare_pages)
    state["spare blocks"] = len(internals_of(manager).tree.spare_blocks)
    return state


def cache_state(manager: KVCacheManager, cache: _KVCache) -> list[object]:
    state: list[object] = [
        cache.id,
        cache.status,
        cache.capacity,
        cache.history_length,
        cache.num_committed_tokens,
        cache.is_committing_stopped,
        cache.num_blocks,
        cache.last_refusal,
        cache.held_for,
        list(cache.snapshot_points),
        cache.reuse_scope,
        cache.has_scratch_slots,
    ]
    if cache.status == KVCacheStatus.CLOSED:
        return state
    for lg in range(manager.num_layer_groups):
        state.append(answer(lambda: cache.get_base_page_indices(lg)))
        state.append(answer(lambda: cache.get_aggregated_page_indices(lg)))
        state.append(answer(lambda: cache.get_num_front_blocks_removed(lg)))
        state.append(answer(lambda: cache.get_scratch_desc(lg)))
        state.append(answer(lambda: cache.get_ssm_block_base_index(lg)))
    return state


def deep_state(
    manager: KVCacheManager, caches: Sequence[_KVCache], events_seen: Callable[[list[KVEvent]], None]
) -> dict[str, object]:
    """The manager's public answers, its tree, eviction lists and spare objects, and each of ``caches``; the KV
    events it drains go to ``events_seen`` too (the world's ``EventReplay``, which must see every one)."""
    state: dict[str, object] = {f"cache #{n}": cache_state(manager, cache) for n, cache in enumerate(caches)}
    state.update(manager_reads(manager, events_seen))
    state["tree"] = tree_state(manager)
    state.update(store_state(manager))
    return {key: describe(value) for key, value in state.items()}


def manager_reads(manager: KVCacheManager, events_seen: Callable[[list[KVEvent]], None]) -> dict[str, object]:
    """The manager's public answers, in ``deep_state``'s order; among them the reads that change what a later read
    answers (``get_usage`` closes the caches dropped meanwhile, the KV events and iteration statistics drain,
    ``max_admissible`` records its refusal). Called alone, it brings those to rest before a ``deep_state`` that
    must find nothing pending, at a fraction of ``deep_state``'s cost (no cache, tree or eviction list read)."""
    state: dict[str, object] = {}
    for level in range(manager.num_cache_levels):
        state[f"statistics {level}"] = manager.get_storage_statistics(level)
        state[f"quota {level}"] = manager.get_quota(level)
    state["usage"] = manager.get_usage()
    state["movement"] = manager.movement_counters
    events = manager.get_latest_events()
    events_seen(events)
    state["events"] = events
    state["iteration stats"] = manager.get_iteration_stats()
    state["committed stats"] = manager.get_committed_stats()
    state["dirty"] = sorted(manager.get_dirty_stats_kv_cache_ids())
    state["max admissible"] = manager.max_admissible(16)  # first: a 0 records its refusal, read next
    state["last refusal"] = manager.last_refusal
    state["last batch refusals"] = manager.last_batch_refusals
    state["live caches"] = manager.num_live_caches
    state["scopes"] = manager.num_reuse_scopes
    state["need adjustment"] = manager.need_adjustment
    return state


def differences(first: dict[str, object], second: dict[str, object]) -> dict[str, tuple[object, object]]:
    keys = first.keys() | second.keys()
    return {key: (first.get(key), second.get(key)) for key in keys if first.get(key) != second.get(key)}
