"""A cache created to store rows the engine already computed (a KV connector's ``wait_for_save``: create over the
computed tokens, copy the rows in, commit, close) is no prefix-cache lookup: ``create_kv_cache(..., lookup=False)``
(``KVCacheRequest(..., lookup=False)``) counts nothing in the iteration statistics, the SSM snapshot lookups or the
request's own statistics, while it still reuses what is cached. Counted as lookups, a connector's saves made the hit
rate of ``iter_reused_blocks`` / ``iter_missed_blocks`` meaningless (one instance drained 338 reused against 27
missed blocks, its loads' and saves' lookups mixed)."""

from __future__ import annotations

from typing import Any

import pytest

from kv_cache_manager_v2 import KVCacheIterationStatsDelta, KVCacheManager, KVCacheRequest, KVCacheStatsDelta, LayerGroupId
from tests.helpers import attention, make_config, prefilled
from tests.test_ssm_snapshot_stats import TPB, hybrid_manager, tokens_of

FULL = LayerGroupId(0)


def lookups(delta: KVCacheIterationStatsDelta) -> tuple[int, int, int, int, int]:
    """(reused, missed) of new requests, of readmitted ones, then every block handed out (new pages + reused)."""
    return (
        delta.iter_reused_blocks,
        delta.iter_missed_blocks,
        delta.iter_preempted_reused_blocks,
        delta.iter_preempted_missed_blocks,
        delta.iter_alloc_total_blocks,
    )


def test_a_save_counts_no_lookup_while_a_real_lookup_beside_it_counts() -> None:
    """Before: ``lookup`` did not exist, and a save counted as a lookup (``(8, 2, 0, 0, 8)`` for the two creates)."""
    manager = KVCacheManager(make_config([attention(0)]))
    tokens = list(range(160))  # 5 blocks of 32
    prefilled(manager, tokens[:128])
    manager.get_and_reset_iteration_stats()
    save = manager.create_kv_cache(None, tokens, lookup=False, enable_request_stats=True)
    asking = manager.create_kv_cache(None, tokens)
    assert save.num_committed_tokens == asking.num_committed_tokens == 128  # reuse itself is unchanged
    assert lookups(manager.get_and_reset_iteration_stats()[FULL]) == (4, 1, 0, 0, 4)
    assert manager.get_dirty_stats_kv_cache_ids() == {asking.id}  # the save has no lookup to settle
    assert save.resume() and save.resize(160)
    save.commit(tokens[128:])
    assert save.commit_pending_stats() == KVCacheStatsDelta(1, 1, 0, 0)  # its one new block, no reuse or miss
    save.close()
    asking.close()
    assert lookups(manager.get_and_reset_iteration_stats()[FULL]) == (0, 0, 0, 0, 1)
    later = manager.create_kv_cache(None, tokens + [1])  # what the save stored is reused
    assert later.num_committed_tokens == 160
    assert lookups(manager.get_and_reset_iteration_stats()[FULL]) == (5, 1, 0, 0, 5)
    later.close()


def test_a_batch_request_says_it_is_a_save() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    tokens = list(range(96))
    prefilled(manager, tokens[:64])
    manager.get_and_reset_iteration_stats()
    caches = manager.create_kv_cache_batch([KVCacheRequest(tokens), KVCacheRequest(tokens + [7], lookup=False)])
    assert all(cache is not None for cache in caches)
    assert caches[1] is not None and caches[1].num_committed_tokens >= 64
    delta = manager.get_and_reset_iteration_stats()[FULL]
    # The first request's lookup alone: 2 reused, 1 missed; the save's 1 new page is handed out, its reuse is not.
    assert lookups(delta)[:4] == (2, 1, 0, 0) and delta.iter_alloc_total_blocks == delta.iter_alloc_new_blocks + 2
    for cache in caches:
        assert cache is not None
        cache.close()


def test_ssm_snapshot_lookups_leave_out_a_save() -> None:
    """Before: the save was a second lookup and hit (``iter_snapshot_lookups`` 2)."""
    manager = hybrid_manager()
    ssm_group = manager.get_layer_group_id(0)
    tokens = tokens_of(1, 3 * TPB)
    cache = manager.create_kv_cache(None, tokens, snapshot_at=[2 * TPB])
    assert cache.resume() and cache.resize(2 * TPB)
    cache.commit(tokens[: 2 * TPB])
    cache.close()
    manager.get_and_reset_ssm_snapshot_iteration_stats()
    save = manager.create_kv_cache(None, tokens, lookup=False)
    assert save.num_committed_tokens == 2 * TPB  # it starts from the snapshot all the same
    save.close()
    assert manager.get_and_reset_ssm_snapshot_iteration_stats() == {}  # a save alone: no lookup to report
    manager.create_kv_cache(None, tokens).close()
    manager.create_kv_cache(None, tokens, lookup=False).close()
    delta = manager.get_and_reset_ssm_snapshot_iteration_stats()[ssm_group]
    assert (delta.iter_snapshot_lookups, delta.iter_snapshot_hits, delta.iter_preempted_snapshot_lookups) == (1, 1, 0)


@pytest.mark.parametrize(("flag", "loose", "meant"), [("preempted", 1, True), ("lookup", 0, False)])
def test_a_flag_must_be_a_bool_and_a_refused_call_changes_nothing(flag: str, loose: Any, meant: bool) -> None:
    """``preempted`` and ``lookup`` alike: an int standing for the flag's other value is refused by
    ``create_kv_cache``, by ``KVCacheRequest`` and, set after construction, by the batch call, each naming the flag
    (and the request's index); neither flag is positional; the refused calls open no cache and count nothing."""
    manager = KVCacheManager(make_config([attention(0)]))
    prefilled(manager, list(range(64)))
    manager.get_and_reset_iteration_stats()
    # Compiled, mypyc checks the bool parameter itself: its message names the type (tests/test_bad_inputs.py).
    with pytest.raises(TypeError, match=f"{flag}|bool object expected; got int"):
        manager.create_kv_cache(None, list(range(64)), **{flag: loose})
    with pytest.raises(TypeError, match=f"KVCacheRequest.{flag}|bool object expected; got int"):
        KVCacheRequest([1, 2], **{flag: loose})
    request = KVCacheRequest([1, 2])
    setattr(request, flag, loose)  # set after construction: the batch call checks again
    with pytest.raises(TypeError, match=rf"requests\[1\].{flag}|bool object expected; got int"):
        manager.create_kv_cache_batch([KVCacheRequest(list(range(64))), request])
    with pytest.raises(TypeError):
        KVCacheRequest([1, 2], None, None, None, None, (), None, meant)  # type: ignore[call-arg]  # keyword-only
    assert manager.num_live_caches == 0
    assert lookups(manager.get_and_reset_iteration_stats()[FULL]) == (0, 0, 0, 0, 0)


def test_a_readmission_that_counts_no_lookup_is_refused() -> None:
    """``preempted`` says where a lookup counts; with ``lookup=False`` there is none, so the pair is a caller's
    confusion of the two (a save passed its request's preemption count along): refused, naming both."""
    manager = KVCacheManager(make_config([attention(0)]))
    prefilled(manager, list(range(64)))
    manager.get_and_reset_iteration_stats()
    with pytest.raises(ValueError, match="preempted=True needs lookup=True"):
        manager.create_kv_cache(None, list(range(64)), preempted=True, lookup=False)
    with pytest.raises(ValueError, match=r"KVCacheRequest.preempted=True needs KVCacheRequest.lookup=True"):
        KVCacheRequest([1, 2], preempted=True, lookup=False)
    request = KVCacheRequest([1, 2], lookup=False)
    request.preempted = True
    with pytest.raises(ValueError, match=r"requests\[1\].preempted=True needs requests\[1\].lookup=True"):
        manager.create_kv_cache_batch([KVCacheRequest(list(range(64))), request])
    assert manager.num_live_caches == 0 and not manager.get_dirty_stats_kv_cache_ids()
    assert lookups(manager.get_and_reset_iteration_stats()[FULL]) == (0, 0, 0, 0, 0)
