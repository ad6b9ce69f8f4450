"""Every soft refusal can be explained afterwards: ``KVCache.last_refusal``, ``KVCacheManager.last_refusal`` and
``last_batch_refusals`` say which tier and pool group was short, by how much, and whether it could ever fit."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
from pathlib import Path
from typing import Callable

import pytest

from kv_cache_manager_v2 import (
    BatchDesc,
    CacheTier,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheRequest,
    KVCacheStatus,
    OutOfPagesError,
    Refusal,
)

from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2._handoff.nixl_agent import UNFINISHED_READ
from tests.fuzz.configs import CONFIGS
from tests.helpers import KIB, MIB, SMALL_SLOTS, attention, make_config, small_manager

TPB = 32



def test_resize_short_records_what_was_short() -> None:
    manager = small_manager()
    hog = manager.create_kv_cache()
    assert hog.resume() and hog.resize(7 * TPB)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(2 * TPB)
    assert (cache.last_refusal, manager.last_refusal) == (None, None)
    assert not cache.resize(5 * TPB)
    refusal = cache.last_refusal
    assert refusal is not None and manager.last_refusal == refusal
    assert refusal.call == "KVCache.resize"
    assert (refusal.tier, refusal.level, refusal.pool_group) == (CacheTier.GPU_MEM, 0, 0)
    assert (refusal.pages_needed, refusal.pages_available, refusal.pages_total) == (3, 1, SMALL_SLOTS)
    assert refusal.fits_empty_manager
    assert "pool group 0" in refusal.detail
    assert hog.last_refusal is None
    hog.close()
    assert cache.resize(5 * TPB)
    assert cache.last_refusal == refusal  # kept until the next refusal
    cache.close()


def test_resize_that_never_fits_says_so() -> None:
    manager = small_manager()
    cache = manager.create_kv_cache()
    assert cache.resume()
    assert not cache.resize(SMALL_SLOTS * TPB + 1)
    refusal = cache.last_refusal
    assert refusal is not None
    assert refusal.pages_needed == SMALL_SLOTS + 1 and refusal.pages_total == SMALL_SLOTS and refusal.pages_available == SMALL_SLOTS
    assert not refusal.fits_empty_manager
    assert f"at most {SMALL_SLOTS}" in refusal.detail
    assert not cache.resize(10**9)  # refused by planning alone, before any allocation is tried
    huge = cache.last_refusal
    assert huge is not None and not huge.fits_empty_manager and huge.pages_needed > SMALL_SLOTS
    cache.close()


def test_resume_short_by_utilisation() -> None:
    manager = small_manager(max_util_for_resume=0.5)
    first = manager.create_kv_cache()
    assert first.resume() and first.resize(4 * TPB)
    first.suspend()
    blocker = manager.create_kv_cache()
    assert blocker.resume() and blocker.resize(2 * TPB)
    assert not first.resume()  # 2 locked + 4 to lock = 60% > 50%
    refusal = first.last_refusal
    assert refusal is not None and manager.last_refusal == refusal
    assert refusal.call == "KVCache.resume"
    assert refusal.fits_empty_manager  # 4 of at most 5
    assert "max_util_for_resume" in refusal.detail
    # The figure to act on is a field, not only words: 6 locked of at most 5, whatever the room says (plenty free).
    assert refusal.pages_over_limit == 1 and refusal.pages_needed <= refusal.pages_available
    blocker.close()
    assert first.resume()
    first.close()


def test_batch_request_refused_is_explained_per_request() -> None:
    manager = small_manager()
    requests = [
        KVCacheRequest(list(range(3 * TPB))),
        KVCacheRequest(list(range(100, 100 + 20 * TPB))),
        KVCacheRequest([], capacity=4 * TPB),
        KVCacheRequest([], capacity=5 * TPB),
    ]
    caches = manager.create_kv_cache_batch(requests)
    assert [cache is None for cache in caches] == [False, True, False, True]
    reasons = manager.last_batch_refusals
    assert len(reasons) == 4 and reasons[0] is None and reasons[2] is None
    never, short = reasons[1], reasons[3]
    assert never is not None and short is not None
    assert never.call == short.call == "create_kv_cache_batch"
    assert not never.fits_empty_manager and never.pages_needed == 20
    assert short.fits_empty_manager and short.pages_needed == 5 and short.pages_available == 3
    assert manager.last_refusal == short
    for cache in caches:
        if cache is not None:
            cache.close()
    assert manager.create_kv_cache_batch([KVCacheRequest([1, 2])])[0] is not None
    assert manager.last_batch_refusals == (None,)


def test_refusal_is_an_immutable_picklable_value() -> None:
    refusal = Refusal("KVCache.resize", CacheTier.GPU_MEM, 0, 0, 3, 1, 10, True, "short")
    assert pickle.loads(pickle.dumps(refusal)) == refusal
    assert copy.deepcopy(refusal) == refusal
    with pytest.raises(dataclasses.FrozenInstanceError):
        refusal.pages_needed = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda manager: manager.can_fit(-1), "num_tokens"),
        (lambda manager: manager.can_fit(5, chunk_size=0), "chunk_size"),
        (lambda manager: manager.max_admissible(0), "chunk_size"),
        (lambda manager: manager.max_admissible(1, -1), "token_num_upper_bound"),
    ],
)
def test_admission_limit_bad_input_names_the_argument(call: Callable[[KVCacheManager], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(small_manager())


def test_construction_warns_once_when_the_declared_request_cannot_fit(caplog: pytest.LogCaptureFixture) -> None:
    step = BatchDesc([KVCacheDesc(12 * TPB, 11 * TPB)])
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        small_manager(typical_step=step)
    warnings = [record.getMessage() for record in caplog.records if record.name == "kv_cache_manager_v2"]
    assert len(warnings) == 1 and f"{12 * TPB} tokens" in warnings[0] and f"{SMALL_SLOTS * TPB}" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        small_manager(typical_step=BatchDesc([KVCacheDesc(4 * TPB, 3 * TPB)]))
    assert not [record for record in caplog.records if record.name == "kv_cache_manager_v2"]


def test_a_never_fitting_refusal_with_several_pool_groups_names_the_split() -> None:
    """Reported by the docs-only integration: the default typical_step (decode steps of 4,096 tokens) leaves a
    sliding-window group of a small GPU tier too few slots for one prefill chunk, while the tier has room to spare
    in the other group. The reason must point at the split, not only at the tier's size."""
    layers = [attention(0, 8 * KIB, window=64, sinks=16), attention(1, 4 * KIB)]  # two slot sizes: two pool groups
    manager = KVCacheManager(make_config(layers, gpu_quota=2 * MIB, tokens_per_block=16))
    cache = manager.create_kv_cache()
    assert cache.resume()
    assert not cache.resize(256, 224)  # one 32-token chunk: 7 window pages, the split gave that group 5
    refusal = cache.last_refusal
    assert refusal is not None and not refusal.fits_empty_manager and refusal.pool_group == 0
    assert "typical_step" in refusal.detail and "2 pool groups" in refusal.detail
    cache.close()
    declared = BatchDesc([KVCacheDesc(256, 224)] * 2)  # what the detail asks for: the same tier then serves it
    planned = KVCacheManager(make_config(layers, gpu_quota=2 * MIB, tokens_per_block=16, typical_step=declared))
    fitting = planned.create_kv_cache()
    assert fitting.resume() and fitting.resize(256, 224)
    fitting.close()
    single = small_manager()
    alone = single.create_kv_cache()
    assert alone.resume() and not alone.resize(SMALL_SLOTS * TPB + 1)
    assert alone.last_refusal is not None and "typical_step" not in alone.last_refusal.detail  # nothing to split
    alone.close()


def test_a_capacity_beyond_the_block_limit_says_so() -> None:
    """A sliding window keeps the pages few, so a capacity beyond ``MAX_BLOCKS_PER_CACHE`` blocks was refused with
    a page count no GPU tier could meet ("needs 16777219 GPU pages") while ``can_fit`` answered True."""
    manager = KVCacheManager(make_config([attention(0, 8 * KIB, window=64)], gpu_quota=SMALL_SLOTS * 16 * KIB))
    limit = (1 << 24) * TPB  # tokens
    assert manager.max_admissible(1) == limit and not manager.can_fit(limit + 1)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(limit, limit - 1)  # a window's pages at the very end: it fits
    assert not cache.resize(limit + 1, limit)
    refusal = cache.last_refusal
    assert refusal is not None and not refusal.fits_empty_manager
    assert f"at most {1 << 24}" in refusal.detail and "GPU pages" not in refusal.detail
    assert (cache.capacity, cache.history_length) == (limit, limit - 1)
    cache.close()


def test_the_length_setters_raise_with_the_refusals_reason() -> None:
    """``cache.capacity = n`` is ``resize(n)`` raising ``OutOfPagesError`` when refused: the error says why, in the
    refusal's words (the block limit is no memory shortage), and where the figures are."""
    manager = small_manager()
    cache = manager.create_kv_cache()
    assert cache.resume()
    with pytest.raises(OutOfPagesError, match=r"cache 0: capacity 4096 refused: the request needs 128 GPU pages in "
                       r"pool group 0; it may use at most 10 of 10: the GPU tier has fewer slots than it needs: raise its "
                       r"quota .*, or shorten the request .*KVCache.last_refusal"):
        cache.capacity = 4096
    with pytest.raises(OutOfPagesError, match=r"capacity 1073741824 refused: the capacity spans 33554432 blocks; a "
                       r"cache may span at most 16777216"):
        cache.capacity = 1 << 30
    assert cache.capacity == 0
    cache.close()


def _cached_prefix(manager: KVCacheManager, tokens: list[int]) -> None:
    """Commit ``tokens`` and close: their blocks stay on the GPU as reusable pages."""
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens)
    cache.close()


def test_a_batch_admits_each_request_as_its_own_create_and_resume_would() -> None:
    """``max_util_for_resume`` counts, for each request of a batch, what its own create + resume would lock then
    (pages running caches lock, the earlier admitted requests' included, its own matched pages, its new ones),
    not the prefix a later request of the batch matched: that one is pinned until the batch ends, locked by
    nobody. Before, the batch counted every claimed page: the first request was refused (4 claimed + 2 new
    pages > 5 of 10) where creating and resuming it alone fits."""
    prefix = list(range(4 * TPB))
    for one_by_one in (True, False):
        manager = small_manager(max_util_for_resume=0.5)
        _cached_prefix(manager, prefix)
        requests = [KVCacheRequest([], capacity=2 * TPB), KVCacheRequest(prefix + [7], capacity=4 * TPB + 1)]
        if one_by_one:
            results = [manager.create_kv_cache_batch([request])[0] for request in requests]
        else:
            results = manager.create_kv_cache_batch(requests)
        assert [result is not None for result in results] == [True, False], one_by_one
        refusal = manager.last_refusal
        assert refusal is not None and refusal.fits_empty_manager and "max_util_for_resume" in refusal.detail
        for result in results:
            if result is not None:
                result.close()
        manager.shutdown()


def test_a_refusals_available_pages_are_the_statistics_available_and_the_shortfall_is_exact() -> None:
    """``pages_available`` is ``get_storage_statistics()``'s ``available`` of that pool group at that moment (free,
    reusable, and held pages the host tier can take), and ``pages_needed`` what the step must find among them
    (with the caller's own held pages, which the statistics count but which must stay): asking for
    ``pages_needed - pages_available`` pages fewer fits. Before, ``pages_available`` was free + reusable only: 3
    where the statistics said 5 (two of a suspended cache's 4 held pages can go to the host)."""
    slot = 16 * KIB
    config = make_config([attention(0, 8 * KIB)], tiers=[GpuCacheTierConfig(SMALL_SLOTS * slot), HostCacheTierConfig(2 * slot)])
    manager = KVCacheManager(config)
    suspended = manager.create_kv_cache()
    assert suspended.resume() and suspended.resize(4 * TPB)
    suspended.suspend()
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(3 * TPB)
    assert not cache.resize(10 * TPB)
    refusal = manager.last_refusal
    assert refusal is not None
    statistics = manager.get_storage_statistics()[refusal.pool_group]
    assert (refusal.pages_available, refusal.pages_total) == (statistics.available, statistics.total)
    missing = refusal.pages_needed - refusal.pages_available
    assert missing == 2 and not cache.resize((10 - missing) * TPB + 1)
    assert cache.resize((10 - missing) * TPB)
    cache.close()
    suspended.close()
    manager.shutdown()


def test_adjust_with_nothing_to_split_for_says_so_in_place_of_an_older_refusal() -> None:
    """``adjust`` answering False before enough closed caches were observed recorded nothing, so
    ``manager.last_refusal`` still held the previous call's refusal (a resize's, below), which an engine reading
    it after the False takes for the adjust's reason. Before: ``last_refusal.call`` was 'KVCache.resize'."""
    manager = small_manager()
    cache = manager.create_kv_cache()
    assert cache.resume() and not cache.resize((SMALL_SLOTS + 1) * TPB)
    cache.suspend()
    assert not manager.need_adjustment and not manager.adjust()
    refusal = manager.last_refusal
    assert refusal is not None and refusal.call == "KVCacheManager.adjust", refusal
    assert refusal.fits_empty_manager and "need_adjustment" in refusal.detail
    assert refusal.pages_needed == 0 and refusal.pages_total == SMALL_SLOTS
    cache.close()
    manager.shutdown()


def test_a_resume_refused_by_max_util_says_how_many_locked_pages_must_go() -> None:
    """The sentence of a refusal by ``max_util_for_resume`` says how far over the limit the resume is; releasing
    exactly that many locked pages (suspending active caches) makes the same resume fit, one fewer does not. Before,
    it said only that the limit was passed."""
    manager = small_manager(max_util_for_resume=0.5)  # at most 5 of 10 pages locked after a resume
    first = manager.create_kv_cache()
    assert first.resume() and first.resize(4 * TPB)
    first.suspend()
    blockers = []
    for _ in range(3):
        blocker = manager.create_kv_cache()
        assert blocker.resume() and blocker.resize(TPB)
        blockers.append(blocker)
    for expected_over in (2, 1):
        assert not first.resume()
        refusal = first.last_refusal
        assert refusal is not None
        assert f"{expected_over} over" in refusal.detail, refusal.detail
        assert "4 for this request" in refusal.detail and f"{expected_over + 1} that other caches lock" in refusal.detail
        blockers.pop().suspend()
    assert first.resume()
    for cache in [first, *blockers]:
        cache.close()


def test_a_quota_refusal_counts_only_the_pages_that_cannot_leave() -> None:
    """Shrinking a tier is refused by the pages that can neither be dropped nor moved colder: ``pages_needed -
    pages_available`` of the refusal is how many of them must go (closing the caches that hold them) before the
    same call fits, one fewer still refuses. Before, ``pages_needed`` was every page the tier held, reusable ones
    included (7 where 4 held pages cannot leave: 'missing' 5 where 2 are)."""
    slot = 16 * KIB
    config = make_config([attention(0, 8 * KIB)], tiers=[GpuCacheTierConfig(SMALL_SLOTS * slot), HostCacheTierConfig(8 * slot)])
    manager = KVCacheManager(config)
    reusable = manager.create_kv_cache(None, list(range(3 * TPB)))
    assert reusable.resume() and reusable.resize(3 * TPB)
    reusable.commit(list(range(3 * TPB)))
    reusable.suspend()
    assert reusable.offload() == 3
    reusable.close()  # 3 reusable pages on the host tier
    holders = []
    for _ in range(4):  # 4 held pages on the host tier, one per cache
        holder = manager.create_kv_cache()
        assert holder.resume() and holder.resize(TPB)
        holder.suspend()
        assert holder.offload() == 1
        holders.append(holder)
    for expected_missing in (2, 1):
        assert not manager.resize(1, 2 * slot)
        refusal = manager.last_refusal
        assert refusal is not None and refusal.call == "KVCacheManager.resize" and refusal.level == 1
        assert refusal.pages_needed - refusal.pages_available == expected_missing, refusal
        holders.pop().close()
    assert manager.resize(1, 2 * slot)
    for holder in holders:
        holder.close()


def test_a_resize_whose_window_passes_counts_the_pages_it_lets_go() -> None:
    """A resize that advances the history lets the window's passed blocks go before it allocates (uncommitted, so
    held: the host tier can take them): its refusal counts the pages the cache keeps at the new history, and those
    it lets go as room it would have had. Before, it counted every page the cache held before the step: 'the
    request needs 13 GPU pages; it may use at most 8' (fits_empty_manager False, so a batcher rejects the request
    for good, while can_fit said True), and a shortfall of 6 pages where closing the one-page cache beside it is
    enough."""
    tpb = 16
    slot = 2 * KIB
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(8 * slot), HostCacheTierConfig(8 * slot)]
    manager = KVCacheManager(make_config([attention(0, KIB, window=2 * tpb)], tiers=tiers, tokens_per_block=tpb))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(7 * tpb)
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(tpb)  # the eighth page
    capacity, history = 13 * tpb, 7 * tpb  # keeps blocks 5 and 6, lets 0-4 go, needs 7-12
    assert not cache.resize(capacity, history)
    refusal = cache.last_refusal
    assert refusal is not None
    assert refusal.fits_empty_manager and manager.can_fit(capacity, capacity - history), refusal
    assert refusal.pages_needed - refusal.pages_available == 1, refusal
    statistics = manager.get_storage_statistics()[0]
    assert (refusal.pages_available, refusal.pages_total) == (statistics.available, statistics.total)
    other.close()
    assert cache.resize(capacity, history)
    cache.close()


def test_a_refusal_names_a_pool_group_the_step_never_fits_before_one_short_for_now() -> None:
    """A step short of room in one pool group (other caches hold it) and beyond a second one's whole GPU tier:
    waiting cannot help, so the refusal names the second with ``fits_empty_manager`` False, as ``can_fit`` says.
    Before, it named the first pool group found short, with ``fits_empty_manager`` True: a batcher waits for
    room that never comes (found by the fuzzer, cold_codec, seed 21)."""
    layers = [attention(0, KIB), attention(1, 2 * KIB, window=16)]  # two life cycles, two slot sizes: two pool groups
    config = make_config(layers, gpu_quota=8 * 2 * KIB + 2 * 4 * KIB, tokens_per_block=16, initial_pool_ratio=[16, 8])
    manager = KVCacheManager(config)
    assert [statistics.total for statistics in manager.get_storage_statistics()] == [8, 2]
    hog = manager.create_kv_cache()
    assert hog.resume() and hog.resize(96, 95)  # 6 full-attention pages, 1 window page
    cache = manager.create_kv_cache()
    assert cache.resume() and not cache.resize(48, 0)  # 3 + 3 pages: 2 free in the first group, 2 slots in all in the second
    refusal = cache.last_refusal
    assert refusal is not None and refusal.pool_group == 1 and not refusal.fits_empty_manager, refusal
    assert not manager.can_fit(48, 48)
    hog.close()
    assert not cache.resize(48, 0)
    cache.close()


def test_a_resize_refusal_counts_the_scratch_slots_the_cache_keeps(tmp_path: Path) -> None:
    """With SWA scratch reuse, a cache keeps its scratch slots through a resize (the step asks only for the extra
    ones): alone on the manager, the step below needs 21 of 20 pages and never fits. Counting the entries kept at
    the new history (the window fix before this one) left the scratch slots out and said ``fits_empty_manager``
    True (found by the fuzzer, swa_scratch, seed 24)."""
    manager = KVCacheManager([config for config in CONFIGS if config.name == "swa_scratch"][0].build(str(tmp_path)))
    assert manager.resize(0, 20 * sum(manager.get_slot_bytes(0)))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(47, 0)
    cache.commit(list(range(47)))
    assert cache.resize(89, 47)
    assert not cache.resize(138, 89)
    refusal = cache.last_refusal
    assert refusal is not None and not refusal.fits_empty_manager, refusal
    assert not manager.can_fit(138, 138 - 89)
    cache.close()


def test_a_cache_grown_past_max_util_for_resume_is_refused_for_good_and_told_why() -> None:
    """SPEC: ``resume`` refuses above ``max_util_for_resume``, even alone; ``resize`` is not bounded by it, so a
    running cache can outgrow it and, once suspended, never resume. ``resumable_alone`` says so before the
    suspend; the refusal names the limit, its value, the pages needed and allowed, and the way out (it said only
    "needs 10 GPU pages in pool group 0; it may use at most 9 of 10")."""
    manager = small_manager()  # the default max_util_for_resume=0.97: a resume locks at most 9 of 10 pages
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize((SMALL_SLOTS - 1) * TPB)
    alone = [cache.resumable_alone]
    assert cache.resize(SMALL_SLOTS * TPB)  # a resize may use the whole tier
    alone.append(cache.resumable_alone)
    cache.suspend()
    alone.append(cache.resumable_alone)
    assert alone == [True, False, False]
    assert not cache.resume() and cache.status == KVCacheStatus.SUSPENDED
    refusal = cache.last_refusal
    assert refusal is not None and not refusal.fits_empty_manager
    assert refusal.detail.startswith(f"the request needs {SMALL_SLOTS} GPU pages in pool group 0; it may use at most "
                                     f"{SMALL_SLOTS - 1} of {SMALL_SLOTS}: a resume may lock at most 0.97 of a pool "
                                     f"group (KVCacheManagerConfig.max_util_for_resume"), refusal.detail
    assert "raise max_util_for_resume or give the GPU tier more memory" in refusal.detail
    cache.close()
    with pytest.raises(ValueError, match="is closed"):
        _ = cache.resumable_alone
    roomy = small_manager(max_util_for_resume=1.0)  # the way out the refusal names
    full = roomy.create_kv_cache()
    assert full.resume() and full.resize(SMALL_SLOTS * TPB) and full.resumable_alone
    full.suspend()
    assert full.resume()
    full.close()


def test_a_refusal_names_the_pages_of_held_caches() -> None:
    """Pages of a cache under ``KVCache.hold`` (here as the NIXL receiver holds one whose READ it gave up but NIXL
    still reports in progress) are used until the hold is released, whatever the engine does. Before: a refusal
    said only 'other caches hold the rest' (``Refusal`` had no ``held_pages``)."""
    manager = small_manager()
    hog = manager.create_kv_cache()
    assert hog.resume() and hog.resize(7 * TPB)
    hold = hog.hold(UNFINISHED_READ)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(2 * TPB)
    assert not cache.resize(5 * TPB)
    refusal = cache.last_refusal
    assert refusal is not None and refusal.held_pages == 7  # the hog's 7 blocks, one page each
    assert f"7 of pool group 0's GPU pages are in held caches (KVCache.hold), used until each hold is released: {UNFINISHED_READ}" in refusal.detail
    hold.release()
    assert not cache.resize(5 * TPB)
    assert cache.last_refusal is not None and cache.last_refusal.held_pages == 0  # released: no longer named
    assert "held caches" not in cache.last_refusal.detail
    hog.close()
    cache.close()
    manager.shutdown()


@pytest.mark.parametrize("blocks", [13, 14])
def test_a_step_beyond_the_gpu_tier_counts_the_pages_the_cache_holds_once(blocks: int) -> None:
    """A cache already holding 3 pages (reused or grown) that asks for more than the whole GPU tier (10 slots):
    its sentence and ``pages_needed`` count the pages the step would hold, the 3 it holds included (as ``can_fit``
    of the step does: it never fits, so they are the figure to set against the tier's 10), in a resize and in a
    batch admission, whether planning finds the shortage (13 blocks: 10 new pages, no more than the tier) or the
    arithmetic shortcut does (14 blocks: 11 new pages, more than the tier). Before, the shortcut's ``pages_needed``
    counted the held pages and planning's did not: 13 then 10 for 13 blocks; later both left them out, 10 then 11,
    while the sentence said 13 and 14."""
    manager = small_manager()
    prompt = list(range(3 * TPB))
    cache = manager.create_kv_cache(input_tokens=prompt)
    assert cache.resume() and cache.resize(3 * TPB)
    cache.commit(prompt)
    assert not cache.resize(blocks * TPB)
    grown = cache.last_refusal
    assert grown is not None and not grown.fits_empty_manager
    assert grown.pages_needed == blocks and f"needs {blocks} GPU pages" in grown.detail, grown
    cache.close()
    assert manager.create_kv_cache_batch([KVCacheRequest(prompt + [7] * TPB, capacity=blocks * TPB)]) == [None]
    admitted = manager.last_batch_refusals[0]
    assert admitted is not None and not admitted.fits_empty_manager
    assert admitted.pages_needed == blocks and f"needs {blocks} GPU pages" in admitted.detail, admitted
