"""``CacheState``: one request's cache, everything but the handle the engine holds (``KVCache``, beside the manager).

Lengths: ``num_committed_tokens <= history_length <= capacity``. The pages themselves live in one state object per
layer group (``_group_state.py``: full / windowed attention, SSM); the cache keeps the lengths, the status, its
committed blocks, and orders the groups' steps so that a failing call changes nothing. While ACTIVE every entry
outside the stale range is locked on the GPU; stale entries are private pages kept held until their block is
committed. While SUSPENDED every entry is held.
"""

from __future__ import annotations

from typing import Final, Sequence, SupportsIndex

from .cache_view import CacheView
from .cache_view import KVCacheStatus as KVCacheStatus
from .group_state import Released
from .._base.hashing import ReuseScope, Token, TokenSequence, check_tokens
from .._model.life_cycle import ceil_div
from .._pages.page_store import LruOrder, PageStore
from .._pages.prefix_match import Match
from .._pages.priority import PriorityCallback
from .._pages.page import Block, BlockTokens
from .refusal import Refusal, explain_refusal
from .registry import CacheRegistry
from .services import CacheServices
from .._observe.stats_delta import KVCacheStatsDelta
from .._base.types import DEFAULT_BEAM_INDEX, DEFAULT_PRIORITY, CudaStream, OutOfPagesError
from .._base.validation import as_int


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
        self.refused: bool = num_blocks > MAX_BLOCKS_PER_CACHE
        self.scratch: list[tuple[int, int]] = []
        self.scratch_priority: list[int] = []  # of new scratch slots, per life cycle
        self.forgotten: list[Released] = []
        self.wanted: list[tuple[int, int]] = []
        self.priorities: list[int] = []  # of ``wanted``; empty without a priority callback (default priority)
        self.need: list[int] = [0] * num_pool_groups

    def shortage(self) -> list[int]:
        """What a refused plan lacked per pool group, for its ``Refusal``: ``need`` (set beyond the GPU tier), or
        the block count where the plan was refused for exceeding ``MAX_BLOCKS_PER_CACHE``."""
        return self.need if any(self.need) else [self.num_blocks] * len(self.need)


class ResumePriorities:
    """Priorities of the pages a resume creates, per layer group (copy-on-write copies, scratch slots, live SSM
    states), asked of the user's callback before anything changes."""

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
    registry: CacheRegistry,
    scope: ReuseScope | None,
    tokens: list[Token],
    cache_id: int,
    priority_callback: PriorityCallback | None,
    order: LruOrder | None = None,
) -> CacheState:
    """A suspended cache holding the longest reusable prefix of ``tokens``; ``order`` first remembers where the
    matched pages stand in their eviction lists (a batch admission may have to put them back)."""
    registry.next_id = cache_id + 1
    match = services.matcher.match(scope, tokens)
    remote = services.remote
    if remote is not None and remote.fetch_prefix(scope, tokens, match.length, match.partial_source):
        extended = services.matcher.match(scope, tokens)  # the fetched blocks extend it
        if extended.length >= match.length:  # else a fill that failed in part hides a partial match: keep that one
            match = extended
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
    return CacheState(services, registry, match, tokens, cache_id, priority_callback)


class CacheState(CacheView):
    """One request's KV cache, made by ``KVCacheManager.create_kv_cache``: its blocks' pages in every layer group.

    The manager keeps it (among its open caches) and the engine holds it through a ``KVCache`` handle, which
    closes it when dropped.

    It starts SUSPENDED; ``resume`` locks its pages on the GPU, ``resize`` sets how many tokens it can hold
    (``capacity``) and how many of them are history, ``commit`` makes finished tokens reusable by later requests,
    ``suspend`` lets its pages move to colder tiers, ``close`` ends it. Lengths always satisfy
    ``num_committed_tokens <= history_length <= capacity``.
    """

    def __init__(
        self,
        services: CacheServices,
        registry: CacheRegistry,
        match: Match,
        tokens: list[Token],
        cache_id: int,
        priority_callback: PriorityCallback | None,
    ) -> None:
        super().__init__(services, match, tokens, cache_id, priority_callback)
        self._registry: CacheRegistry = registry
        registry.live[cache_id] = self
        # Why this cache's latest resize/resume/admission answered False; kept until the next refusal.
        self.last_refusal: Refusal | None = None

    def commit_pending_stats(self) -> KVCacheStatsDelta:
        """This request's block counts since the last commit or discard, added to the manager's committed
        statistics (all zero without ``enable_request_stats``)."""
        pending = self.request_stats
        if pending is None:
            return KVCacheStatsDelta()
        self.request_stats: KVCacheStatsDelta | None = KVCacheStatsDelta()
        total = self._services.committed_stats
        total.alloc_total_blocks += pending.alloc_total_blocks
        total.alloc_new_blocks += pending.alloc_new_blocks
        total.reused_blocks += pending.reused_blocks
        total.missed_blocks += pending.missed_blocks
        return pending

    def discard_pending_stats(self) -> None:
        """Forget this request's block counts since the last commit or discard."""
        if self.request_stats is not None:
            self.request_stats = KVCacheStatsDelta()

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
    def cuda_stream(self) -> CudaStream:
        """The stream the manager orders this cache's copies on: the last one given to ``resume`` or set here
        (``resume()`` without a stream uses it)."""
        return self._cuda_stream

    @cuda_stream.setter
    def cuda_stream(self, value: SupportsIndex) -> None:
        self._check_open()
        stream = CudaStream(as_int(value, "cuda_stream"))
        if self._status == KVCacheStatus.ACTIVE:
            self.resume(stream)
        else:
            self._cuda_stream = stream


    # ------------------------------------------------------------------------------------------- lifecycle
    def resume(self, cuda_stream: SupportsIndex | None = None) -> bool:
        """Bring every needed page to the GPU and lock it (one batched migration); False, changing nothing, when
        GPU memory is short or utilisation would exceed ``max_util_for_resume``."""
        self._check_open()
        stream = self._cuda_stream if cuda_stream is None else CudaStream(as_int(cuda_stream, "cuda_stream"))
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
            raise ValueError(f"capacity {capacity} is below the {self._capacity} reused tokens")
        return AdmissionPlan(self._plan_resize(capacity, self._history), self._resume_priorities())

    def admit(self, plan: AdmissionPlan, stream: CudaStream) -> bool:
        """Resume and grow as planned, as one step that either fits whole or changes nothing (batch admission)."""
        if plan.growth.refused:
            self._refuse("create_kv_cache_batch", plan.growth.shortage())
            return False
        return self._resume_with(plan.growth, stream, plan.priorities)

    def _resume_priorities(self) -> ResumePriorities:
        num_groups = len(self.groups)
        cow: list[int] = [DEFAULT_PRIORITY] * num_groups
        for group in self.groups:
            if group.cow_source is not None:
                cow[group.id] = self._priority(len(self._blocks), group.id)
        scratch: list[int] = [DEFAULT_PRIORITY] * num_groups
        for group in self.groups:
            if group.scratch_slot_count(group.scratch_range) > 0:
                scratch[group.id] = self._priority(0, group.id)
        ssm: list[int] = [DEFAULT_PRIORITY] * num_groups
        for group in self.groups:
            if group.wants_live_state():
                ssm[group.id] = self._priority(0, group.id)
        return ResumePriorities(cow, scratch, ssm)

    def _resume_with(self, growth: ResizePlan | None, stream: CudaStream, priorities: ResumePriorities | None = None) -> bool:
        services = self._services
        store = services.store
        if priorities is None:
            priorities = self._resume_priorities()  # before any change: a failing callback leaves no trace
        held = self.live_entries()
        num_pool_groups = len(services.layout.pool_groups)
        need = [0] * num_pool_groups if growth is None else list(growth.need)
        pinned = [[0] * len(store.tiers) for _ in range(num_pool_groups)]
        onboard = [[0] * len(store.tiers) for _ in range(num_pool_groups)]
        for page in held:
            if page.level != 0:
                onboard[page.pool_group][page.level] += 1
            if page.queue is store.queues[page.level][page.pool_group].held:
                pinned[page.pool_group][page.level] += 1
        for group in self.groups:
            need[group.pool_group] += group.resume_need()
        if not store.fits(need, services.settings.max_util_for_resume, pinned, onboard):
            call = "KVCache.resume" if growth is None else "create_kv_cache_batch"
            self._refuse(call, need, services.settings.max_util_for_resume, pinned, onboard)
            return False
        for page in held:
            store.lock(page)
            store.unhold(page)
        store.onboard_all(held)
        for group in self.groups:
            group.resolve_cow(len(self._blocks), priorities.cow[group.id])
        for group in self.groups:
            group.start_live_state(priorities.ssm[group.id])
        for group in self.groups:
            group.fill_scratch_slots(priorities.scratch[group.id])
        store.flush(stream)
        self._status = KVCacheStatus.ACTIVE
        self._cuda_stream = stream
        for group in self.groups:
            group.rebuild_indices(self._history)
        if growth is not None:
            self._apply_resize(growth)
        return True

    def _refuse(
        self,
        call: str,
        need: list[int],
        max_util: float | None = None,
        pinned: list[list[int]] | None = None,
        onboard: list[list[int]] | None = None,
    ) -> None:
        """Record why the step was refused (refusal path only), here and as the manager's latest refusal."""
        own = [0] * len(need)
        for page in self.live_entries():
            if page.level == 0:
                own[page.pool_group] += 1
        refusal = explain_refusal(self._services.store, call, need, own, max_util, pinned, onboard)
        self.last_refusal = refusal
        self._services.last_refusal = refusal

    def suspend(self) -> None:
        """Locks become holds: pages may later move to colder tiers but are never lost."""
        self._check_open()
        if self._status != KVCacheStatus.ACTIVE:
            return
        self._unlock_all()
        self._status = KVCacheStatus.SUSPENDED
        for group in self.groups:
            group.clear_indices()
        self._services.after_call()

    def _unlock_all(self, closing: bool = False) -> None:
        """Leaving ACTIVE: locked entries become held, scratch slots go, and the stream is fenced. ``closing``: the
        caller unholds every entry next, which files each page once, where it ends up (not first as held)."""
        store = self._services.store
        if closing:
            for page in self.live_entries():
                store.lock_to_hold(page)
        else:
            for page in self.live_entries():
                store.hold(page)
                store.unlock(page)
        for group in self.groups:
            group.free_scratch_slots()
        store.stream_order.release(self._cuda_stream)

    def resize(self, capacity: SupportsIndex, history_length: SupportsIndex | None = None) -> bool:
        """Move capacity and history together: stale blocks lose their pages first, then new blocks get pages
        (and, with scratch reuse, this chunk's out-of-window blocks get shared scratch slots instead).

        False, with every length, page index and slot count as before, when GPU memory is short.

        A step that stays inside the last block and leaves every stale range as it is (31 of 32 decode steps)
        changes only the two lengths: it takes an O(1) path without planning, allocation or copies.
        """
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
            ):
                self._capacity = capacity
                self._history = history
                self._services.after_call()
                return True
        return self._resize_planned(capacity, history_length)

    def _resize_planned(self, capacity: SupportsIndex, history_length: SupportsIndex | None) -> bool:
        self._check_active("resize")
        new_capacity, new_history = self._check_resize(capacity, history_length)
        plan = self._plan_resize(new_capacity, new_history)
        if plan.refused:  # beyond every GPU slot (plan.need says where) or beyond MAX_BLOCKS_PER_CACHE blocks
            self._refuse("KVCache.resize", plan.shortage())
            self._services.after_call()
            return False
        released = self._release_newly_stale(new_history, min(self.num_blocks, plan.num_blocks))
        if not self._services.store.fits(plan.need, None):
            self._undo_release(released)
            self._refuse("KVCache.resize", plan.need)
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
                    f"base page index buffer of layer group {group.id} holds {len(buffer)} entries, fewer than the "
                    f"{new_blocks} blocks of capacity {new_capacity}"
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
            new_capacity, new_history, ceil_div(new_capacity, services.tokens_per_block), len(services.layout.pool_groups)
        )
        new_blocks = plan.num_blocks
        if plan.refused or (new_blocks - old_blocks > services.store.num_gpu_slots and self._beyond_gpu(plan)):
            return plan
        rewind = services.settings.max_rewind_len
        enabled = self._scratch_enabled
        for group in self.groups:
            scratch = group.target_scratch(new_history, new_capacity, rewind, enabled)
            plan.scratch.append(scratch)
            plan.scratch_priority.append(DEFAULT_PRIORITY)
            group.plan_forgotten(old_blocks, new_blocks, scratch, plan.forgotten)
            plan.need[group.pool_group] += group.plan_wanted(old_blocks, new_blocks, new_history, scratch, plan.wanted)
            extra = group.extra_scratch_slots(scratch, enabled)
            if extra > 0:
                plan.need[group.pool_group] += extra
                plan.scratch_priority[group.id] = self._priority(0, group.id)
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
        rewind = services.settings.max_rewind_len
        for group in self.groups:
            scratch_beg, scratch_end = group.target_scratch(plan.history, plan.capacity, rewind, self._scratch_enabled)
            pages = group.life_cycle.pages_needed(plan.capacity, plan.history) - (scratch_end - scratch_beg)
            live[group.pool_group] += max(0, pages)
        pool_groups = services.store.tiers[0].pool_groups
        if all(count <= pool_groups[pool_group].num_slots for pool_group, count in enumerate(live)):
            return False
        plan.need = live
        return True

    def _apply_resize(self, plan: ResizePlan) -> None:
        store = self._services.store
        new_blocks = plan.num_blocks
        for lc, ordinal, page in plan.forgotten:
            self.groups[lc].forget(ordinal, page, self._history)
        for group in self.groups:
            group.resize_tables(new_blocks, plan.scratch[group.id])
        decode_step = plan.capacity - plan.history == 1
        request = self.request_stats
        if request is not None and plan.wanted:
            new_block_count = len({ordinal for _, ordinal in plan.wanted})
            request.alloc_new_blocks += new_block_count
            request.alloc_total_blocks += new_block_count
        for position, (lc, ordinal) in enumerate(plan.wanted):
            priority = plan.priorities[position] if plan.priorities else DEFAULT_PRIORITY
            group = self.groups[lc]
            page = store.new_page(group.id, group.pool_group, priority)
            group.entries[ordinal] = page
            group.set_index(ordinal, page.slot)
            if decode_step:
                store.stats[lc].generation_pages += 1
        if self._scratch_enabled or self.has_scratch_slots:
            for group in self.groups:
                group.set_scratch(plan.scratch[group.id], plan.scratch_priority[group.id])
        store.flush(self._cuda_stream)
        self._capacity = plan.capacity
        self._history = plan.history
        self._note_history()

    def commit(
        self,
        accepted_input_tokens: TokenSequence,
        beam_search_indices: Sequence[SupportsIndex] | None = None,
        is_end: bool = False,
    ) -> None:
        """Append finalised tokens; each newly completed block joins the radix tree (or is rebased onto an
        identical one), then the history bump releases stale pages. ``is_end``: these are the last tokens
        (``stop_committing`` follows). ``beam_search_indices``: beam width is 1, so only beam 0.

        Plain-int tokens that complete no block and leave every stale range as it is (a decode step inside the
        last block) take an O(1) path: they join the trailing partial block and move the lengths, nothing else.
        """
        if (
            type(accepted_input_tokens) is list
            and beam_search_indices is None
            and is_end is False
            and self._status is KVCacheStatus.ACTIVE
            and not self._committing_stopped
            and not self._scratch_enabled
        ):
            tail = self._tail
            count = len(accepted_input_tokens)
            committed = self._committed + count
            if committed <= self._capacity and len(tail) + count < self._tpb and committed < self._steady_below:
                for token in accepted_input_tokens:
                    if type(token) is not int:
                        break
                else:
                    tail.extend(accepted_input_tokens)
                    self._committed = committed
                    if committed > self._history:
                        self._history = committed
                    self._services.after_call()
                    return
        self._commit_checked(accepted_input_tokens, beam_search_indices, is_end)

    def _commit_checked(
        self, accepted_input_tokens: TokenSequence, beam_search_indices: Sequence[SupportsIndex] | None, is_end: bool
    ) -> None:
        self._check_active("commit")
        if self._committing_stopped:
            raise ValueError(f"commit after stop_committing on cache {self.id}")
        if not isinstance(is_end, bool):
            raise TypeError(f"is_end must be a bool, got {is_end!r}")
        if beam_search_indices is not None:
            for position, beam in enumerate(beam_search_indices):
                if as_int(beam, f"beam_search_indices[{position}]") != DEFAULT_BEAM_INDEX:
                    raise ValueError(f"beam_search_indices[{position}] = {int(beam)}: beam width is 1")
        new_tokens = check_tokens(accepted_input_tokens, "accepted_input_tokens")
        if self._committed + len(new_tokens) > self._capacity:
            raise ValueError(
                f"committing {len(new_tokens)} tokens would exceed capacity {self._capacity} "
                f"({self._committed} already committed)"
            )
        self._check_scratch_history(max(self._history, self._committed + len(new_tokens)))
        services = self._services
        tpb = services.tokens_per_block
        tail = self._tail
        tail.extend(new_tokens)
        self._committed += len(new_tokens)
        full = len(tail) - len(tail) % tpb
        completed = full > 0
        if completed:
            stale = [group.life_cycle.stale(self._history) for group in self.groups]  # the same for every block
            for begin in range(0, full, tpb):
                self._commit_block(tuple(tail[begin : begin + tpb]), stale)
            del tail[:full]
        if completed and self._takes_snapshot():
            block = self._blocks[-1]
            for group in self.groups:
                group.snapshot_into(block, services.tree)
        if self._committed > self._history:
            released = self._release_newly_stale(self._committed, self.num_blocks)
            self._commit_release(released)
            self._history = self._committed
            self._note_history()
            if self._history == self._capacity:
                for group in self.groups:
                    group.set_scratch((0, 0), DEFAULT_PRIORITY)
        services.store.flush(self._cuda_stream)
        if is_end:
            self.stop_committing()
        services.after_call()

    def stop_committing(self) -> None:
        """No more commits: the trailing partial block joins the tree when the cache closes (the cache may
        still write past it until then), and held stale pages that can no longer be committed are freed."""
        self._check_open()
        if self._committing_stopped:
            return
        self._committing_stopped = True
        for group in self.groups:
            group.drop_uncommitted_stale(self._history, len(self._blocks))
        self._services.after_call()

    def close(self) -> None:
        """Release everything; committed pages stay in the tree as reusable content, the trailing partial block
        included (as ``stop_committing`` would publish it). Idempotent."""
        if self._status == KVCacheStatus.CLOSED:
            return
        self._release(observed=True)

    def discard(self) -> None:
        """Close a cache that a batch admission created but did not hand out, leaving no observed length."""
        self._release(observed=False)

    def _release(self, observed: bool) -> None:
        services = self._services
        tree = services.tree
        if self._status == KVCacheStatus.ACTIVE:
            self._unlock_all(closing=True)
        for group in self.groups:
            group.release_cow_source()
        for group in self.groups:
            group.release_snapshot_source()
        for group in self.groups:
            group.release_live_state()
        partial: Block | None = None
        if self._tail:
            parent = self._blocks[-1] if self._blocks else self._root
            partial = tree.add_child(parent, tuple(self._tail))
        for group in self.groups:
            group.release_entries(partial, len(self._blocks), tree)
        self._root.users -= 1
        for block in self._blocks:
            block.users -= 1
        # Pruning the deepest block walks up through every ancestor it empties, the scope's root included.
        tree.prune(partial if partial is not None else (self._blocks[-1] if self._blocks else self._root))
        self._blocks = []
        self._status = KVCacheStatus.CLOSED
        for group in self.groups:
            group.clear_buffer()
        del self._registry.live[self.id]
        if observed:
            self._registry.observed_lengths.append((self._capacity, self._history))
            # Not for ``discard``: its batch admission still has claims out, and runs the check once it is done.
            services.after_call()

    # ------------------------------------------------------------------------------------------- internals
    def _commit_block(self, block_tokens: BlockTokens, stale: list[tuple[int, int]]) -> None:
        """Add the next block to the tree; ``stale``: each group's stale range at the history."""
        tree = self._services.tree
        ordinal = len(self._blocks)
        parent = self._blocks[-1] if self._blocks else self._root
        block = tree.add_child(parent, block_tokens)
        block.users += 1
        self._blocks.append(block)
        for group in self.groups:
            group.commit_entry(block, ordinal, stale[group.id], tree)

    def _takes_snapshot(self) -> bool:
        """Whether the commit just made ends where SSM snapshots are taken: a block boundary on the reuse
        interval that is also the end of the computed chunk (``capacity``): the live state holds every token the
        engine computed, so a commit that stops short of them would snapshot a state from the future."""
        services = self._services
        if not services.has_live_states or self._tail or self._committed != self._capacity:
            return False
        settings = services.settings
        if settings.snapshot_every_commit:
            return True
        interval = settings.ssm_reuse_interval
        return interval > 0 and self._committed % interval == 0

    def _release_newly_stale(self, new_history: int, num_blocks: int) -> list[Released]:
        """Unlock entries entering the stale range: committed ones are dropped from the cache (kept in the tree,
        evictable), uncommitted ones become held. Reversible until ``_commit_release``."""
        released: list[Released] = []
        for group in self.groups:
            group.release_newly_stale(self._history, new_history, num_blocks, released)
        return released

    def _undo_release(self, released: list[Released]) -> None:
        store = self._services.store
        for lc, ordinal, page in released:
            store.lock(page)
            store.unhold(page)
            self.groups[lc].set_index(ordinal, page.slot)

    def _commit_release(self, released: list[Released]) -> None:
        """Finish a release: committed pages leave the cache; uncommitted ones stay held, or are freed once
        committing has stopped."""
        store = self._services.store
        for lc, ordinal, page in released:
            if page.block is not None or self._committing_stopped:
                self.groups[lc].entries[ordinal] = None
                store.unhold(page)
                if page.block is None:
                    store.free(page)

