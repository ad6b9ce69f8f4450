"""One name per event concept (issue #38): a page moving to another tier is ``"updated"`` in ``KVEvent.kind``,
``KVCacheUpdatedData`` in the TensorRT-LLM-shaped event manager and a removal plus a store on the vLLM wire; the
README's vocabulary table says the same."""

from __future__ import annotations

from pathlib import Path

from tests.events_helpers import require_events_extra

require_events_extra()

from kv_cache_manager_v2 import (  # noqa: E402
    KV_EVENT_REMOVED,
    KV_EVENT_STORED,
    KV_EVENT_UPDATED,
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheManagerConfig,
    KVCacheRemovedData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    KVEvent,
)
from kv_cache_manager_v2.kv_events import BlockRemoved, BlockStored, EventTranslator, WireEvent  # noqa: E402

TPB = 4
README = Path(__file__).resolve().parents[1] / "README.md"


def test_each_kind_has_the_event_managers_class_of_the_same_name() -> None:
    classes = {KV_EVENT_STORED: KVCacheStoredData, KV_EVENT_REMOVED: KVCacheRemovedData, KV_EVENT_UPDATED: KVCacheUpdatedData}
    for kind, data_class in classes.items():
        assert data_class.__name__ == f"KVCache{kind.capitalize()}Data"
        assert hasattr(KVCacheEventManager, f"add_{kind}_event")
        assert f"`\"{kind}\"`" in README.read_text(encoding="utf-8")


def test_a_tier_move_is_updated_in_both_of_ours_and_removed_plus_stored_on_the_wire() -> None:
    events = KVCacheEventManager(1000)
    layers = [AttentionLayerConfig(0, [BufferConfig("key", 64)])]
    config = KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers, cache_tiers=[GpuCacheTierConfig(64 * 16), HostCacheTierConfig(64 * 64)],
        backend="cpu", enable_kv_events=True,
    )
    manager = KVCacheManager(config, event_manager=events)
    translator = EventTranslator.for_manager(manager)
    wire: list[WireEvent] = []
    ours: list[KVEvent] = []
    for start in range(0, 160, 32):  # more than the GPU holds: older blocks move to the host tier
        tokens = list(range(start, start + 32))
        cache = manager.create_kv_cache(None, tokens)
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        cache.close()
        latest = manager.get_latest_events()
        ours += latest
        wire += translator.translate(latest)
    events.flush_iteration_events()
    updated = [event for event in ours if event.kind == KV_EVENT_UPDATED]
    assert updated and all(event.level == 1 for event in updated)
    trtllm = [event.data for event in events.get_latest_events() if isinstance(event.data, KVCacheUpdatedData)]
    assert len(trtllm) == len(updated)
    assert {(data.cache_level.old_value, data.cache_level.new_value) for data in trtllm if data.cache_level} == {(0, 1)}
    assert sum(isinstance(e, BlockRemoved) and e.medium == "GPU" for e in wire) == len(updated)
    assert sum(isinstance(e, BlockStored) and e.medium == "CPU" for e in wire) == len(updated)
    manager.shutdown()
