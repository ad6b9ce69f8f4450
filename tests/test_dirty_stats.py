"""``get_dirty_stats_kv_cache_ids`` reads the ids the manager keeps as caches gain and settle statistics (it used
to visit every open cache on each call): a lookup or request blocks add a cache, ``commit_pending_stats``,
``discard_pending_stats`` and its close take it out, also a dropped handle's and a batch's. Debug mode checks the
kept ids against every open cache after each call."""

from __future__ import annotations

import gc

import pytest

from kv_cache_manager_v2 import KVCacheManager, KVCacheRequest
from tests.helpers import attention, make_config


def test_dirty_stats_ids_follow_lookups_request_blocks_settlements_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_CACHE_MANAGER_V2_DEBUG", "1")
    manager = KVCacheManager(make_config([attention(0)]))
    prompt = list(range(96))
    looked_up = manager.create_kv_cache(input_tokens=prompt, id=1)
    counted = manager.create_kv_cache(id=2, enable_request_stats=True)
    both = manager.create_kv_cache(input_tokens=prompt, id=3, enable_request_stats=True)
    assert manager.get_dirty_stats_kv_cache_ids() == {1, 3}
    looked_up.close()
    assert manager.get_dirty_stats_kv_cache_ids() == {3}
    assert counted.resume() and counted.resize(64)
    assert manager.get_dirty_stats_kv_cache_ids() == {2, 3}
    admitted = manager.create_kv_cache_batch([KVCacheRequest(prompt, id=7), KVCacheRequest([], id=8)])
    assert manager.get_dirty_stats_kv_cache_ids() == {2, 3, 7}
    both.commit_pending_stats()
    counted.discard_pending_stats()
    assert manager.get_dirty_stats_kv_cache_ids() == {7}
    del admitted[0]  # a dropped handle: its cache closes at the next guarded call
    gc.collect()
    again = manager.create_kv_cache(input_tokens=prompt, id=1)  # an id used before, looked up again
    assert manager.get_dirty_stats_kv_cache_ids() == {1}
    assert counted.resize(128)  # more request blocks after a settlement
    assert manager.get_dirty_stats_kv_cache_ids() == {1, 2}
    for cache in (again, counted, both, *[cache for cache in admitted if cache is not None]):
        cache.close()
    assert manager.get_dirty_stats_kv_cache_ids() == set()
    manager.shutdown()
