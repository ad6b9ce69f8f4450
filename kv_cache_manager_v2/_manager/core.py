"""The manager's core: builds and owns the storage tiers, layout, page store, radix tree and cache registry, and
answers the statistics and event questions. ``KVCacheManager`` is this plus the layers of methods stacked on it
(``layout_queries``, ``quotas``, then the requests in ``manager``): one class, written in modules of one concern."""

from __future__ import annotations

import logging
import os
from typing import Callable, Final, SupportsIndex

from .._cache.call_guard import CallGuard
from .._observe.event_manager import EventBridge, KVCacheEventManager, LayerGroupKind, layer_group_kind
from .._observe.events import EventLog, IterationStats, KVEvent
from .._cache.invariants import check_invariants
from .._cache.registry import CacheRegistry
from .._model.layout import StorageLayout
from .._model.tier_grouping import TierGrouping, split_cold_quota
from .._model.life_cycle import LifeCycleRegistry
from .._storage.memory import MemoryBackend, choose_backend
from .._storage.codec_copies import check_round_trip
from .._storage.page_codec import ColdPageCodec
from .._pages.movement_counters import MovementCounters
from .._pages.page_store import PageStore
from .._model.planning import DEFAULT_TYPICAL_STEP, QuotaPlanner, RebalanceGates
from .._pages.radix_tree import RadixTree
from .._cache.services import CacheServices, CacheSettings
from .._remote.statistics import RemoteTierStatistics
from .._remote.tier import RemoteTier
from .._observe.ssm_snapshot_stats import SsmSnapshotIterationStatsDelta
from .._observe.stats_delta import KVCacheIterationStatsDelta, KVCacheStatsDelta, iteration_delta
from .._model.admission_limits import (
    default_step_for, warn_if_declared_request_cannot_fit, warn_if_default_split_starves, warn_if_no_cache_admissible,
)
from .._storage.slots import TierStorage, build_tier
from .._base.types import CacheLevel, LayerGroupId, PageIndexMode, Handle
from .._base.validation import as_index, as_int
from ..config import BatchDesc, DiskCacheTierConfig, GpuCacheTierConfig, KVCacheManagerConfig

logger = logging.getLogger("kv_cache_manager_v2")


# Set to 1 to run the full invariant check after every public call that changes state (slow; for debugging).
DEBUG_ENV: Final = "KV_CACHE_MANAGER_V2_DEBUG"


class ManagerInternals:
    """A manager's internal collaborators, for the package's other modules (``disagg``, the handoff,
    ``_introspection``, planned drops) and white-box tests: they get it from ``internals_of``, so none of these
    is a name on the public ``KVCacheManager``."""

    def __init__(
        self, store: PageStore, tree: RadixTree, planner: QuotaPlanner, services: CacheServices, guard: CallGuard
    ) -> None:
        self.store: PageStore = store
        self.tree: RadixTree = tree
        self.planner: QuotaPlanner = planner
        self.services: CacheServices = services
        self.guard: CallGuard = guard
        # The handoff's ``same_layout.layout_summary``, made at its first use (the layout never changes): ~0.4 ms
        # for 48 layers, which every ``plan_transfer`` would otherwise pay twice.
        self.layout_summary: tuple[tuple[str, str], ...] = ()


def internals_of(manager: ManagerCore) -> ManagerInternals:
    """The internal collaborators of ``manager`` (internal API: not for engines)."""
    return manager._internals


def check_alive(manager: ManagerCore) -> None:
    """Raise ValueError once ``manager`` is shut down (internal API: the package's other modules call it)."""
    manager._check_alive()


class ManagerCore(Handle):
    """What every part of the manager stands on (see ``KVCacheManager`` for the threading and re-entrancy rules)."""

    def __init__(
        self,
        config: KVCacheManagerConfig,
        event_manager: KVCacheEventManager | None = None,
        cold_page_codec: ColdPageCodec | None = None,
    ) -> None:
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
        encoded_bytes = _encoded_page_bytes(config, len(self._registry), cold_page_codec)
        self._grouping = TierGrouping(self._layout, len(config.local_tiers), encoded_bytes)
        self._backend: MemoryBackend = choose_backend(config.backend)
        guard = CallGuard()
        self._backend.interrupts = guard  # a disk tier's warnings mid-call wait for its end
        if cold_page_codec is not None and encoded_bytes is not None:
            hot = self._grouping.levels[0]
            for layer_group, size in enumerate(encoded_bytes):
                plain_bytes = sum(hot[self._grouping.group_of[0][layer_group]].pool_slot_bytes)
                check_round_trip(cold_page_codec, layer_group, plain_bytes, size, self._backend.name == "cuda")
        self._planner = QuotaPlanner(
            self._registry,
            self._layout,
            config.enable_swa_scratch_reuse,
            config.max_rewind_len,
            config.typical_step if config.typical_step is not None else DEFAULT_TYPICAL_STEP,
            config.constraints,
            config.admission_util,
            config.initial_pool_ratio,
            RebalanceGates(
                config.rebalance_min_sampled_kv_caches, config.rebalance_cooldown_secs, config.rebalance_ratio_threshold
            ),
        )
        default_step: BatchDesc | None = None
        if config.typical_step is None and config.initial_pool_ratio is None:  # a default that serves this tier
            default_step = default_step_for(self._planner, config.local_tiers[0].quota, config.admission_util)
        self._tiers: list[TierStorage] = []
        try:
            for level, tier_config in enumerate(config.local_tiers):
                quota, max_quota = tier_config.quota, tier_config.max_quota
                counts = self._tier_split(level, quota, self._planner.demand)
                if counts is None:  # only the GPU tier has floors
                    quota = self._planner.floor_bytes()
                    max_quota = None if max_quota is None else max(max_quota, quota)
                    logger.warning(
                        "GpuCacheTierConfig.quota %d is below the %d bytes the constraints need: the GPU tier takes %d",
                        tier_config.quota, quota, quota,
                    )
                    counts = self._planner.split(quota, self._planner.demand, self._planner.floors)
                    assert counts is not None, "the floors fit their own bytes"
                for pool_group, count in zip(self._layout.pool_groups, counts):
                    if count == 0 and level == 0 and self._needs_slots(pool_group.index):
                        one_each = sum(group.slot_bytes for group in self._layout.pool_groups)
                        raise ValueError(
                            f"GpuCacheTierConfig.quota {tier_config.quota} leaves pool group {pool_group.index} "
                            f"(slots of {pool_group.slot_bytes} bytes) without a single slot: give the GPU tier more "
                            f"memory (one slot of every pool group takes {one_each} bytes) or declare "
                            f"KVCacheManagerConfig.typical_step (or initial_pool_ratio) so that the split gives it a share"
                        )
                directory = tier_config.path if isinstance(tier_config, DiskCacheTierConfig) else None
                try:
                    built = build_tier(
                        self._backend,
                        CacheLevel(level),
                        tier_config.tier,
                        quota,
                        max_quota,
                        directory,
                        self._grouping.levels[level],
                        counts,
                    )
                except MemoryError as error:  # the allocator's message names a byte count, not the setting behind it
                    setting = (
                        f"quota {tier_config.quota}" if tier_config.max_quota is None
                        else f"max_quota {tier_config.max_quota}"
                    )
                    raise MemoryError(
                        f"{type(tier_config).__name__}.{setting}: this machine cannot allocate the tier's pools ({error})"
                    ) from error
                self._tiers.append(built)
        except BaseException:
            for tier in self._tiers:
                tier.close()
            raise
        # From here on user code runs (event-manager hooks, the remote store's open): whatever it raises, the tiers
        # just built give back their memory and files, and the event manager stops counting this manager among
        # its feeders (else no later manager's shutdown could end its readers' waits).
        fed = False
        try:
            if config.typical_step is not None:
                warn_if_declared_request_cannot_fit(self._planner, self._gpu_slot_counts(), config.typical_step)
            if default_step is not None:
                warn_if_default_split_starves(self._planner, self._gpu_slot_counts(), default_step, self._tiers[0].quota)
            warn_if_no_cache_admissible(
                self._registry.life_cycles, self._layout.life_cycle_pool_group, self._gpu_slot_counts(),
                config.admission_util,
            )
            self._is_shut_down = False
            self._guard = guard
            self._event_manager = event_manager
            bridge: EventBridge | None = None
            if event_manager is not None:
                bridge = EventBridge(event_manager, [tier_config.tier for tier_config in config.local_tiers], self._guard)
                life_cycles = self._registry.life_cycles
                windows: dict[int, int] = {lc.id: lc.window_size or 0 for lc in life_cycles}
                kinds: dict[int, LayerGroupKind] = {lc.id: layer_group_kind(lc) for lc in life_cycles}
                event_manager.check_feed(windows, kinds)
                event_manager.set_layer_group_window_sizes(windows)
                event_manager.set_layer_group_kinds(kinds)
                event_manager.begin_feed()
                fed = True
                event_manager.add_created_event(
                    [sum(pool_group.num_slots for pool_group in tier.pool_groups) for tier in self._tiers]
                )
            self._events = EventLog(config.enable_kv_events, config.max_kv_events, None if bridge is None else bridge.record)
            self._tree = RadixTree(
                config.tokens_per_block,
                len(self._registry),
                self._events,
                config.partial_reuse_enabled,
                spare_blocks=max(pool_group.num_slots for pool_group in self._tiers[0].pool_groups),
            )
            self._tree.merges_partial_siblings = config.partial_reuse_enabled and not any(
                life_cycle.is_ssm for life_cycle in self._registry.life_cycles
            )
            self._store = PageStore(
                self._tiers, self._tree, len(self._registry), self._events, self._backend.stream_order(), self._grouping,
                self._guard, cold_page_codec,
            )
            settings = CacheSettings(
                config.tokens_per_block,
                config.partial_reuse_enabled,
                config.max_util_for_resume,
                config.enable_swa_scratch_reuse,
                config.max_rewind_len,
                config.ssm_reuse_interval,
                config.last_snapshot,
                config.snapshot_prefill_chunks,
                config.admission_watermark,
            )
            self._caches = CacheRegistry(self._planner)
            self._services = CacheServices(self._store, self._tree, self._registry.life_cycles, self._layout, settings)
            self._services.matcher.match_backoff = config.reuse_match_backoff
            self._internals: ManagerInternals = ManagerInternals(
                self._store, self._tree, self._planner, self._services, self._guard
            )
            self._remote: RemoteTier | None = None
            remote = config.remote_tier
            if remote is not None:
                client = remote.backend.open(remote.quota)
                try:
                    self._remote = RemoteTier(
                        client, remote, config.layers, self._registry.life_cycles, self._layout,
                        config.tokens_per_block, self._store, self._tree, self._guard,
                    )
                except BaseException:  # a Ctrl-C included: the store's client is connected, lending its quota
                    client.close()
                    raise
                self._store.listener = self._remote
                self._tree.attach_listener = self._remote.committed
                self._services.remote = self._remote
        except BaseException:
            for tier in self._tiers:
                tier.close()
            if fed and event_manager is not None:
                event_manager.end_feed()
            raise
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            self._services.invariant_checker = self._check_all

    def get_iteration_stats(self) -> list[IterationStats]:
        """Per layer group: pages allocated, blocks reused (full / partial) and missed, pages and bytes onboarded
        and offloaded, pages copied and dropped since the previous call (get and reset; empty when
        ``enable_stats`` is off)."""
        self._check_alive()
        taken = self._store.take_stats()
        return taken if self._config.enable_stats else []

    def get_and_reset_iteration_stats(self) -> dict[int, KVCacheIterationStatsDelta]:
        """Per layer group, what happened since the previous call, in TensorRT-LLM's ``KVCacheIterationStatsDelta``
        (empty when ``enable_stats`` is off). Takes the same counts as ``get_iteration_stats``: use one of them.
        Keyed by plain ints (layer group ids), so an engine's ``dict[int, ...]`` takes it as it is."""
        self._check_alive()
        taken = self._store.take_stats()
        if not self._config.enable_stats:
            return {}
        slot_bytes = [self._layout.pool_groups[group].slot_bytes for group in self._layout.life_cycle_pool_group]
        return {stats.layer_group_id: iteration_delta(stats, slot_bytes[stats.layer_group_id]) for stats in taken}

    def get_and_reset_ssm_snapshot_iteration_stats(self) -> dict[LayerGroupId, SsmSnapshotIterationStatsDelta]:
        """Per SSM layer group with lookups since the previous call, how many new caches found a snapshot to start
        from and the tokens it saved (empty when ``enable_stats`` is off)."""
        self._check_alive()
        taken = self._services.ssm_snapshots.take()
        return taken if self._config.enable_stats else {}

    def get_committed_stats(self) -> KVCacheStatsDelta:
        """Sum of the per-request statistics caches committed (``KVCache.commit_pending_stats``)."""
        self._check_alive()
        total = self._services.committed_stats
        return KVCacheStatsDelta(total.alloc_total_blocks, total.alloc_new_blocks, total.reused_blocks, total.missed_blocks)

    def get_dirty_stats_kv_cache_ids(self) -> set[int]:
        """Ids of the open caches holding statistics not yet committed or discarded (``commit_pending_stats`` /
        ``discard_pending_stats``): a reuse lookup counted at creation, or request blocks. Only on the scheduler
        thread (``RuntimeError`` on another, like ``get_usage``): the ids are for that thread's next
        ``commit_pending_stats`` calls, and a read in the middle of one of its calls could name a cache that call
        is about to take back."""
        self._check_alive()
        guard = self._guard
        guard.enter_scheduler_read("KVCacheManager.get_dirty_stats_kv_cache_ids")
        try:
            return set(self._services.pending_stats)
        finally:
            guard.leave()

    @property
    def event_manager(self) -> KVCacheEventManager | None:
        """The event manager given at construction, which receives this manager's KV events."""
        return self._event_manager

    def get_latest_events(self) -> list[KVEvent]:
        """KV events since the previous call, oldest first (empty unless ``enable_kv_events``)."""
        self._check_alive()
        return self._events.drain()

    @property
    def movement_counters(self) -> MovementCounters:
        """A snapshot of pages and bytes onboarded, offloaded, copied and dropped since construction."""
        return self._store.counters.snapshot()

    @property
    def num_live_caches(self) -> int:
        """Caches created and not yet closed (active or suspended); a dropped handle's cache counts until then (on
        the scheduler thread this read closes it first; on the other thread it closes nothing)."""
        self._guard.settle()
        return len(self._caches.live)

    @property
    def is_shut_down(self) -> bool:
        """Whether ``shutdown`` ran: every page and slot is gone."""
        return self._is_shut_down

    @property
    def num_reuse_scopes(self) -> int:
        """Reuse scopes the radix tree keeps a root for: those with cached blocks or live caches."""
        return self._tree.num_roots

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if any page is lost, double-owned or misfiled; O(pages), for debugging."""
        self._check_alive()
        guard = self._guard
        guard.enter_read("KVCacheManager.check_invariants")
        try:
            self._check_all()
        finally:
            guard.leave()

    def _check_all(self) -> None:
        check_invariants(self._services, self._caches)

    @property
    def config(self) -> KVCacheManagerConfig:
        """The validated configuration this manager was built from."""
        return self._config

    @property
    def backend(self) -> str:
        """``"cpu"`` or ``"cuda"``: the resolved backend."""
        return self._backend.name

    def shutdown(self) -> None:
        """Clear the radix tree and free all memory (every cache must be closed); unusable afterwards."""
        if self._is_shut_down:
            return
        guard = self._guard
        guard.enter("KVCacheManager.shutdown")
        try:
            self._check_all_closed("shutdown")
            self._drop_all_cached()
            if self._remote is not None:
                self._remote.close()
            self._tree.clear()
            for tier in self._tiers:
                tier.close()
            self._tiers = []
            self._is_shut_down = True
            if self._event_manager is not None:
                self._event_manager.end_feed()  # its readers would wait for a flush that no longer comes
        finally:
            guard.leave()

    def _drop_all_cached(self) -> None:
        """Drop every cached page (``shutdown``, ``clear_reusable_blocks``); the remote tier gets them (all of them
        unless written through) within one ``bulk_write_back_deadline_s``, and works as usual afterwards."""
        remote = self._remote
        if remote is None:
            self._store.drop_all_droppable()
            return
        remote.begin_bulk_write_back()
        try:
            self._store.drop_all_droppable()
        finally:
            remote.end_bulk_write_back()

    def _check_all_closed(self, operation: str) -> None:
        open_caches = len(self._caches.live)
        if open_caches:  # "(s)" kept: TensorRT-LLM's text word for word, which its engines and tests match on
            raise RuntimeError(
                f"{operation}() with {open_caches} KV cache(s) still open: close them (or drain the engine) first"
            )

    def _check_alive(self) -> None:
        if self._is_shut_down:
            raise ValueError("the KVCacheManager has been shut down")

    def _check_level(self, level: SupportsIndex) -> int:
        self._check_alive()
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

    def _tier_split(self, level: int, quota: int, demand: list[int]) -> list[int] | None:
        """Slot counts of ``level``'s pool groups under ``quota`` for ``demand`` (pages per hot pool group): the
        planner's split on the hot grouping (floors on the GPU tier only), else shared by encoded page bytes."""
        if level == 0 or not self._grouping.encoded:
            return self._planner.split(quota, demand, self._planner.floors if level == 0 else None)
        hot = self._layout.pool_groups
        weights = [
            demand[group] / len(hot[group].life_cycle_ids) for group in self._layout.life_cycle_pool_group
        ]
        return split_cold_quota(quota, self._grouping.levels[level], weights)

    def _needs_slots(self, pool_group: int) -> bool:
        """Whether the GPU tier must give a pool group at least one slot: unless the typical step (or the
        initial pool ratio) and the constraints ask for none, a pool group without a slot could serve no request."""
        return self._planner.demand[pool_group] > 0 or self._planner.floors[pool_group] > 0

    def _gpu_slot_counts(self) -> list[int]:
        return [pool_group.num_slots for pool_group in self._tiers[0].pool_groups]

    def get_remote_tier_statistics(self) -> RemoteTierStatistics | None:
        """What the shared remote tier stored, fetched, rejected and missed so far (a snapshot); None without one."""
        return None if self._remote is None else self._remote.stats.snapshot()


def _encoded_page_bytes(
    config: KVCacheManagerConfig, num_layer_groups: int, codec: ColdPageCodec | None
) -> list[int] | None:
    """Each layer group's encoded page size, after checking that the codec and the tiers go together: a GPU tier
    after the first needs a codec, a codec needs a tier after the first and no remote tier."""
    tiers = config.local_tiers
    if codec is None:
        for level, tier in enumerate(tiers):
            if level > 0 and isinstance(tier, GpuCacheTierConfig):
                raise ValueError(
                    f"KVCacheManagerConfig.cache_tiers[{level}] is a GPU tier after the first: it stores pages "
                    f"encoded, so cold_page_codec must be given"
                )
        return None
    for method in ("encoded_page_bytes", "encode", "decode"):
        if not callable(getattr(codec, method, None)):
            raise TypeError(f"cold_page_codec must be a ColdPageCodec (no {method} method), got {codec!r}")
    if len(tiers) < 2:
        raise ValueError("cold_page_codec needs a cache tier after the first GPU tier to store encoded pages in")
    if config.remote_tier is not None:
        raise ValueError("cold_page_codec cannot be combined with a remote tier (it stores plain pages)")
    sizes: list[int] = []
    # Its answer as the object it is: typed int, compiled code would unbox True to 1 (and refuse a float unnamed).
    encoded_page_bytes: Callable[[int], object] = codec.encoded_page_bytes
    # No page larger than the largest cold tier could ever be stored (a huge answer would reach NumPy unnamed).
    largest = max(tier.quota if tier.max_quota is None else tier.max_quota for tier in tiers[1:])
    for layer_group in range(num_layer_groups):
        size = as_int(encoded_page_bytes(layer_group), f"cold_page_codec.encoded_page_bytes({layer_group})")
        if size <= 0:
            raise ValueError(f"cold_page_codec.encoded_page_bytes({layer_group}) must be positive, got {size}")
        if size > largest > 0:  # (cold tiers of quota 0 hold no page of any size)
            raise ValueError(
                f"cold_page_codec.encoded_page_bytes({layer_group}) is {size} bytes, more than the largest cold tier "
                f"holds ({largest} bytes): no page of that layer group could be stored"
            )
        sizes.append(size)
    return sizes
