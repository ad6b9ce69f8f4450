"""The CUDA C of the data-movement kernels, run on the CPU through kernels/cpu_shim.cuh, against the NumPy twins.

g++ compiles the unmodified .cu files (with the shim defining __global__, threadIdx, ...) into a shared library in
pytest's tmp dir; ctypes launches each kernel on NumPy arrays with small, odd grids so the grid-stride loops, the
16-byte vector path and its byte-wise head and tail all run. One test reruns this file under AddressSanitizer and
UndefinedBehaviorSanitizer (out-of-bounds accesses, misaligned 16-byte vectors), where one more test proves that ASan
notices a page past the end.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_cache_manager_v2.kernels._launch import flat_geometry, row_geometry
from kv_cache_manager_v2.kernels._source import kernel_directory
from kv_cache_manager_v2.kernels.kv_append import kv_append_reference
from kv_cache_manager_v2.kernels.mapped_copy import pack_row_tables
from kv_cache_manager_v2.kernels.page_copy import batched_copy_reference, copy_rows_reference
from kv_cache_manager_v2.kernels.page_table import convert_page_tables_reference
from kv_cache_manager_v2.kernels.ssm_copy import ssm_snapshot_copy_reference
from tests.test_kernels_reference import SETTINGS, TableBatch, check_tables, random_bytes, spans, table_batches

SANITIZE_ENV = "KV_CACHE_MANAGER_V2_SHIM_SANITIZE"
SANITIZED = os.environ.get(SANITIZE_ENV) == "1"
SHIM_SETTINGS = settings(SETTINGS, max_examples=12 if SANITIZED else 30)
GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is needed to build the CPU shim")

P = ctypes.c_void_p
I32 = ctypes.c_int
I64 = ctypes.c_longlong
CValue = ctypes.c_void_p | ctypes.c_int | ctypes.c_longlong
SIGNATURES: dict[str, tuple[type[CValue], ...]] = {
    "page_copy_rows": (P, P, P, P, I64, I32),
    "page_copy_batched": (P, P, P, P, P, I32),
    "kv_append": (P, I64, P, P, P, I64, I32, I32),
    "convert_page_tables": (P, P, P, P, P, P, I32, I32, I32, I32, I32),
    "ssm_snapshot_copy": (P, P, P, I64, I32),
}
SOURCES = ("page_copy.cu", "kv_append.cu", "page_table.cu", "ssm_copy.cu")
Geometry = tuple[tuple[int, ...], tuple[int, ...]]


def build_shim(directory: Path, sanitize: bool) -> Path:
    """Compile every data-movement .cu with the shim into ``directory``; returns the library's path."""
    source = directory / "shim_kernels.cpp"
    lines = ['#include "cpu_shim.cuh"', *(f'#include "{name}"' for name in SOURCES)]
    lines += [f"SHIM_EXPORT({name})" for name in SIGNATURES]
    source.write_text("\n".join(lines) + "\n")
    library = directory / ("libshim_sanitized.so" if sanitize else "libshim.so")
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"] if sanitize else []
    command = [GXX or "g++", "-std=c++20", "-O1", "-g", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Werror"]
    command += [*flags, f"-I{kernel_directory()}", str(source), "-o", str(library)]
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}  # g++ itself runs unsanitized
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"g++ failed:\n{result.stderr}"
    return library


class Shim:
    """Launches the shim's kernels with cuLaunchKernel-style argument arrays."""

    def __init__(self, library: Path) -> None:
        self.path = library
        self.library = ctypes.CDLL(str(library))

    def launch(self, name: str, geometry: Geometry, *args: object) -> None:
        grid = (*geometry[0], 1, 1)[:3]
        block = (*geometry[1], 1, 1)[:3]
        values = [self._value(kind, arg) for kind, arg in zip(SIGNATURES[name], args, strict=True)]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        getattr(self.library, f"shim_{name}")(*grid, *block, pointers)

    @staticmethod
    def _value(kind: type[CValue], arg: object) -> CValue:
        """A NumPy array (or None) becomes its address, a number the kernel parameter's C type."""
        if kind is P:
            assert arg is None or isinstance(arg, np.ndarray), arg
            return P(None if arg is None else arg.ctypes.data)
        assert isinstance(arg, (int, np.integer)), arg
        return kind(int(arg))


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Shim:
    return Shim(build_shim(tmp_path_factory.mktemp("shim"), SANITIZED))


def geometries() -> st.SearchStrategy[Geometry]:
    """Small grids and blocks, often fewer threads than work, so every grid-stride loop turns."""
    return st.tuples(
        st.tuples(st.integers(1, 3), st.integers(1, 3)),
        st.tuples(st.sampled_from([1, 3, 4, 32]), st.integers(1, 3)),
    )


def table_at(rng: np.random.Generator, rows: int, row_bytes: int, misalign: int | None) -> npt.NDArray[np.uint8]:
    """Random ``[rows, row_bytes]`` table; ``misalign`` places it at that offset mod 16 inside a larger buffer, None
    allocates it exactly (so the sanitizer sees one byte past the end)."""
    if misalign is None:
        return random_bytes(rng, rows, row_bytes)
    buffer = random_bytes(rng, rows * row_bytes + 32)
    start = (misalign - buffer.ctypes.data) % 16
    return buffer[start : start + rows * row_bytes].reshape(rows, row_bytes)


def compare(target: npt.NDArray[np.generic], twin: Callable[[], None], kernel: Callable[[], None]) -> None:
    """Runs the twin, then the kernel from the same bytes, and compares the whole buffer ``target`` was cut from (so
    a stray write just outside the table counts too)."""
    buffer = target if target.base is None else np.asarray(target.base)
    before = buffer.copy()
    twin()
    expected = buffer.copy()
    buffer[...] = before
    kernel()
    assert np.array_equal(buffer, expected)


def int32(values: list[int] | None) -> npt.NDArray[np.int32] | None:
    return None if values is None else np.array(values, dtype=np.int32)


alignments = st.one_of(st.none(), st.integers(0, 15))


# --- page copies ----------------------------------------------------------------------------------------------------


@SHIM_SETTINGS
@given(st.data(), geometries(), alignments, alignments)
def test_page_copy_rows_matches_its_twin(
    shim: Shim, data: st.DataObject, geometry: Geometry, dst_align: int | None, src_align: int | None
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    row_bytes = data.draw(st.sampled_from([0, 1, 7, 16, 48, 100, 256, 1040]))
    src = table_at(rng, data.draw(st.integers(1, 9)), row_bytes, src_align)
    dst = table_at(rng, data.draw(st.integers(1, 9)), row_bytes, dst_align)
    pairs = data.draw(st.lists(st.tuples(st.integers(-1, dst.shape[0] - 1), st.integers(-1, src.shape[0] - 1))))
    pairs = list(dict(pairs).items())[: min(dst.shape[0], src.shape[0])]  # distinct destinations; fits either side
    dst_rows: list[int] | None = [d for d, _ in pairs]
    src_rows: list[int] | None = [s for _, s in pairs]
    side = data.draw(st.sampled_from(["both", "gather", "scatter"]))
    if side == "gather":
        dst_rows = None  # rows 0, 1, ... of dst: a staging table
    elif side == "scatter":
        src_rows = None
    count = len(pairs)
    compare(
        dst,
        lambda: copy_rows_reference(dst, dst_rows, src, src_rows),
        lambda: shim.launch("page_copy_rows", geometry, dst, int32(dst_rows), src, int32(src_rows), row_bytes, count),
    )


def test_page_copy_rows_with_the_launcher_geometry(shim: Shim) -> None:
    rng = np.random.default_rng(3)
    pool = table_at(rng, 12, 4096 + 16, 0)
    target = table_at(rng, 12, 4096 + 16, 4)  # different alignment: the byte-wise path
    rows = [11, 0, 5, 3, 9]
    compare(
        target,
        lambda: copy_rows_reference(target, rows[::-1], pool, rows),
        lambda: shim.launch(
            "page_copy_rows", row_geometry(5, 4112), target, int32(rows[::-1]), pool, int32(rows), 4112, 5
        ),
    )


def test_page_copy_rows_reads_the_packed_row_tables_of_a_mapped_move(shim: Shim) -> None:
    """A device <-> pinned move uploads both row tables as one buffer (``pack_row_tables``) and hands the kernel its
    two halves; scattered 16 KiB pages land where the twin puts them."""
    rng = np.random.default_rng(41)
    row_bytes, rows = 16 * 1024, 24
    pool = table_at(rng, rows, row_bytes, 0)
    target = table_at(rng, rows, row_bytes, 0)
    dst_ids = rng.permutation(rows)[:17].astype(np.int64)
    src_ids = rng.permutation(rows)[:17].astype(np.int64)
    packed = np.full(2 * rows, -7, dtype=np.int32)  # longer than needed, as a ring slot is
    pack_row_tables(packed, dst_ids, src_ids)
    count = int(dst_ids.size)
    compare(
        target,
        lambda: copy_rows_reference(target, dst_ids, pool, src_ids),
        lambda: shim.launch(
            "page_copy_rows", row_geometry(count, row_bytes), target, packed, pool, packed[count:], row_bytes, count
        ),
    )


@SHIM_SETTINGS
@given(st.data(), geometries(), alignments, alignments)
def test_page_copy_batched_matches_its_twin(
    shim: Shim, data: st.DataObject, geometry: Geometry, dst_align: int | None, src_align: int | None
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src = table_at(rng, 1, data.draw(st.integers(1, 700)), src_align).reshape(-1)
    dst = table_at(rng, 1, data.draw(st.integers(1, 700)), dst_align).reshape(-1)
    dst_offsets, src_offsets, sizes = (np.array(v, np.int64) for v in data.draw(spans(dst.size, src.size)))
    compare(
        dst,
        lambda: batched_copy_reference(dst, dst_offsets, src, src_offsets, sizes),
        lambda: shim.launch("page_copy_batched", geometry, dst, dst_offsets, src, src_offsets, sizes, sizes.size),
    )


# --- KV append ------------------------------------------------------------------------------------------------------


@SHIM_SETTINGS
@given(st.data(), geometries(), alignments, st.sampled_from([np.float16, np.uint16, np.float32]))
def test_kv_append_matches_its_twin(
    shim: Shim, data: st.DataObject, geometry: Geometry, align: int | None, dtype: type[np.generic]
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    heads, head_dim = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([1, 3, 8, 64]))
    tokens_per_page = data.draw(st.integers(1, 4))
    row_bytes = heads * head_dim * np.dtype(dtype).itemsize
    num_pages = data.draw(st.integers(1, 5))
    pages = table_at(rng, num_pages, tokens_per_page * row_bytes + data.draw(st.sampled_from([0, 16, 6])), align)
    targets = data.draw(st.lists(st.integers(0, num_pages * tokens_per_page - 1), unique=True, max_size=10))
    page_indices = np.array([t // tokens_per_page if data.draw(st.integers(0, 4)) else -1 for t in targets], np.int32)
    laps = [tokens_per_page * data.draw(st.integers(0, 9)) for _ in targets]
    positions = np.array([t % tokens_per_page + lap for t, lap in zip(targets, laps)], np.int32)
    new_rows = table_at(rng, len(targets), row_bytes, data.draw(alignments)).view(dtype).reshape(-1, heads, head_dim)
    compare(
        pages,
        lambda: kv_append_reference(pages, page_indices, positions, new_rows, tokens_per_page),
        lambda: shim.launch(
            "kv_append",
            geometry,
            pages,
            pages.shape[1],
            page_indices,
            positions,
            new_rows,
            row_bytes,
            len(targets),
            tokens_per_page,
        ),
    )


# --- page-table conversion ------------------------------------------------------------------------------------------


def launch_page_tables(
    shim: Shim, geometry: Geometry | None, *packed: npt.NDArray[np.int32], out_width: int
) -> npt.NDArray[np.int32]:
    base_tables, num_blocks, ranges, slots, params = packed
    out = np.full((params.shape[0], base_tables.shape[0], out_width), 12345, dtype=np.int32)
    shim.launch(
        "convert_page_tables",
        geometry or flat_geometry(out.size),
        out,
        base_tables,
        num_blocks,
        ranges,
        slots,
        params,
        params.shape[0],
        base_tables.shape[0],
        base_tables.shape[1],
        slots.shape[1],
        out_width,
    )
    return out


@SHIM_SETTINGS
@given(table_batches(), st.one_of(st.none(), geometries()))
def test_convert_page_tables_matches_its_twin_and_the_python_converter(
    shim: Shim, batch: TableBatch, geometry: Geometry | None
) -> None:
    packed = batch.packed()
    expected = convert_page_tables_reference(*packed)
    out = launch_page_tables(shim, geometry, *packed, out_width=expected.shape[2])
    assert np.array_equal(out, expected)
    check_tables(out, batch)


def test_convert_page_tables_gives_minus_one_where_the_twin_would_raise(shim: Shim) -> None:
    # The kernel cannot raise: a base index below -1 and a scratch block without a slot become -1.
    base_tables = np.array([[-5, 2, -1, 7]], dtype=np.int32)
    ranges = np.array([[2, 4]], dtype=np.int32)
    slots = np.array([[3]], dtype=np.int32)  # block 3 needs slot position 1 (t = 3 with ppb 2, k 1, scale 2)
    params = np.array([[2, 1, 1, 2, 1, 1]], dtype=np.int32)
    out = launch_page_tables(shim, None, base_tables, np.array([4], np.int32), ranges, slots, params, out_width=5)
    assert out.tolist() == [[[-1, 5, 7, -1, -1]]]


def test_convert_page_tables_gives_minus_one_for_an_index_past_int32(shim: Shim) -> None:
    # Device base tables are not checked on the host: base 2^30 x scale 4 + 1 wrapped to page 1 (another block's
    # page) and (2^29 + 1) x 4 + 1 to -2147483643; an index that does not fit int32 is "no page" (-1) instead.
    base_tables = np.array([[2**30, 2**29 + 1, 3]], dtype=np.int32)
    params = np.array([[4, 1, 1, 1, 0, 1], [2, 2, 0, 1, 0, 0]], dtype=np.int32)
    ranges, slots = np.zeros((1, 2), np.int32), np.zeros((1, 0), np.int32)
    out = launch_page_tables(shim, None, base_tables, np.array([3], np.int32), ranges, slots, params, out_width=6)
    assert out.tolist() == [[[-1, -1, 13, -1, -1, -1]], [[-1, -1, -1, -1, 12, 13]]]


# --- SSM snapshot copy ----------------------------------------------------------------------------------------------


@SHIM_SETTINGS
@given(st.data(), geometries(), alignments)
def test_ssm_snapshot_copy_matches_its_twin(
    shim: Shim, data: st.DataObject, geometry: Geometry, align: int | None
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    num_slots = data.draw(st.integers(2, 10))
    slots = table_at(rng, num_slots, data.draw(st.sampled_from([4, 33, 160, 512])), align)
    order = data.draw(st.permutations(range(num_slots)))
    half = data.draw(st.integers(0, num_slots // 2))
    src_slots = np.array([s if data.draw(st.integers(0, 5)) else -1 for s in order[:half]], dtype=np.int32)
    dst_slots = np.array(order[half : 2 * half], dtype=np.int32)
    compare(
        slots,
        lambda: ssm_snapshot_copy_reference(slots, src_slots, dst_slots),
        lambda: shim.launch("ssm_snapshot_copy", geometry, slots, src_slots, dst_slots, slots.shape[1], half),
    )


# --- sanitizers -----------------------------------------------------------------------------------------------------


@pytest.mark.skipif(SANITIZED, reason="this is the run under the sanitizers")
def test_shim_suite_under_sanitizers() -> None:
    """Reruns this file with ASan + UBSan in a subprocess (ASan's runtime must be preloaded into Python)."""
    asking = [GXX or "g++", "-print-file-name=libasan.so"]
    runtime = subprocess.run(asking, capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(runtime) or not os.path.exists(runtime):
        pytest.skip("g++ ships no libasan.so here")
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0", PYTHONDONTWRITEBYTECODE="1")
    env[SANITIZE_ENV] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-rp", "-p", "no:cacheprovider", "-k", "not suite_under_sanitizers"]
    command.append(__file__)
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
    assert Path(__file__).name + "::test_address_sanitizer_catches" in result.stdout, result.stdout[-2000:]


# Collected only in the sanitized rerun, which test_shim_suite_under_sanitizers requires to pass with nothing skipped:
# a plain run would report it as a skip that no missing GPU or extra explains.
if SANITIZED:

    def test_address_sanitizer_catches_a_page_past_the_end(shim: Shim) -> None:
        # Row 4 of a 4-row table: one row past the end of an exactly sized allocation.
        script = f"""
import ctypes, numpy as np
lib = ctypes.CDLL({str(shim.path)!r})
src, dst = np.zeros((4, 32), np.uint8), np.zeros((1, 32), np.uint8)
rows = np.array([4], np.int32)
values = [ctypes.c_void_p(dst.ctypes.data), ctypes.c_void_p(None), ctypes.c_void_p(src.ctypes.data),
          ctypes.c_void_p(rows.ctypes.data), ctypes.c_longlong(32), ctypes.c_int(1)]
args = (ctypes.c_void_p * 6)(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
lib.shim_page_copy_rows(1, 1, 1, 2, 1, 1, args)
"""
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert result.returncode != 0
        assert "heap-buffer-overflow" in result.stderr
