"""A request readmitted after recompute preemption (its cache closed, created again from its tokens) counts its
prefix lookup apart from new requests', as vLLM's ``PrefixCacheStats`` keeps ``preempted_requests`` /
``preempted_queries`` / ``preempted_hits`` apart from ``requests`` / ``queries`` / ``hits``: a hit rate read from
``iter_reused_blocks`` / ``iter_missed_blocks`` is then the new requests' rate, as a dashboard ported from vLLM
expects."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheIterationStatsDelta, KVCacheManager, KVCacheRequest, LayerGroupId
from kv_cache_manager_v2.batching import BatchingOptions, ContinuousBatcher
from tests.helpers import attention, make_config, prefilled
from tests.test_batching import Checked, Replayed, manager_with, run_to_end
from tests.test_ssm_snapshot_stats import TPB, hybrid_manager, tokens_of

FULL = LayerGroupId(0)


def lookups(delta: KVCacheIterationStatsDelta) -> tuple[int, int, int, int]:
    """(reused, missed) of new requests, then of readmitted ones."""
    return (
        delta.iter_reused_blocks,
        delta.iter_missed_blocks,
        delta.iter_preempted_reused_blocks,
        delta.iter_preempted_missed_blocks,
    )


def test_a_readmission_counts_its_lookup_apart_from_new_requests() -> None:
    """Before: ``create_kv_cache`` had no ``preempted`` (``TypeError: ... unexpected keyword argument``), and a
    readmission counted as a new request's 4 reused and 1 missed blocks."""
    manager = KVCacheManager(make_config([attention(0)]))
    tokens = list(range(160))
    prefilled(manager, tokens[:128])
    manager.get_and_reset_iteration_stats()
    new = manager.create_kv_cache(None, tokens)
    readmitted = manager.create_kv_cache(None, tokens, preempted=True)
    delta = manager.get_and_reset_iteration_stats()[FULL]
    assert lookups(delta) == (4, 1, 4, 1)
    assert delta.iter_alloc_total_blocks == 8  # both caches' reused blocks were handed out
    new.close()
    readmitted.close()
    assert lookups(manager.get_and_reset_iteration_stats()[FULL]) == (0, 0, 0, 0)


def test_a_batch_request_says_it_is_a_readmission() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    tokens = list(range(96))
    prefilled(manager, tokens[:64])
    manager.get_and_reset_iteration_stats()
    caches = manager.create_kv_cache_batch([KVCacheRequest(tokens), KVCacheRequest(tokens + [7], preempted=True)])
    assert all(cache is not None for cache in caches)
    # The readmission's third block is the one the first request computes this step: a hit (as vLLM counts it).
    assert lookups(manager.get_and_reset_iteration_stats()[FULL]) == (2, 1, 3, 1)
    for cache in caches:
        assert cache is not None
        cache.close()


def test_a_refused_readmission_in_a_batch_counts_nothing() -> None:
    manager = manager_with(gpu_slots=4)
    manager.get_and_reset_iteration_stats()
    caches = manager.create_kv_cache_batch([KVCacheRequest(list(range(200)), preempted=True)])
    assert caches == [None]
    assert all(lookups(delta) == (0, 0, 0, 0) for delta in manager.get_and_reset_iteration_stats().values())


def test_ssm_snapshot_lookups_of_a_readmission_are_counted_apart() -> None:
    """Before: the readmission was a second lookup and hit (``iter_snapshot_lookups`` 2)."""
    manager = hybrid_manager()
    ssm_group = manager.get_layer_group_id(0)
    tokens = tokens_of(1, 3 * TPB)
    cache = manager.create_kv_cache(None, tokens, snapshot_at=[2 * TPB])
    assert cache.resume() and cache.resize(2 * TPB)
    cache.commit(tokens[: 2 * TPB])
    cache.close()
    manager.get_and_reset_ssm_snapshot_iteration_stats()
    manager.create_kv_cache(None, tokens).close()
    manager.create_kv_cache(None, tokens, preempted=True).close()
    delta = manager.get_and_reset_ssm_snapshot_iteration_stats()[ssm_group]
    assert (delta.iter_snapshot_lookups, delta.iter_snapshot_hits, delta.iter_reused_tokens) == (1, 1, 2 * TPB)
    assert (delta.iter_preempted_snapshot_lookups, delta.iter_preempted_snapshot_hits) == (1, 1)
    manager.create_kv_cache(None, tokens_of(2, TPB), preempted=True).close()  # a readmission alone is reported
    delta = manager.get_and_reset_ssm_snapshot_iteration_stats()[ssm_group]
    assert (delta.iter_snapshot_lookups, delta.iter_preempted_snapshot_lookups, delta.iter_preempted_snapshot_hits) == (0, 1, 0)


@pytest.mark.parametrize("batched", [False, True])
def test_the_batcher_counts_its_recomputes_as_readmissions(batched: bool) -> None:
    """The short request is closed to make room for the long one and recomputed later: its readmissions' lookups
    land in the preempted fields, so the new requests' lookups are the two first admissions' prompt blocks. Before:
    the recompute's lookup was counted with them."""
    manager = manager_with(gpu_slots=40)
    short = Replayed(0, list(range(1, 31)), 10)  # 9 prompt tokens looked up: one block
    long = Replayed(1, list(range(1000, 1000 + 38 * 16 + 8 + 20)), 38 * 16 + 8)  # 39 blocks looked up
    engine = Checked(manager, reject_drops=True)
    batcher = ContinuousBatcher(manager, [short, long], engine, BatchingOptions(chunk=640, max_batch=4, batch_admission=batched))
    totals = [0, 0, 0, 0]
    while not batcher.done:
        assert batcher.step_index < 1_000, "no progress"
        batcher.step()
        for delta in manager.get_and_reset_iteration_stats().values():
            totals = [a + b for a, b in zip(totals, lookups(delta))]
    assert batcher.recomputes == 1 and sorted(batcher.finished_ids) == [0, 1]
    assert totals[0] + totals[1] == 1 + 39, totals  # each request's first admission
    assert totals[2] + totals[3] >= 1, totals  # the short one's readmission (its attempts until it fit)
    assert manager.num_live_caches == 0
    run_to_end(batcher)
    manager.shutdown()
