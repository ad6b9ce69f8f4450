"""``ResizingCache``: a cache's resume and resize (with batch admission, a resume and a resize as one step).

Each plans first (``ResizePlan``, ``ResumePriorities``), releases stale pages reversibly, asks ``PageStore.fits``
and only then applies, so a refused call changes nothing. ``resize`` takes an O(1) path for a decode step inside
the last block. Suspending and the placement hints of a suspended cache are the layer below (``cache_suspend.py``).
"""

from __future__ import annotations

import errno
from typing import SupportsIndex

from .._base.types import DEFAULT_PRIORITY, CudaStream, PageContentLostError
from .._base.validation import as_int, as_stream_handle
from .._model.life_cycle import ceil_div
from .._pages.page import Page
from .._pages.room_model import DROPPABLE, FREED, STILL_HELD, UNCLAIMED
from .attention_state import Released, leaves_when_stale, room_released
from .cache_plans import AdmissionPlan, ResizePlan, ResumePriorities
from .cache_suspend import SuspendingCache
from .cache_view import KVCacheStatus
from .lent_rows import recall_beyond
from .refusal import explain_refusal, own_stale_room
from .._base.wording import counted


class ResizingCache(SuspendingCache):
    """The resume / resize layer of ``CacheState``."""

    # ------------------------------------------------------------------------------------------- lifecycle
    def resume(self, cuda_stream: SupportsIndex | None = None) -> bool:
        """See ``KVCache.resume``."""
        self._check_open()
        given = None if cuda_stream is None else as_stream_handle(cuda_stream, "cuda_stream")
        stream = self._cuda_stream if given is None else CudaStream(given)
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

    def plan_admission(self, capacity: int) -> AdmissionPlan:
        """A batch admission growing to ``capacity``, planned (its priorities asked) before anything changes."""
        if capacity < self._capacity:
            raise ValueError(f"capacity {capacity} is below the {counted(self._capacity, 'reused token')}")
        return AdmissionPlan(self._plan_resize(capacity, self._history), self._resume_priorities())

    def admit(self, plan: AdmissionPlan, stream: CudaStream, reserved: list[int]) -> bool:
        """Resume and grow as planned, as one step that either fits whole or changes nothing (batch admission);
        ``reserved[pool_group]``: GPU pages the batch claims for its other requests, which this one's admission
        limit does not count (``BatchReservation``)."""
        if plan.growth.refused:
            self._refuse(
                "create_kv_cache_batch", plan.growth.shortage(), self._services.settings.admission_util,
                num_blocks=plan.growth.num_blocks,
            )
            return False
        return self._resume_with(plan.growth, stream, plan.priorities, reserved)

    def _resume_priorities(self) -> ResumePriorities:
        num_groups = len(self.groups)
        cow: list[int] = [DEFAULT_PRIORITY] * num_groups
        for group in self.attention:
            if group.cow_source is not None:
                cow[group.id] = self._priority(len(self._blocks), group.id)
        scratch: list[int] = [DEFAULT_PRIORITY] * num_groups
        for group in self.attention:
            if group.scratch_slot_count(group.scratch_range) > 0:
                scratch[group.id] = self._priority(0, group.id)
        ssm: list[int] = [DEFAULT_PRIORITY] * num_groups
        for state in self.ssm:
            if state.wants_live_state():
                ssm[state.id] = self._priority(0, state.id)
        return ResumePriorities(cow, scratch, ssm)

    def _resume_with(
        self,
        growth: ResizePlan | None,
        stream: CudaStream,
        priorities: ResumePriorities | None = None,
        reserved: list[int] | None = None,
    ) -> bool:
        services = self._services
        store = services.store
        lost_before = store.counters.lost_pages
        if lost_before and any(page.lost for page in self.held_pages()):
            raise self._lost_error()  # lost while suspended (a failed eviction to disk): nothing changed
        if priorities is None:
            priorities = self._resume_priorities()  # before any change: a failing callback leaves no trace
        held = self.live_entries()
        num_pool_groups = len(services.layout.pool_groups)
        need = [0] * num_pool_groups if growth is None else list(growth.need)
        pinned = [[0] * len(store.tiers) for _ in range(num_pool_groups)]
        onboard = [[0] * len(store.tiers) for _ in range(num_pool_groups)]
        gpu_group_of = store.grouping.group_of[0]  # a page's pool_group is its level's: count by the GPU's
        for page in held:
            gpu_group = gpu_group_of[page.life_cycle]
            if page.level != 0:
                onboard[gpu_group][page.level] += 1
            if page.queue is store.queues[page.level][page.pool_group].held:
                pinned[gpu_group][page.level] += 1
        for any_kind in self.groups:
            need[any_kind.pool_group] += any_kind.resume_need()
        claimed, sources = self._copy_sources(num_pool_groups)
        settings = services.settings
        if not store.fits(need, settings.admission_util, pinned, onboard, sources, reserved):
            call = "KVCache.resume" if growth is None else "create_kv_cache_batch"
            # Refused by the watermark alone when the step fits under max_util_for_resume.
            by_watermark = settings.admission_util < settings.max_util_for_resume and store.fits(
                need, settings.max_util_for_resume, pinned, onboard, sources, reserved
            )
            stale = own_stale_room(
                store, self.attention, self._history, len(self._blocks), [], need, pinned, settings.admission_util,
                onboard, sources, reserved,
            )
            self._refuse(call, need, settings.admission_util, pinned, onboard, by_watermark, 0, sources, reserved, stale=stale)
            return False
        for page in held:
            store.lock(page)
            store.unhold(page)
        for page in claimed:
            store.claim(page)
        try:
            store.onboard_all(held, claimed)
            for group in self.attention:
                group.resolve_cow(len(self._blocks), priorities.cow[group.id])
        finally:
            store.waiting.pages = []
        for state in self.ssm:
            state.start_live_state(priorities.ssm[state.id])
        for group in self.attention:
            group.fill_scratch_slots(priorities.scratch[group.id])
        store.flush(stream)
        if store.counters.lost_pages != lost_before and any(page.lost for page in self.live_entries()):
            self._unlock_all()  # suspended again, its pages where they are now
            raise self._lost_error()
        self._status = KVCacheStatus.ACTIVE
        self._cuda_stream = stream
        for group in self.attention:
            group.rebuild_indices(self._history)
        if growth is not None:
            self._apply_resize(growth)
        return True

    def _copy_sources(self, num_pool_groups: int) -> tuple[list[Page], list[list[tuple[int, int]]] | None]:
        """The copy-on-write sources a resume claims until it copies them (those no active cache locks and no
        batch claims), and per pool group, in copying order, each copy's source level (``UNCLAIMED`` for the
        others) and what it becomes once copied (``RoomModel.obtain``); None without a copy."""
        claimed: list[Page] = []
        sources: list[list[tuple[int, int]]] | None = None
        for group in self.attention:
            source = group.cow_source
            if source is None:
                continue
            if sources is None:
                sources = [[] for _ in range(num_pool_groups)]
            if source.lock_count or source.claim_count:
                sources[group.pool_group].append((UNCLAIMED, DROPPABLE))
                continue
            claimed.append(source)
            after = STILL_HELD if source.hold_count > 1 else FREED if source.block is None else DROPPABLE
            sources[group.pool_group].append((source.level, after))
        return claimed, sources

    def _lost_error(self) -> PageContentLostError:
        return PageContentLostError(
            errno.EIO,
            f"KVCache.resume: cache {self.id} cannot resume: pages it needs lost their content "
            f"({self._services.store.last_copy_error}); close it and create the request again (its lost blocks "
            f"are no longer reusable)"
        )

    def _refuse(
        self,
        call: str,
        need: list[int],
        max_util: float | None = None,
        pinned: list[list[int]] | None = None,
        onboard: list[list[int]] | None = None,
        by_watermark: bool = False,
        num_blocks: int = 0,
        sources: list[list[tuple[int, int]]] | None = None,
        reserved: list[int] | None = None,
        kept: list[Page] | None = None,
        freed: list[int] | None = None, short: int = -1, stale: int = 0,
    ) -> None:
        """Record why the step was refused (refusal path only), here and as the manager's latest refusal; ``kept``:
        the pages the cache keeps (default: its live entries); ``freed``, ``short``, ``stale``: see ``explain_refusal``."""
        own = [0] * len(need)
        counted = [0] * len(need)  # of ``own``, those in no eviction list: ``num_locked`` counts them already
        for page in self.live_entries() if kept is None else kept:
            if page.level == 0:
                own[page.pool_group] += 1
                if page.queue is None:
                    counted[page.pool_group] += 1
        refusal = explain_refusal(
            self._services.store, call, need, own, max_util, pinned, onboard, by_watermark, num_blocks, sources,
            reserved, counted, freed, short, stale, self.held_pages,
        )
        self.note_refusal(refusal)

    def resize(self, capacity: SupportsIndex, history_length: SupportsIndex | None = None) -> bool:
        """See ``KVCache.resize``. Stale blocks lose their pages first, then new blocks get pages (with scratch reuse, this
        chunk's out-of-window blocks get shared scratch slots instead). A step that stays inside the last block and
        leaves every stale range as it is (31 of 32 decode steps) changes only the two lengths: an O(1) path without
        planning, allocation or copies."""
        if (
            type(capacity) is int
            and (history_length is None or type(history_length) is int)
            and self._status is KVCacheStatus.ACTIVE
            and not self._scratch_enabled
        ):
            history = self._history if history_length is None else history_length
            tpb = self._tpb
            if (
                self._history <= history <= capacity
                and history < self._steady_below
                and -(-capacity // tpb) == -(-self._capacity // tpb)
                and capacity >= self._loans.lent_end
            ):
                self._capacity = capacity
                self._history = history
                self._services.after_call()
                return True
        return self._resize_planned(capacity, history_length)

    def _resize_planned(self, capacity: SupportsIndex, history_length: SupportsIndex | None) -> bool:
        self._check_active("resize")
        new_capacity, new_history = self._check_resize(capacity, history_length)
        if new_capacity == self._capacity and not self._scratch_enabled and not self.has_scratch_slots:
            self._advance_history(new_history)
            self._services.after_call()
            return True
        plan = self._plan_resize(new_capacity, new_history)
        if plan.refused:  # beyond every GPU slot (plan.need: the pages it lacks) or beyond MAX_BLOCKS_PER_CACHE blocks
            self._refuse("KVCache.resize", plan.shortage(), num_blocks=plan.num_blocks)
            self._services.after_call()
            return False
        released = self._release_newly_stale(new_history, min(self.num_blocks, plan.num_blocks))
        store, keep = self._services.store, not self._services.settings.snapshot_every_commit
        # The room the step makes itself counts: what it forgets, its spare scratch slots, stale pages that leave.
        ours = room_released(released, len(self._blocks), keep and not self._committing_stopped, plan.let_go, len(store.tiers))
        need = plan.net_need()
        if not store.fits(need, None, ours):
            short, freed = store.shortfall(need, None, ours), [store.available_to(g, ours[g]) for g in range(len(need))]
            stale = own_stale_room(store, self.attention, self._history, len(self._blocks), released, need, ours)
            self._undo_release(released)
            freed = [count - store.available_to(group) + plan.let_go[group] for group, count in enumerate(freed)]
            kept = plan.kept_pages(self.attention) + [state.live for state in self.ssm if state.live]
            self._refuse("KVCache.resize", plan.need, kept=kept, freed=freed, short=short, stale=stale)
            self._services.after_call()
            return False
        self._commit_release(released, keep_uncommitted=keep)
        self._apply_resize(plan)
        if self._capacity < self._loans.lent_end:  # cut below rows it lent: those it has not computed go back
            recall_beyond(self, self._capacity)
        self._services.after_call()
        return True

    def _advance_history(self, new_history: int) -> None:
        """A step that moves only the history (capacity kept, no scratch) takes no page, so it has nothing to plan or
        refuse: the blocks entering a stale range let go of their pages and that is all (the history setter of a
        decode loop whose step ends on a block boundary, half of its resizes)."""
        released = self._release_newly_stale(new_history, self.num_blocks)
        self._commit_release(released, keep_uncommitted=not self._services.settings.snapshot_every_commit)
        self._services.store.flush(self._cuda_stream)
        self._history = new_history
        self._note_history()

    def _check_resize(self, capacity: SupportsIndex, history_length: SupportsIndex | None) -> tuple[int, int]:
        new_capacity = as_int(capacity, "capacity")
        new_history = self._history if history_length is None else as_int(history_length, "history_length")
        if new_capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {new_capacity}")
        if new_history < self._history:
            raise ValueError(
                f"history_length {new_history} would move backwards from {self._history} (it only grows, and commit "
                f"raises it to num_committed_tokens): to compute earlier tokens again, close the cache and create "
                f"a new one whose input_tokens stop before them (create_kv_cache reuses every cached token it is "
                f"given: pass a prompt without its last token, whose logits sample the first output token)"
            )
        if new_history > new_capacity:
            if history_length is None:  # the caller passed a capacity only: name what it did pass
                raise ValueError(
                    f"capacity {new_capacity} is below history_length {new_history}, which resize keeps: computed "
                    f"tokens cannot be given back (pass a capacity of at least {new_history})"
                )
            raise ValueError(f"history_length {new_history} exceeds capacity {new_capacity}")
        rewind = self._services.settings.max_rewind_len
        if new_capacity > self._capacity and self.has_scratch_slots:
            if not self._capacity - rewind <= new_history <= self._capacity:
                raise ValueError(
                    f"history_length {new_history} must be in [{self._capacity - rewind}, {self._capacity}] to grow "
                    f"capacity while scratch blocks exist (each chunk starts where the previous one ended)"
                )
        self._check_scratch_history(new_history)
        new_blocks = ceil_div(new_capacity, self._services.tokens_per_block)
        for group in self.groups:
            buffer = group.user_buffer
            if buffer is not None and len(buffer) < new_blocks:
                raise ValueError(
                    f"base page index buffer of layer group {group.id} holds "
                    f"{counted(len(buffer), 'entry', 'entries')}, fewer than the {counted(new_blocks, 'block')} of "
                    f"capacity {new_capacity}"
                )
        return new_capacity, new_history

    def _check_scratch_history(self, new_history: int) -> None:
        """While scratch blocks exist, this chunk's out-of-window blocks live only in scratch slots: the
        history may move only to ``capacity - max_rewind_len`` or beyond, where no scratch block is in window."""
        if not self._scratch_enabled or new_history == self._history or not self.has_scratch_slots:
            return
        floor = self._capacity - self._services.settings.max_rewind_len
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
            new_capacity,
            new_history,
            ceil_div(new_capacity, services.tokens_per_block),
            len(services.layout.pool_groups),
            len(self.groups),
        )
        new_blocks = plan.num_blocks
        if plan.refused or (new_blocks - old_blocks > services.store.num_gpu_slots and self._beyond_gpu(plan)):
            return plan
        rewind = services.settings.max_rewind_len
        enabled = self._scratch_enabled
        for group in self.attention:
            scratch = group.target_scratch(new_history, new_capacity, rewind, enabled)
            plan.scratch[group.id] = scratch
            plan.let_go[group.pool_group] += group.plan_forgotten(old_blocks, new_blocks, scratch, plan.forgotten)
            plan.need[group.pool_group] += group.plan_wanted(old_blocks, new_blocks, new_history, scratch, plan.wanted)
            extra = group.extra_scratch_slots(scratch, enabled)
            plan.let_go[group.pool_group] += max(0, -extra)  # scratch slots the chunk no longer needs
            if extra > 0:
                plan.need[group.pool_group] += extra
                plan.scratch_priority[group.id] = self._priority(0, group.id)
        if self._priority_callback is not None:
            for wanted_group, wanted_ordinal in plan.wanted:
                plan.priorities.append(self._priority(wanted_ordinal, wanted_group.id))
        return plan

    def _beyond_gpu(self, plan: ResizePlan) -> bool:
        """Whether the lengths need more live pages than a pool group's whole GPU tier has; if so, ``plan.need``
        gets the pages beyond those the cache holds on the GPU now (what planning would count, so a refusal's
        ``pages_needed`` means the same either side of this shortcut) and the plan is refused. Arithmetic only, so
        an absurd capacity is refused at once (only asked when the growth exceeds every GPU slot: below that,
        planning is cheap and finds the shortage)."""
        services = self._services
        live = [0] * len(plan.need)
        rewind = services.settings.max_rewind_len
        for group in self.attention:
            scratch_beg, scratch_end = group.target_scratch(plan.history, plan.capacity, rewind, self._scratch_enabled)
            pages = group.life_cycle.pages_needed(plan.capacity, plan.history) - (scratch_end - scratch_beg)
            live[group.pool_group] += max(0, pages)
        for state in self.ssm:
            live[state.pool_group] += state.life_cycle.pages_needed(plan.capacity, plan.history)
        pool_groups = services.store.tiers[0].pool_groups
        if all(count <= pool_groups[pool_group].num_slots for pool_group, count in enumerate(live)):
            return False
        for page in self.live_entries():
            if page.level == 0:
                live[page.pool_group] -= 1
        plan.need = [max(0, count) for count in live]
        plan.refused = True
        return True

    def _apply_resize(self, plan: ResizePlan) -> None:
        store = self._services.store
        for forgetting, ordinal, page in plan.forgotten:
            forgetting.forget(ordinal, page, self._history)
        for group in self.attention:  # what the step lets go of goes first: the room its new pages counted
            group.resize_tables(plan.num_blocks, plan.scratch[group.id])
            group.trim_scratch_slots(group.scratch_slot_count(plan.scratch[group.id]))
        decode_step = plan.capacity - plan.history == 1
        request = self.request_stats
        if request is not None and plan.wanted:
            new_block_count = len({ordinal for _, ordinal in plan.wanted})
            request.alloc_new_blocks += new_block_count
            request.alloc_total_blocks += new_block_count
            self._services.pending_stats.add(self.id)
        for position, (group, ordinal) in enumerate(plan.wanted):
            priority = plan.priorities[position] if plan.priorities else DEFAULT_PRIORITY
            page = store.new_page(group.id, group.pool_group, priority)
            group.entries[ordinal] = page
            group.set_index(ordinal, page.slot)
            if decode_step:
                store.stats[group.id].generation_pages += 1
        if self._scratch_enabled or self.has_scratch_slots:
            for group in self.attention:
                group.set_scratch(plan.scratch[group.id], plan.scratch_priority[group.id])
        store.flush(self._cuda_stream)
        self._capacity = plan.capacity
        self._history = plan.history
        self._note_history()

    def _release_newly_stale(self, new_history: int, num_blocks: int) -> list[Released]:
        """Unlock entries entering the stale range: committed ones are dropped from the cache (kept in the tree,
        evictable), uncommitted ones become held. Reversible until ``_commit_release``."""
        released: list[Released] = []
        for group in self.attention:
            group.release_newly_stale(self._history, new_history, num_blocks, released)
        return released

    def _undo_release(self, released: list[Released]) -> None:
        store = self._services.store
        for group, ordinal, page in released:
            store.lock(page)
            store.unhold(page)
            group.set_index(ordinal, page.slot)

    def _commit_release(self, released: list[Released], keep_uncommitted: bool = True) -> None:
        """Finish a release: the pages that leave the cache (``leaves_when_stale``; uncommitted ones are kept only
        with ``keep_uncommitted`` while committing goes on) go, freed when private; the others stay held."""
        store = self._services.store
        keep = keep_uncommitted and not self._committing_stopped
        for group, ordinal, page in released:
            if leaves_when_stale(page, ordinal, len(self._blocks), keep):
                group.entries[ordinal] = None
                store.unhold(page)
                if page.block is None:
                    store.free_if_unused(page)
