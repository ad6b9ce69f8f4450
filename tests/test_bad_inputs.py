"""Bad input across the public API (SPEC §11), table-driven.

Every row calls one public entry point with one bad argument and asserts the exception type (``ValueError``;
``TypeError`` for a wrong Python type), that its message names the argument or the value, and that the manager
and every cache are exactly as before: lengths and status of each cache, base page indices of every layer
group, a registered page table, storage statistics and quota of every level, reuse probes of known prompts,
movement counters, FakeEngine content, and ``check_invariants``.

Compiled mode: mypyc checks parameters declared with a concrete type (``role: str``, ``index_mode:
PageIndexMode``, ``digest: bytes``, ...) itself and raises ``TypeError("str object expected; got int")``, which
names the type rather than the argument; those rows accept either message. ``SupportsIndex`` parameters are
checked by the package in both modes.

NumPy integers are accepted wherever ints are: see ``NUMPY_ROWS``.

The rows, by concept: ``tests/bad_input_rows_manager.py`` (the manager's calls and its page index converter),
``tests/bad_input_rows_cache.py`` (a cache's calls in each state), ``tests/bad_input_rows_config.py`` (configs);
the world they run against is ``tests/bad_input_world.py``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BatchDesc,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheDesc,
    KVCacheManager,
    KVCacheManagerConfig,
    PageIndexMode,
    ReuseScope,
    SwaScratchReuseConfig,
)
from tests.bad_input_rows_cache import CACHE_ROWS
from tests.bad_input_rows_config import CONFIG_ROWS
from tests.bad_input_rows_manager import MANAGER_ROWS
from tests.bad_input_world import IMAGE, Bad, World, build_world, kv, tokens_of, world_config_disk
from tests.fuzz.checks import assert_unchanged

BAD_INPUTS: list[Bad] = MANAGER_ROWS + CACHE_ROWS + CONFIG_ROWS


@pytest.fixture
def world() -> Iterator[World]:
    w = build_world()
    yield w
    for cache in w.caches:
        cache.close()
    w.manager.check_invariants()
    if w.manager.num_live_caches == 0:  # a row that wrongly succeeded may have left a cache open
        w.manager.shutdown()



@pytest.mark.parametrize("row", [pytest.param(row, id=row.name) for row in BAD_INPUTS])
def test_bad_input_is_rejected_and_changes_nothing(row: Bad, world: World) -> None:
    before = world.snapshot()
    with pytest.raises(row.error, match=row.match):
        row.call(world)
    assert_unchanged(before, world.snapshot(), row.name)
    world.manager.check_invariants()


def test_the_table_is_wide() -> None:
    assert len(BAD_INPUTS) >= 40
    assert len({row.name for row in BAD_INPUTS}) == len(BAD_INPUTS)


# -------------------------------------------------------------------------------- NumPy integers accepted
def _numpy_converter(w: World) -> None:
    per_layer = PageIndexMode.PER_LAYER
    assert w.manager.get_page_index_converter(np.int32(3), "key") == w.manager.get_page_index_converter(3, "key")
    convert = w.manager.get_page_index_converter(np.int64(1), "value")
    # NumPy arrays are not typing.Sequence, though the converter takes them at run time.
    table = np.array([0, -1, 2], np.int32)
    assert convert(table, per_layer) == convert([0, -1, 2], per_layer)
    assert convert(np.array([5], np.int64)) == convert([5])


def _numpy_addressing(w: World) -> None:
    m = w.manager
    assert m.get_page_stride(np.int64(3), "value") == m.get_page_stride(3, "value")
    shared = PageIndexMode.SHARED
    assert m.get_mem_pool_base_address(np.int64(2), "key", shared) == m.get_mem_pool_base_address(2, "key")
    assert m.get_page_index_upper_bound(np.int16(1), "key") == m.get_page_index_upper_bound(1, "key")
    assert m.get_layer_window(np.int64(0)) == (48, 4)
    assert m.get_layer_group_id(np.int32(3)) == m.get_layer_group_id(3)
    assert m.get_pool_group_index(np.int64(1)) == m.get_pool_group_index(1)
    assert m.get_slot_bytes(np.int32(0)) == m.get_slot_bytes(0)
    assert m.get_pool_base_address(np.int64(1), np.int32(0), np.int64(1)) == m.get_pool_base_address(1, 0, 1)


def _numpy_levels(w: World) -> None:
    m = w.manager
    assert m.get_storage_statistics(np.int64(1)) == m.get_storage_statistics(1)
    assert m.get_quota(np.int8(0)) == m.get_quota(0)
    assert m.gen_multimodal_cache_key_tokens(IMAGE, np.int64(4), np.int32(100)) == [IMAGE, 101, 102, 103]


def _numpy_tokens(w: World) -> None:
    sequence = w.tokens[1][:64] + tokens_of(7, 136)  # shares 4 blocks with the suspended cache
    prompt = sequence[:90]
    expected = w.manager.probe_reuse(None, prompt)
    assert expected == 64
    assert w.manager.probe_reuse(None, np.array(prompt, np.int64)) == expected
    assert w.manager.probe_reuse(None, np.array(prompt, np.int32)) == expected
    cache = w.manager.create_kv_cache(None, np.array(prompt), id=np.int64(500), expected_prompt_length=np.int32(90))
    assert cache.id == 500 and cache.num_committed_tokens == expected
    assert cache.resume(np.int64(3))
    assert cache.resize(np.int64(90), np.int32(64))
    w.engine.step(cache, sequence)
    cache.commit(np.array(prompt[64:], np.int32))
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (90, 90, 90)
    cache.close()


def _numpy_lengths(w: World) -> None:
    cache = w.active
    assert cache.resize(np.int64(100), np.int64(75))
    assert (cache.capacity, cache.history_length) == (100, 75)
    cache.capacity = np.int32(110)
    cache.history_length = np.uint16(80)
    assert (cache.capacity, cache.history_length) == (110, 80)
    w.engine.step(cache, w.tokens[0])
    assert list(cache.get_base_page_indices(np.int64(1), np.int64(0))) == list(cache.get_base_page_indices(1))
    table = np.full(16, -9, np.int32)
    cache.set_base_page_index_buf(np.int64(0), np.int32(1), table)
    assert table[: cache.num_blocks].tolist() == list(cache.get_base_page_indices(1))


def _numpy_quota(w: World) -> None:
    w.active.suspend()
    w.stopped.suspend()
    quota = w.manager.get_quota(1)
    assert w.manager.resize(np.int64(1), np.int64(quota // 2))
    assert w.manager.get_quota(1) == quota // 2
    assert w.manager.resize(np.int32(1), np.uint32(quota))


def _numpy_configs(w: World) -> None:
    buffer = BufferConfig("key", np.int64(4096), np.int32(8))  # type: ignore[arg-type]
    assert buffer.size == 4096 and type(buffer.size) is int and buffer.tokens_per_block_override == 8
    layer = AttentionLayerConfig(
        np.int32(0),  # type: ignore[arg-type]
        [buffer, BufferConfig("value", np.int64(4096), np.int32(8))],  # type: ignore[arg-type]
        sliding_window_size=np.int64(64),  # type: ignore[arg-type]
        num_sink_tokens=np.int64(4),  # type: ignore[arg-type]
    )
    full = AttentionLayerConfig(np.int64(1), kv(4096))  # type: ignore[arg-type]
    desc = KVCacheDesc(np.int64(128), np.int32(100))  # type: ignore[arg-type]
    config = KVCacheManagerConfig(
        np.int64(16),  # type: ignore[arg-type]
        cache_tiers=[GpuCacheTierConfig(np.int64(2 * 1024 * 1024), max_quota=np.int64(4 * 1024 * 1024))], layers=[layer, full],  # type: ignore[arg-type]
        vocab_size=np.int32(32_000),  # type: ignore[arg-type]
        backend="cpu",
        ssm_reuse_interval=np.int64(32),  # type: ignore[arg-type]
        typical_step=BatchDesc([desc] * 2, np.int16(0)),  # type: ignore[arg-type]
        swa_scratch_reuse=SwaScratchReuseConfig(np.int64(0)),  # type: ignore[arg-type]
    )
    manager = KVCacheManager(config)
    assert manager.tokens_per_block == 16 and manager.get_layer_window(0) == (64, 4)
    cache = manager.create_kv_cache(None, np.arange(40))
    assert cache.resume() and cache.resize(np.int64(40))
    cache.close()
    manager.shutdown()


def _numpy_scope(w: World) -> None:
    scope = ReuseScope(lora_id=np.int64(0))  # type: ignore[arg-type]
    assert w.manager.probe_reuse(scope, w.tokens[0]) == w.manager.probe_reuse(ReuseScope(lora_id=0), w.tokens[0])


NUMPY_ROWS: list[tuple[str, Callable[[World], None]]] = [
    ("converter and its call", _numpy_converter),
    ("addressing API", _numpy_addressing),
    ("levels, quotas, multimodal tokens", _numpy_levels),
    ("token arrays, id, expected_prompt_length, cuda_stream, resize, commit", _numpy_tokens),
    ("resize, setters, page tables", _numpy_lengths),
    ("manager.resize", _numpy_quota),
    ("configs and a manager built from them", _numpy_configs),
]


NUMPY_ROWS.append(("ReuseScope lora_id", _numpy_scope))


@pytest.mark.parametrize("row", [pytest.param(call, id=name) for name, call in NUMPY_ROWS])
def test_numpy_integers_are_accepted(row: Callable[[World], None], world: World) -> None:
    row(world)
    world.manager.check_invariants()


def test_impossible_capacity_is_refused_without_exhausting_memory() -> None:
    """SPEC §2/§11: a capacity that cannot fit is a memory shortage: ``resize`` returns False. Work and memory
    used to grow with the requested block count (2**62: the process was killed), so the check runs in a child
    process limited to 1 GiB of address space."""
    resource = pytest.importorskip("resource")
    assert resource is not None
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "sys.path[:0] = sys.argv[1:]\n"
        "from kv_cache_manager_v2 import AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCacheManager, "
        "KVCacheManagerConfig\n"
        "layer = AttentionLayerConfig(0, [BufferConfig('key', 512), BufferConfig('value', 512)])\n"
        "manager = KVCacheManager(KVCacheManagerConfig(16, cache_tiers=[GpuCacheTierConfig(1 << 20)], layers=[layer], backend='cpu'))\n"
        "cache = manager.create_kv_cache()\n"
        "assert cache.resume()\n"
        "print(cache.resize(2 ** 62), cache.capacity)\n"
    )
    package_root = str(Path(kv_cache_manager_v2.__file__).resolve().parent.parent)
    result = subprocess.run(
        [sys.executable, "-c", code, package_root], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.split() == ["False", "0"], result.stderr[-500:]


def test_disk_tier_in_an_existing_directory_is_accepted() -> None:
    """The positive twin of the 'disk path does not exist' row."""
    with tempfile.TemporaryDirectory() as directory:
        manager = KVCacheManager(world_config_disk(str(Path(directory))))
        assert manager.num_cache_levels == 2
        manager.shutdown()
