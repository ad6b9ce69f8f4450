"""The tensor-core kernel ``kernels/paged_attention_mma.cu`` run on the CPU against the NumPy twin.

g++ compiles the unmodified CUDA C with ``kernels/paged_attention_cpu.cuh``, whose mma.sync, ldmatrix and
cp.async stand-ins follow the PTX ISA's per-lane fragment layouts: a lane that reads or writes the wrong
fragment element shows up here as a wrong output, not only on the GPU. Launched with the launcher's own plan
(``plan_launch(..., tensor_cores=True)``) and argument list. Skipped where g++ is missing.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2.kernels._source import kernel_directory
from kv_cache_manager_v2.kernels.attention import (
    MMA_MAX_SPLITS,
    AttentionBatch,
    AttentionParams,
    kernel_arguments,
    paged_attention_reference,
    plan_launch,
)
from kv_cache_manager_v2.kernels.attention_variants import (
    DECODE_DEFAULT,
    DECODE_VARIANTS,
    PREFILL_DEFAULT,
    PREFILL_ROWS,
    PREFILL_VARIANTS,
    WIDE_PREFILL_VARIANTS,
    MmaVariant,
    mma_threads,
)
from tests.test_attention_cuda_on_cpu import SHORT_TYPES, assert_close, pack_arguments
from tests.test_attention_reference import Scene, Sequence, to_float

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"), reason="needs g++ on Linux"
)

# (dtype enum, head_dim, row warps, stages, tile keys) of the variants the scenarios below launch: the default
# pipeline for every shape (prefill shapes at 64 and 128 rows per CTA), then every other compiled pipeline
# (``DECODE_VARIANTS`` / ``PREFILL_VARIANTS`` / ``WIDE_PREFILL_VARIANTS``).
DEFAULT_SHAPES = [
    ("attention::kFloat16", 64, 1),
    ("attention::kFloat16", 64, 4),
    ("attention::kBFloat16", 64, 1),
    ("attention::kBFloat16", 64, 4),
    ("attention::kFloat16", 128, 1),
    ("attention::kFloat16", 128, 4),
    ("attention::kBFloat16", 128, 1),
    ("attention::kFloat16", 256, 1),
    ("attention::kBFloat16", 256, 4),
]
PIPELINE_SHAPES = {
    16: ("attention::kFloat16", 128, 1),
    64: ("attention::kBFloat16", 64, 4),
    128: ("attention::kBFloat16", 64, 8),
}
D256_PIPELINE = ("attention::kFloat16", 256, 1, 3, 64)  # the deepest pipeline head_dim 256 has room for
VARIANTS = sorted(
    {
        *[(*shape, DECODE_DEFAULT.stages, DECODE_DEFAULT.tile_keys) for shape in DEFAULT_SHAPES if shape[2] == 1],
        *[
            (*shape[:2], row_warps, PREFILL_DEFAULT.stages, PREFILL_DEFAULT.tile_keys)
            for shape in DEFAULT_SHAPES
            if shape[2] == 4
            for row_warps in (4, 8)
        ],
        *[(*PIPELINE_SHAPES[16], *pipeline) for pipeline in DECODE_VARIANTS],
        *[(*PIPELINE_SHAPES[64], *pipeline) for pipeline in PREFILL_VARIANTS],
        *[(*PIPELINE_SHAPES[128], *pipeline) for pipeline in WIDE_PREFILL_VARIANTS],
        D256_PIPELINE,
    }
)
ENUM_NAMES = {"attention::kFloat16": "f16", "attention::kBFloat16": "bf16"}
# Every prefill pipeline at both CTA sizes: (stages, tile_keys, prefill_rows).
PREFILL_PIPELINES = [(*pipeline, 64) for pipeline in PREFILL_VARIANTS] + [
    (*pipeline, 128) for pipeline in WIDE_PREFILL_VARIANTS
]


def prefill(rows: int) -> MmaVariant:
    """The default prefill variant with ``rows`` query rows per CTA."""
    return MmaVariant(stages=PREFILL_DEFAULT.stages, tile_keys=PREFILL_DEFAULT.tile_keys, prefill_rows=rows)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    directory = tmp_path_factory.mktemp("paged_attention_mma_cpu")
    lines = ['#include "paged_attention_cpu.cuh"', "#define PAGED_ATTENTION_NO_ENTRIES"]
    lines.append('#include "paged_attention_mma.cu"')
    for dtype, head_dim, row_warps, stages, tile_keys in VARIANTS:
        name = f"mma_{ENUM_NAMES[dtype]}_d{head_dim}_r{16 * row_warps}_s{stages}_k{tile_keys}"
        entry = f"PAGED_ATTENTION_MMA_ENTRY({name}, {dtype}, {head_dim}, {row_warps}, {stages}, {tile_keys})"
        lines += [entry, f"CPU_EXPORT({name})"]
    source = directory / "driver.cpp"
    source.write_text("\n".join(lines) + "\n")
    target = directory / "driver.so"
    command = ["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", f"-I{kernel_directory()}"]
    subprocess.run([*command, str(source), "-o", str(target)], check=True)
    return ctypes.CDLL(str(target))


def run_kernel(
    library: ctypes.CDLL,
    query: npt.NDArray[np.generic],
    key_pages: npt.NDArray[np.uint8],
    value_pages: npt.NDArray[np.uint8],
    batch: AttentionBatch,
    params: AttentionParams,
    resident_ctas: int,
    variant: MmaVariant | None = None,
) -> tuple[npt.NDArray[np.generic], int, int]:
    """The kernel's output, its split count and rows per CTA; also checks the split-K counters are back at zero.
    ``variant``: the pipeline and split policy (None: the default for the row tile)."""
    num_heads, head_dim = int(query.shape[1]), int(query.shape[2])
    plan = plan_launch(batch, params, num_heads, resident_ctas, tensor_cores=True, variant=variant)
    assert plan.variant is not None
    out = np.full_like(query, 0x7E00)  # poison: NaN in fp16 and bf16
    partial = np.full(max(1, plan.partial_floats(head_dim)), np.nan, dtype=np.float32)
    counters = np.zeros(plan.num_work_items, dtype=np.uint32)
    arrays = (batch.query_start, batch.positions, batch.key_page_table, batch.value_page_table, batch.kv_page_offset)
    pages = (key_pages.ctypes.data, value_pages.ctypes.data, key_pages.strides[0], len(key_pages), len(value_pages))
    arguments = kernel_arguments(
        query, out, pages, arrays, batch, params, (num_heads, head_dim), plan, (partial, counters)
    )
    packed = pack_arguments(arguments)
    pipeline = f"s{plan.variant.stages}_k{plan.variant.tile_keys}"
    name = f"cpu_mma_{SHORT_TYPES[params.element_type]}_d{head_dim}_r{plan.rows}_{pipeline}"
    assert getattr(library, name)(*plan.grid, mma_threads(plan.rows), packed.pointers) == 0, "a barrier deadlocked"
    assert not counters.any(), "the last CTA of each work item resets its counter"
    return out, plan.num_splits, plan.rows


def attend_both(
    library: ctypes.CDLL,
    scene: Scene,
    sequences: list[Sequence],
    resident_ctas: int,
    window_local: bool = False,
    variant: MmaVariant | None = None,
) -> tuple[int, int]:
    """Checks kernel against twin; returns (splits, rows per CTA)."""
    query, key_pages, value_pages, batch = scene.inputs(0, sequences, window_local=window_local)
    out, splits, rows = run_kernel(library, query, key_pages, value_pages, batch, scene.params, resident_ctas, variant)
    twin = paged_attention_reference(query, key_pages, value_pages, batch, scene.params)
    assert_close(out, twin, scene.element_type)
    return splits, rows


@pytest.mark.parametrize("element_type", ["float16", "bfloat16"])
@pytest.mark.parametrize(("kv_heads", "num_heads"), [(2, 2), (2, 4), (1, 4), (2, 16)])
def test_decode_gqa_groups_in_one_mma_tile(library: ctypes.CDLL, element_type: str, kv_heads: int, num_heads: int) -> None:
    # GQA 1, 2, 4, 8: the group's rows (padded to 16) share each K/V tile; 200 keys end inside a 64-key tile.
    scene = Scene(kv_heads=kv_heads, num_heads=num_heads, element_type=element_type, seed=30 + num_heads)
    sequences = [scene.sequence(199, 1), scene.sequence(70, 1), scene.sequence(0, 1)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=1) == (1, 16)
    scene.close()


@pytest.mark.parametrize("tpb", [16, 32, 64])
def test_decode_split_k_over_tokens_per_block(library: ctypes.CDLL, tpb: int) -> None:
    scene = Scene(tpb=tpb, kv_heads=2, num_heads=8, head_dim=128, seed=40 + tpb)
    sequences = [scene.sequence(900, 1), scene.sequence(130, 1)]
    scene.write(0, sequences)
    # 4 work items on 12 resident CTAs, 15 key tiles: the default (wave-fit) policy makes one full wave, 3 splits.
    splits, rows = attend_both(library, scene, sequences, resident_ctas=12)
    assert (splits, rows) == (3, 16)
    scene.close()


def test_more_splits_than_a_warp_has_lanes(library: ctypes.CDLL) -> None:
    # The last CTA weighs the splits with lanes striding over them: 40 splits > 32 lanes; then the 64 limit.
    scene = Scene(kv_heads=1, num_heads=1, element_type="bfloat16", tpb=64, seed=17, gpu_quota=16 * 1024 * 1024)
    sequences = [scene.sequence(8300, 1)]
    scene.write(0, sequences)
    forced = MmaVariant(stages=DECODE_DEFAULT.stages, tile_keys=DECODE_DEFAULT.tile_keys, splits=40)
    assert attend_both(library, scene, sequences, resident_ctas=20, variant=forced) == (40, 16)
    assert attend_both(library, scene, sequences, resident_ctas=1000) == (MMA_MAX_SPLITS, 16)  # one wave, capped
    scene.close()


@pytest.mark.parametrize("rows", PREFILL_ROWS)
@pytest.mark.parametrize("element_type", ["float16", "bfloat16"])
def test_chunked_prefill_in_row_tiles(library: ctypes.CDLL, element_type: str, rows: int) -> None:
    # Chunks after a history: causal positions inside 64- or 128-row tiles of tokens x heads (GQA 4: 16 or 32
    # tokens a tile), a chunk that is not a whole number of tiles, a decode in the same batch, a fresh prefill.
    scene = Scene(kv_heads=2, num_heads=8, element_type=element_type, seed=50)
    sequences = [scene.sequence(300, 37), scene.sequence(60, 1), scene.sequence(0, 21)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=prefill(rows)) == (1, rows)
    assert attend_both(library, scene, sequences, resident_ctas=64, variant=prefill(rows))[0] > 1
    scene.close()


def test_wide_tiles_run_longest_first_over_several_sequences(library: ctypes.CDLL) -> None:
    # 128-row CTAs, 3 tiles per sequence over 3 sequences of different lengths: the grid runs row tiles last
    # first across sequences, so every (sequence, tile, kv head) item must still find its own rows.
    scene = Scene(kv_heads=2, num_heads=4, element_type="float16", seed=52)
    sequences = [scene.sequence(300, 150), scene.sequence(10, 64), scene.sequence(0, 129)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=prefill(128)) == (1, 128)
    assert attend_both(library, scene, sequences, resident_ctas=40, variant=prefill(128))[0] > 1
    scene.close()


@pytest.mark.parametrize("rows", PREFILL_ROWS)
def test_prefill_head_dim_128_gqa_8(library: ctypes.CDLL, rows: int) -> None:
    scene = Scene(kv_heads=1, num_heads=8, head_dim=128, tpb=32, seed=51)
    sequences = [scene.sequence(70, 20), scene.sequence(5, 3)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=prefill(rows)) == (1, rows)
    scene.close()


@pytest.mark.parametrize("rows", PREFILL_ROWS)
@pytest.mark.parametrize("element_type", ["float16", "bfloat16"])
def test_sliding_window_sinks_and_window_local_tables(library: ctypes.CDLL, element_type: str, rows: int) -> None:
    scene = Scene(window=300, sinks=5, element_type=element_type, seed=11)
    sequences = [scene.sequence(700, 1), scene.sequence(310, 1), scene.sequence(3, 1), scene.sequence(200, 40)]
    scene.write(0, sequences)
    variant = prefill(rows)
    assert attend_both(library, scene, sequences, resident_ctas=64, window_local=True, variant=variant)[0] > 1
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=variant) == (1, rows)
    scene.close()


@pytest.mark.parametrize("rows", PREFILL_ROWS)
def test_windowed_prefill_with_scratch_blocks_and_expansion(library: ctypes.CDLL, rows: int) -> None:
    # tpb 8 over pages of 4 tokens, window 16 and 4 sinks over a 32-token chunk after 16 tokens: blocks [2, 4) are
    # scratch; the chunk's rows see different windows inside one tile.
    scene = Scene(num_layers=2, window=16, sinks=4, tpb=8, expansion=2, element_type="bfloat16", seed=12)
    sequences = [scene.sequence(16, 32, scratch=True), scene.sequence(7, 3)]
    assert sequences[0].scratch and sequences[0].scratch.range.beg == 2 and sequences[0].scratch.range.end == 4
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=prefill(rows)) == (1, rows)
    scene.close()


@pytest.mark.parametrize("rows", PREFILL_ROWS)
def test_head_dim_256(library: ctypes.CDLL, rows: int) -> None:
    scene = Scene(kv_heads=2, num_heads=2, head_dim=256, tpb=32, seed=13)
    sequences = [scene.sequence(150, 1), scene.sequence(45, 1)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=8)[1] == 16
    scene.close()
    scene = Scene(kv_heads=1, num_heads=4, head_dim=256, element_type="bfloat16", tpb=16, seed=14)
    sequences = [scene.sequence(30, 20)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=prefill(rows)) == (1, rows)
    scene.close()


@pytest.mark.parametrize("rows", PREFILL_ROWS)
def test_a_missing_page_poisons_only_its_queries(library: ctypes.CDLL, rows: int) -> None:
    scene = Scene(element_type="bfloat16", seed=16)
    sequences = [scene.sequence(80, 1), scene.sequence(90, 1), scene.sequence(40, 20)]
    scene.write(0, sequences)
    query, key_pages, value_pages, tables = scene.inputs(0, sequences)
    key_table = tables.key_page_table.copy()
    key_table[0, 2] = -1  # block 2 of sequence 0 (visible to its decode query)
    key_table[2, 3] = -1  # keys 48-63 of sequence 2: visible to its queries at positions 48-59, not 40-47
    batch = AttentionBatch(tables.query_start, tables.positions, key_table, tables.value_page_table)
    for resident in (1, 64):
        out, _, _ = run_kernel(library, query, key_pages, value_pages, batch, scene.params, resident, prefill(rows))
        floats = to_float(out, "bfloat16")
        assert np.isnan(floats[0]).all() and not np.isnan(floats[1]).any()
        assert not np.isnan(floats[2:10]).any() and np.isnan(floats[10:]).all()


@pytest.mark.parametrize(("stages", "tile_keys"), DECODE_VARIANTS)
def test_every_decode_pipeline(library: ctypes.CDLL, stages: int, tile_keys: int) -> None:
    # Contexts ending inside a tile, shorter than the pipeline, and split-K chunks of whole tiles per variant.
    scene = Scene(kv_heads=2, num_heads=8, head_dim=128, tpb=16, seed=60 + stages + tile_keys)
    sequences = [scene.sequence(1000, 1), scene.sequence(140, 1), scene.sequence(3, 1)]
    scene.write(0, sequences)
    variant = MmaVariant(stages=stages, tile_keys=tile_keys)
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=variant) == (1, 16)
    assert attend_both(library, scene, sequences, resident_ctas=24, variant=variant) == (4, 16)
    scene.close()


@pytest.mark.parametrize(("stages", "tile_keys", "rows"), PREFILL_PIPELINES)
def test_every_prefill_pipeline(library: ctypes.CDLL, stages: int, tile_keys: int, rows: int) -> None:
    scene = Scene(kv_heads=2, num_heads=8, element_type="bfloat16", window=300, sinks=3, seed=70 + stages)
    sequences = [scene.sequence(300, 37), scene.sequence(60, 1), scene.sequence(0, 21)]
    scene.write(0, sequences)
    variant = MmaVariant(stages=stages, tile_keys=tile_keys, prefill_rows=rows)
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=variant) == (1, rows)
    assert attend_both(library, scene, sequences, resident_ctas=64, variant=variant)[0] > 1
    scene.close()


def test_deepest_head_dim_256_pipeline_and_forced_splits(library: ctypes.CDLL) -> None:
    scene = Scene(kv_heads=1, num_heads=4, head_dim=256, tpb=32, seed=80)
    sequences = [scene.sequence(700, 1), scene.sequence(50, 1)]
    scene.write(0, sequences)
    deep = MmaVariant(stages=D256_PIPELINE[3], tile_keys=D256_PIPELINE[4])
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=deep) == (1, 16)
    # Forced factors (the sweep's): 3 splits whatever the occupancy; two waves of 8 resident CTAs on 2 items.
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=MmaVariant(splits=3)) == (3, 16)
    assert attend_both(library, scene, sequences, resident_ctas=8, variant=MmaVariant(split_waves=2)) == (5, 16)
    scene.close()


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize(("stages", "tile_keys", "rows"), PREFILL_PIPELINES)
def test_window_edge_inside_a_warps_rows(
    library: ctypes.CDLL, sinks: int, stages: int, tile_keys: int, rows: int
) -> None:
    # GQA 1: a warp's 16 rows are 16 consecutive tokens, so a 40-key window's edge passes through the keys of
    # one tile for some rows and not for others; a warp may skip the mask only where no row's edge is in its keys.
    scene = Scene(kv_heads=1, num_heads=1, window=40, sinks=sinks, tpb=16, element_type="bfloat16", seed=90 + sinks)
    sequences = [scene.sequence(300, 200), scene.sequence(0, 70)]
    scene.write(0, sequences)
    variant = MmaVariant(stages=stages, tile_keys=tile_keys, prefill_rows=rows)
    assert attend_both(library, scene, sequences, resident_ctas=1, variant=variant) == (1, rows)
    scene.close()
