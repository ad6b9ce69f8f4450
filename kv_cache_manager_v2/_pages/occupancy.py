"""The page store's read side: what each tier and pool group holds, whether a step's pages can be had, and the
statistics and counters of what moved.

``PageStore`` derives from ``StoreOccupancy`` and adds everything that changes pages; the questions here change
nothing, so admission checks and statistics can ask them freely.
"""

from __future__ import annotations

from .._model.tier_grouping import TierGrouping
from .._observe.events import IterationStats, stats_growth
from .._storage.memory import PoolMemory
from .._storage.slots import StorageStatistics, TierStorage
from .movement_counters import MovementCounters
from .page import PriorityLru
from .room_model import RoomModel


class TierQueues:
    """Evictable pages of one tier and pool group: held ones (must survive) and droppable ones."""

    def __init__(self) -> None:
        self.held = PriorityLru()
        self.droppable = PriorityLru()


class StoreOccupancy:
    """Slots, eviction lists and counters per tier and pool group, and the read-only questions about them."""

    def __init__(self, tiers: list[TierStorage], num_life_cycles: int, grouping: TierGrouping) -> None:
        self.tiers = tiers
        # Each level's pool groups and each life cycle's pool group there; a page's ``pool_group`` is its level's.
        self.grouping = grouping
        self.queues: list[list[TierQueues]] = [[TierQueues() for _ in tier.pool_groups] for tier in tiers]
        self.stats: list[IterationStats] = [IterationStats(lc) for lc in range(num_life_cycles)]
        self._stats_taken = [IterationStats(lc) for lc in range(num_life_cycles)]
        self.counters: MovementCounters = MovementCounters()

    @property
    def last_level(self) -> int:
        return len(self.tiers) - 1

    def pools(self, level: int, pool_group: int) -> list[PoolMemory]:
        """The memory pools of one pool group in one tier; slot ``s`` is row ``s`` of each."""
        return self.tiers[level].pool_groups[pool_group].pools

    def gpu_pools(self) -> list[PoolMemory]:
        """Every pool of the GPU tier, pool group by pool group (what a transport registers)."""
        return [pool for pool_group in self.tiers[0].pool_groups for pool in pool_group.pools]

    # ------------------------------------------------------------------------------------------- capacity
    def can_obtain(
        self,
        pool_group: int,
        new_pages: int,
        onboard: list[int] | None = None,
        pinned: list[int] | None = None,
        sources: list[tuple[int, int]] | None = None,
        freed: list[list[int]] | None = None,
    ) -> bool:
        """Whether ``new_pages`` GPU pages can be had in a pool group after onboarding ``onboard[level]`` of the
        caller's pages from each colder level, as eviction would make room for them.

        ``pinned[level]`` of a tier's held pages are the caller's own, about to be locked: they make no room.
        ``freed[level][group]``: as if that many held pages of that level's pool group ``group`` (none of them
        ``pinned``) were freed first (a refusal asking what its cache's own held pages would give,
        ``refusal.own_stale_room``).
        Onboarding runs from the warmest colder level down (``PageStore.onboard_order``), each move freeing its
        old slot. The first new pages copy ``sources`` (``RoomModel.obtain``), held pages each filed once copied.
        """
        storage = self.tiers[0].pool_groups[pool_group]
        queues = self.queues[0][pool_group]
        wanted = new_pages
        if onboard is not None:
            for count in onboard:
                wanted += count
        freed_here = 0 if freed is None else freed[0][pool_group]
        if wanted <= storage.allocator.num_free + freed_here + queues.droppable.size:
            return True
        if wanted > storage.num_slots:
            return False
        return self._room_model(pool_group, pinned, 0, sources, freed).obtain(new_pages, onboard, sources)

    def fits(
        self,
        need: list[int],
        max_util: float | None,
        pinned: list[list[int]] | None = None,
        onboard: list[list[int]] | None = None,
        sources: list[list[tuple[int, int]]] | None = None,
        reserved: list[int] | None = None,
        freed: list[list[int]] | None = None,
    ) -> bool:
        """Whether ``need`` new GPU pages per pool group can be had after onboarding ``onboard[pool_group][level]``
        pages (``pinned[pool_group][level]``: held pages about to be locked; with ``max_util``, GPU utilisation
        after locking them must stay within it, not counting the ``reserved[pool_group]`` pages a batch claims for
        its other requests, ``num_locked``; ``sources[pool_group]``: the copy-on-write sources the first of them
        copy; ``freed[level][group]``: held pages of each level's pool groups supposed freed first, ``can_obtain``)."""
        return self.shortfall(need, max_util, pinned, onboard, sources, reserved, freed) < 0

    def shortfall(
        self,
        need: list[int],
        max_util: float | None,
        pinned: list[list[int]] | None = None,
        onboard: list[list[int]] | None = None,
        sources: list[list[tuple[int, int]]] | None = None,
        reserved: list[int] | None = None,
        freed: list[list[int]] | None = None,
    ) -> int:
        """The first pool group where ``fits`` fails (what a refusal reports), or -1 when the step fits."""
        for pool_group, count in enumerate(need):
            ours = None if pinned is None else pinned[pool_group]
            moving = None if onboard is None else onboard[pool_group]
            copied = None if sources is None else sources[pool_group]
            extra = 0 if ours is None else ours[0]
            if moving is not None:
                for moved in moving:
                    extra += moved
            if count == 0 and extra == 0 and max_util is None:
                continue
            if not self.can_obtain(pool_group, count, moving, ours, copied, freed):
                return pool_group
            if max_util is not None:
                total = self.tiers[0].pool_groups[pool_group].num_slots
                if (self.num_locked(pool_group, reserved) + extra + count) > max_util * total:
                    return pool_group
        return -1

    def pool_group_slots(self, pool_group: int) -> int:
        return self.tiers[0].pool_groups[pool_group].num_slots

    def available_to(
        self, pool_group: int, pinned: list[int] | None = None, sources: list[tuple[int, int]] | None = None
    ) -> int:
        """GPU pages of a pool group that eviction can give: free, plus those that can leave (``RoomModel.movable``);
        with ``pinned``/``sources``, the caller's own held pages and claimed sources excluded (they stay). Without
        them it is ``statistics(0)[pool_group].available``."""
        free = self.tiers[0].pool_groups[pool_group].allocator.num_free
        return free + self._room_model(pool_group, pinned, 0, sources).movable(0)

    def stranded_held(self, pool_group: int) -> int:
        """Held GPU pages of a pool group (kept for suspended caches, or uncommitted blocks behind a window) that
        can neither be dropped nor moved colder now: ``get_usage()``'s held less what ``statistics(0)``'s evictable
        counts beyond the reusable pages. While it is above 0, a suspend frees no GPU page (its pages join them)."""
        queues = self.queues[0][pool_group]
        return queues.held.size - (self._room_model(pool_group, None).movable(0) - queues.droppable.size)

    def staying(self, level: int, pool_group: int) -> int:
        """Pages of a pool group of ``level`` that can neither be dropped nor moved colder now: what a quota
        shrink cannot make room below (``statistics``' used less evictable)."""
        used = self.tiers[level].pool_groups[pool_group].allocator.num_used
        return used - self._room_model(pool_group, None, level).movable(level)

    def _room_model(
        self,
        pool_group: int,
        pinned: list[int] | None,
        home_level: int = 0,
        sources: list[tuple[int, int]] | None = None,
        freed: list[list[int]] | None = None,
    ) -> RoomModel:
        """The slot counts of a pool group of ``home_level`` (the GPU's unless given) now, on every level;
        ``pinned[level]`` held pages of the caller cannot move, nor its claimed copy-on-write ``sources`` (they wait);
        ``freed[level][group]`` held pages of that level's pool group count as free slots instead, before the
        shares below are taken, so a supposed freeing gives the room the real one would.

        Where a cold tier groups the GPU pool group's life cycles differently (a cold-page codec), its pages may
        land in any of their cold pool groups there, and other GPU pool groups may draw on the same ones within
        one step (``fits`` asks per GPU pool group): each count is the least over those cold pool groups of an
        equal share among the GPU pool groups feeding it. That may refuse room a tight merged cold pool group
        could make, never grant room a move then fails to find."""
        free: list[int] = []
        droppable: list[int] = []
        held: list[int] = []
        grouping = self.grouping
        life_cycles = grouping.levels[home_level][pool_group].life_cycle_ids
        pooled = True
        for level, tier in enumerate(self.tiers):
            groups = {grouping.group_of[level][life_cycle] for life_cycle in life_cycles}
            shares = {group: grouping.gpu_feeders[level][group] if home_level == 0 else 1 for group in groups}
            pooled = pooled and len(groups) == 1 and max(shares.values()) == 1
            gone = {group: 0 if freed is None else freed[level][group] for group in groups}
            free.append(
                min((tier.pool_groups[group].allocator.num_free + gone[group]) // shares[group] for group in groups)
            )
            droppable.append(min(self.queues[level][group].droppable.size // shares[group] for group in groups))
            least_held = min((self.queues[level][group].held.size - gone[group]) // shares[group] for group in groups)
            claimed = 0 if sources is None else sum(1 for at, _ in sources if at == level)
            held.append(max(0, least_held - (0 if pinned is None else pinned[level]) - claimed))
        return RoomModel(free, droppable, held, pooled)

    @property
    def num_gpu_slots(self) -> int:
        """GPU slots of every pool group together (quotas can change, so it is summed when asked)."""
        total = 0
        for pool_group in self.tiers[0].pool_groups:
            total += pool_group.num_slots
        return total

    def num_locked(self, pool_group: int, reserved: list[int] | None = None) -> int:
        """GPU pages of a pool group in no eviction list: locked by active caches, or claimed (pinned for a call);
        less ``reserved[pool_group]``, the pages a batch admission claims for requests other than the one asking:
        nobody locks them, so a request's ``max_util_for_resume`` does not count them (``BatchReservation``)."""
        storage = self.tiers[0].pool_groups[pool_group]
        queues = self.queues[0][pool_group]
        pinned = storage.allocator.num_used - queues.held.size - queues.droppable.size
        return pinned if reserved is None else pinned - reserved[pool_group]

    # ----------------------------------------------------------------------------------------- statistics
    def take_stats(self) -> list[IterationStats]:
        """The iteration statistics since the previous call.

        ``stats`` only ever grows (the scheduler thread adds to it) and each call returns its growth since the
        last one, so another thread may take them beside the scheduler: an addition made meanwhile counts in
        this call or the next, once. (Swapping in fresh counters would lose additions to the old ones.)
        """
        now = [stats_growth(current, IterationStats(current.layer_group_id)) for current in self.stats]
        taken = [stats_growth(current, earlier) for current, earlier in zip(now, self._stats_taken)]
        self._stats_taken = now
        return taken

    def statistics(self, level: int) -> list[StorageStatistics]:
        """Per pool group of ``level``: evictable counts the pages that can leave it now, as making room would move
        them (``RoomModel.movable``: a held page only where the tiers below can take it)."""
        result: list[StorageStatistics] = []
        for pool_group, storage in enumerate(self.tiers[level].pool_groups):
            evictable = self._room_model(pool_group, None, level).movable(level)
            total = storage.num_slots
            free = storage.allocator.num_free
            available = free + evictable
            result.append(
                StorageStatistics(
                    total, free, evictable, available, total - available, list(storage.layout.pool_slot_bytes)
                )
            )
        return result
