"""A strict downstream project, as an engine would write it against the README: a continuous-batching loop and
an event consumer. ``tests/test_typing.py`` type-checks it with pyright strict and mypy strict, with no ignore
comments: every public entry point of the manager and the cache handle is used once, with the plain ints, lists
and NumPy arrays an engine holds, and without casts."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import (
    KV_EVENT_REMOVED,
    KV_EVENT_STORED,
    LAYER_GROUP_SLIDING_WINDOW,
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheEvent,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRemovedData,
    KVCacheRequest,
    KVCacheStoredData,
    KVEvent,
    LifeCycle,
    PageView,
    PriorityCallback,
    ReuseScope,
)

TPB, ROW, NUM_LAYERS = 16, 8 * 64 * 2, 4


def build_manager(events: KVCacheEventManager | None = None) -> KVCacheManager:
    layers = [AttentionLayerConfig(i, [BufferConfig("key", TPB * ROW), BufferConfig("value", TPB * ROW)])
              for i in range(NUM_LAYERS)]
    config = KVCacheManagerConfig(tokens_per_block=TPB, layers=layers, backend="cpu", enable_stats=True,
                                  cache_tiers=[GpuCacheTierConfig(16 << 20), HostCacheTierConfig(16 << 20)])
    return KVCacheManager(config, events)


def keep_system_prompt(ordinal: int, life_cycle: LifeCycle) -> int:
    """Blocks of the shared system prompt outlive the rest (a plain int is a valid priority)."""
    return 80 if ordinal < 4 and life_cycle.window_size is None else 35


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list[int])
    cache: KVCache | None = None


class Engine:
    """Admits what fits, prefills, decodes one token a step, finishes, and preempts by suspending."""

    def __init__(self, manager: KVCacheManager, priority: PriorityCallback = keep_system_prompt) -> None:
        self.manager = manager
        self.priority = priority
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.tables: dict[int, npt.NDArray[np.int32]] = {}

    def admit(self) -> None:
        batch = [KVCacheRequest(request.prompt, capacity=len(request.prompt) + request.max_new_tokens)
                 for request in self.waiting]
        for request, cache in zip(list(self.waiting), self.manager.create_kv_cache_batch(batch)):
            if cache is None:
                cache = self.manager.create_kv_cache(ReuseScope(lora_id=None), request.prompt,
                                                     custom_priority_callback=self.priority,
                                                     expected_prompt_length=len(request.prompt))
            if not cache.resume():
                cache.close()
                break
            self.waiting.popleft()
            request.cache = cache
            self.running.append(request)

    def page_table(self, cache: KVCache, layer: int) -> list[int]:
        group = self.manager.get_layer_group_id(layer)
        table = np.full(cache.num_blocks, -1, dtype=np.int32)
        cache.set_base_page_index_buf(0, group, table)
        self.tables[cache.id] = table
        return self.manager.get_page_index_converter(layer, "key")(cache.get_base_page_indices(group))

    def step(self) -> None:
        for request in list(self.running):
            cache = request.cache
            assert cache is not None and cache.is_active
            history = cache.history_length  # tokens already in the cache (a reused prefix included)
            tokens = (request.prompt + request.output)[history:]  # the prompt's rest, then one token a step
            if not cache.resize(history + len(tokens), history):
                cache.suspend()  # preempted: back to the queue, pages kept (maybe on the host tier)
                self.running.remove(request)
                self.waiting.appendleft(request)
                continue
            self.page_table(cache, 0)  # the model would run here on these tokens' pages
            cache.commit(tokens)
            request.output.append((tokens[-1] * 31 + 7) % 32_000)
            if len(request.output) >= request.max_new_tokens:
                cache.stop_committing()
                stats = cache.commit_pending_stats()
                print(cache.id, stats.reused_blocks, cache.num_committed_tokens, cache.status, cache.reuse_scope)
                cache.close()
                self.running.remove(request)

    def inspect_memory(self) -> int:
        view: PageView = self.manager.get_page_view(0, "key")
        pages = np.from_dlpack(view)
        total = int(pages.shape[0])
        for group in range(self.manager.num_layer_groups):
            pool_group = self.manager.get_pool_group_index(group)
            total += sum(self.manager.get_slot_bytes(pool_group))
            total += self.manager.get_pool_base_address(pool_group, 0) % 2
        for layer in range(self.manager.num_layers):
            window, sinks = self.manager.get_layer_window(layer)
            total += window + sinks + self.manager.get_page_stride(layer, "value")
            total += self.manager.get_mem_pool_base_address(layer, "value") % 2
            total += self.manager.get_page_index_upper_bound(layer, "value")
        for level in range(self.manager.num_cache_levels):
            total += sum(stat.available for stat in self.manager.get_storage_statistics(level))
            total += self.manager.get_quota(level)
        total += self.manager.clamp_max_seq_len_for_mem(8, 4096) + self.manager.num_pool_groups
        if self.manager.need_adjustment:
            self.manager.adjust()
        return total


def consume_events(manager: KVCacheManager, events: KVCacheEventManager, index: dict[bytes, int]) -> None:
    """A KV-aware router's view: the manager's own events, then the TensorRT-LLM-shaped ones."""
    event: KVEvent
    for event in manager.get_latest_events():
        if event.kind == KV_EVENT_STORED:
            index[event.block_hash] = event.level
        elif event.kind == KV_EVENT_REMOVED:
            index.pop(event.block_hash, None)
    trt_event: KVCacheEvent
    for trt_event in events.get_latest_events(timeout_ms=10):
        if trt_event.layer_group_kind == LAYER_GROUP_SLIDING_WINDOW:
            continue  # this router indexes full-attention blocks only
        data = trt_event.data
        if isinstance(data, KVCacheStoredData):
            index.update((block.block_hash, block.cache_level) for block in data.blocks)
        elif isinstance(data, KVCacheRemovedData):
            for block_hash in data.block_hashes:
                index.pop(block_hash, None)


def main() -> None:
    events = KVCacheEventManager(1024)
    manager = build_manager(events)
    engine = Engine(manager)
    system = list(range(1000, 1064))
    engine.waiting.extend(Request(system + [i, i + 1], max_new_tokens=4) for i in range(8))
    index: dict[bytes, int] = {}
    print(manager.probe_reuse(None, system), manager.layer_grouping, manager.config.tokens_per_block)
    while engine.waiting or engine.running:
        engine.admit()
        engine.step()
        consume_events(manager, events, index)
        per_group = manager.get_and_reset_iteration_stats()
        print({group: delta.iter_reused_blocks for group, delta in per_group.items()}, manager.num_live_caches)
    print(engine.inspect_memory(), manager.get_committed_stats(), manager.get_iteration_stats(),
          manager.movement_counters, manager.get_remote_tier_statistics(), manager.backend)
    manager.resize(1, 8 << 20)
    manager.clear_reusable_blocks()
    manager.shutdown()


if __name__ == "__main__":
    main()
