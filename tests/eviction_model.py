"""An independent reference model of priority-LRU eviction (SPEC §3, §4, README "What an engine can rely on"),
written from the documentation, not from the page store: ``tests/test_eviction_model.py`` drives the real manager
and this model with the same calls and compares which blocks are cached, on which tier.

The rules modelled (attention layer groups, full or windowed, with sink tokens or not; full blocks only):

- A tier's slots hold pages, one per (layer group, block), in that layer group's pool group. A committed block's
  pages stay in the radix tree after its caches close (reusable; droppable once no cache uses them).
- A block stays in the tree while it or a descendant has a page, or a live cache committed it (pages or not): a
  match walks through the blocks the tree holds; partial reuse looks for a sibling past the last of them, and
  where the match steps back, inside the block it steps back to: the longest end some sibling serves in every
  layer group, the first in the tree's order on a tie (``EvictionTree._join_children``: as they joined, the first
  place refilled while a block has fewer than 8 children).
- A new cache matches the longest prefix of full blocks that every layer group can serve: full attention needs a
  page for every block, a window the blocks inside it at the matched length. It holds those pages (on any tier);
  ``resume`` brings them to the GPU and locks them (an active cache's pages never move); ``suspend`` turns locks
  into holds (a held page may move colder, never be dropped). A window's blocks that fall out of it when the
  history grows leave the cache (committed: they stay cached, droppable).
- Making room in a tier's pool group takes its unlocked pages, lowest priority first, least recently used within
  a priority; a victim moves to the next tier (making room there the same way) and is dropped where there is none
  and nobody holds it (the lowest droppable page is dropped when the victim is held and cannot move).
- A page's priority is the callback's answer for its block ordinal when the page was allocated; a reuse does not
  change it. A page's use time is when it was last filed in an eviction list: released by its last locking cache
  (suspend, close, falling out of a window), held by a new cache, moved to another tier by eviction or by a
  placement hint. Pages filed together are filed last block first, every layer group's page of a block together,
  so eviction shortens a cached prefix in every layer group alike; but
  blocks that a window passes are filed in the order it passed them (the first block first): a longer match
  needs the window's later blocks, a shorter one the earlier.
- ``resume`` onboards one page at a time, warmest colder tier first; a tier full of the resuming cache's own
  waiting pages sends its last one a tier down to let a victim through. Then it copies the blocks it reuses the
  first tokens of (partial reuse), layer group by layer group: their pages wait behind the others (no other
  eviction moves them) and each is filed once copied, room for the next. A call refused for room (``resume``,
  ``resize``) changes nothing.
- A cache closed having committed only the first tokens of a block (copied at its resume) leaves its page of that
  block to the block it copied them from where that block has no page of that layer group holding as many: such a
  page holds fewer tokens than its block (no KV event tells of it), serves only matches ending inside the block,
  and is evicted like any page.
- A block committed again while its cached page is off the GPU replaces that page (the colder copy leaves the
  tree: freed, or kept where it is in the order by the caches using it until they let go of it or their window
  passes it); a GPU copy is adopted instead of the cache's own page.

The SSM rules (a hybrid setup: an SSM layer group in a pool group of its own; no partial reuse; README "An SSM
layer group's state is one slot per cache", "Chunks are committed whole where the manager relies on it"):

- A cache's SSM group has no page per block: one live state, a page of that group allocated on the GPU at the
  cache's first resume (priority: the callback's for block 0), locked while the cache is active, held while it is
  suspended (so it may move colder and is onboarded again by the next resume, as any held page), freed at close.
- A commit of new tokens that ends at the cache's capacity on a block boundary within the prompt the cache was
  created with, its end included (``snapshot_prefill_chunks``), or past it on a multiple of
  ``ssm_reuse_interval`` (any block boundary with ``mamba_save_last_snapshot``) gives that block a snapshot
  (unless it has one): a new page with the live state's priority, filed as used now, on the GPU if a slot can
  be had (making room as for any page) or else on the warmest colder tier with room; skipped when none has. A snapshot is the SSM group's page of its block, evicted like any page of its pool
  group.
- A match needs, besides the attention pages, the snapshot of its last block (on any tier): the longest prefix
  of whole blocks ending on a snapshot. The new cache holds that snapshot (filed with its other pages); its first
  resume copies it, wherever it is, into the live state (no onboarding: held, not locked, it may even move
  colder to make room for that live state) and lets go of it (filed as used now).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from tests.eviction_tree import Entry, EvictionTree, Key, ModelCache, ModelPage, Path, filing_order

__all__ = ["Entry", "EvictionModel", "Key", "ModelCache", "ModelPage", "Path", "filing_order"]


class EvictionModel(EvictionTree):
    """What the documentation says the manager keeps, tier by tier, through each call it models."""

    # -- the calls ----------------------------------------------------------------------------------------------
    def create(self, cache_id: int, tokens: list[int], priority: Callable[[int, int], int]) -> int:
        length, sources = self.match(tokens)
        matched = length // self.tpb
        pages = {(lc, o): self.tree[(lc, self._path(tokens, o))] for lc, o in self._needed(length, matched)}
        for page in pages.values():
            page.users.add(cache_id)
        for source in sources.values():
            source.copy_sources_for.add(cache_id)
        self.partial_matches += bool(sources)
        cache = ModelCache(list(tokens), priority, pages, matched, length, copy_sources=sources)
        cache.copied_from = next((page.path for page in sources.values()), None)
        cache.ssm_source = self._snapshot(tokens, matched)
        self.snapshot_matches += cache.ssm_source is not None
        cache.prompt_length = len(tokens)
        held = [cache.ssm_source] if cache.ssm_source is not None else []
        for page in held:
            page.users.add(cache_id)
        self.caches[cache_id] = cache
        self._file(list(pages.values()) + list(sources.values()) + held)
        return length

    def resume(self, cache_id: int, util: float) -> bool:
        """Lock the cache's pages on the GPU (``util``: ``max_util_for_resume``)."""
        return self._all_or_nothing(lambda: self._onboard(cache_id, util, set()))

    def resize(self, cache_id: int, capacity: int) -> bool:
        """Grow an active cache to ``capacity`` (its history stays)."""
        return self._all_or_nothing(lambda: self._grow(cache_id, capacity, set()))

    def create_batch(self, requests: list[tuple[int, list[int], Callable[[int, int], int]]], util: float) -> list[bool]:
        """``create_kv_cache_batch`` of requests with no common prefix: every request's matched pages are claimed
        (no request's room is made from them), then each is resumed and grown to its prompt within ``util`` (its
        new pages counted), or refused leaving no trace (its matched pages keep their place in the eviction
        order). The SSM snapshots admitted requests copied are filed as the claims go, after every admission,
        in request order."""
        stamps = {id(page): page.stamp for page in self._pages()}
        for cache_id, tokens, priority in requests:
            self.create(cache_id, tokens, priority)
        claimed = {id(page) for cache_id, _, _ in requests for page in self._movable(cache_id)}
        snapshots = [self.caches[cache_id].ssm_source for cache_id, _, _ in requests]
        admitted = [  # the limit counts the pages locked once it is admitted (its own create + resume's count)
            self._all_or_nothing(
                lambda: self._onboard(cache_id, 1.0, claimed)
                and self._grow(cache_id, len(tokens), claimed)
                and self._within(util)
            )
            for cache_id, tokens, _ in requests
        ]
        for (cache_id, _, _), ok in zip(requests, admitted):
            if not ok:
                cache = self.caches.pop(cache_id)
                pages = list(cache.pages.values()) + ([cache.ssm_source] if cache.ssm_source is not None else [])
                for page in pages:
                    page.users.discard(cache_id)
                    if not self._locked(page):
                        page.stamp = stamps[id(page)]
        for snapshot, ok in zip(snapshots, admitted):  # copied by an admitted request: filed as the claims go
            if snapshot is not None and ok:
                self._file([snapshot])
        return admitted

    def _onboard(self, cache_id: int, util: float, claimed: set[int]) -> bool:
        cache = self.caches[cache_id]
        cache.active = True  # its pages are locked from here on: none of them is a victim
        colder = sorted((page for page in self._block_order(cache) if page.level > 0), key=lambda page: page.level)
        # The sources it copies from wait behind them, claimed (no other eviction moves them), unless an active
        # cache locks one or a batch claims it.
        waiting_sources = [
            page for page in cache.copy_sources.values() if not self._locked(page) and id(page) not in claimed
        ]
        self._waiting = colder + waiting_sources
        try:
            for _ in colder:
                if not self._make_room(0, self._group(self._waiting[0]), 1, claimed):
                    return False
                self._waiting.pop(0).level = 0
            for lc, source in cache.copy_sources.items():  # the partially reused block: copied into a page of ours
                if not self._make_room(0, self.pool_group_of[lc], 1, claimed):
                    return False
                ordinal = cache.history // self.tpb
                page = ModelPage(lc, ordinal, 0, cache.priority(ordinal, lc), users={cache_id})
                cache.pages[(lc, ordinal)] = page
                self.private.append(page)
                if self._waiting and self._waiting[0] is source:
                    self._waiting.pop(0)
                self._let_go_of_source(cache_id, source)  # filed once copied: room for the next page
        finally:
            self._waiting = []
        cache.copy_sources = {}
        if self.ssm is not None and (self.ssm, 0) not in cache.pages:  # first resume: the live state
            if not self._make_room(0, self.pool_group_of[self.ssm], 1, claimed):
                return False
            live = ModelPage(self.ssm, 0, 0, cache.priority(0, self.ssm), users={cache_id})
            cache.pages[(self.ssm, 0)] = live
            self.private.append(live)
            snapshot, cache.ssm_source = cache.ssm_source, None
            if snapshot is not None and id(snapshot) in claimed:  # a batch's: filed when the batch's claims go
                snapshot.users.discard(cache_id)
            elif snapshot is not None:
                self._let_go(cache_id, [snapshot])
        return self._within(util)

    def _within(self, util: float) -> bool:
        """SPEC §2: no GPU pool group fuller than ``util`` (``max_util_for_resume``) with pages locked."""
        return all(
            sum(1 for page in self._pages() if self._at(page, 0, group) and self._locked(page)) <= util * slots
            for group, slots in enumerate(self.slots[0])
        )

    def _grow(self, cache_id: int, capacity: int, claimed: set[int]) -> bool:
        cache = self.caches[cache_id]
        wanted = -(-capacity // self.tpb)
        new = [
            (lc, o)
            for lc in self.attention
            for o in range(wanted)
            if (lc, o) not in cache.pages and o not in self._stale(lc, cache.history)
        ]
        for pool_group in range(len(self.slots[0])):
            count = sum(1 for lc, _ in new if self.pool_group_of[lc] == pool_group)
            if count and not self._make_room(0, pool_group, count, claimed):
                return False
        for lc, o in new:
            page = ModelPage(lc, o, 0, cache.priority(o, lc), users={cache_id})
            cache.pages[(lc, o)] = page
            self.private.append(page)
        cache.capacity = max(cache.capacity, capacity)
        return True

    def commit(self, cache_id: int, num_tokens: int) -> None:
        """Commit the cache's tokens up to ``num_tokens`` (whole blocks), then move its history there."""
        cache = self.caches[cache_id]
        computed = num_tokens > cache.history  # an empty commit (the whole prompt reused) computed no state
        self._prune_children()
        for o in range(cache.committed_blocks, num_tokens // self.tpb):
            self._join_children(self._path(cache.tokens, o))
            for lc in self.attention:
                if (lc, o) in cache.pages:
                    self._commit_page(cache_id, cache, lc, o)
        if computed and num_tokens == cache.capacity and num_tokens % self.tpb == 0 and self._snapshot_point(cache, num_tokens):
            self._take_snapshot(cache, num_tokens // self.tpb)
        cache.committed_blocks = max(cache.committed_blocks, num_tokens // self.tpb)
        cache.history = max(cache.history, num_tokens)
        stale = [entry for entry in cache.pages if entry[1] in self._stale(entry[0], cache.history)]
        released = [cache.pages.pop(entry) for entry in stale]
        self._let_go(cache_id, released, left_window=True)

    def _snapshot_point(self, cache: ModelCache, num_tokens: int) -> bool:
        """Within the prompt (its end included: ``snapshot_prefill_chunks``), on the interval, or anywhere with
        ``mamba_save_last_snapshot``."""
        if self.ssm is None:
            return False
        if self.snapshot_every_block or num_tokens <= cache.prompt_length:
            return True
        return self.snapshot_interval > 0 and num_tokens % self.snapshot_interval == 0

    def _take_snapshot(self, cache: ModelCache, blocks: int) -> None:
        """Block ``blocks - 1`` gets a copy of the live state unless it has one: on the GPU if room can be made,
        else the warmest colder tier with room; skipped where none has."""
        assert self.ssm is not None
        key = (self.ssm, self._path(cache.tokens, blocks - 1))
        live = cache.pages.get((self.ssm, 0))
        if key in self.tree or live is None:
            return
        group = self.pool_group_of[self.ssm]
        for level in range(len(self.slots)):
            if self._make_room(level, group, 1):
                page = ModelPage(self.ssm, blocks - 1, level, live.priority, path=key[1])
                self.tree[key] = page
                self._file([page])
                return

    def extend(self, cache_id: int, tokens: list[int]) -> None:
        """The cache's tokens grew (a decode step's): ``tokens`` starts with the ones it had."""
        self.caches[cache_id].tokens = list(tokens)

    def suspend(self, cache_id: int) -> None:
        cache = self.caches[cache_id]
        cache.active = False
        self._file(cache.pages.values())

    def close(self, cache_id: int) -> None:
        """Release every page; with partial reuse, the cache's copied page of a block it committed only the first
        tokens of becomes the page of the first block extending those tokens (``_first_extending``) where that
        block has none holding as many (the generated prompts commit inside a block only so: the first tokens
        reused, the rest refused)."""
        cache = self.caches.pop(cache_id)
        for source in cache.copy_sources.values():
            source.copy_sources_for.discard(cache_id)
        unused_snapshot = [cache.ssm_source] if cache.ssm_source is not None else []  # never resumed
        tail = cache.history % self.tpb
        into = self._first_extending(cache.tokens[: cache.history]) if tail and cache.copied_from else None
        if into is not None:
            for lc in range(len(self.windows)):
                page = cache.pages.get((lc, cache.history // self.tpb))
                current = self.tree.get((lc, into))
                if page is None or page.path is not None or page.users != {cache_id}:
                    continue
                if current is None or (current.tokens or self.tpb) < tail:
                    if current is not None:
                        self._leave_tree(current)
                    page.path, page.tokens = into, tail
                    self.tree[(lc, into)] = page
                    self.private.remove(page)
        self._let_go(cache_id, list(cache.pages.values()) + unused_snapshot, also_filed=list(cache.copy_sources.values()))

    def prefetch(self, cache_id: int, evict: bool, admission_util: float) -> int:
        """Bring a suspended cache's colder pages up, warmest tier first and block order within one, into free GPU
        slots (or, with ``evict``, making room as ``resume`` would, up to what ``resume`` could then lock)."""
        movable = self._movable(cache_id)
        budget = [
            int(admission_util * slots) - sum(1 for page in self._pages() if self._at(page, 0, group) and self._locked(page))
            for group, slots in enumerate(self.slots[0])
        ]
        for page in movable:
            if page.level == 0:
                budget[self._group(page)] -= 1
        moved = 0
        claimed = set(map(id, movable)) if evict else set()
        for page in sorted((page for page in movable if page.level > 0), key=lambda page: page.level):
            group = self._group(page)
            if evict and budget[group] <= 0:
                continue
            if self.free(0, group) > 0 or (evict and self._make_room(0, group, 1, claimed)):
                page.level = 0
                moved += 1
                budget[group] -= 1
        self._file(movable)
        return moved

    def offload(self, cache_id: int) -> int:
        """Move a suspended cache's GPU pages, deepest first, to the warmest colder tier with a free slot."""
        movable = self._movable(cache_id)
        moved = 0
        for page in filing_order(movable):
            if page.level != 0:
                continue
            for level in range(1, len(self.slots)):
                if self.free(level, self._group(page)) > 0:
                    page.level = level
                    moved += 1
                    break
        self._file(movable)
        return moved

    def resize_tier(self, level: int, count: int) -> bool:
        """``manager.resize`` of a tier with one pool group (every cache suspended): a shrink evicts as making room
        does; refused, changing nothing, when what must stay would not fit."""

        def attempt() -> bool:
            self.slots[level] = [count]
            return self._make_room(level, 0, 0)

        return self._all_or_nothing(attempt)

    def clear(self) -> None:
        """``clear_reusable_blocks`` (every cache closed)."""
        self.tree.clear()

    # -- helpers ------------------------------------------------------------------------------------------------
    def _movable(self, cache_id: int) -> list[ModelPage]:
        """A cache's pages that no active cache locks, in block order, then the blocks it copies from and the
        snapshot its SSM live state starts from."""
        cache = self.caches[cache_id]
        snapshot = [cache.ssm_source] if cache.ssm_source is not None else []
        pages = self._block_order(cache) + list(cache.copy_sources.values()) + snapshot
        return [page for page in pages if not self._locked(page)]

    @staticmethod
    def _block_order(cache: ModelCache) -> list[ModelPage]:
        return [cache.pages[entry] for entry in sorted(cache.pages, key=lambda entry: (entry[1], entry[0]))]

    def _commit_page(self, cache_id: int, cache: ModelCache, lc: int, o: int) -> None:
        key = (lc, self._path(cache.tokens, o))
        page = cache.pages[(lc, o)]
        existing = self.tree.get(key)
        self.private.remove(page)
        if existing is not None and existing.level == 0 and existing.tokens is None:  # rebasing: the GPU copy is adopted
            existing.users.add(cache_id)
            cache.pages[(lc, o)] = existing
            return
        if existing is not None:  # a colder (or narrower) copy leaves the tree for ours (kept by its users)
            self._leave_tree(existing)
        page.path = key[1]
        self.tree[key] = page

    def _leave_tree(self, page: ModelPage) -> None:
        """Out of the tree for another page of its block: freed, or kept by the caches using it."""
        del self.tree[(page.life_cycle, page.path or ())]
        page.path = None
        if page.users:
            self.private.append(page)

    def _let_go(
        self, cache_id: int, pages: list[ModelPage], left_window: bool = False, also_filed: Sequence[ModelPage] = ()
    ) -> None:
        """A cache stops using ``pages``: private ones nobody else uses are freed, the others filed (``left_window``:
        blocks a window passed, in the order it passed them, the first block first), with ``also_filed``."""
        for page in pages:
            page.users.discard(cache_id)
        every = pages + list(also_filed)
        kept = [page for page in every if page.path is not None or page.users or page.copy_sources_for]
        for page in every:
            if page not in kept and page in self.private:
                self.private.remove(page)
        self._file(kept, left_window)

    def _let_go_of_source(self, cache_id: int, source: ModelPage) -> None:
        source.copy_sources_for.discard(cache_id)
        self._let_go(cache_id, [], also_filed=[source])

    def _file(self, pages: Iterable[ModelPage], in_block_order: bool = False) -> None:
        ordered = filing_order(pages)
        for page in reversed(ordered) if in_block_order else ordered:
            page.stamp = next(self._clock)

    def _locked(self, page: ModelPage) -> bool:
        """Used by an active cache, other than as the snapshot its first resume copies (held, not locked)."""
        return any(self.caches[user].active and self.caches[user].ssm_source is not page for user in page.users)

    def _make_room(self, level: int, pool_group: int, count: int, claimed: Iterable[int] = ()) -> bool:
        """Free ``count`` slots of a tier's pool group; ``claimed``: ids of pages that must stay where they are."""
        pinned = set(claimed)
        while self.free(level, pool_group) < count:
            waiting = {id(page) for page in self._waiting}
            candidates = [
                page
                for page in self._pages()
                if self._at(page, level, pool_group)
                and not self._locked(page)
                and id(page) not in pinned
                and id(page) not in waiting
            ]
            candidates.sort(key=lambda page: (page.priority, page.stamp))
            ours = [page for page in self._waiting if self._at(page, level, pool_group)]
            for victim in candidates + ours[-1:]:
                if level + 1 < len(self.slots) and self._make_room(level + 1, pool_group, 1, pinned):
                    victim.level = level + 1
                    victim.stamp = next(self._clock)  # the most recent arrival of its tier
                    self.moves[level + 1] += 1
                    break
                if victim.path is not None and not victim.users and not victim.copy_sources_for:
                    del self.tree[(victim.life_cycle, victim.path)]
                    self.drops += 1
                    break
            else:
                return False
        return True

    def _all_or_nothing(self, attempt: Callable[[], bool]) -> bool:
        """Run ``attempt``; if it answers False, put every page, cache and the tree back as they were."""
        pages = [(page, page.level, page.stamp, page.path, set(page.users), set(page.copy_sources_for)) for page in self._pages()]
        caches = [
            (cache, dict(cache.pages), cache.active, dict(cache.copy_sources), cache.ssm_source, cache.capacity)
            for cache in self.caches.values()
        ]
        tree, private, slots = dict(self.tree), list(self.private), [list(counts) for counts in self.slots]
        if attempt():
            return True
        self.slots = slots
        for page, level, stamp, path, users, copiers in pages:
            page.level, page.stamp, page.path, page.users, page.copy_sources_for = level, stamp, path, users, copiers
        for cache, entries, active, sources, ssm_source, capacity in caches:
            cache.pages, cache.active, cache.copy_sources = entries, active, sources
            cache.ssm_source, cache.capacity = ssm_source, capacity
        self.tree, self.private = tree, private
        self.refusals += 1
        return False
