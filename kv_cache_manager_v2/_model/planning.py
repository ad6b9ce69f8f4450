"""Quota planning: how each tier's bytes are split across pool groups, floors that keep constrained
batches runnable, the longest sequence that fits, and rebalancing from observed requests.

Pages a cache needs per life cycle count what the manager would really allocate: SWA blocks out of the window
(stale) take none, prefill scratch blocks share ``ceil(n * f)`` slots, SSM layers take one live state (plus one
snapshot when sizing for a typical step), and a shared system prompt's blocks count once (for SWA, those still in
the window).

Constraint floors leave ``max_util_for_resume`` headroom, so that every cache of a constraint batch can resume.
They raise a pool group's share only where its proportional share falls short (a floor the typical step already
covers changes nothing), and a GPU quota too small for them is raised to them. ``initial_pool_ratio`` replaces the
typical step's proportions for the initial split.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Final, Sequence

from .layout import StorageLayout
from .life_cycle import NO_WINDOW, LifeCycleRegistry
from ..config import BatchDesc, KVCacheDesc

# Without a typical step: 8 caches of 4,096 tokens, a plausible serving step for sizing pool groups.
DEFAULT_TYPICAL_STEP: Final = BatchDesc([KVCacheDesc(4096, 4095)] * 8)
# SSM slots per cache when sizing for a typical step: its live state plus one snapshot.
TYPICAL_SSM_SLOTS: Final = 2


class QuotaPlanner:
    def __init__(
        self,
        registry: LifeCycleRegistry,
        layout: StorageLayout,
        scratch_reuse: bool,
        max_rewind_len: int,
        typical_step: BatchDesc,
        constraints: Sequence[BatchDesc],
        max_util_for_resume: float = 1.0,
        initial_pool_ratio: Sequence[float] | None = None,
        rebalance: RebalanceGates | None = None,
    ) -> None:
        self.rebalance: RebalanceGates = rebalance if rebalance is not None else RebalanceGates()
        self.registry = registry
        self.layout = layout
        self.scratch_reuse = scratch_reuse
        self.max_rewind_len = max_rewind_len
        self.demand: list[int] = self.pages(typical_step, TYPICAL_SSM_SLOTS)
        if initial_pool_ratio is not None:
            self.demand = self.ratio_demand(initial_pool_ratio)
        num_pool_groups = len(layout.pool_groups)
        self.floors: list[int] = [0] * num_pool_groups
        for batch in constraints:
            for pool_group, pages in enumerate(self.pages(batch, 1)):
                # The last cache of the batch resumes with the others' pages in use: keep utilisation within
                # max_util_for_resume with all of them allocated.
                self.floors[pool_group] = max(self.floors[pool_group], math.ceil(pages / max_util_for_resume - 1e-9))
        # Set through ``_introspection`` (TensorRT-LLM's test hooks): a GPU split per pool group that replaces the
        # observed demand until an ``adjust`` applies it, and a sample count that stands in for observations when
        # deciding whether enough requests were seen.
        self.target_ratio: list[float] | None = None
        self.declared_samples: int = 0

    def ratio_demand(self, weights: Sequence[float]) -> list[int]:
        """Demand (in slots) whose bytes per pool group follow ``weights`` (one per layer group, summed over the
        layer groups of a pool group), at a resolution of one part in 2**40."""
        shares = [0.0] * len(self.layout.pool_groups)
        for life_cycle in self.registry.life_cycles:
            shares[self.layout.life_cycle_pool_group[life_cycle.id]] += weights[life_cycle.id]
        total = sum(shares)
        return [
            round(share / total * (1 << 40) / pool_group.slot_bytes)
            for share, pool_group in zip(shares, self.layout.pool_groups)
        ]

    def floor_bytes(self) -> int:
        """GPU bytes the constraint floors take: a GPU quota below it is raised to it (the constraints are batches
        that must always run; pools are reserved at construction, so a GPU without that memory fails there)."""
        return sum(floor * pool_group.slot_bytes for floor, pool_group in zip(self.floors, self.layout.pool_groups))

    def pool_ratio_demand(self, ratios: Sequence[float]) -> list[int]:
        """Demand (in slots) whose bytes follow ``ratios``, one per pool group (``ratio_demand`` takes one per
        layer group)."""
        total = sum(ratios)
        return [
            round(ratio / total * (1 << 40) / pool_group.slot_bytes)
            for ratio, pool_group in zip(ratios, self.layout.pool_groups)
        ]

    def cache_pages(
        self, desc: KVCacheDesc, ssm_slots: int, shared_blocks: int, scratch_rewind: int | None = -1
    ) -> list[int]:
        """Slots one cache needs per pool group; ``shared_blocks`` full-attention blocks are someone else's.
        ``scratch_rewind``: -1 plans with the manager's scratch setting, None without scratch reuse, else with
        scratch reuse keeping that many tokens out of scratch."""
        if scratch_rewind == -1:
            scratch_rewind = self.max_rewind_len if self.scratch_reuse else None
        needed = [0] * len(self.layout.pool_groups)
        for life_cycle in self.registry.life_cycles:
            pool_group = self.layout.life_cycle_pool_group[life_cycle.id]
            pages = life_cycle.planned_pages(desc.capacity, desc.history_length, shared_blocks, ssm_slots)
            if scratch_rewind is not None:  # a chunk's out-of-window blocks share scratch slots (only windows have any)
                scratch_beg, scratch_end = life_cycle.scratch(desc.history_length, desc.capacity, scratch_rewind)
                scratch = max(0, scratch_end - scratch_beg)
                pages += self.layout.scratch_slots(life_cycle.id, scratch) - scratch
            needed[pool_group] += pages
        return needed

    def pages(self, batch: BatchDesc, ssm_slots: int, scratch_rewind: int | None = -1) -> list[int]:
        """Slots each pool group needs to hold ``batch`` at once (``scratch_rewind`` as in ``cache_pages``)."""
        needed = [0] * len(self.layout.pool_groups)
        tpb = self.layout_tokens_per_block()
        shared_blocks = batch.system_prompt_length // tpb
        for position, desc in enumerate(batch.kv_caches):
            shared = shared_blocks if position > 0 else 0
            for pool_group, pages in enumerate(self.cache_pages(desc, ssm_slots, shared, scratch_rewind)):
                needed[pool_group] += pages
        return needed

    def layout_tokens_per_block(self) -> int:
        return self.registry.life_cycles[0].tokens_per_block

    def block_index_offsets(self) -> set[int]:
        """The ``offset`` of every block index a page count reads, ``(x + offset) // tpb`` for ``x`` a history, a
        capacity or a capacity less the rewind: ``tpb - 1`` (rounding up), ``1 - window`` (the first block in a
        window), and 0 (rounding down: a finer split is always safe)."""
        offsets = {0, self.layout_tokens_per_block() - 1}
        for life_cycle in self.registry.life_cycles:
            if life_cycle.window != NO_WINDOW:
                offsets.add(1 - life_cycle.window)
        return offsets

    def split(self, quota: int, demand: list[int], floors: list[int] | None) -> list[int] | None:
        """Slot counts per pool group: the quota in proportion to the bytes of ``demand``, each group raised to its
        floor where its share falls short (the others share what is left, so floors a demand already covers
        change nothing); None when the floors alone exceed the quota. Bytes the rounding leaves over become whole
        slots (largest remainder first, then the largest demand), so no slot's worth of the quota stays unused."""
        pool_groups = self.layout.pool_groups
        lows = [0] * len(pool_groups) if floors is None else list(floors)
        sizes = [pool_group.slot_bytes for pool_group in pool_groups]
        if sum(low * size for low, size in zip(lows, sizes)) > quota:
            return None
        weights = [pages * size for pages, size in zip(demand, sizes)]
        if sum(weights) == 0:
            weights = list(sizes)
        pinned = [False] * len(pool_groups)
        while True:  # pin every group whose share is under its floor, then share the rest among the others
            remaining = quota - sum(low * size for low, size, pin in zip(lows, sizes, pinned) if pin)
            total = sum(weight for weight, pin in zip(weights, pinned) if not pin)
            shares = [0.0 if pin or total == 0 else remaining * weight / total for weight, pin in zip(weights, pinned)]
            short = [i for i, share in enumerate(shares) if not pinned[i] and share / sizes[i] < lows[i]]
            if not short:
                break
            for index in short:
                pinned[index] = True
        counts = [low if pin else int(share // size) for low, pin, share, size in zip(lows, pinned, shares, sizes)]
        left = quota - sum(count * size for count, size in zip(counts, sizes))
        wanted = [i for i in range(len(pool_groups)) if weights[i] > 0]
        for index in sorted(wanted, key=lambda i: (not pinned[i], shares[i] / sizes[i] - counts[i]), reverse=True):
            if sizes[index] <= left:
                counts[index] += 1
                left -= sizes[index]
        for index in sorted(wanted, key=lambda i: weights[i], reverse=True):  # what is still left: as many as fit
            counts[index] += left // sizes[index]
            left %= sizes[index]
        return counts

    def clamp_max_seq_len(self, batch_size: int, upper_bound: int, slot_counts: list[int], chunk: int = 1) -> int:
        """Largest ``L <= upper_bound`` such that ``batch_size`` caches of capacity ``L`` and history ``L - chunk``
        fit together in ``slot_counts``; 0 when none does.

        Pages are not monotonic in ``L`` when a window is not a multiple of tpb (window 20, tpb 16: ``L`` 32
        needs 2 pages, 33 to 35 need 3, 36 needs 2 again), so one bisection over ``L`` can miss the answer.
        Along one residue class ``L = r + k * tpb`` they are: each step adds exactly one block of capacity and
        at most one stale block. So one bisection per residue ``r`` in ``[1, tpb]``, and the best of them; only a
        few residues can be the best (``_candidate_residues``), whatever the tokens per block.
        """
        best = 0
        step = self.layout_tokens_per_block()
        for first in self._candidate_residues(upper_bound, chunk):
            if not self.lengths_fit(first, batch_size, slot_counts, chunk):
                continue
            low, high = 0, (upper_bound - first) // step
            while low < high:
                middle = (low + high + 1) // 2
                if self.lengths_fit(first + middle * step, batch_size, slot_counts, chunk):
                    low = middle
                else:
                    high = middle - 1
            best = max(best, first + low * step)
        return best

    def _candidate_residues(self, upper_bound: int, chunk: int) -> list[int]:
        """The residues ``r`` in ``[1, min(tpb, upper_bound)]`` that ``clamp_max_seq_len`` must try (every one once
        walked all of them: minutes at 2**20 tokens a block). Every block index the pages of ``L = r + k * tpb``
        read is ``k + (r + shift) // tpb``, the shifts being an offset of ``block_index_offsets`` less 0, the
        chunk or the rewind (a history clamped at 0 stays in its run). So the residues split into runs whose
        pages agree for every ``k``; in a run a larger ``r`` is a longer answer, except where the bound cuts
        ``k``, which is longest at ``r = upper_bound mod tpb``. The last residue of each run and that one."""
        tpb = self.layout_tokens_per_block()
        limit = min(tpb, upper_bound)
        rewind = self.max_rewind_len if self.scratch_reuse else 0
        ends = {limit, upper_bound % tpb or tpb}
        for base in (0, chunk, rewind):
            for offset in self.block_index_offsets():
                ends.add((-1 - offset + base) % tpb or tpb)
        return sorted(end for end in ends if 1 <= end <= limit)

    def lengths_fit(self, length: int, batch_size: int, slot_counts: list[int], chunk: int = 1) -> bool:
        """Whether ``batch_size`` caches of capacity ``length`` and history ``length - chunk`` fit in
        ``slot_counts``."""
        per_cache = self.cache_pages(KVCacheDesc(length, max(0, length - chunk)), 1, 0)
        return all(pages * batch_size <= slots for pages, slots in zip(per_cache, slot_counts))

    def rebalance_demand(self, observed: ObservedDemand) -> list[int] | None:
        """What a rebalancing should split the GPU tier for: the ``target_ratio`` when one is set, else
        ``observed_demand``; None while fewer than ``rebalance.min_samples`` caches were seen (observed, or
        ``declared_samples``), a target split included: it stands in for the mix, not for the sample count."""
        if max(len(observed), self.declared_samples) < self.rebalance.min_samples:
            return None
        if self.target_ratio is not None:
            return self.pool_ratio_demand(self.target_ratio)
        return self.observed_demand(observed)

    def observed_demand(self, observed: ObservedDemand) -> list[int] | None:
        """Typical-step demand from (capacity, history) of recently closed caches; None without any."""
        if not len(observed):
            return None
        return list(observed.sums)


class ObservedDemand:
    """The (capacity, history) of the last ``size`` closed caches and the pages each needs per pool group in a
    typical step, summed (``QuotaPlanner.pages`` of the batch of them) as they come and go: ``need_adjustment``
    costs what closed since it was last asked, not all ``size`` of them again. A close only queues its lengths;
    the next read of ``sums`` counts what was queued."""

    def __init__(self, planner: QuotaPlanner, size: int) -> None:
        self.planner = planner
        self.size = size
        self.counted: deque[list[int]] = deque()  # pages per pool group of the oldest observations, in ``sums``
        self.queued: deque[tuple[int, int]] = deque()  # the newer ones' (capacity, history), not yet in ``sums``
        self.counted_sums: list[int] = [0] * len(planner.layout.pool_groups)

    def __len__(self) -> int:
        return len(self.counted) + len(self.queued)

    def append(self, capacity: int, history: int) -> None:
        """Observe a closed cache's lengths; the oldest observation goes once there are ``size``."""
        if len(self) == self.size:
            if self.counted:
                for pool_group, pages in enumerate(self.counted.popleft()):
                    self.counted_sums[pool_group] -= pages
            else:
                self.queued.popleft()
        self.queued.append((capacity, history))

    @property
    def sums(self) -> list[int]:
        """Pages per pool group of the observed caches together."""
        sums = self.counted_sums
        while self.queued:
            capacity, history = self.queued.popleft()
            pages_needed = self.planner.cache_pages(KVCacheDesc(capacity, history), TYPICAL_SSM_SLOTS, 0)
            for pool_group, pages in enumerate(pages_needed):
                sums[pool_group] += pages
            self.counted.append(pages_needed)
        return sums


class RebalanceGates:
    """When ``need_adjustment`` may suggest a new split: enough closed caches seen, a pool group's slot count off
    its ideal by more than a ratio, and the last rebalancing at least ``cooldown_secs`` ago on ``clock`` (a
    monotonic clock in seconds; replaceable so tests need not wait). Before any rebalancing there is no cooldown,
    so the first one never depends on how long the machine has been up."""

    def __init__(self, min_samples: int = 16, cooldown_secs: float = 0.0, ratio_threshold: float = 1.1) -> None:
        self.min_samples = min_samples
        self.cooldown_secs = cooldown_secs
        self.ratio_threshold = ratio_threshold
        self.clock: Callable[[], float] = time.monotonic
        self.last_adjustment: float | None = None

    def cooling_down(self) -> bool:
        """Whether the last rebalancing was less than ``cooldown_secs`` ago."""
        return self.last_adjustment is not None and self.clock() - self.last_adjustment < self.cooldown_secs

    def departs(self, current: list[int], ideal: list[int]) -> bool:
        """Whether any pool group's slot count and its ideal differ by more than ``ratio_threshold`` times (and by
        more than one slot, so that tiny pool groups do not flap)."""
        return any(
            abs(have - want) > 1 and max(have, want) > self.ratio_threshold * min(have, want)
            for have, want in zip(current, ideal)
        )


def closest_quota(current: int, target: int, fits: Callable[[int], bool]) -> int:
    """The quota nearest ``target`` that ``fits``, searched from ``current`` (which fits) towards it: slot counts
    grow with the quota, so whatever fits lies on ``current``'s side of whatever does not (bisection)."""
    good, bad = current, target
    while abs(bad - good) > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return bad if fits(bad) else good
