"""Layer configs: which buffers each layer keeps per block (attention) or per state (SSM).

The manager groups layers by these shapes into layer groups and pool groups; each class checks its own fields at
construction and names the field and value it refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence, final

from mypy_extensions import mypyc_attr

from .._base.validation import check_iterable, coerce_fields, refuse_subclass


@final
@mypyc_attr(native_class=False)
@dataclass
class BufferConfig:
    """One buffer of a layer: ``size`` bytes per block (``tokens_per_block`` tokens), or per state for SSM.

    With ``tokens_per_block_override`` the buffer is paged in pages of that many tokens and ``size`` is the bytes
    of one such page (as in TensorRT-LLM): a block then holds ``tokens_per_block / override`` of them."""

    role: str
    size: int
    tokens_per_block_override: int | None = None

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "BufferConfig")

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("size",), optional_ints=("tokens_per_block_override",), strs=("role",))
        if not self.role:
            raise ValueError("BufferConfig.role must be a non-empty string")
        if self.size <= 0:
            raise ValueError(f"BufferConfig.size must be > 0, got {self.size} for role {self.role!r}")
        override = self.tokens_per_block_override
        if override is not None and override <= 0:
            raise ValueError(f"BufferConfig.tokens_per_block_override must be > 0, got {override}")


def _check_buffers(layer_id: int, buffers: Sequence[BufferConfig], kind: str) -> tuple[BufferConfig, ...]:
    check_iterable(buffers, f"{kind}.buffers")
    result = tuple(buffers)
    if not result:
        raise ValueError(f"{kind}.buffers of layer {layer_id} must not be empty")
    roles: set[str] = set()
    for buffer in result:
        if not isinstance(buffer, BufferConfig):
            raise TypeError(f"{kind}.buffers of layer {layer_id} must hold BufferConfig, got {buffer!r}")
        if buffer.role in roles:
            raise ValueError(f"{kind}.buffers of layer {layer_id}: duplicate role {buffer.role!r}")
        roles.add(buffer.role)
    return result


@final
@mypyc_attr(native_class=False)
@dataclass
class AttentionLayerConfig:
    """An attention layer; ``sliding_window_size=None`` means full attention. Sink tokens need a window.

    With a window ``W`` and ``S`` sink tokens, the query at position ``p`` sees the keys ``j <= p`` with
    ``j > p - W`` or ``j < S`` (``W`` keys, itself included, plus the sinks). A step whose history is ``h`` therefore
    needs the keys from ``h + 1 - W`` on: the pages of whole blocks before that (sink blocks excepted) are released
    at ``resize``/``commit``, and ``KVCache.get_base_page_indices`` answers ``BAD_PAGE_INDEX`` for them."""

    layer_id: int
    buffers: Sequence[BufferConfig]
    sliding_window_size: int | None = None
    num_sink_tokens: int | None = None

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "AttentionLayerConfig")

    @property
    def window_size(self) -> int | None:
        """``sliding_window_size`` (TensorRT-LLM's name for it)."""
        return self.sliding_window_size

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("layer_id",), optional_ints=("sliding_window_size", "num_sink_tokens"))
        self.buffers = _check_buffers(self.layer_id, self.buffers, "AttentionLayerConfig")
        window = self.sliding_window_size
        if window is not None and window <= 0:
            raise ValueError(f"AttentionLayerConfig.sliding_window_size must be > 0, got {window}")
        sinks = self.num_sink_tokens
        if sinks is not None:
            if sinks < 0:
                raise ValueError(f"AttentionLayerConfig.num_sink_tokens must be >= 0, got {sinks}")
            if sinks > 0 and window is None:
                raise ValueError(
                    f"AttentionLayerConfig.num_sink_tokens={sinks} of layer {self.layer_id} requires a "
                    "sliding_window_size"
                )


@final
@mypyc_attr(native_class=False)
@dataclass
class SsmLayerConfig:
    """A Mamba/SSM layer; each buffer's ``size`` is the bytes of one state (e.g. roles ssm_state, conv_state)."""

    layer_id: int
    buffers: Sequence[BufferConfig]

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "SsmLayerConfig")

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("layer_id",))
        self.buffers = _check_buffers(self.layer_id, self.buffers, "SsmLayerConfig")
        for buffer in self.buffers:
            if buffer.tokens_per_block_override is not None:
                raise ValueError(
                    f"SsmLayerConfig layer {self.layer_id} buffer {buffer.role!r}: tokens_per_block_override "
                    "is not allowed on SSM buffers"
                )


LayerConfig = AttentionLayerConfig | SsmLayerConfig


def revalidated_layer(layer: object) -> object:
    """A copy of a layer config (and its buffers) built through their checks again; anything else is left for the
    whole-config check to name."""
    if isinstance(layer, (AttentionLayerConfig, SsmLayerConfig)):
        buffers = [replace(buffer) if isinstance(buffer, BufferConfig) else buffer for buffer in layer.buffers]
        return replace(layer, buffers=buffers)
    return layer
