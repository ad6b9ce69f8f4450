"""``KVCacheManager``, the engine-facing entry point, and ``KVCache``, the handle it gives out for each request.

The two refer to each other, so they live here together; their bodies are below them (``ManagerCore`` and the
method layers stacked on it, ``CacheHandle`` in ``_cache``)."""

from __future__ import annotations

from typing import Sequence, SupportsIndex, final

from .._cache.batch import KVCacheRequest, check_lookup_flags, create_batch
from .._base.hashing import (
    ReuseScope, Token, TokenSequence, check_scope, check_text_only, check_tokens, gen_multimodal_cache_key_tokens,
)
from .._cache.handle import CacheHandle
from .._cache.kv_cache import CacheState
from .planned_drop import PlannedDropHandle, plan_committed_block_drop
from .._cache.kv_cache import open_cache
from .._pages.priority import PriorityCallback
from .._pages.reuse_split import ReuseByTier, split_by_tier
from .._observe.stats_delta import KVCacheStatsDelta
from .._cache.refusal import Refusal
from .._base.types import CacheTier, CudaStream
from ..config import KVCacheManagerConfig
from .._base.validation import as_int, as_list, as_non_negative_int, as_optional_int, as_positions, as_stream_handle
from .quotas import ManagerQuotas
from .core import internals_of


@final
class KVCacheManager(ManagerQuotas):
    """Owns every pool of every tier, creates the per-request caches and answers the kernels' addressing
    questions: where a (layer, role) buffer's pages start and how to turn a cache's page table into page indices.

    Threads: one scheduler thread makes every call that changes state; no locks are taken. One other thread may
    call ``get_latest_events``, ``get_iteration_stats`` (each hands over what was recorded since its previous
    call, nothing lost or repeated), ``get_storage_statistics``, ``movement_counters`` and ``num_live_caches``
    beside it; ``get_usage`` there raises ``RuntimeError`` (it sums counts a call may be changing).

    Re-entrancy: no manager code runs inside another manager call. A call that changes state, made from a
    callback (priority callback, event-manager hook) while another is in flight, raises ``RuntimeError`` naming
    both and changes nothing; a ``KVCache`` dropped without ``close()`` is closed at the entry of the next such
    call (or by ``num_live_caches``, ``get_storage_statistics``, ``get_usage``, ``need_adjustment`` and ``shutdown``
    on the scheduler thread: the thread of the last call). The reads the other thread may make are not guarded, close nothing and see a dropped cache as
    open until then. Like its caches, a manager is a handle, not a value: copy, deepcopy and pickle raise
    ``TypeError``.

    ``cold_page_codec`` (a ``ColdPageCodec``): every tier after the first stores pages encoded by it, grouped by
    encoded size (a GPU tier after the first needs one); offload / onboard statistics then count encoded bytes.
    """

    def create_kv_cache(
        self,
        reuse_scope: ReuseScope | None = None,
        input_tokens: TokenSequence | None = None,
        id: SupportsIndex | None = None,
        custom_priority_callback: PriorityCallback | None = None,
        expected_prompt_length: SupportsIndex | None = None,
        text_only: bool | None = None,
        enable_request_stats: bool = False,
        snapshot_at: Sequence[SupportsIndex] = (),
        *,
        preempted: bool = False,
        lookup: bool = True,
    ) -> KVCache:
        """A suspended cache holding the longest reusable prefix of ``input_tokens`` within ``reuse_scope``.

        Its three lengths equal the reused length; ``resume`` it before use. An engine that needs the logits of the
        last prompt token passes the prompt without it. ``expected_prompt_length`` is accepted as a hint and unused.
        ``text_only`` (default: the config's): the cache refuses multimodal (``bytes``) tokens.
        ``enable_request_stats``: count this request's blocks for ``KVCache.commit_pending_stats``.
        ``snapshot_at``: token positions (e.g. the end of a shared system prompt) where SSM states are snapshotted
        for later requests to reuse; each is snapped down to its block boundary, and the snapshot is taken when a
        commit ends a computed chunk there (end a prefill chunk at ``KVCache.snapshot_points``). Positions past
        ``input_tokens`` are kept, since the engine computes past its input; one never reached takes no snapshot.
        With SWA scratch reuse they are also where a chunk must end for the window before them to keep its pages.
        ``preempted``: the request ran before and was preempted by closing its cache (recompute); its lookup counts
        in the iteration statistics' preempted fields (``iter_preempted_reused_blocks``, ...), not as a new
        request's, as vLLM's ``PrefixCacheStats`` keeps ``preempted_hits`` apart.
        ``lookup``: False for a cache that stores rows the engine already has (a KV connector's save): no request
        asks for reuse, so no lookup is counted (iteration, SSM snapshot and request statistics); the cache still
        reuses what is cached. ``preempted=True`` needs ``lookup=True`` (``ValueError``).
        """
        self._check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.create_kv_cache")
        try:
            scope = self._check_scope(reuse_scope)
            tokens = [] if input_tokens is None else check_tokens(input_tokens, "input_tokens")
            if text_only is not None and not isinstance(text_only, bool):
                raise TypeError(f"text_only must be a bool or None, got {text_only!r}")
            if not isinstance(enable_request_stats, bool):
                raise TypeError(f"enable_request_stats must be a bool, got {enable_request_stats!r}")
            check_lookup_flags(preempted, lookup, "")
            only_text = self._config.text_only if text_only is None else text_only
            if only_text:
                check_text_only(tokens, "input_tokens")
            snapshot_points = as_positions(snapshot_at, "snapshot_at")
            if expected_prompt_length is not None:
                as_non_negative_int(expected_prompt_length, "expected_prompt_length")
            if custom_priority_callback is not None and not callable(custom_priority_callback):
                raise TypeError(f"custom_priority_callback must be callable, got {custom_priority_callback!r}")
            services = self._services
            if id is None:
                cache_id = self._caches.free_id()
            else:
                cache_id = as_int(id, "id")
                if cache_id in self._caches.live:
                    raise ValueError(f"id {cache_id} is already used by a live cache")
            state = open_cache(services, self._caches, scope, tokens, cache_id, custom_priority_callback)
            state.declare_snapshots(snapshot_points)
            if enable_request_stats:
                state.request_stats = KVCacheStatsDelta()
            state.count_reuse(preempted=preempted, lookup=lookup)
            services.after_call()
            return KVCache(self, state, only_text)
        finally:
            guard.leave()

    def create_kv_cache_batch(
        self, requests: Sequence[KVCacheRequest], cuda_stream: SupportsIndex | None = None
    ) -> list[KVCache | None]:
        """Admit a batch with a two-phase claim (every request's matched pages are pinned before any request
        allocates, so one request cannot evict what another matched): admitted caches come back ACTIVE with at
        least their capacity; a request that does not fit gets None and leaves no trace (earlier ones stay
        admitted) but its reason, in ``last_batch_refusals`` (one entry per request). Later requests are still
        tried, so a smaller one may be admitted after a refused one: an engine that admits in order only closes
        those (or suspends them, they are active) itself. Each request's ``max_util_for_resume`` (and watermark) counts what its own create + resume would
        then: pages running caches lock, the earlier admitted requests' included, not pages later requests matched. With only full-attention layers a later request may share the blocks an earlier one of the batch
        computes in this step (step them in batch order): its history starts after them, its
        ``num_committed_tokens`` does not, so commit from there. Until that earlier request's step wrote them, do not
        resize it below them, suspend or close it (the later one would read rows nothing wrote, and no check can
        see whether a step ran): cut the later request's chunk, or close it first; ask the step's token budget as
        ``num_new_tokens`` rather than cutting a chunk after admission."""
        self._check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.create_kv_cache_batch")
        try:
            stream = CudaStream(0 if cuda_stream is None else as_stream_handle(cuda_stream, "cuda_stream"))
            admitted = create_batch(
                self._services, self._caches, as_list(requests, "requests"), stream, self._config.text_only
            )
            self._services.after_call()
            return [None if state is None else KVCache(self, state, self._config.text_only) for state in admitted]
        finally:
            guard.leave()

    @property
    def last_refusal(self) -> Refusal | None:
        """Why the latest soft refusal of this manager's calls (``KVCache.resize``/``resume`` or the quota calls
        ``resize``/``adjust`` answering False, a batch request answered None, or ``can_fit``/``can_fit_in_chunks``
        answering False) happened; None before any. Kept until the next refusal."""
        return self._services.last_refusal

    @property
    def last_batch_refusals(self) -> tuple[Refusal | None, ...]:
        """One entry per request of the latest ``create_kv_cache_batch``: None where admitted, else its reason."""
        return self._services.last_batch_refusals

    @property
    def init_config(self) -> KVCacheManagerConfig:
        """TensorRT-LLM's name for ``config``: the validated copy this manager was built from."""
        return self._config

    @property
    def cache_tier_list(self) -> list[CacheTier]:
        """The kind of memory of each cache level, level 0 (the GPU) first (a remote tier is no level)."""
        return [tier.tier for tier in self._tiers]

    @property
    def commit_min_snapshot(self) -> bool:
        """Whether SSM states are also snapshotted where each commit ends (``commit_min_snapshot`` or its other
        name, ``mamba_save_last_snapshot``)."""
        return self._config.last_snapshot

    @property
    def enable_partial_match(self) -> bool:
        """Whether a match may end inside a block (``enable_partial_reuse`` as resolved for this model; TensorRT-LLM's
        name, which its inspection calls take as their last argument)."""
        return self._services.settings.partial_reuse

    def probe_reuse(self, reuse_scope: ReuseScope | None = None, input_tokens: TokenSequence | None = None) -> int:
        """How many leading tokens ``create_kv_cache`` would reuse right now; changes nothing."""
        self._check_alive()
        guard = self._guard
        guard.enter_read("KVCacheManager.probe_reuse")
        try:
            scope = self._check_scope(reuse_scope)
            if input_tokens is None:
                return 0
            return self._services.matcher.match(scope, check_tokens(input_tokens, "input_tokens")).length
        finally:
            guard.leave()

    def probe_reuse_by_tier(
        self, reuse_scope: ReuseScope | None = None, input_tokens: TokenSequence | None = None
    ) -> ReuseByTier:
        """``probe_reuse`` split by where the pages are (SGLang's device hit and host hit): per cache level the
        tokens, and the pages ``create_kv_cache`` + ``resume`` would onboard or copy from there; changes nothing."""
        self._check_alive()
        guard = self._guard
        guard.enter_read("KVCacheManager.probe_reuse_by_tier")
        try:
            scope = self._check_scope(reuse_scope)
            services = self._services
            tiers = tuple(tier.tier for tier in self._tiers)
            if input_tokens is None:
                nothing = (0,) * len(tiers)
                return ReuseByTier(0, tiers, nothing, nothing, nothing)
            match = services.matcher.match(scope, check_tokens(input_tokens, "input_tokens"))
            return split_by_tier(match, services.life_cycles, services.tokens_per_block, tiers)
        finally:
            guard.leave()

    def prefetch_remote(self, reuse_scope: ReuseScope | None = None, input_tokens: TokenSequence | None = None) -> int:
        """Fetch now, for a request that waits for admission, what ``create_kv_cache`` would fetch from the shared
        remote tier: the blocks of ``input_tokens`` beyond the local prefix cache, into the coldest local tier as
        cached blocks (pinned while the fill evicts for their slots, as every fill). Admission then finds them
        locally instead of waiting on the store; ``KVCache.prefetch`` moves them on toward the GPU once the cache
        exists. Returns the tokens of the longest prefix now held locally (what ``probe_reuse`` answers); without a
        remote tier, or while the store is backed off, it only probes. Until a cache holds them the blocks are
        reusable like any other (eviction may drop them again)."""
        self._check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.prefetch_remote")
        try:
            scope = self._check_scope(reuse_scope)
            if input_tokens is None:
                return 0
            tokens = check_tokens(input_tokens, "input_tokens")
            services = self._services
            length = services.match_fetching_remote(scope, tokens).length
            services.after_call()
            return length
        finally:
            guard.leave()

    def mark_stats_excluded(self, kv_cache_id: SupportsIndex | None) -> None:
        """Keep the cache with this id out of what ``need_adjustment`` / ``adjust`` observe (warm-up or padding
        requests sized at the longest context would skew the split) until it closes; None does nothing."""
        self._check_alive()
        cache_id = as_optional_int(kv_cache_id, "kv_cache_id")
        with self._guard.entering("KVCacheManager.mark_stats_excluded"):
            if cache_id is not None:
                self._caches.stats_excluded.add(cache_id)

    def clear_stats_excluded(self, kv_cache_id: SupportsIndex | None) -> None:
        """Undo ``mark_stats_excluded``; None, or an id never marked, does nothing."""
        self._check_alive()
        cache_id = as_optional_int(kv_cache_id, "kv_cache_id")
        with self._guard.entering("KVCacheManager.clear_stats_excluded"):
            if cache_id is not None:
                self._caches.stats_excluded.discard(cache_id)

    def is_stats_excluded(self, kv_cache_id: SupportsIndex | None) -> bool:
        """Whether ``mark_stats_excluded`` marks this id now (False for None)."""
        cache_id = as_optional_int(kv_cache_id, "kv_cache_id")
        return cache_id is not None and cache_id in self._caches.stats_excluded

    def clear_reusable_blocks(self) -> None:
        """Drop every cached page (the reusable content of the radix tree); every cache must be closed, else
        ``RuntimeError`` naming how many are open."""
        self._check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.clear_reusable_blocks")
        try:
            self._check_all_closed("clear_reusable_blocks")
            self._drop_all_cached()
            self._store.flush()
            self._services.after_call()
        finally:
            guard.leave()

    def gen_multimodal_cache_key_tokens(
        self,
        multi_modal_data_digest: bytes,
        num_tokens: SupportsIndex,
        id_offset: SupportsIndex | None = None,
        token_offset: SupportsIndex = 0,
        uuid: str | None = None,
    ) -> list[Token]:
        """Multimodal stand-in tokens (the module function's); ``id_offset`` defaults to ``config.vocab_size``."""
        if id_offset is None:
            if self._config.vocab_size is None:
                raise ValueError("id_offset is required when KVCacheManagerConfig.vocab_size is not set")
            offset = self._config.vocab_size
        else:
            offset = as_int(id_offset, "id_offset")
        return gen_multimodal_cache_key_tokens(
            offset, multi_modal_data_digest, as_int(num_tokens, "num_tokens"), as_int(token_offset, "token_offset"), uuid
        )

    @staticmethod
    def _check_scope(scope: object) -> ReuseScope | None:
        checked = check_scope(scope)
        if checked is not None and type(checked) is not ReuseScope:  # a subclass's methods would run inside the call
            return ReuseScope(checked.lora_id, checked.salt)
        return checked


@final
class KVCache(CacheHandle):
    """One request's KV cache, made by ``KVCacheManager.create_kv_cache``: its blocks' pages in every layer group.

    It starts SUSPENDED; ``resume`` locks its pages on the GPU, ``resize`` sets how many tokens it can hold
    (``capacity``) and how many of them are history, ``commit`` makes finished tokens reusable by later requests,
    ``suspend`` lets its pages move to colder tiers, ``close`` ends it (dropping the last reference does too, at
    the manager's next call). Lengths always satisfy ``num_committed_tokens <= history_length <= capacity``.

    Re-entrancy: a method that changes the cache (or reads its pending statistics) raises ``RuntimeError``,
    changing nothing, while another call of the same manager is in flight (from a priority callback or an
    event-manager hook). It cannot be copied or pickled (``TypeError``).
    """

    def __init__(self, manager: KVCacheManager, state: CacheState, text_only: bool) -> None:
        super().__init__(state, internals_of(manager).guard, manager.tokens_per_block, text_only)
        self._manager = manager

    @property
    def manager(self) -> KVCacheManager:
        """The manager that made this cache."""
        return self._manager

    # _HOT_PATH_NOTE: an engine calls ``resize`` and ``commit`` and reads ``capacity``/``history_length`` once per
    # cache per decode step, so they live on the public class itself (below), and the two calls inline the guard's
    # common case (nothing dropped, no hold, the guard's entry popped: two reads, one pop and one write), calling
    # ``_changing`` only otherwise. CPython specialises a call to a compiled method only when
    # the receiver's type is exactly the class defining it: inherited from ``CacheHandle``, every engine call took
    # the generic path (~20 ns more), and a forwarding override still paid a second native call (~20 instructions);
    # an inherited property is type-checked against its class through the MRO (~16 instructions per read).
    @property
    def capacity(self) -> int:
        """Tokens the cache has pages for; setting it is ``resize(value)``, raising ``OutOfPagesError`` when short."""
        return self._state.capacity

    @capacity.setter
    def capacity(self, value: SupportsIndex) -> None:
        with self._changing("KVCache.capacity"):
            setattr(self._state, "capacity", value)  # see _SETTER_NOTE

    @property
    def history_length(self) -> int:
        """Tokens before this step's input (``capacity - history_length`` are this step's); setting it is
        ``resize(capacity, value)``. Read it before each step: it goes back when an earlier request of the same
        batch that was to compute rows this cache shares is cut, suspended or closed before computing them (the
        README's batch admission section)."""
        guard = self._guard
        if guard.dropped:  # a dropped donor's close may recall rows from this history: closed first
            guard.settle()
        return self._state.history_length

    @history_length.setter
    def history_length(self, value: SupportsIndex) -> None:
        with self._changing("KVCache.history_length"):
            setattr(self._state, "history_length", value)  # see _SETTER_NOTE

    def resize(self, capacity: SupportsIndex, history_length: SupportsIndex | None = None) -> bool:
        """Set capacity and (optionally) history in one step; False, changing nothing, when memory is short:
        ``last_refusal`` then says which pool group was short, by how many pages, and whether waiting can help.
        A smaller capacity gives pages back: a chunk admitted past the prompt's end, or rejected draft tokens."""
        guard = self._guard
        if guard.dropped or self._holds:  # see _HOT_PATH_NOTE
            self._changing("KVCache.resize")
        else:
            try:
                guard.idle.pop()  # CallGuard.enter's test-and-mark
            except IndexError:
                self._changing("KVCache.resize")  # refused (or the call in flight just ended: then it enters)
            guard.current = "KVCache.resize"
        try:
            return self._state.resize(capacity, history_length)
        finally:
            guard.current = ""
            guard.idle.append(None)
            if guard.warnings or guard.interrupt is not None:  # see DeferredInterrupts
                guard.deliver()

    def commit(
        self,
        accepted_input_tokens: TokenSequence,
        beam_search_indices: Sequence[SupportsIndex] | None = None,
        is_end: bool = False,
        save_ssm_snapshot: bool = False,
    ) -> None:
        """Append finalised tokens; each newly completed block joins the radix tree (or is rebased onto an
        identical one), then the history bump releases stale pages. ``is_end``: these are the last tokens
        (``stop_committing`` follows). ``beam_search_indices``: beam width is 1, so only beam 0.
        ``save_ssm_snapshot``: also snapshot the SSM states where these tokens end, inside a block too (the
        committed tokens must then reach ``capacity``, the tokens the live state holds)."""
        guard = self._guard
        if guard.dropped or self._holds:  # see _HOT_PATH_NOTE
            self._changing("KVCache.commit")
        else:
            try:
                guard.idle.pop()  # CallGuard.enter's test-and-mark
            except IndexError:
                self._changing("KVCache.commit")  # refused (or the call in flight just ended: then it enters)
            guard.current = "KVCache.commit"
        try:
            tokens = accepted_input_tokens
            if self._text_only:
                if type(tokens) is not list:  # checked once: the state commits this list, not the argument again
                    tokens = check_tokens(tokens, "accepted_input_tokens")
                check_text_only(tokens, "accepted_input_tokens")
            self._state.commit(tokens, beam_search_indices, is_end, save_ssm_snapshot)
        finally:
            guard.current = ""
            guard.idle.append(None)
            if guard.warnings or guard.interrupt is not None:  # see DeferredInterrupts
                guard.deliver()

    def plan_committed_block_drop(self) -> PlannedDropHandle | None:
        """After ``stop_committing``: a handle whose ``drop`` evicts the committed blocks inside each sliding window
        at the end of this turn and the SSM snapshot there (full-attention, sink blocks and earlier snapshots stay);
        None if there is nothing to plan."""
        with self._guard.entering("KVCache.plan_committed_block_drop"):
            return plan_committed_block_drop(self._state, self.manager)


# TensorRT-LLM's name for the cache class.
_KVCache = KVCache
