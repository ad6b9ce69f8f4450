"""Whole-manager consistency checks, run by debug mode after each state-changing call: no page lost or
double-owned, queues exact, tables true."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from .cache_view import CacheView
from .registry import CacheRegistry
from .._pages.page import Page
from .._pages.page import NO_CHILDREN, Block
from .services import CacheServices
from .._base.types import BAD_PAGE_INDEX, NO_LEVEL, NO_SLOT


@mypyc_attr(native_class=False)
class InvariantError(AssertionError):
    """The manager's bookkeeping contradicts itself (a bug, never a user error)."""


def _fail(message: str) -> None:
    raise InvariantError(message)


def tree_pages(services: CacheServices, blocks: set[int]) -> list[Page]:
    """The tree's pages, checking its links; ``blocks`` gets the id of every block in the tree."""
    if NO_CHILDREN:
        _fail("the children dict shared by blocks with at most one child was given a child")
    pages: list[Page] = []
    tree = services.tree
    stack: list[Block] = tree.roots()
    while stack:
        block = stack.pop()
        blocks.add(id(block))
        for lc, page in enumerate(block.pages):
            if page is not None:
                if page.block is not block or page.life_cycle != lc:
                    _fail(f"tree page of block {block.ordinal} life cycle {lc} does not point back to it")
                if not 0 < page.num_tokens <= len(block.tokens):
                    _fail(f"tree page of block {block.ordinal} life cycle {lc} holds {page.num_tokens} of its tokens")
                pages.append(page)
        if block.child is not None and block.child.slot in block.more_children:
            _fail(f"two children of block {block.ordinal} share slot {block.child.slot}")
        for child in block.children():
            if child.parent is not block or block.at_slot(child.slot) is not child or not child.attached:
                _fail(f"block {child.ordinal} is linked inconsistently with its parent")
            if tree.child(block, child.tokens) is not child:
                _fail(f"block {child.ordinal} is not what a lookup of its tokens finds")
            if len(block.tokens) < services.tokens_per_block and not block.is_root:
                _fail(f"partial block {block.ordinal} has children")
            stack.append(child)
    return pages


def check_invariants(services: CacheServices, registry: CacheRegistry) -> None:
    store = services.store
    pages: dict[int, Page] = {}
    blocks: set[int] = set()
    for page in tree_pages(services, blocks):
        pages[id(page)] = page
    expected_locks: dict[int, int] = {}
    private_users: dict[int, int] = {}  # a batch admission may share a private page between caches
    for cache in registry.live.values():
        for page in cache.held_pages():
            pages[id(page)] = page
            if page.block is None:
                private_users[id(page)] = private_users.get(id(page), 0) + 1
        if cache.is_active:
            for page in cache.live_entries():
                expected_locks[id(page)] = expected_locks.get(id(page), 0) + 1
            for group_state in cache.attention:
                for scratch_page in group_state.scratch_pages:
                    expected_locks[id(scratch_page)] = 1
            _check_indices(services, cache)
        elif any(group_state.scratch_pages for group_state in cache.attention):
            _fail(f"suspended cache {cache.id} holds scratch slots")
        _check_buffers(services, cache)
        _check_stale_entries(services, cache)
    pending = {cache.id for cache in registry.live.values() if cache.has_pending_stats}
    if services.pending_stats != pending:
        _fail(f"caches with pending statistics: kept {sorted(services.pending_stats)}, open {sorted(pending)}")
    for page in pages.values():
        users = private_users.get(id(page), 0)
        if users and page.hold_count + page.lock_count != users:
            _fail(f"private page of {users} caches has {page.lock_count} locks and {page.hold_count} holds")
    occupied: set[tuple[int, int, int]] = set()
    queued = 0
    for page in pages.values():
        if page.level < 0 or page.slot < 0:
            _fail(f"live page of life cycle {page.life_cycle} has no slot")
        where = (page.level, page.pool_group, page.slot)
        if page.pool_group != store.grouping.group_of[page.level][page.life_cycle]:
            _fail(f"page at {where} of life cycle {page.life_cycle} is not in its level's pool group")
        if page.claim_count != 0:
            _fail(f"page at {where} is still claimed outside a batch admission")
        if where in occupied:
            _fail(f"two pages share slot {where}")
        occupied.add(where)
        if page.lock_count != expected_locks.get(id(page), 0):
            _fail(f"page at {where} has {page.lock_count} locks, expected {expected_locks.get(id(page), 0)}")
        if page.lock_count > 0:
            if page.level != 0:
                _fail(f"locked page at {where} is not on the GPU")
            if page.queue is not None:
                _fail(f"locked page at {where} is in an eviction list")
        else:
            queues = store.queues[page.level][page.pool_group]
            want = queues.held if page.hold_count > 0 or page.block is None else queues.droppable
            if page.queue is not want:
                _fail(f"evictable page at {where} is not in its eviction list")
            queued += 1
    listed = 0
    for level, tier in enumerate(store.tiers):
        for pool_group, storage in enumerate(tier.pool_groups):
            used = sum(1 for where in occupied if where[0] == level and where[1] == pool_group)
            if used + storage.allocator.num_free != storage.num_slots:
                _fail(
                    f"level {level} pool group {pool_group}: {used} used + {storage.allocator.num_free} free != "
                    f"{storage.num_slots} slots"
                )
            queues = store.queues[level][pool_group]
            listed += queues.held.size + queues.droppable.size
            for queue in (queues.held, queues.droppable):
                if sum(1 for _ in queue) != queue.size:
                    _fail(f"level {level} pool group {pool_group}: eviction list size is off")
    if listed != queued:
        _fail(f"eviction lists hold {listed} pages, {queued} pages are evictable")
    _check_spares(services, pages, blocks)


def _check_spares(services: CacheServices, pages: dict[int, Page], blocks: set[int]) -> None:
    """Spare page and block objects (freed, kept for reuse) are blank and referenced by nothing in use: a
    reference kept past ``free`` or ``prune`` would otherwise alias the next content they are given."""
    for page in services.store.spare_pages:
        if id(page) in pages:
            _fail(f"spare page of life cycle {page.life_cycle} is still in use")
        if page.slot != NO_SLOT or page.level != NO_LEVEL or page.block is not None or page.queue is not None:
            _fail(f"spare page of life cycle {page.life_cycle} still has a slot, a block or an eviction list")
        if page.lock_count or page.hold_count or page.claim_count:
            _fail(f"spare page of life cycle {page.life_cycle} still has locks, holds or claims")
    for block in services.tree.spare_blocks:
        if id(block) in blocks or block.attached:
            _fail(f"spare block (ordinal {block.ordinal}) is still in the tree")
        if block.parent is not None or block.users or block.has_children() or block.has_any_page():
            _fail(f"spare block (ordinal {block.ordinal}) still has a parent, users, children or pages")


def _check_indices(services: CacheServices, cache: CacheView) -> None:
    for any_kind in cache.groups:
        indices = cache.get_base_page_indices(any_kind.id)
        if len(indices) != cache.num_blocks:
            _fail(f"cache {cache.id} layer group {any_kind.id}: {len(indices)} indices for {cache.num_blocks} blocks")
    for group in cache.attention:
        lc = group.id
        stale_beg, stale_end = cache.stale_range(lc)
        scratch_beg, scratch_end = group.scratch_range
        scratch_slots = len(group.scratch_pages)
        if scratch_slots != services.layout.scratch_slots(lc, max(0, scratch_end - scratch_beg)):
            _fail(f"cache {cache.id} layer group {lc}: {scratch_slots} scratch slots for [{scratch_beg}, {scratch_end})")
        indices = cache.get_base_page_indices(lc)
        for ordinal, page in enumerate(group.entries):
            stale = stale_beg <= ordinal < stale_end
            if scratch_beg <= ordinal < scratch_end:
                if page is not None:
                    _fail(f"cache {cache.id} layer group {lc} scratch block {ordinal} has a page")
                continue
            want = page.slot if page is not None and not stale else BAD_PAGE_INDEX
            if indices[ordinal] != want:
                _fail(f"cache {cache.id} layer group {lc} block {ordinal}: index {indices[ordinal]} != {want}")
            if not stale and page is None:
                _fail(f"active cache {cache.id} layer group {lc} block {ordinal} has no page")


def _check_stale_entries(services: CacheServices, cache: CacheView) -> None:
    """A window keeps a block it has passed only while the cache may still commit it: a committed block's page
    leaves the cache (the tree keeps it, or nothing needs it), else it would take a slot until the cache closes."""
    live = {id(page) for page in cache.live_entries()}
    committed_blocks = cache.num_committed_tokens // services.tokens_per_block
    for group in cache.attention:
        for ordinal, page in enumerate(group.entries[:committed_blocks]):
            if page is not None and id(page) not in live:
                _fail(f"cache {cache.id} layer group {group.id} keeps committed block {ordinal} its window passed")


def _check_buffers(services: CacheServices, cache: CacheView) -> None:
    """A registered page-index buffer equals the cache's indices, and -1 past them (all -1 while suspended)."""
    for group in cache.groups:
        lc = group.id
        buffer = group.user_buffer
        if buffer is None:
            continue
        indices = cache.get_base_page_indices(lc)
        for ordinal in range(len(buffer)):
            want = indices[ordinal] if cache.is_active and ordinal < len(indices) else BAD_PAGE_INDEX
            if buffer[ordinal] != want:
                _fail(f"cache {cache.id} layer group {lc}: registered buffer[{ordinal}] = {buffer[ordinal]}, expected {want}")
