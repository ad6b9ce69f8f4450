"""The manager's answers about the model's layout and memory: layer and pool groups, the addresses and page index
conversions a kernel needs, page views, and storage statistics."""

from __future__ import annotations

from typing import Final, Iterable, Iterator, SupportsIndex, cast

from .._model.addressing import PageIndexConverter
from .._model.aggregated_pages import AggregatedPageDesc, aggregate, all_buffer_ids
from .._model.layout import BufferPlacement
from .._storage.memory import rows_view
from .._base.page_view import PageView
from .._pages.usage import PoolGroupUsage, usage_of
from .._storage.slots import StorageStatistics
from .._base.types import GPU_LEVEL, BufferId, LayerGroupId, LayerId, MemAddress, PageIndexMode
from .._base.validation import as_index, as_int
from ..config import AttentionLayerConfig



from .core import ManagerCore

# A module constant: a member lookup on the enum class costs more than the comparison (a per-layer query's).
_SHARED: Final = PageIndexMode.SHARED


class ManagerLayoutQueries(ManagerCore):
    """Read-only questions about where each (layer, role) buffer lives; nothing here changes state."""

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
    def layer_ids(self) -> Iterator[LayerId]:
        """Every layer's id (attention and SSM), in the config's order."""
        return iter([LayerId(layer.layer_id) for layer in self._config.layers])

    @property
    def layer_grouping(self) -> list[list[int]]:
        """Layer ids of each layer group, indexed by layer group id (plain ints: a ``list[list[LayerId]]`` would
        be refused where an engine's ``list[list[int]]`` is expected, lists being invariant)."""
        return [list(life_cycle.layer_ids) for life_cycle in self._registry.life_cycles]

    def get_layer_window(self, layer_id: SupportsIndex) -> tuple[int, int]:
        """(sliding window size or 0, number of sink tokens) of an attention layer, as its kernel sees them; (0, 0)
        for an SSM layer, which has neither (``SsmLayerConfig``)."""
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

    def get_life_cycle_pool_group_indices(self, cache_level: SupportsIndex = GPU_LEVEL) -> list[int]:
        """Pool group of every layer group in tier ``cache_level``, indexed by layer group id (a cold-page codec
        groups the cold tiers' layer groups by encoded page size; otherwise every tier groups them alike)."""
        level = self._check_level(cache_level)
        return [int(group) for group in self._store.grouping.group_of[level]]

    def get_pool_base_address(self, pool_group: SupportsIndex, pool: SupportsIndex, level: SupportsIndex = 0) -> MemAddress:
        """Address of slot 0 of one pool of a tier; slot ``s`` starts ``s * get_slot_bytes(pool_group)[pool]`` later
        (the tier's own pool groups: with a cold-page codec, a cold tier's differ from the GPU's)."""
        groups = self._tiers[self._check_level(level)].pool_groups
        pools = groups[as_index(pool_group, "pool_group", len(groups))].pools
        return MemAddress(pools[as_index(pool, "pool", len(pools))].address)

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

    def get_page_index_converter(self, layer_id: SupportsIndex, data_role: str) -> PageIndexConverter:
        """Turns a cache's base page indices (``KVCache.get_base_page_indices`` of this layer's group) into the page
        indices a kernel uses for this (layer, role) buffer, relative to ``get_mem_pool_base_address``; page ``i``
        then starts ``i * get_page_stride(layer_id, data_role)`` bytes after that base."""
        self._check_alive()
        return self._layout.page_index_converter(as_int(layer_id, "layer_id"), data_role)

    def get_page_index_scale(self, layer_id: SupportsIndex, data_role: str) -> int:
        """Page indices of this (layer, role) buffer per slot: a base page index ``s`` is page ``s * scale`` of the
        buffer (SHARED mode; ``get_page_index_converter`` applies it, and the layer offset for PER_LAYER)."""
        return self._placement(layer_id, data_role).scale

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
        pool = self._tiers[0].pool_groups[placement.pool_group].pools[placement.pool]
        offset = placement.layer_offset * placement.size if mode == _SHARED else 0
        return MemAddress(pool.address + offset)

    def get_page_index_upper_bound(
        self, layer_id: SupportsIndex, data_role: str, index_mode: PageIndexMode = PageIndexMode.SHARED
    ) -> int:
        """Number of valid page indices from the base address of ``index_mode``."""
        placement = self._placement(layer_id, data_role)
        mode = self._check_mode(index_mode)
        slots = self._tiers[0].pool_groups[placement.pool_group].num_slots
        if mode == PageIndexMode.SHARED:
            return (slots * placement.scale - placement.layer_offset) * placement.expansion
        return slots * placement.scale * placement.expansion

    def get_page_view(
        self, layer_id: SupportsIndex, data_role: str, index_mode: PageIndexMode = PageIndexMode.SHARED
    ) -> PageView:
        """GPU-tier pages of one buffer as a ``uint8`` array ``(upper_bound, stride)``; row ``i`` is page index ``i``.

        A NumPy array on the cpu backend, a CuPy array on cuda (wrap it with DLPack for torch).
        """
        layer = as_int(layer_id, "layer_id")  # once: the placement and the row count must be the same layer's
        placement = self._placement(layer, data_role)
        mode = self._check_mode(index_mode)
        rows = self.get_page_index_upper_bound(layer, data_role, mode)
        pool = self._tiers[0].pool_groups[placement.pool_group].pools[placement.pool]
        first_row = placement.layer_offset * placement.expansion if mode == PageIndexMode.SHARED else 0
        whole = rows_view(pool, placement.stride, rows + first_row)
        return cast(PageView, whole[first_row:])  # type: ignore[index]

    def supports_index_mode(self, mode: PageIndexMode) -> bool | None:
        """PER_LAYER always; SHARED too unless scratch reuse is on, where it is per cache (None)."""
        mode = self._check_mode(mode)
        if mode == PageIndexMode.SHARED and self._config.enable_swa_scratch_reuse:
            return None
        return True

    def get_storage_statistics(self, cache_level: SupportsIndex = GPU_LEVEL) -> list[StorageStatistics]:
        """Slot counts per pool group of one cache level (evictable: pages that can leave this level). On the
        scheduler thread between calls, dropped handles' caches are closed first, as ``get_usage`` does, so the two
        read the same moment; on another thread it closes nothing and counts their pages as in use."""
        level = self._check_level(cache_level)
        self._guard.settle()
        return self._store.statistics(level)

    def get_usage(self) -> list[PoolGroupUsage]:
        """Pages (and bytes) used / held / reusable / free per tier and pool group, warmest tier first, between two
        calls (dropped handles' caches closed first). Only on the scheduler thread (``RuntimeError`` on another:
        its counts would mix moments of a call; ``get_storage_statistics`` is the other thread's read)."""
        self._check_alive()
        guard = self._guard
        guard.enter_scheduler_read("KVCacheManager.get_usage")
        try:
            return usage_of(self._store)
        finally:
            guard.leave()

    def _placement(self, layer_id: SupportsIndex, role: str) -> BufferPlacement:
        self._check_alive()
        return self._layout.placement(as_int(layer_id, "layer_id"), role)

    def _resolve_base_mode(self, index_mode: PageIndexMode | None) -> PageIndexMode:
        if index_mode is None:
            if self._config.enable_swa_scratch_reuse:
                raise ValueError(
                    "index_mode=None (SHARED) is not allowed when SWA scratch reuse is enabled; pass "
                    "PageIndexMode.PER_LAYER"
                )
            return _SHARED
        return self._check_mode(index_mode)
