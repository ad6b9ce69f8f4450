"""``get_aggregated_pages``: adjacent buffers of a slot reported as one byte range, checked against the bytes each
buffer's own addressing reaches."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kv_cache_manager_v2 import BufferId, DataRole, KVCacheManager, LayerId, PageIndexMode
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, compute_prompt, make_config

TPB = 16


def manager_of(layers: list[LayerConfig]) -> KVCacheManager:
    return KVCacheManager(make_config(layers, tokens_per_block=TPB))


def buffer_bytes(manager: KVCacheManager, buffer: BufferId, slot: int) -> bytes:
    """The bytes of ``buffer`` in GPU slot ``slot``, reached through its own page index and view."""
    converter = manager.get_page_index_converter(buffer.layer_id, buffer.role)
    index = converter([slot], PageIndexMode.SHARED)[0]
    view = manager.get_page_view(buffer.layer_id, buffer.role, PageIndexMode.SHARED)
    assert isinstance(view, np.ndarray)
    return bytes(view[index])


def ids(*pairs: tuple[int, str]) -> list[BufferId]:
    return [BufferId(LayerId(layer), DataRole(role)) for layer, role in pairs]


def test_a_whole_layer_group_is_one_range_per_slot() -> None:
    manager = manager_of([attention(0, 2 * KIB), attention(1, 2 * KIB), attention(2, 2 * KIB)])
    engine = FakeEngine(manager)
    tokens = list(range(3 * TPB))
    cache = compute_prompt(manager, engine, tokens)
    wanted = list(reversed(manager.all_buffer_ids))  # order does not matter
    (desc,) = manager.get_aggregated_pages(wanted)
    assert desc.size == 6 * 2 * KIB and desc.layer_group_id == 0
    assert sorted(b.id for b in desc.buffers) == sorted(wanted)
    slots = cache.get_aggregated_page_indices(desc.layer_group_id, valid_only=True)
    assert len(slots) == 3
    for slot in slots:
        whole = ctypes.string_at(desc.base + desc.stride * slot, desc.size)
        assert whole == b"".join(buffer_bytes(manager, b.id, slot) for b in desc.buffers)
        assert any(whole)  # the engine wrote records there
    cache.close()


def test_a_gap_splits_the_range_and_duplicates_are_ignored() -> None:
    manager = manager_of([attention(0, 2 * KIB), attention(1, 2 * KIB), attention(2, 2 * KIB)])
    all_ids = manager.all_buffer_ids
    chosen = [all_ids[0], all_ids[1], all_ids[4], all_ids[5], all_ids[0]]
    descs = manager.get_aggregated_pages(chosen)
    assert [len(d.buffers) for d in descs] == [2, 2]
    assert descs[1].base - descs[0].base == 4 * 2 * KIB
    assert all(d.size == 2 * 2 * KIB for d in descs)


def test_layer_groups_and_sizes_get_separate_ranges() -> None:
    manager = manager_of([attention(0, 2 * KIB), attention(1, 4 * KIB, window=32)])
    descs = manager.get_aggregated_pages(manager.all_buffer_ids)
    assert sorted((d.layer_group_id, d.size) for d in descs) == [(0, 4 * KIB), (1, 8 * KIB)]


def test_bad_buffers_are_refused_by_name() -> None:
    manager = manager_of([attention(0, 2 * KIB)])
    with pytest.raises(ValueError, match="role"):
        manager.get_aggregated_pages(ids((0, "nope")))
    with pytest.raises(ValueError, match="layer_id"):
        manager.get_aggregated_pages(ids((7, "key")))
    with pytest.raises(TypeError, match="BufferId"):
        manager.get_aggregated_pages(["key"])  # type: ignore[list-item]
