"""The model math of both families, with attention left to the caller.

``Transformer.forward`` runs one batch of tokens through every layer. Each layer computes its queries, keys and
values (norms and RoPE applied), then hands them to ``attend(layer, q, k, v)``, which stores the new keys and
values wherever its cache keeps them and returns the attention output: the paged engine writes them into the
manager's pages and reads through page tables, the dense reference keeps contiguous arrays. Everything else —
and so every number the two paths compare — is this one code.
"""

from __future__ import annotations

import math
from typing import Callable, cast

import numpy as np
import numpy.typing as npt

from .backend import Array, ArrayBackend
from .gguf_model import LayerWeights, Model
from .spec import ModelSpec

Attend = Callable[[int, Array, Array, Array], Array]
"""``attend(layer, q [T, heads, head_dim], k [T, kv_heads, head_dim], v [T, kv_heads, head_dim]) -> [T, heads,
head_dim]``."""


class Transformer:
    """One model's weights on one backend, and its forward pass."""

    def __init__(self, model: Model, backend: ArrayBackend) -> None:
        self.model = model
        self.spec: ModelSpec = model.spec
        self.backend = backend
        put = backend.to_device
        self.embedding: Array = put(model.embedding)
        self.output_norm: Array = put(model.output_norm)
        self.layers: list[LayerWeights] = [
            LayerWeights(
                *(None if weight is None else put(weight) for weight in _fields(layer))  # type: ignore[arg-type]
            )
            for layer in model.layers
        ]
        half = self.spec.head_dim // 2
        self._inverse_frequencies = [
            base ** (-np.arange(half, dtype=np.float64) * 2.0 / self.spec.head_dim) for base in self.spec.rope_bases
        ]

    def forward(
        self, token_ids: npt.NDArray[np.int64], positions: npt.NDArray[np.int64], logit_rows: npt.NDArray[np.int64],
        attend: Attend,
    ) -> npt.NDArray[np.float32]:
        """Logits (host fp32 ``[len(logit_rows), vocab]``) of the tokens at ``logit_rows`` of the batch."""
        spec = self.spec
        x = self.embedding[self.backend.to_device(token_ids)] * np.float32(spec.embedding_scale)
        for index, layer in enumerate(self.layers):
            x = self._layer(index, layer, x, positions, attend)
        rows = x[self.backend.to_device(logit_rows)]
        logits = _rms_norm(rows, self.output_norm, spec.rms_eps) @ self.embedding.T
        return np.asarray(self.backend.to_host(logits), dtype=np.float32)

    def _layer(self, index: int, w: LayerWeights, x: Array, positions: npt.NDArray[np.int64], attend: Attend) -> Array:
        spec = self.spec
        tokens = int(x.shape[0])
        h = _rms_norm(x, w.attn_norm, spec.rms_eps)
        q = (h @ w.q.T).reshape(tokens, spec.num_heads, spec.head_dim)
        k = (h @ w.k.T).reshape(tokens, spec.num_kv_heads, spec.head_dim)
        v = (h @ w.v.T).reshape(tokens, spec.num_kv_heads, spec.head_dim)
        if w.q_norm is not None and w.k_norm is not None:
            q = _rms_norm(q, w.q_norm, spec.rms_eps)
            k = _rms_norm(k, w.k_norm, spec.rms_eps)
        cos, sin = self._rope_tables(index, positions)
        q = self._rotate(q, cos, sin)
        k = self._rotate(k, cos, sin)
        contiguous = self.backend.contiguous
        attended = attend(index, contiguous(q), contiguous(k), contiguous(v))
        out = attended.reshape(tokens, spec.num_heads * spec.head_dim) @ w.o.T
        if w.post_attn_norm is not None:
            out = _rms_norm(out, w.post_attn_norm, spec.rms_eps)
        x = x + out
        h = _rms_norm(x, w.ffn_norm, spec.rms_eps)
        gate = h @ w.gate.T
        activated = _gelu_tanh(gate) if spec.family == "gemma3" else gate / (np.float32(1.0) + np.exp(-gate))
        out = (activated * (h @ w.up.T)) @ w.down.T
        if w.post_ffn_norm is not None:
            out = _rms_norm(out, w.post_ffn_norm, spec.rms_eps)
        return x + out

    def _rope_tables(self, layer: int, positions: npt.NDArray[np.int64]) -> tuple[Array, Array]:
        """``cos``, ``sin`` of shape ``[T, 1, head_dim / 2]`` (angles in float64, then fp32)."""
        angles = positions.astype(np.float64)[:, None] * self._inverse_frequencies[layer][None, :]
        put = self.backend.to_device
        return put(np.cos(angles).astype(np.float32)[:, None, :]), put(np.sin(angles).astype(np.float32)[:, None, :])

    def _rotate(self, x: Array, cos: Array, sin: Array) -> Array:
        half = self.spec.head_dim // 2
        if self.spec.rope_halves:
            first, second = x[..., :half], x[..., half:]
            return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
        even, odd = x[..., 0::2], x[..., 1::2]
        return np.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


def _fields(layer: LayerWeights) -> list[Array | None]:
    return [getattr(layer, name) for name in LayerWeights.__dataclass_fields__]


def _rms_norm(x: Array, weight: Array, eps: float) -> Array:
    scale = np.float32(1.0) / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(eps))
    return cast(Array, x * scale * weight)


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def _gelu_tanh(x: Array) -> Array:
    inner = _GELU_C * (x + np.float32(0.044715) * x * x * x)
    return cast(Array, np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner)))
