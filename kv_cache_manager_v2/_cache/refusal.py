"""Why the manager said no: a soft refusal (``resize``/``resume`` answering False, a batch request answered None)
is recorded as a ``Refusal`` so an engine can log or act on it afterwards instead of guessing.

The reason is built only on the refusal path, from the counts the planner already has (``need``, ``pinned``,
``onboard``) and the pool group ``PageStore.shortfall`` found short: the decode fast path never pays for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, final

from .._pages.page import Page
from .._pages.page_store import PageStore
from .._base.types import GPU_LEVEL, MAX_BLOCKS_PER_CACHE, CacheTier, FrozenValue
from .._base.wording import counted, is_are
from .attention_state import AttentionState, Released, leaves_when_stale


@final
@dataclass(frozen=True)
class Refusal(FrozenValue):
    """One soft refusal: the call, the tier and pool group that was short, the pages the step needed there (by room:
    new pages, pages brought onto the GPU, and the caller's own held GPU pages that eviction could move but the step
    keeps, so the difference below is right whether or not a colder tier makes them count as available; when it
    never fits, ``fits_empty_manager`` False: every GPU page the step would hold, its own held or locked ones
    included on every tier, the figure its sentence's "needs" and ``can_fit`` of that step give), the pages
    available there (``KVCacheManager.get_storage_statistics()``'s ``available`` of that pool
    group at that moment: free, reusable, and held pages the colder tiers can take; inside a batch, with every
    page the batch matched claimed; for a ``KVCache.prefetch(level)`` into free slots only, that level's free
    slots, its statistics' ``free``), the tier's total, and whether the request would fit this pool group on an
    otherwise empty manager (False: waiting for other caches to finish will never help; shorten the request, give
    the tier more memory or, with several pool groups, declare the steps the engine runs as
    ``KVCacheManagerConfig.typical_step`` so that the split gives this group more). For a refusal by room,
    ``pages_needed - pages_available`` is what other caches must give back (or a larger quota add) before the
    same step fits; ``detail`` says the same in a sentence, and for a refusal by ``max_util_for_resume`` how many
    locked pages are over the limit. ``by_watermark``: the step would have fit but for
    ``KVCacheManagerConfig.admission_watermark`` (the room kept for running caches to grow into). For the quota
    calls (``KVCacheManager.resize``/``adjust``) the pages are the pool group's slots at ``level``: those it would
    need (or, when held pages stand in the way, those that can neither be dropped nor moved colder) against those
    the new quota or reservation gives; the difference is what must go first. ``own_stale_pages`` (a ``resize``
    or a ``resume``): the pages this cache itself holds, on any tier, as computed, uncommitted pages that left its
    window (they stay held while their blocks may still be committed: on the GPU only a colder tier can take them,
    and on a colder tier they take the room the GPU's held pages would move to) when freeing them would let the
    step fit: committing the computed blocks (an active cache) or ``stop_committing()`` makes the
    room, waiting for other caches may never do it; 0 otherwise (``stop_committing()`` would not make it fit). ``fits_empty_manager`` stays about the step alone (a fresh request's,
    ``can_fit``), so an engine that rejects on False does not reject a step one call away from fitting.
    ``pages_over_limit``: for an admission (``resume``, a batch request, an evicting ``prefetch``) refused by
    ``max_util_for_resume`` (or the watermark) though it would fit alone, how many locked pages are over that limit: active caches must
    release that many (suspend or close them) before it fits, whatever ``pages_needed - pages_available`` says
    (it may be 0 or less); 0 for a refusal by room. ``KVCacheManager.can_fit``/``can_fit_in_chunks`` answering
    False record one too, about an otherwise empty manager: ``pages_available`` is then the pool group's GPU slots
    (what the statistics read there; for a hybrid's SSM live states over the admission limit too, as a ``resume``'s
    or a batch request's: the limit is in the sentence), ``fits_empty_manager`` False.
    ``held_pages``: of the pool group's pages at ``level``, those of caches under a ``KVCache.hold`` (e.g. a NIXL
    READ given up that may still write, a sender's pages being read): counted as used, and freed only once the
    writer outside the manager lets go, not by anything the engine calls; ``detail`` names the hold reasons. Every
    kind of refusal counts them (the fit queries too, though their answer is about an otherwise empty manager). 0
    when none is held. ``stranded_pages``: for a refusal by room of a page call (``resize``, ``resume``, a batch
    request) or of an evicting ``prefetch``, the pool group's held GPU pages (kept for other suspended caches, or
    uncommitted blocks behind a window) that can neither be dropped nor moved to a colder tier now, less this
    cache's own: ``get_usage()``'s ``held`` less what ``get_storage_statistics()``'s ``evictable`` counts beyond
    ``reusable``, less those this cache holds, never below 0. While it is above 0, suspending a cache frees no GPU
    page there (its pages join them), closing one does; the sentence says so. 0 for every other refusal."""

    call: str
    tier: CacheTier
    level: int
    pool_group: int
    pages_needed: int
    pages_available: int
    pages_total: int
    fits_empty_manager: bool
    detail: str
    by_watermark: bool = False
    own_stale_pages: int = 0
    pages_over_limit: int = 0
    held_pages: int = 0
    stranded_pages: int = 0


def explain_refusal(
    store: PageStore,
    call: str,
    need: list[int],
    own_pages: list[int],
    max_util: float | None = None,
    pinned: list[list[int]] | None = None,
    onboard: list[list[int]] | None = None,
    by_watermark: bool = False,
    num_blocks: int = 0,
    sources: list[list[tuple[int, int]]] | None = None,
    reserved: list[int] | None = None,
    own_counted: list[int] | None = None,
    freed: list[int] | None = None,
    short: int = -1,
    own_stale: int = 0,
    own_held: Callable[[], list[Page]] | None = None,
) -> Refusal:
    """The reason ``store.fits(need, max_util, pinned, onboard, sources, reserved)`` answered False (or a plan was
    refused before asking it); ``own_pages[pool_group]`` are the GPU pages the caller keeps through the step,
    ``own_counted[pool_group]`` those of them ``store.num_locked`` already counts (locked or claimed), ``freed``
    the pages the step's own release would have made available (not there now: the refusal undid it) and ``short``
    the pool group found short then, ``num_blocks`` the blocks the planned capacity spans (beyond
    ``MAX_BLOCKS_PER_CACHE``, that is the reason), ``own_stale`` what ``own_stale_room`` found, ``own_held``
    lists every page the caller holds a count on (what ``stranded_pages`` leaves out), called only when some held
    page is stranded: it walks every block of the cache, which a refusal of another kind need not pay for."""
    if short < 0:
        short = store.shortfall(need, max_util, pinned, onboard, sources, reserved)
    if short < 0:  # refused by planning alone: the pool group whose whole GPU tier is too small
        short = max(range(len(need)), key=lambda pool_group: need[pool_group] - store.pool_group_slots(pool_group))
    never = [  # a pool group the step could not fit even alone is the reason to give: waiting will not help
        pool_group
        for pool_group in range(len(need))
        if own_pages[pool_group] + need[pool_group] + (0 if onboard is None else sum(onboard[pool_group]))
        > _limit(store.pool_group_slots(pool_group), max_util)
    ]
    if never and short not in never:
        short = never[0]
    moving = 0 if onboard is None else sum(onboard[short])
    # What the statistics read (``StorageStatistics.available``), and of it what this step cannot use: its own
    # held pages and claimed sources, which eviction counts as able to leave but which must stay.
    available = store.available_to(short)
    unusable = available - store.available_to(
        short, None if pinned is None else pinned[short], None if sources is None else sources[short]
    )
    needed = need[short] + moving + unusable - (0 if freed is None else freed[short])
    total = store.pool_group_slots(short)
    kept = own_pages[short] + need[short] + moving
    own_locked = 0 if own_counted is None else own_counted[short]
    limit = _limit(total, max_util)
    locked = store.num_locked(short, reserved) - own_locked  # by other caches: what the admission limit adds to ``kept``
    over = locked + kept - limit
    too_long = num_blocks > MAX_BLOCKS_PER_CACHE
    by_own_stale = stranded = 0
    if too_long:  # a window's pages stay few, so the page counts would not say it
        detail = (
            f"the capacity spans {num_blocks} blocks; a cache may span at most {MAX_BLOCKS_PER_CACHE} (its per-block "
            f"tables grow with it, whatever the window keeps): shorten the request"
        )
    elif by_watermark:
        detail = (
            f"admitting would lock more than {max_util} of pool group {short}'s {counted(total, 'page')} ({limit}), "
            f"{over} over with the {locked} that other caches lock: the admission watermark keeps the rest for running "
            f"caches to grow into"
        )
    elif kept > limit:
        detail = (
            f"the request needs {counted(kept, 'GPU page')} in pool group {short}; it may use at most {limit} of "
            f"{total}"
        )
        if kept <= total:  # the admission limit, not the tier, is short: the cache outgrew it by resize
            detail += (
                f": a resume may lock at most {max_util} of a pool group (KVCacheManagerConfig.max_util_for_resume, "
                f"less admission_watermark), even alone, and resize is not bounded by it: raise max_util_for_resume "
                f"or give the GPU tier more memory"
            )
            if call in ("KVCache.resume", "create_kv_cache_batch"):  # it locks its matched or held pages at once
                detail += (
                    "; or close the cache and create the request again without input tokens: its resume then locks "
                    "no matched prefix, and resizes compute the prompt chunk by chunk (as ContinuousBatcher does)"
                )
        elif len(need) > 1:
            detail += split_hint(len(need))
        else:  # one pool group: the GPU tier is smaller than this request (too small, or its quota was lowered)
            detail += (
                ": the GPU tier has fewer slots than it needs: raise its quota (KVCacheManager.resize, within the "
                "tier's max_quota)"
            )
            detail += ", or close the cache" if call == "KVCache.resume" else ", or shorten the request"
    elif max_util is not None and over > 0:
        detail = (
            f"resuming would lock more than the admission limit, {max_util} of pool group {short}'s "
            f"{counted(total, 'page')} ({limit}; max_util_for_resume less admission_watermark): {kept} for this "
            f"request and {locked} that other caches lock, {over} over; active caches must release that many "
            f"(suspend or close them)"
        )
        if len(need) > 1 and 2 * kept > limit:  # e.g. a small tier's SSM group: one live state, one request at once
            detail += (
                f"; this pool group admits one such request at a time: to run more at once, raise "
                f"max_util_for_resume{split_hint(len(need))}"
            )
    elif own_stale:  # the only refusal by room whose way out is this cache's own call
        by_own_stale = own_stale
        ways_out = (  # a suspended cache (resume, batch admission) cannot commit
            "commit the computed blocks (KVCache.commit) or call KVCache.stop_committing() and the step fits"
            if call == "KVCache.resize"
            else "call KVCache.stop_committing() and the resume fits (a suspended cache cannot commit)"
        )
        detail = (
            f"{counted(needed, 'GPU page')} needed in pool group {short}, {available} free or evictable; this "
            f"cache itself holds {counted(own_stale, 'page')} of computed blocks behind its window, uncommitted, kept "
            f"for a commit: {ways_out}"
        )
    else:
        detail, stranded = _by_room(store, short, needed, available, own_held)
    fits = kept <= limit and not too_long
    if not fits and not too_long:  # against the tier (or the limit) alone: every GPU page the step holds, as said
        needed = kept
    over_limit = over if fits and max_util is not None and over > 0 else 0
    return Refusal(
        call, store.tiers[GPU_LEVEL].tier, GPU_LEVEL, short, needed, available, total, fits, detail, by_watermark,
        by_own_stale, over_limit, 0, stranded,
    )


def _by_room(
    store: PageStore, short: int, needed: int, available: int, own_held: Callable[[], list[Page]] | None,
    clause: str = "",
) -> tuple[str, int]:
    """The sentence of a refusal by room in GPU pool group ``short`` (a page call's, an evicting prefetch's, with
    ``clause`` after its head) and its ``stranded_pages``: the held GPU pages there that can neither be dropped nor
    moved colder, less the caller's own (``own_held``: every page it holds a count on, asked only when some are)."""
    detail = (
        f"{counted(needed, 'GPU page')} needed in pool group {short}, {available} free or evictable; other caches "
        f"hold the rest{clause}"
    )
    stranded = max(0, store.stranded_held(short))
    if stranded > 0 and own_held is not None:
        stranded = max(0, stranded - _held_on_gpu(store, short, own_held()))
    if stranded > 0:  # a scheduler that preempts only by suspending would wait here forever
        detail += (
            f"; {stranded} of pool group {short}'s GPU pages {is_are(stranded)} held for other caches (suspended, or "
            f"uncommitted blocks behind a window) with no room on a colder tier to move to: suspending a cache frees "
            f"no GPU page here, closing one does (compute it again later)"
        )
    return detail, stranded


def held_pages_refusal(refusal: Refusal, held_caches: dict[int, tuple[Callable[[], list[Page]], list[str]]]) -> Refusal:
    """``refusal`` with ``held_pages`` and a sentence naming the holds, when caches under ``KVCache.hold`` keep
    pages of its tier and pool group (``CacheServices.held_caches``); itself otherwise. Refusal path only: every
    refusal passes here as it is recorded (``CacheServices.note_refusal``)."""
    held_ids: set[int] = set()  # by identity: two caches may share a page
    reasons: list[str] = []
    for pages_of, hold_reasons in held_caches.values():
        before = len(held_ids)
        for page in pages_of():
            if page.level == refusal.level and page.pool_group == refusal.pool_group:
                held_ids.add(id(page))
        if len(held_ids) > before:
            reasons.extend(reason for reason in hold_reasons if reason not in reasons)
    if not held_ids:
        return refusal
    detail = refusal.detail
    if _is_shortage(refusal):  # not lost content: the holds may be why, name them
        where = "GPU pages" if refusal.level == GPU_LEVEL else f"pages at level {refusal.level}"
        detail += (
            f"; {len(held_ids)} of pool group {refusal.pool_group}'s {where} {is_are(len(held_ids))} in held caches "
            f"(KVCache.hold), used until each hold is released: {'; '.join(reasons)}"
        )
    if not refusal.fits_empty_manager:  # the step is too big for the tier itself: no release makes it fit
        detail += " (releasing them would not make this fit: it does not fit an otherwise empty manager)"
    return Refusal(
        refusal.call, refusal.tier, refusal.level, refusal.pool_group, refusal.pages_needed, refusal.pages_available,
        refusal.pages_total, refusal.fits_empty_manager, detail, refusal.by_watermark, refusal.own_stale_pages,
        refusal.pages_over_limit, len(held_ids), refusal.stranded_pages,
    )


def _held_on_gpu(store: PageStore, pool_group: int, pages: list[Page]) -> int:
    """How many of ``pages`` (each counted once: a cache's groups may share one) sit in the held queue of the GPU
    pool group: the caller's own share of the held pages there."""
    held_queue = store.queues[GPU_LEVEL][pool_group].held
    ids: set[int] = set()
    for page in pages:
        if page.queue is held_queue:
            ids.add(id(page))
    return len(ids)


def _is_shortage(refusal: Refusal) -> bool:
    """Whether room or a limit was short (every refusal but lost content's and ``adjust``'s nothing-to-split)."""
    return (
        refusal.pages_needed > 0 or refusal.pages_over_limit > 0 or refusal.by_watermark
        or not refusal.fits_empty_manager
    )


def split_hint(num_pool_groups: int) -> str:
    """The tail of a GPU shortfall's sentence with several pool groups: the split, not the tier's size, may be
    what is short, so it names the setting that makes it."""
    return (
        f" (the GPU tier is split across {num_pool_groups} pool groups for KVCacheManagerConfig.typical_step, or "
        f"initial_pool_ratio: declare the steps the engine runs there, or give the tier more memory)"
    )



def _limit(total: int, max_util: float | None) -> int:
    """The pages of a pool group of ``total`` a step may hold under ``max_util`` (all without one)."""
    return total if max_util is None else int(max_util * total)


def content_lost_refusal(store: PageStore, call: str) -> Refusal:
    """A batch request refused because pages it matched lost their content on the way to the GPU (a failed disk
    read, a cold-page codec's error): no pool group was short (``pages_needed`` 0, the GPU tier's first pool group
    as the statistics read it), and creating it again fits (its lost blocks are no longer matched)."""
    detail = (
        f"pages the request matched lost their content ({store.last_copy_error}); create it again: its lost blocks "
        f"are no longer matched, so it recomputes them"
    )
    available = store.available_to(0)
    return Refusal(call, store.tiers[GPU_LEVEL].tier, GPU_LEVEL, 0, 0, available, store.pool_group_slots(0), True, detail)


def prefetch_refusal(
    store: PageStore, target: int, left_colder: list[Page], movable: list[Page], evict_util: float | None
) -> Refusal:
    """Why ``KVCache.prefetch(target)`` answered False: ``left_colder`` (never empty) are the cache's ``movable``
    pages still colder than ``target``; the pool group (at ``target``) of the first of them is the one named.
    ``evict_util``: the admission limit an evicting prefetch stays within (None: free slots only). Counted as a
    ``resume`` counts (``explain_refusal``): ``own`` is every page of the cache's that pool group would then hold
    at ``target`` (those warmer stay where they are); when they would not fit the level even alone (under the
    limit), ``fits_empty_manager`` is False and ``pages_needed`` is ``own``. Otherwise, into free slots, the pages
    still to move against the free slots; evicting, by the limit (``pages_over_limit``: ``own`` and what active
    caches lock, over it), or by room: the pages still to move and the cache's own GPU pages that eviction counts
    as able to leave but that stay, against the statistics' ``available``, in a resume's sentence (``_by_room``),
    ``stranded_pages`` and all."""
    group_of = store.grouping.group_of[target]
    short = group_of[left_colder[0].life_cycle]
    stuck = sum(1 for page in left_colder if group_of[page.life_cycle] == short)
    slots = store.tiers[target].pool_groups[short]
    total, free = slots.num_slots, slots.allocator.num_free
    pinned = [0] * len(store.tiers)  # the cache's pages of that pool group per level: none of them is evicted
    for page in movable:
        if group_of[page.life_cycle] == short:
            pinned[page.level] += 1
    own = sum(pinned[target:])
    limit = _limit(total, evict_util)
    stays = "stays" if stuck == 1 else "stay"
    needed, over_limit, stranded = stuck, 0, 0
    if evict_util is None:
        available = free
        detail = (
            f"{stuck} of this cache's pages of pool group {short} {stays} colder than level {target}: it has "
            f"{counted(free, 'free slot')} of {total}, and prefetch moves pages into free slots only (nothing is "
            f"evicted for them)"
        )
        if target == 0 and own <= limit:  # never fitting, resume would be refused too (said below)
            detail += "; prefetch(0, evict=True) makes room as resume would, and resume brings them all"
    else:
        available = store.available_to(short)
        locked = store.num_locked(short)
        over = locked + own - limit
        if over > 0:
            over_limit = over
            detail = (
                f"{stuck} of this cache's pages of pool group {short} {stays} off the GPU: prefetch(evict=True) "
                f"brings no more than resume could then lock, and bringing them would lock more than the admission "
                f"limit, {evict_util} of pool group {short}'s {counted(total, 'page')} ({limit}; max_util_for_resume "
                f"less admission_watermark): {own} for this cache and {locked} that active caches lock, {over} over; "
                f"active caches must release that many (suspend or close them)"
            )
        else:  # by room: within the limit, yet held GPU pages no colder tier has room for (other suspended caches',
            # uncommitted blocks behind a window) take the slots, as plainly as another suspended cache filling the
            # GPU with the host full. Counted as a resume's: what eviction counts as able to leave includes this
            # cache's own GPU pages, which stay
            needed = stuck + available - store.available_to(short, pinned)
            clause = (
                f": {stuck} of this cache's pages {stays} off the GPU (prefetch(evict=True) makes room as resume would)"
            )
            detail, stranded = _by_room(store, short, needed, available, lambda: movable, clause)
    fits = own <= limit
    if not fits:  # as a step that never fits: every page it would hold there, against what the level allows
        needed, over_limit = own, 0
        where = "on the GPU" if target == 0 else f"at level {target}"
        detail += (
            f"; even alone it never fits: this cache's {counted(own, 'page')} of pool group {short} {where} exceed "
            f"the {limit} it may hold there"
        )
    return Refusal(
        "KVCache.prefetch", store.tiers[target].tier, target, short, needed, available, total, fits, detail,
        pages_over_limit=over_limit, stranded_pages=stranded,
    )


def own_stale_room(
    store: PageStore,
    groups: list[AttentionState],
    history: int,
    num_committed_blocks: int,
    released: list[Released],
    need: list[int],
    pinned: list[list[int]],
    max_util: float | None = None,
    onboard: list[list[int]] | None = None,
    sources: list[list[tuple[int, int]]] | None = None,
    reserved: list[int] | None = None,
) -> int:
    """The pages this cache holds as stale uncommitted pages on any tier (held already at ``history``, or made stale
    by the refused step, ``released``, and kept for a commit) when the step would fit were they freed, as
    ``stop_committing`` frees them (a colder tier's slots let the GPU's held pages leave); 0 when it would not. The step is what ``PageStore.fits`` was asked (a resize:
    ``need`` net of the room it makes itself, ``pinned`` as ``room_released`` counted; a resume or a batch
    admission: its ``max_util``, ``onboard``, ``sources``, ``reserved`` too). Held pages are locked by nobody, so
    freeing them changes room, never utilisation."""
    freed = [[0] * len(tier.pool_groups) for tier in store.tiers]
    for group in groups:
        stale_beg, stale_end = group.life_cycle.stale(history)
        for ordinal in range(max(stale_beg, num_committed_blocks), stale_end):
            _count_if_alone(group.entries[ordinal], freed)
    for group, ordinal, page in released:  # those leaving anyway are counted in the step's room already
        if not leaves_when_stale(page, ordinal, num_committed_blocks, True):
            _count_if_alone(page, freed)
    if not any(any(groups) for groups in freed):
        return 0
    if store.fits(need, max_util, pinned, onboard, sources, reserved, freed):
        return sum(sum(groups) for groups in freed)
    return 0


def _count_if_alone(page: Page | None, freed: list[list[int]]) -> None:
    """Count a page only this cache's hold keeps (freeing it gives its slot back) under its level and that level's
    pool group: with a cold-page codec a colder level groups layer groups otherwise than the GPU."""
    if page is not None and page.hold_count == 1 and page.lock_count == 0 and page.claim_count == 0:
        freed[page.level][page.pool_group] += 1
