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
from kv_cache_manager_v2.testing import MemoryStoreConfig
from tests.fuzz.model import FuzzInterrupt

# A batch answered well, one result short, one too many, every key failed, raising, interrupting, or (a get) every
# object read back with a flipped byte: the tier rejects and removes them.
STORE_FAULTS: Final = 7


class FlakyStoreConfig:
    """An in-memory store that answers the next batch calls badly, one armed fault per call (``faults``)."""

    def __init__(self) -> None:
        self.memory: MemoryStoreConfig = MemoryStoreConfig()
        self.faults: list[int] = []

    def open(self, quota: int) -> RemoteStore:
        return FlakyStore(self.memory.open(quota), self)


class FlakyStore:
    def __init__(self, inner: RemoteStore, config: FlakyStoreConfig) -> None:
        self.inner = inner
        self.config = config

    def _answer(
        self, results: list[object], failed: object, read: Sequence[npt.NDArray[np.uint8]] = ()
    ) -> list[object]:
        fault = self.config.faults.pop(0) if self.config.faults else 0
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

    def put_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[bool]:
        stored: list[bool] = self._answer(list(self.inner.put_batch(keys, buffers)), False)  # type: ignore[assignment]
        return stored

    def get_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[int]:
        answer = self._answer(list(self.inner.get_batch(keys, buffers)), -2, buffers)
        lengths: list[int] = answer  # type: ignore[assignment]
        return lengths

    def exists_batch(self, keys: list[str]) -> list[bool]:
        found: list[bool] = self._answer(list(self.inner.exists_batch(keys)), False)  # type: ignore[assignment]
        return found

    def remove_batch(self, keys: list[str]) -> list[bool]:
        removed: list[bool] = self._answer(list(self.inner.remove_batch(keys)), False)  # type: ignore[assignment]
        return removed

    def close(self) -> None:
        self.inner.close()
