"""Every state-changing public call, made from every kind of user code that runs inside a manager call (a priority
callback, an event-manager hook, a cold-page codec, a remote store), raises ``RuntimeError`` naming the call in
flight and changes nothing; the outer call completes and the manager serves correct content afterwards.

The calls are classified by name (``GUARDED`` / ``READS``) against the public classes themselves, so a public
method added later fails ``test_every_public_call_is_classified`` until someone decides which it is."""

from __future__ import annotations

import gc
import inspect
from typing import Callable

import numpy as np
import numpy.typing as npt
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    KVCache,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheRequest,
    LifeCycle,
    MultimodalDigest,
    PlannedDropHandle,
    Priority,
    RemoteCacheTierConfig,
    RemoteStore,
    ReuseScope,
)
from kv_cache_manager_v2._base.hashing import check_tokens
from kv_cache_manager_v2._introspection import internals_of, reuse_match_planned_drop_counts
from kv_cache_manager_v2._storage.page_codec import PaddingColdPageCodec
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.forwarding_store import ForwardingStore
from tests.helpers import KIB, attention, compute_prompt, make_config, seeded_prompt, serve_checked

TPB = 16
KV = 2 * KIB
SLOT = 2 * 2 * KV  # two layers (one windowed), K and V


class World:
    """A manager, its engine, an active cache (``victim``) and a finished turn's planned drop (``plan``)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.engine = FakeEngine(manager)
        finished = compute_prompt(manager, self.engine, seeded_prompt(90, 3 * TPB))
        finished.stop_committing()
        plan = finished.plan_committed_block_drop()
        finished.close()
        assert plan is not None
        self.plan: PlannedDropHandle = plan
        self.victim_tokens = seeded_prompt(91, 2 * TPB + 3)
        self.victim: KVCache | None = compute_prompt(manager, self.engine, self.victim_tokens)
        self.refusals: dict[str, str] = {}
        self.armed = False
        self.dropping = False  # what the armed user code does: drop the handles (else call everything)
        self.queued_inside = -1

    def call_everything(self) -> None:
        """Once, from inside user code: every guarded call, each expected to raise RuntimeError (or, ``dropping``,
        drop the last references to the victim's handle and the plan and run the collector)."""
        if not self.armed:
            return
        self.armed = False
        if self.dropping:
            self.victim = self.plan = None  # type: ignore[assignment]
            gc.collect()
            self.queued_inside = len(internals_of(self.manager).guard.dropped)
            return
        for name, call in GUARDED.items():
            try:
                call(self)
            except RuntimeError as error:
                self.refusals[name] = str(error)
            else:
                self.refusals[name] = "accepted"


def _set(target: object, name: str, value: object) -> None:
    setattr(target, name, value)


def victim(world: World) -> KVCache:
    assert world.victim is not None
    return world.victim


GUARDED: dict[str, Callable[[World], object]] = {
    "KVCacheManager.adjust": lambda w: w.manager.adjust(),
    "KVCacheManager.check_invariants": lambda w: w.manager.check_invariants(),
    "KVCacheManager.clear_reusable_blocks": lambda w: w.manager.clear_reusable_blocks(),
    "KVCacheManager.clear_stats_excluded": lambda w: w.manager.clear_stats_excluded(None),
    "KVCacheManager.create_kv_cache": lambda w: w.manager.create_kv_cache(None, [1, 2, 3]),
    "KVCacheManager.create_kv_cache_batch": lambda w: w.manager.create_kv_cache_batch([KVCacheRequest([1, 2])]),
    "KVCacheManager.get_usage": lambda w: w.manager.get_usage(),
    "KVCacheManager.mark_stats_excluded": lambda w: w.manager.mark_stats_excluded(None),
    "KVCacheManager.prefetch_remote": lambda w: w.manager.prefetch_remote(None, w.victim_tokens),
    "KVCacheManager.probe_reuse": lambda w: w.manager.probe_reuse(None, w.victim_tokens),
    "KVCacheManager.probe_reuse_by_tier": lambda w: w.manager.probe_reuse_by_tier(None, w.victim_tokens),
    "KVCacheManager.resize": lambda w: w.manager.resize(0, w.manager.get_quota(0)),
    "KVCacheManager.shutdown": lambda w: w.manager.shutdown(),
    "KVCache.capacity": lambda w: _set(victim(w), "capacity", victim(w).capacity + TPB),
    "KVCache.close": lambda w: victim(w).close(),
    "KVCache.commit": lambda w: victim(w).commit([]),
    "KVCache.commit_pending_stats": lambda w: victim(w).commit_pending_stats(),
    "KVCache.cuda_stream": lambda w: _set(victim(w), "cuda_stream", 0),
    "KVCache.discard_pending_stats": lambda w: victim(w).discard_pending_stats(),
    "KVCache.enable_swa_scratch_reuse": lambda w: _set(victim(w), "enable_swa_scratch_reuse", False),
    "KVCache.history_length": lambda w: _set(victim(w), "history_length", victim(w).capacity),
    "KVCache.hold": lambda w: victim(w).hold("inside"),
    "KVCache.offload": lambda w: victim(w).offload(),
    "KVCache.plan_committed_block_drop": lambda w: victim(w).plan_committed_block_drop(),
    "KVCache.prefetch": lambda w: victim(w).prefetch(),
    "KVCache.resize": lambda w: victim(w).resize(victim(w).capacity + TPB),
    "KVCache.resume": lambda w: victim(w).resume(),
    "KVCache.set_base_page_index_buf": lambda w: victim(w).set_base_page_index_buf(0, 0, None),
    "KVCache.stop_committing": lambda w: victim(w).stop_committing(),
    "KVCache.suspend": lambda w: victim(w).suspend(),
    "PlannedDropHandle.drop": lambda w: w.plan.drop(),
}

# Reads: answered from the state as it is (statistics may be read from another thread, mid-call).
READS = {
    "KVCacheManager": {
        "can_fit", "can_fit_in_chunks", "clamp_max_seq_len_for_mem", "gen_multimodal_cache_key_tokens", "get_aggregated_pages",
        "get_and_reset_iteration_stats", "get_and_reset_ssm_snapshot_iteration_stats", "get_committed_stats",
        "get_dirty_stats_kv_cache_ids", "get_iteration_stats", "get_latest_events", "get_layer_group_id",
        "get_layer_window", "get_life_cycle_pool_group_indices", "get_mem_pool_base_address",
        "get_page_index_converter", "get_page_index_scale", "get_page_index_upper_bound", "get_page_stride", "get_page_view", "get_pool_base_address", "get_pool_group_index", "get_quota",
        "get_remote_tier_statistics", "get_slot_bytes", "get_storage_statistics", "is_stats_excluded",
        "max_admissible", "peak_pages", "supports_index_mode",
    },
    "KVCache": {
        "_get_num_reusable_tokens_before_hybrid_pruning", "_get_num_reusable_tokens_before_pruning",
        "get_aggregated_page_indices", "get_base_page_indices", "get_num_front_blocks_removed", "get_scratch_desc",
        "get_ssm_block_base_index", "supports_index_mode",
    },
    "PlannedDropHandle": set(),
}


def public_calls(cls: type) -> set[str]:
    """Methods and property setters of ``cls`` an engine may call (TensorRT-LLM's underscored ones included)."""
    names = set()
    for name in dir(cls):
        if name.startswith("__") or (name.startswith("_") and not name.startswith("_get_num_reusable")):
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, property):
            if member.fset is not None:
                names.add(name)
        elif callable(member) and not isinstance(member, type):
            names.add(name)
    return names


@pytest.mark.parametrize("cls", [KVCacheManager, KVCache, PlannedDropHandle], ids=lambda cls: cls.__name__)
def test_every_public_call_is_classified(cls: type) -> None:
    guarded = {name.split(".")[1] for name in GUARDED if name.startswith(cls.__name__ + ".")}
    classified = guarded | READS[cls.__name__]
    if kv_cache_manager_v2.COMPILED:  # a native class's getset descriptors all look settable: its methods only here
        classified = {name for name in classified if callable(inspect.getattr_static(cls, name))}
    assert public_calls(cls) == classified


# ------------------------------------------------------------------------------------ the user code
class CallingEvents(KVCacheEventManager):
    def __init__(self) -> None:
        super().__init__(1000)
        self.world: World | None = None

    def add_stored_event(self, *args: object, **kwargs: object) -> None:
        if self.world is not None:
            self.world.call_everything()
        super().add_stored_event(*args, **kwargs)  # type: ignore[arg-type]


class CallingCodec(PaddingColdPageCodec):
    def __init__(self) -> None:
        super().__init__({0: 3 * KV, 1: 3 * KV})
        self.world: World | None = None

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        if self.world is not None:
            self.world.call_everything()
        super().encode(layer_group_id, pages, encoded)


class CallingStoreConfig:
    def __init__(self) -> None:
        self.memory = MemoryStoreConfig()
        self.world: World | None = None

    def open(self, quota: int) -> RemoteStore:
        return CallingStore(self.memory.open(quota), self)


class CallingStore(ForwardingStore):
    def __init__(self, inner: RemoteStore, config: CallingStoreConfig) -> None:
        super().__init__(inner)
        self.config = config

    def put_batch(self, keys: list[str], buffers: list[npt.NDArray[np.uint8]]) -> list[bool]:
        if self.config.world is not None:
            self.config.world.call_everything()
        return self.inner.put_batch(keys, buffers)


def layers() -> list[object]:
    return [attention(0, KV, window=TPB), attention(1, KV)]


def world_for(surface: str) -> tuple[World, Callable[[], object]]:
    """The manager with ``surface``'s user code plugged in, and the outer call that runs it."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(64 * SLOT)]
    if surface == "event_hook":
        events = CallingEvents()
        world = World(KVCacheManager(make_config(layers(), tiers=tiers, tokens_per_block=TPB), event_manager=events))  # type: ignore[arg-type]
        events.world = world
    elif surface == "codec":
        codec = CallingCodec()
        tiers = [GpuCacheTierConfig(16 * SLOT), GpuCacheTierConfig(1 << 20)]
        world = World(KVCacheManager(
            make_config(layers(), tiers=tiers, tokens_per_block=TPB, max_util_for_resume=1.0),  # type: ignore[arg-type]
            cold_page_codec=codec,
        ))
        codec.world = world
    elif surface == "store":
        store = CallingStoreConfig()
        tiers.append(RemoteCacheTierConfig(0, store, namespace="t"))
        world = World(KVCacheManager(make_config(layers(), tiers=tiers, tokens_per_block=TPB)))  # type: ignore[arg-type]
        store.world = world
    else:
        world = World(KVCacheManager(make_config(layers(), tiers=tiers, tokens_per_block=TPB)))  # type: ignore[arg-type]

    def serve_new() -> None:  # commits (events, store), evicts to the cold tier (codec)
        for seed in range(6):
            serve_checked(world.manager, world.engine, seeded_prompt(seed, 3 * TPB))

    def grow_with_callback() -> None:
        def priority(ordinal: int, life_cycle: LifeCycle) -> Priority:
            world.call_everything()
            return Priority(35)

        cache = world.manager.create_kv_cache(custom_priority_callback=priority)
        assert cache.resume() and cache.resize(2 * TPB)
        cache.close()

    return world, grow_with_callback if surface == "priority" else serve_new


@pytest.mark.parametrize("surface", ["priority", "event_hook", "codec", "store"])
def test_every_changing_call_from_user_code_is_refused_and_changes_nothing(surface: str) -> None:
    world, outer = world_for(surface)
    victim = world.victim
    assert victim is not None
    lengths = (victim.capacity, victim.history_length, victim.num_committed_tokens)
    world.armed = True
    outer()
    assert not world.armed, "the user code never ran"
    accepted = [name for name, message in world.refusals.items() if "is in flight" not in message]
    assert not accepted, {name: world.refusals[name] for name in accepted}
    assert victim.is_active and not victim.held_for and not victim.is_committing_stopped
    assert (victim.capacity, victim.history_length, victim.num_committed_tokens) == lengths
    assert not world.plan.is_dropped
    gc.collect()
    world.manager.check_invariants()
    world.engine.check(victim, world.victim_tokens)
    victim.close()
    world.plan.drop()
    for seed in range(3):
        serve_checked(world.manager, world.engine, seeded_prompt(seed, 3 * TPB))
    world.manager.shutdown()


@pytest.mark.parametrize("surface", ["priority", "event_hook", "codec", "store"])
def test_handles_dropped_and_collected_inside_user_code_are_finished_after_the_call(surface: str) -> None:
    """The victim's handle and the planned drop, dropped and collected from inside the call, are only queued; the
    next call closes the cache and applies the plan; the content served meanwhile and after is checked."""
    world, outer = world_for(surface)
    turn = seeded_prompt(90, 3 * TPB)
    window_group = world.manager.get_layer_group_id(0)
    world.armed = world.dropping = True
    outer()
    assert world.queued_inside == 2  # the cache and the plan, queued, not finished inside the call
    assert world.manager.num_live_caches == 0  # a read that finishes the queue between calls
    _, counts = reuse_match_planned_drop_counts(world.manager, None, turn, window_group)
    assert all(count in (0, None) for count in counts), counts
    world.manager.check_invariants()
    for seed in range(3):
        serve_checked(world.manager, world.engine, seeded_prompt(seed, 3 * TPB))
    world.manager.shutdown()


# ------------------------------------------------------------------------------------ token objects
class ProbingToken(MultimodalDigest):
    """A token of the user's own bytes subclass whose ``__hash__`` / ``__eq__`` raise while ``armed``: the
    manager's tree would call them half way through a commit (which then raised with its committed tokens moved
    but only its first block in the tree)."""

    armed = False
    calls = 0

    def __hash__(self) -> int:
        return self.probe() or bytes.__hash__(self)

    def __eq__(self, other: object) -> bool:
        return bool(self.probe()) or bytes.__eq__(self, other)

    @staticmethod
    def probe() -> int:
        if ProbingToken.armed:
            ProbingToken.calls += 1
            raise RuntimeError("a token's method ran inside a manager call")
        return 0


def test_token_objects_run_no_code_inside_manager_calls() -> None:
    manager = KVCacheManager(make_config([attention(0, KV)], tokens_per_block=TPB))
    engine = FakeEngine(manager)
    plain: list[int | bytes] = [*range(3 * TPB)]
    plain[5], plain[TPB + 3] = b"x" * 32, b"y" * 32
    tokens: list[int | bytes] = list(plain)
    tokens[5] = ProbingToken(b"x" * 32)
    tokens[TPB + 3] = ProbingToken(b"y" * 32)
    tokens[TPB + 3].uuid = "item-1"  # type: ignore[union-attr]
    assert [getattr(token, "uuid", None) for token in check_tokens(tokens, "t")][TPB + 3] == "item-1"
    ProbingToken.armed = True
    try:
        cache = manager.create_kv_cache(None, tokens[:-1])
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        cache.close()
        reused = manager.probe_reuse(None, tokens)
    finally:
        ProbingToken.armed = False
    assert ProbingToken.calls == 0 and reused == len(tokens)
    assert manager.probe_reuse(None, plain) == len(tokens)  # the same values as plain bytes
    serve_checked(manager, engine, [*range(1000, 1000 + 2 * TPB)])
    manager.shutdown()


class ProbingSalt(str):
    """A salt of the user's own str subclass whose methods raise while ``ProbingToken.armed``."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        ProbingToken.probe()
        return str.encode(self, encoding, errors)

    def __hash__(self) -> int:
        return ProbingToken.probe() or str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        return bool(ProbingToken.probe()) or str.__eq__(self, other)


class ProbingScope(ReuseScope):
    """A ``ReuseScope`` subclass whose hash and equality raise while ``ProbingToken.armed``."""

    def __hash__(self) -> int:
        return ProbingToken.probe() or ReuseScope.__hash__(self)

    def __eq__(self, other: object) -> bool:
        return bool(ProbingToken.probe()) or ReuseScope.__eq__(self, other)


def test_scopes_and_batch_requests_run_no_code_inside_manager_calls() -> None:
    """A salt of a str subclass ran its ``encode`` inside ``create_kv_cache``; a batch request's tokens or scope
    set after construction reached the tree as they were."""
    manager = KVCacheManager(make_config([attention(0, KV)], tokens_per_block=TPB))
    tokens: list[int | bytes] = [*range(2 * TPB)]
    salted = ReuseScope(3, ProbingSalt("tenant"))
    request = KVCacheRequest([1, 2, 3], capacity=2 * TPB)
    request.input_tokens = [*tokens[:TPB], ProbingToken(b"z" * 32), *tokens[TPB + 1 :]]
    # Compiled, mypyc checks a ``ReuseScope`` parameter or field by exact type (the class has no subclass of its
    # own), so a subclass is refused at the call, before anything runs; interpreted, it is taken as the plain scope
    # it holds.
    if kv_cache_manager_v2.COMPILED:
        with pytest.raises(TypeError, match="ReuseScope object expected"):
            request.reuse_scope = ProbingScope(4)
        request.reuse_scope = ReuseScope(4)
    else:
        request.reuse_scope = ProbingScope(4)
    scope = ReuseScope(3, "tenant") if kv_cache_manager_v2.COMPILED else ProbingScope(3, "tenant")
    ProbingToken.armed = True
    try:
        cache = manager.create_kv_cache(salted, tokens)
        cache.close()
        if kv_cache_manager_v2.COMPILED:
            with pytest.raises(TypeError, match="ReuseScope object expected"):
                manager.probe_reuse(ProbingScope(3, "tenant"), tokens)
        reused = manager.probe_reuse(scope, tokens)
        admitted = manager.create_kv_cache_batch([request])[0]
        assert admitted is not None
        admitted.close()
    finally:
        ProbingToken.armed = False
    assert ProbingToken.calls == 0 and reused == 0  # nothing committed; the scope is ReuseScope(3, "tenant")
    assert cache.reuse_scope == ReuseScope(3, "tenant") and type(cache.reuse_scope.salt) is str
    manager.check_invariants()
    manager.shutdown()


def test_fit_queries_from_a_priority_callback_answer_without_recording_a_refusal() -> None:
    """``can_fit`` and ``can_fit_in_chunks`` answer from inside a call (they are reads) but leave ``last_refusal``
    to the call in flight: a refusal recorded mid-call would stand for that call's own."""
    world, _ = world_for("priority")
    manager = world.manager
    too_long = 1 << 20
    seen: list[tuple[bool, bool, bool]] = []

    def priority(ordinal: int, life_cycle: LifeCycle) -> Priority:
        before = manager.last_refusal
        answers = (manager.can_fit(too_long), manager.can_fit_in_chunks(too_long, TPB))
        seen.append((*answers, manager.last_refusal is before))
        return Priority(35)

    cache = manager.create_kv_cache(custom_priority_callback=priority)
    assert cache.resume() and cache.resize(2 * TPB)
    cache.close()
    assert seen and all(entry == (False, False, True) for entry in seen), seen
    assert not manager.can_fit(too_long) and manager.last_refusal is not None  # between calls it records
    victim(world).close()
    world.plan.drop()
    manager.shutdown()
