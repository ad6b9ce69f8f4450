"""The world ``tests/test_bad_inputs.py`` calls bad input against: a manager with caches in every state, the
row type of the tables (``tests/bad_input_rows_*.py``) and the small builders the rows share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HalfOpenRange,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    PageIndexConverter,
    ReuseScope,
    ScratchDesc,
    SsmLayerConfig,
    _KVCache,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.fuzz.checks import snapshot

TPB = 16
KIB = 1024
SLOT_BYTES = 3 * 2 * 512 + 2 * 1024  # SWA pool group (3 layers, K/V 512) + full pool group (K/V 1024)
IMAGE = b"img".ljust(32, b".")  # a multimodal digest: 32 bytes
TYPICAL = BatchDesc([KVCacheDesc(128, 112)] * 4)  # splits quotas so both pool groups get room


def kv(size: int) -> list[BufferConfig]:
    return [BufferConfig("key", size), BufferConfig("value", size)]


def world_layers() -> list[LayerConfig]:
    """Three SWA layers with sinks (K/V 512 B per block) and one full layer with larger heads: two pool groups."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(i, kv(512), sliding_window_size=48, num_sink_tokens=4) for i in range(3)
    ]
    layers.append(AttentionLayerConfig(3, kv(1024)))
    return layers


def world_config(**kwargs: object) -> KVCacheManagerConfig:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(64 * SLOT_BYTES), HostCacheTierConfig(32 * SLOT_BYTES)]
    options: dict[str, object] = {"backend": "cpu", "typical_step": TYPICAL, **kwargs}
    return KVCacheManagerConfig(
        tokens_per_block=TPB,
        layers=world_layers(),
        cache_tiers=tiers,
        **options,  # type: ignore[arg-type]
    )


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


@dataclass
class World:
    """A manager with caches in every state: ``active`` (computed and committed), ``suspended`` (reused a
    prefix), ``stopped`` (active, committing stopped, an exact-size page table registered), ``closed``."""

    manager: KVCacheManager
    engine: FakeEngine
    active: _KVCache
    suspended: _KVCache
    stopped: _KVCache
    closed: _KVCache
    tokens: dict[int, list[int]]
    table: npt.NDArray[np.int32]

    @property
    def caches(self) -> list[_KVCache]:
        return [self.active, self.suspended, self.stopped, self.closed]

    def probes(self) -> list[tuple[ReuseScope | None, list[int | bytes]]]:
        probes: list[tuple[ReuseScope | None, list[int | bytes]]] = [(None, list(t)) for t in self.tokens.values()]
        probes.append((ReuseScope(lora_id=0), list(self.tokens[0])))
        return probes

    def snapshot(self) -> dict[str, object]:
        state = snapshot(self.manager, self.caches, self.probes())
        state["table"] = self.table.tolist()
        for cache in (self.active, self.stopped):
            self.engine.check(cache, self.tokens[cache.id])
        return state


def build_world() -> World:
    manager = KVCacheManager(world_config())
    engine = FakeEngine(manager)
    tokens = {i: tokens_of(i, 200) for i in range(4)}

    def computed(cache_id: int, capacity: int, commit: int) -> _KVCache:
        cache = manager.create_kv_cache(None, tokens[cache_id][:capacity], id=cache_id)
        assert cache.resume() and cache.resize(capacity)
        engine.step(cache, tokens[cache_id])
        cache.commit(tokens[cache_id][cache.num_committed_tokens : commit])
        return cache

    active = computed(0, 90, 70)
    tokens[1] = tokens[0][:64] + tokens[1][64:]  # shares 4 blocks with `active`
    suspended = computed(1, 100, 100)
    suspended.suspend()
    stopped = computed(2, 60, 50)
    stopped.stop_committing()
    table = np.full(stopped.num_blocks, -9, dtype=np.int32)
    stopped.set_base_page_index_buf(0, 1, table)
    closed = computed(3, 80, 80)
    closed.close()
    manager.check_invariants()
    return World(manager, engine, active, suspended, stopped, closed, tokens, table)


# ------------------------------------------------------------------------------------------- the tables' rows
Call = Callable[[World], object]


@dataclass(frozen=True)
class Bad:
    name: str
    call: Call
    error: type[Exception]
    match: str  # regex the message must contain: the argument's name or the bad value


def scratch_manager() -> KVCacheManager:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, kv(512), sliding_window_size=32),
        AttentionLayerConfig(1, kv(512)),
    ]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(64 * 4 * 512)]
    return KVCacheManager(KVCacheManagerConfig(TPB, cache_tiers=tiers, layers=layers, backend="cpu", enable_swa_scratch_reuse=True))


def config_with(**kwargs: object) -> Call:
    return lambda w: world_config(**kwargs)


GPU = [GpuCacheTierConfig(64 * SLOT_BYTES)]
SSM = SsmLayerConfig(9, [BufferConfig("ssm_state", 4096)])


def world_config_disk(path: str) -> KVCacheManagerConfig:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(64 * SLOT_BYTES), DiskCacheTierConfig(32 * SLOT_BYTES, path)]
    return KVCacheManagerConfig(TPB, cache_tiers=tiers, layers=world_layers(), backend="cpu", typical_step=TYPICAL)


def read_only_table() -> npt.NDArray[np.int32]:
    table = np.zeros(16, np.int32)
    table.setflags(write=False)
    return table


def converter(w: World) -> PageIndexConverter:
    return w.manager.get_page_index_converter(0, "value")


def one_scratch() -> ScratchDesc:
    return ScratchDesc(HalfOpenRange(0, 1), (0,))


def resize_with_priority(w: World, priority: object) -> None:
    """A cache whose priority callback returns ``priority``: its first new page is refused. Closed afterwards, so
    the world is as before."""
    callback = lambda _ordinal, _group: priority  # noqa: E731
    cache = w.manager.create_kv_cache(custom_priority_callback=callback)  # type: ignore[arg-type]
    try:
        assert cache.resume()
        cache.resize(TPB)
    finally:
        cache.close()
