"""Every public value type pickles and copies (``copy.copy``, ``copy.deepcopy``) in both modes (SPEC §11).

An engine ships events and statistics to a router or a metrics process, and keeps copies of configs. Compiled,
a frozen dataclass's default pickling (restore each attribute on a blank object) hit its ``__setattr__`` and
raised ``FrozenInstanceError`` (issue #35, item 16). The test walks the exported names of the package and of
``disagg``: each class is either a value with an example below (made through the public API where the library
makes it) or in ``NOT_VALUES`` with the reason, so a new export cannot be forgotten; the subpackages an engine
imports (``kv_events``, ``batching``, ``testing``) are walked too. ``tools/mode_parity.py``'s ``pickles`` scenario
loads each example's pickle in the other mode.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import importlib
import inspect
import os
import pickle
import sys
from pathlib import Path
from typing import Callable

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    BufferId,
    CacheTier,
    DataRole,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HalfOpenRange,
    HostCacheTierConfig,
    InvariantError,
    IterationStats,
    KVCacheCreatedData,
    KVCacheDesc,
    KVCacheEvent,
    KVCacheEventDiff,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheRemovedData,
    KVCacheRequest,
    KVCacheCommitState,
    KVCacheStatus,
    KVCacheStoredBlockData,
    KVCacheStoredData,
    KVCacheUpdatedData,
    KVEvent,
    LayerId,
    MooncakeStoreConfig,
    OutOfMemoryError,
    OutOfPagesError,
    PageContentLostError,
    PageIndexMode,
    PoolGroupUsage,
    ReuseByTier,
    Refusal,
    RemoteCacheTierConfig,
    RemoteStoreError,
    RemoteTierStatistics,
    ReuseScope,
    ScratchDesc,
    SsmSnapshotIterationStatsDelta,
    AggregatedPageDesc,
    ExpandedBuffer,
    MemAddress,
    LayerGroupId,
    SsmLayerConfig,
    SwaScratchReuseConfig,
    UniqueToken,
    gen_multimodal_cache_key_tokens,
)
from kv_cache_manager_v2 import disagg
from kv_cache_manager_v2.batching import BatchingOptions
from kv_cache_manager_v2.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Gap,
    LayerGroupSpec,
    ReceivedBatch,
    Restart,
    WireBlock,
    WireFormatError,
)
from kv_cache_manager_v2.testing import ContentError
from tests.helpers import gemma_like_layers, make_config
from tests.public_parameters import ENGINE_FACING_PACKAGES

# Exported classes that are not values, with the reason.
NOT_VALUES: dict[str, str] = {
    "KVCache": "a handle on a live cache: refuses copy and pickle (issue #35 item 6)",
    "_KVCache": "TensorRT-LLM's name of KVCache",
    "KVCacheManager": "owns pools of memory and live caches",
    "CacheHold": "a hold on a live cache, released once: refuses copy and pickle",
    "PlannedDropHandle": "a pending action on a live manager's pages, applied once",
    "KVCacheEventManager": "the manager's event sink, with a lock and a condition variable",
    "LifeCycle": "the manager's rules object for a layer group, handed to priority callbacks",
    "RemoteStore": "a Protocol a store backend implements",
    "ColdPageCodec": "a Protocol a cold-page codec implements",
    "RemoteStoreConfig": "a Protocol a store backend's config implements",
    "PageView": "a Protocol the page arrays (NumPy or CuPy) satisfy",
    "KVSender": "an end of a NIXL connection",
    "KVReceiver": "an end of a NIXL connection",
    "NixlEndpoint": "a NIXL agent with registered memory",
    "ReceivedKV": "what KVReceiver.receive hands back alongside the caller's open cache",
    "TransferPlan": "its pickle round trip (no longer local, so not equal) is tests/test_disagg.py's",
    "LocalEndpoints": "the two managers and caches of a local plan",
    "SourcePlan": "made by plan_source from live caches; tests/test_disagg.py and test_nixl_transport.py ship it",
    "EventSubscriber": "a ZeroMQ subscriber: sockets and the gaps it is replaying",
    "ZmqEventPublisher": "ZeroMQ sockets and the thread sending on them",
    "KVEventsPublisher": "a live manager's publisher: sockets and a thread",
    "EventTranslator": "what one manager's subscribers were told so far, fed every event in order",
    "PrefixIndex": "a router's index, fed every batch in order",
    "BatchEngine": "a Protocol an engine implements",
    "BatchedRequest": "a request's scheduling state, which the batcher changes every step",
    "ContinuousBatcher": "drives a live manager",
    "StepBoundaryInterrupts": "holds the process's signal handlers while installed",
    "FakeEngine": "reads and writes a live manager's pages",
    "MemoryStore": "a client of a MemoryStoreConfig's shared objects",
    "MemoryStoreConfig": "every manager given it shares its one dict of objects: a copy would be another store",
    "ContextualTokens": "an incremental digest (a hashlib state) of the tokens given so far",
}


def produced_by_a_manager() -> list[object]:
    """Values the library makes: statistics, events, a page index converter, a multimodal digest."""
    event_manager = KVCacheEventManager(100)
    manager = KVCacheManager(make_config(gemma_like_layers(), enable_kv_events=True), event_manager=event_manager)
    cache = manager.create_kv_cache(None, list(range(100)))
    assert cache.resume() and cache.resize(100, 0)
    cache.commit(list(range(100)))
    cache.close()
    event_manager.flush_iteration_events()
    events = event_manager.get_latest_events()
    assert {type(event.data) for event in events} >= {KVCacheCreatedData, KVCacheStoredData}
    values: list[object] = [
        *manager.get_storage_statistics(0),
        *manager.get_and_reset_iteration_stats().values(),
        *manager.get_iteration_stats(),
        manager.get_committed_stats(),
        manager.movement_counters,
        manager.get_page_index_converter(0, DataRole("key")),
        *events,
        gen_multimodal_cache_key_tokens(1000, hashlib.sha256(b"image").digest(), 4, uuid="img")[0],
    ]
    manager.shutdown()
    return values


def made_directly() -> list[object]:
    mooncake = MooncakeStoreConfig("master:50051", "http://meta:8080/metadata", local_hostname="host")
    descriptor = disagg.TransferDescriptor(0, 1, 0, 0, 5, 6, 4096, 1 << 20, 2 << 20)
    return [
        AttentionLayerConfig(0, [BufferConfig("key", 64), BufferConfig("value", 64)], 128, 4),
        SsmLayerConfig(1, [BufferConfig("ssm_state", 256)]),
        make_config(gemma_like_layers(), initial_pool_ratio=[1.0, 2.0], swa_scratch_reuse=SwaScratchReuseConfig(8),
                    typical_step=BatchDesc([KVCacheDesc(256, 128)], 64)),
        HostCacheTierConfig(1 << 20),
        DiskCacheTierConfig(1 << 20, "/tmp"),
        GpuCacheTierConfig(1 << 20, 2 << 20),
        mooncake,
        RemoteCacheTierConfig(0, mooncake, namespace="model", retry_after_s=1.5),
        RemoteTierStatistics(),
        Refusal("KVCache.resize", CacheTier.GPU_MEM, 0, 0, 3, 1, 10, True, "short"),
        PoolGroupUsage(0, CacheTier.GPU_MEM, 0, 4096, 10, 4, 3, 2, 1),
        ReuseByTier(48, (CacheTier.GPU_MEM, CacheTier.HOST_MEM), (32, 16), (0, 2), (1, 0)),
        KVCacheRequest([1, 2, 3], id=7, capacity=16),
        ReuseScope(3, b"salt"),
        HalfOpenRange(2, 9),
        BufferId(LayerId(0), DataRole("key")),
        ScratchDesc(HalfOpenRange(0, 2), (4, 5)),
        SsmSnapshotIterationStatsDelta(2, 1, 1, 64, 10, 1, 0),
        ExpandedBuffer(BufferId(LayerId(1), DataRole("value")), 2),
        AggregatedPageDesc(MemAddress(4096), 512, 2048, LayerGroupId(1), [ExpandedBuffer(BufferId(LayerId(1), DataRole("key")), 1)]),
        IterationStats(0, allocated_pages=3),
        KVEvent(1, "stored", 0, b"key", None, (1, 2, b"mm"), ReuseScope(1), 0, 35),
        UniqueToken("ab", 1),
        KVCacheStoredBlockData(b"h", [UniqueToken(5)], 0, 35, mm_keys=[(b"d", 0, "u")], lora_id=2),
        KVCacheEvent(3, KVCacheRemovedData([b"a", b"b"]), 128, layer_group_id=1, layer_group_kind="sliding_window"),
        KVCacheEvent(4, KVCacheUpdatedData(b"h", KVCacheEventDiff(0, 1), None), 0),
        CacheTier.HOST_MEM,
        PageIndexMode.PER_LAYER,
        KVCacheStatus.SUSPENDED,
        KVCacheCommitState.STOPPED,
        OutOfPagesError("no room"),
        OutOfMemoryError("no memory"),
        PageContentLostError(5, "pages lost their content"),
        InvariantError("broken"),
        RemoteStoreError("down"),
        disagg.KVSlice(160, HalfOpenRange(32, 160)),
        disagg.GroupTransfer(0, "full_attention", 32, 1, 1, 5, 4, 4096),
        descriptor,
        disagg.SourceBlock(0, 1, 0, 0, 5, 4096, 1 << 20),
        disagg.PrefillRequest(3, list(range(64)), [0, 32]),
        disagg.PrefillRequest(4, [1, 2], [0, 0], ReuseScope(lora_id=2, salt=b"tenant")),
        disagg.KVFormat("bf16", "llama@main", "NHD 8x128", 1, 2),
        disagg.TransferError("peer gone"),
        EventBatch(1.5, (
            BlockStored((7, 8), None, (1, 2, 3, 4), 4, 3, "GPU", "adapter", ((b"d", 0),), 1, "sliding_window", 128),
            BlockRemoved((b"h",), "CPU", 0),
            AllBlocksCleared(),
        ), 2),
        ReceivedBatch(4, EventBatch(2.0, ()), replayed=True),
        Gap(3, 5, 1),
        Restart(9, 0),
        LayerGroupSpec(1, "sliding_window", 128),
        WireBlock((1, 2, 3, 4), ((b"d", 0),)),
        WireFormatError("not a batch"),
        BatchingOptions(chunk=128, max_batch=4, snapshot_block=2, probe_reuse=True),
        ContentError("wrong content"),
    ]


def with_parts(values: list[object]) -> list[object]:
    """``values`` and, recursively, the fields of the dataclasses among them and the items of their lists."""
    result: list[object] = []
    pending = list(values)
    while pending:
        value = pending.pop()
        result.append(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            pending.extend(getattr(value, part.name) for part in dataclasses.fields(value))
        elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            pending.extend(value)
    return [value for value in result if str(type(value).__module__).startswith("kv_cache_manager_v2")]


def pickled(value: object) -> object:
    return pickle.loads(pickle.dumps(value))


def state(value: object) -> object:
    """What two values must agree on: equality where the class defines it, else the public attributes."""
    if isinstance(value, BaseException):
        return (type(value), value.args)
    if type(value).__eq__ is not object.__eq__:
        return value
    names = [name for name in dir(value) if not name.startswith("_")]
    return (type(value), {name: getattr(value, name) for name in names if not callable(getattr(value, name))})


def assert_round_trips(value: object) -> None:
    """``value`` pickles, copies and deep-copies to an object of its type with its state."""
    round_trips: list[tuple[str, Callable[[object], object]]] = [
        ("pickle", pickled), ("copy", copy.copy), ("deepcopy", copy.deepcopy)
    ]
    for name, round_trip in round_trips:
        try:
            again = round_trip(value)
        except Exception as error:  # noqa: BLE001 - the assertion names the value and the failure
            raise AssertionError(f"{name} of {value!r} failed: {error!r}") from error
        assert type(again) is type(value), (name, value)
        assert state(again) == state(value), (name, value, again)


def test_every_public_value_pickles_and_copies() -> None:
    values = with_parts(produced_by_a_manager() + made_directly())
    for value in values:
        assert_round_trips(value)
    digest = next(value for value in values if isinstance(value, kv_cache_manager_v2.MultimodalDigest))
    assert pickle.loads(pickle.dumps(digest)).uuid == "img" and copy.deepcopy(digest).uuid == "img"


def exported_classes() -> dict[str, type]:
    names = {name: getattr(kv_cache_manager_v2, name) for name in dir(kv_cache_manager_v2)}
    names.update({name: getattr(disagg, name) for name in dir(disagg) if not name.startswith("__")})
    for package in ENGINE_FACING_PACKAGES:
        module = importlib.import_module(package)
        names.update({name: getattr(module, name) for name in getattr(module, "__all__")})
    return {
        name: value
        for name, value in names.items()
        if inspect.isclass(value) and str(value.__module__).startswith("kv_cache_manager_v2")
    }


def test_every_exported_class_is_a_value_with_an_example_or_says_why_not() -> None:
    covered = {type(value) for value in with_parts(produced_by_a_manager() + made_directly())}
    missing = [
        name
        for name, cls in exported_classes().items()
        if name not in NOT_VALUES and cls not in covered and not name.startswith("_")
    ]
    assert missing == [], f"give these exported classes an example in tests/test_value_types.py: {missing}"
    stale = [name for name in NOT_VALUES if name not in exported_classes()]
    assert stale == [], stale


def frozen_dataclasses_pickled_field_by_field() -> list[str]:
    """Frozen dataclasses of the compiled modules that would pickle and copy the default way (a blank object, then
    each field set: refused compiled by the frozen ``__setattr__``): neither a ``FrozenValue`` nor with their own
    ``__reduce__``, nor kept interpreted (``mypyc_attr(native_class=False)``). Read from the sources (the rule is
    about the compiled mode, checked in both)."""
    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo))
    previous = os.getcwd()
    os.chdir(repo)  # compiled_sources globs from the repository root
    try:
        from setup_mypyc import compiled_sources

        sources = compiled_sources()
    finally:
        os.chdir(previous)
        sys.path.remove(str(repo))
    assert len(sources) > 50, sources
    found: list[str] = []
    for path in sources:
        for node in ast.walk(ast.parse((repo / path).read_text(), path)):
            if not isinstance(node, ast.ClassDef):
                continue
            decorators = [ast.unparse(decorator) for decorator in node.decorator_list]
            frozen = any(d.startswith("dataclass(") and "frozen=True" in d for d in decorators)
            interpreted = any("native_class=False" in d for d in decorators)
            own_reduce = any(isinstance(item, ast.FunctionDef) and item.name == "__reduce__" for item in node.body)
            if frozen and not interpreted and not own_reduce and "FrozenValue" not in map(ast.unparse, node.bases):
                found.append(f"{path}: {node.name}")
    return found


def test_every_compiled_frozen_dataclass_pickles_through_its_constructor() -> None:
    assert frozen_dataclasses_pickled_field_by_field() == []
