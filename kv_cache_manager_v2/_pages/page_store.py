"""Page placement across tiers: use counting, allocation with priority-LRU eviction cascading down the tiers,
onboarding, snapshots, quota changes, and the recorded copies that carry it all out (``slot_copies``).

The read-only questions (room for a step, statistics) are ``StoreOccupancy``'s, which ``PageStore`` extends.
"""

from __future__ import annotations

import logging

from .._observe.events import UPDATED, EventLog
from .._model.tier_grouping import TierGrouping
from .._base.interrupts import DeferredInterrupts
from .._storage.page_codec import ColdPageCodec
from .._storage.slots import TierStorage
from .._storage.stream_order import StreamOrder
from .._base.types import NO_LEVEL, NO_SLOT, CacheLevel, LifeCycleId, OutOfPagesError, PoolGroupIndex, SlotId
from .._base.wording import counted
from .listener import PageListener
from .occupancy import StoreOccupancy
from .page import MAX_SPARES_MADE_UP_FRONT, Page
from .radix_tree import RadixTree, record_page_event
from .room_model import WaitingPages
from .slot_copies import SlotCopy, copy_pool_group_slots, run_slot_copies

logger = logging.getLogger("kv_cache_manager_v2.pages")


class PageStore(StoreOccupancy):
    """Where every page lives and what moves when room is short; the one place data movement is recorded."""

    def __init__(
        self,
        tiers: list[TierStorage],
        tree: RadixTree,
        num_life_cycles: int,
        events: EventLog,
        stream_order: StreamOrder,
        grouping: TierGrouping,
        interrupts: DeferredInterrupts,
        codec: ColdPageCodec | None = None,
    ) -> None:
        super().__init__(tiers, num_life_cycles, grouping)
        self.codec = codec
        # Where an interrupt the codec raised goes: the end of the call (``DeferredInterrupts``).
        self.interrupts = interrupts
        self.stream_order = stream_order
        self.events = events
        self.tree = tree
        self._copies: list[SlotCopy] = []
        # A page left an active cache's hands (unlocked) since the last ``flush``: that flush fences the caller's
        # stream, so another stream reusing the slot waits for the work already queued on it (an asynchronous
        # engine resizes for step N + 1 while step N may still read the pages it releases).
        self._unlocked_since_flush = False
        # Pages whose move failed since the last ``flush`` (``run_recorded_copies``), settled there.
        self._lost: list[Page] = []
        # The last such failure, for errors and the log ("" while none happened).
        self.last_copy_error: str = ""
        self._stamp = 0
        # A colder layer above (the shared remote tier), told of drops; plugged in by the manager.
        self.listener: PageListener | None = None
        # Freed page objects, handed out again for new content. One per GPU slot is made here (up to
        # MAX_SPARES_MADE_UP_FRONT), so a cache that fills up creates no page objects, and freed ones come back:
        # otherwise every page would be a new object the garbage collector traverses (and promotes) as the cache
        # warms up, and again with each one replacing an evicted one. Kept to one per GPU slot, so a burst into
        # colder tiers does not pin its objects for good.
        self.spare_page_limit: int = sum(pool_group.num_slots for pool_group in tiers[0].pool_groups)
        self.spare_pages: list[Page] = [
            Page(LifeCycleId(0), PoolGroupIndex(0), NO_LEVEL, NO_SLOT, 0)
            for _ in range(min(self.spare_page_limit, MAX_SPARES_MADE_UP_FRONT))
        ]
        # While a cache resumes: its pages still to onboard or copy from, which may be sent a tier down (``_evict_one``).
        self.waiting: WaitingPages = WaitingPages()

    # ------------------------------------------------------------------------------------------ use counting
    def refile(self, page: Page) -> None:
        """Put a page in the eviction list its state calls for (none while locked)."""
        queue = page.queue
        if queue is not None:
            queue.remove(page)
        if page.lock_count > 0 or page.claim_count > 0:
            return
        if page.lost and page.block is None and page.hold_count == 0:
            self.free(page)  # its last user let go of a page that left the tree (``_settle_lost``)
            return
        queues = self.queues[page.level][page.pool_group]
        self._stamp += 1
        if page.hold_count > 0 or page.block is None:
            queues.held.push(page, self._stamp)
        else:
            queues.droppable.push(page, self._stamp)

    def lock(self, page: Page) -> None:
        page.lock_count += 1
        queue = page.queue
        if queue is not None:
            queue.remove(page)

    def lock_to_hold(self, page: Page) -> None:
        """Turn one lock into a hold without filing the page in an eviction list: for a caller that unholds it
        within the same call (closing a cache), which files it once, where it ends up."""
        page.lock_count -= 1
        page.hold_count += 1

    def unlock(self, page: Page) -> None:
        page.lock_count -= 1
        self._unlocked_since_flush = True
        if page.lock_count == 0 and page.claim_count == 0:
            self.refile(page)

    def claim(self, page: Page) -> None:
        """Pin a page where it is for the rest of a batch admission (out of every eviction list)."""
        page.claim_count += 1
        queue = page.queue
        if queue is not None:
            queue.remove(page)

    def unclaim(self, page: Page) -> None:
        page.claim_count -= 1
        if page.claim_count == 0 and page.lock_count == 0:
            self.refile(page)

    def hold(self, page: Page) -> None:
        page.hold_count += 1
        if page.queue is not None:
            self.refile(page)

    def unhold(self, page: Page) -> None:
        page.hold_count -= 1
        if page.lock_count == 0 and page.claim_count == 0:
            self.refile(page)

    # ------------------------------------------------------------------------------------------ placement
    @staticmethod
    def onboard_order(page: Page) -> int:
        """Sort key that onboards pages in the order ``can_obtain`` assumes (warmest colder level first)."""
        return page.level

    def new_page(self, life_cycle: LifeCycleId, pool_group: PoolGroupIndex, priority: int) -> Page:
        """A new locked private page on the GPU; the caller has checked ``gpu_room``."""
        slot = self._obtain_slot(0, pool_group)
        if slot < 0:
            raise OutOfPagesError(f"no GPU slot left in pool group {pool_group}")
        page = self._page(life_cycle, pool_group, CacheLevel(0), slot, priority)
        page.lock_count = 1
        self.stats[life_cycle].allocated_pages += 1
        return page

    def onboard(self, page: Page) -> None:
        """Bring a (locked) page to the GPU; its old slot is freed once the copy is recorded."""
        if page.level == 0:
            return
        pool_group = self.grouping.group_of[0][page.life_cycle]
        slot = self._obtain_slot(0, pool_group)
        if slot < 0:
            raise OutOfPagesError(f"no GPU slot left in pool group {pool_group} to onboard a page")
        slot_bytes = self.grouping.page_bytes(page.level, page.life_cycle)
        self._record_move(page, CacheLevel(0), slot)
        self.counters.onboarded_pages += 1
        self.counters.onboarded_bytes += slot_bytes
        stats = self.stats[page.life_cycle]
        stats.onboarded_pages += 1
        stats.onboarded_bytes += slot_bytes

    def onboard_all(self, pages: list[Page], sources: list[Page]) -> None:
        """Bring a resuming cache's locked pages to the GPU in the order ``can_obtain`` counted (warmest level
        first); one still waiting may go a tier down to make room where nothing else can (see ``RoomModel``), and
        so may its claimed copy-on-write ``sources``, which wait on in ``waiting`` for their copies (the caller
        clears it)."""
        pages.sort(key=PageStore.onboard_order)
        self.waiting.pages = pages + sources
        for index, page in enumerate(pages):
            self.waiting.first = index
            self.onboard(page)
        self.waiting.first = len(pages)

    def move_if_free(self, page: Page, level: int) -> bool:
        """Move an unlocked page to a free slot of ``level`` (a placement hint, whose caller then ``refile``s its
        pages deepest first); False, changing nothing, when that tier has no free slot: nothing is evicted for it."""
        slot = self.tiers[level].pool_groups[self.grouping.group_of[level][page.life_cycle]].allocator.allocate()
        if slot < 0:
            return False
        previous = page.level
        self._record_move(page, CacheLevel(level), slot)
        self._count_move(page, previous, level)
        return True

    def onboard_evicting(self, pages: list[Page], budget: list[int]) -> int:
        """Move the unlocked ``pages`` (one suspended cache's) to the GPU, warmest level first, evicting by the
        priority-LRU where no slot is free, as ``resume`` would (``KVCache.prefetch(evict=True)``); at most
        ``budget[pool_group]`` pages into each pool group. Every one of ``pages`` is claimed meanwhile, so making
        room never sends one of them down; locked and claimed pages (active caches', a batch's) are never evicted.
        A page for which no room can be made stays where it is. Returns the pages moved."""
        for page in pages:
            self.claim(page)
        moved = 0
        try:
            for page in sorted(pages, key=PageStore.onboard_order):
                pool_group = self.grouping.group_of[0][page.life_cycle]
                if page.level == 0 or budget[pool_group] <= 0:
                    continue
                slot = self._obtain_slot(0, pool_group)
                if slot < 0:
                    continue
                previous = page.level
                self._record_move(page, CacheLevel(0), slot)
                self._count_move(page, previous, 0)
                budget[pool_group] -= 1
                moved += 1
        finally:
            for page in reversed(pages):  # refiled last block first: the deepest is evicted first
                self.unclaim(page)
        return moved

    def _count_move(self, page: Page, previous: int, level: int) -> None:
        """Onboarded / offloaded counters and iteration statistics of a placement move (bytes as the colder tier
        stores them)."""
        slot_bytes = self.grouping.page_bytes(max(previous, level), page.life_cycle)
        stats = self.stats[page.life_cycle]
        if level == 0:
            self.counters.onboarded_pages += 1
            self.counters.onboarded_bytes += slot_bytes
            stats.onboarded_pages += 1
            stats.onboarded_bytes += slot_bytes
        elif previous == 0:
            self.counters.offloaded_pages += 1
            self.counters.offloaded_bytes += slot_bytes
            stats.offloaded_pages += 1
            stats.offloaded_bytes += slot_bytes

    def copy_content(self, src: Page, dst: Page) -> None:
        """Copy one page's bytes into another page of the same life cycle (copy-on-write, snapshots)."""
        self._copies.append(SlotCopy(dst, src.pool_group, src.level, src.slot, dst.pool_group, dst.level, dst.slot))
        if src.lost:  # a copy of bytes that never arrived
            self._mark_lost(dst)
        self.counters.copied_pages += 1
        self.stats[src.life_cycle].copied_pages += 1

    def snapshot(self, source: Page) -> Page | None:
        """A copy of ``source`` in a new page: on the GPU if a slot can be had, else the warmest colder tier with
        room; None when no tier has room (the snapshot is then skipped)."""
        for level in range(len(self.tiers)):
            pool_group = self.grouping.group_of[level][source.life_cycle]
            slot = self._obtain_slot(level, pool_group)
            if slot >= 0:
                page = self._page(source.life_cycle, pool_group, CacheLevel(level), slot, source.priority)
                self.stats[source.life_cycle].allocated_pages += 1
                self.copy_content(source, page)
                return page
        return None

    def free(self, page: Page) -> None:
        """Release a page's slot for good (a private page of a closed cache, or a replaced one). The caller has
        let go of it (no lock, hold, claim or block) and keeps no reference: the object becomes a spare. A lost
        page ``refile`` freed already is left alone."""
        if page.level == NO_LEVEL:
            return
        queue = page.queue
        if queue is not None:
            queue.remove(page)
        self.tiers[page.level].pool_groups[page.pool_group].allocator.release(page.slot)
        page.slot = NO_SLOT
        page.level = NO_LEVEL
        page.lost = False
        if len(self.spare_pages) < self.spare_page_limit:
            self.spare_pages.append(page)

    def free_if_unused(self, page: Page) -> None:
        """Free a private page the caller let go of, unless another cache still locks or holds it: a batch admission
        lets requests with a common prefix share its uncomputed pages (``_cache/batch_sharing.py``), and the last
        one to let go frees it."""
        if page.lock_count == 0 and page.hold_count == 0 and page.claim_count == 0:
            self.free(page)

    def drop(self, page: Page) -> None:
        """Drop droppable cached content: the tree detaches it from its block (pruning what empties), then the
        slot is freed."""
        if self.listener is not None:
            self.listener.capture(page)  # before the tree unlinks it: the key is its block's; a lost page is skipped there
        self.tree.detach(page)
        self.free(page)
        self.counters.dropped_pages += 1
        self.stats[page.life_cycle].dropped_pages += 1

    def drop_all_droppable(self) -> None:
        for level_queues in self.queues:
            for queues in level_queues:
                page = queues.droppable.first()
                while page is not None:
                    self.drop(page)
                    page = queues.droppable.first()

    def obtain_cold_page(self, life_cycle: LifeCycleId, priority: int) -> Page | None:
        """A new page in a slot of the coldest tier (made free by eviction if needed), or None: where content
        fetched from the remote tier lands."""
        cold_group = self.grouping.group_of[self.last_level][life_cycle]
        slot = self._obtain_slot(self.last_level, cold_group)
        if slot < 0:
            return None
        return self._page(life_cycle, cold_group, CacheLevel(self.last_level), slot, priority)

    def _page(
        self, life_cycle: LifeCycleId, pool_group: PoolGroupIndex, level: CacheLevel, slot: SlotId, priority: int
    ) -> Page:
        spare = self.spare_pages
        if spare:
            page = spare.pop()
            page.reuse(life_cycle, pool_group, level, slot, priority)
            return page
        return Page(life_cycle, pool_group, level, slot, priority)

    def _obtain_slot(self, level: int, pool_group: int) -> SlotId:
        allocator = self.tiers[level].pool_groups[pool_group].allocator
        slot = allocator.allocate()
        if slot >= 0:
            return slot
        if not self._evict_one(level, pool_group):
            return NO_SLOT
        return allocator.allocate()

    def _evict_one(self, level: int, pool_group: int) -> bool:
        """Make one slot free at ``level``: move the lowest-priority LRU page down, or drop droppable content."""
        queues = self.queues[level][pool_group]
        droppable = queues.droppable.first()
        if level == self.last_level:
            if droppable is None:
                return False
            self.drop(droppable)
            return True
        held = queues.held.first()
        victim = droppable
        if held is not None and (
            victim is None or (held.priority, held.stamp) < (victim.priority, victim.stamp)
        ):
            victim = held
        if victim is None:
            victim = self.waiting.victim(level, pool_group, self.grouping.group_of[level])
            if victim is None:
                return False
        slot = self._obtain_slot(level + 1, self.grouping.group_of[level + 1][victim.life_cycle])
        if slot < 0:
            if droppable is None:
                return False
            self.drop(droppable)
            return True
        self._record_move(victim, CacheLevel(level + 1), slot)
        self.refile(victim)
        if level == 0:
            slot_bytes = self.grouping.page_bytes(1, victim.life_cycle)
            self.counters.offloaded_pages += 1
            self.counters.offloaded_bytes += slot_bytes
            stats = self.stats[victim.life_cycle]
            stats.offloaded_pages += 1
            stats.offloaded_bytes += slot_bytes
        return True

    def _record_move(self, page: Page, level: CacheLevel, slot: SlotId, keep_place: bool = False) -> None:
        """Move a page (a recorded copy); out of its eviction list unless ``keep_place`` (same tier and list)."""
        queue = page.queue
        if queue is not None and not keep_place:
            queue.remove(page)
        pool_group = self.grouping.group_of[level][page.life_cycle]
        self._copies.append(SlotCopy(page, page.pool_group, page.level, page.slot, pool_group, level, slot))
        self.tiers[page.level].pool_groups[page.pool_group].allocator.release(page.slot)
        previous_level = page.level
        page.pool_group = pool_group
        page.level = level
        page.slot = slot
        if previous_level != level and self.events.enabled:
            record_page_event(self.events, UPDATED, page, previous_level)

    # ---------------------------------------------------------------------------------------- quota changes
    def resize_slots(self, level: int, counts: list[int]) -> bool:
        """Give each pool group of ``level`` a new slot count, evicting and compacting as needed.

        Only called while every cache is suspended, so no page is locked. False (nothing changed) when held
        pages would not fit, a count exceeds the pool group's reservation, or the disk cannot back the new slots.
        """
        if not self.can_resize_slots(level, counts):
            return False
        pool_groups = self.tiers[level].pool_groups
        if not self.tiers[level].reserve(counts):
            return False
        for pool_group, count in enumerate(counts):
            allocator = pool_groups[pool_group].allocator
            while allocator.num_used > count:
                if not self._evict_one(level, pool_group):
                    raise OutOfPagesError(f"could not shrink level {level} pool group {pool_group} to {count}")
            self._compact(level, pool_group, count)
            if not allocator.resize(count):
                raise AssertionError(f"slots above {count} still in use at level {level}")
        self.flush()  # the compaction's copies read slots whose disk blocks the trim gives back
        self.tiers[level].trim()
        return True

    def can_resize_slots(self, level: int, counts: list[int]) -> bool:
        """Whether ``resize_slots`` could give ``level`` these counts: each within its reservation, held pages
        fitting (the disk's space aside). Changes nothing."""
        return self.resize_obstacle(level, counts) is None

    def resize_obstacle(self, level: int, counts: list[int]) -> tuple[int, bool] | None:
        """The first pool group of ``level`` that cannot take its count, and whether the count is beyond its
        reservation (else its pages cannot all be evicted or moved to a colder tier); None when all can."""
        for pool_group, count in enumerate(counts):
            storage = self.tiers[level].pool_groups[pool_group]
            if count > storage.max_slots:
                return pool_group, True
            excess = storage.allocator.num_used - count
            if excess > 0 and not self._room_model(pool_group, None, level).vacate(level, excess):
                return pool_group, False
        return None

    def _compact(self, level: int, pool_group: int, count: int) -> None:
        """Move every page in a slot ``>= count`` into a free slot below it (same tier), keeping its place in its
        eviction list: a quota change is no use of a page."""
        allocator = self.tiers[level].pool_groups[pool_group].allocator
        queues = self.queues[level][pool_group]
        movers = [page for page in list(queues.held) + list(queues.droppable) if page.slot >= count]
        for page in movers:
            self._record_move(page, CacheLevel(level), allocator.allocate_below(count), keep_place=True)

    # ---------------------------------------------------------------------------------------------- copies
    def flush(self, stream: int = 0) -> None:
        """Execute the recorded copies (``run_recorded_copies``), settle the pages whose move failed, then send
        what the remote tier captured; fences ``stream`` when pages left its caller's hands since the last flush."""
        if self._unlocked_since_flush:
            self.fence(stream)
        self.run_recorded_copies(stream)
        if self._lost:
            self._settle_lost()
        if self.listener is not None:
            self.listener.send()

    def fence(self, stream: int) -> None:
        """Pages just left the hands of the work queued on ``stream`` (``StreamOrder.release``)."""
        self._unlocked_since_flush = False
        self.stream_order.release(stream)

    def run_recorded_copies(self, stream: int = 0) -> None:
        """Order ``stream`` after the last users of the slots it may touch, then execute the recorded copies on
        it in order, one gather/scatter per run of same-direction copies."""
        order = self.stream_order
        order.acquire(stream)
        copies = self._copies
        if not copies:
            return
        self._copies = []
        with order.copies_on(stream):
            failure = run_slot_copies(self.tiers, copies, self.grouping, self.codec)
        order.release(stream)
        if failure is not None:
            self.last_copy_error = failure.describe()
            self.interrupts.warn(
                logger, "page moves failed (%s): %s lost", self.last_copy_error, counted(len(failure.lost), "page")
            )
            for page in failure.lost:
                self._mark_lost(page)
            for error in failure.errors:
                self.interrupts.defer(error)

    def _mark_lost(self, page: Page) -> None:
        """``page``'s slot never got its bytes: never to be served (``Page.lost``); settled by ``flush``."""
        if not page.lost:
            page.lost = True
            self._lost.append(page)
            self.counters.lost_pages += 1

    def _settle_lost(self) -> None:
        """A failed move degrades to a miss: a lost page nobody uses is dropped; one a cache uses leaves the tree
        (no match finds it again) and is freed when its last user lets go (``refile``); that cache cannot resume
        (``PageContentLostError``)."""
        lost, self._lost = self._lost, []
        for page in lost:
            if not page.lost:  # freed meanwhile
                continue
            if page.block is not None and page.lock_count == 0 and page.hold_count == 0 and page.claim_count == 0:
                self.drop(page)
            elif page.block is not None:
                self.tree.detach(page)
                self.refile(page)

    def copy_from(self, source: PageStore, pool_group: int, src_slots: list[int], dst_slots: list[int], stream: int) -> None:
        """Copy GPU slots of another manager's store into ours on ``stream`` (a local KV handoff): both stores'
        recorded copies run first, ``stream`` waits for both sides' fences, and is fenced on both afterwards."""
        source.flush(stream)
        self.flush(stream)
        source.stream_order.acquire(stream)
        order = self.stream_order
        src = source.tiers[0].pool_groups[pool_group]
        dst = self.tiers[0].pool_groups[pool_group]
        with order.copies_on(stream):
            copy_pool_group_slots(dst, dst_slots, src, src_slots)
        order.release(stream)
        source.stream_order.release(stream)
