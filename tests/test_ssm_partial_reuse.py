"""SSM models with ``enable_partial_reuse=True``: attention may reuse part of a block, but an SSM state exists only
where a snapshot was taken, so a request diverging inside a block reuses up to the last snapshot before it."""

from __future__ import annotations

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, compute_prompt, make_config, ssm

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def hybrid_manager(interval: int) -> KVCacheManager:
    layers: list[LayerConfig] = [ssm(0), attention(1, 2 * KIB), ssm(2), attention(3, 2 * KIB, window=64)]
    return KVCacheManager(make_config(layers, ssm_reuse_interval=interval, enable_partial_reuse=True))


def test_partial_reuse_is_accepted_with_ssm_layers() -> None:
    manager = hybrid_manager(TPB)
    assert manager.config.partial_reuse_enabled


def test_divergence_inside_a_block_reuses_up_to_the_last_snapshot() -> None:
    manager = hybrid_manager(TPB)
    engine = FakeEngine(manager)
    first = tokens_of(1, 4 * TPB)
    compute_prompt(manager, engine, first, stops=(TPB, 2 * TPB, 3 * TPB)).close()
    fork = first[: 2 * TPB + 20] + tokens_of(2, 50)  # shares 20 tokens of block 2, whose start has a snapshot
    assert manager.probe_reuse(None, fork) == 2 * TPB
    cache = compute_prompt(manager, engine, fork)
    engine.check(cache, fork)  # every layer's content is the fork's, the SSM states included
    cache.close()


def test_a_snapshot_interval_of_two_blocks_backs_off_further() -> None:
    manager = hybrid_manager(2 * TPB)
    engine = FakeEngine(manager)
    first = tokens_of(3, 4 * TPB)
    compute_prompt(manager, engine, first, stops=(2 * TPB,)).close()
    fork = first[: 3 * TPB + 5] + tokens_of(4, 40)  # the snapshots sit at 64 and 128 (the prompt's end)
    assert manager.probe_reuse(None, fork) == 2 * TPB
    cache = compute_prompt(manager, engine, fork)
    engine.check(cache, fork)
    cache.close()


def test_forks_inside_the_first_block_reuse_nothing_but_are_served() -> None:
    manager = hybrid_manager(TPB)
    engine = FakeEngine(manager)
    first = tokens_of(5, 2 * TPB)
    compute_prompt(manager, engine, first, stops=(TPB,)).close()
    for seed in (6, 7):
        fork = first[:10] + tokens_of(seed, 30)
        assert manager.probe_reuse(None, fork) == 0
        cache = compute_prompt(manager, engine, fork)
        engine.check(cache, fork)
        cache.close()
