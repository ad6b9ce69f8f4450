"""``SuspendingCache``: how a cache leaves ACTIVE (``suspend``: its locks become holds, its scratch slots go, its
stream is fenced) and where a suspended cache's pages go meanwhile: the placement hints ``prefetch`` /
``prefetch_to`` / ``offload``, moves into free slots only (``prefetch(evict=True)`` alone evicts, within what a
``resume`` could lock). It is also where a cache's history can go back: ``recall_history``, for rows a batch
admission lent it that their writer will not compute (``lent_rows.py``; suspending a writer recalls them).
"""

from __future__ import annotations

from typing import Callable

from .._pages.page import Page
from .._pages.page_store import PageStore
from .cache_view import CacheView, KVCacheStatus
from .lent_rows import RowLoans, recall_beyond, recall_to
from .refusal import prefetch_refusal


class SuspendingCache(CacheView):
    """The suspend / placement-hint layer of ``CacheState``."""

    @property
    def history(self) -> int:
        """``history_length`` (whose setter ``CacheState`` adds), as a batch-sharing loan reads it."""
        return self._history

    @property
    def loans(self) -> RowLoans:
        """The batch-sharing loans this cache writes and reads (internal: ``lent_rows.py``)."""
        return self._loans

    def recall_history(self, position: int) -> None:
        """The rows from ``position`` on that this cache borrowed will not be written by their writer's step: its
        history goes back there (never below its commits), so the engine's next step computes them."""
        history = max(position, self._committed)
        if history < self._history:
            self._history = history
            self._note_history()
        recall_to(self, history)

    def suspend(self) -> None:
        """See ``KVCache.suspend``: locks become holds, and the rows it lent later requests of its batch but has not
        computed are recalled into their histories (its step will not run now)."""
        self._check_open()
        if self._status != KVCacheStatus.ACTIVE:
            return
        recall_beyond(self, self._history)
        self._unlock_all()
        self._status = KVCacheStatus.SUSPENDED
        for group in self.attention:
            group.clear_indices()
        self._services.after_call()

    def resumable_alone(self) -> bool:
        """See ``KVCache.resumable_alone``: the pages a resume would lock (every live entry, on any tier, and what
        it allocates) per GPU pool group, within ``admission_util`` of its slots, as ``explain_refusal`` counts
        the pages of a step that could not fit even alone."""
        self._check_open()
        services = self._services
        store = services.store
        pages = [0] * len(services.layout.pool_groups)
        gpu_group_of = store.grouping.group_of[0]  # a page's pool_group is its level's: count by the GPU's
        for page in self.live_entries():
            pages[gpu_group_of[page.life_cycle]] += 1
        for group in self.groups:
            pages[group.pool_group] += group.resume_need()
        util = services.settings.admission_util
        return all(count <= int(util * store.pool_group_slots(group)) for group, count in enumerate(pages))

    def prefetch(self, evict: bool = False) -> int:
        """See ``KVCache.prefetch``."""
        store = self._check_placement_hint("prefetch")
        moved = 0
        if evict:
            movable = self._movable_pages()
            moved = store.onboard_evicting(movable, self._prefetch_budget(movable))
        else:
            moved = self._move_where_free(store, lambda page: [0] if page.level != 0 else [])
        store.flush(self._cuda_stream)
        self._services.after_call()
        return moved

    def prefetch_to(self, target: int, evict: bool) -> bool:
        """See ``KVCache.prefetch`` with a ``target`` level: whether none of this cache's movable pages is left
        colder than it."""
        store = self._services.store
        if not 0 <= target < len(store.tiers):
            raise ValueError(f"target must be a cache level in [0, {len(store.tiers)}), got {target}")
        if evict and target != 0:
            raise ValueError(f"evict=True makes room on the GPU only (target 0), got target {target}")
        if target == 0:
            self.prefetch(evict)
        else:
            self._check_placement_hint("prefetch")
            self._move_where_free(store, lambda page: [target] if page.level > target else [])
            store.flush(self._cuda_stream)
            self._services.after_call()
        movable = self._movable_pages()
        left_colder = [page for page in movable if page.level > target]
        if left_colder:  # a soft False: its reason is kept, as every refusal's is
            admission_util = self._services.settings.admission_util
            self.note_refusal(prefetch_refusal(store, target, left_colder, movable, admission_util if evict else None))
        return not left_colder

    def offload(self) -> int:
        """See ``KVCache.offload``."""
        store = self._check_placement_hint("offload")
        colder = list(range(1, len(store.tiers)))
        moved = self._move_where_free(store, lambda page: colder if page.level == 0 else [], deepest_first=True)
        store.flush(self._cuda_stream)
        self._services.after_call()
        return moved

    def _move_where_free(self, store: PageStore, levels: Callable[[Page], list[int]], deepest_first: bool = False) -> int:
        """Move each movable page to the first of its ``levels`` with a free slot (onboarding: warmest colder tier
        first, block order within one; ``deepest_first``: last block first), then file them all as used now, last
        block first (as ``prefetch(evict=True)``, ``suspend`` and ``close`` do): eviction shortens their prefix
        instead of cutting its head. Returns how many moved."""
        movable = self._movable_pages()
        order = movable[::-1] if deepest_first else sorted(movable, key=PageStore.onboard_order)
        moved = sum(1 for page in order if any(store.move_if_free(page, level) for level in levels(page)))
        for page in reversed(movable):
            store.refile(page)
        return moved

    def _prefetch_budget(self, movable: list[Page]) -> list[int]:
        """Per pool group, the pages an evicting prefetch may bring to the GPU: what ``resume`` could then lock
        under ``admission_util`` (the watermark folded in), counting this cache's ``movable`` pages already there
        (its pages other caches lock are in ``num_locked``)."""
        store = self._services.store
        admission_util = self._services.settings.admission_util
        budget = [
            int(admission_util * store.pool_group_slots(pool_group)) - store.num_locked(pool_group)
            for pool_group in range(len(self._services.layout.pool_groups))
        ]
        for page in movable:
            if page.level == 0:
                budget[page.pool_group] -= 1
        return budget

    def _check_placement_hint(self, operation: str) -> PageStore:
        self._check_open()
        if self._status != KVCacheStatus.SUSPENDED:
            raise ValueError(f"KVCache.{operation} needs a suspended cache; cache {self.id} is active (suspend it first)")
        return self._services.store

    def _movable_pages(self) -> list[Page]:
        """This cache's pages, each once, that no active cache locks (those must stay where they are)."""
        seen: set[int] = set()
        result: list[Page] = []
        for page in self.held_pages():
            if page.lock_count == 0 and page.claim_count == 0 and id(page) not in seen:
                seen.add(id(page))
                result.append(page)
        return result

    def _unlock_all(self, closing: bool = False) -> None:
        """Leaving ACTIVE: locked entries become held, scratch slots go, and the stream is fenced. ``closing``: the
        caller unholds every entry next, which files each page once, where it ends up (not first as held)."""
        store = self._services.store
        if closing:
            for page in self.live_entries():
                store.lock_to_hold(page)
        else:
            for page in reversed(self.live_entries()):  # filed last block first, as at close: the deepest leaves first
                store.hold(page)
                store.unlock(page)
        for group in self.attention:
            group.free_scratch_slots()
        store.fence(self._cuda_stream)
