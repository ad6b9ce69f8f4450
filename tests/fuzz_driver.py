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

Extension points (SSM layers, SWA scratch reuse and batched admission are being built): add configs to
``CONFIGS``; add operations as ``Fuzzer`` methods, list them in ``OPERATIONS`` with a weight (soak), dispatch
them in ``Fuzzer.random_step`` and add a matching rule to ``KVCacheMachine`` in ``tests/test_stateful.py``.
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Final, Iterator, Sequence, Union

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheStatus,
    LayerGroupId,
    OutOfPagesError,
    Priority,
    ReuseScope,
    _KVCache,
    gen_multimodal_cache_key_tokens,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.testing import FakeEngine

Token = Union[int, bytes]
I32 = npt.NDArray[np.int32]

KIB: Final = 1024
MAX_LIVE_CACHES: Final = 6
# Upper bounds (inclusive) of the ints the operations take; both drivers draw from [0, bound].
INDEX_MAX: Final = 7
SOURCE_MAX: Final = 15
CUT_MAX: Final = 300
SUFFIX_MAX: Final = 40
FLAGS_MAX: Final = 15
AMOUNT_MAX: Final = 48
RESIZE_KINDS: Final = 5
RESIZE_MODES: Final = 3
QUOTA_CHOICES: Final = 6
INVALID_KINDS: Final = 10
COUNT_MAX: Final = 64

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


def _full(_: str) -> KVCacheManagerConfig:
    layers: list[LayerConfig] = [AttentionLayerConfig(0, _kv(512)), AttentionLayerConfig(1, _kv(512))]
    return KVCacheManagerConfig(16, layers, [GpuCacheTierConfig(28 * 4 * 512)], backend="cpu")


def _swa_sinks(_: str) -> KVCacheManagerConfig:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=40, num_sink_tokens=5),
        AttentionLayerConfig(1, _kv(512), sliding_window_size=40, num_sink_tokens=5),
        AttentionLayerConfig(2, _kv(512), sliding_window_size=24),
        AttentionLayerConfig(3, _kv(512), sliding_window_size=64, num_sink_tokens=20),
    ]
    return KVCacheManagerConfig(16, layers, [GpuCacheTierConfig(20 * 8 * 512)], backend="cpu")


def _mixed_heads(_: str) -> KVCacheManagerConfig:
    """Two SWA layers (one with K and V of different sizes: two pools) and two full layers of another head size
    (one with expansion 2): two pool groups with different slot sizes."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, _kv(512), sliding_window_size=32),
        AttentionLayerConfig(1, _kv(512, 1024), sliding_window_size=32),
        AttentionLayerConfig(2, _kv(1024)),
        AttentionLayerConfig(3, _kv(1024, tokens_per_block_override=8)),
    ]
    typical = BatchDesc([KVCacheDesc(128, 112)] * 4)
    return KVCacheManagerConfig(
        16, layers, [GpuCacheTierConfig(160 * KIB)], backend="cpu", typical_step=typical
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
    return KVCacheManagerConfig(16, layers, tiers, backend="cpu")


# Extension point: add SSM (SsmLayerConfig), SWA scratch reuse and batch-admission configs here once they exist.
CONFIGS: Final[list[FuzzConfig]] = [
    FuzzConfig("full", _full, max_capacity=256, full_attention_only=True),
    FuzzConfig("swa_sinks", _swa_sinks, max_capacity=256),
    FuzzConfig("mixed_heads", _mixed_heads, max_capacity=192),
    FuzzConfig("tiered", _tiered, max_capacity=192, needs_directory=True),
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
)


# ------------------------------------------------------------------------------------------------- model
class CacheModel:
    """What the engine knows about one cache: its tokens by position and the lengths it expects."""

    def __init__(self, cache: _KVCache, tokens: list[Token], scope: ReuseScope | None, reused: int) -> None:
        self.cache = cache
        self.tokens = tokens
        self.prompt_length = len(tokens)
        self.scope = scope
        self.capacity = reused
        self.history = reused
        self.committed = reused
        self.active = False
        self.stopped = False
        self.buffers: dict[int, I32] = {}

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
        for name, count in other.by_operation.items():
            self.by_operation[name] = self.by_operation.get(name, 0) + count


def _lengths(cache: _KVCache) -> tuple[int, int, int]:
    return cache.capacity, cache.history_length, cache.num_committed_tokens


def _pick(candidates: Sequence[CacheModel], index: int) -> CacheModel | None:
    return candidates[index % len(candidates)] if candidates else None


def _same_scope(a: ReuseScope | None, b: ReuseScope | None) -> bool:
    return (ReuseScope() if a is None else a) == (ReuseScope() if b is None else b)


def _token_arg(tokens: list[Token], as_numpy: bool) -> object:
    """Tokens as the engine passes them: a list, or an int64 NumPy array when every token is an int."""
    if as_numpy and all(isinstance(token, int) for token in tokens):
        return np.array(tokens, dtype=np.int64)
    return tokens


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
            self.manager = KVCacheManager(config.build(self.directory or ""))
        except BaseException:
            self._remove_directory()
            raise
        self.engine = FakeEngine(self.manager)
        self.tpb = self.manager.tokens_per_block
        self.max_blocks = math.ceil(config.max_capacity / self.tpb)
        self.quotas = [self.manager.get_quota(level) for level in range(self.manager.num_cache_levels)]
        self._windows = [self.manager.get_layer_window(group[0]) for group in self.manager.layer_grouping]
        self.live: list[CacheModel] = []
        self.closed: list[CacheModel] = []
        self.stats = FuzzStats()
        self.broken = False  # set after a failure: teardown then only releases what it can
        self.last_operation = ""
        self._next_token = 1000
        self._next_id = 1_000_000
        tpb = self.tpb
        image = gen_multimodal_cache_key_tokens(MULTIMODAL_OFFSET, b"image-0", tpb)
        self.shared_prefixes: list[list[Token]] = [
            self._fresh(3 * tpb),
            self._fresh(2 * tpb + 5),
            self._fresh(tpb // 2) + image + self._fresh(tpb),
            self._fresh(5 * tpb + 3),
        ]
        self.recent: list[list[Token]] = []  # token lists of recent caches (multi-turn prefixes)
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
            assert self.manager.probe_reuse(scope, prefix) > 0 or len(prefix) < self.tpb
        self.manager.check_invariants()

    # ---------------------------------------------------------------------------------------------- helpers
    def _fresh(self, count: int) -> list[Token]:
        tokens: list[Token] = list(range(self._next_token, self._next_token + count))
        self._next_token += count
        return tokens

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
        if operation == "create":
            return len(self.live) < MAX_LIVE_CACHES
        if operation in ("resume", "stop_committing", "suspend", "close", "serve"):
            return bool(self.live)
        if operation in ("resize", "register_buffer"):
            return any(model.active for model in self.live)
        if operation == "commit":
            return any(model.active and not model.stopped for model in self.live)
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
            lower = self._reuse_lower_bound(reuse_scope, prompt)
            probe = self.manager.probe_reuse(reuse_scope, _token_arg(prompt, bool(flags & 1)))
            assert lower <= probe <= len(prompt), f"probe_reuse {probe} outside [{lower}, {len(prompt)}]"
            cache_id: int | None = None
            if flags & 2:
                live_ids = {model.cache.id for model in self.live}
                while self._next_id in live_ids:
                    self._next_id += 1
                cache_id = self._next_id
                self._next_id += 1
            callback: Callable[[int, LayerGroupId], Priority] | None = None
            if flags & 4:
                base = (source * 37 + suffix) % 101
                callback = lambda ordinal, group: Priority((base + 7 * ordinal + 13 * int(group)) % 101)  # noqa: E731
            expected = len(prompt) if flags & 8 else None
            live_before = self.manager.num_live_caches
            cache = self.manager.create_kv_cache(
                reuse_scope,
                _token_arg(prompt, bool(flags & 1)),
                id=cache_id,
                custom_priority_callback=callback,
                expected_prompt_length=expected,
            )
            model = CacheModel(cache, prompt, reuse_scope, probe)
            assert cache.status == KVCacheStatus.SUSPENDED, cache
            assert _lengths(cache) == model.lengths, (cache, probe)
            assert cache_id is None or cache.id == cache_id, (cache.id, cache_id)
            assert all(other.cache.id != cache.id for other in self.live), f"cache id {cache.id} reused"
            assert self.manager.num_live_caches == live_before + 1
            self.live.append(model)
            self.recent = (self.recent + [model.tokens])[-8:]
            self.stats.caches_created += 1
            if probe > 0:
                self.stats.reuse_hits += 1
                self.stats.reused_tokens += probe

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
                model.cache.commit(tokens)
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
            model.buffers.clear()
            assert model.cache.status == KVCacheStatus.SUSPENDED

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
            model.buffers.clear()
            self.closed = (self.closed + [model])[-4:]
            assert self.manager.num_live_caches == len(self.live)

    def change_quota(self, level: int, choice: int) -> None:
        """Suspend every cache, then ``manager.resize(level, quota)``: True sets the quota, False changes nothing."""
        with self._operation("change_quota"):
            level %= len(self.quotas)
            for model in self._active():
                model.cache.suspend()
                model.active = False
                model.buffers.clear()
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

    def clear_reusable(self) -> None:
        """Drops only content no cache uses: free slots never shrink, the last tier keeps nothing evictable, and
        (full attention) blocks committed by live caches stay reusable. Probes may go up as well as down: with
        partial reuse, dropping a page-less block can expose a partially matching sibling (SPEC §4's walk)."""
        with self._operation("clear_reusable"):
            levels = range(self.manager.num_cache_levels)
            before_free = [[s.free for s in self.manager.get_storage_statistics(level)] for level in levels]
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
            model = _pick(self._active(), index)
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
                if self.live:
                    call, what = self.manager.shutdown, "shutdown with open caches"
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

    # ------------------------------------------------------------------------------------------------ checks
    def _check_buffers(self, model: CacheModel) -> None:
        blocks = model.cache.num_blocks
        for lg, buffer in model.buffers.items():
            expected = list(model.cache.get_base_page_indices(lg))
            assert buffer[:blocks].tolist() == expected, (lg, buffer[:blocks].tolist(), expected)

    def _stale_range(self, layer_group: int, history: int) -> tuple[int, int]:
        """SPEC §3's stale range, from the public window of the layer group's first layer."""
        window, sinks = self._windows[layer_group]
        start = min(-(-history // self.tpb), -(-sinks // self.tpb))
        if window == 0:
            return start, start
        return start, max(start, (history + 1 - window) // self.tpb)

    def _check_page_table(self, model: CacheModel) -> None:
        """An active cache has a page exactly outside the stale range of each layer group."""
        for lg in range(self.manager.num_layer_groups):
            indices = model.cache.get_base_page_indices(lg)
            assert len(indices) == model.cache.num_blocks, (lg, len(indices), model.cache)
            stale_beg, stale_end = self._stale_range(lg, model.history)
            for ordinal, slot in enumerate(indices):
                stale = stale_beg <= ordinal < stale_end
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
        else:
            raise AssertionError(f"unknown operation {name}")
        return name
