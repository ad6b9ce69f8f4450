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
    KVCacheManagerConfig,
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


def stored_keys(layers: list[LayerConfig], secret_key: bytes | None = None, **changed: Any) -> set[str]:
    """The keys one instance stores serving one prompt (full blocks of every layer group, SSM snapshots too);
    ``changed``: other values of ``KEYED`` fields."""
    store = MemoryStoreConfig()
    tpb: int = changed.pop("tokens_per_block", TPB)
    group = {"tensor_parallel_size": 4}  # room for the other rank KEYED tries
    remote = RemoteCacheTierConfig(0, store, **{"namespace": "keys", "secret_key": secret_key, **group, **changed})
    manager = KVCacheManager(make_config(
        layers, tiers=[GpuCacheTierConfig(8 << 20), remote], tokens_per_block=tpb, ssm_reuse_interval=2 * tpb
    ))
    tokens = list(range(1000, 1000 + 4 * tpb + 3))
    engine = FakeEngine(manager)
    cache = manager.create_kv_cache(input_tokens=tokens)
    assert cache.resume()
    for end in (2 * tpb, 4 * tpb, len(tokens)):  # chunks ending on the SSM interval take snapshots
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


# The manager and remote tier config fields a page's bytes depend on, each in every key (the layers' fields too:
# ``test_every_layer_config_field_changes_every_key``), and another value of each.
KEYED: dict[str, Any] = {
    "KVCacheManagerConfig.tokens_per_block": TPB // 2,
    "RemoteCacheTierConfig.namespace": "keys/bf16",  # what the layout cannot tell: weights, KV dtype, head order
    "RemoteCacheTierConfig.tensor_parallel_rank": 1,
    "RemoteCacheTierConfig.tensor_parallel_size": 2,  # rank r of a group of 16 holds another head than of 8
    "RemoteCacheTierConfig.secret_key": bytes(32),  # not the secret itself: a key space per secret
}
# Why each other field never changes a page's bytes (so instances differing in it share pages).
UNKEYED: dict[str, str] = {
    "KVCacheManagerConfig.layers": "every field of every layer is keyed (above)",
    "KVCacheManagerConfig.vocab_size": "checks token ids; the multimodal stand-in ids it shifts are in the block key",
    "KVCacheManagerConfig.cache_tiers": "where pages are kept (a cold-page codec with a remote tier is refused)",
    "KVCacheManagerConfig.backend": "NumPy or CuPy memory holding the same bytes",
    "KVCacheManagerConfig.enable_partial_reuse": "how much of a block is reused; only full blocks are stored",
    "KVCacheManagerConfig.ssm_reuse_interval": "which snapshots exist; one is the state after its whole prefix",
    "KVCacheManagerConfig.mamba_save_last_snapshot": "which snapshots exist",
    "KVCacheManagerConfig.commit_min_snapshot": "which snapshots exist",
    "KVCacheManagerConfig.snapshot_prefill_chunks": "which snapshots exist",
    "KVCacheManagerConfig.swa_scratch_reuse": "where out-of-window pages live while a chunk is computed",
    "KVCacheManagerConfig.enable_swa_scratch_reuse": "where out-of-window pages live while a chunk is computed",
    "KVCacheManagerConfig.reuse_match_backoff": "how much of a match is used",
    "KVCacheManagerConfig.text_only": "which tokens a cache takes",
    "KVCacheManagerConfig.max_util_for_resume": "admission",
    "KVCacheManagerConfig.admission_watermark": "admission",
    "KVCacheManagerConfig.constraints": "pool sizing",
    "KVCacheManagerConfig.typical_step": "pool sizing",
    "KVCacheManagerConfig.initial_pool_ratio": "pool sizing",
    "KVCacheManagerConfig.rebalance_min_sampled_kv_caches": "pool sizing",
    "KVCacheManagerConfig.rebalance_cooldown_secs": "pool sizing",
    "KVCacheManagerConfig.rebalance_ratio_threshold": "pool sizing",
    "KVCacheManagerConfig.enable_stats": "statistics",
    "KVCacheManagerConfig.enable_kv_events": "events",
    "KVCacheManagerConfig.max_kv_events": "events",
    "RemoteCacheTierConfig.quota": "this process's memory lent to the store",
    "RemoteCacheTierConfig.backend": "the store's client",
    "RemoteCacheTierConfig.write_through": "when pages are stored",
    "RemoteCacheTierConfig.retry_after_s": "back-off",
    "RemoteCacheTierConfig.bulk_write_back_deadline_s": "how long shutdown stores",
    "RemoteCacheTierConfig.previous_secret_keys": "read only: each checked with its own secret, stored under ours",
}


def test_every_config_field_is_keyed_or_says_why_pages_do_not_depend_on_it() -> None:
    """A field added to the manager or remote tier config fails here by name until it is in ``KEYED`` (another value
    changes every key) or ``UNKEYED`` (why instances differing in it may share pages)."""
    configs = (KVCacheManagerConfig, RemoteCacheTierConfig)
    fields = {f"{config.__name__}.{field.name}" for config in configs for field in dataclasses.fields(config)}
    listed = set(KEYED) | set(UNKEYED)
    assert fields == listed and not set(KEYED) & set(UNKEYED), sorted(fields ^ listed)


@pytest.mark.parametrize("name", list(KEYED))
def test_every_keyed_config_field_changes_every_key(base_keys: set[str], name: str) -> None:
    other = stored_keys(BASE, **{name.split(".")[1]: KEYED[name]})
    shared = len(other & base_keys)
    assert other and shared == 0, f"{name}: {shared} of {len(other)} key(s) shared with the base instance's"
