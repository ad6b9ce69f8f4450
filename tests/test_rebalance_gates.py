"""The three rebalancing knobs (``rebalance_min_sampled_kv_caches``, ``rebalance_cooldown_secs``,
``rebalance_ratio_threshold``): each moves what ``need_adjustment`` says, and bad values are refused by name."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from kv_cache_manager_v2 import KVCacheManager, _introspection
from kv_cache_manager_v2._introspection import internals_of
from tests.helpers import attention, make_config
from tests.test_introspection import TPB, two_pool_group_manager


def close_long_requests(manager: KVCacheManager, count: int) -> None:
    for _ in range(count):
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(64 * TPB, 64 * TPB - 1)
        cache.close()


def test_min_sampled_kv_caches_sets_how_many_closed_caches_open_the_gate() -> None:
    manager = two_pool_group_manager(rebalance_min_sampled_kv_caches=3)
    close_long_requests(manager, 2)
    assert not manager.need_adjustment
    close_long_requests(manager, 1)
    assert bool(manager.need_adjustment)  # bool(): keeps mypy from narrowing the property


def skewed_split(manager: KVCacheManager, skew: float) -> list[float]:
    current = _introspection.current_gpu_ratio(manager)
    shares = [current[0] * skew, *current[1:]]
    return [share / sum(shares) for share in shares]


def test_a_target_split_waits_for_the_sample_gate_too() -> None:
    """A target split replaces the observed mix, not the sample count: TensorRT-LLM's tuner holds it back until
    ``rebalance_min_sampled_kv_caches`` requests were seen, and so does this one."""
    manager = two_pool_group_manager(rebalance_min_sampled_kv_caches=5000)
    before = _introspection.current_gpu_ratio(manager)
    _introspection.set_target_ratio_list_gpu(manager, skewed_split(manager, 2.0))
    _introspection.set_num_sampled_kv_caches(manager, 2001)
    assert not manager.need_adjustment
    assert not manager.adjust()
    assert _introspection.current_gpu_ratio(manager) == before
    _introspection.set_num_sampled_kv_caches(manager, 5000)
    assert bool(manager.need_adjustment)
    assert manager.adjust() and _introspection.current_gpu_ratio(manager) != before


def test_forcing_the_precondition_opens_a_raised_sample_gate() -> None:
    manager = two_pool_group_manager(rebalance_min_sampled_kv_caches=5000)
    _introspection.force_rebalance_precondition(manager, skew=2.0)
    assert bool(manager.need_adjustment)


def test_ratio_threshold_sets_how_far_a_split_may_drift() -> None:
    tolerant = two_pool_group_manager(rebalance_ratio_threshold=1000.0)
    _introspection.force_rebalance_precondition(tolerant, skew=2.0)
    assert not tolerant.need_adjustment
    strict = two_pool_group_manager(rebalance_ratio_threshold=np.float32(1.5))
    _introspection.force_rebalance_precondition(strict, skew=2.0)
    assert bool(strict.need_adjustment)


def test_cooldown_counts_from_the_last_rebalancing_on_the_injected_clock() -> None:
    manager = two_pool_group_manager(rebalance_cooldown_secs=60.0)
    gates = internals_of(manager).planner.rebalance
    now = [5.0]  # a clock that starts near zero, like a freshly booted machine's
    gates.clock = lambda: now[0]
    _introspection.force_rebalance_precondition(manager, skew=2.0)
    assert bool(manager.need_adjustment)  # the first rebalancing is never held back
    assert manager.adjust()
    _introspection.force_rebalance_precondition(manager, skew=4.0)
    now[0] = 64.0
    assert not manager.need_adjustment  # 59 s after the last one
    now[0] = 65.0
    assert bool(manager.need_adjustment)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("rebalance_min_sampled_kv_caches", -1, ValueError),
        ("rebalance_min_sampled_kv_caches", True, TypeError),
        ("rebalance_cooldown_secs", -1.0, ValueError),
        ("rebalance_cooldown_secs", math.inf, ValueError),
        ("rebalance_cooldown_secs", "1", TypeError),
        ("rebalance_ratio_threshold", 1.0, ValueError),
        ("rebalance_ratio_threshold", math.nan, ValueError),
        ("rebalance_ratio_threshold", False, TypeError),
    ],
)
def test_bad_rebalance_settings_are_refused_by_name(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=field):
        overrides: dict[str, Any] = {field: value}
        dataclasses.replace(make_config([attention(0)]), **overrides)


def test_numpy_numbers_are_accepted_as_plain_ones() -> None:
    config = make_config(
        [attention(0)], rebalance_min_sampled_kv_caches=np.int64(4), rebalance_cooldown_secs=np.float64(2.5)
    )
    assert type(config.rebalance_min_sampled_kv_caches) is int and config.rebalance_min_sampled_kv_caches == 4
    assert type(config.rebalance_cooldown_secs) is float and config.rebalance_cooldown_secs == 2.5
