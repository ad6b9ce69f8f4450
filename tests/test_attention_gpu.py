"""The CuPy paged attention kernel against its NumPy twin on a real GPU, within ``TOLERANCES`` (skipped without one).

Pages live in a cuda-backend manager; the twin reads host copies of the same views. Scenarios mirror
tests/test_attention_reference.py and add what only a GPU shows: long contexts with split-K, every row tile,
raw base addresses, streams and repeated launches on one split-K workspace.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2 import PageIndexMode
from kv_cache_manager_v2.kernels.attention import (
    TOLERANCES,
    AttentionBatch,
    device_pages,
    paged_attention_cuda,
    paged_attention_reference,
)
from tests.helpers import MIB
from tests.test_attention_reference import Scene, Sequence, to_float

cupy = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cupy.is_available(), reason="needs a CUDA device")]

SHARED = PageIndexMode.SHARED
PER_LAYER = PageIndexMode.PER_LAYER


def compare(
    scene: Scene,
    sequences: list[Sequence],
    layer: int = 0,
    mode: PageIndexMode = PER_LAYER,
    window_local: bool = False,
) -> npt.NDArray[np.generic]:
    """Kernel output (host copy) after checking it against the twin."""
    query, key_pages, value_pages, batch = scene.inputs(layer, sequences, mode, window_local)
    out = paged_attention_cuda(cupy.asarray(query), key_pages, value_pages, batch, scene.params)
    got: npt.NDArray[np.generic] = cupy.asnumpy(out)
    twin = paged_attention_reference(query, cupy.asnumpy(key_pages), cupy.asnumpy(value_pages), batch, scene.params)
    atol, rtol = TOLERANCES[scene.element_type]
    np.testing.assert_allclose(
        to_float(got, scene.element_type), to_float(twin, scene.element_type), atol=atol, rtol=rtol
    )
    return got


@pytest.mark.parametrize("element_type", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_long_contexts_with_split_k(element_type: str, head_dim: int) -> None:
    scene = Scene(tpb=32, head_dim=head_dim, element_type=element_type, seed=20, backend="cuda", gpu_quota=64 * MIB)
    sequences = [scene.sequence(4000, 1), scene.sequence(777, 1), scene.sequence(0, 1)]
    scene.write(0, sequences)
    compare(scene, sequences)
    scene.close()


@pytest.mark.parametrize(("kv_heads", "num_heads"), [(4, 4), (2, 4), (2, 8), (1, 8), (1, 16)])
def test_every_row_tile(kv_heads: int, num_heads: int) -> None:
    scene = Scene(kv_heads=kv_heads, num_heads=num_heads, element_type="float16", seed=21, backend="cuda")
    sequences = [scene.sequence(300, 1), scene.sequence(45, 1), scene.sequence(90, 30)]
    scene.write(0, sequences)
    compare(scene, sequences[:2])  # decode tiles of 1, 2, 4, 8 rows
    compare(scene, sequences)  # prefill tiles
    scene.close()


@pytest.mark.parametrize("element_type", ["float16", "bfloat16", "float32"])
def test_sliding_window_sinks_window_local_and_prefill(element_type: str) -> None:
    scene = Scene(window=256, sinks=5, tpb=16, element_type=element_type, seed=22, backend="cuda")
    sequences = [scene.sequence(3000, 1), scene.sequence(260, 1), scene.sequence(500, 64), scene.sequence(2, 5)]
    scene.write(0, sequences)
    local = compare(scene, sequences, window_local=True)
    full = compare(scene, sequences)
    np.testing.assert_array_equal(local, full)
    scene.close()


def test_scratch_blocks_expansion_and_shared_mode() -> None:
    scene = Scene(num_layers=2, window=32, sinks=4, expansion=2, element_type="float16", seed=23, backend="cuda")
    scratch_sequence = scene.sequence(0, 160, scratch=True)
    scene.write(1, [scratch_sequence])
    compare(scene, [scratch_sequence], layer=1)
    plain = [scene.sequence(400, 1), scene.sequence(50, 20)]
    scene.write(1, plain)
    per_layer = compare(scene, plain, layer=1, window_local=True)
    shared = compare(scene, plain, layer=1, mode=SHARED, window_local=True)
    np.testing.assert_array_equal(shared, per_layer)
    scene.close()


def test_raw_addresses_streams_and_repeated_launches() -> None:
    scene = Scene(num_layers=2, element_type="bfloat16", seed=24, backend="cuda")
    sequences = [scene.sequence(2000, 1), scene.sequence(1500, 1)]
    scene.write(1, sequences)
    query, key_view, value_view, batch = scene.inputs(1, sequences, SHARED)
    manager = scene.manager
    stride = manager.get_page_stride(1, "key")
    pages = [
        device_pages(
            manager.get_mem_pool_base_address(1, role, SHARED),
            stride,
            manager.get_page_index_upper_bound(1, role, SHARED),
        )
        for role in ("key", "value")
    ]
    device_query = cupy.asarray(query)
    first = cupy.asnumpy(paged_attention_cuda(device_query, key_view, value_view, batch, scene.params))
    stream = cupy.cuda.Stream(non_blocking=True)
    out = cupy.empty_like(device_query)
    for _ in range(3):  # the split-K counters must be back at zero after every launch
        paged_attention_cuda(device_query, pages[0], pages[1], batch, scene.params, out=out, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(out), first)
    scene.close()


def test_a_missing_page_yields_nan_for_its_queries_only() -> None:
    scene = Scene(element_type="float32", seed=25, backend="cuda")
    sequences = [scene.sequence(700, 1), scene.sequence(90, 1)]
    scene.write(0, sequences)
    query, key_pages, value_pages, batch = scene.inputs(0, sequences)
    table = batch.key_page_table.copy()
    table[0, 3] = -1
    broken = AttentionBatch(batch.query_start, batch.positions, table, batch.value_page_table)
    out = cupy.asnumpy(paged_attention_cuda(cupy.asarray(query), key_pages, value_pages, broken, scene.params))
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()
    scene.close()
