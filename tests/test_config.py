"""Config validation: every bad field raises, naming the field; NumPy ints are accepted (array code hands them
around). The config package keeps exporting every name users import from it."""

from __future__ import annotations

import numpy as np
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import config as config_package
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)
from tests.helpers import attention, kv, make_config, ssm


def test_numpy_integers_are_normalised_to_int() -> None:
    buffer = BufferConfig("key", np.int64(4096), np.int32(16))  # type: ignore[arg-type]
    assert type(buffer.size) is int and buffer.size == 4096
    assert type(buffer.tokens_per_block_override) is int
    layer = AttentionLayerConfig(np.int64(3), [buffer], sliding_window_size=np.int64(64))  # type: ignore[arg-type]
    assert type(layer.layer_id) is int and type(layer.sliding_window_size) is int
    config = KVCacheManagerConfig(np.int64(32), cache_tiers=[GpuCacheTierConfig(np.int64(1 << 20))], layers=[layer], backend="cpu")  # type: ignore[arg-type]
    assert type(config.tokens_per_block) is int and type(config.cache_tiers[0].quota) is int


@pytest.mark.parametrize(
    ("build", "error", "fragment"),
    [
        (lambda: BufferConfig("key", 0), ValueError, "BufferConfig.size"),
        (lambda: BufferConfig("", 16), ValueError, "BufferConfig.role"),
        (lambda: BufferConfig("key", 16.0), TypeError, "BufferConfig.size"),  # type: ignore[arg-type]
        (lambda: BufferConfig("key", 16, 0), ValueError, "tokens_per_block_override"),
        (lambda: AttentionLayerConfig(0, []), ValueError, "buffers"),
        (lambda: AttentionLayerConfig(0, kv(16) + kv(16)), ValueError, "duplicate role 'key'"),
        (lambda: AttentionLayerConfig(0, kv(16), num_sink_tokens=4), ValueError, "num_sink_tokens"),
        (lambda: AttentionLayerConfig(0, kv(16), sliding_window_size=0), ValueError, "sliding_window_size"),
        (lambda: AttentionLayerConfig(0, kv(16), 64, -1), ValueError, "num_sink_tokens"),
        (lambda: SsmLayerConfig(0, [BufferConfig("ssm_state", 64, 16)]), ValueError, "tokens_per_block_override"),
        (lambda: GpuCacheTierConfig(-1), ValueError, "GpuCacheTierConfig.quota"),
        (lambda: HostCacheTierConfig(-5), ValueError, "HostCacheTierConfig.quota"),
        (lambda: GpuCacheTierConfig(100, max_quota=50), ValueError, "max_quota"),
        (lambda: DiskCacheTierConfig(100, 5), TypeError, "DiskCacheTierConfig.path"),  # type: ignore[arg-type]
        (lambda: KVCacheDesc(10, 11), ValueError, "history_length"),
        (lambda: KVCacheDesc(-1, 0), ValueError, "KVCacheDesc.capacity"),
        (lambda: BatchDesc([KVCacheDesc(4, 4)], -1), ValueError, "system_prompt_length"),
        (lambda: SwaScratchReuseConfig(-1), ValueError, "max_rewind_len"),
        (lambda: make_config([attention(0), attention(0)]), ValueError, "duplicate layer_id 0"),
        (lambda: make_config([]), ValueError, "layers"),
        (lambda: make_config([attention(0)], tokens_per_block=0), ValueError, "tokens_per_block"),
        (
            lambda: make_config([AttentionLayerConfig(0, [BufferConfig("key", 96, 24)])]),
            ValueError,
            "tokens_per_block_override 24",
        ),
        (lambda: make_config([attention(0)], tiers=[HostCacheTierConfig(1 << 20)]), ValueError, "cache_tiers[0]"),
        (
            lambda: make_config(
                [attention(0)],
                tiers=[GpuCacheTierConfig(1 << 20), HostCacheTierConfig(1 << 20), GpuCacheTierConfig(1 << 20)],
            ),
            ValueError,
            "cache_tiers[2]",
        ),
        (lambda: make_config([attention(0)], tiers=[]), ValueError, "cache_tiers"),
        (lambda: make_config([attention(0)], backend="tpu"), ValueError, "backend"),
        (lambda: make_config([attention(0)], max_util_for_resume=0.0), ValueError, "max_util_for_resume"),
        (lambda: make_config([attention(0)], max_util_for_resume=1.5), ValueError, "max_util_for_resume"),
        (lambda: make_config([attention(0)], vocab_size=0), ValueError, "vocab_size"),
        (lambda: make_config([attention(0), ssm(1)], ssm_reuse_interval=48), ValueError, "ssm_reuse_interval"),
        (lambda: make_config([attention(0), ssm(1)], ssm_reuse_interval=0, snapshot_prefill_chunks=False), ValueError, "ssm_reuse_interval"),
        (lambda: make_config([attention(0)], enable_swa_scratch_reuse=1), TypeError, "enable_swa_scratch_reuse"),
    ],
)
def test_invalid_configs_name_the_field(build: object, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as info:
        build()  # type: ignore[operator]
    assert fragment in str(info.value)


def test_ssm_interval_only_checked_with_ssm_layers() -> None:
    config = make_config([attention(0)], ssm_reuse_interval=-3)
    assert config.ssm_reuse_interval == -3
    assert make_config([attention(0), ssm(1)], ssm_reuse_interval=64).ssm_reuse_interval == 64


def test_partial_reuse_default_depends_on_ssm() -> None:
    assert make_config([attention(0)]).partial_reuse_enabled is True
    assert make_config([attention(0), ssm(1)]).partial_reuse_enabled is False
    assert make_config([attention(0)], enable_partial_reuse=False).partial_reuse_enabled is False
    assert make_config([attention(0), ssm(1)], enable_partial_reuse=True).partial_reuse_enabled is True


def test_scratch_reuse_config_forms() -> None:
    assert make_config([attention(0, window=64)]).enable_swa_scratch_reuse is False
    plain = make_config([attention(0, window=64)], enable_swa_scratch_reuse=True)
    assert plain.max_rewind_len == 0
    rewind = make_config([attention(0, window=64)], swa_scratch_reuse=SwaScratchReuseConfig(max_rewind_len=8))
    assert rewind.enable_swa_scratch_reuse is True and rewind.max_rewind_len == 8


CONFIG_NAMES = (
    "AttentionLayerConfig", "BACKENDS", "BatchDesc", "BufferConfig", "CacheTierConfig", "DiskCacheTierConfig",
    "GpuCacheTierConfig", "HostCacheTierConfig", "KVCacheDesc", "KVCacheManagerConfig", "LayerConfig",
    "LocalCacheTierConfig", "RemoteCacheTierConfig", "SsmLayerConfig", "SwaScratchReuseConfig",
)


def test_the_config_package_exports_every_name_of_the_former_module() -> None:
    """``kv_cache_manager_v2.config`` is the path users import configs from, whichever module defines them."""
    missing = [name for name in CONFIG_NAMES if not hasattr(config_package, name)]
    assert missing == []
    for name in CONFIG_NAMES:
        if hasattr(kv_cache_manager_v2, name):
            assert getattr(kv_cache_manager_v2, name) is getattr(config_package, name), name
