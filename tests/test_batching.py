"""The continuous batcher on its own: chunked prefill under the budget, FCFS admission with follow-ups,
preemption by suspension under memory pressure, recompute and reject, batch admission; the FakeEngine checks
every readable token of every scheduled cache on every step."""

from __future__ import annotations

import random

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCache, KVCacheManager, Refusal
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from kv_cache_manager_v2.batching import BatchedRequest, BatchEngine, BatchingOptions, ContinuousBatcher
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, MIB, attention, make_config, ssm

TPB = 16
SLOT = 2 * 2 * 4 * KIB  # two layers of K and V, 4 KiB each per block


class Replayed(BatchedRequest):
    """A request whose every token is known up front (a replay): ``max_length`` ends it."""

    def __init__(self, request_id: int, tokens: list[int], prompt_length: int, follows: int | None = None,
                 arrival_step: int = 0) -> None:
        super().__init__(request_id, prompt_length, arrival_step, follows, max_length=len(tokens))
        self.known = tokens

    @property
    def tokens(self) -> list[int]:
        return self.known


class Checked(BatchEngine[Replayed]):
    """Writes and checks token records through the FakeEngine; records what each step computed."""

    def __init__(self, manager: KVCacheManager, reject_drops: bool = False) -> None:
        self.fake = FakeEngine(manager)
        self.manager = manager
        self.steps: list[list[tuple[int, int, int]]] = []  # per step: (request id, history, target)
        self.admission_order: list[int] = []
        self.reject_drops = reject_drops
        self.rejected_ids: list[int] = []
        self.requeued_ids: list[int] = []
        self.reused: dict[int, int] = {}  # request id -> tokens its latest admission matched

    def compute(self, scheduled: list[Replayed]) -> None:
        step = []
        for request in scheduled:
            cache = request.cache
            assert cache is not None
            step.append((request.request_id, cache.history_length, request.target))
            self.fake.step(cache, request.tokens)
        self.steps.append(step)

    def is_done(self, request: Replayed) -> bool:
        return request.target == request.max_length

    def matched(self, request: Replayed, cache: KVCache) -> None:
        self.reused[request.request_id] = cache.num_committed_tokens

    def admitted(self, requests: list[Replayed]) -> None:
        self.admission_order.extend(request.request_id for request in requests)

    def requeued(self, request: Replayed) -> None:
        self.requeued_ids.append(request.request_id)

    def reject(self, request: Replayed) -> None:
        if not self.reject_drops:
            super().reject(request)
        self.rejected_ids.append(request.request_id)

    def step_done(self) -> None:
        self.manager.check_invariants()


def manager_with(gpu_slots: int, host_slots: int = 0) -> KVCacheManager:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_slots * SLOT)]
    if host_slots:
        tiers.append(HostCacheTierConfig(host_slots * SLOT))
    return KVCacheManager(make_config([attention(0), attention(1)], tiers=tiers, tokens_per_block=TPB))


def run_to_end(batcher: ContinuousBatcher[Replayed], max_steps: int = 5_000) -> None:
    while not batcher.done:
        assert batcher.step_index < max_steps, "no progress"
        batcher.step()


def workload(count: int, seed: int = 7) -> list[Replayed]:
    """Requests sharing a system prompt, each with its own question and a few decode tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 30_000) for _ in range(40)]
    requests = []
    for request_id in range(count):
        prompt = system + [rng.randrange(1, 30_000) for _ in range(rng.randrange(60, 160))]
        outputs = [rng.randrange(1, 30_000) for _ in range(rng.randrange(2, 12))]
        requests.append(Replayed(request_id, prompt + outputs, len(prompt)))
    return requests


def test_prefill_is_chunked_under_the_budget_then_decodes_one_token_a_step() -> None:
    manager = manager_with(64)
    tokens = list(range(1, 103))
    engine = Checked(manager)
    batcher = ContinuousBatcher(manager, [Replayed(0, tokens, 100)], engine, BatchingOptions(chunk=32))
    run_to_end(batcher)
    assert [step[0][1:] for step in engine.steps] == [(0, 32), (32, 64), (64, 96), (96, 100), (100, 101), (101, 102)]
    assert engine.fake.tokens_checked > 0 and manager.num_live_caches == 0
    assert manager.probe_reuse(None, tokens[:99]) == 99  # the finished request published its blocks
    manager.shutdown()


def test_a_chunk_stops_at_the_prompts_last_full_block_when_snapshots_need_it() -> None:
    request = Replayed(0, list(range(1, 110)), 100)
    assert request.next_target(64, 0, TPB) == 64
    assert request.next_target(64, 64, TPB) == 96  # the last full block of the prompt ends at 96
    assert request.next_target(64, 96, TPB) == 100
    assert request.next_target(64, 64) == 100  # without snapshots: the whole rest of the prompt
    assert request.next_target(64, 108) == 109  # never past max_length


def test_admission_is_fcfs_and_a_follow_up_waits_for_the_request_it_continues() -> None:
    manager = manager_with(64)
    first = Replayed(0, list(range(1, 60)), 50)
    follow_up = Replayed(1, list(range(1, 70)), 60, follows=0)
    independent = Replayed(2, list(range(500, 540)), 30)
    late = Replayed(3, list(range(700, 720)), 10, arrival_step=3)
    engine = Checked(manager)
    batcher = ContinuousBatcher(manager, [first, follow_up, independent, late], engine, BatchingOptions(chunk=64, max_batch=2))
    batcher.step()
    assert [request.request_id for request in batcher.running] == [0, 2]
    assert [request.request_id for request in batcher.waiting] == [1]  # earlier in FCFS order, but its turn waits
    run_to_end(batcher)
    # 3 arrived first, but once 0 finished, 1 was admissible and comes first in FCFS (request id) order.
    assert engine.admission_order == [0, 2, 1, 3]
    follow_up_admitted = next(index for index, step in enumerate(engine.steps) if any(r == 1 for r, _, _ in step))
    assert follow_up_admitted > max(index for index, step in enumerate(engine.steps) if any(r == 0 for r, _, _ in step))
    assert engine.reused[1] >= 48  # the follow-up found its parent's finished blocks (3 of 16 tokens)
    manager.shutdown()


@pytest.mark.parametrize("batch_admission", [False, True])
def test_memory_pressure_preempts_by_suspension_and_every_request_finishes_with_its_content(batch_admission: bool) -> None:
    manager = manager_with(gpu_slots=24, host_slots=400)
    requests = workload(10)
    engine = Checked(manager)
    options = BatchingOptions(chunk=48, max_batch=6, batch_admission=batch_admission)
    batcher = ContinuousBatcher(manager, requests, engine, options)
    run_to_end(batcher)
    assert batcher.preemptions > 0 and batcher.resumes > 0  # suspended caches came back from the host tier
    assert batcher.rejected == 0 and len(batcher.finished_ids) == len(requests)
    assert sorted(engine.admission_order) == list(range(len(requests)))
    assert engine.fake.tokens_checked > 0 and manager.num_live_caches == 0
    assert batcher.manager_ns > 0
    for step in engine.steps:
        assert len(step) <= options.max_batch
        assert all(target - history <= options.chunk for _, history, target in step)
    manager.shutdown()


def test_without_a_colder_tier_a_preempted_request_is_recomputed_never_suspended() -> None:
    """Suspended, a cache would keep every GPU page (no tier to move them to), so suspending frees nothing: the
    batcher used to suspend one running request after another, then recompute them anyway (on the public trace,
    llama on 8 GiB: 3,304 suspensions and 561 recomputes over 18,398 steps). It now closes the victim, whose
    committed blocks stay cached for its recompute to reuse, as vLLM's recompute preemption does. Before:
    ``assert not [<test_batching.Replayed object ...>]`` (a suspended request)."""
    manager = manager_with(gpu_slots=24)
    requests = workload(8, seed=3)
    engine = Checked(manager)
    batcher = ContinuousBatcher(manager, requests, engine, BatchingOptions(chunk=48, max_batch=6))
    while not batcher.done:
        assert batcher.step_index < 5_000, "no progress"
        batcher.step()
        assert not batcher.suspended
    assert batcher.resumes == 0 and batcher.preemptions == batcher.recomputes > 0 and engine.requeued_ids
    assert all(request.requeues >= 1 for request in requests if request.request_id in engine.requeued_ids)
    assert len(batcher.finished_ids) == len(requests) and batcher.rejected == 0
    assert manager.num_live_caches == 0
    manager.shutdown()


def test_a_request_that_cannot_fit_alone_goes_to_the_engines_reject() -> None:
    huge = Replayed(0, list(range(1, 600)), 590)  # 37 blocks on a 24-slot GPU tier
    follow_up = Replayed(1, list(range(1, 40)), 30, follows=0)
    manager = manager_with(gpu_slots=24)
    batcher = ContinuousBatcher(manager, [huge, follow_up], Checked(manager), BatchingOptions(chunk=600))
    with pytest.raises(RuntimeError, match="request 0 does not fit"):
        run_to_end(batcher)
    assert [request.request_id for request in batcher.waiting] == [0, 1]  # the default reject changed nothing
    batcher.close_all()

    engine = Checked(manager, reject_drops=True)
    batcher = ContinuousBatcher(manager, [Replayed(0, huge.known, 590), Replayed(1, follow_up.known, 30, follows=0)],
                                engine, BatchingOptions(chunk=600))
    run_to_end(batcher)
    assert engine.rejected_ids == [0] and batcher.rejected == 1
    assert engine.admission_order == [1]  # the follow-up still ran once its parent was dropped
    assert manager.num_live_caches == 0
    manager.shutdown()


@pytest.mark.parametrize("batch_admission", [False, True])
def test_a_reused_prefix_a_resume_may_not_lock_is_computed_again_instead(batch_admission: bool) -> None:
    """Two GPU slots, of which a resume may lock one (``max_util_for_resume``). The second request matches the
    first's full block and part of its second (a copy): its first resume would lock both slots, which it may never
    do, yet computed from its first token it fits (``resize`` is not bounded by that limit). It was rejected as
    not fitting even alone; it is now admitted without the reuse."""
    manager = manager_with(gpu_slots=2)
    shared = list(range(1, 25))
    first = Replayed(0, shared + [900, 901, 902], 26)
    second = Replayed(1, shared + [800, 801, 802, 803, 804], 29)
    engine = Checked(manager)
    options = BatchingOptions(chunk=1, max_batch=1, batch_admission=batch_admission)
    run_to_end(ContinuousBatcher(manager, [first, second], engine, options))
    assert engine.admission_order == [0, 1] and engine.reused[1] == 0
    assert engine.fake.tokens_checked > 0 and manager.num_live_caches == 0
    manager.shutdown()


@pytest.mark.parametrize(
    ("arguments", "error", "words"),
    [
        ({"chunk": 0}, ValueError, "chunk"),
        ({"max_batch": -1}, ValueError, "max_batch"),
        ({"snapshot_block": -16}, ValueError, "snapshot_block"),
        ({"chunk": True}, TypeError, "chunk"),
        ({"batch_admission": 1}, TypeError, "batch_admission"),
    ],
)
def test_bad_options_name_the_argument(arguments: dict[str, object], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        BatchingOptions(**arguments)  # type: ignore[arg-type]


class Declared(Replayed):
    """A replayed request that declares where its shared prefix ends."""

    def __init__(self, request_id: int, tokens: list[int], prompt_length: int, boundary: int) -> None:
        super().__init__(request_id, tokens, prompt_length)
        self.boundary = boundary

    @property
    def prefix_boundaries(self) -> tuple[int, ...]:
        return (self.boundary,)


class RecordsRejections(Checked):
    """Drops rejected requests, noting at which step and why."""

    def __init__(self, manager: KVCacheManager) -> None:
        super().__init__(manager, reject_drops=True)
        self.rejected_at: list[int] = []
        self.reasons: list[Refusal | None] = []

    def reject(self, request: Replayed) -> None:
        super().reject(request)
        self.rejected_at.append(len(self.steps))
        self.reasons.append(request.refusal)


def test_a_chunk_ends_at_a_snapshot_point_and_the_next_one_where_the_cut_chunk_would_have() -> None:
    request = Replayed(0, list(range(1, 110)), 100)
    assert request.next_target(64, 0, stops=(40,)) == 40
    assert request.next_target(64, 40, stops=(40,)) == 64  # the chunk grid stays where chunk-end snapshots are
    assert request.next_target(64, 64, stops=(40,)) == 100
    assert request.next_target(32, 0, stops=(40,)) == 32  # a stop beyond the chunk changes nothing
    assert request.next_target(80, 0) == 80  # recomputed from scratch: the cut chunk no longer applies


@pytest.mark.parametrize("hybrid", [True, False])
def test_the_batcher_declares_prefix_boundaries_and_stops_a_chunk_there(hybrid: bool) -> None:
    layers: list[LayerConfig] = [ssm(0), attention(1)] if hybrid else [attention(0), attention(1)]
    manager = KVCacheManager(make_config(layers, tiers=[GpuCacheTierConfig(16 * MIB)], tokens_per_block=TPB))
    tokens = list(range(1, 103))
    engine = Checked(manager)
    batcher = ContinuousBatcher(manager, [Declared(0, tokens, 100, boundary=40)], engine, BatchingOptions(chunk=64))
    batcher.step()
    cache = batcher.running[0].cache
    assert cache is not None and cache.snapshot_points == ((32,) if hybrid else ())  # 40 snapped down to its block
    run_to_end(batcher)
    chunks = [step[0][1:] for step in engine.steps][:3]
    # Only SSM states are snapshotted: an attention-only model's chunks do not stop at the boundary.
    assert chunks == ([(0, 32), (32, 64), (64, 100)] if hybrid else [(0, 64), (64, 100), (100, 101)])
    if hybrid:
        follower = manager.create_kv_cache(None, tokens[:32] + [7] * 40)
        assert follower.num_committed_tokens == 32  # the SSM snapshot at the declared boundary
        follower.close()
    manager.shutdown()


def test_batch_admission_asks_for_new_tokens_so_a_shared_prefix_leaves_a_whole_chunk() -> None:
    manager = manager_with(64)
    common = list(range(1, 65))
    first = Replayed(0, common + list(range(100, 140)), 100)
    second = Replayed(1, common + list(range(200, 240)), 100)
    engine = Checked(manager)
    batcher = ContinuousBatcher(manager, [first, second], engine, BatchingOptions(chunk=48, batch_admission=True))
    batcher.step()
    # The second request holds the 3 blocks the first computes this step and computes 48 new tokens after them.
    assert engine.steps[0] == [(0, 0, 48), (1, 48, 96)]
    run_to_end(batcher)
    assert engine.fake.tokens_checked > 0 and manager.num_live_caches == 0
    manager.shutdown()


def test_batch_admission_computes_a_short_prompt_whole_in_its_first_step() -> None:
    """The batch passes each prompt less its last token (its logits sample the first output token). The admitted
    chunk stopped at those tokens' end, so the last prompt token took a step of its own: (0, 39) then (39, 40)."""
    manager = manager_with(64)
    first = Replayed(0, list(range(1, 43)), 40)
    second = Replayed(1, list(range(1, 33)) + list(range(500, 510)), 40)  # shares the first's 2 blocks in the batch
    engine = Checked(manager)
    batcher = ContinuousBatcher(manager, [first, second], engine, BatchingOptions(chunk=48, batch_admission=True))
    run_to_end(batcher)
    assert engine.steps[:2] == [[(0, 0, 40), (1, 32, 40)], [(0, 40, 41), (1, 40, 41)]]
    assert engine.fake.tokens_checked > 0 and manager.num_live_caches == 0
    manager.shutdown()


def test_a_running_request_whose_growth_never_fits_is_failed_at_once_instead_of_preempted() -> None:
    manager = manager_with(gpu_slots=24)  # 384 tokens
    grows = Replayed(0, list(range(1, 501)), 100)  # decodes past what the whole GPU tier holds
    grows.max_length = None  # decoding decides, as with a model: a known length is refused on arrival instead
    other = Replayed(1, list(range(1000, 1070)), 60)
    engine = RecordsRejections(manager)
    batcher = ContinuousBatcher(manager, [grows, other], engine, BatchingOptions(chunk=64))
    run_to_end(batcher)
    assert engine.rejected_ids == [0] and batcher.preemptions == 0  # before: preempted, resumed, then rejected
    assert engine.rejected_at == [2 + (384 - 100)]  # right after 2 prefill and 284 decode steps: a 25th block
    reason = engine.reasons[0]
    assert reason is not None and reason.call == "KVCache.resize" and not reason.fits_empty_manager
    assert len(batcher.finished_ids) == 2 and manager.num_live_caches == 0
    manager.shutdown()


@pytest.mark.parametrize("chunk", [64, 500])
def test_a_request_of_known_length_that_never_fits_is_rejected_on_arrival(chunk: int) -> None:
    """A replayed request longer than the whole GPU tier was prefilled as far as the tier held, then rejected:
    steps computed for nothing, counted as work by the simulator (6 steps of prefill here at chunk 64)."""
    manager = manager_with(gpu_slots=24)  # 384 tokens
    engine = RecordsRejections(manager)
    batcher = ContinuousBatcher(manager, [Replayed(0, list(range(1, 501)), 450)], engine, BatchingOptions(chunk=chunk))
    run_to_end(batcher)
    assert engine.rejected_ids == [0] and engine.steps == [] and batcher.rejected == 1
    reason = engine.reasons[0]
    assert reason is not None and reason.call == "KVCacheManager.can_fit_in_chunks" and not reason.fits_empty_manager
    assert manager.num_live_caches == 0
    manager.shutdown()


@pytest.mark.parametrize("batch_admission", [False, True])
def test_a_waiting_request_that_never_fits_is_failed_at_once_while_others_run(batch_admission: bool) -> None:
    manager = manager_with(gpu_slots=24)
    running = Replayed(0, list(range(1, 121)), 40)  # 80 decode steps
    huge = Replayed(1, list(range(1000, 1600)), 590)  # 37 blocks
    engine = RecordsRejections(manager)
    options = BatchingOptions(chunk=600, batch_admission=batch_admission, refusal_backoff=True)
    batcher = ContinuousBatcher(manager, [running, huge], engine, options)
    run_to_end(batcher)
    assert engine.rejected_ids == [1] and engine.rejected_at[0] <= 2  # not after request 0's 80 steps
    reason = engine.reasons[0]
    assert reason is not None and not reason.fits_empty_manager and "pool group 0" in reason.detail
    manager.shutdown()


class CountsAdmissionAttempts(Checked):
    """Counts the caches opened for each request (each admission attempt matches a prefix and opens one)."""

    def __init__(self, manager: KVCacheManager) -> None:
        super().__init__(manager)
        self.attempts: dict[int, int] = {}

    def matched(self, request: Replayed, cache: KVCache) -> None:
        super().matched(request, cache)
        self.attempts[request.request_id] = self.attempts.get(request.request_id, 0) + 1


@pytest.mark.parametrize("backoff", [True, False])
def test_by_default_a_refused_admission_is_retried_only_once_gpu_room_grew(backoff: bool) -> None:
    manager = manager_with(gpu_slots=24)
    running = Replayed(0, list(range(1, 301)), 200)  # 100 decode steps on most of the GPU tier
    waiting = Replayed(1, list(range(1000, 1300)), 200)  # fits alone, not beside request 0
    engine = CountsAdmissionAttempts(manager)
    options = BatchingOptions(chunk=600) if backoff else BatchingOptions(chunk=600, refusal_backoff=False)
    batcher = ContinuousBatcher(manager, [running, waiting], engine, options)
    run_to_end(batcher)
    assert batcher.finished_ids == {0, 1} and batcher.preemptions == 0
    # Backing off: refused once, admitted once request 0 freed its pages. Without: a cache opened every step.
    assert engine.attempts == ({0: 1, 1: 2} if backoff else {0: 1, 1: 102})
    manager.shutdown()


def test_the_default_reject_names_the_managers_reason() -> None:
    manager = manager_with(gpu_slots=24)
    batcher = ContinuousBatcher(manager, [Replayed(0, list(range(1, 600)), 590)], Checked(manager),
                                BatchingOptions(chunk=600))
    with pytest.raises(RuntimeError, match="request 0 does not fit in the GPU tier even alone: .*GPU pages"):
        batcher.step()
    batcher.close_all()
    manager.shutdown()


def test_a_chunk_ends_at_the_first_of_many_snapshot_points_inside_it() -> None:
    """Stops come ascending (``KVCache.snapshot_points``); the first one past the history decides, wherever it is
    among many (one at every block of a long prompt)."""
    request = Replayed(0, list(range(1, 5000)), 4999)
    stops = tuple(range(16, 4096, 16))
    assert request.next_target(64, 0, stops=stops) == 16
    assert request.next_target(64, 16, stops=stops) == 32
    assert request.next_target(64, 4080, stops=stops) == 4080 + 64  # past the last stop: the whole chunk
    assert request.next_target(64, 100, stops=(50, 120, 130)) == 120  # stops behind the history change nothing
    assert request.next_target(8, 100, stops=(50, 120, 130)) == 108  # nor one beyond the chunk


def test_a_request_grown_past_max_util_for_resume_is_never_preempted() -> None:
    """``resize`` is not bounded by ``max_util_for_resume`` (only a resume is), so a running request can grow to
    more of a pool group than a resume may lock: a long request holding 39 of 40 pages was preempted when an
    earlier, short one needed its second block, and its resume then answered "needs 39 GPU pages; it may use at
    most 38 of 40" with ``fits_empty_manager=False``: the batcher rejected it after it had run (7 of its 20
    tokens generated). A request whose cache is not ``resumable_alone`` is no victim: the short one waits
    instead (it preempts itself), and both finish with their tokens checked."""
    manager = manager_with(gpu_slots=40, host_slots=64)  # the default max_util_for_resume: a resume locks <= 38
    short = Replayed(0, list(range(1, 31)), 10)  # grows to its second block while the long one runs
    long = Replayed(1, list(range(1000, 1000 + 38 * TPB + 8 + 20)), 38 * TPB + 8)  # 40 blocks at its end
    engine = Checked(manager, reject_drops=True)
    batcher = ContinuousBatcher(manager, [short, long], engine, BatchingOptions(chunk=640, max_batch=4))
    run_to_end(batcher)
    assert engine.rejected_ids == [] and sorted(batcher.finished_ids) == [0, 1]
    assert batcher.preemptions == 1 and batcher.resumes == 1  # the short one, by itself
    assert engine.fake.tokens_checked > 0
    manager.shutdown()

