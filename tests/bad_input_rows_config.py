"""Invalid configs, and managers that cannot be built from one (``tests/test_bad_inputs.py`` runs the rows)."""

from __future__ import annotations

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    SsmLayerConfig,
    SwaScratchReuseConfig,
)
from tests.bad_input_world import GPU, SSM, TPB, Bad, config_with, kv, world_config_disk, world_layers

CONFIG_ROWS: list[Bad] = [
    # --- invalid configs
    Bad("config: buffer size 0", lambda w: BufferConfig("key", 0), ValueError, "BufferConfig.size"),
    Bad(
        "config: float buffer size",
        lambda w: BufferConfig("key", 512.0),  # type: ignore[arg-type]
        TypeError,
        "BufferConfig.size",
    ),
    Bad("config: empty role", lambda w: BufferConfig("", 512), ValueError, "BufferConfig.role"),
    Bad(
        "config: role is an int",
        lambda w: BufferConfig(1, 512),  # type: ignore[arg-type]
        TypeError,
        "BufferConfig.role",
    ),
    Bad(
        "config: tokens_per_block_override 0",
        lambda w: BufferConfig("key", 512, 0),
        ValueError,
        "tokens_per_block_override",
    ),
    Bad("config: no buffers", lambda w: AttentionLayerConfig(0, []), ValueError, "buffers"),
    Bad(
        "config: duplicate role",
        lambda w: AttentionLayerConfig(0, [BufferConfig("key", 8), BufferConfig("key", 8)]),
        ValueError,
        "key",
    ),
    Bad(
        "config: str layer id",
        lambda w: AttentionLayerConfig("0", kv(512)),  # type: ignore[arg-type]
        TypeError,
        "layer_id",
    ),
    Bad(
        "config: window 0",
        lambda w: AttentionLayerConfig(0, kv(512), sliding_window_size=0),
        ValueError,
        "sliding_window_size",
    ),
    Bad(
        "config: sinks without a window",
        lambda w: AttentionLayerConfig(0, kv(512), num_sink_tokens=4),
        ValueError,
        "num_sink_tokens",
    ),
    Bad("config: negative sinks", lambda w: AttentionLayerConfig(0, kv(512), 64, -1), ValueError, "num_sink_tokens"),
    Bad(
        "config: SSM buffer with override",
        lambda w: SsmLayerConfig(0, [BufferConfig("ssm_state", 64, 8)]),
        ValueError,
        "tokens_per_block_override",
    ),
    Bad("config: GPU quota -1", lambda w: GpuCacheTierConfig(-1), ValueError, "quota"),
    Bad("config: GPU quota None", lambda w: GpuCacheTierConfig(None), TypeError, "quota"),  # type: ignore[arg-type]
    Bad("config: max_quota below quota", lambda w: HostCacheTierConfig(1000, max_quota=10), ValueError, "max_quota"),
    Bad(
        "config: disk path is an int",
        lambda w: DiskCacheTierConfig(1000, 5),  # type: ignore[arg-type]
        TypeError,
        "path",
    ),
    Bad("config: KVCacheDesc history beyond capacity", lambda w: KVCacheDesc(10, 20), ValueError, "history_length"),
    Bad("config: negative system_prompt_length", lambda w: BatchDesc([], -1), ValueError, "system_prompt_length"),
    Bad("config: negative max_rewind_len", lambda w: SwaScratchReuseConfig(-1), ValueError, "max_rewind_len"),
    Bad(
        "config: tokens_per_block 0",
        lambda w: KVCacheManagerConfig(0, cache_tiers=GPU, layers=world_layers()),
        ValueError,
        "tokens_per_block",
    ),
    Bad(
        "config: float tokens_per_block",
        lambda w: KVCacheManagerConfig(16.0, cache_tiers=GPU, layers=world_layers()),  # type: ignore[arg-type]
        TypeError,
        "tokens_per_block",
    ),
    Bad("config: no layers", lambda w: KVCacheManagerConfig(TPB, cache_tiers=GPU, layers=[]), ValueError, "layers"),
    Bad(
        "config: duplicate layer id",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=GPU, layers=world_layers() * 2),
        ValueError,
        "layer_id",
    ),
    Bad("config: no tiers", lambda w: KVCacheManagerConfig(TPB, cache_tiers=[], layers=world_layers()), ValueError, "cache_tiers"),
    Bad(
        "config: first tier not GPU",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=[HostCacheTierConfig(10**6)], layers=world_layers()),
        ValueError,
        "cache_tiers",
    ),
    Bad(
        "config: a GPU tier after a host tier",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=[*GPU, HostCacheTierConfig(1 << 20), *GPU], layers=world_layers()),
        ValueError,
        "cache_tiers",
    ),
    Bad(
        "manager: a second GPU tier without cold_page_codec",
        lambda w: KVCacheManager(KVCacheManagerConfig(TPB, cache_tiers=GPU * 2, layers=world_layers(), backend="cpu")),
        ValueError,
        "cold_page_codec",
    ),
    Bad("config: unknown backend", config_with(backend="tpu"), ValueError, "backend"),
    Bad("config: max_util_for_resume 0", config_with(max_util_for_resume=0.0), ValueError, "max_util_for_resume"),
    Bad("config: max_util_for_resume 1.5", config_with(max_util_for_resume=1.5), ValueError, "max_util_for_resume"),
    Bad("config: max_util_for_resume str", config_with(max_util_for_resume="high"), TypeError, "max_util_for_resume"),
    Bad("config: vocab_size 0", config_with(vocab_size=0), ValueError, "vocab_size"),
    Bad("config: enable_partial_reuse str", config_with(enable_partial_reuse="yes"), TypeError, "enable_partial_reuse"),
    Bad(
        "config: scratch reuse flag is an int",
        config_with(enable_swa_scratch_reuse=1),
        TypeError,
        "enable_swa_scratch_reuse",
    ),
    Bad(
        "config: override not dividing tokens_per_block",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=GPU, layers=[AttentionLayerConfig(0, [BufferConfig("key", 512, 5)])]),
        ValueError,
        "tokens_per_block_override",
    ),
    Bad(
        "config: ssm_reuse_interval not a multiple of tokens_per_block",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=GPU, layers=[*world_layers(), SSM], ssm_reuse_interval=24),
        ValueError,
        "ssm_reuse_interval",
    ),
    Bad(
        "manager: config is a dict",
        lambda w: KVCacheManager({"tokens_per_block": 16}),  # type: ignore[arg-type]
        TypeError,
        "config|KVCacheManagerConfig",
    ),
    Bad(
        "manager: GPU quota leaves a pool group no slot",
        lambda w: KVCacheManager(KVCacheManagerConfig(TPB, cache_tiers=[GpuCacheTierConfig(1024)], layers=world_layers(), backend="cpu")),
        ValueError,
        "quota",
    ),
    Bad(
        "manager: disk path does not exist",
        lambda w: KVCacheManager(world_config_disk("/nonexistent/kv-cache-dir")),
        ValueError,
        "nonexistent",
    ),
]
