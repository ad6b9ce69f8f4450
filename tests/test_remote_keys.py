"""Every field of every layer config is part of the remote tier's keys: instances whose layer configs differ in any
one field never share an object. The manager derives coarser things from some fields (sink tokens in whole blocks,
layers grouped by window), so keys built from what it derives would let such models read each other's pages.

A field added to a layer or buffer config fails ``test_every_layer_config_field_changes_every_key`` until
``OTHER_VALUE`` says how to change it: decide then whether it changes the pages' meaning (it does unless proven).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    RemoteCacheTierConfig,
    SsmLayerConfig,
)
from kv_cache_manager_v2._model.layout import StorageLayout
from kv_cache_manager_v2._model.life_cycle import LifeCycleRegistry
from kv_cache_manager_v2._remote.objects import layout_key_prefixes
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.helpers import attention, make_config, ssm

TPB = 16
BASE: list[LayerConfig] = [attention(0, 512), attention(1, 512, window=32, sinks=4), ssm(2, 4096, 512)]
# How each field's value changes; a value the config accepts, in a model the manager accepts.
OTHER_VALUE: dict[str, Callable[[Any], Any]] = {
    "layer_id": lambda value: 100 + value,
    "sliding_window_size": lambda value: 1 + value,
    "num_sink_tokens": lambda value: 1 + value,  # 5 sink tokens: still 1 sink block, as 4 are
    "role": lambda value: f"{value}-other",
    "size": lambda value: 2 * value,
    "tokens_per_block_override": lambda value: TPB // 2 if value is None else None,
}


def stored_keys(layers: list[LayerConfig], secret_key: bytes | None = None) -> set[str]:
    """The keys one instance stores serving one prompt (full blocks of every layer group, SSM snapshots too)."""
    store = MemoryStoreConfig()
    remote = RemoteCacheTierConfig(0, store, namespace="keys", secret_key=secret_key)
    manager = KVCacheManager(make_config(
        layers, tiers=[GpuCacheTierConfig(8 << 20), remote], tokens_per_block=TPB, ssm_reuse_interval=2 * TPB
    ))
    tokens = list(range(1000, 1000 + 4 * TPB + 3))
    engine = FakeEngine(manager)
    cache = manager.create_kv_cache(input_tokens=tokens)
    assert cache.resume()
    for end in (2 * TPB, 4 * TPB, len(tokens)):  # chunks ending on the SSM interval take snapshots
        assert cache.resize(end)
        engine.step(cache, tokens)
        cache.commit(tokens[cache.num_committed_tokens : end])
    cache.close()
    manager.shutdown()
    return set(store.objects)


def variants() -> list[tuple[str, list[LayerConfig]]]:
    """BASE with one field of its windowed or SSM layer (or of that layer's first buffer) changed."""
    result: list[tuple[str, list[LayerConfig]]] = []
    for index in (1, 2):
        layer = BASE[index]
        for field in dataclasses.fields(layer):
            if field.name == "buffers":
                continue
            changed = dataclasses.replace(layer, **{field.name: OTHER_VALUE[field.name](getattr(layer, field.name))})
            result.append((f"{type(layer).__name__}.{field.name}", [*BASE[:index], changed, *BASE[index + 1 :]]))
        first = layer.buffers[0]
        for field in dataclasses.fields(first):
            if isinstance(layer, SsmLayerConfig) and field.name == "tokens_per_block_override":
                continue  # SSM buffers refuse one
            buffer = dataclasses.replace(first, **{field.name: OTHER_VALUE[field.name](getattr(first, field.name))})
            changed = dataclasses.replace(layer, buffers=[buffer, *layer.buffers[1:]])
            name = f"{type(layer).__name__}.buffers[0].{field.name}"
            result.append((name, [*BASE[:index], changed, *BASE[index + 1 :]]))
    return result


def test_every_field_has_another_value() -> None:
    """``OTHER_VALUE`` covers every field of the layer and buffer configs (a new one fails here first, by name)."""
    names = {f.name for cls in (AttentionLayerConfig, SsmLayerConfig, BufferConfig) for f in dataclasses.fields(cls)}
    assert names - {"buffers"} <= set(OTHER_VALUE), sorted(names - {"buffers"} - set(OTHER_VALUE))


@pytest.fixture(scope="module")
def base_keys() -> set[str]:
    keys = stored_keys(BASE)
    assert len(keys) >= 4 + 4 + 2  # the full and windowed groups' blocks, two snapshots
    return keys


@pytest.mark.parametrize(("name", "layers"), variants(), ids=[name for name, _ in variants()])
def test_every_layer_config_field_changes_every_key(base_keys: set[str], name: str, layers: list[LayerConfig]) -> None:
    other = stored_keys(layers)
    shared = len(other & base_keys)
    assert other and shared == 0, f"{name}: {shared} of {len(other)} key(s) shared with the base model's"


def key_prefixes(layout: StorageLayout, registry: LifeCycleRegistry) -> list[str]:
    config = RemoteCacheTierConfig(0, MemoryStoreConfig(), namespace="keys")
    return layout_key_prefixes(config, TPB, BASE, registry.life_cycles, layout, None)


def test_a_page_laid_out_otherwise_for_the_same_config_has_other_keys() -> None:
    """Where a buffer sits in a page is the package's choice, not the config's: a version placing layer 0's values
    before its keys (a swapped ``layer_offset``) writes other bytes for the same config, so its keys must differ
    from ours whatever ``FORMAT_VERSION`` says (a version bump forgotten with a layout change would serve wrong
    pages across a rolling upgrade)."""
    registry = LifeCycleRegistry(BASE, TPB)
    ours = key_prefixes(StorageLayout(BASE, registry, TPB), registry)
    other = StorageLayout(BASE, registry, TPB)
    keys, values = other.placement(0, "key"), other.placement(0, "value")
    keys.layer_offset, values.layer_offset = values.layer_offset, keys.layer_offset
    theirs = key_prefixes(other, registry)
    assert len(ours) == len(theirs) == 3 and not set(ours) & set(theirs), (ours, theirs)
