"""Page and block objects are made once and reused (``PageStore.spare_pages``, ``RadixTree.spare_blocks``): a cache
that fills up and keeps evicting creates none, so the garbage collector has no new objects to traverse; the debug
checks catch a reference kept past ``free`` or ``prune``, which reuse would otherwise turn into aliased content."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2._cache.invariants import InvariantError
from kv_cache_manager_v2._pages.page import Block, Page
from kv_cache_manager_v2._pages.page import PriorityLru
from kv_cache_manager_v2._pages.lru_order import LruOrder
from kv_cache_manager_v2._base.types import NO_LEVEL, NO_SLOT, CacheLevel, LifeCycleId, PoolGroupIndex, SlotId
from tests.helpers import attention, make_config

TPB = 4
SLOTS = 24
SLOT_BYTES = 2 * 256  # K and V of one 256-byte buffer each


def _manager() -> KVCacheManager:
    return KVCacheManager(make_config([attention(0, 256)], gpu_quota=SLOTS * SLOT_BYTES, tokens_per_block=TPB))


def _serve(manager: KVCacheManager, request: int) -> None:
    """One request of three full blocks, all its own tokens: computed, committed, closed (cached, then evicted)."""
    tokens = [request * 1000 + position for position in range(3 * TPB)]
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)
    cache.close()


def _tree(manager: KVCacheManager) -> tuple[list[Block], list[Page]]:
    """The tree's blocks (roots aside) and their pages."""
    blocks: list[Block] = []
    pages: list[Page] = []
    stack = internals_of(manager).tree.roots()
    while stack:
        block = stack.pop()
        if not block.is_root:
            blocks.append(block)
        pages.extend(page for page in block.pages if page is not None)
        stack.extend(block.children())
    return blocks, pages


def test_a_cache_that_keeps_evicting_makes_no_page_or_block_objects() -> None:
    manager = _manager()
    store = internals_of(manager).store
    tree = internals_of(manager).tree
    assert len(store.spare_pages) == SLOTS and len(tree.spare_blocks) == SLOTS
    made = list(store.spare_pages), list(tree.spare_blocks)  # kept alive: their ids stay theirs
    for request in range(5 * SLOTS):  # 15 times the blocks the GPU holds: most are evicted and pruned
        _serve(manager, request)
    manager.check_invariants()
    assert manager.movement_counters.dropped_pages > 3 * SLOTS
    blocks, pages = _tree(manager)
    assert len(blocks) == len(pages) == SLOTS  # the GPU is full of cached blocks
    assert {id(page) for page in pages + store.spare_pages} <= {id(page) for page in made[0]}
    assert {id(block) for block in blocks + tree.spare_blocks} <= {id(block) for block in made[1]}
    manager.shutdown()


def test_the_debug_checks_catch_a_spare_page_or_block_still_in_use() -> None:
    manager = _manager()
    _serve(manager, 1)
    store = internals_of(manager).store
    tree = internals_of(manager).tree
    root = tree.roots()[0]
    block = root.child
    assert block is not None
    page = block.pages[0]
    assert page is not None
    store.spare_pages.append(page)
    with pytest.raises(InvariantError, match="spare page of life cycle 0 is still in use"):
        manager.check_invariants()
    store.spare_pages.pop()
    tree.spare_blocks.append(block)
    with pytest.raises(InvariantError, match="spare block .* is still in the tree"):
        manager.check_invariants()
    tree.spare_blocks.pop()
    manager.check_invariants()
    manager.shutdown()


def _page(slot: int) -> Page:
    return Page(LifeCycleId(0), PoolGroupIndex(0), CacheLevel(0), SlotId(slot), 0)


def test_lru_order_leaves_a_page_object_that_was_given_other_content_where_it_is() -> None:
    """A refused batch request puts the pages it touched back in their old LRU positions; a page dropped meanwhile
    whose object now holds other content in the same list is not one of them."""
    queue = PriorityLru()
    first, second, third = _page(0), _page(1), _page(2)
    for stamp, page in enumerate((first, second, third)):
        queue.push(page, stamp)
    order = LruOrder()
    order.remember(first)
    order.remember(second)
    queue.remove(first)  # dropped: freed, its object kept as a spare...
    first.slot, first.level = NO_SLOT, NO_LEVEL
    first.reuse(LifeCycleId(0), PoolGroupIndex(0), CacheLevel(0), SlotId(7), 0)  # ...and given new content
    queue.push(first, 10)
    queue.remove(second)  # touched by the refused request: back to its old place
    queue.push(second, 11)
    order.restore()
    assert list(queue) == [second, third, first]
