"""The CUDA C of ``kernels/paged_attention.cu`` run on the CPU (g++ + ``kernels/paged_attention_cpu.cuh``).

CI has no GPU, so this is where the kernel's own index arithmetic, masking, online softmax, warp shuffles and
split-K merge meet the twin: g++ compiles the unmodified kernel, its threads run as fibers, and it is launched
with the launcher's own plan and argument list (``plan_launch``, ``kernel_arguments``) on NumPy memory. Skipped
where g++ is missing. The GPU run is tests/test_attention_gpu.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2.kernels._source import kernel_directory
from kv_cache_manager_v2.kernels.attention import (
    TOLERANCES,
    AttentionBatch,
    AttentionParams,
    kernel_arguments,
    paged_attention_reference,
    plan_launch,
)
from tests.test_attention_reference import Scene, Sequence, to_float

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"), reason="needs g++ on Linux"
)

# (name, dtype enum, head_dim, rows): the variants the scenarios below launch.
VARIANTS = [
    ("f16_d64_r4", "attention::kFloat16", 64, 4),
    ("f32_d64_r8", "attention::kFloat32", 64, 8),
    ("bf16_d128_r2", "attention::kBFloat16", 128, 2),
    ("f16_d256_r1", "attention::kFloat16", 256, 1),
    ("f16_d64_r8", "attention::kFloat16", 64, 8),
    ("f32_d64_r1", "attention::kFloat32", 64, 1),
]
SHORT_TYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_CTYPES: dict[type, type[ctypes.c_uint64 | ctypes.c_int64 | ctypes.c_int32 | ctypes.c_float]] = {
    np.uint64: ctypes.c_uint64,
    np.int64: ctypes.c_int64,
    np.int32: ctypes.c_int32,
    np.float32: ctypes.c_float,
}


class PackedArguments(NamedTuple):
    """A kernel's arguments as ctypes values and the array of their addresses a ``cpu_*`` entry point takes; the
    values live as long as this tuple, so keep it until the call returned."""

    values: list[ctypes.c_void_p | ctypes.c_uint64 | ctypes.c_int64 | ctypes.c_int32 | ctypes.c_float]
    pointers: ctypes.Array[ctypes.c_void_p]


def pack_arguments(arguments: Iterable[object]) -> PackedArguments:
    """NumPy arrays by their data address, scalars as the C type of their NumPy type."""
    values = [
        ctypes.c_void_p(argument.ctypes.data)
        if isinstance(argument, np.ndarray)
        else _CTYPES[type(argument)](argument)  # type: ignore[arg-type]
        for argument in arguments
    ]
    return PackedArguments(values, (ctypes.c_void_p * len(values))(*[ctypes.addressof(value) for value in values]))


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    directory = tmp_path_factory.mktemp("paged_attention_cpu")
    lines = ['#include "paged_attention_cpu.cuh"', "#define PAGED_ATTENTION_NO_ENTRIES"]
    lines.append('#include "paged_attention.cu"')
    for name, dtype, head_dim, rows in VARIANTS:
        lines += [f"PAGED_ATTENTION_ENTRY({name}, {dtype}, {head_dim}, {rows})", f"CPU_EXPORT({name})"]
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
) -> tuple[npt.NDArray[np.generic], int]:
    """The kernel's output and its split count; also checks that the split-K counters are back at zero."""
    num_heads, head_dim = int(query.shape[1]), int(query.shape[2])
    plan = plan_launch(batch, params, num_heads, resident_ctas)
    out = np.full_like(query, 0x7E00 if params.element_type != "float32" else np.nan)  # poison: NaN
    partial = np.full(max(1, plan.partial_floats(head_dim)), np.nan, dtype=np.float32)
    counters = np.zeros(plan.num_work_items, dtype=np.uint32)
    arrays = (batch.query_start, batch.positions, batch.key_page_table, batch.value_page_table, batch.kv_page_offset)
    pages = (key_pages.ctypes.data, value_pages.ctypes.data, key_pages.strides[0], len(key_pages), len(value_pages))
    heads = (num_heads, head_dim)
    arguments = kernel_arguments(query, out, pages, arrays, batch, params, heads, plan, (partial, counters))
    packed = pack_arguments(arguments)
    name = f"cpu_{SHORT_TYPES[params.element_type]}_d{head_dim}_r{plan.rows}"
    assert getattr(library, name)(*plan.grid, 128, packed.pointers) == 0, "a barrier deadlocked"
    assert not counters.any(), "the last CTA of each work item resets its counter"
    return out, plan.num_splits


def assert_close(kernel: npt.NDArray[np.generic], twin: npt.NDArray[np.generic], element_type: str) -> None:
    atol, rtol = TOLERANCES[element_type]
    np.testing.assert_allclose(to_float(kernel, element_type), to_float(twin, element_type), atol=atol, rtol=rtol)


def attend_both(
    library: ctypes.CDLL, scene: Scene, sequences: list[Sequence], resident_ctas: int, **inputs: bool
) -> int:
    query, key_pages, value_pages, batch = scene.inputs(0, sequences, window_local=inputs.get("window_local", False))
    out, splits = run_kernel(library, query, key_pages, value_pages, batch, scene.params, resident_ctas)
    assert_close(out, paged_attention_reference(query, key_pages, value_pages, batch, scene.params), scene.element_type)
    return splits


def test_decode_with_split_k_matches_the_twin(library: ctypes.CDLL) -> None:
    scene = Scene(element_type="float16", seed=10)  # GQA 8/2 -> 4-row tiles
    sequences = [scene.sequence(600, 1), scene.sequence(130, 1), scene.sequence(0, 1)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=1) == 1
    # 6 work items, 40 resident CTAs: 6 splits over 601 keys; short sequences leave some splits empty.
    assert attend_both(library, scene, sequences, resident_ctas=40) == 4
    scene.close()


def test_more_splits_than_a_warp_has_lanes(library: ctypes.CDLL) -> None:
    # The last CTA weighs the splits with lanes striding over them: 40 splits > 32 lanes.
    scene = Scene(kv_heads=2, num_heads=2, element_type="float32", tpb=64, seed=17)
    sequences = [scene.sequence(5200, 1)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=80) == 40
    scene.close()


def test_sliding_window_sinks_and_window_local_tables(library: ctypes.CDLL) -> None:
    scene = Scene(window=300, sinks=5, element_type="float16", seed=11)
    sequences = [scene.sequence(700, 1), scene.sequence(310, 1), scene.sequence(3, 1)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=64, window_local=True) > 1
    assert attend_both(library, scene, sequences, resident_ctas=1, window_local=False) == 1
    scene.close()


def test_prefill_with_scratch_blocks_and_expansion(library: ctypes.CDLL) -> None:
    # fp32, 8-row tiles (2 tokens x 4 heads); tpb 8, window 16 and 4 sinks over a 32-token chunk after 16 tokens:
    # blocks [2, 4) are scratch.
    scene = Scene(num_layers=2, window=16, sinks=4, tpb=8, expansion=2, element_type="float32", seed=12)
    sequences = [scene.sequence(16, 32, scratch=True), scene.sequence(7, 3)]
    assert sequences[0].scratch and sequences[0].scratch.range.beg == 2 and sequences[0].scratch.range.end == 4
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=1) == 1
    scene.close()


def test_mha_head_dim_256_and_bf16_head_dim_128(library: ctypes.CDLL) -> None:
    scene = Scene(kv_heads=2, num_heads=2, head_dim=256, tpb=8, seed=13)
    sequences = [scene.sequence(300, 1), scene.sequence(45, 1)]
    scene.write(0, sequences)
    attend_both(library, scene, sequences, resident_ctas=16)
    scene.close()
    scene = Scene(kv_heads=2, num_heads=4, head_dim=128, element_type="bfloat16", seed=14)
    sequences = [scene.sequence(257, 1)]
    scene.write(0, sequences)
    assert attend_both(library, scene, sequences, resident_ctas=8) == 2
    scene.close()


def test_fp16_prefill_many_tiles(library: ctypes.CDLL) -> None:
    scene = Scene(element_type="float16", seed=15)
    sequences = [scene.sequence(0, 17), scene.sequence(100, 1), scene.sequence(60, 9)]
    scene.write(0, sequences)
    attend_both(library, scene, sequences, resident_ctas=1)
    scene.close()


def test_a_missing_page_poisons_only_its_queries(library: ctypes.CDLL) -> None:
    scene = Scene(element_type="float16", seed=16)
    sequences = [scene.sequence(80, 1), scene.sequence(90, 1)]
    scene.write(0, sequences)
    query, key_pages, value_pages, _ = scene.inputs(0, sequences)
    tables = scene.inputs(0, sequences)[3]
    key_table = tables.key_page_table.copy()
    key_table[0, 2] = -1  # block 2 of sequence 0 (visible to its decode query)
    batch = AttentionBatch(tables.query_start, tables.positions, key_table, tables.value_page_table)
    for resident in (1, 64):
        out, _ = run_kernel(library, query, key_pages, value_pages, batch, scene.params, resident)
        floats = to_float(out, "float16")
        assert np.isnan(floats[0]).all() and not np.isnan(floats[1]).any()
