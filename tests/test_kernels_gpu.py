"""The CuPy launchers of the data-movement kernels on a real GPU, against their NumPy twins (skipped without one).

Each test builds the same bytes on the host and on the device, runs the twin on the host copy and the launcher on
the device copy, and compares the whole buffers, so a stray write just outside a table fails too. Tables are cut at
chosen offsets (mod 16) to drive both the 16-byte vector path and the byte-wise one.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_cache_manager_v2._storage.memory import CudaPoolMemory, HostPoolMemory, PinnedPoolMemory, PoolMemory, copy_rows
from kv_cache_manager_v2.kernels.kv_append import kv_append_cuda, kv_append_reference
from kv_cache_manager_v2.kernels.page_copy import (
    batched_copy_cuda,
    batched_copy_reference,
    copy_rows_cuda,
    copy_rows_reference,
)
from kv_cache_manager_v2.kernels.page_table import convert_page_tables_cuda, convert_page_tables_reference
from kv_cache_manager_v2.kernels.ssm_copy import ssm_snapshot_copy_cuda, ssm_snapshot_copy_reference
from tests.test_kernels_reference import SETTINGS, TableBatch, check_tables, random_bytes, spans, table_batches

cupy = pytest.importorskip("cupy")  # the test-cuda extra; a CPU-only test install has no CuPy
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy.is_available(), reason="CuPy sees no CUDA device"),
]


class Twin:
    """One random buffer held twice, on the host and on the device; tables are cut at the same offsets of both."""

    def __init__(self, rng: np.random.Generator, nbytes: int) -> None:
        self.host = random_bytes(rng, nbytes + 32)
        self.device = cupy.asarray(self.host)

    def tables(self, start: int, rows: int, row_bytes: int) -> tuple[npt.NDArray[np.uint8], object]:
        stop = start + rows * row_bytes
        return self.host[start:stop].reshape(rows, row_bytes), self.device[start:stop].reshape(rows, row_bytes)

    def check(self) -> None:
        cupy.cuda.get_current_stream().synchronize()
        assert np.array_equal(cupy.asnumpy(self.device), self.host)


offsets = st.integers(0, 15)


@SETTINGS
@given(st.data(), offsets, offsets)
def test_copy_rows_matches_its_twin(data: st.DataObject, dst_at: int, src_at: int) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    row_bytes = data.draw(st.sampled_from([1, 16, 100, 4096, 65536 + 16]))
    src_rows_total, dst_rows_total = data.draw(st.integers(1, 20)), data.draw(st.integers(1, 20))
    source, target = Twin(rng, src_rows_total * row_bytes), Twin(rng, dst_rows_total * row_bytes)
    src_host, src_device = source.tables(src_at, src_rows_total, row_bytes)
    dst_host, dst_device = target.tables(dst_at, dst_rows_total, row_bytes)
    dst_rows = data.draw(st.lists(st.integers(-1, dst_rows_total - 1), unique=True, max_size=dst_rows_total))
    src_rows = [data.draw(st.integers(-1, src_rows_total - 1)) for _ in dst_rows]
    copy_rows_reference(dst_host, dst_rows, src_host, src_rows)
    copy_rows_cuda(dst_device, dst_rows, src_device, src_rows)
    target.check()


def test_gather_and_scatter_many_large_pages_in_one_launch_each() -> None:
    rng = np.random.default_rng(4)
    row_bytes, num_rows = 160 * 1024, 600
    pool = Twin(rng, num_rows * row_bytes)
    pool_host, pool_device = pool.tables(0, num_rows, row_bytes)
    rows = [int(r) for r in rng.permutation(num_rows)[:300]]
    staging = cupy.empty((300, row_bytes), dtype=cupy.uint8)
    copy_rows_cuda(staging, None, pool_device, rows)
    assert np.array_equal(cupy.asnumpy(staging), pool_host[rows])
    targets = [int(r) for r in rng.permutation(num_rows)[:300]]
    copy_rows_reference(pool_host, targets, cupy.asnumpy(staging), None)
    copy_rows_cuda(pool_device, targets, staging, None)
    pool.check()


@SETTINGS
@given(st.data(), offsets, offsets)
def test_batched_copy_matches_its_twin(data: st.DataObject, dst_at: int, src_at: int) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src_bytes, dst_bytes = data.draw(st.integers(1, 40000)), data.draw(st.integers(1, 40000))
    source, target = Twin(rng, src_bytes), Twin(rng, dst_bytes)
    src_host, src_device = source.tables(src_at, 1, src_bytes)
    dst_host, dst_device = target.tables(dst_at, 1, dst_bytes)
    dst_offsets, src_offsets, sizes = data.draw(spans(dst_bytes, src_bytes, max_spans=20))
    batched_copy_reference(dst_host.reshape(-1), dst_offsets, src_host.reshape(-1), src_offsets, sizes)
    batched_copy_cuda(cupy.ravel(dst_device), dst_offsets, cupy.ravel(src_device), src_offsets, sizes)
    target.check()


@SETTINGS
@given(st.data(), offsets, st.sampled_from([np.float16, np.uint16, np.float32]))
def test_kv_append_matches_its_twin(data: st.DataObject, at: int, dtype: type[np.generic]) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    heads, head_dim = data.draw(st.integers(1, 8)), data.draw(st.sampled_from([3, 64, 128]))
    tokens_per_page = data.draw(st.sampled_from([1, 4, 16, 32]))
    row_bytes = heads * head_dim * np.dtype(dtype).itemsize
    num_pages = data.draw(st.integers(1, 16))
    stride = tokens_per_page * row_bytes + data.draw(st.sampled_from([0, 16, 6]))
    pool = Twin(rng, num_pages * stride)
    pages_host, pages_device = pool.tables(at, num_pages, stride)
    targets = data.draw(st.lists(st.integers(0, num_pages * tokens_per_page - 1), unique=True, max_size=64))
    page_indices = [t // tokens_per_page if data.draw(st.integers(0, 4)) else -1 for t in targets]
    positions = [t % tokens_per_page + tokens_per_page * data.draw(st.integers(0, 9)) for t in targets]
    new_rows = rng.integers(0, 256, size=(len(targets), heads, head_dim * np.dtype(dtype).itemsize), dtype=np.uint8)
    new_rows_typed = new_rows.view(dtype)
    kv_append_reference(pages_host, page_indices, positions, new_rows_typed, tokens_per_page)
    kv_append_cuda(pages_device, page_indices, positions, cupy.asarray(new_rows_typed), tokens_per_page)
    pool.check()


@SETTINGS
@given(table_batches(max_seqs=8, max_blocks=40))
def test_convert_page_tables_matches_its_twin_and_the_python_converter(batch: TableBatch) -> None:
    base_tables, num_blocks, ranges, slots, params = batch.packed()
    expected = convert_page_tables_reference(base_tables, num_blocks, ranges, slots, params)
    out = convert_page_tables_cuda(cupy.asarray(base_tables), num_blocks, ranges, slots, params)
    host = cupy.asnumpy(out)
    assert np.array_equal(host, expected)
    check_tables(host, batch)


@SETTINGS
@given(st.data(), offsets)
def test_ssm_snapshot_copy_matches_its_twin(data: st.DataObject, at: int) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    num_slots, slot_bytes = data.draw(st.integers(2, 32)), data.draw(st.sampled_from([33, 512, 16384 + 8]))
    pool = Twin(rng, num_slots * slot_bytes)
    slots_host, slots_device = pool.tables(at, num_slots, slot_bytes)
    order = data.draw(st.permutations(range(num_slots)))
    half = data.draw(st.integers(0, num_slots // 2))
    src_slots = [s if data.draw(st.integers(0, 5)) else -1 for s in order[:half]]
    dst_slots = list(order[half : 2 * half])
    ssm_snapshot_copy_reference(slots_host, src_slots, dst_slots)
    ssm_snapshot_copy_cuda(slots_device, src_slots, dst_slots)
    pool.check()


def test_launchers_run_on_the_stream_they_are_given() -> None:
    rng = np.random.default_rng(5)
    pool = Twin(rng, 64 * 4096)
    host, device = pool.tables(0, 64, 4096)
    stream = cupy.cuda.Stream(non_blocking=True)
    copy_rows_reference(host, list(range(32, 64)), host, list(range(32)))
    copy_rows_cuda(device, list(range(32, 64)), device, list(range(32)), stream=stream)
    stream.synchronize()
    assert np.array_equal(cupy.asnumpy(pool.device), pool.host)


MAKERS: dict[str, Callable[[int], PoolMemory]] = {
    "device": CudaPoolMemory,
    "pinned": PinnedPoolMemory,
    "host": HostPoolMemory,
}


@pytest.mark.parametrize("src_kind", list(MAKERS))
@pytest.mark.parametrize("dst_kind", list(MAKERS))
def test_memory_copy_rows_between_tiers(src_kind: str, dst_kind: str) -> None:
    rng = np.random.default_rng(6)
    row_bytes, num_rows = 8192 + 48, 40
    src, dst = MAKERS[src_kind](row_bytes * num_rows), MAKERS[dst_kind](row_bytes * num_rows)
    content = random_bytes(rng, num_rows, row_bytes)
    _fill(src, content)
    _fill(dst, np.zeros_like(content))
    copy_rows(dst, [3, 17, 0, 39], src, [39, 2, 5, 0], row_bytes)
    expected = np.zeros_like(content)
    expected[[3, 17, 0, 39]] = content[[39, 2, 5, 0]]
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(_read(dst).reshape(num_rows, row_bytes), expected)
    # Within one pool, rows both read and written are staged: every source is read before any write.
    copy_rows(src, [1, 2, 3], src, [0, 1, 2], row_bytes)
    content[1:4] = content[0:3].copy()
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(_read(src).reshape(num_rows, row_bytes), content)


def _fill(memory: PoolMemory, content: npt.NDArray[np.uint8]) -> None:
    data = memory.array()
    if isinstance(data, np.ndarray):
        data[:] = content.reshape(-1)
    else:
        cupy.asarray(data)[:] = cupy.asarray(content.reshape(-1))


def _read(memory: PoolMemory) -> npt.NDArray[np.uint8]:
    data = memory.array()
    return data if isinstance(data, np.ndarray) else cupy.asnumpy(data)
