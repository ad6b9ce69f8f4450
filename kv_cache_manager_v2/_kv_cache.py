"""``KVCache``: one request's view of the cache (``_KVCache`` is its earlier name, kept as an alias).

Lengths: ``num_committed_tokens <= history_length <= capacity``. Per life cycle the cache keeps one entry per
block ordinal: the page it uses (a private page until its block is committed, then the radix-tree block's page)
or None (stale, or not yet allocated). While ACTIVE every entry outside the stale range is locked on the GPU;
stale entries are private pages kept held until their block is committed. While SUSPENDED every entry is held.
"""

from __future__ import annotations

import enum
from array import array
from typing import ClassVar, Final, SupportsIndex

from ._hashing import ReuseScope, Token, TokenSequence, check_tokens
from ._life_cycle import ceil_div
from ._page import Page
from ._page_store import LruOrder, PageStore
from ._radix_tree import Block
from ._services import CacheServices, Match, PriorityCallback
from ._addressing import ScratchDesc
from ._types import (
    BAD_PAGE_INDEX,
    DEFAULT_BEAM_INDEX,
    DEFAULT_PRIORITY,
    CudaStream,
    HalfOpenRange,
    OutOfPagesError,
    PageIndexMode,
)
from ._validation import as_index, as_int


class KVCacheStatus(enum.Enum):
    """ACTIVE: pages locked on the GPU, usable by kernels. SUSPENDED: pages held, free to move to colder tiers.
    CLOSED: everything released."""

    ACTIVE = 0
    SUSPENDED = 1
    CLOSED = 2


# Most blocks one cache may span. Its per-block tables grow with the capacity even where a sliding window keeps
# the pages few, so a larger capacity is a memory shortage (resize returns False) found by arithmetic alone.
MAX_BLOCKS_PER_CACHE: Final = 1 << 24


class ResizePlan:
    """A resize worked out before any change: entries to drop, blocks to give pages, slots needed, and the
    priorities of the new pages (the user's callback runs here, so a failing one changes nothing)."""

    def __init__(self, capacity: int, history: int, num_blocks: int, num_pool_groups: int) -> None:
        self.capacity = capacity
        self.history = history
        self.num_blocks = num_blocks
        self.refused = num_blocks > MAX_BLOCKS_PER_CACHE
        self.scratch: list[tuple[int, int]] = []
        self.scratch_priority: list[int] = []  # of new scratch slots, per life cycle
        self.forgotten: list[tuple[int, int, Page]] = []
        self.wanted: list[tuple[int, int]] = []
        self.priorities: list[int] = []  # of ``wanted``; empty without a priority callback (default priority)
        self.need = [0] * num_pool_groups


class ResumePriorities:
    """Priorities of the pages a resume creates (copy-on-write copies, scratch slots, live SSM states), asked of
    the user's callback before anything changes."""

    def __init__(self, cow: list[int], scratch: list[int], ssm: list[int]) -> None:
        self.cow = cow
        self.scratch = scratch
        self.ssm = ssm


class AdmissionPlan:
    """A batch admission of one cache, worked out (callbacks included) before any request of the batch is
    admitted."""

    def __init__(self, growth: ResizePlan, priorities: ResumePriorities) -> None:
        self.growth = growth
        self.priorities = priorities


def open_cache(
    services: CacheServices,
    scope: ReuseScope | None,
    tokens: list[Token],
    cache_id: int,
    priority_callback: PriorityCallback | None,
    order: LruOrder | None = None,
) -> KVCache:
    """A suspended cache holding the longest reusable prefix of ``tokens``; ``order`` first remembers where the
    matched pages stand in their eviction lists (a batch admission may have to put them back)."""
    services.next_cache_id = cache_id + 1
    if services.remote is not None:
        services.remote.fetch_prefix(scope, tokens, services.match(scope, tokens).length)
    match = services.match(scope, tokens)
    if match.root is None:
        match.root = services.tree.root(scope)
    if order is not None:
        sources = list(match.blocks)
        if match.partial_source is not None:
            sources.append(match.partial_source)
        for block in sources:
            for page in block.pages:
                if page is not None:
                    order.remember(page)
    return KVCache(services, match, tokens, cache_id, priority_callback)


class KVCache:
    """One request's KV cache, made by ``KVCacheManager.create_kv_cache``: its blocks' pages in every layer group.

    It starts SUSPENDED; ``resume`` locks its pages on the GPU, ``resize`` sets how many tokens it can hold
    (``capacity``) and how many of them are history, ``commit`` makes finished tokens reusable by later requests,
    ``suspend`` lets its pages move to colder tiers, ``close`` ends it. Lengths always satisfy
    ``num_committed_tokens <= history_length <= capacity``.
    """

    Status: ClassVar[type[KVCacheStatus]] = KVCacheStatus

    def __init__(
        self,
        services: CacheServices,
        match: Match,
        tokens: list[Token],
        cache_id: int,
        priority_callback: PriorityCallback | None,
    ) -> None:
        self._services = services
        self.id = cache_id
        self._status = KVCacheStatus.SUSPENDED
        self._priority_callback = priority_callback
        self._cuda_stream = CudaStream(0)
        tpb = services.tokens_per_block
        length = match.length
        self._capacity = length
        self._history = length
        self._committed = length
        self._committing_stopped = False
        self._root: Block = services.tree.root(None) if match.root is None else match.root
        self._blocks: list[Block] = list(match.blocks)
        self._tail: list[Token] = tokens[len(self._blocks) * tpb : length]
        num_blocks = ceil_div(length, tpb)
        num_life_cycles = len(services.life_cycles)
        self._pages: list[list[Page | None]] = [[None] * num_blocks for _ in range(num_life_cycles)]
        self._indices: list[array[int]] = [array("i", [BAD_PAGE_INDEX]) * num_blocks for _ in range(num_life_cycles)]
        self._user_buffers: list[memoryview | None] = [None] * num_life_cycles
        # Copy-on-write sources of a partially reused last block: (life cycle, held source page).
        self._cow_sources: list[tuple[int, Page]] = []
        # SWA prefill scratch: per life cycle the scratch block range and the slots that hold it.
        self._scratch_enabled = services.scratch_reuse
        self._scratch_ranges: list[tuple[int, int]] = [(0, 0)] * num_life_cycles
        self._scratch_pages: list[list[Page]] = [[] for _ in range(num_life_cycles)]
        # SSM: one private live state page per SSM life cycle (allocated on first resume), and the
        # snapshot pages a prefix match starts from (copied into the live page on first resume).
        self._ssm_live: list[Page | None] = [None] * num_life_cycles
        self._ssm_sources: list[tuple[int, Page]] = []
        store = services.store
        self._root.users += 1
        for block in self._blocks:
            block.users += 1
        for life_cycle in services.life_cycles:
            lc = life_cycle.id
            if life_cycle.is_ssm:
                if length > 0:
                    snapshot = self._blocks[length // tpb - 1].pages[lc]
                    assert snapshot is not None, "match pruning guarantees a snapshot at the match end"
                    store.hold(snapshot)
                    self._ssm_sources.append((lc, snapshot))
                continue
            for ordinal in range(num_blocks):
                if self._is_stale(lc, ordinal, length):
                    continue
                if ordinal < len(self._blocks):
                    page = self._blocks[ordinal].pages[lc]
                    assert page is not None, "match pruning guarantees every needed block has a page"
                    store.hold(page)
                    self._pages[lc][ordinal] = page
                else:
                    source = match.partial_source
                    assert source is not None
                    source_page = source.pages[lc]
                    assert source_page is not None
                    store.hold(source_page)
                    self._cow_sources.append((lc, source_page))
        self._prompt_blocks = ceil_div(len(tokens), tpb)
        services.live_caches[cache_id] = self

    def _count_reuse(self) -> None:
        """Add this cache's reused and missed blocks to the iteration statistics (once it is surely created)."""
        stats = self._services.store.stats
        missed = max(0, self._prompt_blocks - ceil_div(self._capacity, self._services.tokens_per_block))
        for group, entries in enumerate(self._pages):
            stats[group].reused_full_blocks += sum(1 for entry in entries if entry is not None)
            stats[group].missed_blocks += missed
        for cow_lc, _ in self._cow_sources:
            stats[cow_lc].reused_partial_blocks += 1
        for ssm_lc, _ in self._ssm_sources:
            stats[ssm_lc].reused_full_blocks += 1

    # ------------------------------------------------------------------------------------------- properties
    @property
    def status(self) -> KVCacheStatus:
        """ACTIVE (pages locked on the GPU), SUSPENDED or CLOSED."""
        return self._status

    @property
    def is_active(self) -> bool:
        """Whether the status is ACTIVE."""
        return self._status == KVCacheStatus.ACTIVE

    @property
    def capacity(self) -> int:
        """Tokens the cache has pages for; setting it is ``resize(value)``, raising ``OutOfPagesError`` when short."""
        return self._capacity

    @capacity.setter
    def capacity(self, value: SupportsIndex) -> None:
        if self._scratch_enabled:
            raise ValueError("the capacity setter is refused while SWA scratch reuse is on; use resize(capacity, history)")
        if not self.resize(value):
            raise OutOfPagesError(f"not enough GPU memory to grow cache {self.id} to capacity {int(value)}")

    @property
    def history_length(self) -> int:
        """Tokens before this step's input (``capacity - history_length`` are this step's); setting it is
        ``resize(capacity, value)``."""
        return self._history

    @history_length.setter
    def history_length(self, value: SupportsIndex) -> None:
        if not self.resize(self._capacity, value):
            raise OutOfPagesError(f"not enough GPU memory to set history_length {int(value)} of cache {self.id}")

    @property
    def num_committed_tokens(self) -> int:
        """Finalised tokens, the reused prefix included; their full blocks are in the radix tree, reusable."""
        return self._committed

    @property
    def num_blocks(self) -> int:
        """Blocks that ``capacity`` spans: the length of each layer group's page table."""
        return ceil_div(self._capacity, self._services.tokens_per_block)

    @property
    def beam_width(self) -> int:
        """Always 1: beam search is not supported."""
        return 1

    @property
    def cuda_stream(self) -> CudaStream:
        """The stream given to the last ``resume``; the manager orders its copies on it."""
        return self._cuda_stream

    @property
    def is_committing_stopped(self) -> bool:
        """Whether ``stop_committing`` was called."""
        return self._committing_stopped

    @property
    def enable_swa_scratch_reuse(self) -> bool:
        """Whether this cache puts out-of-window blocks of a prefill chunk in shared scratch slots."""
        return self._scratch_enabled

    @enable_swa_scratch_reuse.setter
    def enable_swa_scratch_reuse(self, value: bool) -> None:
        self._check_open()
        if not isinstance(value, bool):
            raise TypeError(f"enable_swa_scratch_reuse must be a bool, got {value!r}")
        if value and not self._services.scratch_reuse:
            raise ValueError(
                "enable_swa_scratch_reuse can be turned on per cache only when "
                "KVCacheManagerConfig.enable_swa_scratch_reuse is on (the GPU split and the index modes depend on it)"
            )
        if not value and self.has_scratch_slots:
            raise ValueError(f"cannot turn scratch reuse off: cache {self.id} holds scratch blocks")
        self._scratch_enabled = value

    @property
    def has_scratch_slots(self) -> bool:
        """Whether any layer group holds shared scratch blocks now (then only PER_LAYER indices are valid)."""
        for begin, end in self._scratch_ranges:
            if end > begin:
                return True
        return False

    def get_scratch_desc(self, layer_group_id: SupportsIndex) -> ScratchDesc | None:
        """Scratch blocks of a layer group and their slots; None when the group cannot have scratch."""
        lc = self._check_layer_group(layer_group_id)
        if not self._scratch_enabled or self._services.life_cycles[lc].window < 0:
            return None
        begin, end = self._scratch_ranges[lc]
        slots = tuple(page.slot for page in self._scratch_pages[lc]) if self.is_active else ()
        return ScratchDesc(HalfOpenRange(begin, end), slots)

    def get_ssm_block_base_index(self, layer_group_id: SupportsIndex, beam: SupportsIndex = DEFAULT_BEAM_INDEX) -> int:
        """GPU slot of this cache's live state of an SSM layer group (``BAD_PAGE_INDEX`` while suspended)."""
        lc = self._check_layer_group(layer_group_id)
        self._check_beam(beam)
        if not self._services.life_cycles[lc].is_ssm:
            raise ValueError(f"layer group {lc} is not an SSM layer group")
        live = self._ssm_live[lc]
        if live is None or not self.is_active:
            return BAD_PAGE_INDEX
        return live.slot

    def get_num_front_blocks_removed(self, layer_group_id: SupportsIndex) -> int:
        """Leading non-sink blocks without a page (stale), for window-local tables' ``kv_page_offset``."""
        lc = self._check_layer_group(layer_group_id)
        begin, end = self._services.life_cycles[lc].stale(self._history)
        return end - begin

    def supports_index_mode(self, mode: PageIndexMode) -> bool:
        """PER_LAYER always; SHARED only while this cache has no scratch blocks."""
        if not isinstance(mode, PageIndexMode):
            raise TypeError(f"mode must be a PageIndexMode, got {mode!r}")
        return mode == PageIndexMode.PER_LAYER or not self.has_scratch_slots

    # ------------------------------------------------------------------------------------------- page tables
    def get_base_page_indices(self, layer_group_id: SupportsIndex, beam: SupportsIndex = DEFAULT_BEAM_INDEX) -> array[int]:
        """Slot id of each block's GPU page (block ordinal order), ``BAD_PAGE_INDEX`` where there is none."""
        self._check_open()
        lc = self._check_layer_group(layer_group_id)
        self._check_beam(beam)
        return array("i", self._indices[lc])

    def set_base_page_index_buf(self, beam: SupportsIndex, layer_group_id: SupportsIndex, buf: object) -> None:
        """Register a writable 1-D int32 buffer the manager keeps equal to the base page indices.

        It stays registered until replaced (``None`` unregisters) or the cache closes, and is rewritten on every
        change: while the cache is suspended or after it closes every entry is ``BAD_PAGE_INDEX`` (-1), as are
        the entries past the last block.
        """
        self._check_open()
        self._check_beam(beam)
        lc = self._check_layer_group(layer_group_id)
        if buf is None:
            self._user_buffers[lc] = None
            return
        try:
            view = memoryview(buf)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"buf must support the buffer protocol, got {type(buf).__name__}") from None
        if view.readonly:
            raise ValueError("buf must be writable")
        if view.ndim != 1 or view.itemsize != 4 or view.format.lstrip("@=<") not in ("i", "l"):
            raise ValueError(f"buf must be a 1-D int32 buffer, got format {view.format!r} with ndim {view.ndim}")
        if not view.c_contiguous:
            raise ValueError(f"buf must be contiguous (the manager writes it in place), got strides {view.strides}")
        view = view.cast("B").cast("i")
        if len(view) < self.num_blocks:
            raise ValueError(f"buf holds {len(view)} entries, fewer than the {self.num_blocks} blocks of cache {self.id}")
        self._user_buffers[lc] = view
        self._write_buffer(lc, 0, len(view))

    # ------------------------------------------------------------------------------------------- lifecycle
    def resume(self, cuda_stream: SupportsIndex | None = None) -> bool:
        """Bring every needed page to the GPU and lock it (one batched migration); False, changing nothing, when
        GPU memory is short or utilisation would exceed ``max_util_for_resume``."""
        self._check_open()
        stream = CudaStream(0 if cuda_stream is None else as_int(cuda_stream, "cuda_stream"))
        if self._status == KVCacheStatus.ACTIVE:
            if stream != self._cuda_stream:  # the new stream's work waits for the old one's on our pages
                order = self._services.store.stream_order
                order.release(self._cuda_stream)
                order.acquire(stream)
                self._cuda_stream = stream
            return True
        resumed = self._resume_with(None, stream)
        self._services.after_call()
        return resumed

    def _plan_admission(self, capacity: int) -> AdmissionPlan:
        """A batch admission growing to ``capacity``, planned (its priorities asked) before anything changes."""
        if capacity < self._capacity:
            raise ValueError(f"capacity {capacity} is below the {self._capacity} reused tokens")
        return AdmissionPlan(self._plan_resize(capacity, self._history), self._resume_priorities())

    def _admit(self, plan: AdmissionPlan, stream: CudaStream) -> bool:
        """Resume and grow as planned, as one step that either fits whole or changes nothing (batch admission)."""
        return False if plan.growth.refused else self._resume_with(plan.growth, stream, plan.priorities)

    def _resume_priorities(self) -> ResumePriorities:
        services = self._services
        cow = [self._priority(len(self._blocks), lc) for lc, _ in self._cow_sources]
        scratch: list[int] = [DEFAULT_PRIORITY] * len(self._pages)
        for lc in range(len(self._pages)):
            if self._scratch_slot_count(lc, self._scratch_ranges[lc]) > 0:
                scratch[lc] = self._priority(0, lc)
        ssm: list[int] = [DEFAULT_PRIORITY] * len(self._pages)
        for lc in services.ssm_life_cycles:
            if self._ssm_live[lc] is None:
                ssm[lc] = self._priority(0, lc)
        return ResumePriorities(cow, scratch, ssm)

    def _resume_with(self, growth: ResizePlan | None, stream: CudaStream, priorities: ResumePriorities | None = None) -> bool:
        services = self._services
        store = services.store
        if priorities is None:
            priorities = self._resume_priorities()  # before any change: a failing callback leaves no trace
        held = self._live_entries()
        num_groups = len(services.layout.pool_groups)
        need = [0] * num_groups if growth is None else list(growth.need)
        pinned = [[0] * len(store.tiers) for _ in range(num_groups)]
        onboard = [[0] * len(store.tiers) for _ in range(num_groups)]
        for page in held:
            if page.level != 0:
                onboard[page.pool_group][page.level] += 1
            if page.queue is store.queues[page.level][page.pool_group].held:
                pinned[page.pool_group][page.level] += 1
        for lc, _ in self._cow_sources:
            need[services.pool_group_of[lc]] += 1
        for lc in range(len(self._pages)):
            need[services.pool_group_of[lc]] += self._scratch_slot_count(lc, self._scratch_ranges[lc])
        for lc in services.ssm_life_cycles:
            if self._ssm_live[lc] is None:
                need[services.pool_group_of[lc]] += 1
        if not self._fits(need, check_util=True, pinned=pinned, onboard=onboard):
            return False
        for page in held:
            store.lock(page)
        held.sort(key=PageStore.onboard_order)  # the order the room estimate assumed
        for page in held:
            store.unhold(page)
            store.onboard(page)
        for position, (lc, source) in enumerate(self._cow_sources):
            ordinal = len(self._blocks)
            page = store.new_page(lc, source.pool_group, priorities.cow[position])
            store.copy_content(source, page)
            store.unhold(source)
            self._pages[lc][ordinal] = page
        self._cow_sources = []
        for lc in services.ssm_life_cycles:
            if self._ssm_live[lc] is None:
                self._ssm_live[lc] = store.new_page(lc, services.pool_group_of[lc], priorities.ssm[lc])
        for lc, source in self._ssm_sources:
            live = self._ssm_live[lc]
            assert live is not None
            store.copy_content(source, live)
            store.unhold(source)
        self._ssm_sources = []
        for lc in range(len(self._pages)):
            self._fill_scratch_slots(lc, priorities.scratch[lc])
        store.flush(stream)
        self._status = KVCacheStatus.ACTIVE
        self._cuda_stream = stream
        for life_cycle in services.life_cycles:
            self._rebuild_indices(life_cycle.id)
        if growth is not None:
            self._apply_resize(growth)
        return True

    def suspend(self) -> None:
        """Locks become holds: pages may later move to colder tiers but are never lost."""
        self._check_open()
        if self._status != KVCacheStatus.ACTIVE:
            return
        store = self._services.store
        for page in self._live_entries():
            store.hold(page)
            store.unlock(page)
        self._free_scratch_slots()
        store.stream_order.release(self._cuda_stream)
        self._status = KVCacheStatus.SUSPENDED
        for lc in range(len(self._indices)):
            self._indices[lc] = array("i", [BAD_PAGE_INDEX]) * len(self._indices[lc])
            self._write_buffer(lc, 0, len(self._indices[lc]))
        self._services.after_call()

    def resize(self, capacity: SupportsIndex, history_length: SupportsIndex | None = None) -> bool:
        """Move capacity and history together: stale blocks lose their pages first, then new blocks get pages
        (and, with scratch reuse, this chunk's out-of-window blocks get shared scratch slots instead).

        False, with every length, page index and slot count as before, when GPU memory is short.
        """
        self._check_active("resize")
        new_capacity, new_history = self._check_resize(capacity, history_length)
        plan = self._plan_resize(new_capacity, new_history)
        if plan.refused:
            self._services.after_call()
            return False
        released = self._release_newly_stale(new_history, min(self.num_blocks, plan.num_blocks))
        if not self._fits(plan.need, check_util=False):
            self._undo_release(released)
            self._services.after_call()
            return False
        self._commit_release(released)
        self._apply_resize(plan)
        self._services.after_call()
        return True

    def _check_resize(self, capacity: SupportsIndex, history_length: SupportsIndex | None) -> tuple[int, int]:
        new_capacity = as_int(capacity, "capacity")
        new_history = self._history if history_length is None else as_int(history_length, "history_length")
        if new_capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {new_capacity}")
        if new_history < self._history:
            raise ValueError(f"history_length {new_history} would move backwards from {self._history}")
        if new_history > new_capacity:
            raise ValueError(f"history_length {new_history} exceeds capacity {new_capacity}")
        rewind = self._services.max_rewind_len
        if new_capacity > self._capacity and self.has_scratch_slots:
            if not self._capacity - rewind <= new_history <= self._capacity:
                raise ValueError(
                    f"history_length {new_history} must be in [{self._capacity - rewind}, {self._capacity}] to grow "
                    f"capacity while scratch blocks exist (each chunk starts where the previous one ended)"
                )
        self._check_scratch_history(new_history)
        new_blocks = ceil_div(new_capacity, self._services.tokens_per_block)
        for lc, buffer in enumerate(self._user_buffers):
            if buffer is not None and len(buffer) < new_blocks:
                raise ValueError(
                    f"base page index buffer of layer group {lc} holds {len(buffer)} entries, fewer than the "
                    f"{new_blocks} blocks of capacity {new_capacity}"
                )
        return new_capacity, new_history

    def _check_scratch_history(self, new_history: int) -> None:
        """While scratch blocks exist, this chunk's out-of-window blocks live only in scratch slots: the
        history may move only to ``capacity - max_rewind_len`` or beyond, where no scratch block is in window."""
        if not self._scratch_enabled or new_history == self._history or not self.has_scratch_slots:
            return
        floor = self._capacity - self._services.max_rewind_len
        if new_history < floor:
            raise ValueError(
                f"history_length {new_history} would stop inside the scratch chunk of cache {self.id}: while scratch "
                f"blocks exist it must reach at least {floor} (capacity - max_rewind_len) in one step"
            )

    def _plan_resize(self, new_capacity: int, new_history: int) -> ResizePlan:
        """What a resize would do, without doing it: pages to drop, blocks to fill, slots needed per pool group."""
        services = self._services
        old_blocks = self.num_blocks
        plan = ResizePlan(
            new_capacity, new_history, ceil_div(new_capacity, services.tokens_per_block), len(services.layout.pool_groups)
        )
        new_blocks = plan.num_blocks
        if plan.refused or (new_blocks - old_blocks > services.store.num_gpu_slots and self._beyond_gpu(plan)):
            return plan
        for life_cycle in services.life_cycles:
            lc = life_cycle.id
            entries = self._pages[lc]
            scratch_beg, scratch_end = self._target_scratch(lc, new_history, new_capacity)
            plan.scratch.append((scratch_beg, scratch_end))
            plan.scratch_priority.append(DEFAULT_PRIORITY)
            for ordinal in range(new_blocks, old_blocks):
                page = entries[ordinal]
                if page is not None:
                    plan.forgotten.append((lc, ordinal, page))
            for ordinal in range(scratch_beg, min(scratch_end, old_blocks, new_blocks)):
                page = entries[ordinal]
                if page is not None:
                    plan.forgotten.append((lc, ordinal, page))
            if life_cycle.is_ssm:
                continue
            stale_beg, stale_end = life_cycle.stale(new_history) if life_cycle.window >= 0 else (0, 0)
            old_scratch_beg, old_scratch_end = self._scratch_ranges[lc]
            scan_from = old_blocks if old_scratch_end <= old_scratch_beg else min(old_blocks, old_scratch_beg)
            ordinal = scan_from
            while ordinal < new_blocks:  # jumps over stale and scratch runs: their length is unbounded
                if stale_beg <= ordinal < stale_end:
                    ordinal = stale_end
                elif scratch_beg <= ordinal < scratch_end:
                    ordinal = scratch_end
                else:
                    if ordinal >= old_blocks or entries[ordinal] is None:
                        plan.wanted.append((lc, ordinal))
                        plan.need[services.pool_group_of[lc]] += 1
                    ordinal += 1
            if self._scratch_enabled or self._scratch_pages[lc]:
                extra = self._scratch_slot_count(lc, (scratch_beg, scratch_end)) - len(self._scratch_pages[lc])
                if extra > 0:
                    plan.need[services.pool_group_of[lc]] += extra
                    plan.scratch_priority[lc] = self._priority(0, lc)
        if self._priority_callback is not None:
            for wanted_lc, wanted_ordinal in plan.wanted:
                plan.priorities.append(self._priority(wanted_ordinal, wanted_lc))
        return plan

    def _beyond_gpu(self, plan: ResizePlan) -> bool:
        """Whether the lengths need more live pages than a pool group's whole GPU tier has; if so, ``plan.need``
        gets those counts so the plan cannot fit. Arithmetic only, so an absurd capacity is refused at once (only
        asked when the growth exceeds every GPU slot: below that, planning is cheap and finds the shortage)."""
        services = self._services
        live = [0] * len(plan.need)
        for life_cycle in services.life_cycles:
            lc = life_cycle.id
            scratch_beg, scratch_end = self._target_scratch(lc, plan.history, plan.capacity)
            pages = life_cycle.pages_needed(plan.capacity, plan.history) - (scratch_end - scratch_beg)
            live[services.pool_group_of[lc]] += max(0, pages)
        groups = services.store.tiers[0].groups
        if all(count <= groups[pool_group].num_slots for pool_group, count in enumerate(live)):
            return False
        plan.need = live
        return True

    def _apply_resize(self, plan: ResizePlan) -> None:
        services = self._services
        store = services.store
        new_blocks = plan.num_blocks
        for lc, ordinal, page in plan.forgotten:
            self._forget(lc, ordinal, page)
        for entries in self._pages:
            del entries[new_blocks:]
            entries.extend([None] * (new_blocks - len(entries)))
        for lc in range(len(self._indices)):
            indices = self._indices[lc]
            old_blocks = len(indices)
            del indices[new_blocks:]
            indices.extend(array("i", [BAD_PAGE_INDEX]) * (new_blocks - old_blocks))
            if self._user_buffers[lc] is not None and old_blocks != new_blocks:
                self._write_buffer(lc, min(old_blocks, new_blocks), max(old_blocks, new_blocks))
            for ordinal in range(plan.scratch[lc][0], min(plan.scratch[lc][1], new_blocks)):
                self._set_index(lc, ordinal, BAD_PAGE_INDEX)
        for position, (lc, ordinal) in enumerate(plan.wanted):
            priority = plan.priorities[position] if plan.priorities else DEFAULT_PRIORITY
            page = store.new_page(lc, services.pool_group_of[lc], priority)
            self._pages[lc][ordinal] = page
            self._set_index(lc, ordinal, page.slot)
        if self._scratch_enabled or self.has_scratch_slots:
            for lc in range(len(self._pages)):
                self._set_scratch(lc, plan.scratch[lc], plan.scratch_priority[lc])
        store.flush(self._cuda_stream)
        self._capacity = plan.capacity
        self._history = plan.history

    def commit(self, tokens: TokenSequence) -> None:
        """Append finalised tokens; each newly completed block joins the radix tree (or is rebased onto an
        identical one), then the history bump releases stale pages."""
        self._check_active("commit")
        if self._committing_stopped:
            raise ValueError(f"commit after stop_committing on cache {self.id}")
        new_tokens = check_tokens(tokens, "tokens")
        if self._committed + len(new_tokens) > self._capacity:
            raise ValueError(
                f"committing {len(new_tokens)} tokens would exceed capacity {self._capacity} "
                f"({self._committed} already committed)"
            )
        self._check_scratch_history(max(self._history, self._committed + len(new_tokens)))
        tpb = self._services.tokens_per_block
        self._tail.extend(new_tokens)
        self._committed += len(new_tokens)
        completed = False
        while len(self._tail) >= tpb:
            block_tokens = self._tail[:tpb]
            del self._tail[:tpb]
            self._commit_block(block_tokens)
            completed = True
        if completed and self._takes_snapshot():
            self._snapshot_ssm_states(self._blocks[-1])
        if self._committed > self._history:
            released = self._release_newly_stale(self._committed, self.num_blocks)
            self._commit_release(released)
            self._history = self._committed
            if self._history == self._capacity:
                for lc in range(len(self._pages)):
                    self._set_scratch(lc, (0, 0), DEFAULT_PRIORITY)
        self._services.store.flush(self._cuda_stream)
        self._services.after_call()

    def stop_committing(self) -> None:
        """No more commits: the trailing partial block joins the tree when the cache closes (the cache may
        still write past it until then), and held stale pages that can no longer be committed are freed."""
        self._check_open()
        if self._committing_stopped:
            return
        self._committing_stopped = True
        for life_cycle in self._services.life_cycles:
            lc = life_cycle.id
            stale_beg, stale_end = life_cycle.stale(self._history)
            for ordinal in range(max(stale_beg, len(self._blocks)), stale_end):
                page = self._pages[lc][ordinal]
                if page is not None:
                    self._pages[lc][ordinal] = None
                    self._services.store.unhold(page)
                    self._services.store.free(page)
        self._services.after_call()

    def close(self) -> None:
        """Release everything; committed pages stay in the tree as reusable content. Idempotent."""
        if self._status == KVCacheStatus.CLOSED:
            return
        self._release(observed=True)

    def _discard(self) -> None:
        """Close a cache that a batch admission created but did not hand out, leaving no observed length."""
        self._release(observed=False)

    def _release(self, observed: bool) -> None:
        services = self._services
        store = services.store
        if self._status == KVCacheStatus.ACTIVE:
            for page in self._live_entries():
                store.hold(page)
                store.unlock(page)
            self._free_scratch_slots()
            store.stream_order.release(self._cuda_stream)
        for _, source in self._cow_sources:
            store.unhold(source)
        self._cow_sources = []
        for _, source in self._ssm_sources:
            store.unhold(source)
        self._ssm_sources = []
        for lc, live in enumerate(self._ssm_live):
            if live is not None:
                store.unhold(live)
                store.free(live)
                self._ssm_live[lc] = None
        partial: Block | None = None
        if self._committing_stopped and self._tail:
            parent = self._blocks[-1] if self._blocks else self._root
            partial, _ = services.tree.add_child(parent, list(self._tail))
        for lc, entries in enumerate(self._pages):
            for ordinal, entry in enumerate(entries):
                if entry is None:
                    continue
                if partial is not None and ordinal == len(self._blocks) and entry.block is None:
                    if partial.pages[lc] is None:
                        partial.pages[lc] = entry
                        entry.block = partial
                        store.publish(entry)
                        store.unhold(entry)
                        continue
                store.unhold(entry)
                if entry.block is None:
                    store.free(entry)
        self._pages = []
        self._root.users -= 1
        for block in self._blocks:
            block.users -= 1
        # Pruning the deepest block walks up through every ancestor it empties, the scope's root included.
        services.tree.prune(partial if partial is not None else (self._blocks[-1] if self._blocks else self._root))
        self._blocks = []
        self._status = KVCacheStatus.CLOSED
        if observed:
            services.observed_lengths.append((self._capacity, self._history))
        for lc, buffer in enumerate(self._user_buffers):
            if buffer is not None:
                buffer[:] = array("i", [BAD_PAGE_INDEX]) * len(buffer)
        self._user_buffers = []
        del services.live_caches[self.id]
        services.after_call()

    # ------------------------------------------------------------------------------------------- internals
    def _commit_block(self, block_tokens: list[Token]) -> None:
        services = self._services
        store = services.store
        ordinal = len(self._blocks)
        parent = self._blocks[-1] if self._blocks else self._root
        block, _ = services.tree.add_child(parent, block_tokens)
        block.users += 1
        self._blocks.append(block)
        for lc, entries in enumerate(self._pages):
            page = entries[ordinal]
            if page is None:
                continue
            tree_page = block.pages[lc]
            stale = self._is_stale(lc, ordinal, self._history)
            if tree_page is None:
                block.pages[lc] = page
                page.block = block
                store.publish(page)
                if stale:
                    entries[ordinal] = None
                    store.unhold(page)
                continue
            # Rebase onto the identical block already in the tree.
            if stale:
                entries[ordinal] = None
                store.unhold(page)
                store.free(page)
                continue
            store.free(page)
            store.lock(tree_page)
            store.onboard(tree_page)
            entries[ordinal] = tree_page
            self._set_index(lc, ordinal, tree_page.slot)

    def _takes_snapshot(self) -> bool:
        """Whether the commit just made ends where SSM snapshots are taken: a block boundary on the reuse
        interval that is also the end of the computed chunk (``capacity``): the live state holds every token the
        engine computed, so a commit that stops short of them would snapshot a state from the future."""
        services = self._services
        if not services.ssm_life_cycles or self._tail or self._committed != self._capacity:
            return False
        return self._committed % services.ssm_reuse_interval == 0

    def _snapshot_ssm_states(self, block: Block) -> None:
        """Copy each live SSM state into a snapshot page owned by ``block``, unless it has one."""
        store = self._services.store
        for lc in self._services.ssm_life_cycles:
            live = self._ssm_live[lc]
            if live is None or block.pages[lc] is not None:
                continue
            snapshot = store.snapshot(live)
            if snapshot is not None:
                snapshot.block = block
                block.pages[lc] = snapshot
                store.refile(snapshot)
                store.publish(snapshot)

    def _release_newly_stale(self, new_history: int, num_blocks: int) -> list[tuple[int, int, Page]]:
        """Unlock entries entering the stale range: committed ones are dropped from the cache (kept in the tree,
        evictable), uncommitted ones become held. Reversible until ``_commit_release``."""
        released: list[tuple[int, int, Page]] = []
        store = self._services.store
        for life_cycle in self._services.windowed_life_cycles:
            lc = life_cycle.id
            _, old_end = life_cycle.stale(self._history)
            new_beg, new_end = life_cycle.stale(new_history)
            for ordinal in range(max(old_end, new_beg), min(new_end, num_blocks)):
                page = self._pages[lc][ordinal]
                if page is None:
                    continue
                released.append((lc, ordinal, page))
                store.hold(page)
                store.unlock(page)
                self._set_index(lc, ordinal, BAD_PAGE_INDEX)
        return released

    def _undo_release(self, released: list[tuple[int, int, Page]]) -> None:
        store = self._services.store
        for lc, ordinal, page in released:
            store.lock(page)
            store.unhold(page)
            self._set_index(lc, ordinal, page.slot)

    def _commit_release(self, released: list[tuple[int, int, Page]]) -> None:
        """Finish a release: committed pages leave the cache; uncommitted ones stay held, or are freed once
        committing has stopped."""
        store = self._services.store
        for lc, ordinal, page in released:
            if page.block is not None or self._committing_stopped:
                self._pages[lc][ordinal] = None
                store.unhold(page)
                if page.block is None:
                    store.free(page)

    def _forget(self, lc: int, ordinal: int, page: Page) -> None:
        """Drop an entry beyond a shrunk capacity: always a private page, held when stale, else locked."""
        store = self._services.store
        self._pages[lc][ordinal] = None
        if self._is_stale(lc, ordinal, self._history):
            store.unhold(page)
        else:
            store.unlock(page)
        store.free(page)

    def _target_scratch(self, lc: int, history: int, capacity: int) -> tuple[int, int]:
        if not self._scratch_enabled:
            return 0, 0
        begin, end = self._services.life_cycles[lc].scratch(history, capacity, self._services.max_rewind_len)
        return (begin, end) if end > begin else (0, 0)

    def _scratch_slot_count(self, lc: int, scratch: tuple[int, int]) -> int:
        return self._services.layout.scratch_slots(lc, scratch[1] - scratch[0])

    def _set_scratch(self, lc: int, scratch: tuple[int, int], priority: int) -> None:
        """Adopt a new scratch range, growing or shrinking its slot list (room was checked by the caller; new
        slots get ``priority``)."""
        self._scratch_ranges[lc] = scratch
        self._fill_scratch_slots(lc, priority)

    def _fill_scratch_slots(self, lc: int, priority: int) -> None:
        store = self._services.store
        pages = self._scratch_pages[lc]
        wanted = self._scratch_slot_count(lc, self._scratch_ranges[lc])
        while len(pages) > wanted:
            page = pages.pop()
            store.unlock(page)
            store.free(page)
        while len(pages) < wanted:
            pages.append(store.new_page(lc, self._services.pool_group_of[lc], priority))

    def _free_scratch_slots(self) -> None:
        store = self._services.store
        for pages in self._scratch_pages:
            for page in pages:
                store.unlock(page)
                store.free(page)
            pages.clear()

    def _all_pages(self) -> list[Page]:
        """Every page this cache holds a count on: block entries, copy-on-write and SSM sources, scratch slots and
        live SSM states (a freshly created cache has neither of the last two)."""
        result: list[Page] = []
        for entries in self._pages:
            for page in entries:
                if page is not None:
                    result.append(page)
        for _, source in self._cow_sources:
            result.append(source)
        for _, snapshot in self._ssm_sources:
            result.append(snapshot)
        for pages in self._scratch_pages:
            result.extend(pages)
        for live in self._ssm_live:
            if live is not None:
                result.append(live)
        return result

    def _live_entries(self) -> list[Page]:
        """Entries that are locked while active (everything outside the stale range)."""
        result: list[Page] = []
        for life_cycle in self._services.life_cycles:
            lc = life_cycle.id
            stale_beg, stale_end = life_cycle.stale(self._history)
            for ordinal, page in enumerate(self._pages[lc]):
                if page is not None and not stale_beg <= ordinal < stale_end:
                    result.append(page)
        for live in self._ssm_live:
            if live is not None:
                result.append(live)
        return result

    def _fits(
        self,
        need: list[int],
        check_util: bool,
        pinned: list[list[int]] | None = None,
        onboard: list[list[int]] | None = None,
    ) -> bool:
        """Whether ``need`` new GPU pages per pool group can be had after onboarding ``onboard[pool_group][level]``
        of our pages (``pinned[pool_group][level]``: held pages of ours about to be locked; with ``check_util``,
        GPU utilisation after locking them must stay within ``max_util_for_resume``)."""
        store = self._services.store
        for pool_group, count in enumerate(need):
            ours = None if pinned is None else pinned[pool_group]
            moving = None if onboard is None else onboard[pool_group]
            extra = 0 if ours is None else ours[0]
            if moving is not None:
                for moved in moving:
                    extra += moved
            if count == 0 and extra == 0 and not check_util:
                continue
            if not store.can_obtain(pool_group, count, moving, ours):
                return False
            if check_util:
                total = store.tiers[0].groups[pool_group].num_slots
                if (store.num_locked(pool_group) + extra + count) > self._services.max_util_for_resume * total:
                    return False
        return True

    def _is_stale(self, lc: int, ordinal: int, history: int) -> bool:
        stale_beg, stale_end = self._services.life_cycles[lc].stale(history)
        return stale_beg <= ordinal < stale_end

    def _priority(self, ordinal: int, lc: int) -> int:
        return self._services.priority(self._priority_callback, ordinal, lc)

    def _set_index(self, lc: int, ordinal: int, value: int) -> None:
        if self._status != KVCacheStatus.ACTIVE:
            return
        self._indices[lc][ordinal] = value
        buffer = self._user_buffers[lc]
        if buffer is not None:
            buffer[ordinal] = value

    def _write_buffer(self, lc: int, begin: int, end: int) -> None:
        """Copy ``[begin, end)`` of a layer group's indices into its registered buffer, -1 past the last block."""
        buffer = self._user_buffers[lc]
        if buffer is None:
            return
        indices = self._indices[lc]
        end = min(end, len(buffer))
        for ordinal in range(begin, end):
            buffer[ordinal] = indices[ordinal] if ordinal < len(indices) else BAD_PAGE_INDEX

    def _rebuild_indices(self, lc: int) -> None:
        indices = self._indices[lc]
        stale_beg, stale_end = self._services.life_cycles[lc].stale(self._history)
        for ordinal, page in enumerate(self._pages[lc]):
            live = page is not None and not stale_beg <= ordinal < stale_end
            indices[ordinal] = page.slot if live and page is not None else BAD_PAGE_INDEX
        buffer = self._user_buffers[lc]
        if buffer is not None:
            buffer[: len(indices)] = indices

    def _check_open(self) -> None:
        if self._status == KVCacheStatus.CLOSED:
            raise ValueError(f"cache {self.id} is closed")

    def _check_active(self, operation: str) -> None:
        self._check_open()
        if self._status != KVCacheStatus.ACTIVE:
            raise ValueError(f"{operation} needs an active cache; cache {self.id} is suspended (call resume first)")

    def _check_layer_group(self, layer_group_id: SupportsIndex) -> int:
        return as_index(layer_group_id, "layer_group_id", len(self._services.life_cycles))

    @staticmethod
    def _check_beam(beam: SupportsIndex) -> None:
        value = as_int(beam, "beam")
        if value != DEFAULT_BEAM_INDEX:
            raise ValueError(f"beam {value} out of range: beam width is 1")

    def __repr__(self) -> str:
        return (
            f"KVCache(id={self.id}, status={self._status.name}, capacity={self._capacity}, "
            f"history_length={self._history}, num_committed_tokens={self._committed})"
        )


# The name seed-era code imports.
_KVCache = KVCache
