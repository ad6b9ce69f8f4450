"""``AttentionState``: one cache's pages of one attention layer group (full attention or a sliding window).

It keeps one entry per block ordinal (the page the cache uses: private until committed, then the tree block's
page) and its GPU index table; a partially reused last block's copy-on-write source; and, for a window, the
release of blocks that leave it and the prefill chunk's scratch slots. The cache (``CacheState``) keeps the
lengths and calls these in layer-group order; every loop here keeps the order in which pages are held, freed and
refiled.
"""

from __future__ import annotations

from array import array

from .._base.types import BAD_PAGE_INDEX, GPU_LEVEL, PoolGroupIndex
from .._model.layout import StorageLayout
from .._model.life_cycle import LifeCycle, ceil_div, outside
from .._observe.events import IterationStats
from .._pages.page import Block, Page
from .._pages.page_store import PageStore
from .._pages.partial_siblings import leave_tree, offer_page
from .._pages.prefix_match import Match
from .._pages.radix_tree import RadixTree
from .group_state import GroupState

# A page a step gives up reversibly: (its group, block ordinal, page).
Released = tuple["AttentionState", int, Page]


class AttentionState(GroupState):
    """Full attention's pages; ``WindowedAttentionState`` adds the stale range's release and scratch slots."""

    def __init__(
        self, life_cycle: LifeCycle, pool_group: PoolGroupIndex, store: PageStore, layout: StorageLayout, num_blocks: int
    ) -> None:
        super().__init__(life_cycle, pool_group, store, layout)
        self.entries: list[Page | None] = [None] * num_blocks
        self.indices: array[int] = array("i", [BAD_PAGE_INDEX]) * num_blocks
        # The held source page of a partially reused last block (copied on first resume).
        self.cow_source: Page | None = None
        # SWA prefill scratch: the scratch block range and the slots that hold it (empty unless windowed).
        self.scratch_range: tuple[int, int] = (0, 0)
        self.scratch_pages: list[Page] = []

    # --------------------------------------------------------------------------------------- opening
    def adopt(self, blocks: list[Block], match: Match) -> None:
        """Take the matched pages the step at the match's length reads as entries, and a copy-on-write source (the
        cache then holds them all: ``hold_adopted``)."""
        lc = self.id
        length = match.length
        partial_source = match.partial_source
        for ordinals in outside(self.life_cycle.stale(length), len(self.entries)):
            for ordinal in ordinals:
                if ordinal < len(blocks):
                    page = blocks[ordinal].pages[lc]
                    assert page is not None, "match pruning guarantees every needed block has a page"
                    self.entries[ordinal] = page
                else:
                    assert partial_source is not None
                    source_page = partial_source.pages[lc]
                    assert source_page is not None
                    self.cow_source = source_page

    def count_reuse(self, stats: IterationStats, missed: int) -> None:
        stats.reused_full_blocks += len(self.entries) - self.entries.count(None)  # in C: a window's table is long
        stats.missed_blocks += missed
        if self.cow_source is not None:
            stats.reused_partial_blocks += 1

    # --------------------------------------------------------------------------------------- stale blocks
    def is_stale(self, ordinal: int, history: int) -> bool:
        stale_beg, stale_end = self.life_cycle.stale(history)
        return stale_beg <= ordinal < stale_end

    def release_newly_stale(self, old_history: int, new_history: int, num_blocks: int, released: list[Released]) -> None:
        """Unlock entries entering the stale range (only a window has one); reversible until committed."""

    def forget(self, ordinal: int, page: Page, history: int) -> None:
        """Drop an entry beyond a shrunk capacity: always a private page, held when stale, else locked."""
        store = self.store
        self.entries[ordinal] = None
        if self.is_stale(ordinal, history):
            store.unhold(page)
        else:
            store.unlock(page)
        store.free_if_unused(page)

    def drop_uncommitted_stale(self, history: int, num_committed_blocks: int) -> None:
        """Committing stopped: free the held stale pages that can no longer be committed."""
        stale_beg, stale_end = self.life_cycle.stale(history)
        store = self.store
        for ordinal in range(max(stale_beg, num_committed_blocks), stale_end):
            page = self.entries[ordinal]
            if page is not None:
                self.entries[ordinal] = None
                store.unhold(page)
                store.free(page)

    # --------------------------------------------------------------------------------------- lock sets
    # --------------------------------------------------------------------------------------- resume
    def resume_need(self) -> int:
        """The copy-on-write copy and the scratch slots."""
        need = self.scratch_slot_count(self.scratch_range)
        if self.cow_source is not None:
            need += 1
        return need

    def resolve_cow(self, ordinal: int, priority: int) -> None:
        """Copy the partially reused source block into a private page at ``ordinal``; a source the resume claimed
        (``PageStore.waiting``) is filed once copied, so its slot can make room for the next page."""
        source = self.cow_source
        if source is None:
            return
        store = self.store
        claimed = store.waiting.reach(source)
        page = store.new_page(self.id, self.pool_group, priority)
        store.copy_content(source, page)
        store.unhold(source)
        if claimed:
            store.waiting.first += 1  # copied: no longer waiting
            store.unclaim(source)
        if source.block is None:
            store.free_if_unused(source)  # gave way to a wider page while we held it
        self.entries[ordinal] = page
        self.cow_source = None

    def release_cow_source(self) -> None:
        source = self.cow_source
        if source is not None:
            self.store.unhold(source)
            if source.block is None:
                self.store.free_if_unused(source)  # gave way to a wider page while we held it
            self.cow_source = None

    # --------------------------------------------------------------------------------------- scratch
    def target_scratch(self, history: int, capacity: int, max_rewind_len: int, enabled: bool) -> tuple[int, int]:
        """The scratch range a chunk ``[history, capacity)`` gets (only a window has one)."""
        return 0, 0

    def scratch_slot_count(self, scratch: tuple[int, int]) -> int:
        return self.layout.scratch_slots(self.id, scratch[1] - scratch[0])

    def extra_scratch_slots(self, scratch: tuple[int, int], enabled: bool) -> int:
        """Scratch slots a resize to ``scratch`` must add (0 when it keeps or shrinks them)."""
        if not enabled and not self.scratch_pages:
            return 0
        return self.scratch_slot_count(scratch) - len(self.scratch_pages)

    def set_scratch(self, scratch: tuple[int, int], priority: int) -> None:
        """Adopt a new scratch range, growing or shrinking its slot list (room was checked; new slots get
        ``priority``)."""
        self.scratch_range = scratch
        self.fill_scratch_slots(priority)

    def fill_scratch_slots(self, priority: int) -> None:
        wanted = self.scratch_slot_count(self.scratch_range)
        self.trim_scratch_slots(wanted)
        pages = self.scratch_pages
        while len(pages) < wanted:
            pages.append(self.store.new_page(self.id, self.pool_group, priority))

    def trim_scratch_slots(self, wanted: int) -> None:
        """Free the scratch slots beyond ``wanted``: a resize does it before taking new pages, whose room
        counted them (``ResizePlan.let_go``)."""
        store = self.store
        pages = self.scratch_pages
        while len(pages) > wanted:
            page = pages.pop()
            store.unlock(page)
            store.free(page)

    def free_scratch_slots(self) -> None:
        store = self.store
        for page in self.scratch_pages:
            store.unlock(page)
            store.free(page)
        self.scratch_pages.clear()

    # --------------------------------------------------------------------------------------- resize
    def plan_forgotten(self, old_blocks: int, new_blocks: int, scratch: tuple[int, int], out: list[Released]) -> int:
        """Entries a resize drops: beyond the new capacity, or inside the new scratch range. Returns how many of
        them leave their GPU slot to the step's new pages (nobody else uses them: freed, or a tree block's page
        left droppable), which ``forget`` does before the step takes any."""
        entries = self.entries
        let_go = 0
        for ordinals in (range(new_blocks, old_blocks), range(scratch[0], min(scratch[1], old_blocks, new_blocks))):
            for ordinal in ordinals:
                page = entries[ordinal]
                if page is not None:
                    out.append((self, ordinal, page))
                    if page.lock_count == 1 and page.hold_count == 0 and page.claim_count == 0:
                        let_go += 1
        return let_go

    def plan_wanted(
        self, old_blocks: int, new_blocks: int, history: int, scratch: tuple[int, int], wanted: list[tuple[AttentionState, int]]
    ) -> int:
        """Append the blocks a resize gives new pages to ``wanted``; returns how many."""
        entries = self.entries
        stale_beg, stale_end = self.life_cycle.stale(history)
        scratch_beg, scratch_end = scratch
        old_scratch_beg, old_scratch_end = self.scratch_range
        ordinal = old_blocks if old_scratch_end <= old_scratch_beg else min(old_blocks, old_scratch_beg)
        count = 0
        while ordinal < new_blocks:  # jumps over stale and scratch runs: their length is unbounded
            if stale_beg <= ordinal < stale_end:
                ordinal = stale_end
            elif scratch_beg <= ordinal < scratch_end:
                ordinal = scratch_end
            else:
                if ordinal >= old_blocks or entries[ordinal] is None:
                    wanted.append((self, ordinal))
                    count += 1
                ordinal += 1
        return count

    def resize_tables(self, new_blocks: int, scratch: tuple[int, int]) -> None:
        """Entries and indices to ``new_blocks`` (the registered buffer follows); scratch blocks get no index."""
        entries = self.entries
        del entries[new_blocks:]
        entries.extend([None] * (new_blocks - len(entries)))
        indices = self.indices
        old_blocks = len(indices)
        del indices[new_blocks:]
        indices.extend(array("i", [BAD_PAGE_INDEX]) * (new_blocks - old_blocks))
        if self.user_buffer is not None and old_blocks != new_blocks:
            self.write_buffer(min(old_blocks, new_blocks), max(old_blocks, new_blocks))
        for ordinal in range(scratch[0], min(scratch[1], new_blocks)):
            self.set_index(ordinal, BAD_PAGE_INDEX)

    # --------------------------------------------------------------------------------------- commit
    def commit_entry(self, block: Block, ordinal: int, stale_range: tuple[int, int], tree: RadixTree) -> None:
        """Block ``ordinal`` was committed as ``block``: our page becomes its content, or we rebase onto the page
        an identical block already has on the GPU (one off the GPU leaves the tree for ours); a stale entry (inside ``stale_range``, ours at the history) leaves the
        cache either way."""
        page = self.entries[ordinal]
        if page is None:
            return
        store = self.store
        tree_page = block.pages[self.id]
        stale = stale_range[0] <= ordinal < stale_range[1]
        if tree_page is page or (tree_page is None and page.block is not None):
            # A page shared in a batch admission that another cache committed already (here, or, if it committed
            # other tokens there, elsewhere: the block stays without a page).
            if stale:
                self.entries[ordinal] = None
                store.unhold(page)
            return
        if tree_page is None or (page.block is None and (tree_page.num_tokens < len(block.tokens) or tree_page.level != GPU_LEVEL)):
            if tree_page is not None:
                # A shorter sibling's page, moved in (ours covers the whole block), or a copy off the GPU: ours
                # holds the same tokens where the cache reads them, so no copy brings the other one back (a copy
                # that could fail with a disk or codec fault and leave this active cache a page without bytes).
                leave_tree(store, tree_page)
            tree.attach(block, page)
            if stale:
                self.entries[ordinal] = None
                store.unhold(page)
            return
        if stale:
            self.entries[ordinal] = None
            store.unhold(page)
            store.free(page)
            return
        store.unlock(page)
        store.free_if_unused(page)
        store.lock(tree_page)
        store.onboard(tree_page)
        self.entries[ordinal] = tree_page
        self.set_index(ordinal, tree_page.slot)

    def release_entry(self, ordinal: int, partial: Block | None, partial_ordinal: int, partial_tokens: int) -> None:
        """Closing (``release_entries``): unhold entry ``ordinal`` (freeing a private one); with ``partial``, the
        uncommitted entry at ``partial_ordinal`` becomes that block's content instead, holding its first
        ``partial_tokens`` tokens (the trailing partial block, or a sibling extending it: kept there only if it
        covers more than the page there)."""
        entry = self.entries[ordinal] if ordinal < len(self.entries) else None
        if entry is None:
            return
        store = self.store
        if (
            partial is not None
            and ordinal == partial_ordinal
            and entry.block is None
            and entry.hold_count + entry.lock_count == 1  # not a page another cache still fills
            and offer_page(store, partial, entry, partial_tokens)
        ):
            store.unhold(entry)
            return
        store.unhold(entry)
        if entry.block is None:
            store.free_if_unused(entry)

    def copy_tail_into(self, partial: Block, ordinal: int, tree: RadixTree) -> None:
        """Committing stopped inside block ``ordinal`` while the cache lives on: ``partial`` (the trailing partial
        tree block) gets a copy of our page of it, unless it has a page or ours is gone (stale, scratch); skipped
        when no tier has room. Our page stays ours: later tokens may still be written into it."""
        entries = self.entries
        entry = entries[ordinal] if ordinal < len(entries) else None
        if entry is None or entry.block is not None or partial.pages[self.id] is not None:
            return
        copy = self.store.snapshot(entry)
        if copy is not None:
            tree.attach(partial, copy)
            self.store.refile(copy)

    def publish_partial(self, block: Block, ordinal: int, num_tokens: int) -> None:
        """Committing stopped: our page of the trailing partial block ``ordinal`` becomes ``block``'s content for
        its first ``num_tokens`` tokens, unless the page there covers as many. We keep using it: the rows past the
        committed tokens may still be written, never those before them."""
        page = self.entries[ordinal] if ordinal < len(self.entries) else None
        if page is not None and page.block is None and page.hold_count + page.lock_count == 1:
            offer_page(self.store, block, page, num_tokens)

    def share_entry(self, ordinal: int, page: Page) -> None:
        """Batch admission: hold another cache's private page of block ``ordinal`` as ours (a common prefix that
        the earlier request of the batch computes); a partially reused source at that block is no longer needed."""
        if ordinal >= len(self.entries):
            self.resize_tables(ordinal + 1, (0, 0))
        if self.cow_source is not None:
            self.release_cow_source()
        self.store.hold(page)
        self.entries[ordinal] = page

    # --------------------------------------------------------------------------------------- index table
    def page_indices(self, num_blocks: int) -> array[int]:
        return self.indices[:]  # a copy: a slice copies the buffer at once

    def set_index(self, ordinal: int, value: int) -> None:
        self.indices[ordinal] = value
        buffer = self.user_buffer
        if buffer is not None:
            buffer[ordinal] = value

    def write_buffer(self, begin: int, end: int) -> None:
        buffer = self.user_buffer
        if buffer is None:
            return
        indices = self.indices
        end = min(end, len(buffer))
        if end <= begin:
            return
        split = min(end, max(begin, len(indices)))  # slice copies, in C: a buffer is as long as the block table
        buffer[begin:split] = indices[begin:split]
        buffer[split:end] = array("i", [BAD_PAGE_INDEX]) * (end - split)

    def rebuild_indices(self, history: int) -> None:
        indices = self.indices
        entries = self.entries
        runs = outside(self.life_cycle.stale(history), len(entries))
        stale_beg, stale_end = runs[0].stop, runs[1].start
        indices[stale_beg:stale_end] = array("i", [BAD_PAGE_INDEX]) * (stale_end - stale_beg)
        for ordinals in runs:
            for ordinal in ordinals:
                page = entries[ordinal]
                indices[ordinal] = page.slot if page is not None else BAD_PAGE_INDEX
        buffer = self.user_buffer
        if buffer is not None:
            buffer[: len(indices)] = indices

    def clear_indices(self) -> None:
        self.indices = array("i", [BAD_PAGE_INDEX]) * len(self.indices)
        self.write_buffer(0, len(self.indices))

    # --------------------------------------------------------------------------------------- handoff (disagg)
    def cached_tokens(self, reused: int, prompt_len: int) -> int:
        """The first block the receiver lacks that the decode step at ``prompt_len`` reads, in tokens."""
        if reused == prompt_len:  # the whole prompt, its last block's rows too when the reuse ends inside it
            return prompt_len
        tpb = self.life_cycle.tokens_per_block
        first = reused // tpb  # the receiver holds every needed block below its reused prefix (block aligned)
        stale_beg, stale_end = self.life_cycle.stale(prompt_len)
        if stale_beg <= first < stale_end:
            first = stale_end  # skip the gap of blocks nobody needs: only in-window blocks are requested
        return prompt_len if first >= ceil_div(prompt_len, tpb) else first * tpb

    @property
    def sends_blocks(self) -> bool:
        return True

    def handoff_page(self, ordinal: int) -> Page | None:
        entries = self.entries
        return entries[ordinal] if 0 <= ordinal < len(entries) else None


class FullAttentionState(AttentionState):
    """Full attention: every block of the capacity has a page; nothing is ever stale."""


class WindowedAttentionState(AttentionState):
    """Sliding window (with sink blocks): blocks that fall out of the window release their pages, and with
    scratch reuse a prefill chunk's out-of-window blocks share scratch slots."""

    def release_newly_stale(self, old_history: int, new_history: int, num_blocks: int, released: list[Released]) -> None:
        """Committed entries are then dropped from the cache (kept in the tree, evictable), uncommitted ones held."""
        store = self.store
        life_cycle = self.life_cycle
        _, old_end = life_cycle.stale(old_history)
        new_beg, new_end = life_cycle.stale(new_history)
        for ordinal in range(max(old_end, new_beg), min(new_end, num_blocks)):
            page = self.entries[ordinal]
            if page is None:
                continue
            released.append((self, ordinal, page))
            store.hold(page)
            store.unlock(page)
            self.set_index(ordinal, BAD_PAGE_INDEX)

    def target_scratch(self, history: int, capacity: int, max_rewind_len: int, enabled: bool) -> tuple[int, int]:
        if not enabled:
            return 0, 0
        begin, end = self.life_cycle.scratch(history, capacity, max_rewind_len)
        return (begin, end) if end > begin else (0, 0)


def block_runs(groups: list[AttentionState], history: int, stale_too: bool) -> list[tuple[int, int]]:
    """The runs of block ordinals that ``entries_by_block`` and ``release_entries`` visit, in order: every block but
    those stale at ``history`` in every group, where a long window's table is empty (it may be
    ``MAX_BLOCKS_PER_CACHE`` long: a Python loop took ~1 us a block); ``stale_too``: those too when a group holds
    a page there (one not committed yet: ``list.count`` tells, in C)."""
    num_blocks = max((len(group.entries) for group in groups), default=0)
    gap_beg, gap_end = 0, num_blocks
    for group in groups:
        stale_beg, stale_end = group.life_cycle.stale(history)
        gap_beg, gap_end = max(gap_beg, stale_beg), min(gap_end, stale_end)
    if gap_end <= gap_beg:
        return [(0, num_blocks)]
    if stale_too:
        for group in groups:
            entries = group.entries
            beg, end = min(gap_beg, len(entries)), min(gap_end, len(entries))
            if entries.count(None) - entries[:beg].count(None) - entries[end:].count(None) != end - beg:
                return [(0, num_blocks)]
    return [(0, gap_beg), (gap_end, num_blocks)]


def entries_by_block(groups: list[AttentionState], history: int, stale_too: bool = False) -> list[Page]:
    """The groups' entries in block order, every group's page of a block together (in group order), but those
    inside each group's stale range at ``history`` unless ``stale_too``. Reversed, this is the order a cache files
    the pages it lets go of together (held at creation, suspend, close, placement hints): eviction, least recently
    filed first, then takes every group's page of the last block before any page of an earlier block and shortens
    the cached prefix of all groups alike (full attention reuses nothing past a block without a page, so the other
    groups' pages of later blocks would be kept for nothing)."""
    result: list[Page] = []
    ranges = [(0, 0) if stale_too else group.life_cycle.stale(history) for group in groups]
    for begin, end in block_runs(groups, history, stale_too):
        for ordinal in range(begin, end):
            for group, (stale_beg, stale_end) in zip(groups, ranges):
                page = group.entries[ordinal] if ordinal < len(group.entries) else None
                if page is not None and not stale_beg <= ordinal < stale_end:
                    result.append(page)
    return result


def leaves_when_stale(page: Page, ordinal: int, num_committed_blocks: int, keep_uncommitted: bool) -> bool:
    """Whether a page a step made stale leaves the cache with the step instead of staying held until its block is
    committed: a tree block's page (kept in the tree, evictable), a page of a block committed already that is no
    tree block's (another cache's copy took its place: it can never be committed), or any page once uncommitted
    ones are not kept (committing stopped, or a resize with ``commit_min_snapshot``: what the tree gets is the
    state the commits leave, nothing out of their window)."""
    return page.block is not None or ordinal < num_committed_blocks or not keep_uncommitted


def room_released(
    released: list[Released], num_committed_blocks: int, keep_uncommitted: bool, let_go: list[int], num_levels: int
) -> list[list[int]]:
    """The GPU room the pages a step made stale give it when they leave the cache (``leaves_when_stale``, and
    nobody else uses them: freed, or left droppable), added to ``let_go`` per pool group. They are held until the
    step applies, so the same counts per pool group and level are returned as ``pinned`` for ``PageStore.fits``:
    held pages that must not count again as movable to a colder tier."""
    pinned = [[0] * num_levels for _ in let_go]
    for group, ordinal, page in released:
        alone = page.hold_count == 1 and page.lock_count == 0 and page.claim_count == 0 and page.level == GPU_LEVEL
        if alone and leaves_when_stale(page, ordinal, num_committed_blocks, keep_uncommitted):
            let_go[group.pool_group] += 1
            pinned[group.pool_group][GPU_LEVEL] += 1
    return pinned


def hold_adopted(store: PageStore, groups: list[AttentionState], history: int) -> None:
    """A new cache holds what ``adopt`` took in the reverse of ``entries_by_block``, the copy-on-write sources first
    (the partially reused block is the deepest): eviction then takes the deepest block first in every group."""
    for group in reversed(groups):
        if group.cow_source is not None:
            store.hold(group.cow_source)
    for page in reversed(entries_by_block(groups, history, stale_too=True)):
        store.hold(page)


def release_entries(
    groups: list[AttentionState], history: int, partial: Block | None, partial_ordinal: int, partial_tokens: int
) -> None:
    """Closing: ``release_entry`` of every group's every entry, in the reverse of ``entries_by_block`` (the deepest
    block first, every group's page of it together), then the groups hold no entries."""
    for begin, end in reversed(block_runs(groups, history, True)):
        for ordinal in range(end - 1, begin - 1, -1):
            for group in reversed(groups):
                group.release_entry(ordinal, partial, partial_ordinal, partial_tokens)
    for group in groups:
        group.entries = []
