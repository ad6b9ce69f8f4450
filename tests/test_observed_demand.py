"""``ObservedDemand``: the pages of the last closed caches, summed as they come and go (``need_adjustment`` used to
sum all ``OBSERVED_CACHES`` of them on every call). Its sums must stay those of the batch of the caches it holds,
through the window's turnover and with closes queued between reads."""

from __future__ import annotations

import random

from kv_cache_manager_v2 import BatchDesc, KVCacheDesc, KVCacheManager
from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2._model.planning import TYPICAL_SSM_SLOTS, ObservedDemand

from tests.helpers import KIB, attention, make_config, ssm


def test_observed_demand_sums_the_pages_of_the_caches_it_holds() -> None:
    rng = random.Random(7)
    manager = KVCacheManager(make_config([attention(0, 2 * KIB, window=128), attention(1, 4 * KIB), ssm(2)]))
    planner = internals_of(manager).planner
    observed = ObservedDemand(planner, 8)
    held: list[tuple[int, int]] = []
    for _ in range(200):
        capacity = rng.randrange(0, 3000)
        history = rng.randrange(0, capacity + 1)
        observed.append(capacity, history)
        held = (held + [(capacity, history)])[-8:]
        assert len(observed) == len(held)
        if rng.random() < 0.3:  # reads between runs of closes
            batch = BatchDesc([KVCacheDesc(cap, hist) for cap, hist in held])
            assert observed.sums == planner.pages(batch, TYPICAL_SSM_SLOTS)
    manager.shutdown()
