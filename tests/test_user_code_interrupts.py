"""User code that raises a ``BaseException`` which is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, a
class of its own) in the middle of a manager call: a cold-page codec, a remote store, an event-manager hook, a
priority callback.

Such code's ``Exception`` degrades where it is caught (a lost page, a miss, a hook error for the next flush); the
interrupt used to go straight through, stopping the call half way (pages served without their bytes, locks never
filed, fetched pages left claimed). Now it is degraded the same way and comes out when the call ends
(``DeferredInterrupts``): the call completed (or, for a priority callback, asked while planning, changed nothing),
the invariants hold and the manager goes on serving correct content (the FakeEngine checks every reused token)."""

from __future__ import annotations

import gc

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    KVCache,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheRequest,
    LifeCycle,
    Priority,
    RemoteCacheTierConfig,
    RemoteStore,
)
from kv_cache_manager_v2._storage.page_codec import PaddingColdPageCodec
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.helpers import KIB, attention, make_config, seeded_prompt, serve_checked

TPB = 32
KV = 4 * KIB
BLOCKS = 4


class Interrupt(BaseException):
    """What user code raises here: like ``KeyboardInterrupt``, not an ``Exception``."""


def serve(manager: KVCacheManager, engine: FakeEngine, seed: int) -> None:
    serve_checked(manager, engine, seeded_prompt(seed, BLOCKS * TPB))


def serve_interrupted(manager: KVCacheManager, engine: FakeEngine, seeds: range) -> None:
    """Serve ``seeds`` until the armed user code interrupts a call (it must); the interrupted request's handle goes
    with the traceback (its cache is closed by the next call; the collector frees a traceback in a cycle)."""
    interrupted = False
    try:
        for seed in seeds:
            serve(manager, engine, seed)
    except Interrupt:
        interrupted = True
    assert interrupted, "nothing interrupted the calls"
    gc.collect()


def still_serving(manager: KVCacheManager, engine: FakeEngine, seeds: range) -> None:
    """The interrupted call left a consistent manager that serves (and reuses) correct content."""
    manager.check_invariants()
    for seed in seeds:
        serve(manager, engine, seed)
    for seed in seeds:
        serve(manager, engine, seed)


# ---------------------------------------------------------------------------------------- cold-page codec
class InterruptingCodec(PaddingColdPageCodec):
    """Pads and flips every byte (a copy that skipped the codec shows); raises ``Interrupt`` from ``armed``."""

    def __init__(self) -> None:
        super().__init__({0: 12 * KIB})
        self.armed = ""

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        if self.armed == "encode":
            raise Interrupt("encode")
        super().encode(layer_group_id, pages ^ 0xFF, encoded)  # type: ignore[operator]

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        if self.armed == "decode":
            raise Interrupt("decode")
        super().decode(layer_group_id, encoded, pages)
        pages ^= 0xFF  # type: ignore[operator]


@pytest.mark.parametrize("armed", ["encode", "decode"])
def test_a_codec_interrupting_a_move_loses_its_pages_and_the_call_completes(armed: str) -> None:
    """Before: encode -> 'wrong content at positions [0, 1, ...]' on a later serve (pages evicted in the books,
    never encoded); decode -> InvariantError 'page ... has 1 locks, expected 0' (a resume stopped half way)."""
    codec = InterruptingCodec()
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(2 * BLOCKS * 2 * KV), GpuCacheTierConfig(1 << 20)]
    manager = KVCacheManager(
        make_config([attention(0, KV)], tiers=tiers, max_util_for_resume=1.0),
        cold_page_codec=codec,
    )
    engine = FakeEngine(manager)
    for seed in range(3):
        serve(manager, engine, seed)
    codec.armed = armed
    serve_interrupted(manager, engine, range(3, 6) if armed == "encode" else range(3))
    codec.armed = ""
    still_serving(manager, engine, range(6))
    manager.shutdown()


# ------------------------------------------------------------------------------------------- remote store
class InterruptingStoreConfig:
    """An in-memory store whose ``armed`` method raises ``Interrupt`` (once)."""

    def __init__(self) -> None:
        self.memory = MemoryStoreConfig()
        self.armed = ""

    def open(self, quota: int) -> RemoteStore:
        return InterruptingStore(self.memory.open(quota), self)


class InterruptingStore:
    def __init__(self, inner: RemoteStore, config: InterruptingStoreConfig) -> None:
        self.inner = inner
        self.config = config

    def _check(self, method: str) -> None:
        if self.config.armed == method:
            self.config.armed = ""
            raise Interrupt(method)

    def put_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[bool]:
        self._check("put_batch")
        return self.inner.put_batch(keys, buffers)

    def get_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[int]:
        self._check("get_batch")
        return self.inner.get_batch(keys, buffers)

    def exists_batch(self, keys: list[str]) -> list[bool]:
        self._check("exists_batch")
        return self.inner.exists_batch(keys)

    def remove_batch(self, keys: list[str]) -> list[bool]:
        return self.inner.remove_batch(keys)

    def close(self) -> None:
        self._check("close")
        self.inner.close()


def remote_manager(store: InterruptingStoreConfig) -> KVCacheManager:
    remote = RemoteCacheTierConfig(0, store, namespace="test", retry_after_s=0.0)
    return KVCacheManager(make_config([attention(0, KV)], tiers=[GpuCacheTierConfig(1 << 20), remote]))


@pytest.mark.parametrize("armed", ["put_batch", "exists_batch", "get_batch"])
def test_a_remote_store_interrupting_a_call_is_a_miss_and_the_call_completes(armed: str) -> None:
    """Before: get_batch -> the fetched pages stayed claimed (InvariantError); the interrupt left each call half
    done."""
    store = InterruptingStoreConfig()
    writer = remote_manager(store)
    engine = FakeEngine(writer)
    if armed == "put_batch":
        store.armed = armed
        serve_interrupted(writer, engine, range(1))
        assert store.armed == ""
    for seed in range(1, 3):
        serve(writer, engine, seed)
    reader = remote_manager(store)  # another instance: fetches what the writer stored
    engine = FakeEngine(reader)
    if armed != "put_batch":
        store.armed = armed
        serve_interrupted(reader, engine, range(1, 3))
        assert store.armed == ""
    still_serving(reader, engine, range(4))
    writer.shutdown()
    reader.shutdown()


def test_a_remote_store_interrupting_shutdown_still_shuts_down() -> None:
    store = InterruptingStoreConfig()
    manager = remote_manager(store)
    serve(manager, FakeEngine(manager), 0)
    store.armed = "close"
    with pytest.raises(Interrupt):
        manager.shutdown()
    assert manager.is_shut_down


# ------------------------------------------------------------------------------------- event-manager hook
class InterruptingEvents(KVCacheEventManager):
    """A hook that raises ``Interrupt`` for the first stored event after ``armed`` is set."""

    def __init__(self) -> None:
        super().__init__(1000)
        self.armed = False
        self.stored = 0

    def add_stored_event(self, *args: object, **kwargs: object) -> None:
        if self.armed:
            self.armed = False
            raise Interrupt("add_stored_event")
        self.stored += 1
        super().add_stored_event(*args, **kwargs)  # type: ignore[arg-type]


def test_an_event_hook_interrupting_a_commit_comes_out_after_it_completes() -> None:
    events = InterruptingEvents()
    manager = KVCacheManager(make_config([attention(0, KV)]), event_manager=events)
    engine = FakeEngine(manager)
    tokens = seeded_prompt(1, BLOCKS * TPB)
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    events.armed = True
    with pytest.raises(Interrupt):
        cache.commit(tokens)
    assert cache.num_committed_tokens == len(tokens) and events.stored == BLOCKS - 1  # the other events went on
    events.flush_iteration_events()  # the interrupt is not kept for the flush as a hook's error is
    cache.close()
    assert manager.probe_reuse(None, tokens) == len(tokens)
    still_serving(manager, engine, range(3))
    manager.shutdown()


# -------------------------------------------------------------------------------------- priority callback
def interrupting(ordinal: int, life_cycle: LifeCycle) -> Priority:
    raise Interrupt("priority")


@pytest.mark.parametrize("call", ["resize", "batch"])
def test_a_priority_callback_interrupting_a_call_changes_nothing(call: str) -> None:
    """Asked while planning, before any change: the interrupt goes through at once."""
    manager = KVCacheManager(make_config([attention(0, KV)], tiers=[GpuCacheTierConfig(64 * 2 * KV)]))
    engine = FakeEngine(manager)
    serve(manager, engine, 0)
    tokens = seeded_prompt(0, BLOCKS * TPB) + seeded_prompt(5, TPB)
    before = manager.get_storage_statistics()
    if call == "batch":
        with pytest.raises(Interrupt):
            manager.create_kv_cache_batch([KVCacheRequest(tokens, custom_priority_callback=interrupting)])
        assert manager.num_live_caches == 0
    else:
        cache: KVCache = manager.create_kv_cache(None, tokens, custom_priority_callback=interrupting)
        if call == "resize":
            assert cache.resume()
            before = manager.get_storage_statistics()
        with pytest.raises(Interrupt):
            cache.resize(len(tokens) + TPB)
        assert cache.is_active and cache.capacity == cache.history_length
        cache.close()
        if call == "resize":
            before = manager.get_storage_statistics()
    assert manager.get_storage_statistics() == before
    still_serving(manager, engine, range(3))
    manager.shutdown()
