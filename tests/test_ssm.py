"""SSM layers (SPEC §5): live state slots, periodic snapshots at commit, snapshot-based prefix reuse."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import BAD_PAGE_INDEX, GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from kv_cache_manager_v2.testing.fake_engine import ContentError
from tests.helpers import KIB, attention, make_config, ssm

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def hybrid(window: int | None = None) -> list[LayerConfig]:
    return [ssm(0), attention(1, 2 * KIB, window=window), ssm(2), attention(3, 2 * KIB, window=window)]


def run(cache: _KVCache, engine: FakeEngine, tokens: list[int], end: int) -> None:
    """Compute ``[history, end)`` and commit it."""
    assert cache.resize(end, cache.history_length)
    engine.step(cache, tokens)
    cache.commit(tokens[cache.num_committed_tokens : end])


def test_snapshots_only_when_a_commit_ends_on_the_interval() -> None:
    manager = KVCacheManager(make_config(hybrid(), ssm_reuse_interval=2 * TPB, snapshot_prefill_chunks=False))
    engine = FakeEngine(manager)
    tokens = tokens_of(1, 400)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume()
    run(cache, engine, tokens, 100)  # blocks 0..2 complete, but the commit ends at 100: no snapshot
    assert manager.probe_reuse(None, tokens) == 0
    run(cache, engine, tokens, 128)  # ends on block 4's end, 128 % 64 == 0: snapshot
    assert manager.probe_reuse(None, tokens) == 128
    run(cache, engine, tokens, 160)  # 160 % 64 != 0
    run(cache, engine, tokens, 256)
    assert manager.probe_reuse(None, tokens) == 256
    assert manager.probe_reuse(None, tokens[:255]) == 128  # truncated to the last snapshot
    cache.close()
    short = tokens_of(2, 50)
    other = manager.create_kv_cache(None, short)
    assert other.resume()
    run(other, engine, short, 50)
    other.close()
    assert manager.probe_reuse(None, short) == 0  # below the interval nothing is reusable


def test_reused_state_is_the_snapshot_after_churn() -> None:
    manager = KVCacheManager(
        make_config(
            hybrid(window=64),
            tiers=[GpuCacheTierConfig(160 * KIB * 8), HostCacheTierConfig(160 * KIB * 40)],
            ssm_reuse_interval=TPB,
        )
    )
    engine = FakeEngine(manager)
    prompt = tokens_of(3, 200)
    cache = manager.create_kv_cache(None, prompt)
    assert cache.resume()
    run(cache, engine, prompt, 192)
    cache.close()
    for seed in range(10, 16):  # churn: other requests push the snapshots around the tiers
        other_tokens = tokens_of(seed, 96)
        other = manager.create_kv_cache(None, other_tokens)
        assert other.resume()
        run(other, engine, other_tokens, 96)
        other.close()
    follower = prompt[:192] + tokens_of(4, 40)
    cache = manager.create_kv_cache(None, follower)
    reused = cache.num_committed_tokens
    assert reused > 0 and reused % TPB == 0
    assert cache.resume()
    engine.check(cache, follower)  # the live state must be exactly the state of the reused prefix
    assert engine.states_checked == 4  # 2 SSM layers x 2 roles
    run(cache, engine, follower, len(follower))
    manager.check_invariants()
    cache.close()


def test_a_wrong_state_is_caught() -> None:
    manager = KVCacheManager(make_config([ssm(0)], ssm_reuse_interval=TPB))
    engine = FakeEngine(manager)
    tokens = tokens_of(5, 64)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume()
    run(cache, engine, tokens, 64)
    cache.close()
    impostor = tokens_of(6, 64)
    cache = manager.create_kv_cache(None, tokens + [1])
    assert cache.resume()
    with pytest.raises(ContentError, match="live state"):
        engine.check(cache, impostor + [1])
    cache.close()


def test_live_slot_is_stable_across_suspend_and_resume() -> None:
    manager = KVCacheManager(make_config(hybrid(), ssm_reuse_interval=TPB))
    engine = FakeEngine(manager)
    tokens = tokens_of(7, 90)
    cache = manager.create_kv_cache()
    assert cache.get_ssm_block_base_index(0) == BAD_PAGE_INDEX
    assert cache.resume()
    slot = cache.get_ssm_block_base_index(0)
    assert slot >= 0 and manager.get_layer_group_id(2) == manager.get_layer_group_id(0) == 0  # one SSM group
    run(cache, engine, tokens, 40)
    cache.suspend()
    assert cache.get_ssm_block_base_index(0) == BAD_PAGE_INDEX
    assert cache.resume()
    assert cache.get_ssm_block_base_index(0) == slot
    run(cache, engine, tokens, 90)  # capacity and history changes leave the slot alone
    assert cache.get_ssm_block_base_index(0) == slot
    with pytest.raises(ValueError, match="not an SSM layer group"):
        cache.get_ssm_block_base_index(1)
    cache.close()


def test_snapshots_are_skipped_silently_when_nowhere_fits() -> None:
    layers: list[LayerConfig] = [attention(0, 2 * KIB), ssm(1)]
    manager = KVCacheManager(
        make_config(layers, tiers=[GpuCacheTierConfig(1024 * KIB)], ssm_reuse_interval=TPB, max_util_for_resume=1.0)
    )
    ssm_group = manager.get_pool_group_index(manager.get_layer_group_id(1))
    slots = manager.get_storage_statistics(0)[ssm_group].total
    engine = FakeEngine(manager)
    caches = []
    for seed in range(slots):
        tokens = tokens_of(20 + seed, 64)
        cache = manager.create_kv_cache(None, tokens)
        assert cache.resume()  # earlier caches' snapshots are dropped to make room for this live state
        run(cache, engine, tokens, 64)
        caches.append((cache, tokens))
    # Every SSM slot now holds a live state: the last cache's commits found no room and skipped the snapshot.
    assert manager.get_storage_statistics(0)[ssm_group].free == 0
    assert manager.probe_reuse(None, caches[-1][1]) == 0
    for cache, _ in caches:
        cache.close()
    manager.check_invariants()
