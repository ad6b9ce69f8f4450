"""The interface of a shared KV store behind the remote cache tier (Mooncake Store is the real one).

A backend keeps opaque objects under string keys and moves them in batches between the store and host memory the
caller owns (contiguous NumPy ``uint8`` arrays, so zero-copy clients can read and write them in place). The tier
above it builds the keys (content + layout digests), frames every object (size, format version, checksum) and
verifies what comes back, so a backend only moves bytes. What an LMCache or Redis backend needs:

- ``put_batch``: store each object; a key becomes readable only once its object is complete (write, then publish:
  Mooncake's put does this through the master's put-start/put-end; a Redis backend gets it from ``SET`` being
  atomic, a file backend by writing a temporary name and renaming). Storing a key that exists may keep either
  copy: equal keys carry equal content.
- ``get_batch``: copy each object into its buffer and say how many bytes it had; ``MISSING`` when absent,
  ``TOO_LARGE`` when it does not fit the buffer (the tier rejects it as not ours), ``FAILED`` when the store could
  not answer for that key.
- ``exists_batch``, ``remove_batch``, ``close``.
- Raise ``RemoteStoreError`` when the store as a whole cannot be reached: the tier then degrades to misses for a
  while (counted in ``RemoteTierStatistics``), it never fails the manager's call.
- A ``RemoteStoreConfig`` whose ``open(quota)`` connects (``quota``: the bytes this instance lends the store).
"""

from __future__ import annotations

from typing import Final, Protocol

import numpy as np
import numpy.typing as npt
from mypy_extensions import mypyc_attr

HostBuffer = npt.NDArray[np.uint8]

# get_batch results besides a byte count.
MISSING: Final = -1
FAILED: Final = -2
TOO_LARGE: Final = -3


@mypyc_attr(native_class=False)
class RemoteStoreError(RuntimeError):
    """The remote store as a whole could not be reached (down, not set up, timed out)."""


@mypyc_attr(native_class=False)
class RemoteStore(Protocol):
    """A connected client of a shared object store (see the module docstring for the contract)."""

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        """Store ``buffers[i]`` under ``keys[i]``; True where it was stored."""
        raise NotImplementedError

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        """Copy each object into its buffer: bytes copied, ``MISSING``, ``TOO_LARGE`` or ``FAILED`` per key."""
        raise NotImplementedError

    def exists_batch(self, keys: list[str]) -> list[bool]:
        """Whether each key is readable now."""
        raise NotImplementedError

    def remove_batch(self, keys: list[str]) -> list[bool]:
        """Remove each key; True where it was removed."""
        raise NotImplementedError

    def close(self) -> None:
        """Disconnect; objects this client lent memory for may go with it."""
        ...


@mypyc_attr(native_class=False)
class RemoteStoreConfig(Protocol):
    """How to connect to a store: ``KVCacheManager`` calls ``open`` once at construction."""

    def open(self, quota: int) -> RemoteStore:
        """A connected client lending ``quota`` bytes of this process's memory to the store (0: none)."""
        raise NotImplementedError




def answered_lengths(answer: object, count: int) -> tuple[list[int], bool]:
    """A backend's ``get_batch`` answer for ``count`` keys as one result per key, and whether it was well formed
    (one int per key): a missing result or one that is not an int reads as ``FAILED``, so every page fetched is
    accounted for and a malformed answer is a miss, never a crash."""
    results: list[object] = list(answer) if isinstance(answer, (list, tuple)) else []
    lengths = [_as_int(results[index]) if index < len(results) else None for index in range(count)]
    well_formed = len(results) == count and None not in lengths
    return [FAILED if length is None else length for length in lengths], well_formed


def answered_flags(answer: object, count: int) -> tuple[list[bool], list[bool], bool]:
    """A backend's ``exists_batch`` / ``put_batch`` answer for ``count`` keys as one flag per key, whether each
    key's result was a bool, and whether the answer was well formed (one bool per key): a missing result or one
    that is not a bool reads as False."""
    results: list[object] = list(answer) if isinstance(answer, (list, tuple)) else []
    answered = [index < len(results) and isinstance(results[index], (bool, np.bool_)) for index in range(count)]
    flags = [valid and bool(results[index]) for index, valid in enumerate(answered)]
    return flags, answered, len(results) == count and all(answered)


def _as_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)
