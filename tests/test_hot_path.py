"""The decode hot path (issue #21): the O(1) resize/commit path agrees with the planned one, its stale-range bound
is safe and tight, and a prompt's blocks are hashed once across probe, admission and commit."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kv_cache_manager_v2 import KVCacheManager, LayerGroupId
from kv_cache_manager_v2._cache_handle import KVCache
from kv_cache_manager_v2._life_cycle import NEVER, SsmLifeCycle, WindowedAttentionLifeCycle
from kv_cache_manager_v2.config import LayerConfig

from tests.helpers import KIB, attention, make_config, ssm


@pytest.mark.parametrize("tokens_per_block", [1, 4, 32])
@pytest.mark.parametrize("window", [1, 5, 64, 100])
@pytest.mark.parametrize("sink_blocks", [0, 1, 3])
def test_stale_steady_below_is_the_next_change(tokens_per_block: int, window: int, sink_blocks: int) -> None:
    life_cycle = WindowedAttentionLifeCycle(LayerGroupId(0), tokens_per_block, window, sink_blocks)
    for history in range(0, 400):
        below = life_cycle.stale_steady_below(history)
        assert below > history
        here = life_cycle.stale(history)
        for later in range(history, min(below, history + 200)):
            assert life_cycle.stale(later) == here, (history, later, below)
        # Tight where it matters: the window's first block moves exactly there (past the sinks' filling).
        if below < history + 200 and history >= sink_blocks * tokens_per_block:
            assert life_cycle.stale(below) != here or here[1] == here[0], (history, below)


def test_ssm_and_full_attention_never_change_their_stale_range() -> None:
    assert SsmLifeCycle(LayerGroupId(0), 32).stale_steady_below(12345) == NEVER


def _layers() -> list[LayerConfig]:
    return [attention(0, 2 * KIB), attention(1, 2 * KIB, window=48, sinks=5), ssm(2, 4 * KIB, KIB)]


def _state(manager: KVCacheManager, caches: list[KVCache | None]) -> list[object]:
    seen: list[object] = []
    for cache in caches:
        if cache is None:
            seen.append(None)
            continue
        seen.append((cache.status, cache.capacity, cache.history_length, cache.committed_tokens))
        if cache.is_active:
            for group in range(manager.num_layer_groups):
                seen.append(list(cache.get_base_page_indices(group)))
                seen.append(cache.get_num_front_blocks_removed(group))
    seen.append([(s.total, s.free, s.evictable) for s in manager.get_storage_statistics(0)])
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_fast_path_and_planned_path_leave_identical_state(seed: int) -> None:
    """Plain ints and lists take the O(1) path where it applies; NumPy ints and tuples always take the planned
    one. The same random steps on two managers must leave the same lengths, page tables and slot counts."""
    config = make_config(
        _layers(), gpu_quota=2 << 20, tokens_per_block=8, initial_pool_ratio=[0.4, 0.3, 0.3], ssm_reuse_interval=16
    )
    managers = [KVCacheManager(config) for _ in range(2)]
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
    caches: list[list[KVCache | None]] = [[None] * 4, [None] * 4]
    next_token = 10_000

    def slow_int(value: int) -> np.int64:
        return np.int64(value)

    for step_number in range(400):
        slot = rng.randrange(4)
        first = caches[0][slot]
        if first is None:
            prompt = rng.choice(prefixes)[: rng.randrange(0, 40)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            for side, manager in enumerate(managers):
                opened = manager.create_kv_cache(None, prompt[:-1])
                assert opened.resume()
                caches[side][slot] = opened
            outcome = {caches[side][slot].resize(len(prompt) - 1, None) for side in range(2)}  # type: ignore[union-attr]
            assert len(outcome) == 1
            if outcome == {True}:
                for side in range(2):
                    cache = caches[side][slot]
                    assert cache is not None
                    rest = prompt[cache.num_committed_tokens : -1]
                    cache.commit(rest if side == 0 else tuple(rest))
        elif first.status == KVCache.Status.SUSPENDED:
            results = {caches[side][slot].resume() for side in range(2)}  # type: ignore[union-attr]
            assert len(results) == 1
        else:
            action = rng.random()
            if action < 0.05:
                for side in range(2):
                    caches[side][slot].close()  # type: ignore[union-attr]
                    caches[side][slot] = None
            elif action < 0.1:
                for side in range(2):
                    caches[side][slot].suspend()  # type: ignore[union-attr]
            else:
                capacity = first.capacity
                history = first.history_length
                step = 1 if action < 0.8 else rng.randrange(1, 12)
                ahead = rng.randrange(0, 3) if action > 0.95 else 0
                resized = []
                for side in range(2):
                    cache = caches[side][slot]
                    assert cache is not None
                    if side == 0:
                        resized.append(cache.resize(capacity + step + ahead, capacity))
                    else:
                        resized.append(cache.resize(slow_int(capacity + step + ahead), slow_int(capacity)))
                assert resized[0] == resized[1]
                if resized[0]:
                    tokens = list(range(next_token, next_token + step))
                    next_token += step
                    assert history <= capacity
                    for side in range(2):
                        cache = caches[side][slot]
                        assert cache is not None
                        cache.commit(tokens if side == 0 else tuple(tokens))
        assert _state(managers[0], caches[0]) == _state(managers[1], caches[1])
        if step_number % 50 == 0:
            managers[0].check_invariants()
    for side, manager in enumerate(managers):
        manager.check_invariants()
        for cache in caches[side]:
            if cache is not None:
                cache.close()
        manager.check_invariants()
        manager.shutdown()


def test_probe_then_create_then_commit_hashes_each_prompt_block_once() -> None:
    manager = KVCacheManager(make_config([attention(0, 2 * KIB)], gpu_quota=2 << 20, tokens_per_block=8))
    keys = manager.radix_tree.keys
    shared = list(range(64))  # 8 blocks, cached by a first request
    first = manager.create_kv_cache(None, shared)
    assert first.resume() and first.resize(len(shared))
    first.commit(shared)
    first.close()
    other = manager.create_kv_cache(None, list(range(500, 516)))  # another chain: the memory forgets the first
    other.close()
    prompt = shared + list(range(1000, 1041))  # 5 more full blocks and a partial one
    before = keys.hashed
    hit = manager.probe_reuse(None, prompt[:-1])
    assert hit == len(shared)
    probed = keys.hashed - before
    assert probed == 9  # the 8 cached blocks and the first one missing
    cache = manager.create_kv_cache(None, prompt[:hit])
    assert keys.hashed - before == probed  # the admission hashes nothing again
    assert cache.resume() and cache.resize(len(prompt))
    cache.commit(prompt[hit:])
    # The commit hashes only the blocks the probe never reached: 13 full blocks in all, each hashed once.
    assert keys.hashed - before == len(prompt) // 8
    cache.close()
    manager.shutdown()
