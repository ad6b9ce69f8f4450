"""Bad input across the public API (SPEC §11), table-driven.

Every row calls one public entry point with one bad argument and asserts the exception type (``ValueError``;
``TypeError`` for a wrong Python type), that its message names the argument or the value, and that the manager
and every cache are exactly as before: lengths and status of each cache, base page indices of every layer
group, a registered page table, storage statistics and quota of every level, reuse probes of known prompts,
movement counters, FakeEngine content, and ``check_invariants``.

Compiled mode: mypyc checks parameters declared with a concrete type (``role: str``, ``index_mode:
PageIndexMode``, ``digest: bytes``, ...) itself and raises ``TypeError("str object expected; got int")``, which
names the type rather than the argument; those rows accept either message. ``SupportsIndex`` parameters are
checked by the package in both modes.

NumPy integers are accepted wherever ints are: see ``NUMPY_ROWS``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import numpy.typing as npt
import pytest

import kv_cache_manager_v2
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
    PageIndexMode,
    ReuseScope,
    ScratchDesc,
    SsmLayerConfig,
    SwaScratchReuseConfig,
    _KVCache,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.fuzz.checks import assert_unchanged, snapshot

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


@pytest.fixture
def world() -> Iterator[World]:
    w = build_world()
    yield w
    for cache in w.caches:
        cache.close()
    w.manager.check_invariants()
    if w.manager.num_live_caches == 0:  # a row that wrongly succeeded may have left a cache open
        w.manager.shutdown()


# ------------------------------------------------------------------------------------------- the table
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

BAD_INPUTS: list[Bad] = [
    # --- create_kv_cache / probe_reuse
    Bad("create: tokens is a str", lambda w: w.manager.create_kv_cache(None, "hello"), TypeError, "input_tokens"),  # type: ignore[arg-type]
    Bad("create: float token", lambda w: w.manager.create_kv_cache(None, [1, 2.5]), TypeError, r"input_tokens\[1\]"),  # type: ignore[list-item]
    Bad("create: None token", lambda w: w.manager.create_kv_cache(None, [1, None]), TypeError, r"input_tokens\[1\]"),  # type: ignore[list-item]
    Bad("create: bool token", lambda w: w.manager.create_kv_cache(None, [True]), TypeError, r"input_tokens\[0\]"),
    Bad(
        "create: numpy float tokens",
        lambda w: w.manager.create_kv_cache(None, np.array([1.5])),
        TypeError,
        r"input_tokens\[0\]",
    ),
    Bad("create: tokens not iterable", lambda w: w.manager.create_kv_cache(None, 5), TypeError, "input_tokens"),  # type: ignore[arg-type]
    Bad("create: float id", lambda w: w.manager.create_kv_cache(id=1.5), TypeError, r"\bid\b"),  # type: ignore[arg-type]
    Bad("create: str id", lambda w: w.manager.create_kv_cache(id="7"), TypeError, r"\bid\b"),  # type: ignore[arg-type]
    Bad("create: bool id", lambda w: w.manager.create_kv_cache(id=True), TypeError, r"\bid\b"),
    Bad("create: duplicate id", lambda w: w.manager.create_kv_cache(id=w.active.id), ValueError, "id 0"),
    Bad(
        "create: scope is a str",
        lambda w: w.manager.create_kv_cache("tenant"),  # type: ignore[arg-type]
        TypeError,
        "reuse_scope|ReuseScope",
    ),
    Bad(
        "create: priority callback not callable",
        lambda w: w.manager.create_kv_cache(custom_priority_callback=5),  # type: ignore[arg-type]
        TypeError,
        "custom_priority_callback",
    ),
    Bad(
        "create: float expected_prompt_length",
        lambda w: w.manager.create_kv_cache(expected_prompt_length=2.0),  # type: ignore[arg-type]
        TypeError,
        "expected_prompt_length",
    ),
    Bad(
        "create: negative expected_prompt_length",
        lambda w: w.manager.create_kv_cache(expected_prompt_length=-1).close(),
        ValueError,
        "expected_prompt_length",
    ),
    Bad(
        "create: 2-D numpy tokens",
        lambda w: w.manager.create_kv_cache(None, np.zeros((2, 3), np.int64)),
        TypeError,
        "input_tokens",
    ),
    Bad(
        "create: scope with a float lora_id",
        lambda w: w.manager.create_kv_cache(ReuseScope(lora_id=1.5)),  # type: ignore[arg-type]
        TypeError,
        "lora_id|int or None",
    ),
    Bad(
        "probe: scope with a str lora_id",
        lambda w: w.manager.probe_reuse(ReuseScope(lora_id="7"), [1]),  # type: ignore[arg-type]
        TypeError,
        "lora_id|int or None",
    ),
    Bad(
        "create: scope with a salt UTF-8 cannot encode",  # its key is the salt's UTF-8 bytes
        lambda w: w.manager.create_kv_cache(ReuseScope(salt="tenant-\udc80"), [1, 2]),
        ValueError,
        r"ReuseScope\.salt",
    ),
    Bad(
        "probe: scope is an int",
        lambda w: w.manager.probe_reuse(3, [1]),  # type: ignore[arg-type]
        TypeError,
        "reuse_scope|ReuseScope",
    ),
    # --- manager: levels, quotas, shutdown
    Bad("quota: unknown level", lambda w: w.manager.resize(2, SLOT_BYTES), ValueError, "level 2"),
    Bad("quota: negative quota", lambda w: w.manager.resize(1, -1), ValueError, "quota"),
    Bad("quota: float quota", lambda w: w.manager.resize(1, 1.5e6), TypeError, "quota"),  # type: ignore[arg-type]
    Bad("quota: bool quota", lambda w: w.manager.resize(1, True), TypeError, "quota"),
    Bad("quota: str level", lambda w: w.manager.resize("0", SLOT_BYTES), TypeError, "level"),  # type: ignore[arg-type]
    Bad("quota: with an active cache", lambda w: w.manager.resize(0, 32 * SLOT_BYTES), ValueError, "active"),
    Bad("get_quota: negative level", lambda w: w.manager.get_quota(-1), ValueError, "level -1"),
    Bad("statistics: unknown level", lambda w: w.manager.get_storage_statistics(5), ValueError, "level 5"),
    Bad(
        "statistics: level None",
        lambda w: w.manager.get_storage_statistics(None),  # type: ignore[arg-type]
        TypeError,
        "level",
    ),
    Bad("shutdown with open caches", lambda w: w.manager.shutdown(), RuntimeError, "still open"),
    # --- manager: layers, roles, groups, addressing
    Bad("converter: unknown layer", lambda w: w.manager.get_page_index_converter(99, "key"), ValueError, "99"),
    Bad("converter: unknown role", lambda w: w.manager.get_page_index_converter(0, "query"), ValueError, "query"),
    Bad(
        "converter: role is an int",
        lambda w: w.manager.get_page_index_converter(0, 5),  # type: ignore[arg-type]
        TypeError,
        "role|str object",
    ),
    Bad(
        "converter: float layer id",
        lambda w: w.manager.get_page_index_converter(0.0, "key"),  # type: ignore[arg-type]
        TypeError,
        "layer_id",
    ),
    Bad("stride: bool layer id", lambda w: w.manager.get_page_stride(True, "key"), TypeError, "layer_id"),
    Bad("stride: unknown role", lambda w: w.manager.get_page_stride(3, "ssm_state"), ValueError, "ssm_state"),
    Bad(
        "base address: mode is a str",
        lambda w: w.manager.get_mem_pool_base_address(0, "key", "SHARED"),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "upper bound: mode is an int",
        lambda w: w.manager.get_page_index_upper_bound(0, "key", 1),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "page view: mode None",
        lambda w: w.manager.get_page_view(0, "key", None),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "supports_index_mode: str",
        lambda w: w.manager.supports_index_mode("SHARED"),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "base address: SHARED with scratch reuse",
        lambda w: scratch_manager().get_mem_pool_base_address(0, "key"),
        ValueError,
        "index_mode",
    ),
    Bad("layer window: unknown layer", lambda w: w.manager.get_layer_window(42), ValueError, "42"),
    Bad("layer group id: negative layer", lambda w: w.manager.get_layer_group_id(-1), ValueError, "-1"),
    Bad(
        "pool group index: unknown layer group",
        lambda w: w.manager.get_pool_group_index(7),
        ValueError,
        "layer_group_id 7",
    ),
    Bad("pool base address: unknown pool", lambda w: w.manager.get_pool_base_address(0, 9), ValueError, "pool 9"),
    Bad(
        "pool base address: unknown pool group",
        lambda w: w.manager.get_pool_base_address(5, 0),
        ValueError,
        "pool_group 5",
    ),
    Bad("pool base address: unknown level", lambda w: w.manager.get_pool_base_address(0, 0, 4), ValueError, "level 4"),
    Bad("slot bytes: negative pool group", lambda w: w.manager.get_slot_bytes(-1), ValueError, "pool_group -1"),
    Bad(
        "multimodal: digest is a str",
        lambda w: w.manager.gen_multimodal_cache_key_tokens("img", 4, 0),  # type: ignore[arg-type]
        TypeError,
        "digest|bytes",
    ),
    Bad(
        "multimodal: zero tokens",
        lambda w: w.manager.gen_multimodal_cache_key_tokens(IMAGE, 0, 100),
        ValueError,
        "num_tokens",
    ),
    Bad(
        "multimodal: no id_offset without vocab_size",
        lambda w: w.manager.gen_multimodal_cache_key_tokens(IMAGE, 4),
        ValueError,
        "id_offset",
    ),
    Bad(
        "multimodal: float num_tokens",
        lambda w: w.manager.gen_multimodal_cache_key_tokens(IMAGE, 4.0, 100),  # type: ignore[arg-type]
        TypeError,
        "num_tokens",
    ),
    # --- cache: resize and the length setters
    Bad("resize: negative capacity", lambda w: w.active.resize(-1), ValueError, "capacity"),
    Bad("resize: float capacity", lambda w: w.active.resize(100.0), TypeError, "capacity"),  # type: ignore[arg-type]
    Bad(
        "resize: numpy float capacity",
        lambda w: w.active.resize(np.float64(100)),  # type: ignore[arg-type]
        TypeError,
        "capacity",
    ),
    Bad("resize: str capacity", lambda w: w.active.resize("100"), TypeError, "capacity"),  # type: ignore[arg-type]
    Bad("resize: capacity None", lambda w: w.active.resize(None), TypeError, "capacity"),  # type: ignore[arg-type]
    Bad("resize: bool history", lambda w: w.active.resize(90, True), TypeError, "history_length"),
    Bad("resize: history moves backwards", lambda w: w.active.resize(90, 69), ValueError, "history_length 69"),
    Bad("resize: history beyond capacity", lambda w: w.active.resize(90, 91), ValueError, "history_length 91"),
    Bad("resize: capacity below history", lambda w: w.active.resize(60), ValueError, "capacity 60"),
    Bad("resize: grows past a registered page table", lambda w: w.stopped.resize(80), ValueError, "buffer"),
    Bad("capacity setter: negative", lambda w: setattr(w.active, "capacity", -5), ValueError, "capacity"),
    Bad("capacity setter: float", lambda w: setattr(w.active, "capacity", 95.0), TypeError, "capacity"),
    Bad(
        "history setter: backwards",
        lambda w: setattr(w.active, "history_length", 10),
        ValueError,
        "history_length 10",
    ),
    Bad("history setter: str", lambda w: setattr(w.active, "history_length", "80"), TypeError, "history_length"),
    Bad(
        "resize: priority callback returns 101",
        lambda w: resize_with_priority(w, 101),
        ValueError,
        "custom_priority_callback",
    ),
    Bad(
        "resize: priority callback returns a float",
        lambda w: resize_with_priority(w, 5.5),
        TypeError,
        "custom_priority_callback|int object",
    ),
    # --- cache: commit
    Bad("commit: beyond capacity", lambda w: w.active.commit(list(range(21))), ValueError, "capacity 90"),
    Bad("commit: tokens is a str", lambda w: w.active.commit("abc"), TypeError, "tokens"),  # type: ignore[arg-type]
    Bad("commit: float token", lambda w: w.active.commit([1.0]), TypeError, r"tokens\[0\]"),  # type: ignore[list-item]
    Bad("commit: numpy float tokens", lambda w: w.active.commit(np.array([1.0, 2.0])), TypeError, r"tokens\[0\]"),
    Bad("commit: tokens None", lambda w: w.active.commit(None), TypeError, "tokens"),  # type: ignore[arg-type]
    Bad("commit after stop_committing", lambda w: w.stopped.commit([1]), ValueError, "stop_committing"),
    # --- cache: page tables
    Bad("indices: unknown layer group", lambda w: w.active.get_base_page_indices(9), ValueError, "layer_group_id 9"),
    Bad("indices: beam 1", lambda w: w.active.get_base_page_indices(0, 1), ValueError, "beam_id 1"),
    Bad(
        "indices: str layer group",
        lambda w: w.active.get_base_page_indices("0"),  # type: ignore[arg-type]
        TypeError,
        "layer_group_id",
    ),
    Bad(
        "table: too short",
        lambda w: w.active.set_base_page_index_buf(0, 0, np.zeros(2, np.int32)),
        ValueError,
        "fewer than",
    ),
    Bad("table: int64", lambda w: w.active.set_base_page_index_buf(0, 0, np.zeros(16, np.int64)), ValueError, "int32"),
    Bad(
        "table: 2-D",
        lambda w: w.active.set_base_page_index_buf(0, 0, np.zeros((4, 16), np.int32)),
        ValueError,
        "ndim|1-D",
    ),
    Bad(
        "table: read-only",
        lambda w: w.active.set_base_page_index_buf(0, 0, read_only_table()),
        ValueError,
        "writable",
    ),
    Bad("table: bytes object", lambda w: w.active.set_base_page_index_buf(0, 0, bytes(64)), ValueError, "writable"),
    Bad("table: not a buffer", lambda w: w.active.set_base_page_index_buf(0, 0, 5), TypeError, "buf"),  # type: ignore[arg-type]
    Bad(
        "table: unknown layer group",
        lambda w: w.active.set_base_page_index_buf(0, 5, np.zeros(16, np.int32)),
        ValueError,
        "layer_group_id 5",
    ),
    Bad(
        "table: beam 1",
        lambda w: w.active.set_base_page_index_buf(1, 0, np.zeros(16, np.int32)),
        ValueError,
        "beam_idx 1",
    ),
    Bad(
        "table: non-contiguous",
        lambda w: w.active.set_base_page_index_buf(0, 0, np.zeros(32, np.int32)[::2]),
        ValueError,
        "buf",
    ),
    # --- cache: resume
    Bad(
        "resume: str stream",
        lambda w: w.suspended.resume("stream"),  # type: ignore[arg-type]
        TypeError,
        "cuda_stream",
    ),
    Bad("resume: float stream", lambda w: w.active.resume(1.5), TypeError, "cuda_stream"),  # type: ignore[arg-type]
    # --- operations needing an active cache, on a suspended one
    Bad("suspended: resize", lambda w: w.suspended.resize(120), ValueError, "suspended"),
    Bad("suspended: commit", lambda w: w.suspended.commit([1]), ValueError, "suspended"),
    Bad("suspended: capacity setter", lambda w: setattr(w.suspended, "capacity", 120), ValueError, "suspended"),
    Bad("suspended: history setter", lambda w: setattr(w.suspended, "history_length", 100), ValueError, "suspended"),
    # --- every operation on a closed cache
    Bad("closed: resume", lambda w: w.closed.resume(), ValueError, "closed"),
    Bad("closed: suspend", lambda w: w.closed.suspend(), ValueError, "closed"),
    Bad("closed: resize", lambda w: w.closed.resize(96), ValueError, "closed"),
    Bad("closed: commit", lambda w: w.closed.commit([1]), ValueError, "closed"),
    Bad("closed: stop_committing", lambda w: w.closed.stop_committing(), ValueError, "closed"),
    Bad("closed: capacity setter", lambda w: setattr(w.closed, "capacity", 96), ValueError, "closed"),
    Bad("closed: history setter", lambda w: setattr(w.closed, "history_length", 80), ValueError, "closed"),
    Bad(
        "closed: set_base_page_index_buf",
        lambda w: w.closed.set_base_page_index_buf(0, 0, np.zeros(16, np.int32)),
        ValueError,
        "closed",
    ),
    Bad(
        "closed: get_base_page_indices",
        lambda w: w.closed.get_base_page_indices(0),
        ValueError,
        "closed",
    ),
    # the engine's other address reads: a closed cache has no pages, so an answer (0, None, -1) would be read as one
    Bad("closed: get_num_front_blocks_removed", lambda w: w.closed.get_num_front_blocks_removed(1), ValueError, "closed"),
    Bad("closed: get_scratch_desc", lambda w: w.closed.get_scratch_desc(0), ValueError, "closed"),
    Bad("closed: get_ssm_block_base_index", lambda w: w.closed.get_ssm_block_base_index(0), ValueError, "closed"),
    # --- PageIndexConverter: index modes, scratch descriptors
    Bad(
        "converter: scratch with SHARED",
        lambda w: converter(w)([0, 1], PageIndexMode.SHARED, one_scratch()),
        ValueError,
        "scratch",
    ),
    Bad(
        "converter: scratch without a mode",
        lambda w: converter(w)([0, 1], None, one_scratch()),
        ValueError,
        "scratch",
    ),
    Bad(
        "converter: scratch is a str",
        lambda w: converter(w)([0], PageIndexMode.PER_LAYER, "scratch"),  # type: ignore[arg-type]
        TypeError,
        "scratch|ScratchDesc",
    ),
    Bad(
        "converter: mode is a str",
        lambda w: converter(w)([0], "PER_LAYER"),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "converter: float index",
        lambda w: converter(w)([0, 0.5]),  # type: ignore[list-item]
        TypeError,
        "base_indices",
    ),
    Bad("converter: index below -1", lambda w: converter(w)([3, -2]), ValueError, "-2"),
    Bad(
        "converter: scratch descriptor with too few slots",
        lambda w: converter(w)([0] * 8, PageIndexMode.PER_LAYER, ScratchDesc(HalfOpenRange(0, 8), (0,))),
        ValueError,
        "scratch descriptor",
    ),
    Bad(
        "converter: base_indices None",
        lambda w: converter(w)(None),  # type: ignore[arg-type]
        TypeError,
        "base_indices",
    ),
    # --- invalid configs
    Bad("config: buffer size 0", lambda w: BufferConfig("key", 0), ValueError, "BufferConfig.size"),
    Bad(
        "config: float buffer size",
        lambda w: BufferConfig("key", 512.0),  # type: ignore[arg-type]
        TypeError,
        "BufferConfig.size",
    ),
    Bad("config: empty role", lambda w: BufferConfig("", 512), ValueError, "BufferConfig.role"),
    Bad(
        "config: role is an int",
        lambda w: BufferConfig(1, 512),  # type: ignore[arg-type]
        TypeError,
        "BufferConfig.role",
    ),
    Bad(
        "config: tokens_per_block_override 0",
        lambda w: BufferConfig("key", 512, 0),
        ValueError,
        "tokens_per_block_override",
    ),
    Bad("config: no buffers", lambda w: AttentionLayerConfig(0, []), ValueError, "buffers"),
    Bad(
        "config: duplicate role",
        lambda w: AttentionLayerConfig(0, [BufferConfig("key", 8), BufferConfig("key", 8)]),
        ValueError,
        "key",
    ),
    Bad(
        "config: str layer id",
        lambda w: AttentionLayerConfig("0", kv(512)),  # type: ignore[arg-type]
        TypeError,
        "layer_id",
    ),
    Bad(
        "config: window 0",
        lambda w: AttentionLayerConfig(0, kv(512), sliding_window_size=0),
        ValueError,
        "sliding_window_size",
    ),
    Bad(
        "config: sinks without a window",
        lambda w: AttentionLayerConfig(0, kv(512), num_sink_tokens=4),
        ValueError,
        "num_sink_tokens",
    ),
    Bad("config: negative sinks", lambda w: AttentionLayerConfig(0, kv(512), 64, -1), ValueError, "num_sink_tokens"),
    Bad(
        "config: SSM buffer with override",
        lambda w: SsmLayerConfig(0, [BufferConfig("ssm_state", 64, 8)]),
        ValueError,
        "tokens_per_block_override",
    ),
    Bad("config: GPU quota -1", lambda w: GpuCacheTierConfig(-1), ValueError, "quota"),
    Bad("config: GPU quota None", lambda w: GpuCacheTierConfig(None), TypeError, "quota"),  # type: ignore[arg-type]
    Bad("config: max_quota below quota", lambda w: HostCacheTierConfig(1000, max_quota=10), ValueError, "max_quota"),
    Bad(
        "config: disk path is an int",
        lambda w: DiskCacheTierConfig(1000, 5),  # type: ignore[arg-type]
        TypeError,
        "path",
    ),
    Bad("config: KVCacheDesc history beyond capacity", lambda w: KVCacheDesc(10, 20), ValueError, "history_length"),
    Bad("config: negative system_prompt_length", lambda w: BatchDesc([], -1), ValueError, "system_prompt_length"),
    Bad("config: negative max_rewind_len", lambda w: SwaScratchReuseConfig(-1), ValueError, "max_rewind_len"),
    Bad(
        "config: tokens_per_block 0",
        lambda w: KVCacheManagerConfig(0, cache_tiers=GPU, layers=world_layers()),
        ValueError,
        "tokens_per_block",
    ),
    Bad(
        "config: float tokens_per_block",
        lambda w: KVCacheManagerConfig(16.0, cache_tiers=GPU, layers=world_layers()),  # type: ignore[arg-type]
        TypeError,
        "tokens_per_block",
    ),
    Bad("config: no layers", lambda w: KVCacheManagerConfig(TPB, cache_tiers=GPU, layers=[]), ValueError, "layers"),
    Bad(
        "config: duplicate layer id",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=GPU, layers=world_layers() * 2),
        ValueError,
        "layer_id",
    ),
    Bad("config: no tiers", lambda w: KVCacheManagerConfig(TPB, cache_tiers=[], layers=world_layers()), ValueError, "cache_tiers"),
    Bad(
        "config: first tier not GPU",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=[HostCacheTierConfig(10**6)], layers=world_layers()),
        ValueError,
        "cache_tiers",
    ),
    Bad(
        "config: a GPU tier after a host tier",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=[*GPU, HostCacheTierConfig(1 << 20), *GPU], layers=world_layers()),
        ValueError,
        "cache_tiers",
    ),
    Bad(
        "manager: a second GPU tier without cold_page_codec",
        lambda w: KVCacheManager(KVCacheManagerConfig(TPB, cache_tiers=GPU * 2, layers=world_layers(), backend="cpu")),
        ValueError,
        "cold_page_codec",
    ),
    Bad("config: unknown backend", config_with(backend="tpu"), ValueError, "backend"),
    Bad("config: max_util_for_resume 0", config_with(max_util_for_resume=0.0), ValueError, "max_util_for_resume"),
    Bad("config: max_util_for_resume 1.5", config_with(max_util_for_resume=1.5), ValueError, "max_util_for_resume"),
    Bad("config: max_util_for_resume str", config_with(max_util_for_resume="high"), TypeError, "max_util_for_resume"),
    Bad("config: vocab_size 0", config_with(vocab_size=0), ValueError, "vocab_size"),
    Bad("config: enable_partial_reuse str", config_with(enable_partial_reuse="yes"), TypeError, "enable_partial_reuse"),
    Bad(
        "config: scratch reuse flag is an int",
        config_with(enable_swa_scratch_reuse=1),
        TypeError,
        "enable_swa_scratch_reuse",
    ),
    Bad(
        "config: override not dividing tokens_per_block",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=GPU, layers=[AttentionLayerConfig(0, [BufferConfig("key", 512, 5)])]),
        ValueError,
        "tokens_per_block_override",
    ),
    Bad(
        "config: ssm_reuse_interval not a multiple of tokens_per_block",
        lambda w: KVCacheManagerConfig(TPB, cache_tiers=GPU, layers=[*world_layers(), SSM], ssm_reuse_interval=24),
        ValueError,
        "ssm_reuse_interval",
    ),
    Bad(
        "manager: config is a dict",
        lambda w: KVCacheManager({"tokens_per_block": 16}),  # type: ignore[arg-type]
        TypeError,
        "config|KVCacheManagerConfig",
    ),
    Bad(
        "manager: GPU quota leaves a pool group no slot",
        lambda w: KVCacheManager(KVCacheManagerConfig(TPB, cache_tiers=[GpuCacheTierConfig(1024)], layers=world_layers(), backend="cpu")),
        ValueError,
        "quota",
    ),
    Bad(
        "manager: disk path does not exist",
        lambda w: KVCacheManager(world_config_disk("/nonexistent/kv-cache-dir")),
        ValueError,
        "nonexistent",
    ),
]


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


@pytest.mark.parametrize("row", [pytest.param(row, id=row.name) for row in BAD_INPUTS])
def test_bad_input_is_rejected_and_changes_nothing(row: Bad, world: World) -> None:
    before = world.snapshot()
    with pytest.raises(row.error, match=row.match):
        row.call(world)
    assert_unchanged(before, world.snapshot(), row.name)
    world.manager.check_invariants()


def test_the_table_is_wide() -> None:
    assert len(BAD_INPUTS) >= 40
    assert len({row.name for row in BAD_INPUTS}) == len(BAD_INPUTS)


# -------------------------------------------------------------------------------- NumPy integers accepted
def _numpy_converter(w: World) -> None:
    per_layer = PageIndexMode.PER_LAYER
    assert w.manager.get_page_index_converter(np.int32(3), "key") == w.manager.get_page_index_converter(3, "key")
    convert = w.manager.get_page_index_converter(np.int64(1), "value")
    # NumPy arrays are not typing.Sequence, though the converter takes them at run time.
    table = np.array([0, -1, 2], np.int32)
    assert convert(table, per_layer) == convert([0, -1, 2], per_layer)
    assert convert(np.array([5], np.int64)) == convert([5])


def _numpy_addressing(w: World) -> None:
    m = w.manager
    assert m.get_page_stride(np.int64(3), "value") == m.get_page_stride(3, "value")
    shared = PageIndexMode.SHARED
    assert m.get_mem_pool_base_address(np.int64(2), "key", shared) == m.get_mem_pool_base_address(2, "key")
    assert m.get_page_index_upper_bound(np.int16(1), "key") == m.get_page_index_upper_bound(1, "key")
    assert m.get_layer_window(np.int64(0)) == (48, 4)
    assert m.get_layer_group_id(np.int32(3)) == m.get_layer_group_id(3)
    assert m.get_pool_group_index(np.int64(1)) == m.get_pool_group_index(1)
    assert m.get_slot_bytes(np.int32(0)) == m.get_slot_bytes(0)
    assert m.get_pool_base_address(np.int64(1), np.int32(0), np.int64(1)) == m.get_pool_base_address(1, 0, 1)


def _numpy_levels(w: World) -> None:
    m = w.manager
    assert m.get_storage_statistics(np.int64(1)) == m.get_storage_statistics(1)
    assert m.get_quota(np.int8(0)) == m.get_quota(0)
    assert m.gen_multimodal_cache_key_tokens(IMAGE, np.int64(4), np.int32(100)) == [IMAGE, 101, 102, 103]


def _numpy_tokens(w: World) -> None:
    sequence = w.tokens[1][:64] + tokens_of(7, 136)  # shares 4 blocks with the suspended cache
    prompt = sequence[:90]
    expected = w.manager.probe_reuse(None, prompt)
    assert expected == 64
    assert w.manager.probe_reuse(None, np.array(prompt, np.int64)) == expected
    assert w.manager.probe_reuse(None, np.array(prompt, np.int32)) == expected
    cache = w.manager.create_kv_cache(None, np.array(prompt), id=np.int64(500), expected_prompt_length=np.int32(90))
    assert cache.id == 500 and cache.num_committed_tokens == expected
    assert cache.resume(np.int64(3))
    assert cache.resize(np.int64(90), np.int32(64))
    w.engine.step(cache, sequence)
    cache.commit(np.array(prompt[64:], np.int32))
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (90, 90, 90)
    cache.close()


def _numpy_lengths(w: World) -> None:
    cache = w.active
    assert cache.resize(np.int64(100), np.int64(75))
    assert (cache.capacity, cache.history_length) == (100, 75)
    cache.capacity = np.int32(110)
    cache.history_length = np.uint16(80)
    assert (cache.capacity, cache.history_length) == (110, 80)
    w.engine.step(cache, w.tokens[0])
    assert list(cache.get_base_page_indices(np.int64(1), np.int64(0))) == list(cache.get_base_page_indices(1))
    table = np.full(16, -9, np.int32)
    cache.set_base_page_index_buf(np.int64(0), np.int32(1), table)
    assert table[: cache.num_blocks].tolist() == list(cache.get_base_page_indices(1))


def _numpy_quota(w: World) -> None:
    w.active.suspend()
    w.stopped.suspend()
    quota = w.manager.get_quota(1)
    assert w.manager.resize(np.int64(1), np.int64(quota // 2))
    assert w.manager.get_quota(1) == quota // 2
    assert w.manager.resize(np.int32(1), np.uint32(quota))


def _numpy_configs(w: World) -> None:
    buffer = BufferConfig("key", np.int64(4096), np.int32(8))  # type: ignore[arg-type]
    assert buffer.size == 4096 and type(buffer.size) is int and buffer.tokens_per_block_override == 8
    layer = AttentionLayerConfig(
        np.int32(0),  # type: ignore[arg-type]
        [buffer, BufferConfig("value", np.int64(4096), np.int32(8))],  # type: ignore[arg-type]
        sliding_window_size=np.int64(64),  # type: ignore[arg-type]
        num_sink_tokens=np.int64(4),  # type: ignore[arg-type]
    )
    full = AttentionLayerConfig(np.int64(1), kv(4096))  # type: ignore[arg-type]
    desc = KVCacheDesc(np.int64(128), np.int32(100))  # type: ignore[arg-type]
    config = KVCacheManagerConfig(
        np.int64(16),  # type: ignore[arg-type]
        cache_tiers=[GpuCacheTierConfig(np.int64(2 * 1024 * 1024), max_quota=np.int64(4 * 1024 * 1024))], layers=[layer, full],  # type: ignore[arg-type]
        vocab_size=np.int32(32_000),  # type: ignore[arg-type]
        backend="cpu",
        ssm_reuse_interval=np.int64(32),  # type: ignore[arg-type]
        typical_step=BatchDesc([desc] * 2, np.int16(0)),  # type: ignore[arg-type]
        swa_scratch_reuse=SwaScratchReuseConfig(np.int64(0)),  # type: ignore[arg-type]
    )
    manager = KVCacheManager(config)
    assert manager.tokens_per_block == 16 and manager.get_layer_window(0) == (64, 4)
    cache = manager.create_kv_cache(None, np.arange(40))
    assert cache.resume() and cache.resize(np.int64(40))
    cache.close()
    manager.shutdown()


def _numpy_scope(w: World) -> None:
    scope = ReuseScope(lora_id=np.int64(0))  # type: ignore[arg-type]
    assert w.manager.probe_reuse(scope, w.tokens[0]) == w.manager.probe_reuse(ReuseScope(lora_id=0), w.tokens[0])


NUMPY_ROWS: list[tuple[str, Callable[[World], None]]] = [
    ("converter and its call", _numpy_converter),
    ("addressing API", _numpy_addressing),
    ("levels, quotas, multimodal tokens", _numpy_levels),
    ("token arrays, id, expected_prompt_length, cuda_stream, resize, commit", _numpy_tokens),
    ("resize, setters, page tables", _numpy_lengths),
    ("manager.resize", _numpy_quota),
    ("configs and a manager built from them", _numpy_configs),
]


NUMPY_ROWS.append(("ReuseScope lora_id", _numpy_scope))


@pytest.mark.parametrize("row", [pytest.param(call, id=name) for name, call in NUMPY_ROWS])
def test_numpy_integers_are_accepted(row: Callable[[World], None], world: World) -> None:
    row(world)
    world.manager.check_invariants()


def test_impossible_capacity_is_refused_without_exhausting_memory() -> None:
    """SPEC §2/§11: a capacity that cannot fit is a memory shortage: ``resize`` returns False. Work and memory
    used to grow with the requested block count (2**62: the process was killed), so the check runs in a child
    process limited to 1 GiB of address space."""
    resource = pytest.importorskip("resource")
    assert resource is not None
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "sys.path[:0] = sys.argv[1:]\n"
        "from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCacheManager, "
        "KVCacheManagerConfig\n"
        "layer = AttentionLayerConfig(0, [BufferConfig('key', 512), BufferConfig('value', 512)])\n"
        "manager = KVCacheManager(KVCacheManagerConfig(16, cache_tiers=[GpuCacheTierConfig(1 << 20)], layers=[layer], backend='cpu'))\n"
        "cache = manager.create_kv_cache()\n"
        "assert cache.resume()\n"
        "print(cache.resize(2 ** 62), cache.capacity)\n"
    )
    package_root = str(Path(kv_cache_manager_v2.__file__).resolve().parent.parent)
    result = subprocess.run(
        [sys.executable, "-c", code, package_root], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.split() == ["False", "0"], result.stderr[-500:]


def test_disk_tier_in_an_existing_directory_is_accepted() -> None:
    """The positive twin of the 'disk path does not exist' row."""
    with tempfile.TemporaryDirectory() as directory:
        manager = KVCacheManager(world_config_disk(str(Path(directory))))
        assert manager.num_cache_levels == 2
        manager.shutdown()
