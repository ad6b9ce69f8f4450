"""The logging configuration's handlers are user code the manager runs when it warns in the middle of a call (a page
move that failed, a remote store that failed or answered a bad object). Such a handler may raise (an interrupt
arriving while it runs, a handler of its own that fails) or call the manager (a monitor reading ``get_usage``).
Run mid-call, either stopped the call half way: pages whose bytes never moved were not yet marked lost (served with
the wrong content), a fetch's claimed slots were never filed. The warnings are now held until the call ends: the
handler runs when nothing is half done, may call the manager, and what it raises comes out of the finished call."""

from __future__ import annotations

import gc
import logging
from typing import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, RemoteCacheTierConfig, RemoteStore
from kv_cache_manager_v2._storage.page_codec import PaddingColdPageCodec
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.forwarding_store import ForwardingStore
from tests.helpers import KIB, attention, make_config, seeded_prompt, serve_checked

TPB = 32
KV = 4 * KIB
BLOCKS = 4


class Interrupt(BaseException):
    """What the armed handler raises: like ``KeyboardInterrupt``, not an ``Exception``."""


class ArmedHandler(logging.Handler):
    """Raises ``Interrupt`` (``mode`` "raise") or reads the manager's usage (``mode`` "call") on each warning."""

    def __init__(self, mode: str) -> None:
        super().__init__(logging.WARNING)
        self.mode = mode
        self.manager: KVCacheManager | None = None
        self.records = 0
        self.usages = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1
        if self.mode == "raise":
            raise Interrupt(record.getMessage())
        assert self.manager is not None
        self.manager.get_usage()  # refused (RuntimeError) while a call is in flight
        self.usages += 1


@pytest.fixture
def handler(request: pytest.FixtureRequest) -> Iterator[ArmedHandler]:
    armed = ArmedHandler(request.param)
    logger = logging.getLogger("kv_cache_manager_v2")
    logger.addHandler(armed)
    try:
        yield armed
    finally:
        logger.removeHandler(armed)


def serve(manager: KVCacheManager, engine: FakeEngine, seeds: range) -> int:
    """Serve ``seeds``; the number of calls the handler's ``Interrupt`` came out of (after they completed)."""
    interrupted = 0
    for seed in seeds:
        try:
            serve_checked(manager, engine, seeded_prompt(seed, BLOCKS * TPB))
        except Interrupt:
            interrupted += 1
            gc.collect()  # the interrupted request's handle went with the traceback: closed by the next call
    return interrupted


class FailingCodec(PaddingColdPageCodec):
    """Pads and flips every byte (a copy that skipped the codec shows); ``encode`` fails while ``failing``."""

    def __init__(self) -> None:
        super().__init__({0: 12 * KIB})
        self.failing = False

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        if self.failing:
            raise OSError("encode failed")
        super().encode(layer_group_id, pages ^ 0xFF, encoded)  # type: ignore[operator]

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        super().decode(layer_group_id, encoded, pages)
        pages ^= 0xFF  # type: ignore[operator]


@pytest.mark.parametrize("handler", ["raise", "call"], indirect=True)
def test_a_handler_of_a_failed_move_warning_runs_after_the_call(handler: ArmedHandler) -> None:
    """Before: raise -> 'InvariantError: cache 4 layer group 0: 4 indices for 0 blocks'; call -> 'RuntimeError:
    KVCacheManager.get_usage was called while KVCache.resize is in flight' out of the resize, which stopped there
    (the warning came before the failed move's pages were marked lost: a script serving on showed 'ContentError:
    ... wrong content at positions [0, 1, 2, 3, 4, 5, 6, 7]')."""
    codec = FailingCodec()
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(2 * BLOCKS * 2 * KV), GpuCacheTierConfig(1 << 20)]
    manager = KVCacheManager(
        make_config([attention(0, KV)], tiers=tiers, max_util_for_resume=1.0), cold_page_codec=codec
    )
    handler.manager = manager
    engine = FakeEngine(manager)
    assert serve(manager, engine, range(3)) == 0 and handler.records == 0
    codec.failing = True
    interrupted = serve(manager, engine, range(3, 6))
    codec.failing = False
    assert handler.records > 0
    assert interrupted == (handler.records if handler.mode == "raise" else 0)
    assert handler.usages == (handler.records if handler.mode == "call" else 0)
    manager.check_invariants()
    assert serve(manager, engine, range(6)) == 0 and serve(manager, engine, range(6)) == 0
    manager.shutdown()


class FailingGetsConfig:
    """An in-memory store whose ``get_batch`` raises ``OSError`` while ``failing``."""

    def __init__(self) -> None:
        self.memory = MemoryStoreConfig()
        self.failing = False

    def open(self, quota: int) -> RemoteStore:
        return FailingGets(self.memory.open(quota), self)


class FailingGets(ForwardingStore):
    def __init__(self, inner: RemoteStore, config: FailingGetsConfig) -> None:
        super().__init__(inner)
        self.config = config

    def get_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[int]:
        if self.config.failing:
            raise OSError("get failed")
        return self.inner.get_batch(keys, buffers)


@pytest.mark.parametrize("handler", ["raise", "call"], indirect=True)
def test_a_handler_of_a_failed_fetch_warning_runs_after_the_call(handler: ArmedHandler) -> None:
    """A store failing a fetch warns (treated as down) in the middle of the fill. Before: raise -> 'InvariantError:
    level 0 pool group 0: 0 used + 119 free != 128 slots' (the fill's claimed slots lost); call -> 'RuntimeError:
    KVCacheManager.get_usage was called while KVCacheManager.create_kv_cache is in flight' out of the create."""
    store = FailingGetsConfig()
    remote = RemoteCacheTierConfig(0, store, namespace="test", retry_after_s=0.0)
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(1 << 20), remote]
    writer = KVCacheManager(make_config([attention(0, KV)], tiers=tiers))
    writer_engine = FakeEngine(writer)
    assert serve(writer, writer_engine, range(3)) == 0
    writer.shutdown()
    manager = KVCacheManager(make_config([attention(0, KV)], tiers=tiers))  # empty: every prefix is in the store
    handler.manager = manager
    engine = FakeEngine(manager)
    store.failing = True
    interrupted = serve(manager, engine, range(3))
    store.failing = False
    assert handler.records > 0
    assert interrupted == (handler.records if handler.mode == "raise" else 0)
    assert handler.usages == (handler.records if handler.mode == "call" else 0)
    manager.check_invariants()
    assert serve(manager, engine, range(3)) == 0
    manager.shutdown()
