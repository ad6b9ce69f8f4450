"""CPU stand-in for TensorRT-LLM's test ``kernels`` module: writes and checks per-token records in host memory.

Upstream fills each (head, token) of a page region with 16-byte records ``(token, layer, buffer, beam)`` in a CUDA
kernel; the cpu backend's pools are host memory, so NumPy does the same over the raw address (same layout: heads
outermost, ``max_num_tokens`` token slots per head). Kernel delays and host gates have nothing to delay on a CPU.

Upstream's FakeEngine checks every history page of every layer at each step (a kernel launch each upstream), so
these run up to millions of times per test, and the Python around each call is what costs. A check reads the region
once (``ctypes.string_at``, one copy per head, or one for all heads when the page is full) and compares it with the
records it must hold, kept per (tokens, layer, buffer, beam): the engine checks the same history pages every step.
"""

from __future__ import annotations

import array
import ctypes
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

RECORD_WORDS = 4  # token, layer, buffer, beam: four uint32 words
RECORD_BYTES = 4 * RECORD_WORDS
TOKEN_MASK = 0xFFFFFFFF
MAX_KEPT_BYTES = 256 << 20  # expected records kept for checks: forget them all past this many bytes
RECORD = struct.Struct("<4I")

# Per (records, layer, buffer, beam, tokens): one head's expected records and all heads' (a full page's).
_expected: dict[tuple[object, ...], tuple[bytes, bytes]] = {}
_kept_bytes = 0


def _token_word(token: object) -> int:
    if type(token) is int:
        return token & TOKEN_MASK
    if isinstance(token, int):
        return int(token) & TOKEN_MASK
    raw = bytes(token) if isinstance(token, (bytes, bytearray)) else bytes(getattr(token, "digest"))
    return int.from_bytes(raw[:4], "little")


def _token_words(tokens: Sequence[object]) -> np.ndarray:
    """Each token's record word, one C loop when all are integers below 2**63 (``array`` refuses anything else,
    bytes included): a partial page's records change at every step, so they are rebuilt there each time."""
    try:
        integers = np.frombuffer(array.array("q", tokens), dtype=np.int64)  # type: ignore[type-var]
    except (TypeError, OverflowError):
        return np.array([_token_word(token) for token in tokens], dtype=np.uint32)
    return (integers & TOKEN_MASK).astype(np.uint32)


def _memory(address: int, num_bytes: int) -> memoryview:
    """Host memory at a raw address as a buffer NumPy can view without copying (it neither owns nor pins it)."""
    return memoryview((ctypes.c_char * num_bytes).from_address(address)).cast("B")


def _expected_records(
    tokens: Sequence[object], num_heads: int, records: int, layer: int, buf_id: int, beam: int
) -> tuple[bytes, bytes]:
    """One head's records for ``tokens`` and the same for ``num_heads`` heads, kept while they fit."""
    global _kept_bytes
    key = (num_heads, records, layer, buf_id, beam, *tokens)
    try:
        expected = _expected.get(key)
    except TypeError:  # an unhashable token: nothing to keep
        return _make_records(tokens, num_heads, records, layer, buf_id, beam)
    if expected is None:
        expected = _make_records(tokens, num_heads, records, layer, buf_id, beam)
        if _kept_bytes >= MAX_KEPT_BYTES:
            _expected.clear()
            _kept_bytes = 0
        _expected[key] = expected
        _kept_bytes += len(expected[0]) + len(expected[1])
    return expected


def _make_records(
    tokens: Sequence[object], num_heads: int, records: int, layer: int, buf_id: int, beam: int
) -> tuple[bytes, bytes]:
    words = np.empty((len(tokens), records, RECORD_WORDS), dtype=np.uint32)
    words[:, :, 0] = _token_words(tokens)[:, None]
    words[:, :, 1:] = (layer, buf_id, beam)
    head = words.tobytes()
    return head, head * num_heads


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
    if not count:
        return
    records = bytes_per_head // RECORD_BYTES
    assert records * RECORD_BYTES == bytes_per_head, f"{bytes_per_head} bytes per head is not whole records"
    head, every_head = _expected_records(tokens, num_heads, records, layer, buf_id, beam)
    head_stride = max_num_tokens * bytes_per_head
    if count == max_num_tokens:
        matches = ctypes.string_at(address, len(every_head)) == every_head
    else:
        matches = all(
            ctypes.string_at(address + index * head_stride, len(head)) == head for index in range(num_heads)
        )
    if not matches:
        memory = _memory(address, num_heads * head_stride)
        records_seen = np.ndarray((num_heads, max_num_tokens, records, RECORD_WORDS), np.uint32, memory)[:, :count]
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
