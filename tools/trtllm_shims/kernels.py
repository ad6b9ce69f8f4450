"""CPU stand-in for TensorRT-LLM's test ``kernels`` module: writes and checks per-token records in host memory.

Upstream fills each (head, token) of a page region with 16-byte records ``(token, layer, buffer, beam)`` in a CUDA
kernel; the cpu backend's pools are host memory, so NumPy does the same over the raw address (same layout: heads
outermost, ``max_num_tokens`` token slots per head). Kernel delays and host gates have nothing to delay on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt

RECORD_WORDS = 4  # token, layer, buffer, beam: four uint32 words


def _token_word(token: object) -> int:
    if isinstance(token, int):
        return token & 0xFFFFFFFF
    raw = bytes(token) if isinstance(token, (bytes, bytearray)) else bytes(getattr(token, "digest"))
    return int.from_bytes(raw[:4], "little")


def _region(address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int) -> npt.NDArray[np.uint32]:
    records = bytes_per_head // (4 * RECORD_WORDS)
    assert records * 4 * RECORD_WORDS == bytes_per_head, f"{bytes_per_head} bytes per head is not whole records"
    shape = (num_heads, max_num_tokens, records, RECORD_WORDS)
    return np.asarray(_RawMemory(address, shape))


class _RawMemory:
    """Host memory at a raw address, seen by NumPy as a uint32 array without copying."""

    def __init__(self, address: int, shape: tuple[int, ...]) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": shape, "typestr": "<u4", "version": 3}


def _expected(layer: int, buf_id: int, beam: int, tokens: Sequence[object]) -> npt.NDArray[np.uint32]:
    rows = np.empty((len(tokens), RECORD_WORDS), dtype=np.uint32)
    rows[:, 0] = [_token_word(token) for token in tokens]
    rows[:, 1:] = (layer, buf_id, beam)
    return rows


def fill_values(
    address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int, layer: int, buf_id: int, beam: int,
    tokens: Sequence[object], stream: int,
) -> None:
    if tokens:
        view = _region(address, bytes_per_head, num_heads, max_num_tokens)[:, : len(tokens)]
        view[...] = _expected(layer, buf_id, beam, tokens)[None, :, None, :]


def check_values(
    address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int, layer: int, buf_id: int, beam: int,
    tokens: Sequence[object], stream: int,
) -> None:
    if tokens:
        view = _region(address, bytes_per_head, num_heads, max_num_tokens)[:, : len(tokens)]
        wrong = np.argwhere((view != _expected(layer, buf_id, beam, tokens)[None, :, None, :]).any(axis=(0, 2, 3)))
        assert wrong.size == 0, f"layer {layer} buffer {buf_id}: token slot {int(wrong[0][0])} holds other data"


@contextmanager
def enable_kernel_delay() -> Iterator[None]:
    """Upstream slows its kernels to widen race windows; CPU copies have no window to widen."""
    yield


class HostGate:
    """Upstream holds a stream busy until the host releases it; a cpu stream never waits, so this blocks nothing."""

    def block_stream(self, stream: int, max_iters: int = 100_000) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass
