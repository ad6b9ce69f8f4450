"""What a user can observe of a manager, compared before and after a call that must change nothing, and the
check that a documented invalid move raises ``ValueError``. ``tests/test_bad_inputs.py`` (its world,
``tests/bad_input_world.py``) uses them too."""

from __future__ import annotations

import re
from typing import Callable, Sequence

from kv_cache_manager_v2 import KVCacheManager, KVCacheStatus, Refusal, ReuseScope, StorageStatistics, _KVCache
from kv_cache_manager_v2._introspection import internals_of, state_of
from kv_cache_manager_v2._model.admission_limits import chunked_request_fits, largest_chunked_request, step_shortfall
from kv_cache_manager_v2._pages.usage import usage_of
from kv_cache_manager_v2.config import KVCacheDesc
from tests.fuzz.model import Token

# The calls whose refusal counts GPU pages as the statistics do (the quota calls count a tier's slots instead).
PAGE_CALLS = ("KVCache.resize", "KVCache.resume", "create_kv_cache_batch")
# A refusal's sentence naming its ``stranded_pages``.
STRANDED = re.compile(r"; (\d+) of pool group \d+'s GPU pages (?:is|are) held for other caches")
# The figures a refusal's sentence states that are its fields too: what the step needs, by room or in all, the SSM
# live states an admission locks, and what is available, the limit and the total.
NEEDS = re.compile(r"(?:needs?|locks?) (\d+) (?:GPU pages?|SSM live states?) in pool group (\d+)")
BY_ROOM = re.compile(r"^(\d+) GPU pages? needed in pool group (\d+), (\d+) free or evictable")
# A quota call's refusal where a GPU pool group would get no slot: its group, the slots it would get, those needed.
STARVED = re.compile(r"pool group (\d+) would get (\d+) slots?, at least (\d+) slots? needed")
LIMIT = re.compile(r"at most (\d+) of (?:its )?(\d+)")
# Every count a refusal's sentence states before its noun: singular exactly for one ("1 SSM live state").
COUNTED = re.compile(r"(?<![\d.])(\d+) (GPU page|SSM live state|free slot|slot|page|token|cache|byte|block|key)(s?)\b")
# A prefetch refusal's pages still colder than its level (their pool group named there, or by room in the head,
# ``BY_ROOM``), and (never fitting) every page it would hold there.
PREFETCH_LEFT = re.compile(
    r"(\d+) of this cache's pages (?:of pool group (\d+) )?stays? (?:colder than level (\d+)|off the GPU)"
)
PREFETCH_NEVER = re.compile(r"this cache's (\d+) pages? of pool group (\d+) (?:on the GPU|at level (\d+)) exceed the (\d+) it may")


def check_refusal(
    manager: KVCacheManager,
    earlier: Refusal | None,
    call: str,
    cache: _KVCache | None = None,
    figures_now: bool = True,
    asked: tuple[int, int] | None = None,
    held: Sequence[_KVCache] = (),
) -> Refusal:
    """After a False/None of ``call``: a refusal of that call was recorded by it (not ``earlier``, the one before
    the call), as the cache's own too; a page call's figures are what ``get_storage_statistics`` and ``get_usage``
    read now (the refused call changed nothing; not ``figures_now`` for a batch: its figures are those inside the
    batch, with every matched page claimed, and admitted requests changed them since), and its shortfall is positive unless a limit other than room
    (``fits_empty_manager`` False, ``max_util_for_resume``/the watermark, lost content) was the reason. ``asked``:
    the (capacity, history) a refused resize asked for; ``fits_empty_manager`` is then what ``can_fit`` says of that
    step; a refused resume's is ``KVCache.resumable_alone``. A refusal naming the cache's own held stale pages (``own_stale_pages``) is a resize's or a resume's, by
    room, of a cache holding computed tokens it has not committed. ``held``: the caches under a ``KVCache.hold``
    (``check_held_pages``). ``stranded_pages``: named in the sentence exactly when above 0, a refusal by room's
    only, and what ``check_stranded`` reads at that moment."""
    refusal = manager.last_refusal
    assert refusal is not None and refusal is not earlier, f"{call} said no without recording why (kept: {earlier})"
    assert refusal.call == call, (call, refusal)
    check_sentence_figures(refusal)
    if cache is not None:
        assert cache.last_refusal is refusal, (cache.last_refusal, refusal)
    if call in PAGE_CALLS and figures_now:
        # The refusal's moment: get_storage_statistics() would first close a cache dropped meanwhile (a handle the
        # collector finalized inside the call), as get_usage() does.
        statistics = internals_of(manager).store.statistics(refusal.level)[refusal.pool_group]
        assert (refusal.pages_available, refusal.pages_total) == (statistics.available, statistics.total), (
            refusal, statistics
        )
        check_stranded(manager, refusal, statistics, cache)  # before get_usage(): it closes dropped caches first
        usage = [entry for entry in manager.get_usage() if (entry.level, entry.pool_group) == (refusal.level, refusal.pool_group)]
        assert usage[0].total == refusal.pages_total, (usage, refusal)
        by_limit = refusal.fits_empty_manager and ("would lock more than" in refusal.detail or refusal.by_watermark)
        assert (refusal.pages_over_limit > 0) == by_limit, refusal  # the limit's refusals carry their figure
        by_room = refusal.fits_empty_manager and "max_util" not in refusal.detail and "lost their content" not in refusal.detail
        if by_room and not refusal.by_watermark:
            assert refusal.pages_needed > refusal.pages_available, refusal
    if call == "KVCache.prefetch" and cache is not None:
        check_prefetch_refusal(manager, refusal, cache)
    if call not in PAGE_CALLS and "neither be dropped nor moved" in refusal.detail:  # a quota call: held pages stay
        statistics = internals_of(manager).store.statistics(refusal.level)[refusal.pool_group]
        # those that can neither be dropped nor moved colder, against the slots the new quota would keep
        assert (refusal.pages_needed, refusal.pages_total) == (statistics.unavailable, statistics.total), (
            refusal, statistics
        )
        assert refusal.pages_needed > refusal.pages_available, refusal
    if refusal.own_stale_pages:  # the cache's own held stale pages stand in the way: only its resize/resume can say so
        assert call in ("KVCache.resize", "KVCache.resume") and cache is not None and refusal.fits_empty_manager, refusal
        assert "stop_committing()" in refusal.detail, refusal
        assert ("commit the computed blocks" in refusal.detail) == (call == "KVCache.resize"), refusal  # active only
        if asked is not None or call == "KVCache.resume":  # blocks behind the step's history are not committed
            history = cache.history_length if asked is None else asked[1]
            assert cache.num_committed_tokens < history, (refusal, asked, cache.num_committed_tokens)
        assert refusal.pages_needed > refusal.pages_available and not refusal.by_watermark, refusal
    stranded = STRANDED.search(refusal.detail)
    assert (stranded is not None and int(stranded.group(1)) == refusal.stranded_pages > 0) == (
        refusal.stranded_pages > 0
    ), refusal
    assert refusal.stranded_pages == 0 or "other caches hold the rest" in refusal.detail, refusal  # room refusals only
    check_held_pages(refusal, held)
    if asked is not None:
        capacity, history = asked
        fits = manager.can_fit(capacity, capacity - history)
        assert refusal.fits_empty_manager == fits, (refusal, asked)
        if not fits:
            check_fit_refusal(manager, "KVCacheManager.can_fit")
            by_step = manager.last_refusal  # the figure a never-fitting step's refusal states is can_fit's
            assert by_step is not None and (by_step.pool_group, by_step.pages_needed) == (
                refusal.pool_group, refusal.pages_needed
            ), (refusal, by_step)
    if call == "KVCache.resume" and cache is not None:  # never fitting is the verdict a scheduler reads first
        assert refusal.fits_empty_manager == cache.resumable_alone, refusal
    return refusal


def check_prefetch_refusal(manager: KVCacheManager, refusal: Refusal, cache: _KVCache) -> None:
    """A ``prefetch(level)`` refusal's figures against the statistics and the cache at that moment (a placement
    hint changes nothing after it refuses): the level's total; what is available, the free slots for a prefetch
    into free slots, the statistics' ``available`` for an evicting one; the pages its sentence says stay colder
    are the cache's movable pages there; by room it needs more than is available and counts its stranded pages as
    a page call's (``check_stranded``), by the limit ``pages_over_limit`` is said; never fitting, ``pages_needed`` is every page of the cache's that pool group would hold at that level,
    more than it may hold there, as its sentence says."""
    level, group = refusal.level, refusal.pool_group
    statistics = internals_of(manager).store.statistics(level)[group]
    free_only = "free slots only" in refusal.detail
    assert refusal.pages_total == statistics.total, (refusal, statistics)
    assert refusal.pages_available == (statistics.free if free_only else statistics.available), (refusal, statistics)
    group_of = internals_of(manager).store.grouping.group_of[level]
    movable = {
        id(page): page for page in state_of(cache).held_pages()
        if page.lock_count == 0 and page.claim_count == 0 and group_of[page.life_cycle] == group
    }
    left = PREFETCH_LEFT.search(refusal.detail)
    assert left is not None, refusal
    head = BY_ROOM.search(refusal.detail)  # by room the sentence's head names the pool group, the clause need not
    named = left.group(2) or (head.group(2) if head is not None else None)
    assert named is not None and int(named) == group, refusal
    assert int(left.group(1)) == sum(1 for page in movable.values() if page.level > level) > 0, refusal
    never = PREFETCH_NEVER.search(refusal.detail)
    assert (never is None) == refusal.fits_empty_manager, refusal
    if never is not None:
        own = sum(1 for page in movable.values() if page.level >= level)
        assert (int(never.group(1)), int(never.group(2))) == (refusal.pages_needed, group), refusal
        assert refusal.pages_needed == own > int(never.group(4)) and refusal.pages_over_limit == 0, (refusal, own)
        return
    if free_only:
        assert refusal.pages_needed == int(left.group(1)) > refusal.pages_available, refusal
        assert refusal.pages_over_limit == 0 == refusal.stranded_pages, refusal
    elif refusal.pages_over_limit > 0:
        assert "would lock more than the admission limit" in refusal.detail, refusal
        assert refusal.stranded_pages == 0, refusal
    else:  # by room, as a resume's: its stranded pages too
        assert BY_ROOM.search(refusal.detail) is not None, refusal
        assert refusal.pages_needed > refusal.pages_available, refusal
        check_stranded(manager, refusal, statistics, cache)


def check_stranded(
    manager: KVCacheManager, refusal: Refusal, statistics: StorageStatistics, cache: _KVCache | None
) -> None:
    """A page call's ``stranded_pages`` against the figures of the refusal's moment (``statistics``, read right
    after the call): the held GPU pages that can neither be dropped nor moved colder (``get_usage()``'s held less
    what evictable counts beyond reusable) less the refused cache's own held pages, never below 0. The usage is
    read without ``get_usage()``, which first closes the caches dropped meanwhile: compared after it, a right count
    (4 held, 1 reusable) once looked wrong (1 held, 4 reusable)."""
    level, group = refusal.level, refusal.pool_group
    usage = next(
        entry for entry in usage_of(internals_of(manager).store) if (entry.level, entry.pool_group) == (level, group)
    )
    stranded = usage.held - (statistics.evictable - usage.reusable)
    assert 0 <= stranded <= usage.held, (usage, statistics)
    if "other caches hold the rest" not in refusal.detail or cache is None:
        assert 0 <= refusal.stranded_pages <= stranded, (refusal, usage, statistics)
        return
    own = {  # pages the refused cache holds that sit in the held queue: neither locked nor claimed
        id(page) for page in state_of(cache).held_pages()
        if (page.level, page.pool_group) == (level, group) and page.lock_count == 0 and page.claim_count == 0
    }
    assert refusal.stranded_pages == max(0, stranded - len(own)), (refusal, usage, statistics, len(own))


def check_fit_refusal(manager: KVCacheManager, call: str, held: Sequence[_KVCache] = ()) -> None:
    """After ``call`` (``can_fit``, ``can_fit_in_chunks``, ``max_admissible``) said no: its refusal is a shortage on
    an empty manager, its slots (available and total) are the GPU pool group's slots as the statistics count them,
    as a page call's refusal reads the statistics, and it needs more than it may use: the slots, or for SSM live
    states the admission limit its sentence names (the block limit alone names no pages); ``held`` as for
    ``check_refusal``."""
    refusal = manager.last_refusal
    assert refusal is not None and refusal.call == call and not refusal.fits_empty_manager, (call, refusal)
    check_held_pages(refusal, held)
    check_sentence_figures(refusal)
    slots = manager.get_storage_statistics(0)[refusal.pool_group].total
    assert refusal.level == 0 and refusal.pages_available == refusal.pages_total == slots, (refusal, slots)
    if "blocks" in refusal.detail and refusal.pages_needed == 0:  # longer than a cache may span
        return
    limit = LIMIT.search(refusal.detail)
    usable = int(limit.group(1)) if "SSM live state" in refusal.detail and limit else refusal.pages_available
    assert refusal.pages_needed > usable, refusal


def check_sentence_figures(refusal: Refusal) -> None:
    """Every count the sentence states carries its noun singular for one, plural otherwise; and a figure a
    refusal's sentence states is its field's: the pages (or SSM live states) the step needs, in all
    when it never fits (``fits_empty_manager`` False: the same count ``can_fit`` of that step gives) or by room
    (with what is free or evictable), and the pool group's total beside the limit it may use."""
    for counted in COUNTED.finditer(refusal.detail):
        assert bool(counted.group(3)) == (int(counted.group(1)) != 1), (counted.group(0), refusal)
    needs = NEEDS.search(refusal.detail)
    if needs is not None:
        assert (int(needs.group(1)), int(needs.group(2))) == (refusal.pages_needed, refusal.pool_group), refusal
        assert not refusal.fits_empty_manager, refusal
    by_room = BY_ROOM.search(refusal.detail)
    if by_room is not None:
        figures = tuple(int(figure) for figure in by_room.groups())
        assert figures == (refusal.pages_needed, refusal.pool_group, refusal.pages_available), refusal
    starved = STARVED.search(refusal.detail)
    assert (starved is not None) == ("would get" in refusal.detail), refusal  # every such sentence states them
    if starved is not None:
        figures = tuple(int(figure) for figure in starved.groups())
        assert figures == (refusal.pool_group, refusal.pages_available, refusal.pages_needed), refusal
        assert refusal.pages_needed > refusal.pages_available and not refusal.fits_empty_manager, refusal
    limit = LIMIT.search(refusal.detail)
    if limit is not None and refusal.level == 0 and "blocks" not in refusal.detail:
        assert int(limit.group(2)) == refusal.pages_total and int(limit.group(1)) <= refusal.pages_total, refusal


def check_held_pages(refusal: Refusal, held: Sequence[_KVCache]) -> None:
    """Every refusal counts the pages at its tier and pool group of the caches under a hold (``held``: the fuzzer
    holds caches only inside ``held_call``, so elsewhere a count above 0 is a hold the manager did not forget), and
    a shortage's sentence names the holds' reasons exactly when it counts some."""
    pages: set[int] = set()
    reasons: list[str] = []
    for cache in held:
        before = len(pages)
        pages.update(
            id(page) for page in state_of(cache).held_pages()
            if (page.level, page.pool_group) == (refusal.level, refusal.pool_group)
        )
        if len(pages) > before:
            reasons.extend(cache.held_for)
    assert refusal.held_pages == len(pages), (refusal, len(pages))
    shortage = (
        refusal.pages_needed > 0 or refusal.pages_over_limit > 0 or refusal.by_watermark or not refusal.fits_empty_manager
    )
    assert ("KVCache.hold" in refusal.detail) == (shortage and bool(pages)), refusal
    assert all(reason in refusal.detail for reason in reasons) or not shortage, (refusal, reasons)


def check_default_split(manager: KVCacheManager) -> None:
    """With neither ``typical_step`` nor ``initial_pool_ratio`` declared, the derived step leaves every GPU pool group
    at least one slot (else one kind of layer could never hold a page); the refusal past ``max_admissible``'s cap
    (or of a cap of 0) carries consistent figures; and ``peak_pages`` agrees: the cap's request holds no more than
    each pool group's GPU slots at any step, and one token more holds at least the pages its refusal names."""
    longest = manager.max_admissible()
    slots = [statistics.total for statistics in manager.get_storage_statistics(0)]
    if longest == 0:
        check_fit_refusal(manager, "KVCacheManager.max_admissible")
    else:
        peak = manager.peak_pages(longest, 1)
        assert all(pages <= count for pages, count in zip(peak, slots)), (longest, peak, slots)
        if not manager.can_fit_in_chunks(longest + 1, 1):  # the cap is where the chunked steps stop fitting
            check_fit_refusal(manager, "KVCacheManager.can_fit_in_chunks")
            refusal = manager.last_refusal
            assert refusal is not None
            assert manager.peak_pages(longest + 1, 1)[refusal.pool_group] >= refusal.pages_needed, refusal
    config = manager.config
    if config.typical_step is None and config.initial_pool_ratio is None:
        assert min(slots) >= 1, slots
    check_peak_pages_monotone(manager)


def check_peak_pages_monotone(manager: KVCacheManager) -> None:
    """``peak_pages(n, chunk)`` bounds every step of at most ``chunk`` tokens up to ``n`` wherever it starts, so it
    never shrinks as either grows: a bound taken over the steps of one computation only (chunks from token 0) does,
    since a larger chunk moves those steps' starts elsewhere in a block."""
    tpb = manager.tokens_per_block
    for tokens in (3 * tpb + 2, 7 * tpb + 3):
        for chunk in range(1, 2 * tpb + 2):
            peak = manager.peak_pages(tokens, chunk)
            for larger in (manager.peak_pages(tokens, chunk + 1), manager.peak_pages(tokens + 1, chunk)):
                assert all(a <= b for a, b in zip(peak, larger)), (tokens, chunk, peak, larger)
    check_peak_pages_is_the_maximum(manager, 3 * tpb + 2, (1, tpb + 1))
    check_chunked_fit_is_every_step(manager, 8 * tpb + 3, (1, tpb + 1, 3 * tpb + 5))


def check_chunked_fit_is_every_step(manager: KVCacheManager, bound: int, chunks: Sequence[int]) -> None:
    """``can_fit_in_chunks`` asks only the last period's whole steps and the last one, and ``max_admissible`` is
    computed from the first whole step that falls short: on the world's config both agree with ``can_fit`` asked of
    every step (the definition), for every length up to ``bound``; and so do the answers for a tier with only the
    slots one step halfway there needs, where some steps fall short."""
    admits = manager.can_fit(0)  # a new cache's SSM live states within the admission limit
    planner = internals_of(manager).planner
    for chunk in chunks:
        whole_fit = [manager.can_fit((step + 1) * chunk, chunk) for step in range(bound // chunk)]
        cap = 0
        for length in range(1, bound + 1):
            whole, last = divmod(length, chunk)
            if not (admits and all(whole_fit[:whole]) and (last == 0 or manager.can_fit(length, last))):
                break
            cap = length
        assert manager.max_admissible(chunk, bound) == cap, (chunk, bound, cap)
        for length in range(bound + 1):  # longer than the cap never fits: its steps extend the cap's
            assert manager.can_fit_in_chunks(length, chunk) == (admits and length <= cap), (chunk, length, cap)
        middle = bound // 2
        slots = planner.cache_pages(KVCacheDesc(middle, max(0, middle - chunk)), 1, 0)
        short = [step_shortfall(planner, slots, (step + 1) * chunk, chunk) is not None for step in range(bound // chunk)]
        cap = 0
        for length in range(1, bound + 1):
            whole, last = divmod(length, chunk)
            fits = not any(short[:whole]) and (last == 0 or step_shortfall(planner, slots, length, last) is None)
            assert chunked_request_fits(planner, slots, length, chunk) == fits, (chunk, length, slots)
            cap = length if fits and cap == length - 1 else cap
        assert largest_chunked_request(planner, slots, chunk, bound) == cap, (chunk, bound, slots, cap)


def check_peak_pages_is_the_maximum(manager: KVCacheManager, tokens: int, chunks: Sequence[int]) -> None:
    """``peak_pages`` asks only the last block's worth of steps: on the world's config, it is the most pages any
    step of at most ``chunk`` tokens ending anywhere up to ``tokens`` holds, every such step asked."""
    planner = internals_of(manager).planner
    for chunk in chunks:
        most = [0] * len(planner.layout.pool_groups)
        for end in range(1, tokens + 1):
            for computed in range(1, min(chunk, end) + 1):
                pages = planner.cache_pages(KVCacheDesc(end, end - computed), 1, 0)
                most = [max(a, b) for a, b in zip(most, pages)]
        assert manager.peak_pages(tokens, chunk) == most, (tokens, chunk, most)


def expect_value_error(call: Callable[[], object], what: str) -> None:
    """``call`` must raise ValueError (anything else propagates: a bug)."""
    try:
        call()
    except ValueError:
        return
    raise AssertionError(f"{what}: expected ValueError, nothing was raised")


Probe = tuple[ReuseScope | None, list[Token]]


def snapshot(manager: KVCacheManager, caches: Sequence[_KVCache], probes: Sequence[Probe]) -> dict[str, object]:
    """Everything a user can observe of the manager and ``caches`` without changing it."""
    state: dict[str, object] = {}
    for cache in caches:
        entry: list[object] = [cache.status, cache.capacity, cache.history_length, cache.num_committed_tokens]
        entry.append(cache.is_committing_stopped)
        if cache.status != KVCacheStatus.CLOSED:
            entry.extend(list(cache.get_base_page_indices(lg)) for lg in range(manager.num_layer_groups))
        state[f"cache {cache.id}"] = entry
    for level in range(manager.num_cache_levels):
        state[f"statistics {level}"] = manager.get_storage_statistics(level)
        state[f"quota {level}"] = manager.get_quota(level)
    state["probes"] = [manager.probe_reuse(scope, tokens) for scope, tokens in probes]
    state["probes by tier"] = [manager.probe_reuse_by_tier(scope, tokens) for scope, tokens in probes]
    state["movement"] = manager.movement_counters  # a snapshot, equal to another by its counts
    state["live caches"] = manager.num_live_caches
    return state


def assert_unchanged(before: dict[str, object], after: dict[str, object], what: str) -> None:
    if before != after:
        keys = before.keys() | after.keys()
        diff = {key: (before.get(key), after.get(key)) for key in keys if before.get(key) != after.get(key)}
        raise AssertionError(f"{what} changed state: {diff}")
