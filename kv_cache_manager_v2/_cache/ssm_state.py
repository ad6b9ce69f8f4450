"""``SsmState``: one cache's pages of the SSM layer group.

No per-block pages: one private live state page (allocated on first resume) and the snapshot a prefix match starts
from (held until that resume copies it into the live page). Commits on the reuse interval give a tree block a
snapshot of the live state. Its page table reads ``BAD_PAGE_INDEX`` everywhere (kernels find the live state
through ``get_ssm_block_base_index``).
"""

from __future__ import annotations

from array import array

from .._base.types import BAD_PAGE_INDEX, PoolGroupIndex
from .._model.layout import StorageLayout
from .._model.life_cycle import LifeCycle
from .._observe.events import IterationStats
from .._pages.page import Block, Page
from .._pages.page_store import PageStore
from .._pages.prefix_match import Match
from .._pages.radix_tree import RadixTree
from .group_state import GroupState


class SsmState(GroupState):
    """The live state page and the snapshot source of one cache's SSM layer group."""

    def __init__(self, life_cycle: LifeCycle, pool_group: PoolGroupIndex, store: PageStore, layout: StorageLayout) -> None:
        super().__init__(life_cycle, pool_group, store, layout)
        # The cache's live state (None until the first resume).
        self.live: Page | None = None
        # The held snapshot a prefix match starts from, until the first resume copies it.
        self.source: Page | None = None

    def adopt(self, blocks: list[Block], match: Match) -> None:
        """Hold the snapshot at the end of the match (the only page of this group the next step reads): on the last
        matched block, or on the partial block the match ends with (its snapshot ends exactly there)."""
        length = match.length
        if length > 0:
            tpb = self.life_cycle.tokens_per_block
            ending = match.snapshot_source if length % tpb else blocks[length // tpb - 1]
            assert ending is not None, "a match ending inside a block has a snapshot source"
            snapshot = ending.pages[self.id]
            assert snapshot is not None, "match pruning guarantees a snapshot at the match end"
            self.store.hold(snapshot)
            self.source = snapshot

    def count_reuse(self, stats: IterationStats, missed: int) -> None:
        stats.missed_blocks += missed
        if self.source is not None:
            stats.reused_full_blocks += 1

    def resume_need(self) -> int:
        """The live state, until it exists."""
        return 1 if self.live is None else 0

    def wants_live_state(self) -> bool:
        return self.live is None

    def start_live_state(self, priority: int) -> None:
        """First resume: allocate the live state and copy the matched snapshot into it."""
        store = self.store
        live = self.live
        if live is None:
            live = store.new_page(self.id, self.pool_group, priority)
            self.live = live
        source = self.source
        if source is not None:
            store.copy_content(source, live)
            store.unhold(source)
            self.source = None

    def release_snapshot_source(self) -> None:
        if self.source is not None:
            self.store.unhold(self.source)
            self.source = None

    def release_live_state(self) -> None:
        live = self.live
        if live is not None:
            self.store.unhold(live)
            self.store.free(live)
            self.live = None

    def hand_over_live_state(self, block: Block, tree: RadixTree) -> None:
        """Closing: the live state becomes ``block``'s snapshot itself (unless it has one), no copy, since the cache
        is about to let it go; ``release_live_state`` then has nothing left to free."""
        live = self.live
        if live is None or block.pages[self.id] is not None:
            return
        tree.attach(block, live)
        self.live = None
        self.store.unhold(live)

    def snapshot_into(self, block: Block, tree: RadixTree) -> None:
        """Give ``block`` a snapshot of the live state (unless it has one)."""
        live = self.live
        if live is None or block.pages[self.id] is not None:
            return
        snapshot = self.store.snapshot(live)
        if snapshot is not None:
            tree.attach(block, snapshot)
            self.store.refile(snapshot)

    # --------------------------------------------------------------------------------------- page table
    def page_indices(self, num_blocks: int) -> array[int]:
        return array("i", [BAD_PAGE_INDEX]) * num_blocks

    def write_buffer(self, begin: int, end: int) -> None:
        buffer = self.user_buffer
        if buffer is None:
            return
        for ordinal in range(begin, min(end, len(buffer))):
            buffer[ordinal] = BAD_PAGE_INDEX

    # --------------------------------------------------------------------------------------- handoff (disagg)
    def cached_tokens(self, reused: int, prompt_len: int) -> int:
        """A reused prefix ends on a snapshot that resume copied into the live state; it is the state after the
        prompt only when the reuse is the whole prompt (block-aligned, or a snapshot saved inside its last block)."""
        if reused == prompt_len:
            return prompt_len
        return 0

    @property
    def sends_blocks(self) -> bool:
        return False

    def handoff_page(self, ordinal: int) -> Page | None:
        return self.live

    def committed_entry_at(self, ordinal: int) -> bool:
        return False
