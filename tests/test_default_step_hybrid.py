"""A hybrid attention + SSM model works on a small GPU tier without declaring ``typical_step``: the default step
(8 decode caches of 4,096 tokens) is scaled down to one the tier can run when its split would starve a pool group."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import BatchDesc, KVCacheDesc, KVCacheManager
from kv_cache_manager_v2.config import LayerConfig
from tests.helpers import KIB, MIB, attention, make_config, ssm

LAYERS: list[LayerConfig] = [attention(0, 2 * KIB), ssm(1)]
DEFAULT_TYPICAL_STEP = BatchDesc([KVCacheDesc(4096, 4095)] * 8)  # the documented default, declared


def _gpu_slots(manager: KVCacheManager) -> list[int]:
    return [usage.total for usage in manager.get_usage() if usage.level == 0]


def test_a_small_tier_serves_a_hybrid_without_a_declared_step() -> None:
    """Before: ``ValueError: GpuCacheTierConfig.quota 98304 leaves pool group 1 (slots of 18432 bytes) without a
    single slot ... or declare KVCacheManagerConfig.typical_step`` (the default step's SSM share was under a slot)."""
    manager = KVCacheManager(make_config(LAYERS, gpu_quota=96 * KIB, tokens_per_block=16))
    ssm_group = manager.get_pool_group_index(manager.get_layer_group_id(1))
    assert _gpu_slots(manager)[ssm_group] >= 2  # a live state admitted within max_util_for_resume's 0.97
    assert manager.can_fit_in_chunks(160, 16) and manager.max_admissible(16) >= 160
    cache = manager.create_kv_cache()
    assert cache.resume()
    for end in range(16, 161, 16):
        assert cache.resize(end, end - 16), cache.last_refusal
    cache.close()
    manager.shutdown()
    with pytest.raises(ValueError, match="without a single slot"):  # a declared step is the engine's: kept as is
        KVCacheManager(make_config(LAYERS, gpu_quota=96 * KIB, tokens_per_block=16, typical_step=DEFAULT_TYPICAL_STEP))


def test_a_tier_the_default_step_serves_keeps_its_split() -> None:
    undeclared = KVCacheManager(make_config(LAYERS, gpu_quota=1 * MIB, tokens_per_block=16))
    declared = KVCacheManager(make_config(LAYERS, gpu_quota=1 * MIB, tokens_per_block=16, typical_step=DEFAULT_TYPICAL_STEP))
    assert _gpu_slots(undeclared) == _gpu_slots(declared)
    undeclared.shutdown()
    declared.shutdown()
