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


def test_a_speculative_step_snapshots_only_the_state_the_engine_accepted() -> None:
    """Draft tokens advance the live state past what is committed: a commit of the accepted ones that ends a block
    on the interval must not snapshot it (a follower would resume from the drafts' state), and after the engine
    sets the state back and shrinks the capacity to the accepted tokens, a saved snapshot holds exactly them."""
    manager = KVCacheManager(make_config(hybrid(window=48), ssm_reuse_interval=TPB, snapshot_prefill_chunks=False))
    engine = FakeEngine(manager)
    truth = tokens_of(8, 200)
    cache = manager.create_kv_cache(None, truth[:30])
    assert cache.resume()
    run(cache, engine, truth, 30)
    assert cache.resize(36, 30)  # the last token and 5 drafts, of which 1 is accepted
    engine.step(cache, truth[:32] + [token + 1 for token in truth[32:36]])
    cache.commit(truth[30:32])  # block 0 ends at 32, on the interval, 4 tokens short of what was computed
    assert manager.probe_reuse(None, truth[:40]) == 0
    engine.accept_states(cache, truth)
    run(cache, engine, truth, 64)  # a whole chunk reaching the interval: snapshot
    assert manager.probe_reuse(None, truth[:70]) == 64
    assert cache.resize(70, 64)  # every draft rejected: only the token at 64 is accepted
    engine.step(cache, truth[:65] + [token + 1 for token in truth[65:70]])
    cache.commit(truth[64:65])
    engine.accept_states(cache, truth)
    assert cache.resize(65, 65)  # the rewind: capacity back to the accepted tokens
    cache.stop_committing(save_last_ssm_snapshot=True)
    cache.close()
    for follower, reused in ((truth[:40], 0), (truth[:64] + [7], 64), (truth[:80], 65)):
        reuse = manager.create_kv_cache(None, follower)
        assert reuse.num_committed_tokens == reused
        assert reuse.resume()
        engine.check(reuse, truth)  # the live state is the state of exactly the reused tokens
        reuse.close()
    assert engine.states_checked > 0
    manager.check_invariants()


@pytest.mark.parametrize("partial_reuse", [False, True])
def test_a_request_closed_after_rejected_drafts_leaves_no_snapshot_of_them(partial_reuse: bool) -> None:
    """The request ends among the accepted tokens and the engine closes it without setting the live state back:
    the trailing partial block (a snapshot point at every commit here) must not get the drafts' state."""
    manager = KVCacheManager(
        make_config(hybrid(), ssm_reuse_interval=TPB, commit_min_snapshot=True, enable_partial_reuse=partial_reuse)
    )
    engine = FakeEngine(manager)
    truth = tokens_of(9, 80)
    cache = manager.create_kv_cache(None, truth[:40])
    assert cache.resume()
    run(cache, engine, truth, 40)
    assert cache.resize(46, 40)
    engine.step(cache, truth[:42] + [token + 1 for token in truth[42:46]])
    cache.commit(truth[40:42])  # 2 of 6 accepted, the end of the request
    cache.close()
    for follower in (truth[:42], truth[:42] + [5] * 3, truth[:60]):
        reuse = manager.create_kv_cache(None, follower)
        assert reuse.num_committed_tokens == 40 if partial_reuse else 32
        assert reuse.resume()
        engine.check(reuse, truth)
        reuse.close()
    manager.check_invariants()


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
