"""The manager's events on the wire: hybrid (Gemma preset) groups carry their kinds and window, tier moves become
removed+stored in the new medium, clear and shutdown send AllBlocksCleared, scopes and multimodal digests reach
lora_id / extra_keys, and the index rebuilt from a simulator run's stream agrees with ``probe_reuse``."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from tests.events_helpers import TCP_ANY_PORT, require_events_extra

require_events_extra()

from kv_cache_manager_v2 import (  # noqa: E402
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    ReuseScope,
)
from kv_cache_manager_v2._observe.events import KVEvent  # noqa: E402
from kv_cache_manager_v2.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventSubscriber,
    EventTranslator,
    KVEventsPublisher,
    PrefixIndex,
    WireEvent,
    wire_blocks,
)
from kv_cache_manager_v2.sim.options import SimulatorOptions, build_config  # noqa: E402
from kv_cache_manager_v2.sim.presets import preset_config  # noqa: E402
from kv_cache_manager_v2.sim.scheduler import Simulation  # noqa: E402
from kv_cache_manager_v2.sim.simulator import build_workload  # noqa: E402
from tests.steady_state import traced_growth  # noqa: E402

TPB = 4


def small_manager(host: bool = False, vocab_size: int | None = None) -> KVCacheManager:
    layers = [AttentionLayerConfig(0, [BufferConfig("key", 64)]), AttentionLayerConfig(1, [BufferConfig("key", 64)], sliding_window_size=8)]
    tiers = [GpuCacheTierConfig(64 * 64)] + ([HostCacheTierConfig(64 * 64)] if host else [])
    return KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, layers=layers, cache_tiers=tiers, backend="cpu",
                                               enable_kv_events=True, vocab_size=vocab_size))



def serve(manager: KVCacheManager, tokens: list[int | bytes], scope: ReuseScope | None = None) -> None:
    cache = manager.create_kv_cache(scope, tokens)
    assert cache.resume() and cache.resize(len(tokens))
    cache.commit(tokens[cache.num_committed_tokens :])
    cache.close()


def test_a_publisher_needs_kv_events_enabled(tmp_path: Path) -> None:
    """README: ``KVEventsPublisher`` needs ``enable_kv_events=True``. Without it the manager records nothing to send,
    so the publisher is refused naming the setting, before it binds its endpoint, rather than publishing silence."""
    layers = [AttentionLayerConfig(0, [BufferConfig("key", 64)])]
    manager = KVCacheManager(KVCacheManagerConfig(tokens_per_block=TPB, layers=layers, backend="cpu",
                                                  cache_tiers=[GpuCacheTierConfig(64 * 64)]))
    endpoint = tmp_path / "events"
    with pytest.raises(ValueError, match=r"KVCacheManagerConfig\.enable_kv_events=True"):
        KVEventsPublisher(manager, f"ipc://{endpoint}")
    assert not endpoint.exists()  # nothing bound
    serve(manager, list(range(12)))  # the manager goes on serving
    assert manager.probe_reuse(None, list(range(12))) == 12
    manager.shutdown()

def test_gemma_preset_events_carry_group_kinds_and_window() -> None:
    config = dataclasses.replace(preset_config("gemma", [GpuCacheTierConfig(256 << 20)], backend="cpu"), enable_kv_events=True)
    manager = KVCacheManager(config)
    try:
        translator = EventTranslator.for_manager(manager)
        serve(manager, list(range(100)))
        stored = [e for e in translator.translate(manager.get_latest_events()) if isinstance(e, BlockStored)]
        kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
        assert kinds == {(0, "sliding_window", 1024), (1, "full_attention", None)}
        assert len(stored) == 2 * (100 // 32)  # full blocks only, one per group
        only_full = EventTranslator.for_manager(manager, full_attention_only=True)
        serve(manager, list(range(1000, 1100)))
        assert {e.group_idx for e in only_full.translate(manager.get_latest_events()) if isinstance(e, BlockStored)} == {1}
    finally:
        manager.shutdown()


def test_moves_between_tiers_and_clear_reach_the_wire() -> None:
    manager = small_manager(host=True)
    sent: list[WireEvent] = []
    publisher = KVEventsPublisher(manager, TCP_ANY_PORT, clock=lambda: 0.0)
    translator = EventTranslator.for_manager(manager)  # sees what the publisher is handed, for the checks below

    def publish() -> None:
        drained = manager.get_latest_events()
        publisher.publish_pending(drained)
        sent.extend(translator.translate(drained))

    for start in range(0, 400, 40):  # more than the GPU holds: older blocks go to the host tier
        publish()
        serve(manager, list(range(start, start + 40)))
    publish()
    mediums = {(type(e).__name__, e.medium) for e in sent if isinstance(e, (BlockStored, BlockRemoved))}
    assert ("BlockRemoved", "GPU") in mediums and ("BlockStored", "CPU") in mediums
    index = PrefixIndex()
    index.apply(EventBatch(0.0, tuple(sent)))
    assert index.held_blocks(0, {"GPU"}) and index.held_blocks(0, {"CPU"})
    for start in range(0, 400, 40):
        prompt = list(range(start, start + 40))
        assert index.reusable_tokens(wire_blocks(manager, None, prompt)) == manager.probe_reuse(None, prompt)
    assert publisher.wait_sent()  # the subscriber below joins after these batches
    subscriber = EventSubscriber(publisher.endpoint)
    time.sleep(0.3)
    try:
        publisher.clear_reusable_blocks()  # no live cache: everything went, one AllBlocksCleared says it
        received = subscriber.receive(5000)
        assert received is not None and received.batch.events == (AllBlocksCleared(),)
        publisher.shutdown()
        final = subscriber.receive(5000)
        assert final is not None and final.seq == received.seq + 1 and final.batch.events == (AllBlocksCleared(),)
    finally:
        subscriber.close()
        manager.shutdown()


def test_scope_and_multimodal_keys_on_the_wire() -> None:
    manager = small_manager(vocab_size=1000)
    try:
        translator = EventTranslator.for_manager(manager, lora_names={7: "adapter-7"})
        scope = ReuseScope(lora_id=7, salt="tenant")
        digest = b"\x01\x02".ljust(32, b"\x00")  # multimodal digests are 32 bytes
        image = manager.gen_multimodal_cache_key_tokens(digest, 3)
        serve(manager, [5, *image, 6, 7, 8, 9], scope)
        stored = [e for e in translator.translate(manager.get_latest_events()) if isinstance(e, BlockStored)]
        first = [e for e in stored if e.group_idx == 0]
        assert [e.lora_id for e in first] == [7, 7] and {e.lora_name for e in first} == {"adapter-7"}
        assert first[0].parent_block_hash is None and first[1].parent_block_hash == first[0].block_hashes[0]
        assert first[0].token_ids == (5, 1000, 1001, 1002) and first[0].extra_keys == ((digest.hex(), "tenant"),)
        assert first[1].extra_keys == (None,)
        index = PrefixIndex()
        index.apply(EventBatch(0.0, tuple(stored)))
        prompt = [5, *image, 6, 7, 8, 9]
        assert index.reusable_tokens(wire_blocks(manager, scope, prompt), lora_id=7) == 8
        assert index.reusable_tokens(wire_blocks(manager, ReuseScope(lora_id=7), prompt), lora_id=7) == 0
    finally:
        manager.shutdown()


def test_index_from_a_simulator_run_agrees_with_probe_reuse() -> None:
    options = SimulatorOptions(preset="gemma", num_requests=12, check=False, backend="cpu", gpu_mib=96, host_mib=192)
    workload = build_workload(options)
    config = dataclasses.replace(build_config(options, None, [600], kv_events=True), enable_partial_reuse=False)
    manager = KVCacheManager(config)
    publisher = KVEventsPublisher(manager, TCP_ANY_PORT, clock=lambda: 0.0)
    subscriber = EventSubscriber(publisher.endpoint)
    time.sleep(0.3)
    index = PrefixIndex()
    try:
        published: list[int] = []

        def forward(events: list[KVEvent]) -> None:
            seq = publisher.publish_pending(events)
            if seq is not None:
                published.append(seq)

        simulation = Simulation(options, manager, workload, forward)
        simulation.run()
        assert publisher.wait_sent()
        while (received := subscriber.receive(500)) is not None:
            index.apply(received.batch)
        assert subscriber.gaps == [] and index.batches == len(published) > 0
        assert index.group_kinds == {0: ("sliding_window", 1024), 1: ("full_attention", None)}
        checked = 0
        for request in workload.requests:
            prompt = request.token_ids()[: request.prompt_length]
            for length in (len(prompt), len(prompt) // 2):
                expected = manager.probe_reuse(None, prompt[:length])
                assert index.reusable_tokens(wire_blocks(manager, None, prompt[:length])) == expected
                checked += expected > 0
        assert checked > 0  # some prefixes are cached: the comparison is not all zeros
    finally:
        subscriber.close()
        publisher.shutdown()
        manager.shutdown()


def test_a_refused_clear_still_publishes_the_pending_events() -> None:
    manager = small_manager()
    publisher = KVEventsPublisher(manager, TCP_ANY_PORT, clock=lambda: 0.0)
    subscriber = EventSubscriber(publisher.endpoint)
    time.sleep(0.3)
    try:
        serve(manager, list(range(16)))
        tokens = list(range(100, 116))
        held = manager.create_kv_cache(None, tokens)
        try:
            publisher.clear_reusable_blocks()
            raise AssertionError("a clear with a cache open must be refused")
        except RuntimeError as error:
            assert "still open" in str(error)
        received = subscriber.receive(5000)
        assert received is not None
        stored = [e for e in received.batch.events if isinstance(e, BlockStored) and e.group_idx == 0]
        assert [token for e in stored for token in e.token_ids] == list(range(16))
        held.close()
        publisher.clear_reusable_blocks()  # accepted now: the tree's blocks go, one AllBlocksCleared says it
        cleared = subscriber.receive(5000)
        assert cleared is not None and cleared.batch.events == (AllBlocksCleared(),)
    finally:
        subscriber.close()
        publisher.shutdown()
        manager.shutdown()


def test_the_publisher_keeps_its_collaborators_private() -> None:
    """Issue #39: the manager, translator, clock and sockets a publisher works with are not names on it, nor the
    settings a translator was made with; its two counters are read-only."""
    manager = small_manager()
    publisher = KVEventsPublisher(manager, TCP_ANY_PORT, clock=lambda: 0.0)
    try:
        assert not any(hasattr(publisher, name) for name in ("manager", "translator", "clock", "sockets"))
        translator = EventTranslator.for_manager(manager)
        internal = ("groups", "mediums", "tokens_per_block", "published_groups", "lora_names", "multimodal_token_id")
        assert not any(hasattr(translator, name) for name in internal)
        assert translator.lost_events == 0 and translator.num_published_pages == 0
        serve(manager, list(range(8)))
        assert publisher.publish_pending() == 0 and publisher.wait_sent()
    finally:
        publisher.shutdown()
        manager.shutdown()


def test_publishing_once_the_manager_is_shut_down_sends_nothing_and_a_second_shutdown_does_nothing() -> None:
    """A reader thread publishes until told to stop, and the scheduler thread may shut the manager down before that
    (it cannot know when the reader drains next): the reader's next publish has nothing to send, the publisher's
    shutdown still says AllBlocksCleared, and a second shutdown (a ``finally``) does nothing."""
    manager = small_manager()
    publisher = KVEventsPublisher(manager, TCP_ANY_PORT, clock=lambda: 0.0)
    subscriber = EventSubscriber(publisher.endpoint)
    time.sleep(0.3)
    try:
        serve(manager, list(range(8)))
        assert publisher.publish_pending() == 0
        manager.shutdown()
        assert publisher.publish_pending() is None
        publisher.shutdown()
        sent = [subscriber.receive(5000) for _ in range(2)]
        assert [batch.seq for batch in sent if batch is not None] == [0, 1]
        assert sent[1] is not None and sent[1].batch.events == (AllBlocksCleared(),)
    finally:
        subscriber.close()
        publisher.shutdown()


def test_a_router_index_forgets_the_children_count_of_a_parent_it_never_knew() -> None:
    """A stored block whose parent the index never saw (a subscriber that joined late; a hybrid model's SSM
    group, whose blocks name parents no group stored) counts a child for that parent. Before: forgetting the
    child left the parent's count at 0 in the index for good, one entry per such parent (a hybrid model's
    stream grew it by ~3 per 150 requests; here 2,000 parents grew tracemalloc's total by 140,000+ bytes)."""
    index = PrefixIndex()
    made = [0]

    def store_and_remove(count: int) -> None:
        for _ in range(count):
            made[0] += 1
            parent, child = 2**62 + 2 * made[0], 2**62 + 2 * made[0] + 1  # not small ints: each one allocated
            stored = BlockStored((child,), parent, (1, 2, 3, 4), 4, None, "GPU", None)
            index.apply(EventBatch(0.0, (stored, BlockRemoved((child,), "GPU"))))

    assert traced_growth(store_and_remove, 2_000) < 20_000
