"""Batch sharing never lets a request read rows nothing wrote: a later request of a batch (the follower) starts its
history after blocks an earlier one (the donor) computes in its step; whatever makes the donor skip that step (cut
below them, suspended, closed, its handle dropped) gives the follower those rows back to compute, through its
``history_length``. Every scenario steps the caches with ``FakeEngine``, which checks each history row it reads."""

from __future__ import annotations

import gc

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, KVCacheRequest, _KVCache
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config

TPB = 32
SLOT = 2 * 4 * KIB
SYSTEM = 3 * TPB  # the common prefix the donor computes and the follower shares


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def batch(count: int = 2, slots: int = 64) -> tuple[KVCacheManager, FakeEngine, list[_KVCache], list[list[int]]]:
    """A manager, its engine, and ``count`` admitted requests behind one new system prompt (three blocks); each later
    one shares the system prompt with the first."""
    manager = KVCacheManager(make_config([attention(0, 4 * KIB)], tiers=[GpuCacheTierConfig(slots * SLOT)]))
    system = tokens_of(1, SYSTEM)
    prompts = [system + tokens_of(10 + k, TPB + 5 * k) for k in range(count)]
    caches = manager.create_kv_cache_batch([KVCacheRequest(prompt) for prompt in prompts])
    admitted = [cache for cache in caches if cache is not None]
    assert len(admitted) == count
    assert [cache.history_length for cache in admitted] == [0] + [SYSTEM] * (count - 1)
    return manager, FakeEngine(manager), admitted, prompts


def close_all(manager: KVCacheManager, caches: list[_KVCache]) -> None:
    """Close every cache (donor first), then shut the manager down: nothing may be left held."""
    for cache in caches:
        cache.close()
    manager.shutdown()


def finish(engine: FakeEngine, caches: list[_KVCache], prompts: list[list[int]]) -> None:
    """Step and commit every cache in batch order (the engine's forward), then check every row each one holds."""
    for cache, prompt in zip(caches, prompts):
        if cache.history_length < cache.capacity:
            engine.step(cache, prompt)  # checks the history it reads first
            cache.commit(prompt[cache.num_committed_tokens : cache.capacity])
    for cache, prompt in zip(caches, prompts):
        engine.check(cache, prompt)


def test_donor_cut_before_its_step_gives_the_follower_the_rows_it_will_not_write() -> None:
    manager, engine, (donor, follower), (first, second) = batch()
    assert donor.resize(TPB + 7)  # a step cut short (a budget, a snapshot point): rows from 39 on stay unwritten
    assert follower.history_length == TPB + 7  # the follower computes them itself
    finish(engine, [donor, follower], [first, second])
    assert donor.num_committed_tokens == TPB + 7 and follower.num_committed_tokens == len(second)
    close_all(manager, [donor, follower])


def test_donor_cut_to_its_history_before_its_step() -> None:
    manager, engine, (donor, follower), (first, second) = batch()
    assert donor.resize(0)  # preempted within the scheduling pass: nothing of the prefix gets written
    assert follower.history_length == 0
    finish(engine, [donor, follower], [first, second])
    close_all(manager, [donor, follower])


def test_donor_cut_inside_its_last_block_is_seen_too() -> None:
    """A cut that keeps the donor's block count would take the O(1) resize path, which knows nothing of loans: it
    is not taken below the rows the donor lent."""
    manager, engine, (donor, follower), (first, second) = batch()
    assert donor.resize(SYSTEM)
    assert follower.history_length == SYSTEM  # the whole system prompt is still the donor's to write
    assert donor.resize(SYSTEM - 1)  # same three blocks
    assert follower.history_length == SYSTEM - 1
    finish(engine, [donor, follower], [first, second])
    close_all(manager, [donor, follower])


def test_donor_suspended_before_its_step() -> None:
    manager, engine, (donor, follower), (first, second) = batch()
    donor.suspend()
    assert follower.history_length == 0
    finish(engine, [follower], [second])
    assert donor.resume()
    finish(engine, [donor], [first])  # the same rows again, into the page the two still share
    engine.check(follower, second)
    close_all(manager, [donor, follower])


def test_donor_closed_before_its_step() -> None:
    manager, engine, (donor, follower), (_, second) = batch()
    donor.close()
    assert follower.history_length == 0
    finish(engine, [follower], [second])
    close_all(manager, [follower])


def test_donor_handle_dropped_before_its_step() -> None:
    """The dropped handle's close is queued; reading the follower's history runs it first."""
    manager, engine, caches, (_, second) = batch()
    follower = caches.pop()
    caches.clear()  # the last reference to the donor
    gc.collect()
    assert follower.history_length == 0
    finish(engine, [follower], [second])
    assert manager.num_live_caches == 1
    close_all(manager, [follower])


def test_chained_share_is_recalled_from_the_request_that_writes_it() -> None:
    """The third request shares the second's pages, which hold the first request's rows: closing the first
    recalls them from both."""
    manager = KVCacheManager(make_config([attention(0, 4 * KIB)], tiers=[GpuCacheTierConfig(64 * SLOT)]))
    engine = FakeEngine(manager)
    system, branch = tokens_of(1, SYSTEM), tokens_of(2, 2 * TPB)
    prompts = [system + tokens_of(3, TPB), system + branch + tokens_of(4, 9), system + branch + tokens_of(5, 11)]
    first, second, third = manager.create_kv_cache_batch([KVCacheRequest(prompt) for prompt in prompts])
    assert first is not None and second is not None and third is not None
    assert (second.history_length, third.history_length) == (SYSTEM, SYSTEM + 2 * TPB)
    first.close()
    assert (second.history_length, third.history_length) == (0, 0)
    finish(engine, [second, third], prompts[1:])
    close_all(manager, [second, third])


def test_rows_the_donor_computed_and_gave_back_are_computed_again() -> None:
    """The donor computed its step but gave the rows back without moving its history (the manager cannot tell that
    from a cut before the step): the follower computes them again, never refused, never reading stale rows."""
    manager, engine, (donor, follower), (first, second) = batch()
    engine.step(donor, first)
    assert donor.resize(TPB)
    assert follower.history_length == TPB
    finish(engine, [donor, follower], [first, second])
    close_all(manager, [donor, follower])


def test_a_donor_that_computed_and_committed_lends_nothing_more() -> None:
    manager, engine, (donor, follower), (first, second) = batch()
    engine.step(donor, first)
    donor.commit(first[:SYSTEM])  # the shared rows are written
    donor.close()
    assert follower.history_length == SYSTEM
    finish(engine, [follower], [second])
    close_all(manager, [follower])


def test_a_follower_that_stepped_keeps_its_history() -> None:
    """Once the follower's own step ran (its history or commits moved), so had the donor's in the same forward."""
    manager, engine, (donor, follower), (first, second) = batch()
    finish(engine, [donor, follower], [first, second])
    donor.suspend()
    assert follower.history_length == len(second)
    close_all(manager, [donor, follower])


def test_a_refused_donor_call_recalls_nothing() -> None:
    manager, engine, (donor, follower), (first, second) = batch(slots=10)
    assert not donor.resize(9 * TPB)  # more than the pool: refused, nothing changed
    assert follower.history_length == SYSTEM
    finish(engine, [donor, follower], [first, second])
    close_all(manager, [donor, follower])


def test_closing_in_any_order_with_lent_rows_outstanding() -> None:
    """Shutdown needs every cache closed first; closing followers before their donor (or after) leaves nothing."""
    manager, _, caches, _ = batch(count=3)
    caches[2].close()
    caches[0].close()
    assert caches[1].history_length == 0
    caches[1].close()
    manager.shutdown()


@pytest.mark.parametrize("preempt", ["cut", "suspend", "close"])
def test_follower_stepped_as_told_reads_only_written_rows(preempt: str) -> None:
    """The scheduler preempts the donor before the batch's forward and runs the follower as its lengths say: the
    engine's check of every row the follower reads is the whole test."""
    manager, engine, (donor, follower), (first, second) = batch()
    if preempt == "cut":
        assert donor.resize(0)
    elif preempt == "suspend":
        donor.suspend()
    else:
        donor.close()
    finish(engine, [follower], [second])
    follower.close()
    if donor.status != donor.Status.CLOSED:
        assert donor.resume()
        finish(engine, [donor], [first])
        donor.close()
    manager.shutdown()
