"""A ``RemoteStore`` kept in this process's memory: the remote tier's tests and the fuzzer share one between
managers (as instances share a Mooncake Store) without starting a store server."""

from __future__ import annotations

from typing import final

import numpy as np

from .._base.remote_store import MISSING, TOO_LARGE, HostBuffer, RemoteStore
from .._base.types import Sealed


@final
class MemoryStoreConfig(Sealed):
    """Opens clients of one dict of objects: every manager given this config sees the same store. ``restart``
    empties it, as a store server restarted without persistence would be."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def open(self, quota: int) -> RemoteStore:
        """A new client of the shared objects; ``quota`` is not enforced (memory is the test's)."""
        return MemoryStore(self.objects)

    def restart(self) -> None:
        """Forget every object; clients opened before see the empty store too."""
        self.objects.clear()


@final
class MemoryStore(Sealed):
    """A client of a ``MemoryStoreConfig``'s objects (the ``RemoteStore`` contract, every key answered)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        """Store a copy of each buffer under its key (replacing what was there); every put succeeds."""
        for key, buffer in zip(keys, buffers):
            self.objects[key] = buffer.tobytes()
        return [True] * len(keys)

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        """Copy each object into its buffer: its length, ``MISSING`` for an unknown key, ``TOO_LARGE`` where the
        buffer is shorter than the object (left unwritten)."""
        lengths: list[int] = []
        for key, buffer in zip(keys, buffers):
            data = self.objects.get(key)
            if data is None:
                lengths.append(MISSING)
            elif len(data) > buffer.nbytes:
                lengths.append(TOO_LARGE)
            else:
                buffer[: len(data)] = np.frombuffer(data, dtype=np.uint8)
                lengths.append(len(data))
        return lengths

    def exists_batch(self, keys: list[str]) -> list[bool]:
        """Whether each key holds an object."""
        return [key in self.objects for key in keys]

    def remove_batch(self, keys: list[str]) -> list[bool]:
        """Delete each key's object: True where there was one."""
        return [self.objects.pop(key, None) is not None for key in keys]

    def close(self) -> None:
        """Nothing to release: the objects belong to the config, which other clients still share."""
