"""CPU stand-in for TensorRT-LLM's test ``kernels`` module: writes and checks per-token records in host memory.

Upstream fills each (head, token) of a page region with 16-byte records ``(token, layer, buffer, beam)`` in a CUDA
kernel; the cpu backend's pools are host memory, so NumPy does the same over the raw address (same layout: heads
outermost, ``max_num_tokens`` token slots per head). Kernel delays and host gates have nothing to delay on a CPU.

Upstream's FakeEngine checks every history page of every layer at each step (a kernel launch each upstream), so
these run up to millions of times per test, and the Python around each call is what costs. A check compares every
word of the region as two byte strings: the token words (the same run of tokens is checked in every layer and
buffer, so its expected bytes are kept per run) and the (layer, buffer, beam) words (one 12-byte pattern repeated).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt

RECORD_WORDS = 4  # token, layer, buffer, beam: four uint32 words
RECORD_BYTES = 4 * RECORD_WORDS
TOKEN_MASK = 0xFFFFFFFF
MAX_KEPT_VIEWS = 1 << 16  # a view is ~200 bytes: forget them all past this many (each test has new pools)
MAX_KEPT_RUN_BYTES = 64 << 20  # expected token words kept per run of tokens: forget them all past this many bytes
RECORD = struct.Struct("<4I")
TAG = struct.Struct("<3I")  # a record's layer, buffer, beam words
TAG_WORDS = np.dtype("V12")

RegionKey = tuple[int, int, int, int]
U32 = npt.NDArray[np.uint32]
# Per region: its token words ``(heads, max_num_tokens, records)`` and tag words (one 12-byte item per record).
_planes: dict[RegionKey, tuple[U32, npt.NDArray[np.void]]] = {}
# Per (heads, records, tokens): the token-word bytes a check expects.
_runs: dict[tuple[int, int, tuple[object, ...]], bytes] = {}
_kept_run_bytes = 0


def _token_word(token: object) -> int:
    if type(token) is int:
        return token & TOKEN_MASK
    if isinstance(token, int):
        return int(token) & TOKEN_MASK
    raw = bytes(token) if isinstance(token, (bytes, bytearray)) else bytes(getattr(token, "digest"))
    return int.from_bytes(raw[:4], "little")


def _memory(address: int, num_bytes: int) -> memoryview:
    """Host memory at a raw address as a buffer NumPy can view without copying (it neither owns nor pins it)."""
    return memoryview((ctypes.c_char * num_bytes).from_address(address)).cast("B")


def _region(address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int) -> tuple[U32, npt.NDArray[np.void]]:
    """Token-word and tag-word views of the ``(num_heads, max_num_tokens, records)`` records at ``address``; a kept
    view is as valid as a new one for any address the engine computes."""
    key = (address, bytes_per_head, num_heads, max_num_tokens)
    planes = _planes.get(key)
    if planes is None:
        records = bytes_per_head // RECORD_BYTES
        assert records * RECORD_BYTES == bytes_per_head, f"{bytes_per_head} bytes per head is not whole records"
        shape = (num_heads, max_num_tokens, records)
        strides = (max_num_tokens * bytes_per_head, bytes_per_head, RECORD_BYTES)
        memory = _memory(address, num_heads * max_num_tokens * bytes_per_head)
        token_words: U32 = np.ndarray(shape, np.uint32, memory, 0, strides)
        tag_words: npt.NDArray[np.void] = np.ndarray(shape, TAG_WORDS, memory, 4, strides)
        planes = (token_words, tag_words)
        if len(_planes) >= MAX_KEPT_VIEWS:
            _planes.clear()
        _planes[key] = planes
    return planes


def _token_bytes(tokens: Sequence[object], num_heads: int, records: int) -> bytes:
    """The token words of ``num_heads`` x ``tokens`` x ``records`` records, kept per run: every layer and buffer
    checks the same pages."""
    global _kept_run_bytes
    key = (num_heads, records, tuple(tokens))
    try:
        expected = _runs.get(key)
    except TypeError:  # an unhashable token: nothing to keep
        return _make_token_bytes(tokens, num_heads, records)
    if expected is None:
        expected = _make_token_bytes(tokens, num_heads, records)
        if _kept_run_bytes >= MAX_KEPT_RUN_BYTES:
            _runs.clear()
            _kept_run_bytes = 0
        _runs[key] = expected
        _kept_run_bytes += len(expected)
    return expected


def _make_token_bytes(tokens: Sequence[object], num_heads: int, records: int) -> bytes:
    column = np.array([_token_word(token) for token in tokens], dtype=np.uint32).reshape(-1, 1)
    return np.broadcast_to(column, (num_heads, len(tokens), records)).tobytes()


def fill_values(
    address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int, layer: int, buf_id: int, beam: int,
    tokens: Sequence[object], stream: int,
) -> None:
    """Writes through ``memmove``, not a view: each fill starts at its own token's address, so views would not be
    reused."""
    if tokens:
        records = bytes_per_head // RECORD_BYTES
        assert records * RECORD_BYTES == bytes_per_head, f"{bytes_per_head} bytes per head is not whole records"
        head = b"".join([RECORD.pack(_token_word(token), layer, buf_id, beam) * records for token in tokens])
        for index in range(num_heads):
            ctypes.memmove(address + index * max_num_tokens * bytes_per_head, head, len(head))


def check_values(
    address: int, bytes_per_head: int, num_heads: int, max_num_tokens: int, layer: int, buf_id: int, beam: int,
    tokens: Sequence[object], stream: int,
) -> None:
    count = len(tokens)
    if count:
        token_words, tag_words = _region(address, bytes_per_head, num_heads, max_num_tokens)
        records = token_words.shape[2]
        if (
            token_words[:, :count].tobytes() != _token_bytes(tokens, num_heads, records)
            or tag_words[:, :count].tobytes() != TAG.pack(layer, buf_id, beam) * (num_heads * count * records)
        ):
            records_seen = np.ndarray(
                (num_heads, max_num_tokens, records, RECORD_WORDS), np.uint32,
                _memory(address, num_heads * max_num_tokens * bytes_per_head),
            )[:, :count]
            expected = np.array([(_token_word(token), layer, buf_id, beam) for token in tokens], dtype=np.uint32)
            wrong = int(np.argmin((records_seen == expected[:, None, :]).all(axis=(0, 2, 3))))
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
