"""Whether eviction can make room for new GPU pages, decided before any page moves (``PageStore.can_obtain``)."""

from __future__ import annotations


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

    def obtain(self, new_pages: int, onboard: list[int] | None) -> bool:
        if onboard is not None:
            self.waiting = [level for level in range(1, len(onboard)) for _ in range(onboard[level])]
            for index in range(len(self.waiting)):
                self.first_waiting = index  # the page on its way up may itself step down first
                if not self._take(0):
                    return False
                if self.pooled_below:
                    self.free[self.waiting[index]] += 1
            self.waiting = []
        for _ in range(new_pages):
            if not self._take(0):
                return False
        return True

    def vacate(self, level: int, count: int) -> bool:
        """Whether ``count`` pages can leave ``level`` (a quota shrink: nothing is locked)."""
        for _ in range(count):
            if not self._evict(level):
                return False
        return True

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


def last_waiting_at(levels: list[int], first: int, level: int) -> int:
    """The index (from ``first`` on) of the last waiting page at ``level``, or -1: the one a tier with nothing
    else to move sends down (``RoomModel`` and ``PageStore`` pick the same)."""
    for index in range(len(levels) - 1, first - 1, -1):
        if levels[index] == level:
            return index
    return -1
