"""The CuPy paged attention kernels against their NumPy twin on a real GPU, within ``TOLERANCES`` (skipped without one).

Pages live in a cuda-backend manager; the twin reads host copies of the same views. Scenarios mirror
tests/test_attention_reference.py and add what only a GPU shows: long contexts with split-K, every row tile,
raw base addresses, streams and repeated launches on one split-K workspace. fp16/bf16 run the tensor-core kernel
(``paged_attention_mma.cu``) by default; the CUDA-core kernel is checked too (``kernel="cuda_cores"``), and where
torch is installed, fp32 ``scaled_dot_product_attention`` on the gathered K/V is a second, independent oracle.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

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
from kv_cache_manager_v2.kernels.attention_variants import VARIANT_ENV, MmaVariant, sweep_variants
from tests.helpers import MIB
from tests.test_attention_reference import Scene, Sequence, to_float, to_storage

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
    kernel: str | None = None,
) -> npt.NDArray[np.generic]:
    """Kernel output (host copy) after checking it against the twin."""
    query, key_pages, value_pages, batch = scene.inputs(layer, sequences, mode, window_local)
    out = paged_attention_cuda(cupy.asarray(query), key_pages, value_pages, batch, scene.params, kernel=kernel)
    got: npt.NDArray[np.generic] = cupy.asnumpy(out)
    twin = paged_attention_reference(query, cupy.asnumpy(key_pages), cupy.asnumpy(value_pages), batch, scene.params)
    atol, rtol = TOLERANCES[scene.element_type]
    np.testing.assert_allclose(
        to_float(got, scene.element_type), to_float(twin, scene.element_type), atol=atol, rtol=rtol
    )
    return got


def torch_attention(scene: Scene, sequences: list[Sequence]) -> npt.NDArray[np.float64]:
    """fp32 SDPA (torch) per sequence on its gathered K/V with the visibility mask; GQA by repeating kv heads."""
    torch = pytest.importorskip("torch")
    group = scene.num_heads // scene.kv_heads
    outputs = []
    for seq in sequences:
        keys = torch.tensor(to_float(seq.keys, scene.element_type), dtype=torch.float32, device="cuda")
        values = torch.tensor(to_float(seq.values, scene.element_type), dtype=torch.float32, device="cuda")
        stored = to_float(to_storage(seq.queries, scene.element_type), scene.element_type)
        queries = torch.tensor(stored, dtype=torch.float32, device="cuda")
        positions = torch.tensor(seq.positions, device="cuda")[:, None]
        key_positions = torch.arange(keys.shape[0], device="cuda")[None, :]
        mask = key_positions <= positions
        if scene.window is not None:
            mask &= (key_positions > positions - scene.window) | (key_positions < scene.sinks)
        out = torch.nn.functional.scaled_dot_product_attention(
            queries.transpose(0, 1),
            keys.repeat_interleave(group, dim=1).transpose(0, 1),
            values.repeat_interleave(group, dim=1).transpose(0, 1),
            attn_mask=mask,
            scale=scene.params.scale_for(scene.head_dim),
        )
        outputs.append(out.transpose(0, 1).double().cpu().numpy())
    return np.concatenate(outputs)


# (element type, kv heads, query heads, tokens per block, head_dim, window, sinks)
TORCH_CASES = [
    ("float16", 8, 8, 32, 128, None, 0),
    ("float16", 8, 16, 16, 128, None, 0),
    ("float16", 8, 32, 32, 128, None, 0),
    ("float16", 8, 64, 64, 128, None, 0),
    ("bfloat16", 8, 32, 32, 128, None, 0),
    ("bfloat16", 2, 16, 64, 64, None, 0),
    ("float16", 2, 8, 16, 64, 200, 4),
    ("bfloat16", 4, 16, 32, 128, 300, 8),
    ("float16", 2, 4, 32, 256, None, 0),
]


@pytest.mark.parametrize(("element_type", "kv_heads", "num_heads", "tpb", "head_dim", "window", "sinks"), TORCH_CASES)
def test_tensor_cores_against_the_twin_and_torch(
    element_type: str, kv_heads: int, num_heads: int, tpb: int, head_dim: int, window: int | None, sinks: int
) -> None:
    scene = Scene(
        kv_heads=kv_heads, num_heads=num_heads, tpb=tpb, head_dim=head_dim, window=window, sinks=sinks,
        element_type=element_type, seed=26, backend="cuda", gpu_quota=128 * MIB,
    )
    decode = [scene.sequence(3000, 1), scene.sequence(130, 1), scene.sequence(1, 1)]
    prefill = [scene.sequence(500, 200), scene.sequence(0, 77), scene.sequence(64, 1)]
    for sequences in (decode, prefill):
        scene.write(0, sequences)
        got = compare(scene, sequences, window_local=window is not None, kernel="tensor_cores")
        atol, rtol = TOLERANCES[element_type]
        np.testing.assert_allclose(
            to_float(got, element_type), torch_attention(scene, sequences), atol=atol, rtol=rtol
        )
    scene.close()


@pytest.mark.parametrize("element_type", ["float16", "bfloat16"])
def test_cuda_core_kernel_still_serves_half_types(element_type: str) -> None:
    scene = Scene(kv_heads=2, num_heads=8, element_type=element_type, seed=27, backend="cuda")
    sequences = [scene.sequence(900, 1), scene.sequence(40, 30)]
    scene.write(0, sequences)
    old = compare(scene, sequences, kernel="cuda_cores")
    new = compare(scene, sequences, kernel="tensor_cores")
    atol, rtol = TOLERANCES[element_type]
    np.testing.assert_allclose(to_float(new, element_type), to_float(old, element_type), atol=2 * atol, rtol=2 * rtol)
    scene.close()


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


@pytest.mark.parametrize("kernel", ["tensor_cores", "cuda_cores"])
def test_a_query_at_an_odd_element_offset_is_refused_before_launch(kernel: str) -> None:
    # A C-contiguous fp16 view 2 bytes past an allocation: the tensor-core kernel's 32-bit query loads would fault
    # with a misaligned address (a sticky error that ends the CUDA context); it must be a ValueError instead.
    scene = Scene(element_type="float16", seed=26, backend="cuda")
    sequences = [scene.sequence(40, 1)]
    scene.write(0, sequences)
    query, key_pages, value_pages, batch = scene.inputs(0, sequences)
    flat = cupy.zeros(query.size + 1, dtype=query.dtype)
    shifted = flat[1:].reshape(query.shape)
    shifted[...] = cupy.asarray(query)
    assert shifted.flags.c_contiguous and shifted.data.ptr % 4 == 2
    with pytest.raises(ValueError, match="query must start on 4 bytes"):
        paged_attention_cuda(shifted, key_pages, value_pages, batch, scene.params, kernel=kernel)
    aligned = cupy.asarray(query)  # the same values, aligned: runs
    paged_attention_cuda(aligned, key_pages, value_pages, batch, scene.params, kernel=kernel)
    cupy.cuda.get_current_stream().synchronize()
    scene.close()


@contextmanager
def variant_override(variant: MmaVariant) -> Iterator[None]:
    """Launches inside run ``variant`` (through ``VARIANT_ENV``, as the benchmark's sweep does)."""
    before = os.environ.get(VARIANT_ENV)
    os.environ[VARIANT_ENV] = variant.env_text()
    try:
        yield
    finally:
        if before is None:
            del os.environ[VARIANT_ENV]
        else:
            os.environ[VARIANT_ENV] = before


@pytest.mark.parametrize("variant", sweep_variants(16), ids=MmaVariant.label)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_every_decode_variant_of_the_sweep(variant: MmaVariant, head_dim: int) -> None:
    # Whatever default the sweep picks has run here: long contexts with and without split-K, GQA 4 and 8.
    if head_dim == 256 and (variant.stages, variant.tile_keys) not in ((2, 64), (3, 64)):
        pytest.skip("no shared memory for this pipeline at head_dim 256 (the launcher refuses it)")
    scene = Scene(
        kv_heads=2, num_heads=16, tpb=32, head_dim=head_dim, seed=28, backend="cuda", gpu_quota=64 * MIB
    )
    sequences = [scene.sequence(5000, 1), scene.sequence(777, 1), scene.sequence(0, 1), scene.sequence(64, 1)]
    scene.write(0, sequences)
    with variant_override(variant):
        compare(scene, sequences, kernel="tensor_cores")
        compare(scene, sequences[:1], kernel="tensor_cores")  # one sequence: the most splits
    scene.close()


@pytest.mark.parametrize("variant", sweep_variants(64), ids=MmaVariant.label)
@pytest.mark.parametrize(("element_type", "head_dim"), [("float16", 128), ("bfloat16", 64)])
def test_every_prefill_variant_of_the_sweep(variant: MmaVariant, element_type: str, head_dim: int) -> None:
    # 64- and 128-row CTAs: several row tiles per sequence (run last tile first), windows with sinks, both tables.
    scene = Scene(
        kv_heads=2,
        num_heads=8,
        window=300,
        sinks=4,
        tpb=16,
        head_dim=head_dim,
        element_type=element_type,
        seed=29,
        backend="cuda",
    )
    sequences = [scene.sequence(700, 150), scene.sequence(0, 77), scene.sequence(40, 1)]
    scene.write(0, sequences)
    with variant_override(variant):
        compare(scene, sequences, kernel="tensor_cores", window_local=True)
        compare(scene, sequences, kernel="tensor_cores")
    scene.close()


def test_a_variant_the_kernel_lacks_is_refused_by_name() -> None:
    scene = Scene(kv_heads=2, num_heads=8, head_dim=256, seed=30, backend="cuda")
    sequences = [scene.sequence(100, 1)]
    scene.write(0, sequences)
    query, key_pages, value_pages, batch = scene.inputs(0, sequences)
    with variant_override(MmaVariant(stages=4, tile_keys=64)), pytest.raises(ValueError, match=VARIANT_ENV):
        paged_attention_cuda(cupy.asarray(query), key_pages, value_pages, batch, scene.params)
    scene.close()
