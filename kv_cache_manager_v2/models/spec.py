"""A model's shape and the choices its family makes, read from GGUF metadata.

Two families: ``llama`` (SmolLM2: RMSNorm ``x * w``, SiLU-gated FFN, RoPE on adjacent pairs because llama.cpp's
converter permutes the Q/K rows for it, tied embeddings) and ``gemma3`` (embeddings scaled by ``sqrt(hidden)``,
RMSNorm ``x * w`` with the ``1 +`` already folded into the GGUF weights, per-head Q/K RMSNorm, post-attention and
post-FFN norms, GELU(tanh)-gated FFN, RoPE on the two halves, five sliding-window layers then one global layer,
local RoPE base 10,000 and global base from the metadata).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Mapping

GEMMA3_LOCAL_ROPE_BASE: Final = 10_000.0
"""Gemma 3's ``rope_local_base_freq``: not in the GGUF metadata (llama.cpp hard-codes it too)."""
GEMMA3_GLOBAL_EVERY: Final = 6
"""Gemma 3's layer pattern: layer ``i`` is global when ``(i + 1) % 6 == 0``, else sliding-window."""

Metadata = Mapping[str, object]


@dataclass(frozen=True)
class ModelSpec:
    """Everything the math needs besides the weights. ``windows[i]`` is layer ``i``'s sliding window (None:
    global attention) and ``rope_bases[i]`` its RoPE base. ``num_sink_tokens``: the leading tokens every
    sliding-window layer also sees (0 in both families; set on a copy of a spec to drive the manager's sink blocks
    with real tokens, in the paged path and the dense reference alike)."""

    family: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    rms_eps: float
    windows: tuple[int | None, ...]
    rope_bases: tuple[float, ...]
    bos_id: int | None
    eos_id: int
    num_sink_tokens: int = 0

    @property
    def embedding_scale(self) -> float:
        return math.sqrt(self.hidden) if self.family == "gemma3" else 1.0

    @property
    def rope_halves(self) -> bool:
        """RoPE rotates ``(x[i], x[i + d/2])`` (NeoX, gemma3) rather than ``(x[2i], x[2i + 1])`` (GGUF llama)."""
        return self.family == "gemma3"


def spec_from_metadata(metadata: Metadata) -> ModelSpec:
    """Raises ``ValueError`` for an architecture other than ``llama`` and ``gemma3``."""
    family = str(metadata["general.architecture"])
    if family not in ("llama", "gemma3"):
        raise ValueError(f"GGUF architecture {family!r} is not supported (llama, gemma3)")

    def number(key: str) -> float:
        value = metadata[f"{family}.{key}"]
        if not isinstance(value, (int, float)):
            raise ValueError(f"GGUF metadata {family}.{key} must be a number, got {value!r}")
        return value

    num_layers = int(number("block_count"))
    hidden = int(number("embedding_length"))
    num_heads = int(number("attention.head_count"))
    if family == "gemma3":
        head_dim = int(number("attention.key_length"))
        window = int(number("attention.sliding_window"))
        windows: tuple[int | None, ...] = tuple(
            None if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else window for i in range(num_layers)
        )
        global_base = number("rope.freq_base")
        rope_bases = tuple(global_base if w is None else GEMMA3_LOCAL_ROPE_BASE for w in windows)
    else:
        head_dim = hidden // num_heads
        windows = (None,) * num_layers
        rope_bases = (number("rope.freq_base"),) * num_layers
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab_size = len(tokens) if isinstance(tokens, list) else int(number("vocab_size"))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    return ModelSpec(
        family=family,
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=int(number("attention.head_count_kv")),
        head_dim=head_dim,
        ffn=int(number("feed_forward_length")),
        vocab_size=vocab_size,
        rms_eps=float(number("attention.layer_norm_rms_epsilon")),
        windows=windows,
        rope_bases=tuple(float(base) for base in rope_bases),
        bos_id=int(bos) if add_bos and isinstance(bos, int) else None,
        eos_id=int(str(metadata["tokenizer.ggml.eos_token_id"])),
    )
