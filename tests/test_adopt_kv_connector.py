"""A vLLM-KV-connector-style integration (LMCache / Mooncake connector), written from README.md and the docstrings.

Here vLLM keeps its own block manager: ``VllmInstance`` owns a paged KV buffer (NumPy, ``[layer, role, block,
token, word]``), a free-block list (LIFO: a freed block is the next one handed out), block tables and a scheduler
with a token budget, chunked prefill, preemption by recompute and aborts. The manager is only the external store
behind the connector (``ManagerConnector``): its own tiers (the first one staging, host) and the shared remote
tier (an in-memory store, or a Mooncake store on loopback). Saving copies vLLM's computed full blocks into a cache
of the manager and commits them (written through to the store); ``get_num_new_matched_tokens`` fetches
(``prefetch_remote``) and pins the match in a resumed cache, and the load copies its pages into vLLM's blocks, at
once or a step later (an asynchronous load, its cache held meanwhile). Every token's K/V words derive from the
whole prefix, and vLLM checks every history row before a step reads it, so a loaded row that differs from what
instance A computed, or a late load landing in blocks vLLM gave to another request, fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, CacheHold, GpuCacheTierConfig,
                                 HostCacheTierConfig, KVCache, KVCacheManager, KVCacheManagerConfig,
                                 RemoteCacheTierConfig, RemoteStoreConfig)
from kv_cache_manager_v2.testing import MemoryStoreConfig

from tests.mooncake_helpers import cluster  # noqa: F401  (a Mooncake master and storage node on loopback)

TPB = 16  # vLLM's block_size and the manager's tokens_per_block
WORDS = 4  # int64 words per token of one K or V buffer
ROW = WORDS * 8
LAYERS, ROLES = 2, ("key", "value")
SLOT = LAYERS * len(ROLES) * TPB * ROW
BUDGET, MAX_RUNNING = 64, 4
MASK = (1 << 61) - 1


def prefix_codes(tokens: list[int]) -> list[int]:
    """A chained code per position: position t's K/V depend on tokens[:t + 1], as a model's do."""
    codes, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) & MASK
        codes.append(h)
    return codes


def kv_words(code: int, layer: int, role: int) -> np.ndarray:
    return np.array([(code + 97 * layer + 31 * role + w) & MASK for w in range(WORDS)], dtype=np.int64)


def make_manager(store: RemoteStoreConfig, namespace: str, staging_pages: int = 64) -> KVCacheManager:
    kv = [BufferConfig(r, TPB * ROW) for r in ROLES]
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=[AttentionLayerConfig(i, kv) for i in range(LAYERS)],
        cache_tiers=[GpuCacheTierConfig(staging_pages * SLOT), HostCacheTierConfig(32 * SLOT),
                     RemoteCacheTierConfig(0, store, namespace=namespace)]))


@dataclass
class Request:
    """vLLM's Request, as much of it as a connector reads."""
    request_id: str
    prompt: list[int]
    max_new: int
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: str = "WAITING"  # WAITING, WAITING_FOR_REMOTE_KVS, RUNNING, FINISHED
    external_tokens: int = 0  # tokens the connector loaded at the latest admission
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Load:
    """One load the scheduler side planned: the manager's cache pinning the pages, vLLM's destination blocks."""
    request: Request
    cache: KVCache
    block_ids: list[int]
    num_tokens: int
    is_async: bool
    hold: CacheHold[KVCache] | None = None
    cancelled: bool = False


class ManagerConnector:
    """Both halves of a KVConnectorBase_V1 (scheduler and worker side share this process) over one manager."""

    def __init__(self, manager: KVCacheManager, vllm: VllmInstance, async_load: bool) -> None:
        self.manager, self.vllm, self.async_load = manager, vllm, async_load
        self.matched: dict[str, Load] = {}  # pinned by get_num_new_matched_tokens, blocks not allocated yet
        self.pending: list[Load] = []  # planned by update_state_after_alloc, not yet started
        self.started_now: list[Load] = []  # async loads started this step
        self.in_flight: list[Load] = []  # async loads started in an earlier step: a later get_finished ends them
        self.loaded_tokens = 0
        self.first_loads: dict[str, int] = {}  # tokens loaded at each request's first load
        self.saved_blocks = 0
        # Per lookup (new requests, then readmissions after preemption): whole blocks asked for, and found held.
        self.asked_blocks, self.held_blocks = [0, 0], [0, 0]

    # -- scheduler side --------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Fetch what the store holds, then pin it in a cache of ours, so no eviction loses it before the load."""
        self._unpin(request.request_id)  # vLLM asks again each step a request stays waiting
        tokens = request.tokens
        # vLLM computes at least the last token (its logits); loads are whole blocks.
        asked = (len(tokens) - 1) // TPB * TPB
        if asked <= num_computed_tokens:
            return 0, False
        self.manager.prefetch_remote(None, tokens[:asked])
        # The lookup of the whole ask (a miss counts too), a readmission's apart as vLLM's connector stats keep it.
        preempted = request.num_preemptions > 0
        cache = self.manager.create_kv_cache(input_tokens=tokens[:asked], preempted=preempted)
        held = cache.num_committed_tokens - cache.num_committed_tokens % TPB
        self.asked_blocks[preempted] += asked // TPB
        self.held_blocks[preempted] += held // TPB
        if held <= num_computed_tokens or not cache.resume():  # staging tier short: vLLM computes it
            cache.close()
            return 0, False
        self.matched[request.request_id] = Load(request, cache, [], held, self.async_load)
        return held - num_computed_tokens, self.async_load

    def _unpin(self, request_id: str) -> None:
        load = self.matched.pop(request_id, None)
        if load is not None:
            load.cache.close()

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        load = self.matched.pop(request.request_id, None)
        if load is not None and num_external_tokens > 0:
            load.block_ids = list(block_ids)
            self.pending.append(load)
        elif load is not None:
            load.cache.close()

    def build_connector_meta(self) -> list[Load]:
        loads, self.pending = self.pending, []
        return loads

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        """Keep vLLM from reusing the blocks of a request whose load is still in flight."""
        self._unpin(request.request_id)
        loads = [load for load in self.in_flight + self.started_now if load.request is request]
        for load in loads:
            load.cancelled = True  # its pages are never copied; get_finished reports it, then vLLM frees
        return bool(loads), None

    # -- worker side -----------------------------------------------------------------------------------------
    def start_load_kv(self, loads: list[Load]) -> None:
        for load in loads:
            if load.is_async:
                load.hold = load.cache.hold("kv-connector load in flight")
                self.started_now.append(load)
            else:
                self._finish_load(load)

    def _finish_load(self, load: Load) -> None:
        if load.hold is not None:
            load.hold.release()
        if not load.cancelled:
            for layer in range(LAYERS):
                for r, role in enumerate(ROLES):
                    pages = np.asarray(self.manager.get_page_view(layer, role)).view(np.int64)
                    table = load.cache.get_base_page_indices(self.manager.get_layer_group_id(layer))
                    rows = self.manager.get_page_index_converter(layer, role)(table)
                    for b in range(load.num_tokens // TPB):
                        self.vllm.kv[layer, r, load.block_ids[b]] = pages[rows[b]].reshape(TPB, WORDS)
            self.loaded_tokens += load.num_tokens
            self.first_loads.setdefault(load.request.request_id, load.num_tokens)
        load.cache.close()

    def wait_for_save(self, scheduled: list[Request]) -> None:
        """Store each scheduled request's full blocks computed so far that the manager does not hold yet."""
        for request in scheduled:
            end = request.num_computed_tokens - request.num_computed_tokens % TPB
            if end == 0:
                continue
            tokens = request.tokens[:end]
            cache = self.manager.create_kv_cache(input_tokens=tokens, lookup=False)  # no request asks: no lookup
            start = cache.num_committed_tokens - cache.num_committed_tokens % TPB
            if start >= end or not cache.resume() or not cache.resize(end):
                cache.close()  # memory short: this save is skipped, a later request recomputes
                continue
            for layer in range(LAYERS):
                for r, role in enumerate(ROLES):
                    pages = np.asarray(self.manager.get_page_view(layer, role)).view(np.int64)
                    table = cache.get_base_page_indices(self.manager.get_layer_group_id(layer))
                    rows = self.manager.get_page_index_converter(layer, role)(table)
                    for b in range(start // TPB, end // TPB):
                        pages[rows[b]] = self.vllm.kv[layer, r, request.block_ids[b]].reshape(-1)
            cache.commit(tokens[cache.num_committed_tokens:])
            self.saved_blocks += (end - start) // TPB
            cache.close()

    def get_finished(self) -> set[str]:
        """End the async loads started in an earlier step: the ids of their requests (finished_recving)."""
        done = {load.request.request_id for load in self.in_flight}
        for load in self.in_flight:
            self._finish_load(load)
        self.in_flight, self.started_now = self.started_now, []
        return done


class VllmInstance:
    """vLLM's side: its block pool and KV buffer, the scheduler loop and a model that checks what it reads."""

    def __init__(self, manager: KVCacheManager, num_blocks: int, async_load: bool = False) -> None:
        self.kv = np.zeros((LAYERS, len(ROLES), num_blocks, TPB, WORDS), dtype=np.int64)
        self.free = list(range(num_blocks - 1, -1, -1))  # LIFO: a freed block is the next one handed out
        self.block_table = np.full(64, -1, dtype=np.int64)  # the row the step's attention reads
        self.connector = ManagerConnector(manager, self, async_load)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.delayed: dict[str, list[int]] = {}  # blocks of finished requests the connector still uses
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def _allocate(self, request: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // TPB) - len(request.block_ids)
        if need > len(self.free):
            return False
        request.block_ids += [self.free.pop() for _ in range(max(need, 0))]
        return True

    def _allocate_preempting(self, request: Request, num_tokens: int) -> bool:
        """Preempt until ``request`` gets its blocks: requests loaded but not running first, then running ones
        from the last; False once ``request`` itself had to go."""
        while not self._allocate(request, num_tokens):
            loaded = [r for r in self.waiting if r.block_ids and r.status == "WAITING" and r is not request]
            victim = loaded[-1] if loaded else self.running[-1] if request.status == "RUNNING" else request
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _free(self, request: Request) -> None:
        self._free_blocks(request.block_ids)
        request.block_ids = []

    def _free_blocks(self, block_ids: list[int]) -> None:
        self.kv[:, :, block_ids] = -1  # poison: a later reader of these rows fails
        self.free += reversed(block_ids)

    def _preempt(self, request: Request) -> None:
        if request.status == "RUNNING":
            self.running.remove(request)
            self.waiting.insert(0, request)
        self._free(request)
        request.num_computed_tokens, request.status, request.external_tokens = 0, "WAITING", 0
        request.num_preemptions += 1
        self.preemptions += 1

    def abort(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            for request in [r for r in queue if r.request_id == request_id]:
                queue.remove(request)
                self._finish(request)

    def _finish(self, request: Request) -> None:
        request.status = "FINISHED"
        delay, _ = self.connector.request_finished(request, request.block_ids)
        if delay:
            self.delayed[request.request_id] = request.block_ids
            request.block_ids = []
        else:
            self._free(request)
        self.finished.append(request)

    def step(self) -> None:
        budget, scheduled = BUDGET, {}
        for request in list(self.running):
            if request.status != "RUNNING":  # preempted for an earlier request of this loop
                continue
            want = min(len(request.tokens) - request.num_computed_tokens, budget)
            if want and not self._allocate_preempting(request, request.num_computed_tokens + want):
                want = 0
            if want:
                scheduled[request.request_id], budget = (request, want), budget - want
        for request in sorted(self.waiting, key=lambda r: not r.block_ids):  # loaded ones first: they hold blocks
            holding = len(self.running) + sum(1 for r in self.waiting if r.block_ids and r is not request)
            if budget == 0 or holding >= MAX_RUNNING or request.status != "WAITING":
                continue
            if request.external_tokens == 0:  # not already loaded by an async load that finished
                ext, is_async = self.connector.get_num_new_matched_tokens(request, 0)
            else:
                ext, is_async = 0, False
            start = request.num_computed_tokens + ext
            want = 0 if is_async else min(len(request.tokens) - start, budget)
            if not (self._allocate(request, start + want)
                    or request.block_ids and self._allocate_preempting(request, start + want)):
                break
            self.connector.update_state_after_alloc(request, request.block_ids, ext)
            request.external_tokens = max(ext, request.external_tokens)
            if is_async:  # keeps its place in the queue
                request.status = "WAITING_FOR_REMOTE_KVS"
                continue
            self.waiting.remove(request)
            request.num_computed_tokens, request.status = start, "RUNNING"
            self.running.append(request)
            scheduled[request.request_id], budget = (request, want), budget - want
        self.connector.start_load_kv(self.connector.build_connector_meta())
        for request, n in scheduled.values():
            self._forward(request, n)
        self.connector.wait_for_save([r for r, _ in scheduled.values()])
        for request_id in self.connector.get_finished():
            if request_id in self.delayed:
                self._free_blocks(self.delayed.pop(request_id))
            for request in self.waiting:
                if request.request_id == request_id:
                    request.status, request.num_computed_tokens = "WAITING", request.external_tokens
        for request in [r for r in self.running if len(r.output) >= r.max_new]:
            self.running.remove(request)
            self._finish(request)

    def _forward(self, request: Request, n: int) -> None:
        """Check every history row this step reads, write the chunk's rows, sample after the prompt."""
        tokens, start = request.tokens, request.num_computed_tokens
        codes = prefix_codes(tokens[:start + n])
        blocks = np.asarray(request.block_ids, dtype=np.int64)
        self.block_table[:len(blocks)] = blocks
        for t in range(start + n):
            block, row = int(self.block_table[t // TPB]), t % TPB
            for layer in range(LAYERS):
                for r in range(len(ROLES)):
                    if t >= start:
                        self.kv[layer, r, block, row] = kv_words(codes[t], layer, r)
                    elif not np.array_equal(self.kv[layer, r, block, row], kv_words(codes[t], layer, r)):
                        raise AssertionError(f"{request.request_id}: layer {layer} {ROLES[r]} row {t} is wrong")
        request.num_computed_tokens = start + n
        if request.num_computed_tokens == len(tokens):
            request.output.append(codes[-1] % 5000 + 10_000)

    def run(self, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if not (self.waiting or self.running or self.delayed):
                return
            self.step()
        raise AssertionError("requests never finished")


SYSTEM = list(range(500, 580))  # an 80-token system prompt every chat starts with


def chats(tag: str) -> list[Request]:
    return [Request(f"{tag}-{i}", SYSTEM + [2000 + 37 * i + j for j in range(40 + 9 * i)], 6) for i in range(6)]


def outputs(instance: VllmInstance) -> dict[str, list[int]]:
    return {r.request_id.split("-")[1]: r.output for r in instance.finished}


def check_lookups(instance: VllmInstance, manager: KVCacheManager) -> None:
    """The manager's lookup statistics are the connector's asks and what the store held, new requests' and
    readmissions' apart, its saves (``lookup=False``) left out: the hit rate README's vLLM table computes is the
    connector's own. Before: every save counted as a lookup (instance A of the first test, synchronous loads:
    new requests' 392 reused of 486 blocks, a hit rate of 0.81, where the connector found 79 of the 146 asked)."""
    reused, asked = [0, 0], [0, 0]
    for delta in manager.get_and_reset_iteration_stats().values():
        reused[0] += delta.iter_reused_blocks
        asked[0] += delta.iter_reused_blocks + delta.iter_missed_blocks
        reused[1] += delta.iter_preempted_reused_blocks
        asked[1] += delta.iter_preempted_reused_blocks + delta.iter_preempted_missed_blocks
    connector = instance.connector
    assert (reused, asked) == (connector.held_blocks, connector.asked_blocks)


@pytest.mark.parametrize(("store_kind", "async_load", "staging_pages"),
                         [("memory", False, 64), ("memory", True, 64), ("memory", True, 12), ("mooncake", True, 64)])
def test_instance_b_loads_what_instance_a_saved(request: pytest.FixtureRequest, store_kind: str, async_load: bool,
                                                staging_pages: int) -> None:
    if store_kind == "mooncake":
        store: RemoteStoreConfig = request.getfixturevalue("cluster").config()
    else:
        store = MemoryStoreConfig()
    namespace = f"connector-test/{store_kind}-{async_load}-{staging_pages}"
    a_manager = make_manager(store, namespace)
    b_manager = make_manager(store, namespace, staging_pages)
    a = VllmInstance(a_manager, num_blocks=20)  # small enough to preempt
    for r in chats("a"):
        a.add(r)
    a.run()
    assert a.preemptions > 0 and a.connector.saved_blocks > 0 and a.connector.loaded_tokens > 0
    check_lookups(a, a_manager)
    b = VllmInstance(b_manager, num_blocks=20, async_load=async_load)
    for r in chats("b"):
        b.add(r)
    b.run()
    # Rows B loaded are checked against what A's prefixes give before B reads them; outputs follow from them.
    assert outputs(b) == outputs(a) and all(len(out) == 6 for out in outputs(b).values())
    full = {r.request_id: (len(r.prompt) - 1) // TPB * TPB for r in chats("b")}
    if staging_pages == 64:  # every prompt's full blocks (the last token aside) came from A at its first load
        assert b.connector.first_loads == full
    else:  # a staging tier too small for a prompt: vLLM computes that one (a refused resume is no error)
        assert 0 < len(b.connector.first_loads) < len(full)
    assert sorted(b.free) == list(range(20)) and not b.delayed
    check_lookups(b, b_manager)
    if staging_pages == 64:  # A saved every prompt's full blocks, so each of B's new requests' asks is a hit
        assert b.connector.held_blocks[0] == b.connector.asked_blocks[0] > 0
    for m in (a_manager, b_manager):
        assert m.num_live_caches == 0
        m.shutdown()


def test_instances_side_by_side_preempting_loaded_requests() -> None:
    """B loads while A still saves; B's blocks are so few that it preempts requests it loaded but has not run."""
    store = MemoryStoreConfig()
    a_manager, b_manager = make_manager(store, "side"), make_manager(store, "side")
    a, b = VllmInstance(a_manager, num_blocks=14), VllmInstance(b_manager, num_blocks=14, async_load=True)
    for r_a, r_b in zip(chats("a"), chats("b")):
        a.add(r_a)
        b.add(r_b)
    for _ in range(400):
        for instance in (a, b):
            if instance.waiting or instance.running or instance.delayed:
                instance.step()
    assert outputs(b) == outputs(a) and len(outputs(b)) == 6
    assert b.preemptions > 0 and b.connector.loaded_tokens > 0
    assert sorted(b.free) == list(range(14))
    check_lookups(a, a_manager)
    check_lookups(b, b_manager)
    for m in (a_manager, b_manager):
        assert m.num_live_caches == 0
        m.shutdown()


def test_async_load_finishing_after_abort_never_writes_reused_blocks() -> None:
    store = MemoryStoreConfig()
    a_manager, b_manager = make_manager(store, "abort"), make_manager(store, "abort")
    a = VllmInstance(a_manager, num_blocks=64)
    a.add(chats("a")[5])
    a.run()
    b = VllmInstance(b_manager, num_blocks=12, async_load=True)
    victim = Request("victim", chats("b")[5].prompt, 4)
    b.add(victim)
    b.step()  # the load is planned and started; vLLM waits for it
    assert victim.status == "WAITING_FOR_REMOTE_KVS" and b.connector.in_flight
    victim_blocks = list(victim.block_ids)
    b.abort("victim")  # vLLM frees the request while its load is still in flight
    other = Request("other", [9000 + i for i in range(100)], 4)
    b.add(other)
    b.step()  # the load ends here; "other" was admitted into the blocks free before
    other_blocks = set(other.block_ids)
    b.run()  # "other" reads its history every step: a late copy into its blocks would fail there
    assert not other_blocks & set(victim_blocks)  # vLLM kept them until the load ended
    assert other.output and b.connector.loaded_tokens == 0 and b_manager.num_live_caches == 0
    assert sorted(b.free) == list(range(12))
    for m in (a_manager, b_manager):
        m.shutdown()
