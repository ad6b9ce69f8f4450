"""An SGLang-style engine's integration, written from README.md, the public docstrings and the FakeEngine only.

SGLang's scheduler talks to a radix cache: ``match_prefix`` for every waiting request each step (its
longest-prefix-match policy orders the queue by the answer), ``inc_lock_ref`` on the matched node and
``load_back`` of host pages before a prefill (HiCache), ``cache_unfinished_req`` after each prefill chunk,
``cache_finished_req`` at the end, retraction of decode requests (freed, recomputed later) when memory runs out,
``evictable_size`` for its memory checks and ``flush_cache`` when idle. ``RadixCacheOnManager`` maps each call
onto the manager (README's "Coming from SGLang" table); ``Scheduler`` is that loop over a shared system prompt and
multi-turn chats, on a GPU tier small enough to retract and a host tier that keeps every evicted page. The
FakeEngine writes every computed token's K/V from codes that depend on the whole prefix
(``testing.ContextualTokens``) and checks every page it reads, so a page reused for another prefix, lost on a
host round trip or freed while a request still reads it fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, CacheTier, GpuCacheTierConfig, HostCacheTierConfig,
                                 KVCache, KVCacheManager, KVCacheManagerConfig)
from kv_cache_manager_v2.testing import ContextualTokens, FakeEngine

TPB = 16  # SGLang's page_size
ROW = 128  # bytes per token of one K or V buffer
SLOT = 2 * 2 * TPB * ROW  # one page of every layer's K and V (two layers)
CHUNK = 48  # SGLang's chunked_prefill_size, per request
TOKEN_BUDGET = 96  # tokens computed per step, all requests together
MAX_RUNNING = 4
SYSTEM = list(range(100, 164))  # a 64-token system prompt every conversation starts with
TURNS, CONVERSATIONS, NEW_TOKENS = 3, 6, 24


def _manager(gpu_pages: int, host_pages: int) -> KVCacheManager:
    kv = [BufferConfig("key", TPB * ROW), BufferConfig("value", TPB * ROW)]
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, backend="cpu", layers=[AttentionLayerConfig(0, kv), AttentionLayerConfig(1, kv)],
        cache_tiers=[GpuCacheTierConfig(gpu_pages * SLOT), HostCacheTierConfig(host_pages * SLOT)]))


@dataclass
class Request:
    """One turn of a conversation: its prompt (the turns before it included) and what it generated."""

    rid: int
    conversation: int
    turn: int
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    cache: KVCache | None = None
    committed_before_retract: int = 0  # what the cache had committed when it was last retracted
    codes: ContextualTokens = field(default_factory=ContextualTokens)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


class RadixCacheOnManager:
    """SGLang's radix-cache calls on the manager (the mapping README's SGLang table gives)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.host_hits = 0  # tokens admitted from host pages (``probe_reuse_by_tier``)

    def match_prefix(self, tokens: list[int]) -> int:
        """SGLang's ``match_prefix`` for its LPM policy: the tokens a request would reuse, GPU and host pages
        alike; ``probe_reuse`` changes nothing (no LRU order, no statistics), so probing every waiting request
        every step is safe."""
        return self.manager.probe_reuse(None, tokens)

    def match_and_lock(self, request: Request) -> bool:
        """``match_prefix`` + ``inc_lock_ref`` + HiCache ``load_back``: a cache holding the matched prefix, its host
        pages brought back and every page locked on the GPU by ``resume``. False (closed again) when the GPU is
        short: the request keeps waiting."""
        tokens = request.tokens[:-1]  # the last known token is computed: its logits sample the next one
        expected = self.match_prefix(tokens)
        # SGLang's device hit and host hit apart: what the load-back will move, to budget it before admitting.
        split = self.manager.probe_reuse_by_tier(None, tokens)
        assert split.tokens == expected and split.gpu_tokens + split.tokens_on(CacheTier.HOST_MEM) == expected
        moved = self.manager.movement_counters
        cache = self.manager.create_kv_cache(input_tokens=tokens)
        assert cache.num_committed_tokens == expected  # the probe is exactly what admission reuses
        if not cache.resume():
            refusal = cache.last_refusal
            assert refusal is not None and refusal.fits_empty_manager, refusal
            cache.close()
            return False
        loaded = self.manager.movement_counters.onboarded_pages - moved.onboarded_pages
        assert loaded == split.onboard_pages[1], (loaded, split)  # the host pages the load-back brought
        self.host_hits += split.tokens_on(CacheTier.HOST_MEM)
        request.cache = cache
        return True

    def cache_unfinished_req(self, request: Request, end: int) -> None:
        """After a prefill chunk (or a decode step): the computed tokens join the tree, reusable at once."""
        assert request.cache is not None
        request.cache.commit(request.tokens[request.cache.num_committed_tokens:end])

    def cache_finished_req(self, request: Request) -> None:
        """``cache_finished_req`` + ``dec_lock_ref``: what it committed stays cached (the partial last page too)."""
        assert request.cache is not None
        request.cache.close()
        request.cache = None

    def evictable_size(self) -> int:
        """Tokens of the GPU's cached pages no request uses (``PoolGroupUsage.reusable``)."""
        return sum(usage.reusable for usage in self.manager.get_usage() if usage.level == 0) * TPB

    def protected_size(self) -> int:
        """Tokens of the GPU pages running (locked) and retracted-but-kept (held) requests use."""
        return sum(usage.used + usage.held for usage in self.manager.get_usage() if usage.level == 0) * TPB

    def flush_cache(self) -> bool:
        """The radix cache's part of ``flush_cache``: False while a cache is open (``clear_reusable_blocks`` would
        raise)."""
        if self.manager.num_live_caches:
            return False
        self.manager.clear_reusable_blocks()
        return True


@dataclass
class Scheduler:
    """SGLang's loop in small: LPM-ordered admission, chunked prefill, decode, retraction when a step is short."""

    manager: KVCacheManager
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    reused: dict[int, int] = field(default_factory=dict)  # per request, tokens its latest admission reused
    retractions: int = 0
    steps: int = 0
    admitted_at: dict[int, int] = field(default_factory=dict)  # per request, the step of its latest admission
    prefilled_at: dict[int, int] = field(default_factory=dict)  # per request, the step its prompt was computed
    admission_order: list[tuple[int, int]] = field(default_factory=list)  # (rid, its probe) as admitted

    def __post_init__(self) -> None:
        self.radix = RadixCacheOnManager(self.manager)
        self.fake = FakeEngine(self.manager)

    def retract(self, victim: Request) -> None:
        """SGLang's ``retract_decode``: free the request and recompute it later; what it committed stays cached."""
        assert victim.cache is not None
        victim.committed_before_retract = victim.cache.num_committed_tokens
        self.radix.cache_finished_req(victim)
        self.running.remove(victim)
        self.waiting.insert(0, victim)
        self.retractions += 1

    def grow(self, request: Request, budget: int) -> int:
        """Room for this step's tokens of a running request (a chunk, or the one token sampled last); retracts the
        newest running request while the step is refused. Returns the capacity to compute to, 0 when this request
        was retracted itself."""
        cache = request.cache
        assert cache is not None
        target = min(cache.history_length + min(CHUNK, budget), len(request.tokens))
        while not cache.resize(target, cache.history_length):
            refusal = cache.last_refusal
            assert refusal is not None and refusal.fits_empty_manager, refusal
            self.retract(self.running[-1])
            if request.cache is None:
                return 0
        return target

    def first_chunk(self, request: Request, budget: int) -> int:
        """Room for a new request's first chunk; as SGLang's prefill adder, admission never retracts a running
        request: refused, the request goes back to waiting (its cache closed). Returns the capacity, 0 if refused."""
        cache = request.cache
        assert cache is not None
        target = min(cache.history_length + min(CHUNK, budget), len(request.tokens))
        if cache.resize(target, cache.history_length):
            return target
        refusal = cache.last_refusal
        assert refusal is not None and refusal.fits_empty_manager, refusal
        self.radix.cache_finished_req(request)
        return 0

    def compute(self, request: Request, target: int) -> None:
        """The forward pass over ``[history_length, target)``; the sample when it reached the last known token."""
        assert request.cache is not None
        self.fake.step(request.cache, request.codes.of(request.tokens))
        self.radix.cache_unfinished_req(request, target)
        if target >= len(request.prompt):
            self.prefilled_at.setdefault(request.rid, self.steps)
        if target == len(request.tokens):
            request.generated.append(1000 + request.rid * 50 + len(request.generated))
            if len(request.generated) == NEW_TOKENS:
                self.radix.cache_finished_req(request)
                self.running.remove(request)
                self.finished.append(request)

    def flush_cache(self) -> bool:
        """SGLang's ``flush_cache``: only when no request runs or waits (a waiting one holds no cache, so the
        manager cannot see it)."""
        return not (self.waiting or self.running) and self.radix.flush_cache()

    def step(self) -> None:
        """Running requests first (a refused step retracts the newest), then, unless that retracted one, new
        requests in LPM order."""
        budget, retracted = TOKEN_BUDGET, self.retractions
        self.steps += 1
        for request in list(self.running):  # running first, oldest first: a refusal retracts the newest
            if request.cache is None or budget <= 0:
                continue
            target = self.grow(request, budget)
            if target:
                budget -= target - request.cache.history_length
                self.compute(request, target)
        # LPM: every waiting request probed, longest match first (stable: first come first among equals).
        matched = {request.rid: self.radix.match_prefix(request.tokens[:-1]) for request in self.waiting}
        self.waiting.sort(key=lambda request: -matched[request.rid])
        while self.waiting and len(self.running) < MAX_RUNNING and budget > 0 and self.retractions == retracted:
            request = self.waiting[0]
            if not self.radix.match_and_lock(request):
                break
            assert request.cache is not None
            reused = request.cache.num_committed_tokens
            target = self.first_chunk(request, budget)
            if not target:
                break
            self.reused[request.rid] = reused
            self.waiting.pop(0)
            self.running.append(request)
            self.admission_order.append((request.rid, matched[request.rid]))
            self.admitted_at[request.rid] = self.steps
            budget -= target - request.cache.history_length
            self.compute(request, target)


def _user_message(conversation: int, turn: int) -> list[int]:
    return [5000 + 100 * conversation + turn] * (20 + 7 * ((conversation + turn) % 3))


def _serve() -> tuple[KVCacheManager, Scheduler, dict[int, Request]]:
    manager = _manager(gpu_pages=16, host_pages=400)  # four requests of up to 14 pages each: retractions
    scheduler = Scheduler(manager)
    first = [Request(c, c, 0, SYSTEM + _user_message(c, 0)) for c in range(CONVERSATIONS)]
    scheduler.waiting.extend(first)
    previous: dict[int, Request] = {}  # per follow-up request, the turn it continues
    next_rid, followed = CONVERSATIONS, 0
    while scheduler.waiting or scheduler.running:
        scheduler.step()
        for request in scheduler.finished[followed:]:  # a conversation's next turn arrives once this one ended
            if request.turn + 1 < TURNS:
                follow = Request(next_rid, request.conversation, request.turn + 1,
                                 request.tokens + _user_message(request.conversation, request.turn + 1))
                previous[next_rid] = request
                scheduler.waiting.append(follow)
                next_rid += 1
        followed = len(scheduler.finished)
        if scheduler.waiting or scheduler.running:
            assert not scheduler.flush_cache()  # refused until idle, as SGLang's
    return manager, scheduler, previous


def test_an_sglang_style_scheduler_serves_multi_turn_chats() -> None:
    manager, scheduler, previous = _serve()
    try:
        assert len(scheduler.finished) == CONVERSATIONS * TURNS
        assert all(len(request.generated) == NEW_TOKENS for request in scheduler.finished)
        moved = manager.movement_counters
        # The host tier kept every evicted page (none dropped), so the rules below are exact.
        assert moved.dropped_pages == 0 and moved.offloaded_pages > 0
        assert moved.onboarded_pages > 0  # HiCache's load_back: resume brought host pages back
        assert scheduler.radix.host_hits > 0  # and the probe said so before admitting (``probe_reuse_by_tier``)
        assert scheduler.retractions > 0
        assert any(request.committed_before_retract for request in scheduler.finished)
        for rid, turn_before in previous.items():
            # A follow-up reuses every token the turn before computed: all but the last one it sampled.
            assert scheduler.reused[rid] >= len(turn_before.tokens) - 1, (rid, scheduler.reused[rid])
        for request in scheduler.finished:
            assert scheduler.reused[request.rid] >= request.committed_before_retract  # a retracted one recomputes less
        first = scheduler.admission_order[0][0]
        for request in scheduler.finished:
            if request.turn == 0 and request.rid != first:  # the shared system prompt, or its first chunk
                computed = scheduler.admitted_at[request.rid] > scheduler.prefilled_at[first]
                assert scheduler.reused[request.rid] >= (len(SYSTEM) if computed else CHUNK), request.rid
        assert scheduler.fake.tokens_checked > 0 and manager.num_live_caches == 0
        assert scheduler.radix.evictable_size() > 0
        assert scheduler.flush_cache()
        assert scheduler.radix.evictable_size() == 0 and scheduler.radix.protected_size() == 0
        assert all(usage.reusable == 0 for usage in manager.get_usage())  # the host tier's pages went too
        assert manager.probe_reuse(None, scheduler.finished[-1].tokens) == 0
    finally:
        manager.shutdown()


def test_lpm_admits_the_longest_match_first() -> None:
    """Two requests wait: the later one continues a cached conversation; LPM admits it first."""
    manager = _manager(gpu_pages=30, host_pages=40)
    try:
        scheduler = Scheduler(manager)
        cold = Request(0, 0, 0, [9] * 40)
        warm_prompt = SYSTEM + _user_message(1, 0)
        cache = manager.create_kv_cache(input_tokens=warm_prompt)
        assert cache.resume() and cache.resize(len(warm_prompt))
        scheduler.fake.step(cache, ContextualTokens().of(warm_prompt))
        cache.commit(warm_prompt)
        cache.close()
        warm = Request(1, 1, 1, warm_prompt + _user_message(1, 1))
        scheduler.waiting.extend([cold, warm])
        while scheduler.waiting or scheduler.running:
            scheduler.step()
        assert scheduler.admission_order == [(1, len(warm_prompt)), (0, 0)]
    finally:
        manager.shutdown()


def _pressure(manager: KVCacheManager, probe: list[list[int]] | None) -> list[object]:
    """Cache five prompts in a GPU tier of eight pages and a host tier of four, so eviction must choose; with
    ``probe``, those tokens are probed before each prompt is served, as LPM probes a waiting request. Returns what
    the manager shows afterwards: what each prompt would reuse, the usage, page movements, statistics and events."""
    prompts = [[10 + i] * (3 * TPB) for i in range(5)]
    engine = FakeEngine(manager)
    for prompt in prompts:
        for tokens in probe or []:
            manager.probe_reuse(None, tokens)
        cache = manager.create_kv_cache(input_tokens=prompt)
        assert cache.resume() and cache.resize(len(prompt))
        engine.step(cache, prompt)
        cache.commit(prompt)
        cache.close()
    return [[manager.probe_reuse(None, prompt) for prompt in prompts], manager.get_usage(),
            manager.movement_counters, manager.get_and_reset_iteration_stats(),
            [(event.kind, event.block_hash, event.level) for event in manager.get_latest_events()]]


def test_lpm_probes_of_every_waiting_request_change_nothing() -> None:
    """SGLang's LPM policy probes every waiting request every step: a probe must not refresh a prefix's place in
    the eviction order, nor count as reuse, nor emit events, or the probing itself would decide what is evicted."""
    seen: list[list[object]] = []
    for probing in (False, True):
        manager = KVCacheManager(KVCacheManagerConfig(
            tokens_per_block=TPB, backend="cpu", enable_kv_events=True,
            layers=[AttentionLayerConfig(0, [BufferConfig("key", TPB * ROW), BufferConfig("value", TPB * ROW)])],
            cache_tiers=[GpuCacheTierConfig(8 * 2 * TPB * ROW), HostCacheTierConfig(4 * 2 * TPB * ROW)]))
        try:
            seen.append(_pressure(manager, [[10] * (3 * TPB)] if probing else None))  # a request waits on the oldest
        finally:
            manager.shutdown()
    assert seen[0] == seen[1]
    reuse = seen[0][0]
    assert isinstance(reuse, list) and reuse[0] == 0  # the first prompt was dropped: eviction did choose


def test_flush_cache_while_requests_run_says_what_to_do() -> None:
    """``clear_reusable_blocks`` (SGLang's ``flush_cache``) with a request open raises naming how many are open and
    how to proceed, and changes nothing."""
    manager = _manager(gpu_pages=30, host_pages=40)
    try:
        done = manager.create_kv_cache(input_tokens=SYSTEM)
        assert done.resume() and done.resize(len(SYSTEM))
        FakeEngine(manager).step(done, SYSTEM)
        done.commit(SYSTEM)
        done.close()
        running = manager.create_kv_cache(input_tokens=SYSTEM + [1])
        with pytest.raises(RuntimeError, match=r"1 KV cache\(s\) still open: close them"):
            manager.clear_reusable_blocks()
        assert manager.probe_reuse(None, SYSTEM) == len(SYSTEM)
        running.close()
        manager.clear_reusable_blocks()
        assert manager.probe_reuse(None, SYSTEM) == 0
    finally:
        manager.shutdown()
