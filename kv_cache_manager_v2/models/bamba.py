"""Bamba, a published hybrid: Mamba-2 mixer layers with a few full-attention layers, in NumPy.

Why Bamba (IBM / Princeton / UIUC, ``ibm-fms/Bamba-9B``): its layers are exactly the two kinds the manager keeps
apart — Mamba-2 (SSD) mixers, whose recurrent state lives in the SSM pools, and full causal attention, whose K/V
live in pages — with nothing else (no MoE, no sliding window), and transformers' ``BambaForCausalLM`` runs on the
CPU with its reference kernels, so an independent implementation gives golden logits. Each decoder layer is
RMSNorm -> (mixer or attention) -> residual, RMSNorm -> SwiGLU MLP -> residual; attention rotates only the first
half of each head (``partial_rotary_factor`` 0.5, rotate-half RoPE); the mixer's output goes through an RMS norm
gated by SiLU, per group. Final RMSNorm and an untied LM head.

The shipped weights (``data/bamba_tiny.npz``) are a seeded random initialisation of that architecture (hidden 64,
4 layers: mixer, attention, mixer, attention; vocabulary 256) made by ``tools/make_hybrid_golden.py``.
"""

from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass
from typing import Final, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from .backend import Array
from .dense import dense_attention
from .mamba2 import MambaMixer, MambaShape, MambaState
from .transformer import Attend

DATA: Final = pathlib.Path(__file__).resolve().parent / "data"
WEIGHTS_FILE: Final = DATA / "bamba_tiny.npz"
GOLDEN_FILE: Final = DATA / "bamba_tiny_golden.npz"


@dataclass(frozen=True)
class BambaSpec:
    """Sizes and layer pattern (``attention_layers``: the full-attention layers, every other layer is a mixer)."""

    vocab_size: int
    hidden: int
    num_layers: int
    attention_layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    rotary_dim: int
    rope_theta: float
    ffn: int
    rms_eps: float
    mamba: MambaShape

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def ssm_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.num_layers) if layer not in self.attention_layers)

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> BambaSpec:
        """From transformers' ``BambaConfig`` fields (as saved beside the weights)."""

        def real(name: str) -> float:
            value = config[name]
            if not isinstance(value, (int, float)):
                raise ValueError(f"config field {name} must be a number, got {value!r}")
            return float(value)

        def integer(name: str) -> int:
            return int(real(name))

        hidden = integer("hidden_size")
        heads = integer("num_attention_heads")
        mamba_heads = integer("mamba_n_heads")
        layers = config["attn_layer_indices"]
        if not isinstance(layers, list):
            raise ValueError(f"attn_layer_indices must be a list, got {layers!r}")
        return cls(
            vocab_size=integer("vocab_size"),
            hidden=hidden,
            num_layers=integer("num_hidden_layers"),
            attention_layers=tuple(int(layer) for layer in layers),
            num_heads=heads,
            num_kv_heads=integer("num_key_value_heads"),
            rotary_dim=int(hidden // heads * real("partial_rotary_factor")),
            rope_theta=real("rope_theta"),
            ffn=integer("intermediate_size"),
            rms_eps=real("rms_norm_eps"),
            mamba=MambaShape(
                heads=mamba_heads,
                head_dim=integer("mamba_expand") * hidden // mamba_heads,
                groups=integer("mamba_n_groups"),
                state_size=integer("mamba_d_state"),
                conv_kernel=integer("mamba_d_conv"),
                rms_eps=real("rms_norm_eps"),
            ),
        )


class Bamba:
    """The weights (transformers' state-dict names) and the forward pass; attention is injected, as for
    ``Transformer``: ``attend(layer, q, k, v)`` stores the new K/V wherever its cache keeps them."""

    def __init__(self, spec: BambaSpec, weights: Mapping[str, Array]) -> None:
        self.spec = spec
        self.weights = weights
        self.mixers: dict[int, MambaMixer] = {
            layer: MambaMixer(spec.mamba, weights, f"model.layers.{layer}.mamba.") for layer in spec.ssm_layers
        }
        half = spec.rotary_dim // 2
        self._inverse_frequencies = spec.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / spec.rotary_dim)

    def initial_states(self) -> list[MambaState]:
        """The states of the empty prefix, one per SSM layer."""
        return [MambaState.zeros(self.spec.mamba) for _ in self.spec.ssm_layers]

    def forward(
        self,
        token_ids: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        states: list[MambaState],
        attend: Attend,
    ) -> npt.NDArray[np.float32]:
        """Logits ``[T, vocab]`` of every token of one sequence's pass; ``states`` (the mixers' states before the
        pass, one per SSM layer in ``BambaSpec.ssm_layers`` order) are updated in place to the states after it."""
        spec = self.spec
        if len(states) != len(spec.ssm_layers):
            raise ValueError(f"states must hold one state per SSM layer ({len(spec.ssm_layers)}), got {len(states)}")
        w = self.weights
        x = w["model.embed_tokens.weight"][token_ids]
        for layer in range(spec.num_layers):
            prefix = f"model.layers.{layer}."
            h = rms_norm(x, w[prefix + "input_layernorm.weight"], spec.rms_eps)
            if layer in self.mixers:
                out = self.mixers[layer].forward(h, states[spec.ssm_layers.index(layer)])
            else:
                out = self._attention(layer, h, positions, attend)
            x = x + out
            h = rms_norm(x, w[prefix + "pre_ff_layernorm.weight"], spec.rms_eps)
            gate = h @ w[prefix + "feed_forward.gate_proj.weight"].T
            activated = np.divide(gate, np.float32(1.0) + np.exp(-gate), dtype=np.float32)
            up = h @ w[prefix + "feed_forward.up_proj.weight"].T
            x = x + (activated * up) @ w[prefix + "feed_forward.down_proj.weight"].T
        final = rms_norm(x, w["model.final_layernorm.weight"], spec.rms_eps)
        return np.asarray(final @ w["lm_head.weight"].T, dtype=np.float32)

    def _attention(self, layer: int, h: Array, positions: npt.NDArray[np.int64], attend: Attend) -> Array:
        spec = self.spec
        tokens = int(h.shape[0])
        prefix = f"model.layers.{layer}.self_attn."
        w = self.weights
        q = (h @ w[prefix + "q_proj.weight"].T).reshape(tokens, spec.num_heads, spec.head_dim)
        k = (h @ w[prefix + "k_proj.weight"].T).reshape(tokens, spec.num_kv_heads, spec.head_dim)
        v = (h @ w[prefix + "v_proj.weight"].T).reshape(tokens, spec.num_kv_heads, spec.head_dim)
        angles = positions.astype(np.float64)[:, None] * self._inverse_frequencies[None, :]
        cos = np.cos(np.concatenate([angles, angles], axis=-1)).astype(np.float32)[:, None, :]
        sin = np.sin(np.concatenate([angles, angles], axis=-1)).astype(np.float32)[:, None, :]
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        attended = attend(layer, np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v))
        out: Array = attended.reshape(tokens, spec.hidden) @ w[prefix + "o_proj.weight"].T
        return out

    def _rotate(self, x: Array, cos: Array, sin: Array) -> Array:
        """Rotate-half RoPE on the first ``rotary_dim`` dimensions of each head; the rest pass through."""
        dim = self.spec.rotary_dim
        rotated, passed = x[..., :dim], x[..., dim:]
        first, second = rotated[..., : dim // 2], rotated[..., dim // 2 :]
        turned = np.concatenate([-second, first], axis=-1)
        return np.concatenate([rotated * cos + turned * sin, passed], axis=-1)


class ContiguousKV:
    """The dense reference's attention: each attention layer's K/V of one sequence in one growing array."""

    def __init__(self, spec: BambaSpec) -> None:
        self.keys: dict[int, Array] = {}
        self.values: dict[int, Array] = {}
        self.length: int = 0
        self._first = 0

    def begin(self, num_tokens: int) -> None:
        """The next pass appends ``num_tokens`` tokens at positions ``[length, length + num_tokens)``."""
        self._first = self.length
        self.length += num_tokens

    def attend(self, layer: int, q: Array, k: Array, v: Array) -> Array:
        keys = np.concatenate([self.keys[layer], k]) if layer in self.keys else k
        values = np.concatenate([self.values[layer], v]) if layer in self.values else v
        self.keys[layer], self.values[layer] = keys, values
        return dense_attention(q, keys, values, self._first, None)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    scale = np.reciprocal(np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps)))
    result: Array = x * scale * weight
    return result


@functools.cache
def load_bamba(path: pathlib.Path = WEIGHTS_FILE) -> Bamba:
    """The model saved by ``tools/make_hybrid_golden.py`` (read once per process; no torch needed)."""
    with np.load(path, allow_pickle=False) as archive:
        config = json.loads(str(archive["config"]))
        weights = {name: np.asarray(archive[name], dtype=np.float32) for name in archive.files if name != "config"}
    if config.get("model_type") != "bamba":
        raise ValueError(f"{path}: model_type must be 'bamba', got {config.get('model_type')!r}")
    return Bamba(BambaSpec.from_config(config), weights)


def dense_run(model: Bamba, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
    """Logits of every position of ``tokens`` in one whole-sequence pass, no manager involved."""
    attention = ContiguousKV(model.spec)
    attention.begin(len(tokens))
    ids = np.asarray(tokens, dtype=np.int64)
    return model.forward(ids, np.arange(len(ids), dtype=np.int64), model.initial_states(), attention.attend)
