"""``GroupState``: what every kind of a cache's layer-group state answers, whatever it keeps.

A cache keeps one state per layer group: ``AttentionState`` (``attention_state.py``: one page per block, the index
table, copy-on-write and scratch slots) or ``SsmState`` (``ssm_state.py``: one live state page and the snapshot a
match starts from). The cache calls each kind's own steps on its own list of states (``CacheView.attention``,
``CacheView.ssm``); this base holds only what the cache, the read side and the handoff ask of every group.
"""

from __future__ import annotations

from array import array

from .._base.types import BAD_PAGE_INDEX, LifeCycleId, PoolGroupIndex
from .._model.layout import StorageLayout
from .._model.life_cycle import LifeCycle
from .._observe.events import IterationStats
from .._pages.page import Block, Page
from .._pages.page_store import PageStore
from .._pages.prefix_match import Match


class GroupState:
    """One cache's pages of one layer group, as every kind answers for them."""

    def __init__(self, life_cycle: LifeCycle, pool_group: PoolGroupIndex, store: PageStore, layout: StorageLayout) -> None:
        self.life_cycle = life_cycle
        self.id: LifeCycleId = life_cycle.id
        self.pool_group = pool_group
        self.store = store
        self.layout = layout
        # The engine's registered copy of this group's page table (``set_base_page_index_buf``), if any.
        self.user_buffer: memoryview | None = None

    def adopt(self, blocks: list[Block], match: Match) -> None:
        """Hold what a new cache's matched prefix gives this group (``blocks``: the cache's copy of its full blocks)."""
        raise NotImplementedError

    def count_reuse(self, stats: IterationStats, missed: int) -> None:
        """Add the reused blocks (and ``missed``) of a new cache to the iteration statistics."""
        raise NotImplementedError

    def resume_need(self) -> int:
        """New GPU pages a resume allocates for this group."""
        raise NotImplementedError

    def page_indices(self, num_blocks: int) -> array[int]:
        """A copy of the page table of a cache spanning ``num_blocks`` blocks (``BAD_PAGE_INDEX`` where none)."""
        raise NotImplementedError

    def write_buffer(self, begin: int, end: int) -> None:
        """Copy ``[begin, end)`` of the page table into the registered buffer, -1 past the last block."""
        raise NotImplementedError

    def clear_buffer(self) -> None:
        """Closing: the registered buffer reads -1 everywhere and is let go."""
        buffer = self.user_buffer
        if buffer is not None:
            buffer[:] = array("i", [BAD_PAGE_INDEX]) * len(buffer)
        self.user_buffer = None

    # --------------------------------------------------------------------------------------- handoff (disagg)
    def cached_tokens(self, reused: int, prompt_len: int) -> int:
        """A handoff receiver's count for this group, given its reused prefix of ``reused`` tokens (``prompt_len``
        when it needs nothing sent)."""
        raise NotImplementedError

    @property
    def sends_blocks(self) -> bool:
        """Whether a handoff moves this group's blocks (attention) rather than one live state (SSM)."""
        raise NotImplementedError

    def handoff_page(self, ordinal: int) -> Page | None:
        """The page a handoff reads or writes for block ``ordinal`` here (SSM: the live state, whatever the
        ordinal); None where there is none. A local plan keeps it with its generation (``disagg.execute``)."""
        raise NotImplementedError

    def committed_entry_at(self, ordinal: int) -> bool:
        """Whether block ``ordinal``'s page here is a committed tree page (a handoff must not overwrite it)."""
        page = self.handoff_page(ordinal)
        return page is not None and page.block is not None
