"""One instance of a serving engine with the Mooncake remote tier, run in its own process by
``tests/test_remote_tier.py``: ``compute`` serves a request with a system prompt and exits (its blocks stay in the
store); ``reuse`` is a fresh instance serving another request with that system prompt. ``model-compute`` and
``model-reuse`` do the same with SmolLM2 (greedy), ``model-alone`` serves the second request without any store.
``failed-transfer NODE_PID`` stops the storage node during a get (run with Mooncake's transfer timeouts short);
``stalled-get NODE_PID DEADLINE_S`` serves a stored prompt while the node is stopped (and shuts down);
``stalled-put NODE_PID DEADLINE_S`` serves a new one (writing through) and puts on a client of its own while it is,
then checks what those late puts left. ``interrupted-open METRICS_PORT`` builds a manager lending the store
``OPEN_QUOTA`` bytes, which Ctrl-C interrupts (the test's metadata server sends it) and reports what the store
counts meanwhile.
Each prints one JSON line.

Usage: ``remote_scenarios.py ROLE MASTER_ADDRESS METADATA_URL [NODE_PID]``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    MooncakeStoreConfig,
    RemoteCacheTierConfig,
    RemoteStore,
    RemoteStoreConfig,
)
from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2.testing import FakeEngine
from kv_cache_manager_v2.testing.mooncake_cluster import mounted_capacity

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout, after the package this run tests
from tests.forwarding_store import ForwardingStore  # noqa: E402

TOKENS_PER_BLOCK = 16
SYSTEM_PROMPT = list(range(5000, 5000 + 10 * TOKENS_PER_BLOCK))  # 10 full blocks


def question(seed: int) -> list[int]:
    return [100 + seed * 1000 + i for i in range(37)]


def config(
    master_address: str, metadata_url: str, get_deadline_s: float = 10.0, put_deadline_s: float = 10.0,
    backend: Callable[[MooncakeStoreConfig], RemoteStoreConfig] = lambda store: store, quota: int = 0,
) -> KVCacheManagerConfig:
    """Two full-attention layers and two sliding-window layers (window 48): K/V of 2 KiB per block; ``backend``
    wraps the Mooncake store config; ``quota``: the bytes the manager lends the store."""
    layers = [
        AttentionLayerConfig(i, [BufferConfig("key", 2048), BufferConfig("value", 2048)],
                             sliding_window_size=None if i % 2 == 0 else 48)
        for i in range(4)
    ]
    store = MooncakeStoreConfig(master_address, metadata_url, get_deadline_s=get_deadline_s,
                                put_deadline_s=put_deadline_s)
    remote = RemoteCacheTierConfig(quota, backend(store), namespace="test-model/fp16")
    return KVCacheManagerConfig(
        tokens_per_block=TOKENS_PER_BLOCK,
        layers=layers,
        backend="cpu",
        cache_tiers=[GpuCacheTierConfig(4 << 20), HostCacheTierConfig(4 << 20), remote],
    )


def serve(manager: KVCacheManager, tokens: list[int]) -> dict[str, int]:
    """Prefill ``tokens`` in one step after whatever prefix was reused (its content checked), commit, close."""
    engine = FakeEngine(manager)
    cache = manager.create_kv_cache(input_tokens=tokens)
    reused = cache.num_committed_tokens
    assert cache.resume()
    engine.check(cache, tokens)  # every reused token's K/V, as the instance that computed it wrote it
    assert cache.resize(len(tokens))
    engine.step(cache, tokens)
    cache.commit(tokens[reused:])
    cache.close()
    return {"reused": reused, "checked": engine.tokens_checked}


SYSTEM_TEXT = (
    "You are a helpful assistant for a travel agency. You answer in one short sentence, you never invent facts, "
    "and you always name the country of every city you mention. Questions follow."
)


def serve_model(role: str, master_address: str, metadata_url: str) -> None:
    from kv_cache_manager_v2.models.gguf_model import load_model
    from kv_cache_manager_v2.models.serving import GenerationOptions, Prompt, Server

    remote = None
    if role != "model-alone":
        store = MooncakeStoreConfig(master_address, metadata_url)
        # The deployment's secret: objects signed in one process verify in the other (nothing process-local in
        # the MAC or the key space, e.g. no hash() under another PYTHONHASHSEED).
        remote = RemoteCacheTierConfig(0, store, namespace="smollm2", secret_key=b"smollm2 deployment secret: 32 B.")
    question = " Where is Lyon?" if role == "model-compute" else " Where is Porto?"
    options = GenerationOptions(max_new_tokens=6, tokens_per_block=16, gpu_mib=8, host_mib=8, remote=remote)
    result = Server(load_model("smollm2"), options).run([Prompt(SYSTEM_TEXT + question)])
    sequence = result.sequences[0]
    print(json.dumps({"reused": result.reused_tokens, "prompt": len(sequence.prompt_ids), "output": sequence.output_ids}))


def wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (state T): ``kill`` only queues SIGSTOP. Once, under load, all 8
    gets of ``failed_transfer`` succeeded (cause not proven; this rules out a node not yet stopped)."""
    deadline = time.monotonic() + 5.0
    tasks = Path(f"/proc/{pid}/task")
    while time.monotonic() < deadline:
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks.iterdir()]
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} did not stop within 5 s")


@contextlib.contextmanager
def node_stopped(pid: int) -> Iterator[None]:
    """The storage node ``pid`` stopped (SIGSTOP, every thread: ``wait_stopped``) inside the block, continued after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_stopped(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def failed_transfer(master_address: str, metadata_url: str, node_pid: int) -> None:
    """A get whose storage node stops answering fails (Mooncake's ``TRANSFER_FAIL``), yet Mooncake may still write
    into its buffers once the node answers again: the store keeps them alive, though the caller dropped them."""
    from kv_cache_manager_v2._remote.mooncake import MooncakeStore

    store = MooncakeStoreConfig(master_address, metadata_url).open(0)
    assert isinstance(store, MooncakeStore)
    keys = [f"failed-transfer/{i}" for i in range(8)]
    assert store.put_batch(keys, [np.full(64 << 10, i + 1, dtype=np.uint8) for i in range(8)]) == [True] * 8
    buffers = [np.zeros(64 << 10, dtype=np.uint8) for _ in keys]
    alive = [weakref.ref(buffer) for buffer in buffers]
    with node_stopped(node_pid):
        results = store.get_batch(keys, buffers)
    del buffers
    failed = [ref for ref, result in zip(alive, results) if result < 0]
    print(json.dumps({
        "failed": len(failed), "held_bytes": store.held_bytes, "alive": sum(ref() is not None for ref in failed),
    }))


def stalled_get(master_address: str, metadata_url: str, node_pid: int, get_deadline_s: float) -> None:
    """The storage node holding the system prompt stops (SIGSTOP) while the master still lists it: the request is
    served, its prefix a miss once ``get_deadline_s`` passed, and the tier stays away (no put to the stopped node).
    The get stays inside Mooncake until its transfer timeouts; the engine shuts down while the node is still
    stopped, drops the manager, and lives on while the node answers again: every buffer a get was handed must still
    be alive then, as the abandoned get may write into it."""
    watched: list[WatchedGets] = []

    def watch(store: MooncakeStoreConfig) -> RemoteStoreConfig:
        watched.append(WatchedGets(store))
        return watched[-1]

    manager = KVCacheManager(config(master_address, metadata_url, get_deadline_s, backend=watch))
    with node_stopped(node_pid):
        start = time.monotonic()
        result = serve(manager, SYSTEM_PROMPT + question(3))
        elapsed = time.monotonic() - start
        stats = manager.get_remote_tier_statistics()
        assert stats is not None
        start = time.monotonic()
        manager.shutdown()
        shutdown = time.monotonic() - start
        del manager
        gc.collect()
        gets = watched[0].gets
        alive = sum(ref() is not None for ref in gets)
    time.sleep(0.5)
    figures: dict[str, object] = dict(
        result, elapsed=round(elapsed, 2), fetch_failures=stats.fetch_failures, fetched_pages=stats.fetched_pages,
        skipped_while_down=stats.skipped_while_down, stored_pages=stats.stored_pages, warnings=stats.warnings,
        shutdown=round(shutdown, 2), gets=len(gets), alive=alive,
    )
    print(json.dumps(figures))


def stalled_put(master_address: str, metadata_url: str, node_pid: int, put_deadline_s: float) -> None:
    """The storage node stops (SIGSTOP) while the master still lists it: a request writing through is served once
    ``put_deadline_s`` passed, and a put on a client of its own raises by then, keeping its buffers (Mooncake may
    still read them) though the caller dropped them."""
    from kv_cache_manager_v2._base.remote_store import RemoteStoreError
    from kv_cache_manager_v2._remote.mooncake import MooncakeStore

    manager = KVCacheManager(config(master_address, metadata_url, put_deadline_s=put_deadline_s))
    store = MooncakeStoreConfig(master_address, metadata_url, put_deadline_s=put_deadline_s).open(0)
    assert isinstance(store, MooncakeStore)
    keys = [f"stalled-put/{i}" for i in range(8)]
    buffers = [np.full(64 << 10, i + 1, dtype=np.uint8) for i in range(8)]
    alive = [weakref.ref(buffer) for buffer in buffers]
    with node_stopped(node_pid):
        start = time.monotonic()
        result = serve(manager, SYSTEM_PROMPT + question(4))
        served = time.monotonic() - start
        start = time.monotonic()
        try:
            store.put_batch(keys, buffers)
            error = ""
        except RemoteStoreError as raised:
            error = str(raised)
        put = time.monotonic() - start
    del buffers
    stats = manager.get_remote_tier_statistics()
    assert stats is not None
    figures: dict[str, object] = dict(
        result, served=round(served, 2), store_failures=stats.store_failures, stored_pages=stats.stored_pages,
        warnings=stats.warnings, put=round(put, 2), error=error, held_bytes=store.held_bytes,
        alive=sum(ref() is not None for ref in alive),
    )
    manager.shutdown()
    figures.update(late_puts(store, keys), again=serve(KVCacheManager(config(master_address, metadata_url)),
                                                       SYSTEM_PROMPT + question(4)))
    store.close()
    print(json.dumps(figures))


def late_puts(store: RemoteStore, keys: list[str]) -> dict[str, int]:
    """The node answers again: the puts past their deadline may complete now. Whatever a get finds under their
    keys, after they are put again with the same content (as the tier stores a page again), must be that content:
    never stale or half-written bytes served as a hit. ``stored``: keys found, ``wrong``: with other bytes."""
    deadline = time.monotonic() + 5.0
    while not all(store.exists_batch(keys)) and time.monotonic() < deadline:
        time.sleep(0.05)
    store.put_batch(keys, [np.full(64 << 10, i + 1, dtype=np.uint8) for i in range(len(keys))])
    read = [np.zeros(64 << 10, dtype=np.uint8) for _ in keys]
    lengths = store.get_batch(keys, read)
    wrong = sum(length >= 0 and (length != 64 << 10 or bool(np.any(buffer != i + 1)))
                for i, (length, buffer) in enumerate(zip(lengths, read)))
    return {"stored": sum(length >= 0 for length in lengths), "wrong": wrong}


class WatchedGets:
    """A store config whose clients note a weak reference to every buffer a get was handed (``gets``)."""

    def __init__(self, inner: RemoteStoreConfig) -> None:
        self.inner = inner
        self.gets: list[weakref.ref[HostBuffer]] = []

    def open(self, quota: int) -> RemoteStore:
        return WatchedStore(self.inner.open(quota), self.gets)


class WatchedStore(ForwardingStore):
    def __init__(self, inner: RemoteStore, gets: list[weakref.ref[HostBuffer]]) -> None:
        super().__init__(inner)
        self.gets = gets

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        self.gets += [weakref.ref(buffer) for buffer in buffers]
        return self.inner.get_batch(keys, buffers)


OPEN_QUOTA = 32 << 20


def interrupted_open(master_address: str, metadata_url: str, metrics_port: int) -> None:
    """Ctrl-C while Mooncake's setup runs (it holds the GIL: Python raises ``KeyboardInterrupt`` as setup returns,
    with a connected client lending ``OPEN_QUOTA`` bytes). The error is kept, as an engine logging it would keep
    it, while the store's capacity is read: a client left open still lends its bytes to a manager never built."""
    try:
        KVCacheManager(config(master_address, metadata_url, quota=OPEN_QUOTA))
    except KeyboardInterrupt as interrupt:
        kept = interrupt
        print(json.dumps({"interrupted": True, "capacity": mounted_capacity(metrics_port), "kept": repr(kept)}))
        return
    print(json.dumps({"interrupted": False}))


def main() -> None:
    role, master_address, metadata_url = sys.argv[1:4]
    if role == "failed-transfer":
        failed_transfer(master_address, metadata_url, int(sys.argv[4]))
        return
    if role == "stalled-get":
        stalled_get(master_address, metadata_url, int(sys.argv[4]), float(sys.argv[5]))
        return
    if role == "stalled-put":
        stalled_put(master_address, metadata_url, int(sys.argv[4]), float(sys.argv[5]))
        return
    if role == "interrupted-open":
        interrupted_open(master_address, metadata_url, int(sys.argv[4]))
        return
    if role.startswith("model-"):
        serve_model(role, master_address, metadata_url)
        return
    manager = KVCacheManager(config(master_address, metadata_url))
    result = serve(manager, SYSTEM_PROMPT + question(1 if role == "compute" else 2))
    stats = manager.get_remote_tier_statistics()
    assert stats is not None
    manager.shutdown()
    result.update(stored_pages=stats.stored_pages, fetched_pages=stats.fetched_pages, warnings=stats.warnings)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
