"""What one request can ever be, asked at start-up: an engine sizes its scheduler (longest prompt, chunk size) from
these answers instead of discovering the limit as refusals under load.

The answers are about an otherwise empty manager with the GPU tier split as it is now: one request whose largest
step holds ``num_tokens`` tokens, the last ``chunk`` of them computed in that step (history ``num_tokens - chunk``;
sliding windows keep a chunk's out-of-window blocks until the step ends, so a larger chunk needs more pages).
"""

from __future__ import annotations

import logging
from math import gcd
from typing import Final, Sequence

from .life_cycle import NO_WINDOW, LifeCycle, ceil_div
from .planning import DEFAULT_TYPICAL_STEP, TYPICAL_SSM_SLOTS, QuotaPlanner
from .._base.validation import INT64_LIMIT
from .._base.wording import counted
from ..config import BatchDesc, KVCacheDesc

logger = logging.getLogger("kv_cache_manager_v2")


def request_fits(planner: QuotaPlanner, slot_counts: list[int], num_tokens: int, chunk: int) -> bool:
    return step_shortfall(planner, slot_counts, num_tokens, chunk) is None


def step_shortfall(
    planner: QuotaPlanner, slot_counts: list[int], num_tokens: int, chunk: int, batch_size: int = 1
) -> tuple[int, int] | None:
    """Why ``batch_size`` requests' step (capacity ``num_tokens`` each, computing ``chunk``) does not fit
    ``slot_counts``: the first pool group they need more pages of than it has slots, and those pages; None when
    it fits."""
    per_cache = planner.cache_pages(KVCacheDesc(num_tokens, max(0, num_tokens - chunk)), 1, 0)
    for pool_group, (pages, slots) in enumerate(zip(per_cache, slot_counts)):
        if pages * batch_size > slots:
            return pool_group, pages * batch_size
    return None


def chunked_request_fits(planner: QuotaPlanner, slot_counts: list[int], num_tokens: int, chunk: int) -> bool:
    """Whether every step of one request computed from its first token in chunks of ``chunk`` tokens (the last one
    shorter) fits: step ``k`` holds capacity ``min((k + 1) * chunk, num_tokens)`` with history ``k * chunk``.
    Asks only ``chunked_steps``, a few page counts whatever the length, the window or the chunk."""
    return all(step_shortfall(planner, slot_counts, end, computed) is None
               for end, computed in chunked_steps(planner, num_tokens, chunk))


def chunked_shortfall(
    planner: QuotaPlanner, slot_counts: list[int], num_tokens: int, chunk: int
) -> tuple[int, int, int, int] | None:
    """The first step of ``chunked_request_fits``'s request that does not fit (its end and the tokens it computes),
    the pool group short there and the pages it needs there; None when every step fits. Only a refusal looks for
    it: a bisection over the whole steps, a period's page counts a probe, else the shorter last step."""
    if chunked_request_fits(planner, slot_counts, num_tokens, chunk):
        return None
    whole = num_tokens // chunk
    first = _first_whole_step_short(planner, slot_counts, chunk, whole)
    if first is not None:
        found = step_shortfall(planner, slot_counts, (first + 1) * chunk, chunk)
        if found is not None:  # always: the bisection ends on a step that does not fit
            return (first + 1) * chunk, chunk, found[0], found[1]
    last = num_tokens - whole * chunk
    found = step_shortfall(planner, slot_counts, num_tokens, last)
    if found is not None:  # always, when no whole step falls short: ``chunked_steps`` has one that does
        return num_tokens, last, found[0], found[1]
    return None


def _first_whole_step_short(planner: QuotaPlanner, slot_counts: list[int], chunk: int, limit: int) -> int | None:
    """The first whole step ``k < limit`` (history ``k * chunk``, computing ``chunk``) that does not fit, None when
    all of them fit. Some step before ``m`` does not fit exactly when one of the ``period`` steps before ``m`` does
    not (a step that does not fit has a twin in every later period: the proof above ``any_offset_steps``), so that
    question is a few page counts and a bisection over ``m`` finds the first."""
    rewind = planner.max_rewind_len if planner.scratch_reuse else 0

    def short_before(end: int) -> bool:
        begin = max(0, end - _period(planner, chunk))
        return any(step_shortfall(planner, slot_counts, (step + 1) * chunk, chunk) is not None
                   for step in _page_count_changes(planner, chunk, rewind, begin, end))

    if limit <= 0 or not short_before(limit):
        return None
    low, high = 0, limit  # no step before ``low`` falls short, one before ``high`` does
    while high - low > 1:
        middle = (low + high) // 2
        if short_before(middle):
            high = middle
        else:
            low = middle
    return low


def _period(planner: QuotaPlanner, chunk: int) -> int:
    """The whole steps after which chunked steps start at the same place in a block again: ``lcm(chunk, tpb)``
    tokens."""
    tpb = planner.layout_tokens_per_block()
    return tpb // gcd(chunk, tpb)


def peak_request_pages(planner: QuotaPlanner, num_tokens: int, chunk: int) -> list[int]:
    """Per pool group, the most pages one request of ``num_tokens`` holds at any step computing at most ``chunk``
    tokens, wherever the step starts: the largest count among ``any_offset_steps``, which dominate every such step
    in each pool group. Not only ``chunked_steps``: a chunk after a reused prefix or a snapshot point, or a decode
    step with drafts, starts where no chunk from the first token does, and a window may then hold a page more."""
    peak = [0] * len(planner.layout.pool_groups)
    for end, computed in any_offset_steps(planner, num_tokens, chunk):
        pages = planner.cache_pages(KVCacheDesc(end, end - computed), 1, 0)
        peak = [max(old, new) for old, new in zip(peak, pages)]
    return peak


# Why ``any_offset_steps`` asks the last block's worth of histories only: with the chunk ``c`` fixed, a life
# cycle's pages at history ``x`` (end ``e = x + c``) never drop when ``x`` grows by ``tpb``.
# - Full attention holds ``A = ceil(e / tpb)``, which grows by one; SSM one state.
# - A window of ``W`` with ``S`` sink blocks holds ``A - max(0, B - C) = min(A, A - B + C)``, where
#   ``B = (x + 1 - W) // tpb`` grows by exactly one and ``C = min(ceil(x / tpb), S)`` by one while ``x`` is within
#   the sinks, then not: neither term drops.
# - Scratch reuse takes ``h(n) = n - ceil(n * f)`` off for ``n`` scratch blocks (``f <= 1``: ``h`` grows by 0 or 1
#   a block), ``n = max(0, M - L)``, ``M = min(t', ceil(e / tpb))`` (``t'``, the stale end at ``e - rewind``, grows
#   by at most one, so ``M`` does) and ``L = max(s', ceil(x / tpb))`` (never drops, ``s'`` the sinks filled at
#   ``e - rewind``). So ``n`` grows, by one, only when ``L`` stays, which needs ``s' = S`` above ``ceil(x / tpb)``:
#   ``x`` is within the sinks, ``C`` grows by one and the window's count with it, covering the page taken off.
# tests/test_peak_pages.py checks the answer against the maximum over every step.


def any_offset_steps(planner: QuotaPlanner, num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """Steps (end, tokens computed) whose pages dominate, in every pool group, every step of a request of
    ``num_tokens`` tokens that computes at most ``chunk`` tokens and starts at any position: at most a few per
    block index offset, whatever the length, the window or the chunk.

    Without scratch reuse a step computing more tokens up to the same end holds no fewer pages (its window reaches
    further back), and a step from the first token holds more the more it computes, so each end's step computing
    ``min(chunk, end)`` decides: history ``x`` from 0 to ``last = num_tokens - chunk``, end ``x + chunk``. Each
    life cycle's pages at ``x + tpb`` are at least those at ``x`` (the proof above), so their sum in a pool group
    is too, and every history has one in ``[last - tpb + 1, last]`` holding at least as many: of those, only the
    first of each run of equal block indices is asked.

    With SWA scratch reuse a step computing more tokens may hold fewer pages (more of its blocks leave the window
    within the step and share scratch pages): every count of tokens computed is asked there (``_scratch_steps``)."""
    tpb = planner.layout_tokens_per_block()
    if planner.scratch_reuse:
        return _scratch_steps(planner, num_tokens, min(chunk, num_tokens), tpb, planner.max_rewind_len)
    if num_tokens <= chunk:
        return [(num_tokens, num_tokens)]
    shifts = sorted({base + offset for base in (0, chunk) for offset in planner.block_index_offsets()})
    last = num_tokens - chunk
    histories = _index_changes(shifts, tpb, 1, max(0, last - tpb + 1), last + 1)
    return [(history + chunk, chunk) for history in histories]


def _scratch_steps(planner: QuotaPlanner, num_tokens: int, chunk: int, tpb: int, rewind: int) -> list[tuple[int, int]]:
    """``any_offset_steps`` with scratch reuse: a step's pages there depend on its end ``e`` and history ``x`` only
    through the block indices ``(e + o) // tpb``, ``(e - rewind + o) // tpb`` and ``(x + o) // tpb`` (``o`` each
    ``block_index_offsets``), and, the computed count held, a step one block later holds no fewer (the proof
    above), so the ends in the last block's worth decide. With the end held, a history ``x >= settled`` (every
    window's ``tpb * (S + 1) + W - 1``) holds no more than ``x - tpb``: a window's stale blocks drop by one
    (``B >= S + 1`` and ``ceil(x / tpb) > S``) and its scratch blocks grow by at most one, which takes at most one
    page off (``h`` above). So only histories below ``max(x_lo + tpb, settled)`` are asked, ``x_lo`` the lowest
    history the chunk reaches. Per run of ends ``[a, b]`` with equal indices and run of histories ``[p, q]``, one
    step with both in their runs and ``1 <= e - x <= chunk`` is asked, where any is."""
    offsets = planner.block_index_offsets()
    first_end = max(1, num_tokens - tpb + 1)
    end_shifts = sorted({offset - drop for drop in (0, rewind) for offset in offsets})
    ends = _index_changes(end_shifts, tpb, 1, first_end, num_tokens + 1) + [num_tokens + 1]
    windows = [lc for lc in planner.registry.life_cycles if lc.window != NO_WINDOW]
    settled = max((tpb * (lc.num_sink_blocks + 1) + lc.window - 1 for lc in windows), default=0)
    high = min(num_tokens, max(max(0, num_tokens - chunk) + tpb, settled))
    histories = _index_changes(sorted(offsets), tpb, 1, max(0, first_end - chunk), high) + [high]
    steps: list[tuple[int, int]] = []
    for i in range(len(ends) - 1):
        a, b = ends[i], ends[i + 1] - 1
        for j in range(len(histories) - 1):
            p, q = histories[j], histories[j + 1] - 1
            computed = max(1, a - q)  # the fewest tokens computed by a step with both in their runs
            if computed <= chunk and computed <= b - p:
                end = max(a, p + computed)
                steps.append((end, computed))
    return steps


def chunked_steps(planner: QuotaPlanner, num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """The steps (end, tokens computed) of a request computed in chunks whose pages decide whether it fits, in
    order: whenever a step does not fit, one of these does not either.

    Whole step ``k`` has history ``k * chunk``; step ``k + period`` starts ``lcm(chunk, tpb)`` tokens later, a
    whole number of blocks, so it holds no fewer pages in any life cycle (the proof above ``any_offset_steps``),
    hence in any pool group. So the last ``period`` whole steps and the shorter last one decide. Of those whole
    steps only the first of each run with the same pages is asked (``_page_count_changes``): a few per block the
    steps cross, whatever the length, the window or the tokens per block."""
    whole = num_tokens // chunk
    firsts = _page_count_changes(planner, chunk, planner.max_rewind_len if planner.scratch_reuse else 0,
                                 max(0, whole - _period(planner, chunk)), whole)
    steps = [((step + 1) * chunk, chunk) for step in firsts]
    last = num_tokens - whole * chunk
    if last > 0 or whole == 0:
        steps.append((num_tokens, last))
    return steps


def _page_count_changes(planner: QuotaPlanner, chunk: int, rewind: int, begin: int, end: int) -> list[int]:
    """The whole steps in ``[begin, end)`` whose pages may differ from the step before (``begin`` always): the
    first step of each run holding the same pages in every group.

    Step ``k`` has history ``k * chunk`` and end ``(k + 1) * chunk``. Every block index a page count reads (the
    blocks held, the first block in the window, the sinks filled, the scratch blocks) is ``(x + offset) // tpb``
    for ``x`` the history, the end or the end less the rewind, the offset being ``tpb - 1`` (rounding up) or
    ``1 - window``; clamping those indices keeps a run's count constant. So the pages change only at a step where
    one of those indices moves, and the next such step of each is arithmetic."""
    offsets = planner.block_index_offsets()
    shifts = sorted({base + offset for base in (0, chunk, chunk - rewind) for offset in offsets})
    return _index_changes(shifts, planner.layout_tokens_per_block(), chunk, begin, end)


def _index_changes(shifts: list[int], tpb: int, stride: int, begin: int, end: int) -> list[int]:
    """The ``k`` in ``[begin, end)`` at which some ``(k * stride + shift) // tpb`` exceeds its value at ``k - 1``
    (``begin`` always): the first of each run where every such block index stays put."""
    firsts: list[int] = []
    step = begin
    while step < end:
        firsts.append(step)
        following = end
        for shift in shifts:  # the first step whose (step * stride + shift) // tpb exceeds this one's
            boundary = ((step * stride + shift) // tpb + 1) * tpb
            following = min(following, ceil_div(boundary - shift, stride))
        step = following
    return firsts


def new_cache_admissible(
    life_cycles: Sequence[LifeCycle], pool_group_of: Sequence[int], slot_counts: list[int], admission_util: float
) -> bool:
    """Whether a new cache's first ``resume`` fits an empty manager: it locks one live state per SSM layer group at
    once, and an admission may lock at most ``admission_util`` of each GPU pool group (attention pages come with
    the ``resize`` after it, which that bound does not limit)."""
    return admission_shortfall(life_cycles, pool_group_of, slot_counts, admission_util) is None


def admission_shortfall(
    life_cycles: Sequence[LifeCycle],
    pool_group_of: Sequence[int],
    slot_counts: list[int],
    admission_util: float,
    num_caches: int = 1,
) -> tuple[int, int] | None:
    """Why ``new_cache_admissible`` answered False: the first pool group whose SSM live states the ``resume`` of
    ``num_caches`` new caches would lock are more than ``admission_util`` of its slots, and those states; None when
    all of them are admissible together."""
    need = [0] * len(slot_counts)
    for life_cycle in life_cycles:
        if life_cycle.is_ssm:
            need[pool_group_of[life_cycle.id]] += num_caches
    for pool_group, (count, slots) in enumerate(zip(need, slot_counts)):
        if count > admission_util * slots:
            return pool_group, count
    return None


def warn_if_no_cache_admissible(
    life_cycles: Sequence[LifeCycle], pool_group_of: Sequence[int], slot_counts: list[int], admission_util: float
) -> bool:
    """Log once (at construction) when no new cache can ever be admitted (``new_cache_admissible``). Returns
    whether it warned."""
    shortfall = admission_shortfall(life_cycles, pool_group_of, slot_counts, admission_util)
    if shortfall is None:
        return False
    group, states = shortfall
    logger.warning(
        "no new cache can be admitted: its resume locks %s in pool group %d, a GPU slot each; an admission may lock "
        "at most %d of its %s (%s: max_util_for_resume less admission_watermark): give the GPU tier more memory, "
        "raise max_util_for_resume or declare typical_step",
        counted(states, "SSM live state"),
        group,
        int(admission_util * slot_counts[group]),
        counted(slot_counts[group], "slot"),
        admission_util,
    )
    return True


def largest_request(planner: QuotaPlanner, slot_counts: list[int], chunk: int, upper_bound: int) -> int:
    """The largest ``num_tokens <= upper_bound`` that ``request_fits``; 0 when none does."""
    return planner.clamp_max_seq_len(1, upper_bound, slot_counts, chunk)


def largest_chunked_request(planner: QuotaPlanner, slot_counts: list[int], chunk: int, upper_bound: int) -> int:
    """The largest ``num_tokens <= upper_bound`` that ``chunked_request_fits``: every shorter request fits too, so
    it is a cap a scheduler can compare prompts with (``largest_request`` is not: a window's pages are not
    monotone in the length of one step). Monotone because a longer request's steps are the shorter one's, its
    last step extended: the same history, a larger capacity, never fewer pages. 0 when not even one token fits.

    Computed, not bisected over lengths: the whole steps before the first that does not fit
    (``_first_whole_step_short``) all fit, and past them only the shorter last step's capacity is bisected."""
    whole = upper_bound // chunk
    first = _first_whole_step_short(planner, slot_counts, chunk, whole)
    if first is not None:
        whole = first
    low, high = whole * chunk, min(upper_bound, whole * chunk + chunk - 1)  # ``low`` fits: its whole steps do
    while low < high:
        middle = (low + high + 1) // 2
        if step_shortfall(planner, slot_counts, middle, middle - whole * chunk) is None:
            low = middle
        else:
            high = middle - 1
    return low


# The warning's format: an app that declared ``typical_step`` only to split the quota (not a request it will run)
# recognises the record by it, and says what fits in its own words instead.
DECLARED_REQUEST_TOO_LONG: Final = (
    "the GPU tier cannot hold one request of %d tokens with a %d-token chunk (typical_step's longest cache): "
    "every such request will be refused; the longest that fits is %d tokens"
)


def warn_if_declared_request_cannot_fit(planner: QuotaPlanner, slot_counts: list[int], typical_step: BatchDesc) -> bool:
    """Log once (at construction) when the longest cache the config's ``typical_step`` declares cannot fit the
    GPU tier even alone: every such request would be refused forever. Returns whether it warned."""
    if not typical_step.kv_caches:
        return False
    longest = max(typical_step.kv_caches, key=lambda desc: desc.capacity)
    chunk = longest.capacity - longest.history_length
    if request_fits(planner, slot_counts, longest.capacity, chunk):
        return False
    logger.warning(
        DECLARED_REQUEST_TOO_LONG,
        longest.capacity,
        chunk,
        largest_request(planner, slot_counts, chunk, longest.capacity),
    )
    return True


def default_step_for(planner: QuotaPlanner, quota: int, admission_util: float) -> BatchDesc:
    """The typical step to split a GPU tier of ``quota`` bytes for when the engine declared none (nor
    ``initial_pool_ratio``), set as ``planner.demand``: ``DEFAULT_TYPICAL_STEP``, or ``derived_step_for``'s."""
    step = derived_step_for(planner, quota, admission_util)
    if step is None:
        return DEFAULT_TYPICAL_STEP
    planner.demand = planner.pages(step, TYPICAL_SSM_SLOTS)
    return step


def derived_step_for(planner: QuotaPlanner, quota: int, admission_util: float) -> BatchDesc | None:
    """The typical step to split a GPU tier of ``quota`` bytes for when the engine declared none and the
    default step (8 decode caches of 4,096 tokens) would starve a pool group: the default with fewer caches, then
    shorter ones, the largest whose split gives every pool group a slot and admits a new cache (its SSM live
    states within ``admission_util``). On a tier far smaller than the default step, an SSM state's bytes do not
    shrink with the length while the attention pages do, so the default's split leaves an SSM group less than one
    slot; a smaller step keeps the proportions of a step that tier can run. None when no such step exists (the
    tier cannot hold one slot of every pool group) or the default split serves already."""
    life_cycles = planner.registry.life_cycles
    pool_group_of = planner.layout.life_cycle_pool_group
    template = DEFAULT_TYPICAL_STEP.kv_caches[0]
    tpb = planner.layout_tokens_per_block()

    def serves(demand: list[int]) -> bool:
        counts = planner.split(quota, demand, planner.floors)
        return counts is not None and all(
            count > 0 or (pages == 0 and floor == 0) for count, pages, floor in zip(counts, demand, planner.floors)
        ) and new_cache_admissible(life_cycles, pool_group_of, counts, admission_util)

    if serves(planner.pages(DEFAULT_TYPICAL_STEP, TYPICAL_SSM_SLOTS)):
        return None
    num_caches = len(DEFAULT_TYPICAL_STEP.kv_caches)
    while num_caches >= 1:
        length = template.capacity
        while length >= tpb:
            step = BatchDesc([KVCacheDesc(length, length - 1)] * num_caches)
            if serves(planner.pages(step, TYPICAL_SSM_SLOTS)):
                return step
            length //= 2
        num_caches //= 2
    return None


def warn_if_default_split_starves(planner: QuotaPlanner, slot_counts: list[int], step: BatchDesc, quota: int) -> bool:
    """Log once (at construction) when the GPU tier's default split (``step``: no ``typical_step`` declared) leaves
    a pool group too few slots for one request of the step's length computed in chunks of a block: such requests
    would all be refused, with a sentence naming the split. Names the pool group and the smallest quota whose
    split admits one. Returns whether it warned."""
    if len(slot_counts) < 2:  # one pool group: nothing is split, a refusal names the tier's size
        return False
    length = max(desc.capacity for desc in step.kv_caches)
    chunk = planner.layout_tokens_per_block()
    shortfall = chunked_shortfall(planner, slot_counts, length, chunk)
    if shortfall is None:
        return False
    _, _, pool_group, pages = shortfall
    needed = smallest_quota_admitting(planner, quota, length, chunk)
    logger.warning(
        "GpuCacheTierConfig.quota %d: its default split (no typical_step declared) leaves GPU pool group %d %s, "
        "and one request of %s computed in %d-token chunks needs %d there, so every such request will be refused "
        "(the longest that fits is %s); %s (or declare typical_step or initial_pool_ratio for the steps the engine "
        "runs)",
        quota, pool_group, counted(slot_counts[pool_group], "slot"), counted(length, "token"), chunk, pages,
        counted(largest_chunked_request(planner, slot_counts, chunk, length), "token"),
        "no quota within 64 bits admits one" if needed is None
        else f"the smallest quota whose default split admits one is {counted(needed, 'byte')}",
    )
    return True


def smallest_quota_admitting(planner: QuotaPlanner, quota: int, length: int, chunk: int) -> int | None:
    """The fewest bytes above ``quota`` whose split for ``planner.demand`` holds every step of one request of
    ``length`` tokens computed in chunks of ``chunk`` (a bisection: more bytes never give a pool group fewer
    slots)."""

    def admits(candidate: int) -> bool:
        counts = planner.split(candidate, planner.demand, planner.floors)
        return counts is not None and chunked_request_fits(planner, counts, length, chunk)

    low, high = quota, max(quota, 1)
    while not admits(high):
        if high >= INT64_LIMIT // 2:  # no quota within 64 bits admits one: name none rather than loop on
            return None
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if admits(middle):
            high = middle
        else:
            low = middle
    return high
