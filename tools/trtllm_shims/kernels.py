"""CPU stand-in for TensorRT-LLM's test ``kernels`` module: writes and checks per-token records in host memory.

Upstream fills each (head, token) of a page region with 16-byte records ``(token, layer, buffer, beam)`` in a CUDA
kernel; the cpu backend's pools are host memory, so NumPy does the same over the raw address (same layout: heads
outermost, ``max_num_tokens`` token slots per head). Kernel delays and host gates have nothing to delay on a CPU.

Upstream's FakeEngine checks every history page of every layer at each decode step (a kernel launch each upstream),
so these run hundreds of thousands of times per test: each call is a few whole-array NumPy operations, and the views
of raw memory are kept per region (making one costs more than the check itself).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt

RECORD_WORDS = 4  # token, layer, buffer, beam: four uint32 words
TOKEN_MASK = 0xFFFFFFFF
MAX_KEPT_VIEWS = 1 << 16  # a view is ~200 bytes: forget them all past this many (each test has new pools)

RegionKey = tuple[int, int, int, int]
_views: dict[RegionKey, npt.NDArray[np.uint32]] = {}
MAX_KEPT_WORD_RUNS = 1 << 14  # token runs (a page's tokens at most) whose record words are kept
_words: dict[tuple[object, ...], npt.NDArray[np.uint32]] = {}


def _token_word(token: object) -> int:
    if type(token) is int:
        return token & TOKEN_MASK
    if isinstance(token, int):
        return int(token) & TOKEN_MASK
    raw = bytes(token) if isinstance(token, (bytes, bytearray)) else bytes(getattr(token, "digest"))
    return int.from_bytes(raw[:4], "little")


def _region(address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int) -> npt.NDArray[np.uint32]:
    """``(num_heads, max_num_tokens, records, RECORD_WORDS)`` uint32 view of host memory at ``address``; a view
    does not own or pin the memory, so a kept one is as valid as a new one for any address the engine computes."""
    key = (address, bytes_per_head, num_heads, max_num_tokens)
    view = _views.get(key)
    if view is None:
        records = bytes_per_head // (4 * RECORD_WORDS)
        assert records * 4 * RECORD_WORDS == bytes_per_head, f"{bytes_per_head} bytes per head is not whole records"
        shape = (num_heads, max_num_tokens, records, RECORD_WORDS)
        view = np.asarray(_RawMemory(address, shape))
        if len(_views) >= MAX_KEPT_VIEWS:
            _views.clear()
        _views[key] = view
    return view


class _RawMemory:
    """Host memory at a raw address, seen by NumPy as a uint32 array without copying."""

    def __init__(self, address: int, shape: tuple[int, ...]) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": shape, "typestr": "<u4", "version": 3}


def _token_words(tokens: Sequence[object]) -> npt.NDArray[np.uint32]:
    """Each token's first record word; kept per token run, since every layer and buffer checks the same pages."""
    key = tuple(tokens)
    try:
        words = _words.get(key)
    except TypeError:  # an unhashable token: nothing to keep
        words = None
    if words is None:
        words = np.array([token & TOKEN_MASK if type(token) is int else _token_word(token) for token in tokens],
                         dtype=np.uint32)
        if len(_words) >= MAX_KEPT_WORD_RUNS:
            _words.clear()
        try:
            _words[key] = words
        except TypeError:
            pass
    return words


def _expected(layer: int, buf_id: int, beam: int, tokens: Sequence[object]) -> npt.NDArray[np.uint32]:
    """``(len(tokens), 1, RECORD_WORDS)``: each token's record, broadcast over a region's heads and records."""
    rows = np.empty((len(tokens), 1, RECORD_WORDS), dtype=np.uint32)
    rows[:, 0, 0] = _token_words(tokens)
    rows[:, 0, 1:] = (layer, buf_id, beam)
    return rows


def fill_values(
    address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int, layer: int, buf_id: int, beam: int,
    tokens: Sequence[object], stream: int,
) -> None:
    if tokens:
        view = _region(address, bytes_per_head, num_heads, max_num_tokens)[:, : len(tokens)]
        view[...] = _expected(layer, buf_id, beam, tokens)


def check_values(
    address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int, layer: int, buf_id: int, beam: int,
    tokens: Sequence[object], stream: int,
) -> None:
    if tokens:
        view = _region(address, bytes_per_head, num_heads, max_num_tokens)[:, : len(tokens)]
        matches = view == _expected(layer, buf_id, beam, tokens)
        if not matches.all():
            wrong = int(np.argwhere(~matches.all(axis=(0, 2, 3)))[0][0])
            raise AssertionError(f"layer {layer} buffer {buf_id}: token slot {wrong} holds other data")


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
