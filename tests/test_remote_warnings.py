"""The remote tier's warnings count in English: a store that refuses puts, answers a batch with the wrong number
of results, or fails a call, is named with its figures, singular for one ("refused 1 of 1 page", "answered 1 key",
"storing 1 page failed")."""

from __future__ import annotations

import logging

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, RemoteCacheTierConfig
from kv_cache_manager_v2._base.remote_store import HostBuffer, RemoteStore, RemoteStoreConfig, RemoteStoreError
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import MemoryStoreConfig
from tests.forwarding_store import ForwardingStore
from tests.fuzz.checks import COUNTED
from tests.helpers import KIB, attention, make_config, seeded_prompt

TPB = 32
LOGGER = "kv_cache_manager_v2"


class RefusingStoreConfig:
    """An in-memory store whose puts all fail (a full store), or whose puts answer one result too few."""

    def __init__(self, short_answer: bool) -> None:
        self.memory = MemoryStoreConfig()
        self.short_answer = short_answer

    def open(self, quota: int) -> RemoteStore:
        return RefusingStore(self.memory.open(quota), self.short_answer)


class RefusingStore(ForwardingStore):
    def __init__(self, inner: RemoteStore, short_answer: bool) -> None:
        super().__init__(inner)
        self.short_answer = short_answer

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        return [True] * (len(keys) - 1) if self.short_answer else [False] * len(keys)


def _warnings(caplog: pytest.LogCaptureFixture, blocks: int, short_answer: bool) -> list[str]:
    """The remote tier's warnings while a prompt of ``blocks`` full blocks is computed and committed, written
    back to the store at shutdown."""
    remote = RemoteCacheTierConfig(0, RefusingStoreConfig(short_answer), namespace="warnings")
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(64 * 16 * KIB), remote]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    tokens = seeded_prompt(5, blocks * TPB)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        cache.close()
        manager.shutdown()
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith("remote tier:")]


@pytest.mark.parametrize("blocks", [1, 2])
def test_refused_puts_are_counted_in_english(caplog: pytest.LogCaptureFixture, blocks: int) -> None:
    """Before: "the store refused 1 of 1 page(s)"."""
    refused = [message for message in _warnings(caplog, blocks, False) if "refused" in message]
    assert refused, caplog.text
    for message in refused:
        counts = [(int(match.group(1)), match.group(2), bool(match.group(3))) for match in COUNTED.finditer(message)]
        assert counts == [(blocks, "page", blocks != 1)] and "(s)" not in message, message


def test_a_short_answer_is_counted_in_english(caplog: pytest.LogCaptureFixture) -> None:
    """Puts answered one result short, for a batch of 2 keys and of 1: each warning counts its batch. Before:
    "the store's put_batch answered 1 key(s) with []"."""
    malformed = [message for message in _warnings(caplog, 2, True) if " answered " in message]
    counts = {
        (int(match.group(1)), match.group(2), bool(match.group(3)))
        for message in malformed for match in COUNTED.finditer(message)
    }
    assert {(1, "key", False), (2, "key", True)} <= counts, malformed
    assert all(plural == (count != 1) for count, _, plural in counts), malformed
    assert not any("(s)" in message for message in malformed), malformed


class FailingStoreConfig:
    """A client of ``memory`` whose ``failing`` call raises; for "remove", its gets also flip each object's last
    byte, so every fetched object is rejected and its removal is asked for (and fails)."""

    def __init__(self, memory: MemoryStoreConfig, failing: str) -> None:
        self.memory = memory
        self.failing = failing

    def open(self, quota: int) -> RemoteStore:
        return FailingStore(self.memory.open(quota), self.failing)


class FailingStore(ForwardingStore):
    def __init__(self, inner: RemoteStore, failing: str) -> None:
        super().__init__(inner)
        self.failing = failing

    def _maybe_fail(self, call: str) -> None:
        if call == self.failing:
            raise RemoteStoreError(f"{call} is down")

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        self._maybe_fail("put")
        return self.inner.put_batch(keys, buffers)

    def exists_batch(self, keys: list[str]) -> list[bool]:
        self._maybe_fail("exists")
        return self.inner.exists_batch(keys)

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        self._maybe_fail("get")
        lengths = self.inner.get_batch(keys, buffers)
        if self.failing == "remove":
            for buffer, length in zip(buffers, lengths):
                buffer[length - 1] ^= 0xFF
        return lengths

    def remove_batch(self, keys: list[str]) -> list[bool]:
        self._maybe_fail("remove")
        return self.inner.remove_batch(keys)


FAILED_CALLS = {"put": "storing {}", "exists": "probing {}", "get": "fetching {}", "remove": "removing {}"}
NOUNS = {"put": "page", "exists": "key", "get": "page", "remove": "rejected object"}


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("failing", list(FAILED_CALLS))
def test_a_failed_store_call_is_counted_in_english(caplog: pytest.LogCaptureFixture, failing: str, blocks: int) -> None:
    """A prompt of ``blocks`` full blocks (one layer: one page, one key and one object each) stored by one instance,
    then looked up by another whose store fails ``failing`` (the storing instance's, for "put"): the warning counts
    the batch, singular for one. Before: "storing 1 page(s) failed", "probing 1 key(s)", "fetching 1 page(s)",
    "removing 1 rejected object(s)"."""
    memory = MemoryStoreConfig()

    def manager(store: RemoteStoreConfig) -> KVCacheManager:
        remote = RemoteCacheTierConfig(0, store, namespace="failing")
        tiers: list[CacheTierConfig] = [GpuCacheTierConfig(64 * 16 * KIB), remote]
        return KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))

    tokens = seeded_prompt(7, blocks * TPB)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        writer = manager(FailingStoreConfig(memory, failing) if failing == "put" else memory)
        cache = writer.create_kv_cache()
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        cache.close()
        writer.shutdown()
        if failing != "put":
            assert len(memory.objects) == blocks
            reader = manager(FailingStoreConfig(memory, failing))
            reader.create_kv_cache(None, tokens + [1]).close()
            reader.shutdown()
    noun = NOUNS[failing] if blocks == 1 else NOUNS[failing] + "s"
    expected = FAILED_CALLS[failing].format(f"{blocks} {noun}") + " failed: "
    failures = [record.getMessage() for record in caplog.records if " failed: " in record.getMessage()]
    assert any(expected in message for message in failures), (expected, failures)
    assert not any("(s)" in message for message in failures), failures
