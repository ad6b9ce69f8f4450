"""Whether eviction can make room for new GPU pages, decided before any page moves (``PageStore.can_obtain``)."""

from __future__ import annotations

from typing import Sequence

from .page import Page

# What a copy-on-write source becomes once a resume copied it (``RoomModel.obtain``'s ``sources``): still held by
# another suspended cache, freed (it left the tree while we held it), or droppable (nobody else uses it).
STILL_HELD = 0
FREED = 1
DROPPABLE = 2
# A copy whose source this resume does not claim (an active cache locks it, or a batch claims it): it makes no room.
UNCLAIMED = -1


class RoomModel:
    """Slot counts of one pool group on every tier, to decide before any move whether eviction can make room.

    Eviction moves pages down one tier at a time: a tier takes an incoming page into a free slot, in place of a
    droppable page (dropped, or itself moved down: the count is the same), or by pushing one of its held pages
    down, which works as long as it has a held page (its own or one that just came in) and the tier below takes
    it. Counting exactly as the moves go keeps a True from ever ending in a failed move, and a False from
    refusing room that pages passing through a tier could make.

    The caller's own pages waiting to be onboarded pass through the tiers too: where a tier has nothing else to
    move down, the waiting page to be onboarded last goes a tier down and is onboarded from there in its turn
    (``PageStore.onboard_all`` moves the same page), so a tier full of them does not block the pages above.
    Its copy-on-write sources wait behind them the same way (claimed, so nothing else moves them), and each one,
    once copied, is filed where it is: room for the pages the resume still needs (``KVCache.resume`` copies them
    before it allocates anything else).
    """

    def __init__(self, free: list[int], droppable: list[int], held: list[int], pooled_below: bool = True) -> None:
        """Per level (GPU first): free slots, droppable pages, and held pages that may move. ``pooled_below``: the
        colder levels' counts are of the one pool group every page of this one goes to; False where a cold-page
        codec groups them otherwise (the counts are then shares, see ``StoreOccupancy._room_model``), and a slot
        an onboarded page frees there, or a waiting page stepping down, may be in another pool group than the
        next page needs: neither is counted, nor a page pushed down as one that may move on."""
        self.pooled_below = pooled_below
        self.free = free
        self.droppable = droppable
        self.held = held
        self.last = len(free) - 1
        # Levels of the caller's pages in onboarding order; those from ``first_waiting`` on are not on the GPU yet.
        self.waiting: list[int] = []
        self.first_waiting = 0

    def obtain(self, new_pages: int, onboard: list[int] | None, sources: list[tuple[int, int]] | None = None) -> bool:
        """``new_pages`` GPU pages after onboarding ``onboard[level]`` pages; the first of them are copies of
        ``sources`` (each its level, or ``UNCLAIMED``, and what it becomes once copied: ``STILL_HELD``, ``FREED``,
        ``DROPPABLE``), in the order they are copied."""
        copies = [] if sources is None else sources
        onboarding = [] if onboard is None else [level for level in range(1, len(onboard)) for _ in range(onboard[level])]
        self.waiting = onboarding + [level for level, _ in copies]
        for index in range(len(onboarding)):
            self.first_waiting = index  # the page on its way up may itself step down first
            if not self._take(0):
                return False
            if self.pooled_below:
                self.free[self.waiting[index]] += 1
        for offset, (_, after) in enumerate(copies):
            index = len(onboarding) + offset
            self.first_waiting = index  # so may the source being copied
            if not self._take(0):
                return False
            self._release(self.waiting[index], after)
        self.waiting = []
        for _ in range(new_pages - len(copies)):
            if not self._take(0):
                return False
        return True

    def _release(self, level: int, after: int) -> None:
        """A copied source is filed at ``level`` (counted where the colder counts are of its pool group)."""
        if level == UNCLAIMED or (level > 0 and not self.pooled_below):
            return
        if after == STILL_HELD:
            self.held[level] += 1
        elif after == FREED:
            self.free[level] += 1
        else:
            self.droppable[level] += 1

    def vacate(self, level: int, count: int) -> bool:
        """Whether ``count`` pages can leave ``level`` (a quota shrink: nothing is locked)."""
        for _ in range(count):
            if not self._evict(level):
                return False
        return True

    def movable(self, level: int) -> int:
        """How many pages can leave ``level`` now (``vacate`` answers True up to it): the droppable ones, and held
        ones as far as the tiers below can take them (what ``obtain`` then finds, counted without moving)."""
        held = self.held[level]
        return self.droppable[level] + (min(held, self._room_below(level + 1)) if held > 0 else 0)

    def _room_below(self, level: int) -> int:
        """How many pages pushed from the tier above ``level`` can come in: its free and droppable slots, then
        (pushing its held pages down, those that came in too where the counts are of one pool group) the room
        below it."""
        if level > self.last:
            return 0
        here = self.free[level] + self.droppable[level]
        if level == self.last:
            return here
        if self.pooled_below:
            return here + (self._room_below(level + 1) if here + self.held[level] > 0 else 0)
        return here + min(self.held[level], self._room_below(level + 1))

    def _take(self, level: int) -> bool:
        """One slot at ``level`` for a page that comes in: a free one, else one that eviction empties."""
        if self.free[level] > 0:
            self.free[level] -= 1
            return True
        return self._evict(level)

    def _evict(self, level: int) -> bool:
        """One page leaves ``level``: a droppable one is dropped (or moved down: the count is the same), else a
        held one goes to the tier below."""
        if self.droppable[level] > 0:
            self.droppable[level] -= 1
            return True
        if self.held[level] > 0:
            if self._push(level + 1):
                self.held[level] -= 1
                return True
            return False
        waiting = last_waiting_at(self.waiting, self.first_waiting, level)
        if waiting >= 0 and self.pooled_below and level < self.last and self._take(level + 1):
            self.waiting[waiting] = level + 1
            return True
        return False

    def _push(self, level: int) -> bool:
        """A held page evicted from the tier above comes into ``level`` (and is held there; not counted as one
        that may move on where the counts are shares: it may sit in another pool group than the next one needs)."""
        if level > self.last or not self._take(level):
            return False
        if self.pooled_below:
            self.held[level] += 1
        return True


class WaitingPages:
    """A resuming cache's pages that may still step a tier down (``RoomModel``'s ``waiting``): those to onboard,
    in onboarding order, then its claimed copy-on-write sources, in copying order; from ``first`` on."""

    def __init__(self) -> None:
        self.pages: list[Page] = []
        self.first: int = 0

    def victim(self, level: int, pool_group: int, group_of: Sequence[int]) -> Page | None:
        """The waiting page ``RoomModel`` sends down from ``level`` (the last one there)."""
        ours = [page for page in self.pages[self.first :] if group_of[page.life_cycle] == pool_group]
        index = last_waiting_at([page.level for page in ours], 0, level)
        return None if index < 0 else ours[index]

    def reach(self, source: Page) -> bool:
        """Its turn to be copied (it may itself step down first); False if it is not one of ours."""
        for index in range(self.first, len(self.pages)):
            if self.pages[index] is source:
                self.first = index
                return True
        return False


def last_waiting_at(levels: list[int], first: int, level: int) -> int:
    """The index (from ``first`` on) of the last waiting page at ``level``, or -1: the one a tier with nothing
    else to move sends down (``RoomModel`` and ``PageStore`` pick the same)."""
    for index in range(len(levels) - 1, first - 1, -1):
        if levels[index] == level:
            return index
    return -1
