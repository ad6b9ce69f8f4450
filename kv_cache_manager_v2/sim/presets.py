"""Model presets with realistic per-block buffer sizes (fp16/bf16 K and V, Mamba-2 states)."""

from __future__ import annotations

import dataclasses
from typing import Final

from .._base.validation import INT64_LIMIT, check_minimums
from ..config import (
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
# Bookkeeping-only runs shrink every buffer by one power of two, at most this one, keeping each >= MIN bytes.
MAX_SHRINK: Final = 1 << 20
MIN_SHRUNK_BYTES: Final = 8
# The most layers of a custom model (--layers 10**23 hung building them).
MAX_LAYERS: Final = 4096


def kv_block_bytes(num_kv_heads: int, head_dim: int, tokens_per_block: int) -> int:
    """Bytes of one K (or V) page: ``[tokens_per_block, num_kv_heads, head_dim]`` in a 16-bit dtype. A page too
    large for 64 bits is the block size's fault, said here: the buffer config would name only its byte size."""
    size = tokens_per_block * num_kv_heads * head_dim * BYTES_FP16
    if size >= INT64_LIMIT:
        raise ValueError(
            f"tokens_per_block {tokens_per_block}: a K (or V) page of {num_kv_heads} KV heads of {head_dim} "
            f"dimensions would take {size:,} bytes, more than 64 bits count"
        )
    return size


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
        for layer_id in range(28):
            if layer_id % 7 == 3:
                layers.append(AttentionLayerConfig(layer_id, _kv_buffers(8, 128, tokens_per_block)))
            else:
                layers.append(SsmLayerConfig(layer_id, _ssm_buffers()))
    else:
        raise ValueError(f"unknown preset {name!r}; choose one of {PRESET_NAMES}")
    return layers


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model given by its shape instead of a preset (``--layers`` and the flags beside it).

    ``num_layers`` layers of ``num_kv_heads`` x ``head_dim`` K and V pages. With ``window`` > 0 the attention layers
    use that sliding window, except every ``full_every``-th one (0: none), which is full attention (Gemma's 5:1
    pattern is ``window=1024, full_every=6``). With ``attention_every`` > 1 only every ``attention_every``-th layer
    is attention and the others are Mamba-2 SSM layers with the ``hybrid-ssm`` preset's state sizes.
    """

    num_layers: int
    num_kv_heads: int = 8
    head_dim: int = 128
    window: int = 0
    full_every: int = 0
    attention_every: int = 1

    def __post_init__(self) -> None:
        check_minimums((
            ("num_layers", self.num_layers, 1),
            ("num_kv_heads", self.num_kv_heads, 1),
            ("head_dim", self.head_dim, 1),
            ("window", self.window, 0),
            ("full_every", self.full_every, 0),
            ("attention_every", self.attention_every, 1),
        ))
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"num_layers must be <= {MAX_LAYERS:,}, got {self.num_layers:,}")
        if self.full_every and not self.window:
            raise ValueError(f"full_every {self.full_every} needs a window (every layer is full attention without one)")
        if self.attention_every > self.num_layers:
            raise ValueError(
                f"attention_every must be <= num_layers ({self.num_layers}) so the model has an attention layer, "
                f"got {self.attention_every}"
            )

    def layers(self, tokens_per_block: int) -> list[LayerConfig]:
        layers: list[LayerConfig] = []
        for layer_id in range(self.num_layers):
            if layer_id % self.attention_every != self.attention_every - 1:
                layers.append(SsmLayerConfig(layer_id, _ssm_buffers()))
                continue
            attention_index = layer_id // self.attention_every
            full = self.window == 0 or (self.full_every > 0 and attention_index % self.full_every == self.full_every - 1)
            layers.append(
                AttentionLayerConfig(
                    layer_id,
                    _kv_buffers(self.num_kv_heads, self.head_dim, tokens_per_block),
                    sliding_window_size=None if full else self.window,
                )
            )
        return layers

    def describe(self) -> str:
        layers = "layer" if self.num_layers == 1 else "layers"
        heads = "KV head" if self.num_kv_heads == 1 else "KV heads"
        parts = [f"{self.num_layers} {layers}", f"{self.num_kv_heads} {heads} x {self.head_dim}"]
        if self.window:
            parts.append(f"window {self.window:,}" + (f", every {self.full_every} full" if self.full_every else ""))
        if self.attention_every > 1:
            parts.append(f"attention every {self.attention_every} (others SSM)")
        return "custom (" + ", ".join(parts) + ")"


def _ssm_buffers() -> list[BufferConfig]:
    """Mamba-2 state of the ``hybrid-ssm`` preset: bf16 state 64 heads x 64 x 128 and a conv state."""
    return [
        BufferConfig("ssm_state", 64 * 64 * 128 * BYTES_FP16),
        BufferConfig("conv_state", (4096 + 2 * 128) * 3 * BYTES_FP16),
    ]


def preset_config(
    name: str, cache_tiers: list[CacheTierConfig], tokens_per_block: int = 32, backend: str = "auto"
) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        layers=preset_layers(name, tokens_per_block),
        cache_tiers=cache_tiers,
        backend=backend,
    )


def bookkeeping_divisor(layers: list[LayerConfig]) -> int:
    """The power of two (at most ``MAX_SHRINK``) by which every buffer size can be divided exactly while staying
    at least ``MIN_SHRUNK_BYTES``: dividing buffers and quotas by it keeps every slot count and quota split the
    same (they are ratios of the two) while page copies move a few bytes."""
    divisor = MAX_SHRINK
    for layer in layers:
        for buffer in layer.buffers:
            while divisor > 1 and (buffer.size % divisor or buffer.size // divisor < MIN_SHRUNK_BYTES):
                divisor //= 2
    return divisor


def shrink_layers(layers: list[LayerConfig], divisor: int) -> list[LayerConfig]:
    """The same layers with every buffer ``divisor`` times smaller (sizes must divide exactly)."""
    result: list[LayerConfig] = []
    for layer in layers:
        buffers: list[BufferConfig] = []
        for buffer in layer.buffers:
            if buffer.size % divisor:
                raise ValueError(f"buffer {buffer.role!r} of layer {layer.layer_id} ({buffer.size} bytes) is not a "
                                 f"multiple of {divisor}")
            buffers.append(dataclasses.replace(buffer, size=buffer.size // divisor))
        result.append(dataclasses.replace(layer, buffers=buffers))
    return result
