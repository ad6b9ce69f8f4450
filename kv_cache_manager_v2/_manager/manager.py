"""``KVCacheManager``: the engine-facing entry point; builds and owns the storage tiers, layout, page store and
radix tree, and answers the addressing, statistics, quota and event questions."""

from __future__ import annotations

import os
from typing import Final, Iterable, Sequence, SupportsIndex, cast

from .._model.addressing import PageIndexConverter
from .._model.aggregated_pages import AggregatedPageDesc, aggregate, all_buffer_ids
from .._cache.batch import KVCacheRequest, create_batch
from .._cache.call_guard import CallGuard
from .._observe.event_manager import EventBridge, KVCacheEventManager, layer_group_kind
from .._observe.events import EventLog, IterationStats, KVEvent
from .._cache.invariants import check_invariants
from .._base.hashing import ReuseScope, Token, TokenSequence, check_tokens, gen_multimodal_cache_key_tokens
from .._cache.handle import KVCache
from .._cache.kv_cache import MAX_BLOCKS_PER_CACHE, open_cache
from .._model.layout import BufferPlacement, StorageLayout
from .._model.life_cycle import LifeCycleRegistry
from .._storage.memory import MemoryBackend, choose_backend, rows_view
from .._pages.page_store import MovementCounters, PageStore
from .._base.page_view import PageView
from .._model.planning import DEFAULT_TYPICAL_STEP, QuotaPlanner, closest_quota, departs
from .._pages.radix_tree import RadixTree
from .._pages.priority import PriorityCallback
from .._cache.services import CacheServices, CacheSettings
from .._remote.tier import RemoteTier, RemoteTierStatistics
from .._observe.ssm_snapshot_stats import SsmSnapshotIterationStatsDelta
from .._observe.stats_delta import KVCacheIterationStatsDelta, KVCacheStatsDelta, iteration_delta
from .._model.admission_limits import largest_request, request_fits, warn_if_declared_request_cannot_fit
from .._cache.refusal import Refusal
from .._pages.usage import PoolGroupUsage, usage_of
from .._storage.slots import StorageStatistics, TierStorage, build_tier
from .._base.types import GPU_LEVEL, BufferId, CacheLevel, CudaStream, LayerGroupId, LayerId, MemAddress, PageIndexMode
from .._base.validation import as_index, as_int, as_non_negative_int
from ..config import AttentionLayerConfig, DiskCacheTierConfig, KVCacheManagerConfig


# Set to 1 to run the full invariant check after every public call that changes state (slow; for debugging).
DEBUG_ENV: Final = "KV_CACHE_MANAGER_V2_DEBUG"


class KVCacheManager:
    """Owns every pool of every tier, creates the per-request caches and answers the kernels' addressing
    questions: where a (layer, role) buffer's pages start and how to turn a cache's page table into page indices.

    Threads: one scheduler thread makes every call that changes state; no locks are taken. One other thread may
    call ``get_latest_events``, ``get_iteration_stats`` (each hands over what was recorded since its previous
    call, nothing lost or repeated), ``get_storage_statistics`` and ``movement_counters`` beside it.

    Re-entrancy: no manager code runs inside another manager call. A call that changes state, made from a
    callback (priority callback, event-manager hook) while another is in flight, raises ``RuntimeError`` naming
    both and changes nothing; a ``KVCache`` dropped without ``close()`` is closed at the entry of the next such
    call (or by ``num_live_caches``, ``need_adjustment`` and ``shutdown``). The reads the other thread may make
    are not guarded and see a dropped cache as open until then.
    """

    def __init__(self, config: KVCacheManagerConfig, event_manager: KVCacheEventManager | None = None) -> None:
        if not isinstance(config, KVCacheManagerConfig):
            raise TypeError(f"config must be a KVCacheManagerConfig, got {config!r}")
        if event_manager is not None and not isinstance(event_manager, KVCacheEventManager):
            raise TypeError(f"event_manager must be a KVCacheEventManager or None, got {event_manager!r}")
        # Checked again as a whole (fields may have been changed since it was built) and copied: later changes to
        # the caller's config cannot reach this manager.
        config = config.validated()
        self._config = config
        self.tokens_per_block: int = config.tokens_per_block
        self._registry = LifeCycleRegistry(config.layers, config.tokens_per_block)
        self._layout = StorageLayout(config.layers, self._registry, config.tokens_per_block)
        if config.initial_pool_ratio is not None and len(config.initial_pool_ratio) != len(self._registry):
            raise ValueError(
                f"KVCacheManagerConfig.initial_pool_ratio length must match the number of layer groups "
                f"({len(self._registry)}), got {len(config.initial_pool_ratio)} weights"
            )
        self._backend: MemoryBackend = choose_backend(config.backend)
        self._planner = QuotaPlanner(
            self._registry,
            self._layout,
            config.enable_swa_scratch_reuse,
            config.max_rewind_len,
            config.typical_step if config.typical_step is not None else DEFAULT_TYPICAL_STEP,
            config.constraints,
            config.max_util_for_resume,
            config.initial_pool_ratio,
        )
        self._tiers: list[TierStorage] = []
        try:
            for level, tier_config in enumerate(config.local_tiers):
                counts = self._planner.split_within(
                    tier_config.quota, self._planner.demand, self._planner.floors if level == 0 else None
                )
                for group, count in zip(self._layout.pool_groups, counts):
                    if count == 0 and level == 0 and self._needs_slots(group.index):
                        raise ValueError(
                            f"GpuCacheTierConfig.quota {tier_config.quota} leaves pool group {group.index} "
                            f"(slots of {group.slot_bytes} bytes) without a single slot"
                        )
                directory = tier_config.path if isinstance(tier_config, DiskCacheTierConfig) else None
                self._tiers.append(
                    build_tier(
                        self._backend,
                        CacheLevel(level),
                        tier_config.tier,
                        tier_config.quota,
                        tier_config.max_quota,
                        directory,
                        self._layout.pool_groups,
                        counts,
                    )
                )
        except BaseException:
            for tier in self._tiers:
                tier.close()
            raise
        if config.typical_step is not None:
            warn_if_declared_request_cannot_fit(self._planner, self._gpu_slot_counts(), config.typical_step)
        self._is_shut_down = False
        self._guard = CallGuard()
        self._event_manager = event_manager
        bridge: EventBridge | None = None
        if event_manager is not None:
            bridge = EventBridge(event_manager, [tier_config.tier for tier_config in config.local_tiers])
            life_cycles = self._registry.life_cycles
            event_manager.set_layer_group_window_sizes({lc.id: lc.window_size or 0 for lc in life_cycles})
            event_manager.set_layer_group_kinds({lc.id: layer_group_kind(lc) for lc in life_cycles})
            event_manager.add_created_event([sum(group.num_slots for group in tier.groups) for tier in self._tiers])
        self._events = EventLog(config.enable_kv_events, config.max_kv_events, None if bridge is None else bridge.record)
        self._tree = RadixTree(
            config.tokens_per_block,
            len(self._registry),
            self._events,
            config.partial_reuse_enabled,
            spare_blocks=max(group.num_slots for group in self._tiers[0].groups),
        )
        self._store = PageStore(self._tiers, self._tree, len(self._registry), self._events, self._backend.stream_order())
        settings = CacheSettings(
            config.tokens_per_block,
            config.partial_reuse_enabled,
            config.max_util_for_resume,
            config.enable_swa_scratch_reuse,
            config.max_rewind_len,
            config.ssm_reuse_interval,
            config.last_snapshot,
        )
        self._services = CacheServices(self._store, self._tree, self._registry.life_cycles, self._layout, settings)
        self._services.matcher.match_backoff = config.reuse_match_backoff
        self._remote: RemoteTier | None = None
        remote = config.remote_tier
        if remote is not None:
            try:
                client = remote.backend.open(remote.quota)
            except BaseException:
                for tier in self._tiers:
                    tier.close()
                raise
            self._remote = RemoteTier(
                client, remote, config.layers, self._registry.life_cycles, self._layout, config.tokens_per_block,
                self._store, self._tree,
            )
            self._store.remote = self._remote
            self._tree.attach_listener = self._remote.committed
            self._services.remote = self._remote
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            self._services.invariant_checker = check_invariants

    # ---------------------------------------------------------------------------------------------- requests
    def create_kv_cache(
        self,
        reuse_scope: ReuseScope | None = None,
        input_tokens: TokenSequence | None = None,
        id: SupportsIndex | None = None,
        custom_priority_callback: PriorityCallback | None = None,
        expected_prompt_length: SupportsIndex | None = None,
        text_only: bool | None = None,
        enable_request_stats: bool = False,
    ) -> KVCache:
        """A suspended cache holding the longest reusable prefix of ``input_tokens`` within ``reuse_scope``.

        Its three lengths equal the reused length; ``resume`` it before use. An engine that needs the logits of the
        last prompt token passes the prompt without it. ``expected_prompt_length`` is accepted as a hint and unused.
        ``text_only`` (default: the config's): the cache refuses multimodal (``bytes``) tokens.
        ``enable_request_stats``: count this request's blocks for ``KVCache.commit_pending_stats``.
        """
        self.check_alive()
        self.check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.create_kv_cache")
        try:
            scope = self._check_scope(reuse_scope)
            tokens = [] if input_tokens is None else check_tokens(input_tokens, "input_tokens")
            if text_only is not None and not isinstance(text_only, bool):
                raise TypeError(f"text_only must be a bool or None, got {text_only!r}")
            if not isinstance(enable_request_stats, bool):
                raise TypeError(f"enable_request_stats must be a bool, got {enable_request_stats!r}")
            only_text = self._config.text_only if text_only is None else text_only
            if only_text:
                for position, token in enumerate(tokens):
                    if isinstance(token, bytes):
                        raise ValueError(f"input_tokens[{position}] is a multimodal token but text_only is set")
            if expected_prompt_length is not None:
                as_non_negative_int(expected_prompt_length, "expected_prompt_length")
            if custom_priority_callback is not None and not callable(custom_priority_callback):
                raise TypeError(f"custom_priority_callback must be callable, got {custom_priority_callback!r}")
            services = self._services
            if id is None:
                cache_id = services.caches.free_id()
            else:
                cache_id = as_int(id, "id")
                if cache_id in services.caches.live:
                    raise ValueError(f"id {cache_id} is already used by a live cache")
            state = open_cache(services, scope, tokens, cache_id, custom_priority_callback)
            if enable_request_stats:
                state.request_stats = KVCacheStatsDelta()
            state.count_reuse()
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
        admitted)."""
        self.check_alive()
        self.check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.create_kv_cache_batch")
        try:
            stream = CudaStream(0 if cuda_stream is None else as_int(cuda_stream, "cuda_stream"))
            admitted = create_batch(self._services, list(requests), stream)
            self._services.after_call()
            return [None if state is None else KVCache(self, state, self._config.text_only) for state in admitted]
        finally:
            guard.leave()

    @property
    def last_refusal(self) -> Refusal | None:
        """Why the latest soft refusal of this manager's calls (``KVCache.resize``/``resume`` answering False, a
        batch request answered None) happened; None before any. Kept until the next refusal."""
        return self._services.last_refusal

    @property
    def last_batch_refusals(self) -> tuple[Refusal | None, ...]:
        """One entry per request of the latest ``create_kv_cache_batch``: None where admitted, else its reason."""
        return self._services.last_batch_refusals

    def probe_reuse(self, reuse_scope: ReuseScope | None = None, input_tokens: TokenSequence | None = None) -> int:
        """How many leading tokens ``create_kv_cache`` would reuse right now; changes nothing."""
        self.check_alive()
        self.check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.probe_reuse")
        try:
            scope = self._check_scope(reuse_scope)
            if input_tokens is None:
                return 0
            return self._services.matcher.match(scope, check_tokens(input_tokens, "input_tokens")).length
        finally:
            guard.leave()

    def get_remote_tier_statistics(self) -> RemoteTierStatistics | None:
        """What the shared remote tier stored, fetched, rejected and missed so far (a snapshot); None without one."""
        return None if self._remote is None else self._remote.stats.snapshot()

    def clear_reusable_blocks(self) -> None:
        """Drop every cached page (the reusable content of the radix tree); every cache must be closed, else
        ``RuntimeError`` naming how many are open."""
        self.check_alive()
        self.check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.clear_reusable_blocks")
        try:
            self._check_all_closed("clear_reusable_blocks")
            self._store.drop_all_droppable()
            self._store.flush()  # the remote tier sends what the drops captured
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

    def get_iteration_stats(self) -> list[IterationStats]:
        """Per layer group: pages allocated, blocks reused (full / partial) and missed, pages and bytes onboarded
        and offloaded, pages copied and dropped since the previous call (get and reset; empty when
        ``enable_stats`` is off)."""
        self.check_alive()
        taken = self._store.take_stats()
        return taken if self._config.enable_stats else []

    def get_and_reset_iteration_stats(self) -> dict[int, KVCacheIterationStatsDelta]:
        """Per layer group, what happened since the previous call, in TensorRT-LLM's ``KVCacheIterationStatsDelta``
        (empty when ``enable_stats`` is off). Takes the same counts as ``get_iteration_stats``: use one of them.
        Keyed by plain ints (layer group ids), so an engine's ``dict[int, ...]`` takes it as it is."""
        self.check_alive()
        taken = self._store.take_stats()
        if not self._config.enable_stats:
            return {}
        slot_bytes = [self._layout.pool_groups[group].slot_bytes for group in self._layout.life_cycle_pool_group]
        return {stats.layer_group_id: iteration_delta(stats, slot_bytes[stats.layer_group_id]) for stats in taken}

    def get_and_reset_ssm_snapshot_iteration_stats(self) -> dict[LayerGroupId, SsmSnapshotIterationStatsDelta]:
        """Per SSM layer group with lookups since the previous call, how many new caches found a snapshot to start
        from and the tokens it saved (empty when ``enable_stats`` is off)."""
        self.check_alive()
        taken = self._services.ssm_snapshots.take()
        return taken if self._config.enable_stats else {}

    def get_committed_stats(self) -> KVCacheStatsDelta:
        """Sum of the per-request statistics caches committed (``KVCache.commit_pending_stats``)."""
        self.check_alive()
        total = self._services.committed_stats
        return KVCacheStatsDelta(total.alloc_total_blocks, total.alloc_new_blocks, total.reused_blocks, total.missed_blocks)

    @property
    def event_manager(self) -> KVCacheEventManager | None:
        """The event manager given at construction, which receives this manager's KV events."""
        return self._event_manager

    def get_latest_events(self) -> list[KVEvent]:
        """KV events since the previous call, oldest first (empty unless ``enable_kv_events``)."""
        self.check_alive()
        return self._events.drain()

    @property
    def movement_counters(self) -> MovementCounters:
        """A snapshot of pages and bytes onboarded, offloaded, copied and dropped since construction."""
        return self._store.counters.snapshot()

    @property
    def num_live_caches(self) -> int:
        """Caches created and not yet closed (active or suspended); a dropped handle's cache counts until then."""
        self._guard.settle()
        return len(self._services.caches.live)

    @property
    def call_guard(self) -> CallGuard:
        """The public call in flight and the caches of dropped handles (internal: ``KVCache`` uses it)."""
        return self._guard

    # Internal: named handles the package's other modules (``disagg``) and white-box tests use instead of private
    # attributes.
    @property
    def page_store(self) -> PageStore:
        """The manager's page store (internal)."""
        return self._store

    @property
    def radix_tree(self) -> RadixTree:
        """The manager's radix tree of committed blocks (internal)."""
        return self._tree

    @property
    def is_shut_down(self) -> bool:
        """Whether ``shutdown`` ran: every page and slot is gone."""
        return self._is_shut_down

    @property
    def services(self) -> CacheServices:
        """What the manager's caches share: store, tree, life cycles, settings (internal: ``_introspection``)."""
        return self._services

    @property
    def quota_planner(self) -> QuotaPlanner:
        """The manager's quota planner (internal)."""
        return self._planner

    @property
    def num_reuse_scopes(self) -> int:
        """Reuse scopes the radix tree keeps a root for: those with cached blocks or live caches."""
        return self._tree.num_roots

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if any page is lost, double-owned or misfiled; O(pages), for debugging."""
        self.check_alive()
        self.check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.check_invariants")
        try:
            check_invariants(self._services)
        finally:
            guard.leave()

    @staticmethod
    def _check_scope(scope: object) -> ReuseScope | None:
        if scope is not None and not isinstance(scope, ReuseScope):
            raise TypeError(f"reuse_scope must be a ReuseScope or None, got {scope!r}")
        return scope

    # ----------------------------------------------------------------------------------------------------- model
    @property
    def config(self) -> KVCacheManagerConfig:
        """The validated configuration this manager was built from."""
        return self._config

    @property
    def backend(self) -> str:
        """``"cpu"`` or ``"cuda"``: the resolved backend."""
        return self._backend.name

    @property
    def num_layers(self) -> int:
        """Layers in the config (attention and SSM)."""
        return len(self._config.layers)

    @property
    def num_layer_groups(self) -> int:
        """Layer groups: attention layers with the same window and sink blocks, or all SSM layers; each has one page
        table per cache."""
        return len(self._registry)

    @property
    def num_pool_groups(self) -> int:
        """Pool groups: memory pools whose slots are allocated together (slot ``s`` is a row of every pool); layer
        groups with the same slot layout share one, SSM gets its own."""
        return len(self._layout.pool_groups)

    @property
    def num_cache_levels(self) -> int:
        """Cache tiers, warmest first: level 0 is the GPU, then host memory and disk as configured."""
        return len(self._tiers)

    @property
    def layer_grouping(self) -> list[list[int]]:
        """Layer ids of each layer group, indexed by layer group id (plain ints: a ``list[list[LayerId]]`` would
        be refused where an engine's ``list[list[int]]`` is expected, lists being invariant)."""
        return [list(life_cycle.layer_ids) for life_cycle in self._registry.life_cycles]

    def get_layer_window(self, layer_id: SupportsIndex) -> tuple[int, int]:
        """(sliding window size or 0, number of sink tokens) of an attention layer, as its kernel sees them."""
        value = as_int(layer_id, "layer_id")
        for layer in self._config.layers:
            if layer.layer_id == value:
                if isinstance(layer, AttentionLayerConfig):
                    return layer.sliding_window_size or 0, layer.num_sink_tokens or 0
                return 0, 0
        raise ValueError(f"unknown layer_id {value}")

    def get_layer_group_id(self, layer_id: SupportsIndex) -> LayerGroupId:
        """Layer group of a layer: the index to pass to a cache's per-group calls (``get_base_page_indices``)."""
        return self._registry.of_layer(as_int(layer_id, "layer_id")).id

    def get_pool_group_index(self, layer_group_id: SupportsIndex) -> int:
        """Pool group that holds the slots of a layer group."""
        return self._layout.life_cycle_pool_group[self._check_layer_group(layer_group_id)]

    def get_pool_base_address(self, pool_group: SupportsIndex, pool: SupportsIndex, level: SupportsIndex = 0) -> MemAddress:
        """Address of slot 0 of one pool of a tier; slot ``s`` starts ``s * get_slot_bytes(pool_group)[pool]`` later."""
        group = self._tiers[self._check_level(level)].groups[self._check_pool_group(pool_group)]
        return MemAddress(group.pools[as_index(pool, "pool", len(group.pools))].address)

    @property
    def all_buffer_ids(self) -> list[BufferId]:
        """Every (layer, role) buffer the config declares."""
        return all_buffer_ids(self._layout)

    def get_aggregated_pages(self, buffers: Iterable[BufferId]) -> list[AggregatedPageDesc]:
        """The GPU byte ranges holding ``buffers`` (any order), adjacent buffers of a slot merged into one range:
        one copy per slot and range moves them all (see ``AggregatedPageDesc``)."""
        return aggregate(self._layout, buffers, lambda pool_group, pool: self.get_pool_base_address(pool_group, pool))

    def get_slot_bytes(self, pool_group: SupportsIndex) -> list[int]:
        """Bytes of one slot in each pool of a pool group."""
        return list(self._layout.pool_groups[self._check_pool_group(pool_group)].pool_slot_bytes)

    # ------------------------------------------------------------------------------------------------ addressing
    def get_page_index_converter(self, layer_id: SupportsIndex, data_role: str) -> PageIndexConverter:
        """Turns a cache's base page indices (``KVCache.get_base_page_indices`` of this layer's group) into the page
        indices a kernel uses for this (layer, role) buffer, relative to ``get_mem_pool_base_address``; page ``i``
        then starts ``i * get_page_stride(layer_id, data_role)`` bytes after that base."""
        placement = self._placement(layer_id, data_role)
        return PageIndexConverter(
            placement.scale,
            placement.expansion,
            placement.layer_offset,
            placement.pages_per_block,
            placement.page_in_block,
        )

    def get_page_stride(self, layer_id: SupportsIndex, data_role: str) -> int:
        """Bytes between consecutive page indices of this (layer, role): buffer size / expansion."""
        return self._placement(layer_id, data_role).stride

    def get_mem_pool_base_address(
        self, layer_id: SupportsIndex, data_role: str, index_mode: PageIndexMode | None = None
    ) -> MemAddress:
        """GPU address that page index 0 of this buffer is relative to: for SHARED (the default unless scratch
        reuse is on) the buffer's own start in slot 0, for PER_LAYER the start of its pool."""
        placement = self._placement(layer_id, data_role)
        mode = self._resolve_base_mode(index_mode)
        pool = self._tiers[0].groups[placement.pool_group].pools[placement.pool]
        offset = placement.layer_offset * placement.size if mode == PageIndexMode.SHARED else 0
        return MemAddress(pool.address + offset)

    def get_page_index_upper_bound(
        self, layer_id: SupportsIndex, data_role: str, index_mode: PageIndexMode = PageIndexMode.SHARED
    ) -> int:
        """Number of valid page indices from the base address of ``index_mode``."""
        placement = self._placement(layer_id, data_role)
        mode = self._check_mode(index_mode)
        slots = self._tiers[0].groups[placement.pool_group].num_slots
        if mode == PageIndexMode.SHARED:
            return (slots * placement.scale - placement.layer_offset) * placement.expansion
        return slots * placement.scale * placement.expansion

    def get_page_view(
        self, layer_id: SupportsIndex, data_role: str, index_mode: PageIndexMode = PageIndexMode.SHARED
    ) -> PageView:
        """GPU-tier pages of one buffer as a ``uint8`` array ``(upper_bound, stride)``; row ``i`` is page index ``i``.

        A NumPy array on the cpu backend, a CuPy array on cuda (wrap it with DLPack for torch).
        """
        placement = self._placement(layer_id, data_role)
        mode = self._check_mode(index_mode)
        rows = self.get_page_index_upper_bound(layer_id, data_role, mode)
        pool = self._tiers[0].groups[placement.pool_group].pools[placement.pool]
        first_row = placement.layer_offset * placement.expansion if mode == PageIndexMode.SHARED else 0
        whole = rows_view(pool, placement.stride, rows + first_row)
        return cast(PageView, whole[first_row:])  # type: ignore[index]

    def supports_index_mode(self, mode: PageIndexMode) -> bool | None:
        """PER_LAYER always; SHARED too unless scratch reuse is on, where it is per cache (None)."""
        mode = self._check_mode(mode)
        if mode == PageIndexMode.SHARED and self._config.enable_swa_scratch_reuse:
            return None
        return True

    # --------------------------------------------------------------------------------------------------- storage
    def get_storage_statistics(self, cache_level: SupportsIndex = GPU_LEVEL) -> list[StorageStatistics]:
        """Slot counts per pool group of one cache level (evictable: pages that can leave this level)."""
        return self._store.statistics(self._check_level(cache_level))

    def get_usage(self) -> list[PoolGroupUsage]:
        """Pages (and bytes) used / held / reusable / free per tier and pool group, warmest tier first."""
        self.check_alive()
        self._guard.settle()  # dropped handles' caches closed first
        return usage_of(self._store)

    def get_quota(self, cache_level: SupportsIndex) -> int:
        """Bytes the cache tier at ``cache_level`` may use now (its config's quota, or the last ``resize``)."""
        return self._tiers[self._check_level(cache_level)].quota

    def resize(self, cache_level: SupportsIndex, quota: SupportsIndex, best_efforts: bool = False) -> bool:
        """Change a tier's quota at run time (every cache suspended). Pool base addresses never move: False,
        changing nothing, when the quota exceeds the tier's reservation or held pages would not fit.

        ``best_efforts``: where ``quota`` cannot be had, move to the quota nearest it that can (each pool group
        within its reservation, held pages fitting); ``get_quota`` then reports the quota reached, and False only
        when the tier could not move towards ``quota`` at all."""
        guard = self._guard
        guard.enter("KVCacheManager.resize")
        try:
            level = self._check_level(cache_level)
            new_quota = as_int(quota, "quota")
            if not isinstance(best_efforts, bool):
                raise TypeError(f"best_efforts must be a bool, got {best_efforts!r}")
            if new_quota < 0 or (new_quota == 0 and level == GPU_LEVEL):
                raise ValueError(f"quota must be > 0 for the GPU tier and >= 0 for the others, got {new_quota}")
            for cache in self._services.caches.live.values():
                if cache.is_active:
                    raise ValueError(f"manager.resize needs every cache suspended; cache {cache.id} is active")
            applied = self._apply_quota(level, new_quota)
            if not applied and best_efforts:
                current = self._tiers[level].quota
                nearest = closest_quota(current, new_quota, lambda quota: self._quota_fits(level, quota))
                if nearest > current:  # the fewest bytes giving those slots (not a byte short of the next slot)
                    counts = self._quota_counts(level, nearest)
                    nearest = closest_quota(nearest, current, lambda quota: self._quota_counts(level, quota) == counts)
                applied = nearest != current and self._apply_quota(level, nearest)
            self._services.after_call()
            return applied
        finally:
            guard.leave()

    def _needs_slots(self, pool_group: int) -> bool:
        """Whether the GPU tier must give a pool group at least one slot: unless the typical step (or the
        initial pool ratio) and the constraints ask for none, a group without a slot could serve no request."""
        return self._planner.demand[pool_group] > 0 or self._planner.floors[pool_group] > 0

    def _gpu_split_usable(self, counts: list[int]) -> bool:
        return all(count > 0 or not self._needs_slots(group) for group, count in enumerate(counts))

    def _quota_counts(self, level: int, quota: int) -> list[int] | None:
        """The tier's slot counts per pool group under ``quota``, or None where they could serve no request."""
        counts = self._planner.split(quota, self._planner.demand, self._planner.floors if level == 0 else None)
        if counts is None or (level == 0 and not self._gpu_split_usable(counts)):
            return None
        return counts

    def _quota_fits(self, level: int, quota: int) -> bool:
        counts = self._quota_counts(level, quota)
        return counts is not None and self._store.can_resize_slots(level, counts)

    def _apply_quota(self, level: int, quota: int) -> bool:
        counts = self._quota_counts(level, quota)
        if counts is None or not self._store.resize_slots(level, counts):
            return False
        self._store.flush()
        self._tiers[level].quota = quota
        return True

    # -------------------------------------------------------------------------------------------- planning
    def clamp_max_seq_len_for_mem(self, batch_size: SupportsIndex, token_num_upper_bound: SupportsIndex) -> int:
        """Largest ``L <= token_num_upper_bound`` such that ``batch_size`` caches of capacity ``L`` and history
        ``L - 1`` fit in the GPU tier at once (as the manager would allocate them); 0 if none fits.

        With sliding windows, pages are not monotonic in ``L``: a shorter length may need one page more per window
        (window 20, tpb 16, 2 slots: 200 fits, 33 does not), and a sequence growing to ``L`` passes through it."""
        self.check_alive()
        size = as_int(batch_size, "batch_size")
        bound = as_int(token_num_upper_bound, "token_num_upper_bound")
        if size <= 0:
            raise ValueError(f"batch_size must be > 0, got {size}")
        counts = [group.num_slots for group in self._tiers[0].groups]
        return self._planner.clamp_max_seq_len(size, bound, counts)

    def can_fit(self, num_tokens: SupportsIndex, chunk_size: SupportsIndex = 1) -> bool:
        """Whether one request of ``num_tokens`` tokens, computed ``chunk_size`` at a time, fits the GPU tier of an
        otherwise empty manager (False: it would be refused however long it waits). Admission (resume, batch)
        is further bounded by ``max_util_for_resume``: admit the first chunk, then ``resize`` up to the rest."""
        self.check_alive()
        tokens = as_int(num_tokens, "num_tokens")
        chunk = as_int(chunk_size, "chunk_size")
        if tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {tokens}")
        if chunk <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk}")
        return request_fits(self._planner, self._gpu_slot_counts(), tokens, chunk)

    def max_admissible(self, chunk_size: SupportsIndex = 1, token_num_upper_bound: SupportsIndex | None = None) -> int:
        """The longest request (tokens, at most ``token_num_upper_bound``, default the per-cache block limit) that
        ``can_fit`` with ``chunk_size``; 0 when not even one token does."""
        self.check_alive()
        chunk = as_int(chunk_size, "chunk_size")
        if chunk <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk}")
        bound = MAX_BLOCKS_PER_CACHE * self.tokens_per_block
        if token_num_upper_bound is not None:
            bound = as_int(token_num_upper_bound, "token_num_upper_bound")
            if bound < 0:
                raise ValueError(f"token_num_upper_bound must be >= 0, got {bound}")
        return largest_request(self._planner, self._gpu_slot_counts(), chunk, bound)

    def _gpu_slot_counts(self) -> list[int]:
        return [group.num_slots for group in self._tiers[0].groups]

    @property
    def need_adjustment(self) -> bool:
        """Whether the lengths of recently closed requests call for another split of the GPU tier."""
        self.check_alive()
        self._guard.settle()
        demand = self._planner.observed_demand(self._services.caches.observed_lengths)
        if demand is None:
            return False
        ideal = self._planner.split(self._tiers[0].quota, demand, self._planner.floors)
        current = [group.num_slots for group in self._tiers[0].groups]
        return ideal is not None and departs(current, ideal)

    def adjust(self) -> bool:
        """Re-split every tier across pool groups for the observed request mix (every cache suspended).

        Bases never move (a group grows at most to its reservation) and held pages are never lost: a tier
        whose held pages would not fit keeps its split and the call returns False.
        """
        self.check_alive()
        self.check_alive()
        guard = self._guard
        guard.enter("KVCacheManager.adjust")
        try:
            for cache in self._services.caches.live.values():
                if cache.is_active:
                    raise ValueError(f"adjust needs every cache suspended; cache {cache.id} is active")
            demand = self._planner.observed_demand(self._services.caches.observed_lengths)
            if demand is None:
                return False
            complete = True
            for level, tier in enumerate(self._tiers):
                counts = self._planner.split(tier.quota, demand, self._planner.floors if level == 0 else None)
                if counts is None:
                    complete = False
                    continue
                counts = [min(count, group.max_slots) for count, group in zip(counts, tier.groups)]
                if level == 0 and not self._gpu_split_usable(counts):
                    complete = False
                    continue
                if not self._store.resize_slots(level, counts):
                    complete = False
            self._store.flush()
            if complete:
                self._planner.demand = demand
            self._services.after_call()
            return complete
        finally:
            guard.leave()

    def shutdown(self) -> None:
        """Clear the radix tree and free all memory (every cache must be closed); unusable afterwards."""
        if self._is_shut_down:
            return
        guard = self._guard
        guard.enter("KVCacheManager.shutdown")
        try:
            self._check_all_closed("shutdown")
            self._store.drop_all_droppable()
            if self._remote is not None:
                self._remote.close()  # sends what the drops just captured (all of it unless written through)
            self._tree.clear()
            for tier in self._tiers:
                tier.close()
            self._tiers = []
            self._is_shut_down = True
        finally:
            guard.leave()

    # ---------------------------------------------------------------------------------------------------- checks
    def _placement(self, layer_id: SupportsIndex, role: str) -> BufferPlacement:
        self.check_alive()
        return self._layout.placement(as_int(layer_id, "layer_id"), role)

    def _check_all_closed(self, operation: str) -> None:
        open_caches = len(self._services.caches.live)
        if open_caches:
            raise RuntimeError(
                f"{operation}() with {open_caches} KV cache(s) still open: close them (or drain the engine) first"
            )

    def check_alive(self) -> None:
        """Raise ValueError once the manager is shut down (internal: the package's other modules call it)."""
        if self._is_shut_down:
            raise ValueError("the KVCacheManager has been shut down")

    def _check_level(self, level: SupportsIndex) -> int:
        self.check_alive()
        return as_index(level, "cache_level", len(self._tiers))

    def _check_layer_group(self, layer_group_id: SupportsIndex) -> int:
        return as_index(layer_group_id, "layer_group_id", len(self._registry))

    def _check_pool_group(self, pool_group: SupportsIndex) -> int:
        return as_index(pool_group, "pool_group", len(self._layout.pool_groups))

    @staticmethod
    def _check_mode(mode: object) -> PageIndexMode:
        if not isinstance(mode, PageIndexMode):
            raise TypeError(f"index_mode must be a PageIndexMode, got {mode!r}")
        return mode

    def _resolve_base_mode(self, index_mode: PageIndexMode | None) -> PageIndexMode:
        if index_mode is None:
            if self._config.enable_swa_scratch_reuse:
                raise ValueError(
                    "index_mode=None (SHARED) is not allowed when SWA scratch reuse is enabled; pass "
                    "PageIndexMode.PER_LAYER"
                )
            return PageIndexMode.SHARED
        return self._check_mode(index_mode)
