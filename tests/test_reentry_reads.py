"""Every public read of the manager and of a cache (methods and properties alike), made from a priority callback
in the middle of a ``resize``: each answers or raises the ``RuntimeError`` naming the call in flight, changes
nothing that call relies on, and the call completes with correct content. ``test_reentry_surfaces`` sweeps the
state-changing calls; this sweeps the rest, the cache being resized included.

The reads are listed by name against the public classes, so a read added later fails here until it is swept."""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any, Callable

import pytest

from kv_cache_manager_v2 import (
    KVCache,
    KVCacheEventManager,
    KVCacheManager,
    KVEvent,
    LifeCycle,
    PageIndexMode,
    Priority,
)
from tests.helpers import KIB, attention, make_config, seeded_prompt, serve_checked, ssm
from tests.test_reentry_surfaces import READS, TPB, World, world_for

Read = Callable[[KVCacheManager, KVCache], object]

MANAGER_READS: dict[str, Read] = {
    "can_fit": lambda m, c: m.can_fit(TPB),
    "can_fit_in_chunks": lambda m, c: m.can_fit_in_chunks(4 * TPB, TPB),
    "clamp_max_seq_len_for_mem": lambda m, c: m.clamp_max_seq_len_for_mem(2, 8 * TPB),
    "gen_multimodal_cache_key_tokens": lambda m, c: m.gen_multimodal_cache_key_tokens(b"d" * 32, 3, 1 << 20),
    "get_aggregated_pages": lambda m, c: m.get_aggregated_pages(m.all_buffer_ids),
    "get_and_reset_iteration_stats": lambda m, c: m.get_and_reset_iteration_stats(),
    "get_and_reset_ssm_snapshot_iteration_stats": lambda m, c: m.get_and_reset_ssm_snapshot_iteration_stats(),
    "get_committed_stats": lambda m, c: m.get_committed_stats(),
    "get_dirty_stats_kv_cache_ids": lambda m, c: m.get_dirty_stats_kv_cache_ids(),
    "get_iteration_stats": lambda m, c: m.get_iteration_stats(),
    "get_latest_events": lambda m, c: m.get_latest_events(),
    "get_layer_group_id": lambda m, c: m.get_layer_group_id(1),
    "get_layer_window": lambda m, c: m.get_layer_window(0),
    "get_life_cycle_pool_group_indices": lambda m, c: m.get_life_cycle_pool_group_indices(0),
    "get_mem_pool_base_address": lambda m, c: m.get_mem_pool_base_address(1, "key"),
    "get_page_index_converter": lambda m, c: m.get_page_index_converter(1, "key")(c.get_base_page_indices(1)),
    "get_page_index_scale": lambda m, c: m.get_page_index_scale(1, "key"),
    "get_page_index_upper_bound": lambda m, c: m.get_page_index_upper_bound(1, "key"),
    "get_page_stride": lambda m, c: m.get_page_stride(1, "key"),
    "get_page_view": lambda m, c: m.get_page_view(1, "key"),
    "get_pool_base_address": lambda m, c: m.get_pool_base_address(0, 0),
    "get_pool_group_index": lambda m, c: m.get_pool_group_index(0),
    "get_quota": lambda m, c: m.get_quota(0),
    "get_remote_tier_statistics": lambda m, c: m.get_remote_tier_statistics(),
    "get_slot_bytes": lambda m, c: m.get_slot_bytes(0),
    "get_storage_statistics": lambda m, c: m.get_storage_statistics(0),
    "is_stats_excluded": lambda m, c: m.is_stats_excluded(None),
    "max_admissible": lambda m, c: m.max_admissible(TPB),
    "peak_pages": lambda m, c: m.peak_pages(100, TPB),
    "supports_index_mode": lambda m, c: m.supports_index_mode(PageIndexMode.SHARED),
}

CACHE_READS: dict[str, Read] = {
    "_get_num_reusable_tokens_before_hybrid_pruning": lambda m, c: c._get_num_reusable_tokens_before_hybrid_pruning(),
    "_get_num_reusable_tokens_before_pruning": lambda m, c: c._get_num_reusable_tokens_before_pruning(),
    "get_aggregated_page_indices": lambda m, c: c.get_aggregated_page_indices(0),
    "get_base_page_indices": lambda m, c: c.get_base_page_indices(0),
    "get_num_front_blocks_removed": lambda m, c: c.get_num_front_blocks_removed(0),
    "get_scratch_desc": lambda m, c: c.get_scratch_desc(0),
    "get_ssm_block_base_index": lambda m, c: no_ssm_group_here(c),
    "supports_index_mode": lambda m, c: c.supports_index_mode(PageIndexMode.SHARED),
}


def no_ssm_group_here(cache: KVCache) -> None:
    """This model has no SSM layer: the read's answer is its usual refusal."""
    with pytest.raises(ValueError, match="not an SSM layer group"):
        cache.get_ssm_block_base_index(0)


def properties(cls: type) -> list[str]:
    return sorted(
        name for name in dir(cls)
        if not name.startswith("_") and not callable(inspect.getattr_static(cls, name))
        and not isinstance(inspect.getattr_static(cls, name), (str, int))
    )


def manager_property(name: str) -> Read:
    return lambda manager, cache: getattr(manager, name)


def cache_property(name: str) -> Read:
    return lambda manager, cache: getattr(cache, name)


def sweep(manager: KVCacheManager, cache: KVCache) -> dict[str, str]:
    """Every read of ``manager`` and ``cache``: what each did (``answered``, or its error)."""
    reads: dict[str, Read] = {f"KVCacheManager.{name}": read for name, read in MANAGER_READS.items()}
    reads.update({f"KVCache.{name}": read for name, read in CACHE_READS.items()})
    reads.update({f"KVCacheManager.{name}": manager_property(name) for name in properties(KVCacheManager)})
    reads.update({f"KVCache.{name}": cache_property(name) for name in properties(KVCache)})
    outcomes: dict[str, str] = {}
    for name, read in reads.items():
        try:
            read(manager, cache)
        except Exception as error:  # reported, every one, by the test
            outcomes[name] = f"{type(error).__name__}: {error}"
        else:
            outcomes[name] = "answered"
    return outcomes


def test_every_read_is_swept() -> None:
    assert set(MANAGER_READS) == READS["KVCacheManager"]
    assert set(CACHE_READS) == READS["KVCache"]


@pytest.mark.parametrize("target", ["resized", "victim"])
def test_every_read_from_a_priority_callback_answers_or_is_refused(target: str) -> None:
    world: World = world_for("priority")[0]
    manager = world.manager
    box: list[KVCache] = []
    outcomes: list[dict[str, str]] = []

    def priority(ordinal: int, life_cycle: LifeCycle) -> Priority:
        if not outcomes:
            read_from = box[0] if target == "resized" else world.victim
            assert read_from is not None
            outcomes.append(sweep(manager, read_from))
        return Priority(35)

    tokens = seeded_prompt(7, 2 * TPB + 5)
    cache = manager.create_kv_cache(input_tokens=tokens, custom_priority_callback=priority)
    box.append(cache)
    assert cache.resume() and cache.resize(len(tokens))
    assert outcomes, "the callback never ran"
    unexpected = {
        name: outcome for name, outcome in outcomes[0].items()
        if outcome != "answered" and not (outcome.startswith("RuntimeError") and "is in flight" in outcome)
    }
    assert unexpected == {}
    world.engine.step(cache, tokens)
    cache.commit(tokens)
    world.engine.check(cache, tokens)
    cache.close()
    manager.check_invariants()
    assert world.victim is not None
    world.engine.check(world.victim, world.victim_tokens)
    world.victim.close()
    world.plan.drop()
    for seed in range(3):
        serve_checked(manager, world.engine, seeded_prompt(seed, 3 * TPB))
    manager.shutdown()


# ------------------------------------------------------------------------------ drains in the middle of a call
class DrainingEvents(KVCacheEventManager):
    """Runs ``drain`` inside every stored or removed event's hook: in the middle of a commit, a close, an eviction."""

    def __init__(self) -> None:
        super().__init__(10_000)
        self.drain: Callable[[], None] = lambda: None

    def add_stored_event(self, *args: Any, **kwargs: Any) -> None:
        self.drain()
        super().add_stored_event(*args, **kwargs)

    def add_removed_event(self, *args: Any, **kwargs: Any) -> None:
        self.drain()
        super().add_removed_event(*args, **kwargs)


class Drains:
    """What the three draining reads handed over, added up."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.stats: Counter[tuple[int, str]] = Counter()
        self.ssm: Counter[tuple[int, str]] = Counter()
        self.events: list[KVEvent] = []
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        for group, delta in self.manager.get_and_reset_iteration_stats().items():
            self.stats.update({(group, name): value for name, value in vars_of(delta).items()})
        for group, snapshot in self.manager.get_and_reset_ssm_snapshot_iteration_stats().items():
            self.ssm.update({(group, name): value for name, value in vars_of(snapshot).items()})
        self.events.extend(self.manager.get_latest_events())


def vars_of(value: object) -> dict[str, int]:
    return {name: getattr(value, name) for name in dir(value) if name.startswith("iter_") and type(getattr(value, name)) is int}


def serve_drained(mid_call: bool) -> Drains:
    """A workload with reuse, SSM snapshots and evictions; ``mid_call``: drained from inside every priority
    callback and event hook as well, else only at the end."""
    events = DrainingEvents()
    config = make_config(
        [attention(0, KIB), ssm(1, 2 * KIB, KIB)], gpu_quota=40 * 5 * KIB, tokens_per_block=TPB,
        ssm_reuse_interval=2 * TPB, snapshot_prefill_chunks=False, enable_kv_events=True,
    )
    manager = KVCacheManager(config, event_manager=events)
    drains = Drains(manager)
    if mid_call:
        events.drain = drains

    def priority(ordinal: int, life_cycle: LifeCycle) -> Priority:
        if mid_call:
            drains()
        return Priority(35)

    shared = seeded_prompt(1, 6 * TPB)
    for round_index in range(12):
        tokens = shared[: 2 * TPB * (1 + round_index % 3)] + seeded_prompt(100 + round_index, 2 * TPB + round_index)
        cache = manager.create_kv_cache(input_tokens=tokens, custom_priority_callback=priority)
        assert cache.resume()
        for end in [*range(2 * TPB, len(tokens), 2 * TPB), len(tokens)]:  # snapshots where chunks end
            if end > cache.history_length:
                assert cache.resize(end, cache.history_length)
                cache.commit(tokens[cache.num_committed_tokens : end])
        cache.close()
    events.drain = lambda: None
    drains()
    manager.shutdown()
    return drains


def test_drains_from_inside_calls_hand_over_every_count_and_event_once() -> None:
    """Iteration statistics, SSM snapshot statistics and events taken from a priority callback and from event
    hooks, half way through the calls recording them, add up to what one drain at the end takes of the same
    workload: nothing recorded by the call in flight is lost or counted twice."""
    mid_call, at_end = serve_drained(True), serve_drained(False)
    assert mid_call.calls > 20 and at_end.calls == 1
    assert at_end.stats[1, "iter_reused_blocks"] > 0 and at_end.stats[1, "iter_host_dropped_blocks"] > 0
    assert at_end.ssm[1, "iter_snapshot_hits"] > 0 and len(at_end.events) > 20
    assert +mid_call.stats == +at_end.stats
    assert +mid_call.ssm == +at_end.ssm
    assert [event.event_id for event in mid_call.events] == list(range(len(at_end.events)))
    assert mid_call.events == at_end.events
