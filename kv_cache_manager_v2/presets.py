"""Model presets with realistic per-block buffer sizes (fp16/bf16 K and V, Mamba-2 states)."""

from __future__ import annotations

from typing import Final

from .config import (
    AttentionLayerConfig,
    BufferConfig,
    CacheTierConfig,
    KVCacheManagerConfig,
    LayerConfig,
    SsmLayerConfig,
)

PRESET_NAMES: Final = ("llama", "gemma", "hybrid-ssm")
DEFAULT_PRESET: Final = "gemma"
BYTES_FP16: Final = 2


def kv_block_bytes(num_kv_heads: int, head_dim: int, tokens_per_block: int) -> int:
    """Bytes of one K (or V) page: ``[tokens_per_block, num_kv_heads, head_dim]`` in a 16-bit dtype."""
    return tokens_per_block * num_kv_heads * head_dim * BYTES_FP16


def _kv_buffers(num_kv_heads: int, head_dim: int, tokens_per_block: int) -> list[BufferConfig]:
    size = kv_block_bytes(num_kv_heads, head_dim, tokens_per_block)
    return [BufferConfig("key", size), BufferConfig("value", size)]


def preset_layers(name: str, tokens_per_block: int) -> list[LayerConfig]:
    """Layers of a preset.

    llama: Llama-3-8B-like, 32 full-attention layers, 8 KV heads x 128.
    gemma: Gemma-like, 24 layers in a 5:1 pattern: sliding window 1,024 (8 KV heads x 128) and full
    attention with larger heads (4 KV heads x 512), so the two kinds land in different pool groups.
    hybrid-ssm: Nemotron-H-like, 4 full-attention layers among 24 Mamba-2 layers (bf16 state 64 heads x 64 x 128
    and a conv state).
    """
    layers: list[LayerConfig] = []
    if name == "llama":
        for layer_id in range(32):
            layers.append(AttentionLayerConfig(layer_id, _kv_buffers(8, 128, tokens_per_block)))
    elif name == "gemma":
        for layer_id in range(24):
            if layer_id % 6 == 5:
                layers.append(AttentionLayerConfig(layer_id, _kv_buffers(4, 512, tokens_per_block)))
            else:
                layers.append(
                    AttentionLayerConfig(layer_id, _kv_buffers(8, 128, tokens_per_block), sliding_window_size=1024)
                )
    elif name == "hybrid-ssm":
        ssm_state = 64 * 64 * 128 * BYTES_FP16
        conv_state = (4096 + 2 * 128) * 3 * BYTES_FP16
        for layer_id in range(28):
            if layer_id % 7 == 3:
                layers.append(AttentionLayerConfig(layer_id, _kv_buffers(8, 128, tokens_per_block)))
            else:
                layers.append(
                    SsmLayerConfig(layer_id, [BufferConfig("ssm_state", ssm_state), BufferConfig("conv_state", conv_state)])
                )
    else:
        raise ValueError(f"unknown preset {name!r}; choose one of {PRESET_NAMES}")
    return layers


def preset_config(
    name: str, cache_tiers: list[CacheTierConfig], tokens_per_block: int = 32, backend: str = "auto"
) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        layers=preset_layers(name, tokens_per_block),
        cache_tiers=cache_tiers,
        backend=backend,
    )
