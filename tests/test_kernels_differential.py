"""Differential fuzz of the data-movement kernels: the CPU build of each ``kernels/*.cu`` (kernels/cpu_shim.cuh,
launched with the launcher's own geometry) vs its NumPy twin vs a reference written here from the documented
contract, one Python loop per row (no code shared with the twins), over seeded shapes and their edges: tokens per
block 1/3/16/64 with expansion, the pool's last page, permuted and repeated sources, padding ids, empty batches.

tests/test_kernels_shim.py compares kernel and twin under hypothesis with odd grids; this adds the third opinion.
``KV_CACHE_MANAGER_V2_FUZZ_SEEDS=N`` runs N seeds per test (a long run by hand); CI runs a small slice.
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2.kernels._launch import row_geometry
from kv_cache_manager_v2.kernels.kv_append import kv_append_reference
from kv_cache_manager_v2.kernels.page_copy import batched_copy_reference, copy_rows_reference
from kv_cache_manager_v2.kernels.ssm_copy import ssm_snapshot_copy_reference
from tests.test_kernels_shim import GXX, Shim, build_shim

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is needed to build the CPU shim")
SEEDS = range(int(os.environ.get("KV_CACHE_MANAGER_V2_FUZZ_SEEDS", "0")) or 8)


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Shim:
    return Shim(build_shim(tmp_path_factory.mktemp("differential_shim"), sanitize=False))


def with_last_first(order: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """A permutation with its largest id moved to the front."""
    last = int(np.argmax(order))
    order[[0, last]] = order[[last, 0]]
    return order


def three_way(
    target: npt.NDArray[np.uint8], twin: object, kernel: object, reference: object
) -> None:
    """Runs each of the three on the same starting bytes of ``target`` and requires identical results."""
    start = target.copy()
    results = []
    for run in (reference, twin, kernel):
        target[...] = start
        run()  # type: ignore[operator]
        results.append(target.copy())
    np.testing.assert_array_equal(results[1], results[0], err_msg="twin vs reference")
    np.testing.assert_array_equal(results[2], results[0], err_msg="kernel vs reference")


@pytest.mark.parametrize("seed", SEEDS)
def test_kv_append_three_ways(shim: Shim, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(6):
        dtype = [np.float16, np.uint16, np.float32][int(rng.integers(0, 3))]
        tpb = int(rng.choice([1, 3, 16, 64]))
        expansion = int(rng.choice([e for e in (1, 2, 4) if tpb % e == 0]))
        tokens_per_page = tpb // expansion
        heads, head_dim = int(rng.integers(1, 4)), int(rng.choice([64, 80, 96, 128, 256]))
        row_bytes = heads * head_dim * np.dtype(dtype).itemsize
        num_blocks = int(rng.integers(1, 6))
        num_pages = (num_blocks + int(rng.integers(0, 3))) * expansion
        stride = tokens_per_page * row_bytes + 16 * int(rng.integers(0, 2))
        pages = rng.integers(0, 256, size=(num_pages, stride), dtype=np.uint8)
        # A block table over permuted pages, the pool's last page among them; a chunk starting mid-block.
        block_pages = rng.permutation(num_pages // expansion)[:num_blocks] * expansion
        block_pages[int(rng.integers(0, num_blocks))] = num_pages - expansion
        block_pages = np.unique(block_pages)
        history = int(rng.integers(0, len(block_pages) * tpb + 1))
        count = int(rng.integers(0, len(block_pages) * tpb - history + 1))
        positions = np.arange(history, history + count, dtype=np.int64)
        page_indices = block_pages[positions // tpb] + positions % tpb // tokens_per_page
        page_indices[rng.random(count) < 0.2] = -1  # padding tokens
        raw_rows = rng.integers(0, 256, size=(count, row_bytes), dtype=np.uint8)
        new_rows = raw_rows.view(dtype).reshape(count, heads, head_dim)

        def reference() -> None:
            for t in range(count):
                if page_indices[t] >= 0:
                    row = int(positions[t]) % tokens_per_page
                    raw = new_rows[t].reshape(-1).view(np.uint8)
                    pages[int(page_indices[t]), row * row_bytes : (row + 1) * row_bytes] = raw

        def kernel() -> None:
            if count:
                shim.launch(
                    "kv_append", row_geometry(count, row_bytes), pages, stride, page_indices.astype(np.int32),
                    positions.astype(np.int32), new_rows, row_bytes, count, tokens_per_page,
                )

        three_way(
            pages, lambda: kv_append_reference(pages, page_indices, positions, new_rows, tokens_per_page), kernel,
            reference,
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_page_copy_rows_three_ways(shim: Shim, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for _ in range(6):
        row_bytes = int(rng.choice([1, 16, 48, 1040, 4096 + 16]))
        src_count, dst_count = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        buffer = rng.integers(0, 256, size=(src_count + dst_count, row_bytes), dtype=np.uint8)
        src, dst = buffer[:src_count], buffer[src_count:]
        count = int(rng.integers(0, dst_count + 1))
        dst_rows = with_last_first(rng.permutation(dst_count))[:count]  # the table's last row among them
        src_rows = rng.integers(0, src_count, size=count)  # repeated sources are legal
        src_rows[rng.random(count) < 0.15] = -1
        mode = str(rng.choice(["both", "gather", "scatter"]))
        dst_ids: npt.NDArray[np.int64] | None = None if mode == "gather" else dst_rows
        src_ids: npt.NDArray[np.int64] | None = None if mode == "scatter" else src_rows
        if mode == "scatter":
            count = min(count, src_count)
            dst_ids = dst_rows[:count]
        if mode == "gather":
            src_ids = src_rows[: min(count, dst_count)]
            count = len(src_ids)
        pairs = [
            (i if dst_ids is None else int(dst_ids[i]), i if src_ids is None else int(src_ids[i])) for i in range(count)
        ]

        def reference() -> None:
            for d, s in pairs:
                if d >= 0 and s >= 0:
                    dst[d] = src[s]

        def kernel() -> None:
            if count:
                tables = [None if ids is None else ids.astype(np.int32) for ids in (dst_ids, src_ids)]
                shim.launch("page_copy_rows", row_geometry(count, row_bytes), dst, tables[0], src, tables[1],
                            row_bytes, count)

        three_way(buffer, lambda: copy_rows_reference(dst, dst_ids, src, src_ids), kernel, reference)


@pytest.mark.parametrize("seed", SEEDS)
def test_ssm_snapshot_copy_three_ways(shim: Shim, seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    for _ in range(6):
        num_slots = int(rng.integers(1, 12))
        slot_bytes = int(rng.choice([4, 33, 512, 8192 + 8]))
        slots = rng.integers(0, 256, size=(num_slots, slot_bytes), dtype=np.uint8)
        half = int(rng.integers(0, num_slots // 2 + 1))
        order = with_last_first(rng.permutation(num_slots))  # the pool's last slot: a destination or a source
        order = order if rng.random() < 0.5 else np.roll(order, half)
        src_slots, dst_slots = order[half : 2 * half].copy(), order[:half].copy()
        src_slots[rng.random(half) < 0.2] = -1

        def reference() -> None:
            for s, d in zip(src_slots, dst_slots):
                if s >= 0 and d >= 0:
                    slots[d] = slots[s]

        def kernel() -> None:
            if half:
                shim.launch("ssm_snapshot_copy", row_geometry(half, slot_bytes), slots, src_slots.astype(np.int32),
                            dst_slots.astype(np.int32), slot_bytes, half)

        three_way(slots, lambda: ssm_snapshot_copy_reference(slots, src_slots, dst_slots), kernel, reference)


@pytest.mark.parametrize("seed", SEEDS)
def test_page_copy_batched_three_ways(shim: Shim, seed: int) -> None:
    rng = np.random.default_rng(300 + seed)
    for _ in range(6):
        src_bytes, dst_bytes = int(rng.integers(1, 5000)), int(rng.integers(1, 5000))
        buffer = rng.integers(0, 256, size=src_bytes + dst_bytes, dtype=np.uint8)
        src, dst = buffer[:src_bytes], buffer[src_bytes:]
        # Disjoint destination spans in a shuffled order, each from anywhere in src; zero sizes too.
        cuts = np.sort(rng.choice(dst_bytes + 1, size=min(dst_bytes + 1, 2 * int(rng.integers(0, 6))), replace=False))
        starts, ends = cuts[0::2], cuts[1::2]
        order = rng.permutation(len(ends))
        dst_offsets = starts[: len(ends)][order].astype(np.int64)
        sizes = (ends - starts[: len(ends)])[order].astype(np.int64)
        src_offsets = np.array([int(rng.integers(0, src_bytes - min(n, src_bytes) + 1)) for n in sizes], np.int64)
        sizes = np.minimum(sizes, src_bytes - src_offsets)

        def reference() -> None:
            for d, s, n in zip(dst_offsets, src_offsets, sizes):
                for i in range(int(n)):
                    dst[int(d) + i] = src[int(s) + i]

        def kernel() -> None:
            if len(sizes):
                shim.launch("page_copy_batched", row_geometry(len(sizes), int(sizes.max(initial=1))), dst,
                            dst_offsets, src, src_offsets, sizes, len(sizes))

        three_way(buffer, lambda: batched_copy_reference(dst, dst_offsets, src, src_offsets, sizes), kernel, reference)
