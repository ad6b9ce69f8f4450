"""A remote store that answers badly on demand, for the ``remote_fills`` config and the ``store_fault`` /
``restart_store`` operations.

Its config's GPU tier is small, so fetching into it evicts (and used to prune the blocks being filled, issue #35);
content fetched back is checked by the FakeEngine that wrote it.
"""

from __future__ import annotations

from typing import Final, Sequence

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import RemoteStore, RemoteStoreError
from kv_cache_manager_v2._remote.mooncake import MooncakeStore
from kv_cache_manager_v2.testing import MemoryStoreConfig
from tests.fuzz.model import FuzzInterrupt
from tests.fuzz.stalled_transfers import StallingClient, stalling_store

# A batch answered well, one result short, one too many, every key failed, raising, interrupting, (a get) every
# object read back with a flipped byte: the tier rejects and removes them, or (the next get, the next put) a
# transfer past its deadline, completed late (``stalled_transfers``), or every other key of the next call lost
# (``LOSE_EVERY_OTHER``).
STALL_GET: Final = 7
STALL_PUT: Final = 8
# The store loses every other key of the call (an eviction, a storage node gone): after a put, pages it stored; after
# a probe, objects it found, so the get that follows misses them; before a get, objects the probe found. Keys go by
# block, then layer group, so a fill then has holes inside its chain, in one layer group's pages and not another's
# (an SSM snapshot kept, the KV before it lost).
LOSE_EVERY_OTHER: Final = 9
STORE_FAULTS: Final = 10


class FlakyStoreConfig:
    """An in-memory store that answers the next batch calls badly, one armed fault per call (``faults``)."""

    def __init__(self) -> None:
        self.memory: MemoryStoreConfig = MemoryStoreConfig()
        self.faults: list[int] = []
        self.clients: list[StallingClient] = []  # every client's, for ``problems``

    def open(self, quota: int) -> RemoteStore:
        return FlakyStore(self.memory.open(quota), self)

    def problems(self) -> list[str]:
        """What late transfers did wrong: one touching a buffer freed meanwhile, a put storing other bytes."""
        return [problem for client in self.clients for problem in client.problems]


class FlakyStore:
    def __init__(self, inner: RemoteStore, config: FlakyStoreConfig) -> None:
        self.inner = inner
        self.config = config
        # A stalled call goes through the real MooncakeStore, over an in-memory Mooncake client of the same objects.
        self.mooncake: MooncakeStore | None
        self.mooncake, self.client = stalling_store(config.memory.objects)
        config.clients.append(self.client)

    def _stalls(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]], put: bool) -> MooncakeStore | None:
        """The store for a put or get: the stalling one, armed, when the next fault stalls this call."""
        faults = self.config.faults
        if not faults or faults[0] != (STALL_PUT if put else STALL_GET) or self.mooncake is None:
            return None
        self.config.faults.pop(0)
        self.client.arm(keys, buffers, put)
        return self.mooncake

    def _answer(
        self, results: list[object], failed: object, read: Sequence[npt.NDArray[np.uint8]] = ()
    ) -> list[object]:
        faults = self.config.faults
        fault = faults.pop(0) if faults and faults[0] not in (STALL_GET, STALL_PUT) else 0  # a stall waits for its call
        if fault == 6:
            for buffer in read:
                buffer[-1] ^= 1
        if fault == 1:
            return results[:-1]
        if fault == 2:
            return results + results[:1]
        if fault == 3:
            return [failed] * len(results)
        if fault == 4:
            raise RemoteStoreError("the fuzzer's store is down for this call")
        if fault == 5:
            raise FuzzInterrupt("the fuzzer's store interrupts this call")
        return results

    def _loses(self) -> bool:
        """Whether this call's keys are half lost once the store answered it (``LOSE_EVERY_OTHER`` armed next)."""
        faults = self.config.faults
        if not faults or faults[0] != LOSE_EVERY_OTHER:
            return False
        faults.pop(0)
        return True

    def put_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[bool]:
        stalling = self._stalls(keys, buffers, True)
        if stalling is not None:
            return stalling.put_batch(keys, buffers)  # raises RemoteStoreError past its deadline
        loses = self._loses()
        stored: list[bool] = self._answer(list(self.inner.put_batch(keys, buffers)), False)  # type: ignore[assignment]
        if loses:
            self.inner.remove_batch(keys[1::2])
        return stored

    def get_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[int]:
        stalling = self._stalls(keys, buffers, False)
        if stalling is not None:
            return stalling.get_batch(keys, buffers)
        if self._loses():  # lost between the probe that found them and this read
            self.inner.remove_batch(keys[1::2])
        answer = self._answer(list(self.inner.get_batch(keys, buffers)), -2, buffers)
        lengths: list[int] = answer  # type: ignore[assignment]
        return lengths

    def exists_batch(self, keys: list[str]) -> list[bool]:
        """Calls stalled before complete first: a late put's object appears after its caller was told it failed,
        the next probe may find it. One still stalled at ``close`` completes after it."""
        self.client.complete_late()
        loses = self._loses()
        found: list[bool] = self._answer(list(self.inner.exists_batch(keys)), False)  # type: ignore[assignment]
        if loses:
            self.inner.remove_batch(keys[1::2])
        return found

    def remove_batch(self, keys: list[str]) -> list[bool]:
        removed: list[bool] = self._answer(list(self.inner.remove_batch(keys)), False)  # type: ignore[assignment]
        return removed

    def close(self) -> None:
        """Closes the stalling store with calls still stalled (its wait is bounded), drops it, then lets them complete:
        what they touch must have outlived the store."""
        if self.mooncake is not None:
            self.mooncake.close()
            self.mooncake = None
        self.client.complete_late()
        assert self.client.closed.wait(5.0), "the stalling store never closed its client"
        self.inner.close()
