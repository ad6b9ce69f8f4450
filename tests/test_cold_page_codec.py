"""Cold-page codec tiers (issue #37): with ``cold_page_codec`` every tier after the first stores pages encoded,
grouped by their encoded size; moves across the hot/cold boundary encode and decode per layer group, and the
content an engine wrote survives the round trip (FakeEngine)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest

from kv_cache_manager_v2 import (
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    LayerId,
)
from kv_cache_manager_v2 import _introspection
from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2._manager.manager import _KVCache
from kv_cache_manager_v2._pages.page import Page
from kv_cache_manager_v2._storage.page_codec import PaddingColdPageCodec
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig, RemoteCacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine, MemoryStoreConfig
from tests.helpers import KIB, attention, make_config, ssm

TPB = 32
KV = 4 * KIB  # one layer's K and V each: 8 KiB a block per layer


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


class XorPaddingCodec(PaddingColdPageCodec):
    """Pads like the test codec and flips every byte, so a copy that skipped the codec would be caught both ways."""

    def encode(self, layer_group_id: int, pages: object, encoded: object) -> None:
        super().encode(layer_group_id, pages ^ 0xFF, encoded)  # type: ignore[operator]

    def decode(self, layer_group_id: int, encoded: object, pages: object) -> None:
        super().decode(layer_group_id, encoded, pages)
        pages ^= 0xFF  # type: ignore[operator]


def two_gpu_tiers(hot_blocks: int, cold_bytes: int, layers: Sequence[LayerConfig], *more: CacheTierConfig) -> list[CacheTierConfig]:
    return [GpuCacheTierConfig(hot_blocks * 2 * KV * len(layers)), GpuCacheTierConfig(cold_bytes), *more]


def computed(manager: KVCacheManager, engine: FakeEngine, tokens: list[int]) -> _KVCache:
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(len(tokens))
    engine.step(cache, tokens)
    assert cache.resize(len(tokens), len(tokens))  # computed: the tokens are history, which check() compares
    cache.suspend()
    return cache


def held_pages(manager: KVCacheManager, level: int) -> list[Page]:
    store = internals_of(manager).store
    return [page for queues in store.queues[level] for page in queues.held]


def slot_bytes(manager: KVCacheManager, page: Page) -> bytes:
    """A page's bytes in its slot: every pool of its pool group at its level, in pool order."""
    store = internals_of(manager).store
    sizes = store.tiers[page.level].pool_groups[page.pool_group].layout.pool_slot_bytes
    rows = [
        np.asarray(pool.array())[page.slot * size : (page.slot + 1) * size].tobytes()
        for pool, size in zip(store.pools(page.level, page.pool_group), sizes)
    ]
    return b"".join(rows)


# ------------------------------------------------------------------------------------------------ the codec
def test_padding_codec_round_trip_restores_the_exact_bytes_and_pads_with_zeros() -> None:
    codec = PaddingColdPageCodec({0: 12})
    pages = np.arange(16, dtype=np.uint8).reshape(2, 8)
    encoded = np.full((2, 12), 0xAB, dtype=np.uint8)
    codec.encode(0, pages, encoded)
    assert (encoded[:, :8] == pages).all() and (encoded[:, 8:] == 0).all()
    restored = np.zeros_like(pages)
    codec.decode(0, encoded, restored)
    assert (restored == pages).all()


def test_padding_codec_refuses_a_page_wider_than_its_encoded_size_and_writes_nothing() -> None:
    codec = PaddingColdPageCodec({0: 4})
    encoded = np.full((1, 4), 7, dtype=np.uint8)
    with pytest.raises(ValueError, match="more than the 4"):
        codec.encode(0, np.zeros((1, 8), dtype=np.uint8), encoded)
    assert (encoded == 7).all()


@pytest.mark.parametrize(
    ("sizes", "error", "match"),
    [({0: 0}, ValueError, r"encoded_bytes\[0\]"), ({0: True}, TypeError, r"encoded_bytes\[0\]"), ([4], TypeError, "mapping")],
)
def test_padding_codec_refuses_bad_sizes(sizes: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        PaddingColdPageCodec(sizes)  # type: ignore[arg-type]


def test_introspection_builds_the_padding_codec() -> None:
    codec = _introspection.create_test_padding_cold_page_codec({0: 64, 1: 32})
    assert (codec.encoded_page_bytes(0), codec.encoded_page_bytes(1)) == (64, 32)


# ------------------------------------------------------------------------------------------ configuration
def test_a_gpu_tier_after_the_first_needs_a_codec() -> None:
    layers = [attention(0, KV)]
    with pytest.raises(ValueError, match=r"cache_tiers\[1\].*cold_page_codec"):
        KVCacheManager(make_config(layers, tiers=two_gpu_tiers(4, 1 << 20, layers)))


class _ZeroSize(PaddingColdPageCodec):
    """A codec that declares a page of no bytes (the padding codec itself refuses to be built with one)."""

    def encoded_page_bytes(self, layer_group_id: int) -> int:
        return 0


@pytest.mark.parametrize(
    ("codec", "match"),
    [
        (_ZeroSize({0: 1}), r"encoded_page_bytes\(0\) must be positive"),
        (PaddingColdPageCodec({1: 4 * KIB}), "no encoded size for layer group 0"),
    ],
)
def test_codec_sizes_are_checked_for_every_layer_group(codec: PaddingColdPageCodec, match: str) -> None:
    layers = [attention(0, KV)]
    config = make_config(layers, tiers=two_gpu_tiers(4, 1 << 20, layers))
    with pytest.raises(ValueError, match=match):
        KVCacheManager(config, cold_page_codec=codec)


def test_a_codec_needs_a_tier_to_encode_into_and_no_remote_tier() -> None:
    layers = [attention(0, KV)]
    codec = PaddingColdPageCodec({0: 8 * KIB})
    with pytest.raises(ValueError, match="cold_page_codec needs a cache tier after the first"):
        KVCacheManager(make_config(layers, gpu_quota=1 << 20), cold_page_codec=codec)
    remote = make_config(layers, tiers=[*two_gpu_tiers(4, 1 << 20, layers), RemoteCacheTierConfig(0, MemoryStoreConfig(), "codec")])
    with pytest.raises(ValueError, match="remote tier"):
        KVCacheManager(remote, cold_page_codec=codec)
    with pytest.raises(TypeError, match="cold_page_codec must be a ColdPageCodec"):
        KVCacheManager(make_config(layers, tiers=two_gpu_tiers(4, 1 << 20, layers)), cold_page_codec=object())  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------- grouping
def test_cold_tier_merges_layer_groups_with_equal_encoded_sizes_and_splits_others() -> None:
    # Hot: full (8 KiB K/V) and window 64 (4 KiB K/V) differ; windows 64 and 96 share a pool group.
    layers = [attention(0, 2 * KV), attention(1, KV, window=64), attention(2, KV, window=96)]
    config = make_config(layers, tiers=two_gpu_tiers(64, 4 << 20, layers))
    codec = PaddingColdPageCodec({0: 16 * KIB, 1: 16 * KIB, 2: 8 * KIB})
    manager = KVCacheManager(config, cold_page_codec=codec)
    full, short, long = (manager.get_layer_group_id(LayerId(layer)) for layer in range(3))
    hot = [_introspection.pool_group_index(manager, lc, 0) for lc in (full, short, long)]
    cold = [_introspection.pool_group_index(manager, lc, 1) for lc in (full, short, long)]
    assert hot[0] != hot[1] and hot[1] == hot[2]
    assert cold[0] == cold[1] and cold[1] != cold[2]
    cold_stats = _introspection.storage_statistics(manager, 1)
    assert cold_stats[cold[0]].slot_sizes == [16 * KIB] and cold_stats[cold[2]].slot_sizes == [8 * KIB]
    assert sum(stats.total * sum(stats.slot_sizes) for stats in cold_stats) <= 4 << 20
    manager.shutdown()


def test_a_cold_tier_that_splits_a_pool_group_addresses_its_own_pool_groups() -> None:
    layers = [attention(0, KV), attention(1, KV, window=64)]  # one hot pool group, two cold ones
    manager = KVCacheManager(
        make_config(layers, tiers=two_gpu_tiers(8, 1 << 20, layers)),
        cold_page_codec=PaddingColdPageCodec({0: 8 * KIB, 1: 12 * KIB}),
    )
    assert len(_introspection.storage_statistics(manager, 0)) == 1
    assert [stats.slot_sizes for stats in _introspection.storage_statistics(manager, 1)] == [[8 * KIB], [12 * KIB]]
    assert int(manager.get_pool_base_address(1, 0, 1)) != int(manager.get_pool_base_address(0, 0, 1))
    with pytest.raises(ValueError, match="pool_group"):
        manager.get_pool_base_address(1, 0, 0)
    manager.shutdown()


# ------------------------------------------------------------------------------------------- data movement
def test_offloaded_pages_hold_the_encoded_bytes_and_onboarding_restores_the_content() -> None:
    layers = [attention(0, KV), attention(1, KV, window=64)]  # one hot pool group, two cold ones
    config = make_config(layers, tiers=two_gpu_tiers(8, 1 << 20, layers))
    codec = XorPaddingCodec({0: 8 * KIB, 1: 12 * KIB})
    manager = KVCacheManager(config, cold_page_codec=codec)
    engine = FakeEngine(manager)
    tokens = tokens_of(1, 3 * TPB)
    cache = computed(manager, engine, tokens)
    plain = {id(page): slot_bytes(manager, page) for page in held_pages(manager, 0)}
    manager.get_and_reset_iteration_stats()
    moved = cache.offload()
    assert moved == len(plain) > 0 and held_pages(manager, 0) == []
    for page in held_pages(manager, 1):
        size = codec.encoded_page_bytes(page.life_cycle)
        expected = bytes(byte ^ 0xFF for byte in plain[id(page)]) + bytes(size - len(plain[id(page)]))
        assert slot_bytes(manager, page) == expected
    stats = manager.get_and_reset_iteration_stats()
    for lc, delta in stats.items():
        assert delta.iter_offload_bytes == delta.iter_offload_blocks * codec.encoded_page_bytes(lc)
    assert cache.resume()
    engine.check(cache, tokens)
    stats = manager.get_and_reset_iteration_stats()
    assert 0 < sum(delta.iter_onboard_blocks for delta in stats.values()) <= moved  # a stale window page may stay
    for lc, delta in stats.items():
        assert delta.iter_onboard_bytes == delta.iter_onboard_blocks * codec.encoded_page_bytes(lc)
    manager.check_invariants()
    cache.close()
    manager.shutdown()


def test_eviction_sends_a_suspended_cache_through_the_codec_and_resume_brings_it_back() -> None:
    layers = [attention(0, KV), attention(1, 2 * KV)]  # one layer group whose hot slot spans two pools (8 + 16 KiB)
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(4 * 24 * KIB), GpuCacheTierConfig(1 << 20)]
    config = make_config(layers, tiers=tiers, max_util_for_resume=1.0)
    manager = KVCacheManager(config, cold_page_codec=XorPaddingCodec({0: 32 * KIB}))
    assert _introspection.storage_statistics(manager, 0)[0].slot_sizes == [16 * KIB, 8 * KIB]
    engine = FakeEngine(manager)
    first_tokens, second_tokens = tokens_of(2, 4 * TPB), tokens_of(3, 4 * TPB)
    first = computed(manager, engine, first_tokens)
    second = computed(manager, engine, second_tokens)  # the GPU tier holds one cache: the first went cold
    assert held_pages(manager, 1) != []
    manager.check_invariants()
    assert first.resume()  # the second goes cold in its turn
    engine.check(first, first_tokens)
    first.suspend()
    assert second.resume()
    engine.check(second, second_tokens)
    manager.check_invariants()
    first.close()
    second.close()
    manager.shutdown()


def test_encoded_pages_move_between_cold_tiers_as_they_are() -> None:
    layers = [attention(0, KV)]
    cold_host = HostCacheTierConfig(1 << 20)
    config = make_config(layers, tiers=two_gpu_tiers(4, 16 * KIB * 2, layers, cold_host), max_util_for_resume=1.0)
    codec = XorPaddingCodec({0: 16 * KIB})
    manager = KVCacheManager(config, cold_page_codec=codec)
    engine = FakeEngine(manager)
    caches = [(computed(manager, engine, tokens_of(seed, 4 * TPB)), tokens_of(seed, 4 * TPB)) for seed in (4, 5, 6)]
    # 4 hot slots, 2 cold GPU slots: the oldest pages went on to the host tier, still encoded.
    assert _introspection.pool_group_index(manager, 0, 2) == _introspection.pool_group_index(manager, 0, 1)
    on_host = held_pages(manager, 2)
    assert on_host != []
    assert all(len(slot_bytes(manager, page)) == 16 * KIB for page in on_host)
    for cache, tokens in caches:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.suspend()
    manager.check_invariants()
    for cache, _ in caches:
        cache.close()
    manager.shutdown()


def test_ssm_snapshots_reused_from_the_cold_tier_restore_the_exact_state() -> None:
    layers: list[LayerConfig] = [ssm(0), attention(1, 2 * KIB, window=64), ssm(2), attention(3, 2 * KIB, window=64)]
    plain = KVCacheManager(make_config(layers))
    hot_bytes = {lc: sum(plain.get_slot_bytes(plain.get_pool_group_index(lc))) for lc in range(plain.num_layer_groups)}
    plain.shutdown()
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(160 * KIB * 8), GpuCacheTierConfig(160 * KIB * 80)]
    codec = XorPaddingCodec({lc: size + KIB for lc, size in hot_bytes.items()})
    manager = KVCacheManager(make_config(layers, tiers=tiers, ssm_reuse_interval=TPB), cold_page_codec=codec)
    engine = FakeEngine(manager)
    prompt = tokens_of(7, 200)
    cache = manager.create_kv_cache(None, prompt)
    assert cache.resume() and cache.resize(192)
    engine.step(cache, prompt)
    cache.commit(prompt[:192])
    cache.close()
    for seed in range(10, 40):  # other requests push the snapshots into the cold tier
        tokens = tokens_of(seed, 96)
        other = manager.create_kv_cache(None, tokens)
        assert other.resume() and other.resize(96)
        engine.step(other, tokens)
        other.commit(tokens)
        other.close()
    assert manager.movement_counters.offloaded_pages > 0
    follower = prompt[:192] + tokens_of(8, 40)
    cache = manager.create_kv_cache(None, follower)
    assert cache.num_committed_tokens > 0
    onboarded = manager.movement_counters.onboarded_pages
    assert cache.resume()
    assert manager.movement_counters.onboarded_pages > onboarded
    engine.check(cache, follower)  # attention rows and the SSM state decoded from their cold pages
    assert engine.states_checked == 4
    manager.check_invariants()
    cache.close()
    manager.shutdown()


def test_a_cold_tier_quota_change_splits_by_encoded_size_and_keeps_what_it_holds() -> None:
    layers = [attention(0, KV), attention(1, KV, window=64)]  # one hot pool group, two cold ones
    config = make_config(layers, tiers=two_gpu_tiers(8, 1 << 20, layers), max_util_for_resume=1.0)
    codec = XorPaddingCodec({0: 8 * KIB, 1: 12 * KIB})
    manager = KVCacheManager(config, cold_page_codec=codec)
    engine = FakeEngine(manager)
    tokens = tokens_of(9, 3 * TPB)
    cache = computed(manager, engine, tokens)
    moved = cache.offload()
    assert moved > 0
    assert not manager.resize(1, 8 * KIB)  # the offloaded pages would not fit: refused, nothing changed
    assert manager.get_quota(1) == 1 << 20
    assert manager.resize(1, 256 * KIB)
    cold = _introspection.storage_statistics(manager, 1)
    assert sum(stats.total * sum(stats.slot_sizes) for stats in cold) <= 256 * KIB
    assert all(stats.total > 0 for stats in cold)
    assert len(held_pages(manager, 1)) == moved
    assert cache.resume()
    engine.check(cache, tokens)
    manager.check_invariants()
    cache.close()
    manager.shutdown()


def test_a_cold_pool_group_two_gpu_pool_groups_share_is_never_promised_twice() -> None:
    # Hot: full (16 KiB slots) and window 32 (8 KiB slots) apart; cold: both 16 KiB, one pool group of one slot.
    layers = [attention(0, 2 * KV), attention(1, KV, window=32)]
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(48 * KIB), GpuCacheTierConfig(16 * KIB)]
    config = make_config(layers, tiers=tiers, initial_pool_ratio=[0.8, 0.2], max_util_for_resume=1.0)
    manager = KVCacheManager(config, cold_page_codec=PaddingColdPageCodec({0: 16 * KIB, 1: 16 * KIB}))
    assert [stats.total for stats in _introspection.storage_statistics(manager, 0)] == [2, 2]
    assert [stats.total for stats in _introspection.storage_statistics(manager, 1)] == [1]
    engine = FakeEngine(manager)
    tokens = tokens_of(11, 2 * TPB)
    suspended = computed(manager, engine, tokens)  # holds every GPU slot
    usage = [(use.level, use.pool_group, use.held, use.free) for use in manager.get_usage()]
    other = manager.create_kv_cache()
    assert other.resume()
    # One page of each GPU pool group would have to go to the one cold slot: refused, nothing moved.
    assert not other.resize(TPB)
    assert [(use.level, use.pool_group, use.held, use.free) for use in manager.get_usage()] == usage
    manager.check_invariants()
    other.close()
    assert suspended.resume()
    engine.check(suspended, tokens)
    suspended.close()
    manager.shutdown()
