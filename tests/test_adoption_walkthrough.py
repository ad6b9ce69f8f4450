"""An engine author's integration, written from README.md, the public docstrings and the FakeEngine only.

A vLLM-like scheduler (a waiting queue and a running list, a token budget per step, chunked prefill, one decode
token a step, preemption by ``suspend`` + ``offload`` when a running request cannot grow, ``resume`` later, prefix
caching across requests sharing a system prompt, follow-up turns, ``stop_committing`` + ``close`` at the end) serves
a Llama-like, a Gemma-like and a Nemotron-H-like model, and two variants: new requests admitted in one
``create_kv_cache_batch`` (Llama-like), SWA scratch reuse with chunks longer than the window (Gemma-like). The FakeEngine writes every computed token's K/V (and the SSM
states) from codes that depend on the whole prefix (``testing.ContextualTokens``) and checks every readable page on
every step, so a page reused for the wrong prompt, lost on a tier round trip or missing where attention reads fails.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCache,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRequest,
    SsmLayerConfig,
)
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import ContextualTokens, FakeEngine

TPB = 16
ROW = 128  # bytes per token of one K or V buffer (a multiple of 8: the FakeEngine's records)
CHUNK = 48  # prefill tokens per request per step
TOKEN_BUDGET = 96  # tokens computed per step, all requests together
MAX_RUNNING = 4
SYSTEM = [7] * 5 + list(range(100, 170))  # 75 tokens: four full blocks and a partial one
# The steps this engine runs (KVCacheManagerConfig.typical_step): a few requests mid-prefill or decoding.
STEP = BatchDesc([KVCacheDesc(160, 112)] * MAX_RUNNING, system_prompt_length=len(SYSTEM))


def kv(tokens_per_block: int = TPB) -> list[BufferConfig]:
    return [BufferConfig("key", tokens_per_block * ROW), BufferConfig("value", tokens_per_block * ROW)]


@dataclass
class Request:
    """One turn of a chat: its prompt, what was generated after it, its cache while it has one."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    generated: list[int] = field(default_factory=list)
    cache: KVCache | None = None
    reused: int = -1  # tokens the cache found cached when it was created
    preempted: bool = False
    previous: Request | None = None  # the turn this one continues
    codes: ContextualTokens = field(default_factory=ContextualTokens)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def done(self) -> bool:
        return len(self.generated) == self.max_new_tokens


@dataclass
class Scheduler:
    """The engine's loop: FCFS admission from ``waiting``, running requests first in each step's budget."""

    manager: KVCacheManager
    snapshot_at: list[int]
    batch_admission: bool = False  # admit new requests with create_kv_cache_batch
    chunk: int = CHUNK
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0
    resumes: int = 0
    offloaded_pages: int = 0
    batch_shares: int = 0  # requests admitted holding pages an earlier request of their batch computes
    stale_blocks: dict[int, int] = field(default_factory=dict)  # per layer group, the most a window released

    def __post_init__(self) -> None:
        self.fake = FakeEngine(self.manager)

    def next_target(self, request: Request, cache: KVCache, budget: int) -> int:
        """The capacity this step computes to: a prefill chunk (ending at a snapshot point, as
        ``KVCache.snapshot_points`` asks) or the one token sampled last step."""
        history = cache.history_length
        if history >= len(request.prompt) - 1:
            return len(request.tokens)  # decode: the last sampled token (or the prompt's last one)
        target = min(history + min(self.chunk, budget), len(request.prompt))
        return min([target] + [point for point in cache.snapshot_points if history < point < target])

    def preempt(self, victim: Request) -> None:
        """Suspend the newest running request and send its pages to the host tier; it waits at the front."""
        assert victim.cache is not None
        victim.cache.suspend()
        self.offloaded_pages += victim.cache.offload()
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        victim.preempted = True
        self.preemptions += 1

    def grow(self, request: Request, budget: int) -> int:
        """Room for this step's tokens of a running request, preempting newer ones while it is refused."""
        cache = request.cache
        assert cache is not None
        while True:
            target = self.next_target(request, cache, budget)
            if cache.resize(target, cache.history_length):
                return target - cache.history_length
            refusal = cache.last_refusal
            assert refusal is not None and refusal.fits_empty_manager, refusal
            self.preempt(self.running[-1])
            if request not in self.running:
                return 0

    def admit(self, request: Request, budget: int) -> bool:
        """Create (or resume) the request's cache and give it its first chunk; False leaves it waiting."""
        if request.cache is None:
            # Without the last prompt token: its logits sample the first output (create_kv_cache's docstring).
            expected = self.manager.probe_reuse(None, request.prompt[:-1])
            request.cache = self.manager.create_kv_cache(input_tokens=request.prompt[:-1], snapshot_at=self.snapshot_at)
            request.reused = request.cache.num_committed_tokens
            assert request.reused == expected
        cache = request.cache
        if not cache.resume():
            refusal = cache.last_refusal
            assert refusal is not None and refusal.fits_empty_manager, refusal
            return False
        target = self.next_target(request, cache, budget)
        if not cache.resize(target, cache.history_length):
            refusal = cache.last_refusal
            assert refusal is not None and refusal.fits_empty_manager, refusal
            cache.suspend()
            return False
        self.running.append(request)
        return True

    def step(self, arrivals: list[Request]) -> None:
        self.steps += 1
        self.waiting.extend(request for request in arrivals if request.arrival_step == self.steps)
        budget = TOKEN_BUDGET
        scheduled: list[Request] = []
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted by an older request's growth this step
            budget -= self.grow(request, budget)
            if request in self.running:
                scheduled.append(request)
        while self.waiting and len(self.running) < MAX_RUNNING and budget > 0:
            request = self.waiting[0]
            if request.cache is None and self.batch_admission:
                budget -= self.admit_batch(budget, scheduled)
                break
            if not self.admit(request, budget):
                break
            self.waiting.popleft()
            self.resumes += request.preempted
            request.preempted = False
            assert request.cache is not None
            budget -= request.cache.capacity - request.cache.history_length
            scheduled.append(request)
        for request in scheduled:  # in admission order: a batch's later request reads what an earlier one writes
            self.forward(request)

    def admit_batch(self, budget: int, scheduled: list[Request]) -> int:
        """Admit the new requests at the head of ``waiting`` in one ``create_kv_cache_batch``, each asking for a
        chunk beyond what it reuses (``num_new_tokens``); returns the tokens scheduled."""
        new: list[Request] = []
        for request in self.waiting:
            if request.cache is not None or len(self.running) + len(new) == MAX_RUNNING:
                break
            new.append(request)
        share = max(1, budget // len(new))
        caches = self.manager.create_kv_cache_batch(
            [KVCacheRequest(request.prompt[:-1], num_new_tokens=min(share, self.chunk), snapshot_at=self.snapshot_at)
             for request in new]
        )
        used = 0
        for request, cache, refusal in zip(new, caches, self.manager.last_batch_refusals):
            if cache is None:
                assert refusal is not None and refusal.fits_empty_manager, refusal
                continue
            request.cache, request.reused = cache, cache.history_length
            self.batch_shares += cache.num_committed_tokens < cache.history_length  # an earlier one computes it
            # The chunk is counted from the reuse, which the engine did not know: end it where this step must.
            target = self.next_target(request, cache, cache.capacity - cache.history_length)
            if target < cache.capacity:
                assert cache.resize(target, cache.history_length)
            self.waiting.remove(request)
            self.running.append(request)
            scheduled.append(request)
            used += cache.capacity - cache.history_length
        return used

    def forward(self, request: Request) -> None:
        """The model's step: write this step's K/V, check every page it reads, commit, sample."""
        cache = request.cache
        assert cache is not None
        target = cache.capacity
        self.fake.step(cache, request.codes.of(request.tokens))
        if target == len(request.tokens):  # the last known token was computed: sample the next one
            request.generated.append(1000 + request.request_id * 37 + len(request.generated))
        # From num_committed_tokens, not history_length: a request sharing a batch neighbour's prefix pages starts
        # its history after them but commits them itself.
        cache.commit(request.tokens[cache.num_committed_tokens : target])
        for group in range(self.manager.num_layer_groups):
            released = cache.get_num_front_blocks_removed(group)
            self.stale_blocks[group] = max(self.stale_blocks.get(group, 0), released)
        if request.done:
            cache.stop_committing()
            cache.close()
            self.running.remove(request)
            self.finished.append(request)

    def run(self, requests: list[Request], follow_ups: int = 2) -> None:
        """Serve ``requests``; the first ``follow_ups`` finished ones each get a next turn (their prompt and
        answer plus new user tokens), arriving the step after."""
        pending = list(requests)
        while len(self.finished) < len(pending):
            assert self.steps < 2000, "the loop does not finish"
            done = len(self.finished)
            self.step(pending)
            for turn in self.finished[done:]:
                if turn.request_id < follow_ups:
                    user = [900 + turn.request_id] * 20
                    pending.append(Request(100 + turn.request_id, turn.tokens + user, 4, self.steps + 1, previous=turn))
        assert self.manager.num_live_caches == 0


def chats(count: int) -> list[Request]:
    """``count`` requests opening with the system prompt, two arriving per step."""
    return [
        Request(i, SYSTEM + [500 + 10 * i + j % 7 for j in range(30 + 25 * (i % 3))], max_new_tokens=6,
                arrival_step=1 + i // 2)
        for i in range(count)
    ]


def manager_for(
    layers: list[LayerConfig], gpu_bytes: int, last_snapshot: bool = False, scratch: bool = False
) -> KVCacheManager:
    return KVCacheManager(
        KVCacheManagerConfig(
            tokens_per_block=TPB,
            layers=layers,
            backend="cpu",
            cache_tiers=[GpuCacheTierConfig(gpu_bytes), HostCacheTierConfig(8 << 20)],
            typical_step=STEP,
            mamba_save_last_snapshot=last_snapshot,
            enable_swa_scratch_reuse=scratch,
        )
    )


def serve_and_check(manager: KVCacheManager, snapshot_at: list[int], batch_admission: bool = False) -> Scheduler:
    """Serve eight chats and two follow-up turns; check what the docs promise beyond the page contents (which the
    FakeEngine checked on every step): memory was short enough to preempt and offload, and the preempted requests
    came back."""
    scheduler = Scheduler(manager, snapshot_at, batch_admission)
    scheduler.run(chats(8))
    assert len(scheduler.finished) == 10 and all(request.done for request in scheduler.finished)
    assert scheduler.fake.tokens_checked > 0
    assert scheduler.preemptions > 0 and scheduler.resumes == scheduler.preemptions, scheduler
    assert scheduler.offloaded_pages > 0 and manager.movement_counters.onboarded_pages > 0
    return scheduler


def reuse_of(scheduler: Scheduler) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Tokens found cached by the chats that arrived after the first two; for each follow-up turn, (tokens found,
    tokens the previous turn computed, the end of the previous prompt's last full block)."""
    later = [request.reused for request in scheduler.finished if request.previous is None and request.arrival_step > 1]
    turns = [
        # The previous turn's last sampled token was never computed; its cache was created without the last
        # prompt token, so that one's full blocks end the prompt's snapshot.
        (request.reused, len(request.previous.tokens) - 1, (len(request.previous.prompt) - 1) // TPB * TPB)
        for request in scheduler.finished
        if request.previous is not None
    ]
    return later, turns


def test_llama_like() -> None:
    layers: list[LayerConfig] = [AttentionLayerConfig(i, kv()) for i in range(4)]
    manager = manager_for(layers, 16 * 4 * 2 * TPB * ROW)  # 16 blocks on the GPU
    later, turns = reuse_of(serve_and_check(manager, []))
    # The system prompt is reused whole (partial reuse copies its last, partial block); a follow-up turn reuses
    # every token its previous turn computed (close() published the trailing partial block).
    assert later == [len(SYSTEM)] * 6
    assert len(turns) == 2 and all(found == computed for found, computed, _ in turns), turns
    manager.shutdown()


def test_llama_like_with_batch_admission() -> None:
    """New requests admitted together (``create_kv_cache_batch`` with ``num_new_tokens``): the two opening chats
    share the system prompt's first chunk, which the first computes and the second reads in the same step."""
    layers: list[LayerConfig] = [AttentionLayerConfig(i, kv()) for i in range(4)]
    manager = manager_for(layers, 16 * 4 * 2 * TPB * ROW)
    scheduler = serve_and_check(manager, [], batch_admission=True)
    assert scheduler.batch_shares > 0
    later, turns = reuse_of(scheduler)
    assert later == [len(SYSTEM)] * 6
    assert len(turns) == 2 and all(found == computed for found, computed, _ in turns), turns
    manager.shutdown()


def test_gemma_like() -> None:
    """Five sliding-window layers (window 40) to one global layer, as Gemma 3 interleaves them."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(i, kv()) if i % 6 == 5 else AttentionLayerConfig(i, kv(), sliding_window_size=40)
        for i in range(6)
    ]
    manager = manager_for(layers, 12 * 6 * 2 * TPB * ROW)
    assert manager.num_layer_groups == 2 and manager.get_layer_window(0) == (40, 0)
    scheduler = serve_and_check(manager, [])
    # The windows released the blocks they had passed (their pages went back to the pool); the global layer none.
    window, full = manager.get_layer_group_id(0), manager.get_layer_group_id(5)
    assert scheduler.stale_blocks[window] > 0 and scheduler.stale_blocks[full] == 0, scheduler.stale_blocks
    later, turns = reuse_of(scheduler)
    assert later == [len(SYSTEM)] * 6
    assert len(turns) == 2 and all(found == computed for found, computed, _ in turns), turns
    manager.shutdown()


def test_gemma_like_with_scratch_reuse() -> None:
    """Prefill chunks (96 tokens) longer than the window (24) with SWA scratch reuse: what a chunk leaves behind
    the window gets no page, so the system prompt is reusable only because its end is declared (``snapshot_at``)
    and the scheduler ends a chunk at ``snapshot_points``."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(i, kv()) if i % 6 == 5 else AttentionLayerConfig(i, kv(), sliding_window_size=24)
        for i in range(6)
    ]
    manager = manager_for(layers, 4 << 20, scratch=True)
    scheduler = Scheduler(manager, [len(SYSTEM)], chunk=96)
    scheduler.run(chats(8))
    assert scheduler.fake.tokens_checked > 0
    later, turns = reuse_of(scheduler)
    # From the system prompt's last block boundary (a chunk ended there too) while its partial last block is in
    # no cache's tree yet, all of it after.
    assert all(reused in (len(SYSTEM) // TPB * TPB, len(SYSTEM)) for reused in later), later
    assert len(turns) == 2 and all(found == computed for found, computed, _ in turns), turns
    manager.shutdown()


def test_nemotron_h_like() -> None:
    """Attention every third layer, Mamba-2 layers (conv and SSM states) between. The system prompt's end is
    declared (``snapshot_at``) and ``mamba_save_last_snapshot`` makes each prompt's end a reuse point for the next
    turn; the scheduler ends prefill chunks at ``snapshot_points``."""
    layers: list[LayerConfig] = [
        AttentionLayerConfig(i, kv()) if i % 3 == 2
        else SsmLayerConfig(i, [BufferConfig("conv_state", 512), BufferConfig("ssm_state", 4096)])
        for i in range(6)
    ]
    manager = manager_for(layers, 1 << 18, last_snapshot=True)
    later, turns = reuse_of(serve_and_check(manager, [len(SYSTEM)]))
    # An SSM state exists only where a snapshot was taken: the first chunk's end (48) for the two chats that
    # arrived while the first ones were still computing the system prompt, its snapped-down end (64) after.
    assert later == [48, 48, 64, 64, 64, 64], later
    # A follow-up resumes at least from its previous prompt's last full block.
    assert len(turns) == 2 and all(found >= prompt_end > len(SYSTEM) for found, _, prompt_end in turns), turns
    manager.shutdown()
