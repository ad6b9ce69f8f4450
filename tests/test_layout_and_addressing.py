"""Storage layout and addressing: pool groups, coalescing, expansion, converters, views."""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import numpy as np
import pytest

from kv_cache_manager_v2._introspection import internals_of
from kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    AttentionLayerConfig,
    BufferConfig,
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HalfOpenRange,
    HostCacheTierConfig,
    KVCacheManager,
    PageIndexConverter,
    PageIndexMode,
    ScratchDesc,
)
from kv_cache_manager_v2.config import CacheTierConfig, LayerConfig
from tests.helpers import KIB, MIB, attention, gemma_like_layers, make_config, ssm

SHARED = PageIndexMode.SHARED
PER_LAYER = PageIndexMode.PER_LAYER


def test_gemma_like_layers_get_two_pool_groups_sized_to_them() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=16 * MIB))
    assert manager.layer_grouping == [[0, 1, 2, 3, 4], [5]]
    assert manager.num_pool_groups == 2
    assert manager.get_slot_bytes(manager.get_pool_group_index(0)) == [160 * KIB]
    assert manager.get_slot_bytes(manager.get_pool_group_index(1)) == [64 * KIB]
    # K0 V0 K1 V1 ...: layer 2's value is the 6th buffer of the coalesced slot.
    converter = manager.get_page_index_converter(2, "value")
    assert (converter.scale, converter.layer_offset, converter.expansion) == (10, 5, 1)
    assert (converter.scratch_pages_per_block, converter.scratch_page_in_block) == (2, 1)


def test_the_page_store_names_the_pools_of_each_tier_and_pool_group() -> None:
    """What the remote tier and the NIXL endpoint read: the pools of one pool group in one tier, and every GPU
    pool; the same memory the public addresses point at."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(16 * MIB), HostCacheTierConfig(16 * MIB)]
    manager = KVCacheManager(make_config([*gemma_like_layers(), ssm(6)], tiers=tiers))
    store = internals_of(manager).store
    for pool_group in range(manager.num_pool_groups):
        pools = store.pools(0, pool_group)
        assert len(pools) == len(manager.get_slot_bytes(pool_group))
        assert [pool.address for pool in pools] == [
            manager.get_pool_base_address(pool_group, pool) for pool in range(len(pools))
        ]
        host = store.pools(1, pool_group)
        assert [pool.address for pool in host] == [
            manager.get_pool_base_address(pool_group, pool, 1) for pool in range(len(host))
        ]
    everywhere = [pool for pool_group in range(manager.num_pool_groups) for pool in store.pools(0, pool_group)]
    assert store.gpu_pools() == everywhere and len(everywhere) == 4  # one pool per attention pool group, SSM two
    full = manager.get_page_index_converter(5, "key")
    assert (full.scale, full.layer_offset) == (2, 0)
    manager.shutdown()


def test_ssm_layers_get_a_pool_group_of_their_own() -> None:
    # The SSM buffers coalesce to the same 32 KiB as the attention slot, yet never share its pool group.
    layers: list[LayerConfig] = [attention(0, 16 * KIB), ssm(1, state=16 * KIB, conv=16 * KIB)]
    manager = KVCacheManager(make_config(layers))
    assert manager.num_pool_groups == 2
    assert manager.get_slot_bytes(0) == manager.get_slot_bytes(1) == [32 * KIB]
    assert manager.get_pool_group_index(0) != manager.get_pool_group_index(1)
    manager.shutdown()


def test_equal_layouts_share_a_pool_group_and_mixed_sizes_make_several_pools() -> None:
    quant = [BufferConfig("key", 8 * KIB), BufferConfig("value", 8 * KIB), BufferConfig("key_block_quant", 1 * KIB)]
    layers = [
        AttentionLayerConfig(0, quant),
        AttentionLayerConfig(1, quant, sliding_window_size=64),
        AttentionLayerConfig(2, list(quant), sliding_window_size=64),
    ]
    manager = KVCacheManager(make_config(layers))
    # Full (1 layer) and SWA (2 layers) differ in coalesced sizes -> two pool groups, each with two pools.
    assert manager.num_pool_groups == 2
    assert manager.get_slot_bytes(manager.get_pool_group_index(1)) == [32 * KIB, 2 * KIB]
    scale_conv = manager.get_page_index_converter(2, "key_block_quant")
    assert (scale_conv.scale, scale_conv.layer_offset, scale_conv.scratch_pages_per_block) == (2, 1, 1)
    value = manager.get_page_index_converter(2, "value")
    assert (value.scale, value.layer_offset, value.scratch_pages_per_block, value.scratch_page_in_block) == (4, 3, 2, 1)
    manager.shutdown()

    twins = [attention(0, 8 * KIB, window=64), attention(1, 8 * KIB, window=128)]
    manager = KVCacheManager(make_config(twins))
    assert manager.num_layer_groups == 2 and manager.num_pool_groups == 1
    manager.shutdown()


def test_tokens_per_block_override_expands_pages() -> None:
    layers = [AttentionLayerConfig(0, [BufferConfig("key", 2 * KIB, 8), BufferConfig("value", 8 * KIB)])]
    manager = KVCacheManager(make_config(layers, gpu_quota=1 * MIB))
    key = manager.get_page_index_converter(0, "key")
    assert key.expansion == 4 and manager.get_page_stride(0, "key") == 2 * KIB
    assert manager.get_page_stride(0, "value") == 8 * KIB
    assert key([3, BAD_PAGE_INDEX], PER_LAYER) == [24, 25, 26, 27, -1, -1, -1, -1]
    slots = manager.get_storage_statistics(0)[0].total
    assert manager.get_page_index_upper_bound(0, "key", SHARED) == slots * 2 * 4
    assert manager.get_page_index_upper_bound(0, "value", SHARED) == slots * 2 - 1
    assert manager.get_page_index_upper_bound(0, "value", PER_LAYER) == slots * 2
    manager.shutdown()


@pytest.mark.parametrize(
    ("converter", "base", "mode", "expected"),
    [
        (PageIndexConverter(4, 1, 1, 2, 1), [0, 3, -1, 7], SHARED, [0, 12, -1, 28]),
        (PageIndexConverter(4, 1, 1, 2, 1), [0, 3, -1, 7], PER_LAYER, [1, 13, -1, 29]),
        (PageIndexConverter(4, 2, 1, 2, 1), [3, -1], PER_LAYER, [26, 27, -1, -1]),
        (PageIndexConverter(4, 2, 3, 2, 1), [2], SHARED, [16, 17]),
        (PageIndexConverter(1, 1, 0, 1, 0), [], None, []),
    ],
)
def test_converter_table(
    converter: PageIndexConverter, base: list[int], mode: PageIndexMode | None, expected: list[int]
) -> None:
    assert converter(base, mode) == expected
    assert converter(np.asarray(base, dtype=np.int32), mode) == expected
    assert converter(array("i", base), mode) == expected  # what get_base_page_indices returns: the unchecked path


def test_converter_refuses_an_index_below_bad_page_index_in_an_array_too() -> None:
    with pytest.raises(ValueError, match="base page index must be >= 0 or -1, got -5"):
        PageIndexConverter(4, 1, 1, 2, 1)(array("i", [3, -5]), SHARED)


@pytest.mark.parametrize("typecode", ["d", "f"])
def test_converter_refuses_an_array_of_floats_as_it_refuses_a_list_of_them(typecode: str) -> None:
    # The array fast path took any array: array("d", [1.5, 2.0]) came back as [6.0, 8.0], page indices no int32
    # table holds, where the list [1.5, 2.0] is refused.
    converter = PageIndexConverter(4, 1, 1, 2, 1)
    for mode in (SHARED, PER_LAYER):
        with pytest.raises(TypeError, match=r"base_indices\[0\] must be an integer, got float 1.5"):
            converter(array(typecode, [1.5, 2.0]), mode)  # type: ignore[arg-type]  # bad input on purpose
    assert converter(array("q", [3, -1]), PER_LAYER) == [13, -1]  # other integer arrays convert as lists do


@pytest.mark.parametrize("base", [[2**29, 0], array("i", [2**29, 0]), [2**40]], ids=["list", "array", "past-int32"])
def test_converter_refuses_a_page_index_past_int32(base: list[int]) -> None:
    # Slot 2^29 x scale 4 + 1 = 2^31 + 1: the converter returned it as it was, which an engine's int32 page table
    # (what get_base_page_indices and the kernels use) wraps to another page; the kernels' twin refuses it.
    converter = PageIndexConverter(4, 1, 1, 2, 1)
    with pytest.raises(ValueError, match=r"page index of base_indices\[0\] overflows int32"):
        converter(base, PER_LAYER)
    assert converter(array("i", [2**29 - 1]), PER_LAYER) == [2**31 - 3]  # the last slot that fits
    with pytest.raises(ValueError, match=r"overflows int32.* x expansion 2"):
        PageIndexConverter(1, 2, 0, 1, 0)([2**30], SHARED)  # 2^30 x 2 + 1 does not fit either


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ((4, 1, 4, 2, 1), ValueError, r"layer_offset must be in \[0, 4\), got 4"),
        ((4, 1, 1, 2, 2), ValueError, r"scratch_page_in_block must be in \[0, 2\), got 2"),
        ((4, 1, 1, 5, 0), ValueError, r"scratch_pages_per_block must be in \[1, 5\), got 5"),
        ((0, 1, 0, 1, 0), ValueError, r"scale must be in \[1, "),
        ((4, 0, 1, 2, 1), ValueError, r"expansion must be in \[1, "),
        ((4.0, 1, 1, 2, 1), TypeError, "PageIndexConverter.scale must be an integer, got float"),
        ((4, 1, True, 2, 1), TypeError, "PageIndexConverter.layer_offset must be an integer, got bool"),
    ],
)
def test_a_converter_pointing_outside_its_slot_is_refused(
    fields: tuple[object, ...], error: type[Exception], message: str
) -> None:
    # layer_offset 4 of scale 4 mapped slot s onto slot s + 1's first buffer (and the last slot past the pool).
    with pytest.raises(error, match=message):
        PageIndexConverter(*fields)  # type: ignore[arg-type]


def test_value_types_take_numpy_integers_and_refuse_other_numbers() -> None:
    """HalfOpenRange, ScratchDesc and PageIndexConverter as the rest of the package (validation.as_int): NumPy
    integers become ints, bools, floats (NumPy's and NaN too) and non-numbers are refused naming the field; an
    empty range is allowed."""
    span = HalfOpenRange(np.int64(2), np.int32(5))
    assert (span.beg, span.end, len(span)) == (2, 5, 3) and type(span.beg) is int and span == HalfOpenRange(2, 5)
    assert not HalfOpenRange(5, 2) and len(HalfOpenRange(5, 2)) == 0  # empty by design
    assert np.int64(2) in span and 2 in span and 5 not in span  # np.int64(2) was not in it
    assert True not in HalfOpenRange(0, 2) and 1.0 not in span and "2" not in span
    for beg in (1.5, np.float64(1.0), float("nan"), True, np.bool_(False), "1", None):
        with pytest.raises(TypeError, match="HalfOpenRange.beg must be an integer"):
            HalfOpenRange(beg, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="HalfOpenRange.end must be an integer, got float inf"):
        HalfOpenRange(0, float("inf"))  # type: ignore[arg-type]
    converter = PageIndexConverter(np.int64(4), np.int32(1), 1, 2, 1)
    assert converter == PageIndexConverter(4, 1, 1, 2, 1) and type(converter.scale) is int
    desc = ScratchDesc(HalfOpenRange(0, 2), [np.int64(7), 8])
    assert desc.slot_ids == (7, 8) and type(desc.slot_ids[0]) is int
    for slot_ids, error, message in (
        ((7, 1.5), TypeError, r"ScratchDesc.slot_ids\[1\] must be an integer, got float"),
        ((np.bool_(True),), TypeError, r"ScratchDesc.slot_ids\[0\] must be an integer, got bool"),
        ((-1,), ValueError, r"ScratchDesc.slot_ids\[0\] must be >= 0, got -1"),
        (7, TypeError, "ScratchDesc.slot_ids must be a sequence of integers, got int"),
    ):
        with pytest.raises(error, match=message):
            ScratchDesc(HalfOpenRange(0, 2), slot_ids)  # type: ignore[arg-type]
    # Compiled, mypyc checks a parameter of a native class itself, naming the type (tests/test_bad_inputs.py).
    with pytest.raises(TypeError, match="ScratchDesc.range must be a HalfOpenRange, got tuple|HalfOpenRange object"):
        ScratchDesc((0, 2), (7,))  # type: ignore[arg-type]


def test_a_negative_scratch_slot_never_becomes_a_page_index() -> None:
    # ScratchDesc(range, (-1,)) made the converter return -2 for scratch block 0 (slot -1 x scale 2 + 0): a
    # negative index other than -1, which an engine reads as a page before the pool; the kernels' twin gave -1.
    with pytest.raises(ValueError, match=r"slot_ids\[0\] must be >= 0"):
        PageIndexConverter(2, 1, 1, 1, 0)([-1, 3], PER_LAYER, ScratchDesc(HalfOpenRange(0, 1), (-1,)))


def test_the_manager_hands_out_one_converter_per_buffer_and_still_checks_its_arguments() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=16 * MIB))
    converter = manager.get_page_index_converter(2, "value")
    assert manager.get_page_index_converter(np.int64(2), "value") is converter
    assert manager.get_page_index_converter(2, "key") is not converter
    with pytest.raises(TypeError, match="layer_id"):
        manager.get_page_index_converter(True, "value")
    with pytest.raises(ValueError, match="unknown role 'values'"):
        manager.get_page_index_converter(2, "values")
    manager.shutdown()
    with pytest.raises(Exception, match="shut down"):
        manager.get_page_index_converter(2, "value")


def test_converter_maps_scratch_blocks_without_collisions() -> None:
    # 32 layers x (K, V) in one pool: scale 64, ppb 2. 28 scratch blocks fit in one slot (f = 2/64: up to 32 do).
    scratch = ScratchDesc(HalfOpenRange(0, 28), (9,))
    seen: set[int] = set()
    for layer in range(32):
        for k in range(2):
            converter = PageIndexConverter(64, 1, 2 * layer + k, 2, k)
            indices = converter([-1] * 28 + [40, 41, 42, 43], PER_LAYER, scratch)
            assert indices[28:] == [40 * 64 + 2 * layer + k + 64 * i for i in range(4)]
            for index in indices[:28]:
                assert 9 * 64 <= index < 10 * 64
            seen_layer = set(indices[:28])
            assert len(seen_layer) == 28  # no two blocks of one (layer, buffer) collide
            if layer == 0:
                seen |= seen_layer
    assert len(seen) == 56 and seen == set(range(9 * 64, 9 * 64 + 56))


def test_converter_scratch_with_expansion_and_several_slots() -> None:
    scratch = ScratchDesc(HalfOpenRange(1, 4), (5, 2))
    converter = PageIndexConverter(scale=2, expansion=2, layer_offset=1, scratch_pages_per_block=1, scratch_page_in_block=0)
    # t = 0, 1, 2 -> slots 5, 5, 2 at positions 0, 1, 0.
    assert converter([7, -1, -1, -1, 8], PER_LAYER, scratch) == [30, 31, 20, 21, 22, 23, 8, 9, 34, 35]


@pytest.mark.parametrize(
    ("mode", "scratch", "error"),
    [
        (None, ScratchDesc(HalfOpenRange(0, 1), (1,)), ValueError),
        (SHARED, ScratchDesc(HalfOpenRange(0, 1), (1,)), ValueError),
        ("PER_LAYER", None, TypeError),
        (PER_LAYER, ScratchDesc(HalfOpenRange(0, 8), ()), ValueError),
    ],
)
def test_converter_rejects_misuse(mode: object, scratch: ScratchDesc | None, error: type[Exception]) -> None:
    converter = PageIndexConverter(2, 1, 1, 1, 0)
    with pytest.raises(error):
        converter([-1, 3], mode, scratch)  # type: ignore[arg-type]


def test_empty_scratch_is_falsy_and_allowed_in_shared_mode() -> None:
    empty = ScratchDesc(HalfOpenRange(3, 3), ())
    assert not empty and len(empty.range) == 0
    assert PageIndexConverter(2, 1, 1, 1, 0)([4], None, empty) == [8]


@pytest.mark.parametrize("beg, end", [(0, -1), (5, 2), (-3, 2), (-1, -1)])
def test_scratch_desc_refuses_a_reversed_or_negative_range(beg: int, end: int) -> None:
    """A reversed range is a mistake, not an empty scratch; a negative start would put blocks [0, end) on slots
    computed from a shifted ordinal (a wrong page)."""
    with pytest.raises(ValueError, match=r"ScratchDesc\.range"):
        ScratchDesc(HalfOpenRange(beg, end), (1, 2, 3, 4, 5))


def test_both_modes_address_the_same_bytes() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=16 * MIB))
    for layer_id in range(6):
        for role in ("key", "value"):
            converter = manager.get_page_index_converter(layer_id, role)
            stride = manager.get_page_stride(layer_id, role)
            shared_base = manager.get_mem_pool_base_address(layer_id, role, SHARED)
            per_layer_base = manager.get_mem_pool_base_address(layer_id, role, PER_LAYER)
            assert manager.get_mem_pool_base_address(layer_id, role) == shared_base
            slots = [0, 5, 17]
            shared = [shared_base + i * stride for i in converter(slots, SHARED)]
            per_layer = [per_layer_base + i * stride for i in converter(slots, PER_LAYER)]
            assert shared == per_layer
    manager.shutdown()


def test_page_views_alias_the_pool_memory() -> None:
    manager = KVCacheManager(make_config(gemma_like_layers(), gpu_quota=16 * MIB))
    converter = manager.get_page_index_converter(3, "value")
    shared = manager.get_page_view(3, "value", SHARED)
    per_layer = manager.get_page_view(3, "value", PER_LAYER)
    assert isinstance(shared, np.ndarray) and isinstance(per_layer, np.ndarray)
    assert shared.shape == (manager.get_page_index_upper_bound(3, "value", SHARED), 16 * KIB)
    assert per_layer.shape[0] == manager.get_page_index_upper_bound(3, "value", PER_LAYER)
    assert shared.ctypes.data == manager.get_mem_pool_base_address(3, "value", SHARED)
    [row_shared] = converter([2], SHARED)
    [row_per_layer] = converter([2], PER_LAYER)
    shared[row_shared, :4] = [1, 2, 3, 4]
    assert list(per_layer[row_per_layer, :4]) == [1, 2, 3, 4]
    # Neighbouring buffers of the same slot are untouched.
    assert not per_layer[row_per_layer - 1].any() and not per_layer[row_per_layer + 1].any()
    manager.shutdown()


def test_unknown_layers_and_roles_are_named() -> None:
    manager = KVCacheManager(make_config([attention(0)]))
    with pytest.raises(ValueError, match="unknown layer_id 7"):
        manager.get_page_stride(7, "key")
    with pytest.raises(ValueError, match="unknown role 'kee'"):
        manager.get_page_index_converter(0, "kee")
    with pytest.raises(TypeError, match="layer_id"):
        manager.get_page_stride("0", "key")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="index_mode|PageIndexMode"):  # compiled: mypyc's own argument check
        manager.get_page_index_upper_bound(0, "key", 1)  # type: ignore[arg-type]
    assert manager.get_page_stride(np.int64(0), "key") == 4 * KIB
    assert manager.get_layer_group_id(np.int32(0)) == 0
    manager.shutdown()
    with pytest.raises(ValueError, match="shut down"):
        manager.get_page_stride(0, "key")


def test_scratch_reuse_refuses_implicit_shared_base() -> None:
    manager = KVCacheManager(make_config([attention(0, window=64)], enable_swa_scratch_reuse=True))
    with pytest.raises(ValueError, match="index_mode=None"):
        manager.get_mem_pool_base_address(0, "key")
    assert manager.get_mem_pool_base_address(0, "key", PER_LAYER) > 0
    assert manager.supports_index_mode(PER_LAYER) is True
    assert manager.supports_index_mode(SHARED) is None
    manager.shutdown()
    plain = KVCacheManager(make_config([attention(0, window=64)]))
    assert plain.supports_index_mode(SHARED) is True
    plain.shutdown()


def test_storage_statistics_and_quota_split_by_typical_demand() -> None:
    manager = KVCacheManager(
        make_config(gemma_like_layers(), tiers=[GpuCacheTierConfig(32 * MIB), HostCacheTierConfig(64 * MIB)])
    )
    gpu = manager.get_storage_statistics(0)
    host = manager.get_storage_statistics(1)
    assert len(gpu) == len(host) == 2
    for stat in gpu + host:
        assert stat.free == stat.available == stat.total > 0 and stat.unavailable == stat.evictable == 0
    used = sum(stat.total * sum(manager.get_slot_bytes(i)) for i, stat in enumerate(gpu))
    assert 32 * MIB - 160 * KIB - 64 * KIB < used <= 32 * MIB
    # Full attention needs every block, SWA (window 128) only ~5 per 4k-token request: most bytes go to full.
    assert gpu[1].total * 64 > gpu[0].total * 160
    assert manager.get_quota(1) == 64 * MIB
    with pytest.raises(ValueError, match="level 2"):
        manager.get_storage_statistics(2)
    manager.shutdown()


def test_gpu_quota_too_small_for_a_slot_is_rejected_saying_what_to_do() -> None:
    with pytest.raises(ValueError, match="GpuCacheTierConfig.quota") as refused:
        KVCacheManager(make_config(gemma_like_layers(), gpu_quota=100 * KIB))
    message = str(refused.value)  # the way out, not only the problem: more memory (how much at least) or the split
    assert "give the GPU tier more memory (one slot of every pool group takes " in message
    assert "typical_step" in message


def test_disk_tier_needs_an_existing_directory(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("x")
    for path in (tmp_path / "missing", regular / "below-a-file"):
        tiers: list[CacheTierConfig] = [GpuCacheTierConfig(4 * MIB), DiskCacheTierConfig(8 * MIB, str(path))]
        with pytest.raises(ValueError, match="DiskCacheTierConfig.path"):
            KVCacheManager(make_config(gemma_like_layers(), tiers=tiers))
