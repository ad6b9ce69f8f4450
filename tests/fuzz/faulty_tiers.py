"""Faults below the manager, provoked for real: a disk tier's pool file replaced, for a while, by another file
behind the process's own descriptors (reads and writes then fail or come back short), and a cold-page codec that
raises on its next calls. Used by ``tests/test_disk_faults.py``, ``tests/test_codec_faults.py`` and the fuzzer's
``disk_fault`` / ``codec_fault`` operations."""

from __future__ import annotations

import contextlib
import os
from typing import Final, Iterator, Mapping

from kv_cache_manager_v2._storage.page_codec import PaddingColdPageCodec
from tests.fuzz.model import FuzzInterrupt

DISK_FAULTS: Final = 2  # the pool files unreadable (writes land), or unwritable as well (a full device)


def pool_descriptors() -> list[int]:
    """This process's descriptors of disk tier pool files (the tier's own and its mapping's duplicate)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if "kv_cache_manager_v2-" in target and ".pool" in target:
                found.append(int(name))
    return found


@contextlib.contextmanager
def pool_files_replaced(path: str | None, flags: int) -> Iterator[None]:
    """Every pool file descriptor refers meanwhile to ``path`` opened with ``flags``, or (``path`` None) to its
    own file opened again with ``flags``: ``O_WRONLY`` makes reads fail and writes still land, ``O_RDONLY`` the
    reverse. The original descriptions come back afterwards."""
    descriptors = pool_descriptors()
    assert descriptors, "no disk tier pool file is open"
    saved = [os.dup(fd) for fd in descriptors]
    try:
        for fd in descriptors:
            other = os.open(f"/proc/self/fd/{fd}" if path is None else path, flags)
            os.dup2(other, fd)
            os.close(other)
        yield
    finally:
        for fd, original in zip(descriptors, saved):
            os.dup2(original, fd)
            os.close(original)


@contextlib.contextmanager
def pool_files_cut() -> Iterator[None]:
    """Every pool file cut to nothing meanwhile (a reader of its mapping would die of SIGBUS), then given back its
    length (zeros: what it held is gone)."""
    descriptors = pool_descriptors()
    assert descriptors, "no disk tier pool file is open"
    sizes = [os.fstat(fd).st_size for fd in descriptors]
    for fd in descriptors:
        os.ftruncate(fd, 0)
    try:
        yield
    finally:
        for fd, size in zip(descriptors, sizes):
            os.ftruncate(fd, size)


def disk_fault(kind: int) -> contextlib.AbstractContextManager[None]:
    """Kind 0: reads fail (EBADF), writes land; kind 1: writes fail (ENOSPC: ``/dev/full``) and reads too."""
    return pool_files_replaced(None, os.O_WRONLY) if kind == 0 else pool_files_replaced("/dev/full", os.O_WRONLY)


class FlakyCodec(PaddingColdPageCodec):
    """The padding codec, raising on its next ``failures`` calls (encode or decode), then interrupting its next
    ``interrupts`` calls (``FuzzInterrupt``, as a Ctrl-C would)."""

    def __init__(self, encoded_bytes: Mapping[int, int]) -> None:
        super().__init__(encoded_bytes)
        self.failures = 0
        self.interrupts = 0

    def _fail(self) -> None:
        if self.interrupts > 0 and self.failures == 0:
            self.interrupts -= 1
            raise FuzzInterrupt("the fuzzer's codec interrupts this call")
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("the fuzzer's codec fails this call")

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        self._fail()
        super().encode(layer_group_id, pages, encoded)

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        self._fail()
        super().decode(layer_group_id, encoded, pages)
