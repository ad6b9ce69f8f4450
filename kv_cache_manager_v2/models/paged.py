"""The paged path: every key and value of every layer lives in the manager's pages, nowhere else.

Per step, after the driver has resized every scheduled cache, ``PagedKV.begin`` builds each layer group's page
tables for the whole batch in one call of the page-table kernel's NumPy twin (``convert_page_tables_reference``)
from the caches' base page indices (``get_base_page_indices``), their scratch descriptors (``get_scratch_desc``,
PER_LAYER mode so scratch blocks resolve to scratch slots) and the layers' ``PageIndexConverter`` parameters.
Sliding-window groups then get window-local tables: the stale blocks after the sink blocks (a spec's
``num_sink_tokens``; none in the GGUF models) are dropped (``get_num_front_blocks_removed``) and ``kv_page_offset``
says how many. ``attend`` (called by the model for each layer) writes the new
tokens' K and V with ``kv_append`` into the pages the full table names and computes paged attention through the
window-local table — the NumPy twins on the cpu backend, the CUDA kernels on the cuda backend. Scratch slots are
shared by the layers of a group: each layer writes and reads them before the next layer overwrites them.

Page layout (``kernels/kv_append.py``): one K or V page is ``[tokens_per_block, num_kv_heads, head_dim]`` of the
KV element type (fp32 on cpu, fp16 on cuda).
"""

from __future__ import annotations

import time
from typing import Sequence, cast

import numpy as np
import numpy.typing as npt

from .. import KVCache, KVCacheManager, PageIndexMode
from .._base.types import MAX_BLOCKS_PER_CACHE
from ..config import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    CacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheDesc,
    KVCacheManagerConfig,
    RemoteCacheTierConfig,
)
from ..kernels.attention import AttentionBatch, AttentionParams, paged_attention_cuda, paged_attention_reference
from ..kernels._checks import HostRows
from ..kernels.kv_append import kv_append_cuda, kv_append_reference
from ..kernels.page_table import convert_page_tables_reference, converter_params, pack_base_tables, pack_scratch
from .backend import Array, ArrayBackend
from .spec import ModelSpec

PER_LAYER = PageIndexMode.PER_LAYER
ROLES = ("key", "value")


def manager_config(
    spec: ModelSpec,
    backend: ArrayBackend,
    tokens_per_block: int,
    gpu_bytes: int,
    host_bytes: int,
    scratch: bool,
    typical_length: int,
    max_batch: int,
    remote: RemoteCacheTierConfig | None = None,
) -> KVCacheManagerConfig:
    """One attention layer per model layer with a K and a V buffer of ``tokens_per_block`` tokens each; Gemma's
    sliding-window layers form one layer group and its global layers another. ``typical_length`` is capped at the
    longest cache (``MAX_BLOCKS_PER_CACHE`` blocks): a step no cache can reach plans nothing more, and an option
    past 64 bits then reaches the check that names it instead of the planner's 64-bit ``KVCacheDesc``."""
    row_bytes = spec.num_kv_heads * spec.head_dim * np.dtype(backend.kv_dtype).itemsize
    layers = [
        AttentionLayerConfig(
            layer,
            [BufferConfig(role, tokens_per_block * row_bytes) for role in ROLES],
            spec.windows[layer],
            _sinks(spec, layer) or None,
        )
        for layer in range(spec.num_layers)
    ]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(gpu_bytes)]
    if host_bytes > 0:
        tiers.append(HostCacheTierConfig(host_bytes))
    if remote is not None:
        tiers.append(remote)
    length = min(max(2, typical_length), MAX_BLOCKS_PER_CACHE * tokens_per_block)
    return KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        layers=layers,
        cache_tiers=tiers,
        vocab_size=spec.vocab_size,
        backend=backend.name,
        enable_swa_scratch_reuse=scratch,
        typical_step=BatchDesc([KVCacheDesc(length, length - 1)] * max_batch),
    )


class _LayerTables:
    """One layer's inputs for one step: K and V page indices of each new token, and the attention batch."""

    def __init__(self, key_rows: npt.NDArray[np.int64], value_rows: npt.NDArray[np.int64], batch: AttentionBatch):
        self.key_rows = key_rows
        self.value_rows = value_rows
        self.batch = batch


class PagedKV:
    """A ``KVCacheManager`` sized for one model, and the page tables of the step being computed.

    Time spent building tables, appending K/V and in attention is accumulated in ``tables_s``, ``append_s`` and
    ``attention_s`` (the driver times the manager calls itself).
    """

    def __init__(self, spec: ModelSpec, backend: ArrayBackend, config: KVCacheManagerConfig) -> None:
        self.spec = spec
        self.backend = backend
        self.manager: KVCacheManager = KVCacheManager(config)
        manager = self.manager
        self.tokens_per_block: int = manager.tokens_per_block
        self.params: list[AttentionParams] = [
            AttentionParams(
                num_kv_heads=spec.num_kv_heads,
                tokens_per_block=self.tokens_per_block,
                element_type=backend.kv_element_type,
                sliding_window_size=spec.windows[layer],
                num_sink_tokens=_sinks(spec, layer),
            )
            for layer in range(spec.num_layers)
        ]
        self.groups: list[list[int]] = [list(layers) for layers in manager.layer_grouping]
        self.windowed: list[bool] = [spec.windows[layers[0]] is not None for layers in self.groups]
        self.sink_blocks: list[int] = [self.params[layers[0]].sink_blocks for layers in self.groups]
        self.converter_rows: list[npt.NDArray[np.int32]] = [
            converter_params(
                [manager.get_page_index_converter(layer, role) for layer in layers for role in ROLES], PER_LAYER
            )
            for layers in self.groups
        ]
        self._tables: list[_LayerTables | None] = [None] * spec.num_layers
        self._positions = np.zeros(0, dtype=np.int64)
        self._pages: list[tuple[object, object]] = []
        self.tables_s: float = 0.0
        self.append_s: float = 0.0
        self.attention_s: float = 0.0

    def close(self) -> None:
        self.manager.shutdown()

    def begin(self, caches: Sequence[KVCache]) -> None:
        """Tables for one forward pass over ``[history_length, capacity)`` of each (active, resized) cache."""
        start = time.perf_counter()
        manager = self.manager
        counts = [cache.capacity - cache.history_length for cache in caches]
        query_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._positions = np.concatenate(
            [np.arange(cache.history_length, cache.capacity, dtype=np.int64) for cache in caches]
        )
        sequence_of_token = np.repeat(np.arange(len(caches)), counts)
        block_of_token = self._positions // self.tokens_per_block
        for group, layers in enumerate(self.groups):
            bases, num_blocks = pack_base_tables([cache.get_base_page_indices(group) for cache in caches])
            ranges, slots = pack_scratch([cache.get_scratch_desc(group) for cache in caches])
            tables = convert_page_tables_reference(bases, num_blocks, ranges, slots, self.converter_rows[group])
            removed = np.array(
                [cache.get_num_front_blocks_removed(group) if self.windowed[group] else 0 for cache in caches],
                dtype=np.int64,
            )
            width = int(tables.shape[2])
            # Window-local: entry i of row s is block i for the sink blocks, block i + removed[s] after them.
            entries = np.arange(width)[None, :]
            columns = entries + np.where(entries < self.sink_blocks[group], 0, removed[:, None])
            local = np.where(
                columns < width,
                np.take_along_axis(tables, np.minimum(columns, width - 1)[None, :, :].repeat(len(tables), 0), axis=2),
                -1,
            )
            if int(np.min(tables[:, sequence_of_token, block_of_token], initial=0)) < 0:
                raise RuntimeError(f"layer group {group}: a token of this step has no page to be written to")
            for position, layer in enumerate(layers):
                key_table, value_table = tables[2 * position], tables[2 * position + 1]
                batch = AttentionBatch(
                    query_start, self._positions, local[2 * position], local[2 * position + 1], removed
                )
                self._tables[layer] = _LayerTables(
                    key_table[sequence_of_token, block_of_token].astype(np.int64),
                    value_table[sequence_of_token, block_of_token].astype(np.int64),
                    batch,
                )
        self._pages = [
            (manager.get_page_view(layer, "key", PER_LAYER), manager.get_page_view(layer, "value", PER_LAYER))
            for layer in range(self.spec.num_layers)
        ]
        self.tables_s += time.perf_counter() - start

    def attend(self, layer: int, q: Array, k: Array, v: Array) -> Array:
        """Write this pass's K/V of ``layer`` into its pages, then attend through the page tables."""
        tables = self._tables[layer]
        if tables is None:
            raise RuntimeError("PagedKV.begin must build the step's tables before attend")
        key_pages, value_pages = self._pages[layer]
        per_page = self.tokens_per_block
        dtype = self.backend.kv_dtype
        keys, values, query = k.astype(dtype), v.astype(dtype), q.astype(dtype)
        start = time.perf_counter()
        if self.backend.name == "cpu":
            key_rows, value_rows = cast(HostRows, key_pages), cast(HostRows, value_pages)
            kv_append_reference(key_rows, tables.key_rows, self._positions, keys, per_page)
            kv_append_reference(value_rows, tables.value_rows, self._positions, values, per_page)
            middle = time.perf_counter()
            out = paged_attention_reference(query, key_rows, value_rows, tables.batch, self.params[layer])
        else:
            kv_append_cuda(key_pages, tables.key_rows, self._positions, keys, per_page)
            kv_append_cuda(value_pages, tables.value_rows, self._positions, values, per_page)
            middle = time.perf_counter()
            out = cast(Array, paged_attention_cuda(query, key_pages, value_pages, tables.batch, self.params[layer]))
        self.backend.synchronize()
        end = time.perf_counter()
        self.append_s += middle - start
        self.attention_s += end - middle
        return out.astype(np.float32)


def _sinks(spec: ModelSpec, layer: int) -> int:
    """Layer ``layer``'s sink tokens: the spec's, on a sliding-window layer only."""
    return spec.num_sink_tokens if spec.windows[layer] is not None else 0
