"""Shared by the NIXL transport tests: the prefill side in a spawned child process, stopped in teardown.

Without ``nixl_cu12`` the tests skip outside CI and fail in CI (``CI`` set), where ``.ci/run`` installs it with
``pip install --no-deps nixl-cu12==1.5.1``.
"""

from __future__ import annotations

import multiprocessing
import os
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Callable, Iterator

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCache, KVCacheManager, KVCacheManagerConfig
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.disagg import KVFormat, KVSender, PrefillRequest, nixl_available
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, MIB, attention, make_config, ssm

TPB = 32
FAULTS = ("none", "exit_after_sources", "exit_before_sources")
# What the FakeEngine's pages hold: 64-bit records of (token, position, layer, role).
FAKE_FORMAT = KVFormat("uint64", "FakeEngine records")


def require_nixl() -> None:
    if not nixl_available():
        if os.environ.get("CI"):
            pytest.fail("CI installs nixl_cu12 (.ci/run), yet it does not import")
        pytest.skip("nixl_cu12 is not installed: pip install --no-deps nixl-cu12==1.5.1")


def hybrid_layers() -> list[LayerConfig]:
    """Every kind: lg 0 SSM (layers 0 and 2), lg 1 full attention, lg 2 window 64 with a sink block."""
    return [ssm(0), attention(1, 2 * KIB), ssm(2), attention(3, 2 * KIB, window=64, sinks=10)]


def hybrid_config(gpu_mib: int, backend: str = "cpu") -> KVCacheManagerConfig:
    return make_config(hybrid_layers(), tiers=[GpuCacheTierConfig(gpu_mib * MIB)], backend=backend, ssm_reuse_interval=TPB)


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def fake_prefill_side(connection: Connection, gpu_mib: int, backend: str, fault: str) -> None:
    """The child: a manager and a FakeEngine that prefill each requested prompt (its own prefix match included),
    answer with the sources and close the cache once the decode side read it. ``fault`` exits the process
    (``os._exit``, no cleanup: as a crash) right after sending the sources or right before."""
    manager = KVCacheManager(hybrid_config(gpu_mib, backend))
    engine = FakeEngine(manager)
    sender = KVSender(manager, connection, kv_format=FAKE_FORMAT)
    while True:
        request = sender.next_request()
        if request is None:
            break
        tokens = request.tokens
        cache = manager.create_kv_cache(request.reuse_scope, tokens)
        if not cache.resume() or not cache.resize(len(tokens), cache.history_length):
            cache.close()
            sender.send_error(request, f"no room for {len(tokens)} tokens")
            continue
        engine.step(cache, tokens)
        cache.commit(tokens[cache.num_committed_tokens :])
        if fault == "exit_before_sources":
            os._exit(17)
        sender.send_sources(request, cache, extra=("prefilled", len(tokens)))
        if fault == "exit_after_sources":
            os._exit(17)
        sender.wait_released(request)
        cache.close()
    sender.close()
    manager.check_invariants()
    manager.shutdown()


def prefill(manager: KVCacheManager, engine: FakeEngine, request: PrefillRequest) -> KVCache:
    """A cache for ``request`` whose prompt ``engine`` computed (FakeEngine records), not yet committed."""
    cache = manager.create_kv_cache(request.reuse_scope, request.tokens)
    assert cache.resume() and cache.resize(len(request.tokens), cache.history_length)
    engine.step(cache, request.tokens)
    return cache


def send_first_request(side: ChildSide) -> tuple[KVCacheManager, KVSender, PrefillRequest, KVCache]:
    """This process as the prefill side of ``side``'s decode child: a manager, its sender, and the first request
    prefilled with FakeEngine records, committed and its sources sent."""
    manager = KVCacheManager(hybrid_config(16))
    engine = FakeEngine(manager)
    sender = KVSender(manager, side.connection, kv_format=FAKE_FORMAT)
    request = sender.next_request()
    assert request is not None
    cache = prefill(manager, engine, request)
    cache.commit(request.tokens)
    sender.send_sources(request, cache)
    return manager, sender, request, cache


class ChildSide:
    """A spawned child running ``target(connection, *args)``; ``stop`` joins it, killing it if it lingers."""

    def __init__(self, target: Callable[..., None], *args: object) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child_end = context.Pipe()
        self.process: BaseProcess = context.Process(target=target, args=(child_end, *args), daemon=True)
        self.process.start()
        child_end.close()

    def wait_exit(self, timeout_s: float = 60.0) -> int | None:
        self.process.join(timeout_s)
        return self.process.exitcode

    def stop(self) -> None:
        self.connection.close()  # a child waiting for a request sees the end of the connection and returns
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


@contextmanager
def child_side(target: Callable[..., None], *args: object) -> Iterator[ChildSide]:
    """The child runs inside the ``with`` block and is stopped when it ends, even when the test failed."""
    side = ChildSide(target, *args)
    try:
        yield side
    finally:
        side.stop()
