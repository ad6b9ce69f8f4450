"""``get_and_reset_ssm_snapshot_iteration_stats``: per SSM layer group, how many new caches found a snapshot to
start from and the tokens that saved, reset by each call."""

from __future__ import annotations

import pickle

from kv_cache_manager_v2 import KVCacheManager, SsmSnapshotIterationStatsDelta
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, compute_prompt, make_config, ssm

TPB = 32


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def hybrid_manager(enable_stats: bool = True) -> KVCacheManager:
    layers: list[LayerConfig] = [ssm(0), attention(1, 2 * KIB), ssm(2)]
    return KVCacheManager(make_config(layers, ssm_reuse_interval=2 * TPB, enable_stats=enable_stats, snapshot_prefill_chunks=False))


def test_lookups_hits_and_tokens_are_counted_and_reset() -> None:
    manager = hybrid_manager()
    engine = FakeEngine(manager)
    ssm_group = manager.get_layer_group_id(0)
    assert manager.get_layer_group_id(2) == ssm_group
    tokens = tokens_of(1, 3 * TPB)
    compute_prompt(manager, engine, tokens, stops=(2 * TPB,)).close()  # miss: 96 tokens, none reused
    again = manager.create_kv_cache(None, tokens + [5] * 10)  # hit: snapshot at 64 of 106 tokens
    no_input = manager.create_kv_cache()  # no input tokens: no lookup
    stats = manager.get_and_reset_ssm_snapshot_iteration_stats()
    assert list(stats) == [ssm_group]
    delta = stats[ssm_group]
    assert delta == SsmSnapshotIterationStatsDelta(2, 1, 1, 64, 96 + 42, 1, 0)
    assert delta.iter_snapshot_hit_rate == 0.5
    assert manager.get_and_reset_ssm_snapshot_iteration_stats() == {}
    again.close()
    no_input.close()


def test_nothing_without_ssm_layers_or_with_stats_off() -> None:
    plain = KVCacheManager(make_config([attention(0)]))
    plain.create_kv_cache(None, [1, 2, 3]).close()
    assert plain.get_and_reset_ssm_snapshot_iteration_stats() == {}
    quiet = hybrid_manager(enable_stats=False)
    quiet.create_kv_cache(None, [1, 2, 3]).close()
    assert quiet.get_and_reset_ssm_snapshot_iteration_stats() == {}


def test_the_delta_is_a_value() -> None:
    delta = SsmSnapshotIterationStatsDelta(4, 3, 1, 96, 10, 3, 0)
    assert pickle.loads(pickle.dumps(delta)) == delta
    assert SsmSnapshotIterationStatsDelta().iter_snapshot_hit_rate == 0.0
