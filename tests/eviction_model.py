"""An independent reference model of priority-LRU eviction (SPEC §4, README "What an engine can rely on"),
written from the documentation, not from the page store: ``tests/test_eviction_model.py`` drives the real manager
and this model with the same calls and compares which blocks are cached, on which tier.

The rules modelled (one full-attention layer group, one pool group per tier, full blocks only):

- A tier's slots hold pages; a committed block's page stays in the radix tree after its caches close (reusable,
  droppable once no cache uses it). A new cache holds the pages of the longest prefix of full blocks whose pages
  all still exist (on any tier); ``resume`` brings them to the GPU and locks them (an active cache's pages never
  move); ``suspend`` turns locks into holds (a held page may move colder, never be dropped).
- Making room in a tier takes the unlocked pages there, lowest priority first, least recently used within a
  priority; a victim moves to the next tier (making room there the same way) and is dropped where there is none
  and nobody holds it.
- A page's priority is the callback's answer for its block ordinal when the page was allocated; a reuse does not
  change it. A page's use time is when it was last released (its last cache closed or suspended); a close
  releases the deepest block first, so a cached prefix is shortened from its tail.
- A call that fails for room (``resume``, ``resize``) changes nothing.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Callable

Path = tuple[int, ...]  # a committed block: every token from the root to the block's end


@dataclass
class ModelPage:
    level: int
    priority: int
    stamp: int
    path: Path | None = None  # the tree block it is the page of, None while private
    users: set[int] = field(default_factory=set)


@dataclass
class ModelCache:
    tokens: list[int]
    priority: Callable[[int], int]
    pages: list[ModelPage]
    committed_blocks: int
    active: bool = False


class EvictionModel:
    """What the documentation says the manager keeps, tier by tier (level 0 is the GPU)."""

    def __init__(self, slots: list[int], tokens_per_block: int) -> None:
        self.slots = slots
        self.tpb = tokens_per_block
        self.tree: dict[Path, ModelPage] = {}
        self.caches: dict[int, ModelCache] = {}
        self.private: list[ModelPage] = []
        self._clock = itertools.count()
        self.moves = [0] * len(slots)  # pages moved into each tier by eviction
        self.drops = 0  # cached blocks dropped by eviction
        self.refusals = 0  # resume / resize calls refused for room
        self._waiting: list[ModelPage] = []  # a resuming cache's pages still to onboard, in onboarding order

    # -- what is observed ---------------------------------------------------------------------------------------
    def levels(self) -> dict[Path, int]:
        """Each tree block that has a page, and the tier of that page."""
        return {path: page.level for path, page in self.tree.items()}

    def used(self, level: int) -> int:
        return sum(1 for page in self._pages() if page.level == level)

    def free(self, level: int) -> int:
        return self.slots[level] - self.used(level)

    def match_blocks(self, tokens: list[int]) -> int:
        """Full blocks of ``tokens`` reusable now: the longest prefix whose blocks all have a page."""
        count = 0
        while (count + 1) * self.tpb <= len(tokens) and tuple(tokens[: (count + 1) * self.tpb]) in self.tree:
            count += 1
        return count

    # -- the calls ----------------------------------------------------------------------------------------------
    def create(self, cache_id: int, tokens: list[int], priority: Callable[[int], int]) -> int:
        matched = self.match_blocks(tokens)
        pages = [self.tree[tuple(tokens[: (i + 1) * self.tpb])] for i in range(matched)]
        for page in pages:
            page.users.add(cache_id)
        self.caches[cache_id] = ModelCache(list(tokens), priority, pages, matched)
        self._release(pages)
        return matched * self.tpb

    def resume(self, cache_id: int) -> bool:
        def attempt() -> bool:
            cache = self.caches[cache_id]
            cache.active = True  # its pages are locked from here on: none of them is a victim
            # One at a time, warmest colder tier first: each page moved up frees its slot for the next victim, and
            # a tier full of the cache's own waiting pages sends its last one a tier down to let a victim through.
            self._waiting = sorted((page for page in cache.pages if page.level > 0), key=lambda page: page.level)
            try:
                while self._waiting:
                    if not self._make_room(0, 1):
                        return False
                    self._waiting.pop(0).level = 0
            finally:
                self._waiting = []
            return True

        return self._all_or_nothing(attempt)

    def resize(self, cache_id: int, capacity: int) -> bool:
        def attempt() -> bool:
            cache = self.caches[cache_id]
            wanted = -(-capacity // self.tpb)
            new = wanted - len(cache.pages)
            if new > 0 and not self._make_room(0, new):
                return False
            for ordinal in range(len(cache.pages), wanted):
                page = ModelPage(0, cache.priority(ordinal), -1, None, {cache_id})
                cache.pages.append(page)
                self.private.append(page)
            return True

        return self._all_or_nothing(attempt)

    def commit(self, cache_id: int, num_tokens: int) -> None:
        """Commit the cache's tokens up to ``num_tokens`` (whole blocks only)."""
        cache = self.caches[cache_id]
        for ordinal in range(cache.committed_blocks, num_tokens // self.tpb):
            path = tuple(cache.tokens[: (ordinal + 1) * self.tpb])
            page = cache.pages[ordinal]
            existing = self.tree.get(path)
            self.private.remove(page)
            if existing is not None and existing.level == 0:  # rebasing: the GPU copy is adopted, ours is freed
                existing.users.add(cache_id)
                cache.pages[ordinal] = existing
                continue
            if existing is not None:  # a colder copy leaves the tree for ours (kept by the caches using it)
                existing.path = None
                if existing.users:
                    self.private.append(existing)
            page.path = path
            self.tree[path] = page
        cache.committed_blocks = max(cache.committed_blocks, num_tokens // self.tpb)

    def suspend(self, cache_id: int) -> None:
        cache = self.caches[cache_id]
        cache.active = False
        self._release(cache.pages)

    def close(self, cache_id: int) -> None:
        cache = self.caches.pop(cache_id)
        for page in cache.pages:
            page.users.discard(cache_id)
            if page.path is None and not page.users:
                self.private.remove(page)
        self._release([page for page in cache.pages if page.path is not None])

    def prefetch(self, cache_id: int, evict: bool, admission_util: float) -> int:
        """Bring a suspended cache's colder pages up, warmest tier first and block order within one, into free GPU
        slots (or, with ``evict``, making room as ``resume`` would, up to what ``resume`` could then lock)."""
        cache = self.caches[cache_id]
        movable = [page for page in cache.pages if not self._locked(page)]
        budget = int(admission_util * self.slots[0]) - sum(
            1 for page in self._pages() if page.level == 0 and self._locked(page)
        )
        budget -= sum(1 for page in movable if page.level == 0)
        moved = 0
        claimed = set(map(id, movable)) if evict else set()
        for page in sorted((page for page in movable if page.level > 0), key=lambda page: page.level):
            if evict and budget <= 0:
                break
            if self.free(0) > 0 or (evict and self._make_room(0, 1, claimed)):
                page.level = 0
                moved += 1
                budget -= 1
        self._release(movable)
        return moved

    def offload(self, cache_id: int) -> int:
        """Move a suspended cache's GPU pages to the warmest colder tier with a free slot (nothing evicted)."""
        cache = self.caches[cache_id]
        movable = [page for page in cache.pages if not self._locked(page)]
        moved = 0
        for page in reversed(movable):  # the deepest first, as eviction would
            if page.level != 0:
                continue
            for level in range(1, len(self.slots)):
                if self.free(level) > 0:
                    page.level = level
                    moved += 1
                    break
        self._release(movable)
        return moved

    # -- eviction -----------------------------------------------------------------------------------------------
    def _release(self, pages: list[ModelPage]) -> None:
        """Stamp pages leaving a cache's lock, deepest block first (the oldest use)."""
        for page in reversed(pages):
            page.stamp = next(self._clock)

    def _locked(self, page: ModelPage) -> bool:
        return any(self.caches[user].active for user in page.users)

    def _pages(self) -> itertools.chain[ModelPage]:
        return itertools.chain(self.tree.values(), self.private)

    def _make_room(self, level: int, count: int, claimed: frozenset[int] | set[int] = frozenset()) -> bool:
        """Free ``count`` slots in tier ``level``; ``claimed``: ids of pages that must stay where they are."""
        while self.free(level) < count:
            candidates = [
                page
                for page in self._pages()
                if page.level == level and not self._locked(page) and id(page) not in claimed
            ]
            candidates.sort(key=lambda page: (page.priority, page.stamp))
            ours = [page for page in self._waiting if page.level == level]
            for victim in candidates + ours[-1:]:
                if level + 1 < len(self.slots) and self._make_room(level + 1, 1, claimed):
                    victim.level = level + 1
                    victim.stamp = next(self._clock)  # the most recent arrival of its tier
                    if victim in ours:
                        self._waiting.sort(key=lambda page: page.level)
                    self.moves[level + 1] += 1
                    break
                if victim.path is not None and not victim.users:
                    del self.tree[victim.path]
                    self.drops += 1
                    break
            else:
                return False
        return True

    def _all_or_nothing(self, attempt: Callable[[], bool]) -> bool:
        saved = copy.deepcopy((self.tree, self.caches, self.private))
        if attempt():
            return True
        self.tree, self.caches, self.private = saved
        self.refusals += 1
        return False
