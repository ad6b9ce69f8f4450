"""A False from ``can_fit``/``can_fit_in_chunks`` comes with its reason in ``manager.last_refusal``, as every other
refusing call's does: the pool group short, the pages the step needs there against the slots it has."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheManager, KVCacheRequest, Refusal
from kv_cache_manager_v2.config import GpuCacheTierConfig, HostCacheTierConfig, LayerConfig
from tests.helpers import KIB, SMALL_SLOTS, attention, make_config, small_manager, ssm

TPB = 32


def test_can_fit_says_which_pool_group_is_short_and_by_how_many_pages() -> None:
    """Before, ``can_fit`` answered False and ``last_refusal`` stayed None: the engine could not learn why."""
    manager = small_manager()
    assert manager.can_fit(SMALL_SLOTS * TPB) and [manager.last_refusal] == [None]  # a fit records nothing
    assert not manager.can_fit(SMALL_SLOTS * TPB + 1)
    refusal = manager.last_refusal
    assert refusal is not None and refusal.call == "KVCacheManager.can_fit"
    slots = sum(usage.total for usage in manager.get_usage() if usage.level == 0 and usage.pool_group == 0)
    assert (refusal.pool_group, refusal.level, refusal.fits_empty_manager) == (0, 0, False)
    assert (refusal.pages_needed, refusal.pages_available, refusal.pages_total) == (SMALL_SLOTS + 1, slots, slots)
    assert slots == SMALL_SLOTS and f"needs {SMALL_SLOTS + 1} GPU pages in pool group 0" in refusal.detail
    assert manager.can_fit(TPB) and manager.last_refusal is refusal  # kept until the next refusal
    cache = manager.create_kv_cache()  # the same step refused by a cache on the empty manager: the same figures
    assert cache.resume() and not cache.resize(SMALL_SLOTS * TPB + 1)
    assert cache.last_refusal is not None and not cache.last_refusal.fits_empty_manager
    assert (cache.last_refusal.pool_group, cache.last_refusal.pages_needed) == (0, SMALL_SLOTS + 1)
    cache.close()


def test_can_fit_in_chunks_names_the_first_step_that_does_not_fit() -> None:
    windowed = KVCacheManager(make_config([attention(0, 8 * KIB, window=2 * TPB)], gpu_quota=SMALL_SLOTS * 16 * KIB))
    chunk = SMALL_SLOTS * TPB
    cap = windowed.max_admissible(chunk_size=chunk)
    assert not windowed.can_fit_in_chunks(cap + 1, chunk)
    refusal = windowed.last_refusal
    assert refusal is not None and refusal.call == "KVCacheManager.can_fit_in_chunks"
    # the steps in order: the first that can_fit refuses is the one named, with can_fit's own figures
    steps = [(min(start + chunk, cap + 1), min(start + chunk, cap + 1) - start) for start in range(0, cap + 1, chunk)]
    end, computed = next(step for step in steps if not windowed.can_fit(*step))
    assert f"the step ending at token {end} computing {computed} tokens" in refusal.detail
    by_step = windowed.last_refusal
    assert by_step is not None and by_step.call == "KVCacheManager.can_fit"
    assert (refusal.pool_group, refusal.pages_needed, refusal.pages_available) == (
        by_step.pool_group, by_step.pages_needed, by_step.pages_available)
    assert refusal.pages_needed > refusal.pages_available == refusal.pages_total
    windowed.shutdown()


def test_can_fit_says_a_hybrids_ssm_state_is_over_the_admission_limit() -> None:
    """Every path that refuses the one live state carries the same figures: the state needed, against what the
    statistics read available (the empty manager's slots) and the total; the limit is in the sentence. Before,
    ``can_fit`` (and ``max_admissible``) put the limit's 0 in ``pages_available`` where ``resume`` and a batch put 1."""
    layers: list[LayerConfig] = [attention(0, 2 * KIB), ssm(1)]
    manager = KVCacheManager(make_config(layers, gpu_quota=96 * KIB, tokens_per_block=16, initial_pool_ratio=[4, 1]))
    ssm_group = manager.get_pool_group_index(manager.get_layer_group_id(1))
    slots = manager.get_storage_statistics(0)[ssm_group]
    assert (slots.total, slots.available) == (1, 1)
    refusals: list[Refusal] = []
    assert not manager.can_fit(10, 16) and manager.last_refusal is not None
    refusals.append(manager.last_refusal)
    assert not manager.can_fit_in_chunks(10, 4) and manager.last_refusal is not None
    refusals.append(manager.last_refusal)
    assert manager.max_admissible() == 0 and manager.last_refusal is not None
    refusals.append(manager.last_refusal)
    cache = manager.create_kv_cache()
    assert not cache.resume() and cache.last_refusal is not None
    refusals.append(cache.last_refusal)
    cache.close()
    assert manager.create_kv_cache_batch([KVCacheRequest([1, 2, 3])]) == [None]
    refusals.append(manager.last_batch_refusals[0] or refusals[0])
    assert [refusal.call for refusal in refusals] == [
        "KVCacheManager.can_fit", "KVCacheManager.can_fit_in_chunks", "KVCacheManager.max_admissible",
        "KVCache.resume", "create_kv_cache_batch",
    ]
    for refusal in refusals:
        assert (refusal.pool_group, refusal.fits_empty_manager) == (ssm_group, False), refusal
        assert (refusal.pages_needed, refusal.pages_available, refusal.pages_total) == (1, 1, 1), refusal
        assert "max_util_for_resume" in refusal.detail and "at most 0 of" in refusal.detail, refusal.detail
    manager.shutdown()


@pytest.mark.parametrize("host_tier", [False, True])
def test_a_never_fitting_steps_pages_needed_is_what_its_sentence_says_on_every_tier(host_tier: bool) -> None:
    """A step refused whatever finishes counts every GPU page it would hold in ``pages_needed``, its own held or
    locked pages included, as its sentence's "needs K" and ``can_fit`` of the same step do, with or without a
    colder tier. Before, a GPU-only tier's suspended cache said 0 (its held pages are not in ``pages_available``,
    so they were left out) and an active resize the new pages alone, while the sentence counted them all."""
    tiers = [GpuCacheTierConfig(SMALL_SLOTS * 16 * KIB)] + ([HostCacheTierConfig(SMALL_SLOTS * 16 * KIB)] if host_tier else [])
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=0.5))
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(SMALL_SLOTS * TPB)  # resize is not bounded by max_util_for_resume
    cache.suspend()
    assert not cache.resume() and cache.last_refusal is not None
    by_limit = cache.last_refusal
    assert not by_limit.fits_empty_manager and by_limit.pages_total == SMALL_SLOTS
    assert f"needs {SMALL_SLOTS} GPU pages" in by_limit.detail and by_limit.pages_needed == SMALL_SLOTS, by_limit
    cache.close()
    grown = manager.create_kv_cache()
    assert grown.resume() and grown.resize(4 * TPB)
    assert not grown.resize(SMALL_SLOTS * TPB + 1) and grown.last_refusal is not None
    by_tier = grown.last_refusal
    assert f"needs {SMALL_SLOTS + 1} GPU pages" in by_tier.detail and by_tier.pages_needed == SMALL_SLOTS + 1, by_tier
    assert not manager.can_fit(SMALL_SLOTS * TPB + 1, (SMALL_SLOTS - 4) * TPB + 1)
    assert manager.last_refusal is not None and manager.last_refusal.pages_needed == by_tier.pages_needed
    grown.close()
    manager.shutdown()


def test_can_fit_says_a_request_beyond_the_block_limit_must_shorten() -> None:
    manager = small_manager()
    assert not manager.can_fit_in_chunks(2**24 * TPB + 1, 1024)
    refusal = manager.last_refusal
    assert refusal is not None and "shorten the request" in refusal.detail and not refusal.fits_empty_manager
