"""One Mamba-2 (SSD) mixer layer as Bamba uses it, and the recurrent state it carries from token to token.

The state after a prefix is everything the layer needs to go on: the last ``conv_kernel - 1`` inputs of the
depthwise causal convolution and the SSM state ``[heads, head_dim, state_size]``. That pair is what the manager
stores in its SSM pools (the live slot, and a snapshot at the end of a block) and what a reused prefix restores.

The scan runs token by token: the recurrence itself, not the chunked SSD form transformers uses for long inputs
(the same numbers up to fp32 rounding; measured against transformers' logits: at most ~3e-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, cast

import numpy as np

from .backend import Array


@dataclass(frozen=True)
class MambaShape:
    """A Mamba-2 layer's sizes: ``heads`` x ``head_dim`` = ``inner``; B and C have ``groups`` x ``state_size``."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int
    rms_eps: float

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.inner + 2 * self.groups * self.state_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.head_dim, self.state_size)


@dataclass
class MambaState:
    """One layer's state after a prefix: convolution inputs ``[conv_kernel - 1, conv_dim]``, SSM state
    ``[heads, head_dim, state_size]`` (fp32). The state of the empty prefix is all zeros."""

    conv: Array
    ssm: Array

    @classmethod
    def zeros(cls, shape: MambaShape) -> MambaState:
        return cls(np.zeros(shape.conv_state_shape, np.float32), np.zeros(shape.ssm_state_shape, np.float32))


class MambaMixer:
    """One layer's weights (transformers' ``BambaMixer`` names under ``prefix``) and its forward pass."""

    def __init__(self, shape: MambaShape, weights: Mapping[str, Array], prefix: str) -> None:
        self.shape = shape
        self.in_proj: Array = weights[prefix + "in_proj.weight"]
        self.conv_weight: Array = weights[prefix + "conv1d.weight"][:, 0, :].T.copy()  # [kernel, conv_dim]
        self.conv_bias: Array = weights[prefix + "conv1d.bias"]
        self.dt_bias: Array = weights[prefix + "dt_bias"]
        self.decay_rate: Array = -np.exp(weights[prefix + "A_log"].astype(np.float32))  # A
        self.skip: Array = weights[prefix + "D"]
        self.norm: Array = weights[prefix + "norm.weight"]
        self.out_proj: Array = weights[prefix + "out_proj.weight"]

    def forward(self, h: Array, state: MambaState) -> Array:
        """The layer's output for ``h`` ``[T, hidden]`` following the prefix whose state is ``state`` (updated in
        place to the state after the last token)."""
        shape = self.shape
        tokens = int(h.shape[0])
        projected = h @ self.in_proj.T
        gate = projected[:, : shape.inner]
        conv_input = projected[:, shape.inner : shape.inner + shape.conv_dim]
        dt_raw = projected[:, shape.inner + shape.conv_dim :]
        window = np.concatenate([state.conv, conv_input])  # [kernel - 1 + T, conv_dim]
        kernel = shape.conv_kernel
        convolved = sum(
            (window[k : k + tokens] * self.conv_weight[k] for k in range(kernel)), start=self.conv_bias[None, :]
        )
        activated = _silu(convolved)
        x = activated[:, : shape.inner].reshape(tokens, shape.heads, shape.head_dim)
        per_group = shape.groups * shape.state_size
        heads_per_group = shape.heads // shape.groups
        # B and C per head [T, heads, state_size]: head h reads group h // heads_per_group.
        b_groups = activated[:, shape.inner : shape.inner + per_group].reshape(tokens, shape.groups, -1)
        c_groups = activated[:, shape.inner + per_group :].reshape(tokens, shape.groups, -1)
        b = np.repeat(b_groups, heads_per_group, axis=1)
        c = np.repeat(c_groups, heads_per_group, axis=1)
        dt = _softplus(dt_raw + self.dt_bias)  # [T, heads]
        decay = np.exp(dt * self.decay_rate)
        ssm = state.ssm
        y = np.empty_like(x)
        for t in range(tokens):
            ssm = ssm * decay[t][:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * b[t][:, None, :]
            y[t] = np.einsum("hpn,hn->hp", ssm, c[t])
        y = y + self.skip[:, None] * x
        state.conv = window[tokens : tokens + kernel - 1].copy()
        state.ssm = ssm.astype(np.float32)
        out = self._gated_norm(y.reshape(tokens, shape.inner), gate)
        result: Array = out @ self.out_proj.T
        return result

    def _gated_norm(self, y: Array, gate: Array) -> Array:
        """RMS norm of ``y * silu(gate)`` within each of the ``groups`` slices, then the weight."""
        shape = self.shape
        gated = (y * _silu(gate)).reshape(int(y.shape[0]), shape.groups, -1)
        mean_square = np.mean(gated * gated, axis=-1, keepdims=True, dtype=np.float32)
        scale = np.reciprocal(np.sqrt(mean_square + np.float32(shape.rms_eps)))  # float32 (1.0 / x types float64)
        normed: Array = (gated * scale).reshape(y.shape) * self.norm
        return normed


def _silu(x: Array) -> Array:
    return cast(Array, x / (np.float32(1.0) + np.exp(-x)))


def _softplus(x: Array) -> Array:
    result: Array = np.logaddexp(np.float32(0.0), x).astype(np.float32)
    return result
