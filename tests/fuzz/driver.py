"""The shared driver of the stateful fuzz test (``tests/test_stateful.py``) and the soak tool (``tools/soak.py``).

A ``Fuzzer`` owns one manager, a ``FakeEngine`` and a model of every cache it created (token list, capacity,
history, committed length, status). Each operation takes plain ints (so Hypothesis rules and a seeded
``random.Random`` can both draw them), calls the public API like an engine would, and asserts what a user can
observe: the modelled lengths, content written by the FakeEngine (checked after every resume, commit and resize,
and for every active cache after every operation), that a ``False`` from ``resume``/``resize``/``manager.resize``
changes nothing (lengths, page indices, storage statistics of every level, quotas, reuse probes, movement
counters), that documented invalid moves raise ``ValueError`` and change nothing, and ``check_invariants``.
Memory shortage (``False``, ``OutOfPagesError`` from a setter) is legal; any other exception is a bug.

No pytest here: ``tools/soak.py`` imports this module.

Beyond the plain lifecycle it drives SSM layers with snapshots (history only moves by computing, and chunks are
sometimes committed in two calls), SWA scratch reuse with windows that are not multiples of the block size,
a host tier with no slot for one pool group, priority callbacks that misbehave for one call (out of range or
raising: the call must raise and change nothing), batches with id collisions, repeated prompts, absurd
capacities and failing callbacks, quota changes on every level and ``adjust()``, registered page-index
buffers across suspend, resume and close, and remote-tier fills into a small GPU tier (closed requests asked
again, a store that answers short, long, failed or raising, and restarts empty). Re-entrancy (SPEC §11): handles
dropped inside reference cycles with the cycle collector armed to run at a random allocation of the next manager
call (or from a priority callback), priority callbacks that call back into the manager (refused with
``RuntimeError``, nothing changed), and attempts to copy or pickle a handle.

Extension points: add configs to ``CONFIGS``; add operations as ``Fuzzer`` methods, list them in ``OPERATIONS``
with a weight (soak), dispatch them in ``Fuzzer.random_step`` and add a matching rule to ``KVCacheMachine`` in
``tests/test_stateful.py``.
"""

from __future__ import annotations

import copy
import gc
import math
import pickle
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Final, Iterator, Sequence, Union

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRequest,
    KVCacheStatus,
    LifeCycle,
    OutOfPagesError,
    Priority,
    RemoteCacheTierConfig,
    RemoteStore,
    RemoteStoreError,
    ReuseScope,
    SsmLayerConfig,
    TokenSequence,
    _KVCache,
    gen_multimodal_cache_key_tokens,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig

Token = Union[int, bytes]
I32 = npt.NDArray[np.int32]

KIB: Final = 1024
MAX_LIVE_CACHES: Final = 6
# Upper bounds (inclusive) of the ints the operations take; both drivers draw from [0, bound].
INDEX_MAX: Final = 7
SOURCE_MAX: Final = 15
CUT_MAX: Final = 300
SUFFIX_MAX: Final = 40
FLAGS_MAX: Final = 31
AMOUNT_MAX: Final = 48
RESIZE_KINDS: Final = 5
RESIZE_MODES: Final = 3
QUOTA_CHOICES: Final = 6
INVALID_KINDS: Final = 10
COUNT_MAX: Final = 64
BATCH_MAX: Final = 3  # batches of 1 + (size % (BATCH_MAX + 1)) requests, bounded by MAX_LIVE_CACHES
FAULTS: Final = 2  # misbehaving callback: out-of-range priority, or an exception
COLLECT_POINT_MAX: Final = 200  # the cycle collector runs at about this many allocations into the next call
FOLLOW_UPS: Final = 4  # the call a dropped handle's finalizer may interrupt: create, batch, quota, a callback
REENTRY_TARGETS: Final = 10  # what a priority callback calls back into (Fuzzer._reentry)
COPY_KINDS: Final = 3  # copy.copy, copy.deepcopy, pickle.dumps
# A capacity no manager can give (a batch request with it must come back None).
ABSURD_CAPACITY: Final = 1 << 40

SCOPES: Final[tuple[ReuseScope | None, ...]] = (
    None,
    ReuseScope(),  # same tree as None
    ReuseScope(lora_id=0),  # differs from None
    ReuseScope(lora_id=1, salt=b"tenant"),
)
# Quota factors (numerator / 4) of a tier's initial quota: shrink, restore, and grow past the reservation.
QUOTA_FACTORS: Final = (1, 2, 3, 4, 4, 6)
MULTIMODAL_OFFSET: Final = 1 << 40


# ------------------------------------------------------------------------------------------------ configs
def _kv(size: int, value_size: int | None = None, tokens_per_block_override: int | None = None) -> list[BufferConfig]:
    return [
        BufferConfig("key", size, tokens_per_block_override),
        BufferConfig("value", size if value_size is None else value_size, tokens_per_block_override),
    ]


@dataclass(frozen=True)
class FuzzConfig:
    """One manager setup the fuzzer runs on. ``build`` gets a fresh scratch directory (for disk tiers)."""

    name: str
    build: Callable[[str], KVCacheManagerConfig]
    max_capacity: int
    needs_directory: bool = False
    # Every layer group is full attention: a live cache's committed blocks are always reusable (lower bound).
    full_attention_only: bool = False
    # SSM layers: history only moves by computing and committing (the FakeEngine checks the live state against
    # it), so raw resizes, partial commits and stop_committing are off; serve sometimes commits a chunk in two.
    ssm: bool = False
    # Whether a prefix computed in one chunk is reusable afterwards (not with SSM snapshots off the interval,
    # nor with scratch reuse, which never stores a chunk's out-of-window blocks).
    prefixes_reusable: bool = True


def _full(_: str) -> KVCacheManagerConfig:
    layers: list[LayerConfig] = [AttentionLayerConfig(0, _kv(512)), AttentionLayerConfig(1, _kv(512))]
    return KVCacheManagerConfig(16, cache_tiers=[GpuCacheTierConfig(28 * 4 * 512)], layers=layers, backend="cpu")


def _swa_sinks(_: str) -> KVCacheManagerConfig:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=40, num_sink_tokens=5),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=40, num_sink_tokens=5),
        AttentionLayerConfig(2, _kv(512), sliding_window_size=24),
        AttentionLayerConfig(3, _kv(512), sliding_window_size=64, num_sink_tokens=20),
    ]
    # ssm_reuse_interval 0 is valid without SSM layers (SPEC §5) and must not matter
    return KVCacheManagerConfig(16, cache_tiers=[GpuCacheTierConfig(20 * 8 * 512)], layers=layers, backend="cpu", ssm_reuse_interval=0)


def _mixed_heads(_: str) -> KVCacheManagerConfig:
    """Two SWA layers (one with K and V of different sizes: two pools) and two full layers of another head size
    (one with expansion 2): two pool groups with different slot sizes."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=32),
        AttentionLayerConfig(1, _kv(512, 1024), sliding_window_size=32),
        AttentionLayerConfig(2, _kv(1024)),
        AttentionLayerConfig(3, _kv(512, tokens_per_block_override=8)),
    ]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(
        16, cache_tiers=[GpuCacheTierConfig(160 * KIB)], layers=layers, backend="cpu", typical_step=typical
    )


def _tiered(directory: str) -> KVCacheManagerConfig:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512)),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=48, num_sink_tokens=3),
    ]
    slot = 2 * 512
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(24 * slot, max_quota=48 * slot),
        HostCacheTierConfig(24 * slot),
        DiskCacheTierConfig(48 * slot, directory),
    ]
    return KVCacheManagerConfig(16, cache_tiers=tiers, layers=layers, backend="cpu")


def _ssm_state() -> list[BufferConfig]:
    return [BufferConfig("ssm_state", 2048), BufferConfig("conv_state", 512)]


def _hybrid_ssm(_: str) -> KVCacheManagerConfig:
    """Two SSM layers (snapshots at every block), a full and an SWA layer, and a host tier for snapshots."""
    layers: list[LayerConfig] = [
        SsmLayerConfig(0, _ssm_state()),
        AttentionLayerConfig(1, _kv(512)),
        AttentionLayerConfig(2, _kv(512), sliding_window_size=24),
        SsmLayerConfig(3, _ssm_state()),
    ]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(128 * KIB), HostCacheTierConfig(48 * KIB)]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(
        16, cache_tiers=tiers, layers=layers, backend="cpu", ssm_reuse_interval=16, max_util_for_resume=1.0, typical_step=typical
    )


def _swa_scratch(_: str) -> KVCacheManagerConfig:
    """SWA scratch reuse with windows of 20 and 37 (+3 sinks) tokens: not multiples of the 16-token block."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=20),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=37, num_sink_tokens=3),
        AttentionLayerConfig(2, _kv(512)),
    ]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(40 * KIB), HostCacheTierConfig(16 * KIB)]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(16, cache_tiers=tiers, layers=layers, backend="cpu", enable_swa_scratch_reuse=True, typical_step=typical)


def _tiny_host(directory: str) -> KVCacheManagerConfig:
    """Two pool groups (1 and 2 KiB slots) over a host tier whose quota gives the first group no slot at all:
    pages of that group can only pass to the disk if the room estimate follows the tiers one at a time."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=40),
        AttentionLayerConfig(1, _kv(1024)),
    ]
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(48 * KIB, max_quota=96 * KIB),
        HostCacheTierConfig(3 * KIB),
        DiskCacheTierConfig(64 * KIB, directory),
    ]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(16, cache_tiers=tiers, layers=layers, backend="cpu", typical_step=typical)


# ----------------------------------------------------------------------------------------- remote fills
# Remote fills (issue #35): the ``remote_fills`` config, ``FlakyStoreConfig`` and the ``store_fault`` /
# ``restart_store`` operations. Its GPU tier is small, so fetching into it evicts (and used to prune the blocks
# being filled); content fetched back is checked by the FakeEngine that wrote it.
STORE_FAULTS: Final = 5  # a batch answered well, one result short, one too many, every key failed, or raising


class FlakyStoreConfig:
    """An in-memory store that answers the next batch calls badly, one armed fault per call (``faults``)."""

    def __init__(self) -> None:
        self.memory: MemoryStoreConfig = MemoryStoreConfig()
        self.faults: list[int] = []

    def open(self, quota: int) -> RemoteStore:
        return FlakyStore(self.memory.open(quota), self)


class FlakyStore:
    def __init__(self, inner: RemoteStore, config: FlakyStoreConfig) -> None:
        self.inner = inner
        self.config = config

    def _answer(self, results: list[object], failed: object) -> list[object]:
        fault = self.config.faults.pop(0) if self.config.faults else 0
        if fault == 1:
            return results[:-1]
        if fault == 2:
            return results + results[:1]
        if fault == 3:
            return [failed] * len(results)
        if fault == 4:
            raise RemoteStoreError("the fuzzer's store is down for this call")
        return results

    def put_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[bool]:
        stored: list[bool] = self._answer(list(self.inner.put_batch(keys, buffers)), False)  # type: ignore[assignment]
        return stored

    def get_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[int]:
        lengths: list[int] = self._answer(list(self.inner.get_batch(keys, buffers)), -2)  # type: ignore[assignment]
        return lengths

    def exists_batch(self, keys: list[str]) -> list[bool]:
        found: list[bool] = self._answer(list(self.inner.exists_batch(keys)), False)  # type: ignore[assignment]
        return found

    def remove_batch(self, keys: list[str]) -> list[bool]:
        return self.inner.remove_batch(keys)

    def close(self) -> None:
        self.inner.close()


def _remote_fills() -> KVCacheManagerConfig:
    """A full and a windowed layer over 24 GPU slots and a written-through remote tier (no back-off, so a fault
    lasts one call)."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512)),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=40, num_sink_tokens=3),
    ]
    remote = RemoteCacheTierConfig(0, FlakyStoreConfig(), namespace="fuzz", retry_after_s=0.0)
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(24 * 2 * 512), remote]
    return KVCacheManagerConfig(16, cache_tiers=tiers, layers=layers, backend="cpu")


CONFIGS: Final[list[FuzzConfig]] = [
    FuzzConfig("full", _full, max_capacity=256, full_attention_only=True),
    FuzzConfig("swa_sinks", _swa_sinks, max_capacity=256),
    FuzzConfig("mixed_heads", _mixed_heads, max_capacity=192),
    FuzzConfig("tiered", _tiered, max_capacity=192, needs_directory=True),
    FuzzConfig("hybrid_ssm", _hybrid_ssm, max_capacity=192, ssm=True, prefixes_reusable=False),
    FuzzConfig("swa_scratch", _swa_scratch, max_capacity=256, prefixes_reusable=False),
    FuzzConfig("tiny_host", _tiny_host, max_capacity=192, needs_directory=True),
    FuzzConfig("remote_fills", lambda _: _remote_fills(), max_capacity=192),
]

# (operation, weight in the random driver); every name is a ``Fuzzer`` method taking ints.
OPERATIONS: Final[tuple[tuple[str, float], ...]] = (
    ("create", 3.0),
    ("resume", 3.0),
    ("resize", 6.0),
    ("serve", 6.0),
    ("commit", 4.0),
    ("stop_committing", 0.7),
    ("suspend", 2.0),
    ("close", 2.0),
    ("change_quota", 0.4),
    ("clear_reusable", 0.3),
    ("register_buffer", 0.6),
    ("invalid_move", 1.0),
    ("create_batch", 1.2),
    ("misbehave", 0.6),
    ("adjust", 0.2),
    ("drop_in_cycle", 0.6),
    ("reenter", 0.6),
    ("copy_handle", 0.2),
    ("refetch", 2.0),
    ("store_fault", 0.4),
    ("restart_store", 0.05),
)


class CallbackFault(RuntimeError):
    """What a misbehaving priority callback raises."""


class FuzzCallback:
    """A deterministic priority callback that the fuzzer can make misbehave for one call."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.fault = 0  # 0: behaves; 1: returns an out-of-range priority; 2: raises CallbackFault
        self.calls: int = 0
        self.reenter: Callable[[], object] | None = None  # run on every call (calls back into the manager)

    def __call__(self, ordinal: int, life_cycle: LifeCycle) -> Priority:
        self.calls += 1
        if self.reenter is not None:
            self.reenter()
        if self.fault == 1:
            return Priority(101 + ordinal)
        if self.fault == 2:
            raise CallbackFault(f"priority callback failed for block {ordinal}")
        return Priority((self.base + 7 * ordinal + 13 * (life_cycle.window_size or 0)) % 101)


# ------------------------------------------------------------------------------------------------- model
class CacheModel:
    """What the engine knows about one cache: its tokens by position and the lengths it expects."""

    def __init__(self, cache: _KVCache, tokens: list[Token], scope: ReuseScope | None, reused: int) -> None:
        self.cache = cache
        self.tokens = tokens
        self.prompt_length: int = len(tokens)
        self.scope = scope
        self.capacity = reused
        self.history = reused
        self.committed = reused
        self.active = False
        self.stopped = False
        self.buffers: dict[int, I32] = {}
        self.callback: FuzzCallback | None = None

    @property
    def lengths(self) -> tuple[int, int, int]:
        return self.capacity, self.history, self.committed


@dataclass
class FuzzStats:
    operations: int = 0
    caches_created: int = 0
    reuse_hits: int = 0
    reused_tokens: int = 0
    shortages: int = 0
    invalid_moves: int = 0
    quota_changes: int = 0
    tokens_checked: int = 0
    callback_faults: int = 0
    batches_refused: int = 0
    by_operation: dict[str, int] = field(default_factory=dict)

    def add(self, other: FuzzStats) -> None:
        self.operations += other.operations
        self.caches_created += other.caches_created
        self.reuse_hits += other.reuse_hits
        self.reused_tokens += other.reused_tokens
        self.shortages += other.shortages
        self.invalid_moves += other.invalid_moves
        self.quota_changes += other.quota_changes
        self.tokens_checked += other.tokens_checked
        self.callback_faults += other.callback_faults
        self.batches_refused += other.batches_refused
        for name, count in other.by_operation.items():
            self.by_operation[name] = self.by_operation.get(name, 0) + count


def _lengths(cache: _KVCache) -> tuple[int, int, int]:
    return cache.capacity, cache.history_length, cache.num_committed_tokens


def _pick(candidates: Sequence[CacheModel], index: int) -> CacheModel | None:
    return candidates[index % len(candidates)] if candidates else None


def _same_scope(a: ReuseScope | None, b: ReuseScope | None) -> bool:
    return (ReuseScope() if a is None else a) == (ReuseScope() if b is None else b)


def _token_arg(tokens: list[Token], as_numpy: bool) -> TokenSequence:
    """Tokens as the engine passes them: a list, or an int64 NumPy array when every token is an int."""
    if as_numpy and all(isinstance(token, int) for token in tokens):
        return np.array(tokens, dtype=np.int64)
    return tokens


@contextmanager
def collector_armed(point: int) -> Iterator[None]:
    """Make the cycle collector run (first generation) at about the ``point``-th allocation of the body."""
    thresholds = gc.get_threshold()
    gc.set_threshold(gc.get_count()[0] + 1 + point, 1 << 30, 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def expect_value_error(call: Callable[[], object], what: str) -> None:
    """``call`` must raise ValueError (anything else propagates: a bug)."""
    try:
        call()
    except ValueError:
        return
    raise AssertionError(f"{what}: expected ValueError, nothing was raised")


Probe = tuple[ReuseScope | None, list[Token]]


def snapshot(manager: KVCacheManager, caches: Sequence[_KVCache], probes: Sequence[Probe]) -> dict[str, object]:
    """Everything a user can observe of the manager and ``caches`` without changing it."""
    state: dict[str, object] = {}
    for cache in caches:
        entry: list[object] = [cache.status, cache.capacity, cache.history_length, cache.num_committed_tokens]
        entry.append(cache.is_committing_stopped)
        if cache.status != KVCacheStatus.CLOSED:
            entry.extend(list(cache.get_base_page_indices(lg)) for lg in range(manager.num_layer_groups))
        state[f"cache {cache.id}"] = entry
    for level in range(manager.num_cache_levels):
        state[f"statistics {level}"] = manager.get_storage_statistics(level)
        state[f"quota {level}"] = manager.get_quota(level)
    state["probes"] = [manager.probe_reuse(scope, tokens) for scope, tokens in probes]
    counters = manager.movement_counters
    state["movement"] = (
        counters.onboarded_pages,
        counters.onboarded_bytes,
        counters.offloaded_pages,
        counters.offloaded_bytes,
        counters.copied_pages,
        counters.dropped_pages,
    )
    state["live caches"] = manager.num_live_caches
    return state


def assert_unchanged(before: dict[str, object], after: dict[str, object], what: str) -> None:
    if before != after:
        keys = before.keys() | after.keys()
        diff = {key: (before.get(key), after.get(key)) for key in keys if before.get(key) != after.get(key)}
        raise AssertionError(f"{what} changed state: {diff}")


# ------------------------------------------------------------------------------------------------ fuzzer
class Fuzzer:
    """One manager under random operations; see the module docstring."""

    def __init__(self, config: FuzzConfig) -> None:
        self.config = config
        self.directory: str | None = tempfile.mkdtemp(prefix="kvcm-fuzz-") if config.needs_directory else None
        try:
            self.manager: KVCacheManager = KVCacheManager(config.build(self.directory or ""))
        except BaseException:
            self._remove_directory()
            raise
        self.engine: FakeEngine = FakeEngine(self.manager)
        self.tpb: int = self.manager.tokens_per_block
        self.max_blocks: int = math.ceil(config.max_capacity / self.tpb)
        self.quotas: list[int] = [self.manager.get_quota(level) for level in range(self.manager.num_cache_levels)]
        self._windows = [self.manager.get_layer_window(group[0]) for group in self.manager.layer_grouping]
        self._rewind = self.manager.config.max_rewind_len
        self._ssm_groups = {
            int(self.manager.get_layer_group_id(layer.layer_id))
            for layer in self.manager.config.layers
            if isinstance(layer, SsmLayerConfig)
        }
        self.live: list[CacheModel] = []
        self.closed: list[CacheModel] = []
        self.stats: FuzzStats = FuzzStats()
        self.broken: bool = False  # set after a failure: teardown then only releases what it can
        self.last_operation: str = ""
        self._next_token = 1000
        self._next_id = 1_000_000
        tpb = self.tpb
        image = gen_multimodal_cache_key_tokens(MULTIMODAL_OFFSET, b"image-0".ljust(32, b"."), tpb)
        self.shared_prefixes: list[list[Token]] = [
            self._fresh(3 * tpb),
            self._fresh(2 * tpb + 5),
            self._fresh(tpb // 2) + image + self._fresh(tpb),
            self._fresh(5 * tpb + 3),
        ]
        self.recent: list[list[Token]] = []  # token lists of recent caches (multi-turn prefixes)
        remote = self.manager.config.remote_tier
        backend = remote.backend if remote is not None else None
        self.store: FlakyStoreConfig | None = backend if isinstance(backend, FlakyStoreConfig) else None
        try:
            self._warm_up()
        except BaseException:
            self.broken = True
            self.teardown()
            raise

    def _warm_up(self) -> None:
        """Compute and commit the shared prefixes once (like system prompts), so reuse starts at step one."""
        prompts: list[Probe] = [(None, prefix) for prefix in self.shared_prefixes]
        prompts.append((SCOPES[2], self.shared_prefixes[0]))
        for scope, prefix in prompts:
            cache = self.manager.create_kv_cache(scope, prefix)
            reused = cache.num_committed_tokens
            assert cache.resume() and cache.resize(len(prefix)), "a shared prefix must fit an empty manager"
            self.engine.step(cache, prefix)
            cache.commit(prefix[reused:])
            cache.close()
            reusable = self.config.prefixes_reusable and len(prefix) >= self.tpb
            assert self.manager.probe_reuse(scope, prefix) > 0 or not reusable
        self.manager.check_invariants()

    # ---------------------------------------------------------------------------------------------- helpers
    def _fresh(self, count: int) -> list[Token]:
        tokens: list[Token] = list(range(self._next_token, self._next_token + count))
        self._next_token += count
        return tokens

    def _stops_inside_scratch(self, model: CacheModel, history: int) -> bool:
        """SPEC §3: while scratch blocks exist, history may only move to capacity - max_rewind_len or beyond."""
        cache = model.cache
        return cache.has_scratch_slots and history != model.history and history < model.capacity - self._rewind

    def _unused_id(self) -> int:
        """A cache id no live cache has (the manager's automatic ids follow explicit ones, so skip them)."""
        live_ids = {model.cache.id for model in self.live}
        while self._next_id in live_ids:
            self._next_id += 1
        self._next_id += 1
        return self._next_id - 1

    def _remove_directory(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    @contextmanager
    def _operation(self, name: str) -> Iterator[None]:
        self.stats.operations += 1
        self.stats.by_operation[name] = self.stats.by_operation.get(name, 0) + 1
        try:
            yield
        except BaseException:
            self.broken = True
            raise

    def _probes(self) -> list[Probe]:
        probes: list[Probe] = [(None, prefix) for prefix in self.shared_prefixes]
        probes.extend((SCOPES[2], prefix) for prefix in self.shared_prefixes[:2])
        probes.extend((model.scope, model.tokens[: model.capacity]) for model in self.live[-2:])
        return probes

    def snapshot(self) -> dict[str, object]:
        return snapshot(self.manager, [model.cache for model in self.live], self._probes())

    def _active(self) -> list[CacheModel]:
        return [model for model in self.live if model.active]

    def _extend_tokens(self, model: CacheModel, length: int) -> None:
        if len(model.tokens) < length:
            model.tokens.extend(self._fresh(length - len(model.tokens)))

    def _check_content(self, model: CacheModel) -> None:
        before = self.engine.tokens_checked
        self.engine.check(model.cache, model.tokens)
        self.stats.tokens_checked += self.engine.tokens_checked - before

    def _reuse_lower_bound(self, scope: ReuseScope | None, prompt: list[Token]) -> int:
        """Full attention only: blocks committed by a live cache are held, so a prompt sharing them reuses them."""
        if not self.config.full_attention_only:
            return 0
        tpb = self.tpb
        best = 0
        for model in self.live:
            if not _same_scope(model.scope, scope):
                continue
            blocks = 0
            while (
                blocks < model.committed // tpb
                and blocks < len(prompt) // tpb
                and model.tokens[blocks * tpb : (blocks + 1) * tpb] == prompt[blocks * tpb : (blocks + 1) * tpb]
            ):
                blocks += 1
            best = max(best, blocks * tpb)
        return best

    def enabled(self, operation: str) -> bool:
        if operation in ("store_fault", "restart_store"):
            return self.store is not None
        if operation == "refetch":
            return self.store is not None and bool(self.closed) and len(self.live) < MAX_LIVE_CACHES
        if operation == "create_batch" and self.store is not None:
            return False  # fetched blocks stay cached when a batch refuses: its nothing-changed checks do not apply
        if self.config.ssm and operation in ("resize", "commit", "stop_committing"):
            return False  # history moves only by serve: compute, then commit what was computed
        if operation in ("create", "create_batch"):
            return len(self.live) < MAX_LIVE_CACHES
        if operation in ("resume", "stop_committing", "suspend", "close", "serve", "register_buffer"):
            return bool(self.live)
        if operation == "resize":
            return any(model.active for model in self.live)
        if operation == "commit":
            return any(model.active and not model.stopped for model in self.live)
        if operation in ("misbehave", "reenter"):
            return any(model.callback is not None for model in self.live)
        if operation == "drop_in_cycle":
            return bool(self.live)
        if operation == "copy_handle":
            return bool(self.live or self.closed)
        if operation == "invalid_move":
            return bool(self.live)
        return True

    # ------------------------------------------------------------------------------------------- operations
    def create(self, source: int, cut: int, suffix: int, scope: int, flags: int) -> None:
        """A new request: a prefix of a shared prompt or of an earlier request, then fresh tokens."""
        with self._operation("create"):
            sources = self.shared_prefixes + self.recent
            chosen = sources[source % len(sources)]
            prompt = list(chosen[: len(chosen) - cut % (len(chosen) + 1)]) + self._fresh(suffix)
            prompt = prompt[: self.config.max_capacity]
            reuse_scope = SCOPES[scope % len(SCOPES)]
            if flags & 16:  # a single-use scope (a per-request salt): its tree root must go when its blocks go
                reuse_scope = ReuseScope(salt=f"request-{self._next_token}".encode())
            lower = self._reuse_lower_bound(reuse_scope, prompt)
            probe = self.manager.probe_reuse(reuse_scope, _token_arg(prompt, bool(flags & 1)))
            assert lower <= probe <= len(prompt), f"probe_reuse {probe} outside [{lower}, {len(prompt)}]"
            cache_id: int | None = None
            if flags & 2:
                cache_id = self._unused_id()
            callback = FuzzCallback((source * 37 + suffix) % 101) if flags & 4 else None
            expected = len(prompt) if flags & 8 else None
            live_before = self.manager.num_live_caches
            cache = self.manager.create_kv_cache(
                reuse_scope,
                _token_arg(prompt, bool(flags & 1)),
                id=cache_id,
                custom_priority_callback=callback,
                expected_prompt_length=expected,
            )
            reused = probe
            if self.store is not None:  # the probe counts local blocks; the remote tier may extend them
                reused = cache.num_committed_tokens
                assert probe <= reused <= len(prompt), (probe, cache)
            model = CacheModel(cache, prompt, reuse_scope, reused)
            model.callback = callback
            assert cache.status == KVCacheStatus.SUSPENDED, cache
            assert _lengths(cache) == model.lengths, (cache, probe)
            assert cache_id is None or cache.id == cache_id, (cache.id, cache_id)
            assert all(other.cache.id != cache.id for other in self.live), f"cache id {cache.id} reused"
            assert self.manager.num_live_caches == live_before + 1
            self.live.append(model)
            self.recent = (self.recent + [model.tokens])[-8:]
            self.stats.caches_created += 1
            if reused > 0:
                self.stats.reuse_hits += 1
                self.stats.reused_tokens += reused

    def resume(self, index: int, stream: int) -> None:
        with self._operation("resume"):
            model = _pick(self.live, index)
            if model is None:
                return
            cuda_stream = None if stream == 0 else stream
            if model.active:
                assert model.cache.resume(cuda_stream) is True
                return
            before = self.snapshot()
            if not model.cache.resume(cuda_stream):
                self.stats.shortages += 1
                assert_unchanged(before, self.snapshot(), f"resume of cache {model.cache.id} returning False")
                return
            model.active = True
            assert model.cache.status == KVCacheStatus.ACTIVE
            self._check_content(model)

    def resize(self, index: int, kind: int, amount: int, mode: int) -> None:
        """Grow, shrink, advance history, start the next chunk, or decode one token (``kind``); through
        ``resize`` with ints or NumPy ints, or through the ``capacity`` / ``history_length`` setters (``mode``)."""
        with self._operation("resize"):
            model = _pick(self._active(), index)
            if model is None:
                return
            capacity, history = model.capacity, model.history
            limit = self.config.max_capacity
            kind %= RESIZE_KINDS
            new_history: int | None = None
            if kind == 0:
                new_capacity = min(limit, capacity + 1 + amount)
            elif kind == 1:
                new_capacity = max(history, capacity - 1 - amount)
            elif kind == 2:
                new_capacity, new_history = capacity, min(capacity, history + 1 + amount)
            elif kind == 3:
                new_capacity, new_history = min(limit, capacity + 1 + amount), capacity
            else:
                new_capacity, new_history = min(limit, capacity + 1), capacity
            self._resize(model, new_capacity, new_history, mode % RESIZE_MODES)

    def _resize(self, model: CacheModel, new_capacity: int, new_history: int | None, mode: int) -> bool:
        """One checked resize, then a FakeEngine step; False (memory short) must have changed nothing."""
        cache = model.cache
        before = self.snapshot()
        history = model.history if new_history is None else new_history
        if self._stops_inside_scratch(model, history):
            expect_value_error(lambda: cache.resize(new_capacity, new_history), "history stopping inside scratch")
            assert_unchanged(before, self.snapshot(), "history stopping inside scratch")
            self.stats.invalid_moves += 1
            return False
        if cache.has_scratch_slots and new_capacity > model.capacity:
            if not model.capacity - self._rewind <= history <= model.capacity:
                mode = 0  # each chunk must start where the previous one ended: a ValueError, nothing changed
                expect_value_error(lambda: cache.resize(new_capacity, new_history), "growing past scratch blocks")
                assert_unchanged(before, self.snapshot(), "growing past scratch blocks")
                self.stats.invalid_moves += 1
                return False
        if mode == 2 and cache.enable_swa_scratch_reuse and (new_history is None or new_history == model.history):
            mode = 0  # the capacity setter is refused while scratch reuse is on
            expect_value_error(lambda: setattr(cache, "capacity", new_capacity), "capacity setter with scratch reuse")
            assert_unchanged(before, self.snapshot(), "capacity setter with scratch reuse")
        if mode == 2 and (new_history is None or new_history == model.history):
            try:
                cache.capacity = new_capacity
                ok = True
            except OutOfPagesError:
                ok = False
        elif mode == 2 and new_capacity == model.capacity:
            assert new_history is not None
            try:
                cache.history_length = new_history
                ok = True
            except OutOfPagesError:
                ok = False
        elif mode == 1:
            ok = cache.resize(np.int64(new_capacity), None if new_history is None else np.int32(new_history))
        else:
            ok = cache.resize(new_capacity, new_history)
        if not ok:
            self.stats.shortages += 1
            assert_unchanged(before, self.snapshot(), f"resize of cache {cache.id} to {new_capacity} returning False")
            return False
        model.capacity = new_capacity
        if new_history is not None:
            model.history = new_history
        assert _lengths(cache) == model.lengths, (cache, model.lengths)
        self._extend_tokens(model, new_capacity)
        before_checked = self.engine.tokens_checked
        self.engine.step(cache, model.tokens)
        self.stats.tokens_checked += self.engine.tokens_checked - before_checked
        return True

    def serve(self, index: int, chunk: int) -> None:
        """One engine step for a request: resume if needed, then a prefill chunk of at most ``chunk + 1`` prompt
        tokens (or one decode token), FakeEngine step, and commit of everything computed."""
        with self._operation("serve"):
            model = _pick(self.live, index)
            if model is None:
                return
            if not model.active:
                before = self.snapshot()
                if not model.cache.resume():
                    self.stats.shortages += 1
                    assert_unchanged(before, self.snapshot(), f"resume of cache {model.cache.id} returning False")
                    return
                model.active = True
                self._check_content(model)
            history = model.history
            if history < model.prompt_length:
                target = min(model.prompt_length, history + 1 + chunk)
            else:
                target = history + 1
            target = min(max(target, model.capacity), self.config.max_capacity)
            if target > model.capacity and not self._resize(model, target, None, chunk % RESIZE_MODES):
                return
            if not model.stopped:
                tokens = model.tokens[model.committed : model.capacity]
                split = len(tokens) // 2 if chunk % 2 else 0  # a chunk committed in two calls
                if split and self._stops_inside_scratch(model, max(model.history, model.committed + split)):
                    before = self.snapshot()
                    expect_value_error(lambda: model.cache.commit(tokens[:split]), "commit stopping inside scratch")
                    assert_unchanged(before, self.snapshot(), "commit stopping inside scratch")
                    split = 0  # so the chunk is committed in one call
                if split:
                    model.cache.commit(tokens[:split])
                model.cache.commit(tokens[split:])
                model.committed = model.capacity
                model.history = model.capacity
                self._check_content(model)

    def commit(self, index: int, count: int, flags: int) -> None:
        with self._operation("commit"):
            model = _pick([m for m in self.live if m.active and not m.stopped], index)
            if model is None:
                return
            room = model.capacity - model.committed
            number = room if count >= COUNT_MAX else count % (room + 1)  # COUNT_MAX: everything computed
            tokens = model.tokens[model.committed : model.committed + number]
            if self._stops_inside_scratch(model, max(model.history, model.committed + number)):
                before = self.snapshot()
                expect_value_error(lambda: model.cache.commit(tokens), "commit stopping inside scratch")
                assert_unchanged(before, self.snapshot(), "commit stopping inside scratch")
                self.stats.invalid_moves += 1
                return
            model.cache.commit(_token_arg(tokens, bool(flags & 1)))
            model.committed += number
            model.history = max(model.history, model.committed)
            assert _lengths(model.cache) == model.lengths, (model.cache, model.lengths)
            self._check_content(model)

    def stop_committing(self, index: int) -> None:
        with self._operation("stop_committing"):
            model = _pick(self.live, index)
            if model is None:
                return
            model.cache.stop_committing()
            model.stopped = True
            assert model.cache.is_committing_stopped
            if model.active:
                self._check_content(model)

    def suspend(self, index: int) -> None:
        with self._operation("suspend"):
            model = _pick(self.live, index)
            if model is None:
                return
            if not model.active:
                before = self.snapshot()
                model.cache.suspend()  # already suspended: a no-op
                assert_unchanged(before, self.snapshot(), f"suspend of suspended cache {model.cache.id}")
                return
            model.cache.suspend()
            model.active = False
            assert model.cache.status == KVCacheStatus.SUSPENDED
            self._check_buffers(model)  # still registered, and every entry -1

    def close(self, index: int) -> None:
        with self._operation("close"):
            model = _pick(self.live, index)
            if model is None:
                return
            model.cache.close()
            assert model.cache.status == KVCacheStatus.CLOSED
            if index % 2:
                model.cache.close()  # idempotent
            self.live.remove(model)
            model.active = False
            for buffer in model.buffers.values():
                assert (buffer == BAD_PAGE_INDEX).all(), f"cache {model.cache.id}: buffer not cleared on close"
            model.buffers.clear()
            self.closed = (self.closed + [model])[-4:]
            assert self.manager.num_live_caches == len(self.live)

    def change_quota(self, level: int, choice: int) -> None:
        """Suspend every cache, then ``manager.resize(level, quota)``: True sets the quota, False changes nothing."""
        with self._operation("change_quota"):
            level %= len(self.quotas)
            self._suspend_all()
            quota = max(1, self.quotas[level] * QUOTA_FACTORS[choice % len(QUOTA_FACTORS)] // 4)
            before = self.snapshot()
            if not self.manager.resize(level, quota):
                self.stats.shortages += 1
                assert_unchanged(before, self.snapshot(), f"manager.resize({level}, {quota}) returning False")
                return
            self.stats.quota_changes += 1
            assert self.manager.get_quota(level) == quota
            used_bytes = 0
            for group, stats in enumerate(self.manager.get_storage_statistics(level)):
                used_bytes += stats.total * sum(self.manager.get_slot_bytes(group))
            assert used_bytes <= quota, f"level {level}: {used_bytes} bytes of slots for a quota of {quota}"
            for other in range(len(self.quotas)):
                if other != level:
                    assert self.manager.get_quota(other) == before[f"quota {other}"]

    def _suspend_all(self) -> None:
        for model in self._active():
            model.cache.suspend()
            model.active = False

    def adjust(self) -> None:
        """Suspend every cache, then re-split the tiers for the observed mix: True or False, invariants hold."""
        with self._operation("adjust"):
            self._suspend_all()
            self.manager.adjust()  # True or False; check() then verifies invariants, content and page tables

    def create_batch(self, size: int, source: int, flags: int, extra: int) -> None:
        """``create_kv_cache_batch`` of 1-4 requests: repeated prompts, explicit and automatic ids (sometimes
        colliding: ValueError), a priority callback that may fail (it raises, and nothing changes), absurd
        capacities (that request comes back None). Admitted caches are active with the reuse the probe
        promised; when nothing is admitted, nothing changed and no statistics were counted."""
        with self._operation("create_batch"):
            count = min(1 + size % (BATCH_MAX + 1), MAX_LIVE_CACHES - len(self.live))
            sources = self.shared_prefixes + self.recent
            requests: list[KVCacheRequest] = []
            prompts: list[list[Token]] = []
            callbacks: list[FuzzCallback | None] = []
            collision = bool(flags & 2) and (count > 1 or bool(self.live))
            for k in range(count):
                chosen = sources[(source + (0 if flags & 8 else 3 * k)) % len(sources)]  # flags & 8: one prompt
                prompt = list(chosen[: len(chosen) - (extra * (k + 1)) % (len(chosen) + 1)]) + self._fresh((extra + k) % 9)
                prompt = prompt[: self.config.max_capacity]
                cache_id: int | None = None
                if flags & 1 and k % 2 == 0:
                    cache_id = self._unused_id()
                if collision and k == count - 1:  # the first request's id, or a live cache's
                    if count > 1:
                        if requests[0].id is None:
                            requests[0].id = self._unused_id()
                        cache_id = requests[0].id
                    else:
                        cache_id = self.live[0].cache.id
                callback = FuzzCallback(source + k) if flags & 4 and k == count - 1 else None
                capacity = len(prompt) + (extra + 5 * k) % 17
                if extra % 7 == 3 and k == 0:
                    capacity = ABSURD_CAPACITY
                requests.append(KVCacheRequest(prompt, SCOPES[(source + k) % len(SCOPES)], cache_id, capacity, callback))
                prompts.append(prompt)
                callbacks.append(callback)
            reuse = [self.manager.probe_reuse(request.reuse_scope, prompt) for request, prompt in zip(requests, prompts)]
            faulty = callbacks[-1]
            armed = faulty is not None and extra % 3 == 0
            if faulty is not None and armed:
                faulty.fault = 1 + extra % FAULTS
            self.manager.get_iteration_stats()  # counters start from zero for this call
            before = self.snapshot()
            try:
                results = self.manager.create_kv_cache_batch(requests)
            except (ValueError, CallbackFault) as error:
                expected = collision or (armed and faulty is not None and faulty.calls > 0)
                assert expected, f"create_kv_cache_batch raised {error!r}"
                assert_unchanged(before, self.snapshot(), "a batch that raised")
                self._assert_no_statistics("a batch that raised")
                self.stats.callback_faults += 0 if collision else 1
                return
            finally:
                if faulty is not None:
                    faulty.fault = 0
            assert not collision, "a batch with colliding ids was admitted"
            assert not (armed and faulty is not None and faulty.calls > 0), "a misbehaving callback's answer was used"
            if all(result is None for result in results):
                self.stats.batches_refused += 1
                assert_unchanged(before, self.snapshot(), "a batch that admitted nothing")
                self._assert_no_statistics("a batch that admitted nothing")
                return
            for request, prompt, reused, callback, cache in zip(requests, prompts, reuse, callbacks, results):
                assert request.capacity is not None
                if cache is None:  # memory shortage (always so for an absurd capacity)
                    continue
                assert request.capacity != ABSURD_CAPACITY, "an absurd capacity was admitted"
                assert request.id is None or cache.id == request.id, (cache.id, request.id)
                assert cache.status == KVCacheStatus.ACTIVE
                model = CacheModel(cache, prompt, request.reuse_scope, reused)
                model.callback = callback
                model.capacity = max(request.capacity, reused)
                model.active = True
                assert _lengths(cache) == model.lengths, (cache, model.lengths)
                self.live.append(model)
                self.stats.caches_created += 1
                self._extend_tokens(model, model.capacity)
                self.engine.step(cache, model.tokens)
                if self.config.ssm:  # the live state now holds every computed token: commit them
                    cache.commit(model.tokens[model.committed : model.capacity])
                    model.committed = model.history = model.capacity
                self._check_content(model)

    def misbehave(self, index: int, fault: int, amount: int) -> None:
        """Make a cache's priority callback misbehave for one call, then grow it (active) or resume it
        (suspended): if the callback was asked, the call raises and nothing changes; otherwise it is an ordinary
        call."""
        with self._operation("misbehave"):
            model = _pick([m for m in self.live if m.callback is not None], index)
            if model is None or model.callback is None:
                return
            callback = model.callback
            cache = model.cache
            calls = callback.calls
            new_capacity = min(self.config.max_capacity, model.capacity + 1 + amount)
            self.manager.get_iteration_stats()
            before = self.snapshot()
            callback.fault = 1 + fault % FAULTS
            try:
                done = cache.resize(new_capacity, model.capacity) if model.active else cache.resume()
            except (ValueError, CallbackFault) as error:
                assert callback.calls > calls, f"{error!r} without asking the callback"
                assert_unchanged(before, self.snapshot(), "a call whose priority callback failed")
                self._assert_no_statistics("a call whose priority callback failed")
                self.stats.callback_faults += 1
                return
            finally:
                callback.fault = 0
            assert callback.calls == calls, "a misbehaving callback's answer was accepted"
            if not done:
                self.stats.shortages += 1
                assert_unchanged(before, self.snapshot(), "a refused call with a misbehaving callback")
                return
            if not model.active:
                model.active = True
                self._check_content(model)
                return
            model.history = model.capacity
            model.capacity = new_capacity
            self._extend_tokens(model, new_capacity)
            self.engine.step(cache, model.tokens)
            if self.config.ssm:
                cache.commit(model.tokens[model.committed : model.capacity])
                model.committed = model.history = model.capacity

    def refetch(self, index: int, suffix: int) -> None:
        """A closed request's committed tokens again, in its scope, resumed at once: most of its blocks left the
        small GPU tier, so they come back from the store, evicting for their slots; their content is checked."""
        with self._operation("refetch"):
            old = _pick(self.closed, index)
            assert old is not None
            prompt = old.tokens[: old.committed] + self._fresh(suffix % 9)
            probe = self.manager.probe_reuse(old.scope, prompt)
            cache = self.manager.create_kv_cache(old.scope, prompt)
            model = CacheModel(cache, prompt, old.scope, cache.num_committed_tokens)
            assert probe <= model.committed <= len(prompt), (probe, cache)
            self.live.append(model)
            self.stats.caches_created += 1
            if cache.resume():
                model.active = True
                self._check_content(model)

    def store_fault(self, kind: int, count: int) -> None:
        """The store answers its next ``count`` batch calls badly (``FlakyStore``): a miss, never an error; the
        remote tier's statistics stay consistent."""
        with self._operation("store_fault"):
            assert self.store is not None
            self.store.faults.extend([kind % STORE_FAULTS] * (1 + count % 3))
            stats = self.manager.get_remote_tier_statistics()
            assert stats is not None and stats.found_pages <= stats.probed_pages, stats
            assert stats.fetched_pages + stats.rejected_pages + stats.fetch_failures <= stats.found_pages, stats

    def restart_store(self) -> None:
        """The store loses every object (a restart): pages computed afterwards are stored again."""
        with self._operation("restart_store"):
            assert self.store is not None
            self.store.memory.restart()

    def _assert_no_statistics(self, what: str) -> None:
        for stats in self.manager.get_iteration_stats():
            counted = (stats.allocated_pages, stats.reused_full_blocks, stats.reused_partial_blocks, stats.missed_blocks)
            assert counted == (0, 0, 0, 0), f"{what} counted statistics: {stats}"

    def clear_reusable(self) -> None:
        """Drops only content no cache uses: free slots never shrink, the last tier keeps nothing evictable, and
        (full attention) blocks committed by live caches stay reusable. Probes may go up as well as down: with
        partial reuse, dropping a page-less block can expose a partially matching sibling (SPEC §4's walk)."""
        with self._operation("clear_reusable"):
            levels = range(self.manager.num_cache_levels)
            before_free = [[s.free for s in self.manager.get_storage_statistics(level)] for level in levels]
            if self.live:  # refused while any cache is open, changing nothing
                try:
                    self.manager.clear_reusable_blocks()
                except RuntimeError as error:
                    assert f"{len(self.live)} KV cache(s) still open" in str(error), error
                else:
                    raise AssertionError("clear_reusable_blocks with open caches must raise RuntimeError")
                after = [[s.free for s in self.manager.get_storage_statistics(level)] for level in levels]
                assert after == before_free, (before_free, after)
                return
            self.manager.clear_reusable_blocks()
            after_free = [[s.free for s in self.manager.get_storage_statistics(level)] for level in levels]
            for old, new in zip(before_free, after_free):
                assert all(a >= b for a, b in zip(new, old)), (before_free, after_free)
            last = self.manager.get_storage_statistics(self.manager.num_cache_levels - 1)
            assert all(stats.evictable == 0 for stats in last), last
            for model in self.live:
                prompt = model.tokens[: model.capacity]
                lower = self._reuse_lower_bound(model.scope, prompt)
                assert self.manager.probe_reuse(model.scope, prompt) >= lower, (model.cache, lower)

    def register_buffer(self, index: int, layer_group: int) -> None:
        """An engine-owned int32 page table the manager keeps equal to ``get_base_page_indices`` while active."""
        with self._operation("register_buffer"):
            model = _pick(self.live, index)
            if model is None:
                return
            lg = layer_group % self.manager.num_layer_groups
            buffer = np.full(self.max_blocks + 2, -7, dtype=np.int32)
            model.cache.set_base_page_index_buf(0, lg, buffer)
            model.buffers[lg] = buffer
            self._check_buffers(model)

    def invalid_move(self, kind: int, index: int) -> None:
        """A documented invalid move: ValueError, and nothing changes."""
        with self._operation("invalid_move"):
            kind %= INVALID_KINDS
            active = self._active()
            call: Callable[[], object] | None = None
            what = ""
            if kind == 0:
                model = _pick([m for m in self.live if not m.active], index)
                if model is not None:
                    cache = model.cache
                    call, what = (lambda: cache.resize(cache.capacity + 1)), "resize of a suspended cache"
            elif kind == 1:
                model = _pick([m for m in active if m.history > 0], index)
                if model is not None:
                    cache = model.cache
                    call = lambda: cache.resize(cache.capacity, cache.history_length - 1)  # noqa: E731
                    what = "history moving backwards"
            elif kind == 2:
                model = _pick(active, index)
                if model is not None:
                    cache = model.cache
                    call, what = (lambda: cache.resize(cache.capacity, cache.capacity + 1)), "history beyond capacity"
            elif kind == 3:
                model = _pick([m for m in active if not m.stopped], index)
                if model is not None:
                    cache = model.cache
                    tokens = self._fresh(model.capacity - model.committed + 1)
                    call, what = (lambda: cache.commit(tokens)), "commit beyond capacity"
            elif kind == 4:
                model = _pick([m for m in active if m.stopped], index)
                if model is not None:
                    cache = model.cache
                    call, what = (lambda: cache.commit([1])), "commit after stop_committing"
            elif kind == 5:
                model = _pick(self.closed, index)
                if model is not None:
                    call, what = self._closed_call(model.cache, index), "operation on a closed cache"
            elif kind == 6:
                model = _pick(self.live, index)
                if model is not None:
                    cache_id = model.cache.id
                    call, what = (lambda: self.manager.create_kv_cache(id=cache_id)), "duplicate cache id"
            elif kind == 7:
                if active:
                    call, what = (lambda: self.manager.resize(0, self.quotas[0])), "quota change with an active cache"
            elif kind == 8:
                if self.live:  # a RuntimeError naming how many are open, changing nothing
                    before = self.snapshot()
                    try:
                        self.manager.shutdown()
                    except RuntimeError as error:
                        assert f"{len(self.live)} KV cache(s) still open" in str(error), error
                    else:
                        raise AssertionError("shutdown with open caches must raise RuntimeError")
                    assert_unchanged(before, self.snapshot(), "shutdown with open caches")
                    self.stats.invalid_moves += 1
                return
            else:
                model = _pick([m for m in active if m.history > 0], index)
                if model is not None:
                    cache = model.cache
                    call, what = (lambda: cache.resize(cache.history_length - 1)), "capacity below history"
            if call is None:
                return
            before = self.snapshot()
            expect_value_error(call, what)
            assert_unchanged(before, self.snapshot(), what)
            self.stats.invalid_moves += 1

    @staticmethod
    def _closed_call(cache: _KVCache, index: int) -> Callable[[], object]:
        calls: list[Callable[[], object]] = [
            cache.resume,
            cache.suspend,
            lambda: cache.resize(16),
            lambda: cache.commit([1]),
            cache.stop_committing,
            lambda: cache.set_base_page_index_buf(0, 0, np.zeros(64, dtype=np.int32)),
        ]
        return calls[(index // 2) % len(calls)]

    # ----------------------------------------------------------------------- re-entrancy (SPEC §11, issue #35)
    def drop_in_cycle(self, index: int, point: int, follow: int) -> None:
        """Drop a cache's only handle inside a reference cycle, then make one more manager call (``follow``:
        create in the same scope and prefix, a batch of the same, a GPU quota change, a cache's growth whose
        priority callback runs the collector) with the collector armed at about its ``point``-th allocation: the
        dropped cache must be closed at a call boundary, never half way through that call."""
        with self._operation("drop_in_cycle"):
            model = _pick(self.live, index)
            if model is None:
                return
            self.live.remove(model)
            if follow % FOLLOW_UPS == 2:
                model.cache.suspend()  # an uncollected active cache would make the quota change refuse
            scope, prefix = model.scope, model.tokens[: model.committed]
            cycle: list[object] = [model.cache]
            cycle.append(cycle)  # only the collector can free the handle now
            del cycle, model
            with collector_armed(point):
                self._follow_up(follow % FOLLOW_UPS, scope, prefix, point)
            gc.collect()  # if the collector did not run in the call: the handle is finalized now, its cache queued
            assert self.manager.num_live_caches == len(self.live)

    def _follow_up(self, kind: int, scope: ReuseScope | None, prefix: list[Token], point: int) -> None:
        prompt = (prefix + self._fresh(self.tpb + point % 7))[: self.config.max_capacity]
        if kind == 0 and len(self.live) < MAX_LIVE_CACHES:
            cache = self.manager.create_kv_cache(scope, prompt)
            model = CacheModel(cache, prompt, scope, cache.num_committed_tokens)
            assert cache.status == KVCacheStatus.SUSPENDED and _lengths(cache) == model.lengths, cache
            self.live.append(model)
            self.stats.caches_created += 1
        elif kind == 1 and len(self.live) < MAX_LIVE_CACHES:
            admitted = self.manager.create_kv_cache_batch([KVCacheRequest(prompt, scope, capacity=len(prompt))])[0]
            if admitted is None:
                self.stats.batches_refused += 1
                return
            cache = admitted
            model = CacheModel(cache, prompt, scope, cache.num_committed_tokens)
            model.capacity = max(len(prompt), model.committed)
            model.active = True
            assert cache.status == KVCacheStatus.ACTIVE and _lengths(cache) == model.lengths, cache
            self.live.append(model)
            self.stats.caches_created += 1
            self.engine.step(cache, model.tokens)
            if self.config.ssm:  # the live state holds every computed token: commit them
                cache.commit(model.tokens[model.committed : model.capacity])
                model.committed = model.history = model.capacity
            self._check_content(model)
        elif kind == 2:
            self._suspend_all()
            quota = max(1, self.quotas[0] * QUOTA_FACTORS[point % len(QUOTA_FACTORS)] // 4)
            if self.manager.resize(0, quota):
                self.stats.quota_changes += 1
                assert self.manager.get_quota(0) == quota
        else:
            grown = _pick([m for m in self.live if m.callback is not None], point)
            if grown is None or grown.callback is None:
                return
            grown.callback.reenter = gc.collect  # the finalizer runs while the manager asks the callback
            try:
                self._grow_or_resume(grown, min(self.config.max_capacity, grown.capacity + 1 + point % AMOUNT_MAX))
            finally:
                grown.callback.reenter = None

    def reenter(self, index: int, target: int, swallow: bool, amount: int) -> None:
        """A priority callback calls back into the manager (``target``, see ``_reentry``) while its cache grows
        or resumes: that inner call raises ``RuntimeError``. Swallowed, the outer call completes as usual;
        propagated, the outer call raises and changes nothing."""
        with self._operation("reenter"):
            model = _pick([m for m in self.live if m.callback is not None], index)
            if model is None or model.callback is None:
                return
            callback = model.callback
            inner = self._reentry(target, model)
            refusals: list[str] = []

            def call_back_in() -> None:
                try:
                    inner()
                except RuntimeError as error:
                    refusals.append(str(error))
                    if not swallow:
                        raise
                else:
                    raise AssertionError("a manager call from inside a priority callback was not refused")

            self.manager.get_iteration_stats()
            before = self.snapshot()
            callback.reenter = call_back_in
            try:
                done = self._grow_or_resume(model, min(self.config.max_capacity, model.capacity + 1 + amount))
            except RuntimeError as error:
                assert not swallow and refusals, f"{error!r} without a refused call back"
                assert_unchanged(before, self.snapshot(), "a call whose priority callback called back in")
                self._assert_no_statistics("a call whose priority callback called back in")
                self.stats.callback_faults += 1
                return
            finally:
                callback.reenter = None
            assert all("is in flight" in message for message in refusals), refusals
            if not done:
                assert_unchanged(before, self.snapshot(), "a refused call whose priority callback called back in")

    def _reentry(self, target: int, model: CacheModel) -> Callable[[], object]:
        """What a priority callback calls back into: its own cache, another cache, or the manager."""
        cache, manager = model.cache, self.manager
        other = _pick([m for m in self.live if m is not model], target)
        calls: list[Callable[[], object]] = [
            cache.close,
            cache.suspend,
            lambda: cache.commit([]),
            manager.create_kv_cache,
            lambda: manager.create_kv_cache_batch([KVCacheRequest([1, 2, 3])]),
            lambda: manager.probe_reuse(None, [1, 2, 3]),
            lambda: manager.resize(0, self.quotas[0]),
            manager.shutdown,
            manager.clear_reusable_blocks,
            manager.check_invariants if other is None else other.cache.close,
        ]
        return calls[target % len(calls)]

    def _grow_or_resume(self, model: CacheModel, new_capacity: int) -> bool:
        """Grow an active cache by one chunk (or resume a suspended one) and follow in the model; False: short."""
        cache = model.cache
        if not (cache.resize(new_capacity, model.capacity) if model.active else cache.resume()):
            self.stats.shortages += 1
            return False
        if not model.active:
            model.active = True
            self._check_content(model)
            return True
        model.history = model.capacity
        model.capacity = new_capacity
        self._extend_tokens(model, new_capacity)
        self.engine.step(cache, model.tokens)
        if self.config.ssm:
            cache.commit(model.tokens[model.committed : model.capacity])
            model.committed = model.history = model.capacity
        return True

    def copy_handle(self, index: int, kind: int) -> None:
        """A handle is not a value: ``copy``, ``deepcopy`` and ``pickle`` raise TypeError and change nothing."""
        with self._operation("copy_handle"):
            model = _pick(self.live + self.closed, index)
            if model is None:
                return
            operation: Callable[[object], object] = (copy.copy, copy.deepcopy, pickle.dumps)[kind % COPY_KINDS]
            before = self.snapshot()
            try:
                operation(model.cache)
            except TypeError:
                pass
            else:
                raise AssertionError(f"{operation.__name__} of a KVCache handle did not raise TypeError")
            assert_unchanged(before, self.snapshot(), f"{operation.__name__} of a handle")

    # ------------------------------------------------------------------------------------------------ checks
    def _check_buffers(self, model: CacheModel) -> None:
        """Registered buffers equal the page indices then -1 while active, and are all -1 while suspended."""
        for lg, buffer in model.buffers.items():
            expected = list(model.cache.get_base_page_indices(lg)) if model.active else []
            expected += [BAD_PAGE_INDEX] * (len(buffer) - len(expected))
            assert buffer.tolist() == expected, (model.cache.id, lg, buffer.tolist(), expected)

    def _stale_range(self, layer_group: int, history: int) -> tuple[int, int]:
        """SPEC §3's stale range, from the public window of the layer group's first layer."""
        window, sinks = self._windows[layer_group]
        start = min(-(-history // self.tpb), -(-sinks // self.tpb))
        if window == 0:
            return start, start
        return start, max(start, (history + 1 - window) // self.tpb)

    def _check_page_table(self, model: CacheModel) -> None:
        """An active cache has a page exactly outside the stale range (and scratch blocks) of each layer group."""
        for lg in range(self.manager.num_layer_groups):
            indices = model.cache.get_base_page_indices(lg)
            assert len(indices) == model.cache.num_blocks, (lg, len(indices), model.cache)
            if lg in self._ssm_groups:  # one live state slot, no per-block pages
                assert all(slot == BAD_PAGE_INDEX for slot in indices), (lg, list(indices))
                assert model.cache.get_ssm_block_base_index(lg) >= 0, (lg, model.cache)
                continue
            stale_beg, stale_end = self._stale_range(lg, model.history)
            scratch = model.cache.get_scratch_desc(lg)
            scratch_beg, scratch_end = (0, 0) if scratch is None else (scratch.range.beg, scratch.range.end)
            for ordinal, slot in enumerate(indices):
                stale = stale_beg <= ordinal < stale_end or scratch_beg <= ordinal < scratch_end
                assert (slot < 0) == stale, f"cache {model.cache.id} layer group {lg} block {ordinal}: slot {slot}"

    def check(self) -> None:
        """After every operation: invariants, slot accounting, the model, page tables (stale ranges, registered
        buffers) and content of every active cache."""
        self.manager.check_invariants()
        assert self.manager.num_live_caches == len(self.live), (self.manager.num_live_caches, len(self.live))
        for level in range(self.manager.num_cache_levels):
            for stats in self.manager.get_storage_statistics(level):
                assert stats.available == stats.free + stats.evictable, (level, stats)
                assert stats.available + stats.unavailable == stats.total and stats.free <= stats.total, (level, stats)
        for model in self.live:
            cache = model.cache
            status = KVCacheStatus.ACTIVE if model.active else KVCacheStatus.SUSPENDED
            assert cache.status == status, (cache, status)
            assert _lengths(cache) == model.lengths, (cache, model.lengths)
            assert cache.is_committing_stopped == model.stopped
            assert cache.num_blocks == math.ceil(model.capacity / self.tpb)
            if model.active:
                self._check_page_table(model)
                self._check_buffers(model)
                self._check_content(model)

    def teardown(self) -> None:
        """Close everything; unless an operation failed, check nothing is left held and everything can be freed."""
        try:
            if not self.broken:
                self._close_everything_and_check()
                return
            for model in self.live:  # already failing: release what can be released
                try:
                    model.cache.close()
                except Exception:  # noqa: BLE001
                    pass
        finally:
            self.live = []
            self._remove_directory()

    def _close_everything_and_check(self) -> None:
        for model in self.live:
            model.cache.close()
            self.manager.check_invariants()
        levels = range(self.manager.num_cache_levels)
        for level in levels:
            for stats in self.manager.get_storage_statistics(level):
                assert stats.unavailable == 0, f"level {level} after closing every cache: {stats}"
        self.manager.clear_reusable_blocks()
        self.manager.check_invariants()
        for level in levels:
            for stats in self.manager.get_storage_statistics(level):
                assert stats.free == stats.total, f"level {level} after clear_reusable_blocks: {stats}"
        self.manager.shutdown()

    # --------------------------------------------------------------------------------------- random driver
    def random_step(self, rng: random.Random) -> str:
        """One operation with random arguments, chosen among the enabled ones by ``OPERATIONS`` weight."""
        names = [name for name, _ in OPERATIONS if self.enabled(name)]
        weights = [weight for name, weight in OPERATIONS if self.enabled(name)]
        name = rng.choices(names, weights)[0]
        self.last_operation = name
        index = rng.randint(0, INDEX_MAX)
        if name == "create":
            self.create(
                rng.randint(0, SOURCE_MAX),
                rng.randint(0, CUT_MAX),
                rng.randint(0, SUFFIX_MAX),
                rng.randint(0, len(SCOPES) - 1),
                rng.randint(0, FLAGS_MAX),
            )
        elif name == "resume":
            self.resume(index, rng.choice((0, 0, 1, 7)))
        elif name == "resize":
            self.resize(index, rng.randrange(RESIZE_KINDS), rng.randint(0, AMOUNT_MAX), rng.randrange(RESIZE_MODES))
        elif name == "serve":
            self.serve(index, rng.randint(0, AMOUNT_MAX))
        elif name == "commit":
            self.commit(index, rng.randint(0, COUNT_MAX), rng.randint(0, FLAGS_MAX))
        elif name == "stop_committing":
            self.stop_committing(index)
        elif name == "suspend":
            self.suspend(index)
        elif name == "close":
            self.close(index)
        elif name == "change_quota":
            self.change_quota(rng.randint(0, 3), rng.randrange(QUOTA_CHOICES))
        elif name == "clear_reusable":
            self.clear_reusable()
        elif name == "register_buffer":
            self.register_buffer(index, rng.randint(0, 3))
        elif name == "invalid_move":
            self.invalid_move(rng.randrange(INVALID_KINDS), index)
        elif name == "create_batch":
            self.create_batch(rng.randint(0, BATCH_MAX), rng.randint(0, SOURCE_MAX), rng.randint(0, FLAGS_MAX), rng.randint(0, AMOUNT_MAX))
        elif name == "misbehave":
            self.misbehave(index, rng.randrange(FAULTS), rng.randint(0, AMOUNT_MAX))
        elif name == "adjust":
            self.adjust()
        elif name == "drop_in_cycle":
            self.drop_in_cycle(index, rng.randint(0, COLLECT_POINT_MAX), rng.randrange(FOLLOW_UPS))
        elif name == "reenter":
            self.reenter(index, rng.randrange(REENTRY_TARGETS), rng.random() < 0.5, rng.randint(0, AMOUNT_MAX))
        elif name == "copy_handle":
            self.copy_handle(index, rng.randrange(COPY_KINDS))
        elif name == "refetch":
            self.refetch(index, rng.randint(0, SUFFIX_MAX))
        elif name == "store_fault":
            self.store_fault(rng.randrange(STORE_FAULTS), rng.randint(0, 2))
        elif name == "restart_store":
            self.restart_store()
        else:
            raise AssertionError(f"unknown operation {name}")
        return name
