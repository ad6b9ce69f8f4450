"""Error texts engines match on (TensorRT-LLM's wording): the call refused is named with its parentheses, open
caches are counted, bad pool ratios say which rule they broke; a refused call changes nothing."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, compute_prompt, make_config


def test_clear_and_shutdown_name_the_call_and_count_open_caches() -> None:
    manager = KVCacheManager(make_config([attention(0, 2 * KIB)]))
    engine = FakeEngine(manager)
    tokens = list(range(64))
    caches = [compute_prompt(manager, engine, tokens)]
    caches += [manager.create_kv_cache(None, [1, 2, 3]) for _ in range(2)]
    with pytest.raises(RuntimeError) as cleared:
        manager.clear_reusable_blocks()
    assert "clear_reusable_blocks()" in str(cleared.value)
    assert "3 KV cache(s) still open" in str(cleared.value)
    with pytest.raises(RuntimeError) as shut:
        manager.shutdown()
    assert "shutdown()" in str(shut.value) and "3 KV cache(s) still open" in str(shut.value)
    for cache in caches:
        cache.close()
    assert manager.probe_reuse(None, tokens) == 64  # the refused calls cleared nothing
    manager.shutdown()


def test_pool_ratio_of_the_wrong_length_says_length() -> None:
    with pytest.raises(ValueError, match="initial_pool_ratio length must match the number of layer groups"):
        KVCacheManager(make_config([attention(0), attention(1, window=64)], initial_pool_ratio=[1.0]))


@pytest.mark.parametrize("weights", [[0.0, 1.0], [1.5, -0.5]])
def test_pool_ratio_weights_must_be_positive(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="initial_pool_ratio values must be positive"):
        make_config([attention(0), attention(1, window=64)], initial_pool_ratio=weights)
