"""The typed surface downstream checkers see (issue #39) matches what runs: the exported Literal constants are the
values events carry, a priority callback may return a plain or NumPy int, a page view reads through DLPack, the
layer-id outputs hold plain ints, and a layer group kind outside the Literal is refused."""

from __future__ import annotations

import numpy as np
import pytest

from kv_cache_manager_v2 import (
    KV_EVENT_REMOVED,
    KV_EVENT_STORED,
    KV_EVENT_UPDATED,
    LAYER_GROUP_FULL_ATTENTION,
    LAYER_GROUP_SLIDING_WINDOW,
    LAYER_GROUP_SSM,
    KVCacheEventManager,
    KVCacheManager,
    LifeCycle,
)
from kv_cache_manager_v2._observe import event_manager as _event_manager
from kv_cache_manager_v2._observe import events as _events
from tests.helpers import attention, make_config

TPB = 4


def test_exported_constants_are_the_runtime_values() -> None:
    assert (KV_EVENT_STORED, KV_EVENT_REMOVED, KV_EVENT_UPDATED) == (_events.STORED, _events.REMOVED, _events.UPDATED)
    assert (LAYER_GROUP_FULL_ATTENTION, LAYER_GROUP_SLIDING_WINDOW, LAYER_GROUP_SSM) == _event_manager.LAYER_GROUP_KINDS


def test_events_carry_the_exported_kinds() -> None:
    events = KVCacheEventManager(100)
    config = make_config([attention(0), attention(1, window=8)], tokens_per_block=TPB, enable_kv_events=True)
    manager = KVCacheManager(config, events)
    cache = manager.create_kv_cache(None, list(range(8)))
    assert cache.resume() and cache.resize(8)
    cache.commit(list(range(8)))
    cache.close()
    assert {event.kind for event in manager.get_latest_events()} == {KV_EVENT_STORED}
    manager.clear_reusable_blocks()
    assert KV_EVENT_REMOVED in {event.kind for event in manager.get_latest_events()}
    events.flush_iteration_events()
    kinds = {event.layer_group_kind for event in events.get_latest_events() if event.layer_group_id is not None}
    assert kinds == {LAYER_GROUP_FULL_ATTENTION, LAYER_GROUP_SLIDING_WINDOW}
    manager.shutdown()


@pytest.mark.parametrize("answer", [80, np.int64(80), np.int32(80)], ids=["int", "int64", "int32"])
def test_a_priority_callback_may_return_any_integer(answer: int) -> None:
    manager = KVCacheManager(make_config([attention(0)], tokens_per_block=TPB))
    asked: list[int] = []

    def priority(ordinal: int, life_cycle: LifeCycle) -> int:
        asked.append(ordinal)
        return answer

    cache = manager.create_kv_cache(None, list(range(8)), custom_priority_callback=priority)
    assert cache.resume() and cache.resize(8)
    assert asked
    cache.close()
    manager.shutdown()


def test_a_page_view_reads_through_dlpack_and_layer_ids_are_plain_ints() -> None:
    manager = KVCacheManager(make_config([attention(0), attention(1)], tokens_per_block=TPB))
    view = manager.get_page_view(0, "key")
    pages = np.from_dlpack(view)
    assert pages.shape == view.shape and pages.dtype == np.uint8 and view.__dlpack_device__()[0] == 1
    assert all(type(layer) is int for layers in manager.layer_grouping for layer in layers)
    manager.shutdown()


def test_an_unknown_layer_group_kind_is_refused_and_nothing_is_set() -> None:
    events = KVCacheEventManager(10)
    events.set_layer_group_kinds({0: LAYER_GROUP_SSM})
    with pytest.raises(ValueError, match="kinds: unknown layer group kind 'attention'"):
        events.set_layer_group_kinds({0: LAYER_GROUP_FULL_ATTENTION, 1: "attention"})  # type: ignore[dict-item]
    events.add_created_event([4], [0])
    events.flush_iteration_events()
    assert [event.layer_group_kind for event in events.get_latest_events()] == [LAYER_GROUP_SSM]
