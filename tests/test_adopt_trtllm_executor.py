"""A TensorRT-LLM-PyExecutor-style engine's integration, written from README.md and the public docstrings only.

PyExecutor runs each iteration as: a capacity scheduler picks the requests that may hold KV cache
(``GUARANTEED_NO_EVICT``: admit a request only while every admitted one can run to its max tokens without a
pause; ``MAX_UTILIZATION``: admit greedily and pause the newest when a step cannot fit, resuming it later), a
micro-batch scheduler fits them into a token budget (generation requests first, then context chunks),
``prepare_resources`` before the forward (create + resume a new request's cache, ``resize`` for this step's tokens,
drafts included) and ``update_resources`` after it (commit what was computed, rewind rejected drafts, close what
finished). Beam width 1; requests finish at max tokens or on their end token; one is cancelled in the middle of
its context. The model is a deterministic function of the token sequence, so every request's output is known in
advance and checked; the FakeEngine writes every computed token's K/V (and SSM state) from codes of the whole prefix
(``testing.contextual_tokens``) and checks every page and state it reads back. Two models: Gemma-like (a
sliding-window group and a global group) and a Nemotron-H-like hybrid (attention and SSM layers: prefill chunks
end at the cache's ``snapshot_points``, and after a speculative step the live state is set back to the accepted
tokens, as the manager never rewinds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import pytest

from kv_cache_manager_v2 import (AttentionLayerConfig, BatchDesc, BufferConfig, GpuCacheTierConfig, HostCacheTierConfig,
                                 KVCache, KVCacheDesc, KVCacheManager, KVCacheManagerConfig,
                                 SsmLayerConfig)
from kv_cache_manager_v2.testing import FakeEngine, contextual_tokens

TPB, ROW = 16, 64
WINDOW = 64  # the sliding-window layers' attention window
SYSTEM = list(range(100, 148))  # a 48-token system prompt (3 blocks) every request starts with
CHUNK = 32  # context chunk unit (TensorRT-LLM's chunk unit: every chunk but a prompt's last is a multiple)
MAX_NUM_TOKENS = 96  # the micro-batch scheduler's token budget per iteration
MAX_NUM_REQUESTS = 6
NUM_DRAFTS = 3
GPU_PAGES = {"gemma": 60, "hybrid": 30}  # small enough that MAX_UTILIZATION pauses and GUARANTEED_NO_EVICT waits


class State(Enum):
    """LlmRequestState, as far as the KV cache sees it."""

    WAITING = "waiting"
    CONTEXT = "context"
    GENERATION = "generation"
    PAUSED = "paused"
    COMPLETE = "complete"
    CANCELLED = "cancelled"


def model(tokens: list[int]) -> int:
    """The target model's greedy next token: a function of the whole sequence, so a wrong history shows."""
    return (tokens[-1] * 31 + len(tokens) * 7 + tokens[0]) % 901 + 50


def drafter(tokens: list[int], step: int) -> list[int]:
    """A draft model: the target's continuation, with its second token wrong on odd steps."""
    drafts, seq = [], list(tokens)
    for i in range(NUM_DRAFTS):
        token = model(seq)
        if step % 2 == 1 and i == 1:
            token = token + 1
        drafts.append(token)
        seq.append(token)
    return drafts


@dataclass
class Request:
    """An LlmRequest: prompt, limits, and what the executor generated."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    end_id: int | None = None
    speculative: bool = False
    cancel_at_position: int | None = None  # cancelled once its context reaches this many computed tokens
    state: State = State.WAITING
    output: list[int] = field(default_factory=list)
    cache: KVCache | None = None
    position: int = 0  # tokens whose K/V are computed (TensorRT-LLM's context_current_position, then history)
    reused: int = -1
    committed_at_cancel: int = -1
    pauses: int = 0
    steps: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def max_length(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    def expected_output(self) -> list[int]:
        """What greedy decoding with the target model yields (speculation changes nothing)."""
        seq, out = list(self.prompt), list[int]()
        while len(out) < self.max_new_tokens:
            out.append(model(seq))
            seq.append(out[-1])
            if out[-1] == self.end_id:
                break
        return out


def workload() -> list[Request]:
    requests = []
    for i in range(10):
        prompt = SYSTEM + [1000 + 13 * i + j for j in range(20 + 9 * i)]
        requests.append(Request(i, prompt, max_new_tokens=10 + (i % 3) * 4, speculative=i % 2 == 0))
    requests[3].cancel_at_position = 64  # in the middle of its 95-token context (its chunks end at 32, 64, 95)
    requests.append(Request(10, list(requests[3].prompt), max_new_tokens=6))  # the cancelled prompt again
    end_from = requests[5].expected_output()
    requests[5].end_id = end_from[3]  # finishes on its end token after 4 tokens, before its max
    return requests


class Executor:
    """The PyExecutor loop over the manager: capacity scheduler, micro-batch scheduler, prepare / update."""

    def __init__(self, manager: KVCacheManager, requests: list[Request], policy: str) -> None:
        self.manager, self.policy = manager, policy
        self.fake = FakeEngine(manager)
        self.waiting = list(requests)
        self.active: list[Request] = []  # admitted, in admission order (context, generation or paused)
        self.finished: list[Request] = []
        self.iteration = 0
        self.system_cached = False  # some request committed the system prompt: later ones reuse it
        self.cancelled_committed: dict[int, int] = {}  # prompt's first unique token -> tokens the cancel left
        self.cancelled_reused: list[int] = []  # what each repeat of a cancelled prompt reused
        self.refusals = 0
        self.held_back = 0  # GUARANTEED_NO_EVICT admissions postponed for the running requests' reservations
        self.most_running = 0

    # -- capacity scheduler ---------------------------------------------------------------------------------
    def _reserved(self, request: Request) -> list[int]:
        """What the request may hold until it finishes: its max length, plus the drafts of its last step."""
        drafts = NUM_DRAFTS if request.speculative else 0
        return self.manager.peak_pages(request.max_length + drafts, CHUNK)

    def schedule_capacity(self) -> None:
        """Admit waiting requests FCFS (GUARANTEED_NO_EVICT: while every admitted request's peak fits)."""
        if self.policy == "GUARANTEED_NO_EVICT":
            util = self.manager.config.admission_util  # max_util_for_resume, less the watermark's share
            limits = [int(s.total * util) for s in self.manager.get_storage_statistics(0)]
            reserved = [0] * len(limits)
            for request in self.active:
                reserved = [a + b for a, b in zip(reserved, self._reserved(request))]
        while self.waiting and len(self.active) < MAX_NUM_REQUESTS:
            request = self.waiting[0]
            if self.policy == "GUARANTEED_NO_EVICT":
                need = [a + b for a, b in zip(reserved, self._reserved(request))]
                if any(n > limit for n, limit in zip(need, limits)):
                    self.held_back += 1
                    break  # FCFS: wait for a running request to finish
                reserved = need
            elif any(r.state is State.PAUSED for r in self.active):
                break  # the paused come back before anyone new
            if not self._admit(request):
                break  # MAX_UTILIZATION: no room now; try again after a request finishes
            self.waiting.pop(0)
            self.active.append(request)

    def _admit(self, request: Request) -> bool:
        """prepare_context: the cache holds the longest cached prefix of the prompt less its last token."""
        expected_reuse = self.manager.probe_reuse(None, request.prompt[:-1])
        cache = self.manager.create_kv_cache(input_tokens=request.prompt[:-1], snapshot_at=[len(SYSTEM)])
        if not cache.resume():
            assert self.policy == "MAX_UTILIZATION", cache.last_refusal
            assert cache.last_refusal is not None and cache.last_refusal.fits_empty_manager, cache.last_refusal
            cache.close()
            self.refusals += 1
            return False
        request.cache, request.state = cache, State.CONTEXT
        request.position = request.reused = cache.num_committed_tokens
        assert request.reused == expected_reuse
        left = self.cancelled_committed.get(request.prompt[len(SYSTEM)])
        if left is not None:  # the cancelled request's committed prefix, up to the last prompt token, if still cached
            self.cancelled_reused.append(request.reused)
            assert len(SYSTEM) <= request.reused <= min(left, len(request.prompt) - 1), (request.reused, left)
        else:
            assert request.reused == (len(SYSTEM) if self.system_cached else 0), (request.rid, request.reused)
        return True

    # -- micro-batch scheduler and prepare_resources ---------------------------------------------------------
    def _resume_paused(self) -> None:
        for request in self.active:
            if request.state is State.PAUSED:
                assert request.cache is not None
                if not request.cache.resume():
                    return  # oldest first: a younger one must not jump the queue
                request.state = State.CONTEXT if request.position < len(request.prompt) else State.GENERATION

    def _pause_newest(self, keep: Request) -> bool:
        """MAX_UTILIZATION: suspend the most recently admitted running request (not ``keep``) that could resume
        alone; one already scheduled this step gives its growth back first."""
        for victim in reversed(self.active):
            if victim is keep or victim.state not in (State.CONTEXT, State.GENERATION):
                continue
            assert victim.cache is not None
            if not victim.cache.resumable_alone:
                continue
            if victim.cache.capacity > victim.position:
                assert victim.cache.resize(victim.position)
            victim.cache.suspend()
            victim.state, victim.pauses = State.PAUSED, victim.pauses + 1
            return True
        return False

    def _step_target(self, request: Request, budget: int) -> int:
        """End of this step's input: the next context chunk, or the last sampled token plus drafts."""
        if request.state is State.GENERATION:
            return len(request.tokens) + (NUM_DRAFTS if request.speculative else 0)
        remaining = len(request.prompt) - request.position
        if remaining <= min(budget, CHUNK):
            end = len(request.prompt)  # the prompt's last chunk
        else:
            end = request.position + CHUNK if budget >= CHUNK else request.position  # a whole chunk, or none
        assert request.cache is not None  # an SSM state is reusable only where a chunk ended: end there
        return min([end] + [p for p in request.cache.snapshot_points if p > request.position])

    def prepare_resources(self) -> list[tuple[Request, int]]:
        """Generation requests first, then context chunks within the token budget; ``resize`` for each step."""
        if self.policy == "MAX_UTILIZATION":
            self._resume_paused()
        running = [r for r in self.active if r.state in (State.GENERATION, State.CONTEXT)]
        order = [r for r in running if r.state is State.GENERATION] + [r for r in running if r.state is State.CONTEXT]
        budget, batch = MAX_NUM_TOKENS, list[tuple[Request, int]]()
        for request in order:
            if request.state is State.PAUSED:
                continue  # paused by a later request's growth in this very step
            cache = request.cache
            assert cache is not None and cache.history_length == request.position
            end = self._step_target(request, budget)
            if end - request.position > budget or end == request.position:
                continue
            while not cache.resize(end):
                refusal = cache.last_refusal
                assert self.policy == "MAX_UTILIZATION", f"GUARANTEED_NO_EVICT refused: {refusal}"
                assert refusal is not None and refusal.fits_empty_manager, refusal
                self.refusals += 1
                if not self._pause_newest(request):
                    cache.suspend()
                    request.state, request.pauses = State.PAUSED, request.pauses + 1
                    break
                batch = [(r, e) for r, e in batch if r.state is not State.PAUSED]  # its tokens come back
                budget = MAX_NUM_TOKENS - sum(e - r.position for r, e in batch)
            else:
                budget -= end - request.position
                batch.append((request, end))
        return batch

    # -- forward and update_resources ----------------------------------------------------------------------
    def forward(self, batch: list[tuple[Request, int]]) -> dict[int, list[int]]:
        """Write and check every scheduled token's K/V; return each generation request's drafts."""
        drafts: dict[int, list[int]] = {}
        for request, end in batch:
            assert request.cache is not None
            seq = request.tokens
            if request.state is State.GENERATION and request.speculative:
                drafts[request.rid] = drafter(seq, self.iteration)
                seq = seq + drafts[request.rid]
            self.fake.step(request.cache, contextual_tokens(seq[:end]))
        return drafts

    def update_resources(self, batch: list[tuple[Request, int]], drafts: dict[int, list[int]]) -> None:
        for request, end in batch:
            cache = request.cache
            assert cache is not None
            if request.state is State.CONTEXT:
                cache.commit(request.prompt[cache.num_committed_tokens:end])
                request.position = end
                self.system_cached = self.system_cached or end >= len(SYSTEM)
                if request.cancel_at_position is not None and end >= request.cancel_at_position:
                    request.committed_at_cancel = cache.num_committed_tokens
                    self.cancelled_committed[request.prompt[len(SYSTEM)]] = cache.num_committed_tokens
                    self._finish(request, State.CANCELLED)
                    continue
                if end < len(request.prompt):
                    continue
                request.state = State.GENERATION  # the last prompt token's logits sample the first output
                self._emit(request, [model(request.prompt)])
                continue
            seq = request.tokens
            proposed = drafts.get(request.rid, [])
            accepted = 0
            while accepted < len(proposed) and proposed[accepted] == model(seq + proposed[:accepted]):
                accepted += 1
            computed = len(seq) + accepted  # the last sampled token and the accepted drafts
            cache.commit((seq + proposed)[cache.num_committed_tokens:computed])
            if cache.capacity > computed:
                assert cache.resize(computed)  # rewind: the rejected drafts' rows are free again
            if proposed:  # the SSM live state went past the accepted tokens: set it back (no-op without SSM)
                self.fake.accept_states(cache, contextual_tokens((seq + proposed)[:computed]))
            request.position = computed
            new = proposed[:accepted] + [model(seq + proposed[:accepted])]
            self._emit(request, new)

    def _emit(self, request: Request, new: list[int]) -> None:
        for token in new:
            request.output.append(token)
            if token == request.end_id or len(request.output) == request.max_new_tokens:
                self._finish(request, State.COMPLETE)
                return

    def _finish(self, request: Request, state: State) -> None:
        assert request.cache is not None
        request.cache.close()
        request.cache, request.state = None, state
        self.active.remove(request)
        self.finished.append(request)

    def run(self) -> None:
        while self.waiting or self.active:
            self.iteration += 1
            assert self.iteration < 1000, "no progress"
            self.schedule_capacity()
            batch = self.prepare_resources()
            self.most_running = max(self.most_running, len(batch))
            drafts = self.forward(batch)
            self.update_resources(batch, drafts)


def _manager(model_kind: str, gpu_pages: int, declare_step: bool = True) -> KVCacheManager:
    kv = [BufferConfig("key", TPB * ROW), BufferConfig("value", TPB * ROW)]
    slot = 2 * 2 * TPB * ROW  # one page of two layers' K and V
    layers: list[AttentionLayerConfig | SsmLayerConfig]
    if model_kind == "gemma":  # sliding-window layers interleaved with global ones
        layers = [AttentionLayerConfig(i, kv, sliding_window_size=WINDOW if i % 2 == 0 else None) for i in range(4)]
    else:  # Nemotron-H-like: SSM layers and a few attention layers
        layers = [SsmLayerConfig(0, [BufferConfig("ssm_state", 1024), BufferConfig("conv_state", 256)]),
                  AttentionLayerConfig(1, kv), AttentionLayerConfig(2, kv)]
    step = BatchDesc([KVCacheDesc(160, 159)] * MAX_NUM_REQUESTS, len(SYSTEM))  # the decode step it runs most
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=layers, typical_step=step if declare_step else None,
        cache_tiers=[GpuCacheTierConfig(gpu_pages * slot), HostCacheTierConfig(1 << 20)]))


@pytest.mark.parametrize("model_kind", ["gemma", "hybrid"])
@pytest.mark.parametrize("policy", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
def test_executor_serves_every_request(model_kind: str, policy: str) -> None:
    manager = _manager(model_kind, GPU_PAGES[model_kind])
    requests = workload()
    executor = Executor(manager, requests, policy)
    executor.run()
    for request in requests:
        if request.rid == 3:
            assert request.state is State.CANCELLED and request.output == []
            continue
        assert request.state is State.COMPLETE, request
        assert request.output == request.expected_output(), request.rid
    assert len(requests[5].output) == 4 and requests[5].output[-1] == requests[5].end_id
    cancelled = requests[3]  # cancelled with part of its context committed, which its repeat reuses
    assert len(SYSTEM) < cancelled.committed_at_cancel < len(cancelled.prompt) - 1
    assert requests[10].reused == cancelled.committed_at_cancel and executor.cancelled_reused == [requests[10].reused]
    assert manager.num_live_caches == 0 and executor.fake.tokens_checked > 0
    pauses = sum(request.pauses for request in requests)
    if policy == "GUARANTEED_NO_EVICT":
        assert pauses == 0 and executor.refusals == 0 and executor.held_back > 0
    else:
        assert pauses > 0  # the small GPU tier made it pause and resume
    manager.check_invariants()
    manager.shutdown()



def slots(manager: KVCacheManager, slot_bytes: int) -> list[int]:
    """Slots per tier, GPU first, of the hybrid's pool group of ``slot_bytes``: 1,024 + 256 for the SSM group (one
    state), 2 layers x 2 buffers x ``TPB * ROW`` for the attention group."""
    return [usage.total for usage in manager.get_usage() if usage.slot_bytes == slot_bytes]


def test_the_hybrid_without_typical_step_loses_the_cancelled_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    """README ("Coming from TensorRT-LLM's PyExecutor"): without ``typical_step`` the default split (here the step
    derived for a small tier) gave this hybrid's SSM pool group 3 GPU and 9 host slots, so the repeat of the
    cancelled request found its 80-token snapshot evicted and reused only the 48-token system prompt, with no
    refusal; declared, the group got 9 and 64 and the repeat reused all 80."""
    declared = _manager("hybrid", GPU_PAGES["hybrid"])
    assert slots(declared, 1024 + 256) == [9, 64]
    declared.shutdown()
    with caplog.at_level("WARNING", logger="kv_cache_manager_v2"):
        manager = _manager("hybrid", GPU_PAGES["hybrid"], declare_step=False)
    assert "its default split (no typical_step declared)" in caplog.text
    assert slots(manager, 1024 + 256) == [3, 9] and slots(manager, 2 * 2 * TPB * ROW) == [29, 253]
    assert GPU_PAGES["hybrid"] * 2 * 2 * TPB * ROW == 120 << 10  # the README's 120 KiB GPU tier
    requests = workload()
    executor = Executor(manager, requests, "GUARANTEED_NO_EVICT")
    executor.run()
    assert requests[3].committed_at_cancel == 80 and executor.cancelled_reused == [len(SYSTEM)] == [48]
    assert executor.refusals == 0 and all(r.output == r.expected_output() for r in requests if r.rid != 3)
    manager.check_invariants()
    manager.shutdown()
