"""Which running request the continuous batcher preempts when a step wants room (``ContinuousBatcher._victim``),
when it recomputes a suspended one or refuses the step instead, and the batcher refusing to be re-entered from an
engine hook. ``resize`` is not bounded by ``max_util_for_resume``, so running requests can outgrow what a resume may
lock; one that fits the GPU tier alone must never be rejected while another request could make room."""

from __future__ import annotations

import random

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager
from kv_cache_manager_v2.batching import BatchEngine, BatchingOptions, ContinuousBatcher
from tests.helpers import attention, make_config
from tests.test_batching import SLOT, TPB, Checked, Replayed, manager_with, run_to_end, workload


def test_with_no_request_to_preempt_the_step_wanting_room_is_refused_and_the_others_finish() -> None:
    """The batcher's "no victim" path: two running requests have both outgrown ``max_util_for_resume`` (a resume
    locks at most 12 of 40 pages; they hold 21 and 19), so suspending either would strand it. When the earlier one
    needs its 22nd page the GPU is full: no request may be preempted, so its step is refused (``reject``), its
    cache closed, and the other one runs to its end, every token of it checked by the FakeEngine and published."""
    manager = KVCacheManager(make_config(
        [attention(0), attention(1)], tiers=[GpuCacheTierConfig(40 * SLOT)], tokens_per_block=TPB, max_util_for_resume=0.3
    ))
    first = Replayed(0, list(range(1, 20 * TPB + 41)), 20 * TPB)  # 23 blocks at its end
    second = Replayed(1, list(range(5000, 5000 + 18 * TPB + 40)), 18 * TPB)  # 21 blocks at its end
    engine = Checked(manager, reject_drops=True)
    batcher = ContinuousBatcher(manager, [first, second], engine, BatchingOptions(chunk=64, max_batch=4))
    run_to_end(batcher)
    assert engine.rejected_ids == [0] and batcher.rejected == 1 and batcher.preemptions == 0
    assert first.cache is None and second.cache is None and manager.num_live_caches == 0
    assert sorted(batcher.finished_ids) == [0, 1]
    refusal = first.refusal  # the reason kept: the step fits an empty manager, the GPU was full
    assert refusal is not None and refusal.call == "KVCache.resize" and refusal.fits_empty_manager, refusal
    assert refusal.pages_needed > refusal.pages_available and refusal.pages_total == 40, refusal
    assert engine.fake.tokens_checked > 0
    last_step = max(step for step, computed in enumerate(engine.steps) if any(entry[0] == 0 for entry in computed))
    assert [entry[0] for entry in engine.steps[last_step + 1]] == [1]  # the second one runs on alone
    assert manager.probe_reuse(None, second.tokens[:-1]) == len(second.tokens) - 1  # all of it published
    assert manager.probe_reuse(None, first.tokens) < len(first.tokens)
    # The default engine's reason says why, not "does not fit in the GPU tier even alone" (it fits alone).
    with pytest.raises(RuntimeError, match="^request 0 fits the GPU tier alone, but .* outgrown max_util_for_resume"):
        BatchEngine.reject(engine, first)
    manager.shutdown()


def test_a_request_grown_past_max_util_for_resume_is_not_rejected_for_a_suspended_one_pinning_the_gpu() -> None:
    """The test above without a host tier: the short request, preempted by itself, keeps its page held on the
    GPU, where nothing can take it; the long one (39 pages, not ``resumable_alone``) then wants its 40th and,
    with no running request to preempt, was rejected although it fits the tier alone (``rejected_ids`` [1]).
    The suspended one is recomputed later instead (its page freed), and both finish with every token checked."""
    manager = manager_with(gpu_slots=40)
    short = Replayed(0, list(range(1, 31)), 10)
    long = Replayed(1, list(range(1000, 1000 + 38 * TPB + 8 + 20)), 38 * TPB + 8)  # 40 blocks at its end
    engine = Checked(manager, reject_drops=True)
    batcher = ContinuousBatcher(manager, [short, long], engine, BatchingOptions(chunk=640, max_batch=4))
    run_to_end(batcher)
    assert engine.rejected_ids == [] and sorted(batcher.finished_ids) == [0, 1]
    assert batcher.preemptions == 1 and batcher.recomputes == 1 and engine.requeued_ids == [0]
    assert engine.fake.tokens_checked > 0 and manager.num_live_caches == 0
    assert manager.probe_reuse(None, short.tokens[:-1]) == len(short.tokens) - 1  # recomputed last, all published
    manager.shutdown()


def test_a_request_grown_past_max_util_for_resume_wanting_room_preempts_one_scheduled_before_it() -> None:
    """The mirror of the test above: the long request (admitted second) wants its 40th page while the short one,
    admitted first, was already scheduled this step. The long one cannot be suspended (39 pages, a resume locks
    at most 38), and the batcher looked for a victim only among the requests not yet scheduled, so it rejected the
    long one after it had run, although it fits the GPU tier alone (``BatchEngine.reject`` is for requests that
    cannot fit even alone): ``rejected_ids`` was [1]. A request scheduled earlier in the step that can resume is a
    victim too (its growth this step undone): the short one is suspended, its page offloaded, and both finish
    with every token checked."""
    manager = manager_with(gpu_slots=40, host_slots=64)  # the default max_util_for_resume: a resume locks <= 38
    short = Replayed(0, [7] + list(range(100, 114)), 1)  # one block throughout
    long = Replayed(1, list(range(1000, 1000 + 40 * TPB)), 39 * TPB - 1)  # 39 blocks once prefilled, 40 at its end
    engine = Checked(manager, reject_drops=True)
    batcher = ContinuousBatcher(manager, [short, long], engine, BatchingOptions(chunk=640, max_batch=4))
    run_to_end(batcher)
    assert engine.rejected_ids == [] and sorted(batcher.finished_ids) == [0, 1]
    assert batcher.preemptions == 1 and batcher.resumes == 1  # the short one, for the long one
    assert engine.fake.tokens_checked > 0 and manager.num_live_caches == 0
    for request in (short, long):
        assert manager.probe_reuse(None, request.tokens[:-1]) == len(request.tokens) - 1  # all computed, published
    manager.shutdown()


@pytest.mark.parametrize("host_slots", [0, 64])
@pytest.mark.parametrize("seed", range(16))
def test_requests_that_fit_alone_all_finish_however_long_they_grow(seed: int, host_slots: int) -> None:
    """Random mixes of short requests and long ones that grow past what a resume may lock (37 to 40 blocks of the
    40-page tier, a resume locking at most 38: each fits alone), arriving over time: none is rejected (the
    batcher preempts whichever running request can resume, or recomputes a suspended one), every one finishes,
    every token checked. Before the batcher looked for victims scheduled earlier in the step and among the
    suspended, seeds 9 (with and without a host tier) and 14 (without) rejected one."""
    rng = random.Random(seed)
    manager = manager_with(gpu_slots=40, host_slots=host_slots)
    requests = []
    arrival = 0
    for request_id in range(8):
        if rng.random() < 0.4:
            length = rng.randrange(37 * TPB, 40 * TPB + 1)
            prompt = length - rng.randrange(TPB, 3 * TPB)
        else:
            length = rng.randrange(2, 3 * TPB)
            prompt = rng.randrange(1, length)
        base = 10_000 * (request_id + 1)
        requests.append(Replayed(request_id, list(range(base, base + length)), prompt, arrival_step=arrival))
        arrival += rng.randrange(0, 4)
    engine = Checked(manager, reject_drops=True)
    batcher = ContinuousBatcher(manager, requests, engine, BatchingOptions(chunk=rng.choice([64, 256, 640]), max_batch=4))
    run_to_end(batcher)
    assert engine.rejected_ids == [], [(request.request_id, request.refusal) for request in requests if request.refusal]
    assert sorted(batcher.finished_ids) == list(range(8)) and manager.num_live_caches == 0
    assert engine.fake.tokens_checked > 0
    manager.shutdown()


class Reentering(Checked):
    """An engine whose ``compute`` calls back into the batcher running it (once each: ``step``, ``close_all``)."""

    def __init__(self, manager: KVCacheManager) -> None:
        super().__init__(manager)
        self.batcher: ContinuousBatcher[Replayed] | None = None
        self.errors: list[str] = []

    def compute(self, scheduled: list[Replayed]) -> None:
        super().compute(scheduled)
        batcher = self.batcher
        assert batcher is not None
        if len(self.steps) in (2, 3):
            step_index = batcher.step_index
            call = batcher.step if len(self.steps) == 2 else batcher.close_all
            with pytest.raises(RuntimeError) as caught:
                call()
            self.errors.append(str(caught.value))
            assert batcher.step_index == step_index and all(request.cache is not None for request in scheduled)


def test_an_engine_hook_calling_the_batcher_gets_runtime_error_and_changes_nothing() -> None:
    """``compute`` calling ``batcher.step()`` ran a whole second step inside the first (it scheduled, resized,
    computed and committed the requests the outer step had scheduled and not committed yet, overwriting their
    targets); ``close_all()`` there would close the caches the outer step goes on to commit. Both raise
    ``RuntimeError`` naming both calls, change nothing, and the run finishes."""
    manager = manager_with(64)
    engine = Reentering(manager)
    batcher = ContinuousBatcher(manager, workload(4), engine, BatchingOptions(chunk=32, max_batch=4))
    engine.batcher = batcher
    run_to_end(batcher)
    assert engine.errors == [
        "ContinuousBatcher.step called while ContinuousBatcher.step is in flight (from an engine hook): nothing changed",
        "ContinuousBatcher.close_all called while ContinuousBatcher.step is in flight (from an engine hook): nothing "
        "changed",
    ]
    assert sorted(batcher.finished_ids) == [0, 1, 2, 3] and engine.fake.tokens_checked > 0
    assert manager.num_live_caches == 0
    manager.shutdown()
