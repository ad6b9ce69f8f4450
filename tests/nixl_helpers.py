"""Shared by the NIXL transport tests: the prefill side in a spawned child process, stopped in teardown.

Without ``nixl_cu12`` the tests skip outside CI and fail in CI (``CI`` set), where ``.ci/run`` installs it with
``pip install --no-deps nixl-cu12==1.5.1``.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Callable, Iterator, TypeVar

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCache, KVCacheManager, KVCacheManagerConfig
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2._introspection import receiver_endpoint
from kv_cache_manager_v2._handoff.nixl_agent import AgentFactory, NixlAgent, new_agent
from kv_cache_manager_v2.disagg import KVFormat, KVReceiver, KVSender, PrefillRequest, nixl_available, prepare_receiver
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, MIB, attention, compute_prompt, make_config, ssm

TPB = 32
FAULTS = ("none", "exit_after_sources", "exit_before_sources")
AgentT = TypeVar("AgentT")
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


def settle_unfinished_reads(receiver: KVReceiver, timeout_s: float = 10.0) -> None:
    """Ask NIXL until every READ the receiver holds pages for has ended (each then closes its cache): what the
    receiver's next ``request`` or ``read`` does once, done here until it is so."""
    unfinished = receiver_endpoint(receiver).unfinished
    deadline = time.monotonic() + timeout_s
    while unfinished.count:
        assert time.monotonic() < deadline, f"{unfinished.count} READs still in progress after {timeout_s} s"
        unfinished.retry()
        time.sleep(0.01)


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


class PrefillSide:
    """This process as the prefill side of a child decode side: a manager, its FakeEngine and a sender on
    ``connection`` (the handshake happens here; when it fails the manager is shut down)."""

    def __init__(self, connection: Connection, gpu_mib: int = 16, kv_format: KVFormat = FAKE_FORMAT) -> None:
        self.manager = KVCacheManager(hybrid_config(gpu_mib))
        self.engine = FakeEngine(self.manager)
        try:
            self.sender = KVSender(self.manager, connection, kv_format=kv_format)
        except BaseException:
            self.manager.shutdown()
            raise

    def serve(self, commit: bool = True, send: bool = False) -> tuple[PrefillRequest, KVCache]:
        """The next request (there must be one) and its cache, prefilled with FakeEngine records; committed when
        ``commit``, its sources sent when ``send``."""
        request = self.sender.next_request()
        assert request is not None
        cache = prefill(self.manager, self.engine, request)
        if commit:
            cache.commit(request.tokens[cache.num_committed_tokens :])
        if send:
            self.sender.send_sources(request, cache)
        return request, cache

    def close(self) -> None:
        self.sender.close()
        self.manager.check_invariants()
        self.manager.shutdown()


class DecodeSide:
    """This process as the decode side of a child prefill side: a manager, its FakeEngine and a receiver on
    ``connection`` (the handshake happens here, within ``timeout_s``; when it fails the manager is shut down).
    ``agent_type`` makes the receiver's NIXL agent (a test's wrapper of the real one); ``agent`` returns it."""

    def __init__(
        self,
        connection: Connection,
        gpu_mib: int = 8,
        backend: str = "cpu",
        timeout_s: float = 30.0,
        agent_type: AgentFactory = new_agent,
        kv_format: KVFormat = FAKE_FORMAT,
    ) -> None:
        self.manager = KVCacheManager(hybrid_config(gpu_mib, backend))
        self.engine = FakeEngine(self.manager)
        self.connection = connection
        self._agents: list[NixlAgent] = []

        def recorded(name: str) -> NixlAgent:
            self._agents.append(agent_type(name))
            return self._agents[-1]

        try:
            self.receiver = KVReceiver(
                self.manager, connection, kv_format=kv_format, timeout_s=timeout_s, agent_factory=recorded
            )
        except BaseException:
            self.manager.shutdown()
            raise

    def nixl_agent(self) -> NixlAgent:
        """The receiver's agent (for a word of one's own: ``send_notif``)."""
        (agent,) = self._agents
        return agent

    def agent(self, agent_type: type[AgentT]) -> AgentT:
        """The receiver's agent, which ``agent_type`` made."""
        agent = self.nixl_agent()
        assert isinstance(agent, agent_type)
        return agent

    def open(self, prompt: list[int]) -> tuple[KVCache, list[int]]:
        """``prepare_receiver`` of ``prompt``, which must fit: the receiving cache and its counts."""
        received = prepare_receiver(self.manager, prompt)
        assert received is not None
        return received

    def warm(self, tokens: list[int], stops: tuple[int, ...] = ()) -> None:
        """Compute and commit ``tokens`` here (an earlier request on this instance), leave them reusable."""
        compute_prompt(self.manager, self.engine, tokens, stops).close()

    def close(self) -> None:
        self.receiver.close()
        self.manager.check_invariants()
        self.manager.shutdown()

    def leave_without_a_word(self) -> None:
        """A misbehaving decode side's end: wait until the prefill side closes the connection, then close the NIXL
        endpoint (no bye, no abort: the receiver's own ``close`` would send them) and shut the manager down."""
        wait_for_the_end(self.connection)
        receiver_endpoint(self.receiver).close()
        self.manager.shutdown()


def wait_for_the_end(connection: Connection) -> None:
    """Read until the other side closes (it may still send an abort or a bye)."""
    try:
        while True:
            connection.recv_bytes()
    except (EOFError, OSError):
        pass


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
