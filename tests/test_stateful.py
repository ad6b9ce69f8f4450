"""Stateful fuzzing of the request lifecycle with a Hypothesis ``RuleBasedStateMachine``.

Rules: create (prompts drawn from shared prefixes and earlier requests, random reuse scopes, NumPy tokens, explicit
ids, priority callbacks), resume, resize (grow, shrink, advance_history, next_chunk, decode; ints, NumPy ints or
the setters), serve (resume if needed, one prefill chunk or decode token, commit), commit, stop_committing,
suspend, place (offload, prefetch, evicting prefetch of a suspended cache: active caches unchanged), close,
register_buffer, change_quota (``manager.resize`` with every cache suspended),
clear_reusable_blocks, invalid_move (documented ValueErrors), create_batch (id collisions, repeated prompts,
absurd capacities, failing callbacks), preempt_batch (the first request of a batch sharing a new prefix cut,
suspended, closed or dropped before its step: the others compute as their lengths say), misbehave (a priority
callback failing for one call), adjust,
re-entrancy: drop_in_cycle (a handle dropped in a reference cycle, the collector armed inside the next call),
reenter (a priority callback calling back into the manager), copy_handle and held_call (page-changing calls on a
held cache), and for the remote configs refetch
(a closed request's tokens fetched back), twin_serves (a second instance sharing the store, of the same deployment,
another model, another deployment (another secret key) or the same deployment rotated to a new secret, serves them), store_fault (among its faults a get or a put
stalled past its deadline, completed late: ``tests/fuzz/stalled_transfers.py``, and half a call's keys lost) and restart_store; disk_fault (a serve step while the disk
tier's pool files fail reads or writes) and codec_fault (the cold-page codec raising on its next calls, or
interrupting one: a ``BaseException`` that comes out when that call completed; store_fault interrupts too); misuse (a bad call
from ``tests/fuzz/misuse.py``'s catalogue: the documented error naming its argument, nothing observable changed) and probe (an
LPM scheduler's ``probe_reuse`` of a waiting request: nothing observable changed, the eviction lists included). After every rule: ``check_invariants``, slot
accounting, the KV events replayed (tiers, and the wire's ``medium``; every twin's too), the modelled lengths and statuses, page tables against the stale ranges the windows imply, registered page tables,
and the FakeEngine content of every active cache; a False from resume/resize/manager.resize must change nothing.
The logic lives in ``tests/fuzz/`` (``driver.Fuzzer``, shared with ``tools/soak.py``); regression tests of the bugs it found
are at the end of this file.

Sizes: ``KV_CACHE_MANAGER_V2_FUZZ_EXAMPLES`` examples per config (default 50) of
``KV_CACHE_MANAGER_V2_FUZZ_STEPS`` steps (default 60); raise both for longer runs.

Extension point: new configs go in ``tests/fuzz/configs.py:CONFIGS`` (picked up here by parametrisation); new
operations get a method in one of ``tests/fuzz/``'s operations modules and a rule below.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
)
from kv_cache_manager_v2.config import CacheTierConfig
from tests.fuzz.configs import CONFIGS, FuzzConfig
from tests.fuzz.driver import Fuzzer
from tests.fuzz.faulty_tiers import DISK_FAULTS
from tests.fuzz.flaky_store import STORE_FAULTS
from tests.fuzz.handoff_ops import HANDOFF_CHOICES
from tests.fuzz.limits import (
    AMOUNT_MAX,
    BATCH_MAX,
    COLLECT_POINT_MAX,
    COPY_KINDS,
    HELD_CALLS,
    COUNT_MAX,
    CUT_MAX,
    FAULTS,
    FLAGS_MAX,
    FOLLOW_UPS,
    INDEX_MAX,
    INVALID_KINDS,
    QUOTA_CHOICES,
    REENTRY_TARGETS,
    RESIZE_MODES,
    SCOPES,
    SOURCE_MAX,
    SUFFIX_MAX,
)
from tests.fuzz.machine_settings import machine_settings
from tests.fuzz.remote_ops import TWIN_KINDS
from tests.helpers import KIB, attention, make_config

SETTINGS = machine_settings("FUZZ", examples=50, steps=60)

index = st.integers(0, INDEX_MAX)


class KVCacheMachine(RuleBasedStateMachine):
    """Thin Hypothesis face of ``Fuzzer``: every rule draws ints and calls the operation of the same name."""

    def __init__(self, config: FuzzConfig) -> None:
        super().__init__()
        self.fuzz = Fuzzer(config)

    @precondition(lambda self: self.fuzz.enabled("create"))
    @rule(
        source=st.integers(0, SOURCE_MAX),
        cut=st.integers(0, CUT_MAX),
        suffix=st.integers(0, SUFFIX_MAX),
        scope=st.integers(0, len(SCOPES) - 1),
        flags=st.integers(0, FLAGS_MAX),
    )
    def create(self, source: int, cut: int, suffix: int, scope: int, flags: int) -> None:
        self.fuzz.create(source, cut, suffix, scope, flags)

    @precondition(lambda self: self.fuzz.enabled("fan_out"))
    @rule(count=st.integers(0, COUNT_MAX), cut=st.integers(0, CUT_MAX))
    def fan_out(self, count: int, cut: int) -> None:
        self.fuzz.fan_out(count, cut)

    @precondition(lambda self: self.fuzz.enabled("resume"))
    @rule(index=index, stream=st.sampled_from((0, 0, 1, 7)))
    def resume(self, index: int, stream: int) -> None:
        self.fuzz.resume(index, stream)

    # resize, one rule per kind (Hypothesis picks rules uniformly; the lifecycle's core gets more of the steps)
    @precondition(lambda self: self.fuzz.enabled("resize"))
    @rule(index=index, amount=st.integers(0, AMOUNT_MAX), mode=st.integers(0, RESIZE_MODES - 1))
    def grow(self, index: int, amount: int, mode: int) -> None:
        self.fuzz.resize(index, 0, amount, mode)

    @precondition(lambda self: self.fuzz.enabled("resize"))
    @rule(index=index, amount=st.integers(0, AMOUNT_MAX), mode=st.integers(0, RESIZE_MODES - 1))
    def shrink(self, index: int, amount: int, mode: int) -> None:
        self.fuzz.resize(index, 1, amount, mode)

    @precondition(lambda self: self.fuzz.enabled("resize"))
    @rule(index=index, amount=st.integers(0, AMOUNT_MAX), mode=st.integers(0, RESIZE_MODES - 1))
    def advance_history(self, index: int, amount: int, mode: int) -> None:
        self.fuzz.resize(index, 2, amount, mode)

    @precondition(lambda self: self.fuzz.enabled("resize"))
    @rule(index=index, amount=st.integers(0, AMOUNT_MAX), mode=st.integers(0, RESIZE_MODES - 1))
    def next_chunk(self, index: int, amount: int, mode: int) -> None:
        self.fuzz.resize(index, 3, amount, mode)

    @precondition(lambda self: self.fuzz.enabled("resize"))
    @rule(index=index, mode=st.integers(0, RESIZE_MODES - 1))
    def decode(self, index: int, mode: int) -> None:
        self.fuzz.resize(index, 4, 0, mode)

    @precondition(lambda self: self.fuzz.enabled("serve"))
    @rule(index=index, chunk=st.integers(0, AMOUNT_MAX))
    def serve(self, index: int, chunk: int) -> None:
        self.fuzz.serve(index, chunk)

    @precondition(lambda self: self.fuzz.enabled("commit"))
    @rule(index=index, count=st.integers(0, COUNT_MAX), flags=st.integers(0, FLAGS_MAX))
    def commit(self, index: int, count: int, flags: int) -> None:
        self.fuzz.commit(index, count, flags)

    @precondition(lambda self: self.fuzz.enabled("stop_committing"))
    @rule(index=index)
    def stop_committing(self, index: int) -> None:
        self.fuzz.stop_committing(index)

    @precondition(lambda self: self.fuzz.enabled("suspend"))
    @rule(index=index)
    def suspend(self, index: int) -> None:
        self.fuzz.suspend(index)

    @precondition(lambda self: self.fuzz.enabled("place"))
    @rule(index=index, mode=st.integers(0, 2))
    def place(self, index: int, mode: int) -> None:
        self.fuzz.place(index, mode)

    @precondition(lambda self: self.fuzz.enabled("close"))
    @rule(index=index)
    def close(self, index: int) -> None:
        self.fuzz.close(index)

    # Quota changes suspend every cache and clearing drops the reusable content: keep them to every 6th step.
    @precondition(lambda self: self.fuzz.enabled("change_quota") and self.fuzz.stats.operations % 6 == 5)
    @rule(level=st.integers(0, 3), choice=st.integers(0, QUOTA_CHOICES - 1))
    def change_quota(self, level: int, choice: int) -> None:
        self.fuzz.change_quota(level, choice)

    @precondition(lambda self: self.fuzz.enabled("clear_reusable") and self.fuzz.stats.operations % 6 == 5)
    @rule()
    def clear_reusable(self) -> None:
        self.fuzz.clear_reusable()

    @precondition(lambda self: self.fuzz.enabled("register_buffer"))
    @rule(index=index, layer_group=st.integers(0, 3))
    def register_buffer(self, index: int, layer_group: int) -> None:
        self.fuzz.register_buffer(index, layer_group)

    @precondition(lambda self: self.fuzz.enabled("invalid_move"))
    @rule(kind=st.integers(0, INVALID_KINDS - 1), index=index)
    def invalid_move(self, kind: int, index: int) -> None:
        self.fuzz.invalid_move(kind, index)

    @precondition(lambda self: self.fuzz.enabled("create_batch"))
    @rule(
        size=st.integers(0, BATCH_MAX),
        source=st.integers(0, SOURCE_MAX),
        flags=st.integers(0, FLAGS_MAX),
        extra=st.integers(0, AMOUNT_MAX),
    )
    def create_batch(self, size: int, source: int, flags: int, extra: int) -> None:
        self.fuzz.create_batch(size, source, flags, extra)

    @precondition(lambda self: self.fuzz.enabled("preempt_batch"))
    @rule(
        size=st.integers(0, 1),
        source=st.integers(0, SOURCE_MAX),
        mode=st.integers(0, 3),
        extra=st.integers(0, AMOUNT_MAX),
    )
    def preempt_batch(self, size: int, source: int, mode: int, extra: int) -> None:
        self.fuzz.preempt_batch(size, source, mode, extra)

    @precondition(lambda self: self.fuzz.enabled("misbehave"))
    @rule(index=index, fault=st.integers(0, FAULTS - 1), amount=st.integers(0, AMOUNT_MAX))
    def misbehave(self, index: int, fault: int, amount: int) -> None:
        self.fuzz.misbehave(index, fault, amount)

    @precondition(lambda self: self.fuzz.enabled("adjust") and self.fuzz.stats.operations % 6 == 5)
    @rule()
    def adjust(self) -> None:
        self.fuzz.adjust()

    @precondition(lambda self: self.fuzz.enabled("drop_in_cycle"))
    @rule(index=index, point=st.integers(0, COLLECT_POINT_MAX), follow=st.integers(0, FOLLOW_UPS - 1))
    def drop_in_cycle(self, index: int, point: int, follow: int) -> None:
        self.fuzz.drop_in_cycle(index, point, follow)

    @precondition(lambda self: self.fuzz.enabled("reenter"))
    @rule(
        index=index,
        reentry=st.integers(0, REENTRY_TARGETS - 1),  # ("target" is Hypothesis' own keyword)
        swallow=st.booleans(),
        amount=st.integers(0, AMOUNT_MAX),
    )
    def reenter(self, index: int, reentry: int, swallow: bool, amount: int) -> None:
        self.fuzz.reenter(index, reentry, swallow, amount)

    @precondition(lambda self: self.fuzz.enabled("copy_handle"))
    @rule(index=index, kind=st.integers(0, COPY_KINDS - 1))
    def copy_handle(self, index: int, kind: int) -> None:
        self.fuzz.copy_handle(index, kind)

    @precondition(lambda self: self.fuzz.enabled("held_call"))
    @rule(index=index, call=st.integers(0, HELD_CALLS - 1), amount=st.integers(0, AMOUNT_MAX))
    def held_call(self, index: int, call: int, amount: int) -> None:
        self.fuzz.held_call(index, call, amount)

    @rule(seed=st.integers(0, 2**32 - 1))
    def misuse(self, seed: int) -> None:
        self.fuzz.misuse(seed)

    @rule(source=st.integers(0, SOURCE_MAX), cut=st.integers(0, CUT_MAX), scope=st.integers(0, len(SCOPES) - 1),
          as_numpy=st.integers(0, 1))
    def probe(self, source: int, cut: int, scope: int, as_numpy: int) -> None:
        self.fuzz.probe(source, cut, scope, as_numpy)

    @rule(index=index, late=st.integers(0, HANDOFF_CHOICES - 1))
    def handoff(self, index: int, late: int) -> None:
        self.fuzz.handoff(index, late)

    @precondition(lambda self: self.fuzz.enabled("refetch"))
    @rule(index=index, suffix=st.integers(0, SUFFIX_MAX))
    def refetch(self, index: int, suffix: int) -> None:
        self.fuzz.refetch(index, suffix)

    @precondition(lambda self: self.fuzz.enabled("twin_serves"))
    @rule(index=index, suffix=st.integers(0, SUFFIX_MAX), kind=st.integers(0, TWIN_KINDS - 1))
    def twin_serves(self, index: int, suffix: int, kind: int) -> None:
        self.fuzz.twin_serves(index, suffix, kind)

    @precondition(lambda self: self.fuzz.enabled("store_fault"))
    @rule(kind=st.integers(0, STORE_FAULTS - 1), count=st.integers(0, 2))
    def store_fault(self, kind: int, count: int) -> None:
        self.fuzz.store_fault(kind, count)

    @precondition(lambda self: self.fuzz.enabled("restart_store"))
    @rule()
    def restart_store(self) -> None:
        self.fuzz.restart_store()

    @precondition(lambda self: self.fuzz.enabled("disk_fault"))
    @rule(kind=st.integers(0, DISK_FAULTS - 1), index=index, chunk=st.integers(0, AMOUNT_MAX))
    def disk_fault(self, kind: int, index: int, chunk: int) -> None:
        self.fuzz.disk_fault(kind, index, chunk)

    @precondition(lambda self: self.fuzz.enabled("codec_fault"))
    @rule(count=st.integers(0, 2))
    def codec_fault(self, count: int) -> None:
        self.fuzz.codec_fault(count)

    @invariant()
    def consistent(self) -> None:
        self.fuzz.check()

    def teardown(self) -> None:
        self.fuzz.teardown()


def machine_for(config: FuzzConfig) -> type[KVCacheMachine]:
    class Machine(KVCacheMachine):
        def __init__(self) -> None:
            super().__init__(config)

    Machine.__name__ = Machine.__qualname__ = f"KVCacheMachine_{config.name}"
    return Machine


@pytest.mark.parametrize("config", CONFIGS, ids=[config.name for config in CONFIGS])
def test_state_machine(config: FuzzConfig) -> None:
    run_state_machine_as_test(machine_for(config), settings=SETTINGS)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_driver_of_the_soak_tool(seed: int) -> None:
    """``tools/soak.py``'s driver: a few hundred seeded operations per config, checked after each."""
    rng = random.Random(seed)
    for config in CONFIGS:
        fuzz = Fuzzer(config)
        try:
            for _ in range(150):
                fuzz.random_step(rng)
                fuzz.check()
        finally:
            fuzz.teardown()
        assert fuzz.stats.caches_created > 0


def test_failed_resume_keeps_eviction_order() -> None:
    """SPEC §2: ``resume`` returns False 'with no side effects'. A refused resume must not make its pages look
    recently used: afterwards the least recently used held pages (cache ``a``'s) are still the first to go.
    (Regression: at commit fbd5203 the refused resume locked and unlocked its pages, refreshing their LRU stamps.)"""
    slot = 2 * 8 * KIB
    tpb = 32
    manager = KVCacheManager(
        make_config(
            [attention(0, 8 * KIB)],
            tiers=[GpuCacheTierConfig(6 * slot), HostCacheTierConfig(6 * slot)],
            max_util_for_resume=0.5,
        )
    )
    a = manager.create_kv_cache()
    assert a.resume() and a.resize(2 * tpb)
    a.suspend()
    b = manager.create_kv_cache()
    assert b.resume() and b.resize(2 * tpb)
    b.suspend()
    x = manager.create_kv_cache()
    assert x.resume() and x.resize(2 * tpb)
    assert not a.resume()  # 2 locked + 2 to lock > 50% of 6 slots
    assert x.resize(3 * tpb)  # one held page must go to host: a's (least recently used), not b's
    x.suspend()
    onboarded = manager.movement_counters.onboarded_pages
    assert b.resume()
    assert manager.movement_counters.onboarded_pages == onboarded  # b never left the GPU
    for cache in (a, b, x):
        cache.close()


def test_close_after_the_cache_blocks_lost_their_pages() -> None:
    """Found by the state machine (swa_sinks). ``close`` used to prune its blocks last to first; pruning the last
    block also detaches its page-less ancestors, so pruning the next one raised KeyError mid-close."""
    manager = KVCacheManager(make_config([attention(0, window=32)]))  # tokens_per_block 32
    tokens = list(range(200))
    cache = manager.create_kv_cache(None, tokens)
    assert cache.resume() and cache.resize(64)
    cache.commit(tokens[:64])  # blocks 0 and 1 join the tree
    assert cache.resize(200, 200)  # both fall out of the window: their pages become droppable
    # Another cache takes every slot: the two droppable pages are dropped; the blocks stay (the cache uses them).
    filler = manager.create_kv_cache()
    assert filler.resume() and filler.resize(manager.get_storage_statistics(0)[0].available * 32)
    assert manager.get_storage_statistics(0)[0].evictable == 0
    filler.close()
    cache.close()
    manager.check_invariants()
    assert manager.num_live_caches == 0


def test_resume_through_a_full_host_tier(tmp_path: Path) -> None:
    """Found by tools/soak.py (tiered). SPEC §2: resume returns False, with no side effects, when pages cannot be
    found. With GPU, host and disk tiers, its room check used to count the empty disk, but the GPU's held pages
    can only reach it through the host, which is full of the resuming cache's own pages: OutOfPagesError."""
    slot = 2 * 8 * KIB  # one layer, K and V of 8 KiB per block
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(2 * slot),
        HostCacheTierConfig(2 * slot),
        DiskCacheTierConfig(4 * slot, str(tmp_path)),
    ]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=1.0))
    a = manager.create_kv_cache()
    assert a.resume() and a.resize(64)  # GPU: a0 a1
    a.suspend()
    b = manager.create_kv_cache()
    assert b.resume() and b.resize(64)  # GPU: b0 b1; host: a0 a1 (held); disk: empty
    b.suspend()
    statistics = [manager.get_storage_statistics(level) for level in range(3)]
    if not a.resume():  # either swaps a and b, or refuses and changes nothing
        assert [manager.get_storage_statistics(level) for level in range(3)] == statistics
    manager.check_invariants()
