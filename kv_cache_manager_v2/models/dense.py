"""The dense reference: contiguous per-request K/V arrays and a plain causal (windowed) softmax.

Used only to check the paged path: it runs each request alone — the whole prompt in one pass, then one token per
step — through the same ``Transformer`` math, keeping every layer's keys and values in one growing host array
(fp32, attention in float64 on the host, whichever backend runs the rest of the model).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .backend import Array, ArrayBackend
from .spec import ModelSpec


class DenseKV:
    """One request's K/V for every layer, positions ``[0, length)``, and attention over it."""

    def __init__(self, spec: ModelSpec, backend: ArrayBackend) -> None:
        self.spec = spec
        self.backend = backend
        self.keys: list[Array | None] = [None] * spec.num_layers
        self.values: list[Array | None] = [None] * spec.num_layers
        self.length: int = 0
        self._query_start = 0

    def begin(self, num_tokens: int) -> None:
        """The next forward pass appends ``num_tokens`` tokens at positions ``[length, length + num_tokens)``."""
        self._query_start = self.length
        self.length += num_tokens

    def attend(self, layer: int, q: Array, k: Array, v: Array) -> Array:
        host = self.backend.to_host
        new_keys, new_values = np.asarray(host(k), np.float32), np.asarray(host(v), np.float32)
        old_keys, old_values = self.keys[layer], self.values[layer]
        keys = new_keys if old_keys is None else np.concatenate([old_keys, new_keys])
        values = new_values if old_values is None else np.concatenate([old_values, new_values])
        self.keys[layer], self.values[layer] = keys, values
        queries = np.asarray(host(q), np.float32)
        out = dense_attention(
            queries, keys, values, self._query_start, self.spec.windows[layer], self.spec.num_sink_tokens
        )
        return self.backend.to_device(out)


def dense_attention(
    q: Array, keys: Array, values: Array, first_position: int, window: int | None, num_sink_tokens: int = 0
) -> Array:
    """Queries at ``[first_position, first_position + T)`` over keys ``[0, len(keys))``: key ``j`` is visible to
    the query at ``p`` iff ``j <= p`` and (no window, ``j > p - window`` or ``j < num_sink_tokens``); float64
    softmax, fp32 result."""
    tokens, num_heads, head_dim = (int(size) for size in q.shape)
    num_kv_heads = int(keys.shape[1])
    group = num_heads // num_kv_heads
    query_positions = np.arange(first_position, first_position + tokens)[:, None]
    key_positions = np.arange(int(keys.shape[0]))[None, :]
    visible = key_positions <= query_positions
    if window is not None:
        visible &= (key_positions > query_positions - window) | (key_positions < num_sink_tokens)
    # [kv_heads, group * T, head_dim] @ [kv_heads, head_dim, keys]: one float64 matrix product per kv head.
    grouped = q.astype(np.float64).reshape(tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    flat_keys = keys.astype(np.float64).transpose(1, 2, 0)
    scores = (grouped.reshape(num_kv_heads, group * tokens, head_dim) @ flat_keys) / np.sqrt(head_dim)
    scores = np.where(visible, scores.reshape(num_kv_heads, group, tokens, -1), -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    flat_values = values.astype(np.float64).transpose(1, 0, 2)  # [kv_heads, keys, head_dim]
    mixed = weights.reshape(num_kv_heads, group * tokens, -1) @ flat_values
    out: npt.NDArray[np.float64] = mixed.reshape(num_kv_heads, group, tokens, head_dim).transpose(2, 0, 1, 3)
    return out.reshape(tokens, num_heads, head_dim).astype(np.float32)
