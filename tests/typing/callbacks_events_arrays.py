"""Typed usage of callbacks, event kinds and the page arrays (issue #39), checked by ``mypy --strict``
(``tests/test_typing.py``); never executed. Each ``# type: ignore[code]`` line must fail."""

from __future__ import annotations

from array import array
from typing import assert_type

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2 import (
    KV_EVENT_REMOVED,
    KV_EVENT_STORED,
    KV_EVENT_UPDATED,
    LAYER_GROUP_SSM,
    KVCache,
    KVCacheEvent,
    KVCacheEventManager,
    KVCacheIterationStatsDelta,
    KVCacheManager,
    KVEvent,
    KVEventKind,
    LayerGroupKind,
    LifeCycle,
    PageView,
    PriorityCallback,
)


def plain_int_priority(ordinal: int, life_cycle: LifeCycle) -> int:
    """What a user naturally writes: a plain int, no ``Priority(...)`` wrapper."""
    return 80 if life_cycle.window_size is None else 20


def numpy_priority(ordinal: int, life_cycle: LifeCycle) -> np.int64:
    return np.int64(ordinal % 100)


def callbacks(manager: KVCacheManager, prompt: list[int]) -> None:
    callback: PriorityCallback = plain_int_priority
    manager.create_kv_cache(None, prompt, custom_priority_callback=callback)
    manager.create_kv_cache(None, prompt, custom_priority_callback=numpy_priority)
    manager.create_kv_cache(None, prompt, custom_priority_callback=lambda ordinal, life_cycle: 35)
    manager.create_kv_cache(None, prompt, custom_priority_callback=lambda o, lc: "high")  # type: ignore[arg-type,return-value]


def event_kinds(event: KVEvent) -> str:
    assert_type(event.kind, KVEventKind)
    kinds: list[KVEventKind] = [KV_EVENT_STORED, KV_EVENT_REMOVED, KV_EVENT_UPDATED]
    wrong: KVEventKind = "evicted"  # type: ignore[assignment]
    if event.kind in kinds[:1]:
        return str(wrong)
    if event.kind == KV_EVENT_REMOVED:
        return "removed"
    return event.kind


def page_arrays(manager: KVCacheManager, cache: KVCache, table: npt.NDArray[np.int32]) -> None:
    view = manager.get_page_view(0, "key")
    assert_type(view, PageView)
    rows, stride = view.shape
    host = np.from_dlpack(view)  # the DLPack export NumPy, CuPy and torch all read
    assert_type(rows + stride, int)
    assert host.dtype == np.uint8
    cache.set_base_page_index_buf(0, 0, table)
    cache.set_base_page_index_buf(0, 0, array("i", [0] * 8))
    cache.set_base_page_index_buf(0, 0, None)
    cache.set_base_page_index_buf(0, 0, [0, 1, 2])  # type: ignore[arg-type]


def plain_int_outputs(manager: KVCacheManager) -> None:
    """Outputs an engine keeps in its own ``int``-typed containers, without casts."""
    grouping: list[list[int]] = manager.layer_grouping
    stats: dict[int, KVCacheIterationStatsDelta] = manager.get_and_reset_iteration_stats()
    by_group: dict[int, int] = {group: len(layers) for group, layers in enumerate(grouping)}
    assert_type(manager.get_layer_group_id(grouping[0][0]) in by_group, bool)
    assert stats is not None


def layer_group_kinds(event: KVCacheEvent, events: KVCacheEventManager) -> bool:
    assert_type(event.layer_group_kind, LayerGroupKind | None)
    events.set_layer_group_kinds({0: "full_attention", 1: LAYER_GROUP_SSM})
    events.set_layer_group_kinds({0: "attention"})  # type: ignore[dict-item]
    return event.layer_group_kind == LAYER_GROUP_SSM
