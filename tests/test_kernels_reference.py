"""NumPy twins of the data-movement kernels (SPEC §9) against plain Python expectations and ``PageIndexConverter``.

The twins are the cpu backend's implementation and the oracle of the CUDA tests (test_kernels_shim.py,
test_kernels_gpu.py), so each is checked here against an obvious loop. The strategies below are shared with those
files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_cache_manager_v2 import HalfOpenRange, PageIndexConverter, PageIndexMode, ScratchDesc
from kv_cache_manager_v2._storage.memory import HostPoolMemory, copy_rows
from kv_cache_manager_v2.kernels._launch import THREADS_PER_BLOCK, VECTORS_IN_FLIGHT, row_geometry
from kv_cache_manager_v2.kernels.kv_append import kv_append_reference
from kv_cache_manager_v2.kernels.page_copy import batched_copy_reference, copy_rows_reference
from kv_cache_manager_v2.kernels.page_table import (
    convert_page_tables_reference,
    converter_params,
    pack_base_tables,
    pack_scratch,
)
from kv_cache_manager_v2.kernels.ssm_copy import ssm_snapshot_copy_reference

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
PER_LAYER = PageIndexMode.PER_LAYER
SHARED = PageIndexMode.SHARED


def random_bytes(rng: np.random.Generator, *shape: int) -> npt.NDArray[np.uint8]:
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


# --- page-table batches, shared with the shim and GPU tests ------------------------------------------------------


@dataclass
class TableBatch:
    """One layer group's conversion inputs as the Python converter takes them."""

    converters: list[PageIndexConverter]
    mode: PageIndexMode
    bases: list[list[int]]
    scratch: list[ScratchDesc | None]

    def packed(self) -> tuple[npt.NDArray[np.int32], ...]:
        base_tables, num_blocks = pack_base_tables(self.bases)
        ranges, slots = pack_scratch(self.scratch)
        return base_tables, num_blocks, ranges, slots, converter_params(self.converters, self.mode)

    def expected(self) -> list[list[list[int]]]:
        """``PageIndexConverter`` output per converter and sequence."""
        return [
            [converter(base, self.mode, desc) for base, desc in zip(self.bases, self.scratch)]
            for converter in self.converters
        ]


@st.composite
def converters(draw: st.DrawFn) -> PageIndexConverter:
    scale = draw(st.integers(1, 6))
    pages_per_block = draw(st.integers(1, scale))
    return PageIndexConverter(
        scale=scale,
        expansion=draw(st.integers(1, 4)),
        layer_offset=draw(st.integers(0, scale - 1)),
        scratch_pages_per_block=pages_per_block,
        scratch_page_in_block=draw(st.integers(0, pages_per_block - 1)),
    )


def slots_needed(converters: list[PageIndexConverter], beg: int, last: int) -> int:
    """Scratch slots that blocks ``[beg, last]`` need under every converter (SPEC §3's ``t // scale``)."""
    return max(((last - beg) * c.scratch_pages_per_block + c.scratch_page_in_block) // c.scale + 1 for c in converters)


@st.composite
def table_batches(draw: st.DrawFn, max_seqs: int = 4, max_blocks: int = 10) -> TableBatch:
    mode = draw(st.sampled_from([SHARED, PER_LAYER]))
    convs = draw(st.lists(converters(), min_size=1, max_size=4))
    bases: list[list[int]] = []
    scratch: list[ScratchDesc | None] = []
    for _ in range(draw(st.integers(1, max_seqs))):
        length = draw(st.integers(0, max_blocks))
        bases.append(draw(st.lists(st.integers(-1, 40), min_size=length, max_size=length)))
        desc: ScratchDesc | None = None
        if mode == PER_LAYER and length and draw(st.booleans()):
            beg = draw(st.integers(0, length - 1))
            end = draw(st.integers(beg + 1, length + 2))
            count = slots_needed(convs, beg, min(end, length) - 1) + draw(st.integers(0, 1))
            slot_ids = draw(st.lists(st.integers(0, 40), min_size=count, max_size=count))
            desc = ScratchDesc(HalfOpenRange(beg, end), tuple(slot_ids))
        scratch.append(desc)
    return TableBatch(convs, mode, bases, scratch)


def check_tables(out: npt.NDArray[np.int32], batch: TableBatch) -> None:
    """Each row of ``out`` starts with the Python converter's list and is -1 after it."""
    assert out.shape[:2] == (len(batch.converters), len(batch.bases))
    for c, rows in enumerate(batch.expected()):
        for s, row in enumerate(rows):
            assert out[c, s, : len(row)].tolist() == row, (c, s)
            assert (out[c, s, len(row) :] == -1).all(), (c, s)


@st.composite
def spans(draw: st.DrawFn, dst_bytes: int, src_bytes: int, max_spans: int = 12) -> tuple[list[int], ...]:
    """``(dst_offsets, src_offsets, sizes)`` of a batched copy: the destination cut at sorted points, some pieces
    kept (so destination spans never overlap), each fetched from anywhere in the source."""
    cuts = sorted(draw(st.lists(st.integers(0, dst_bytes), max_size=max_spans)))
    pieces = [(a, b - a) for a, b in zip([0, *cuts], [*cuts, dst_bytes]) if b - a <= src_bytes and draw(st.booleans())]
    src_offsets = [draw(st.integers(0, src_bytes - size)) for _, size in pieces]
    return [offset for offset, _ in pieces], src_offsets, [size for _, size in pieces]


# --- page-table conversion ------------------------------------------------------------------------------------------


@SETTINGS
@given(table_batches())
def test_page_tables_match_the_python_converter(batch: TableBatch) -> None:
    check_tables(convert_page_tables_reference(*batch.packed()), batch)


def test_page_table_docstring_example_and_scratch_mapping() -> None:
    converter = PageIndexConverter(4, expansion=2, layer_offset=1, scratch_pages_per_block=2, scratch_page_in_block=1)
    scratch = ScratchDesc(HalfOpenRange(1, 3), (9,))
    batch = TableBatch([converter], PER_LAYER, [[3, -1], [5, -1, -1, 7]], [None, scratch])
    out = convert_page_tables_reference(*batch.packed())
    # Block 1 and 2 are scratch: t = 1 and 3 -> slot 9, indices 37 and 39, expanded by 2.
    assert out[0].tolist() == [[26, 27, -1, -1, -1, -1, -1, -1], [42, 43, 74, 75, 78, 79, 58, 59]]
    check_tables(out, batch)


@pytest.mark.parametrize(("slots", "words"), [((4,), "1 slot"), ((4, 5), "2 slots")])
def test_too_few_scratch_slots_are_counted_in_english(slots: tuple[int, ...], words: str) -> None:
    """Block ``b`` of the range needs slot position ``b``: a range one block longer than its slots is one short, in
    the converter and in the page-table twin alike. Before: "has 1 slot(s), too few" (and "2 slot(s)")."""
    converter = PageIndexConverter(2, expansion=1, layer_offset=1, scratch_pages_per_block=2, scratch_page_in_block=1)
    blocks = len(slots) + 1
    short = ScratchDesc(HalfOpenRange(0, blocks), slots)
    with pytest.raises(ValueError) as by_converter:
        converter([-1] * blocks, PER_LAYER, short)
    said = f"scratch descriptor has {words}, too few for block {blocks - 1} of range [0, {blocks})"
    assert said in str(by_converter.value), by_converter.value
    with pytest.raises(ValueError) as by_twin:
        convert_page_tables_reference(*TableBatch([converter], PER_LAYER, [[-1] * blocks], [short]).packed())
    said = f"scratch_slots[0] has {words}, too few for block {blocks - 1} of range [0, {blocks})"
    assert said in str(by_twin.value), by_twin.value


def test_page_tables_reject_what_the_python_converter_rejects() -> None:
    converter = PageIndexConverter(2, expansion=1, layer_offset=1, scratch_pages_per_block=2, scratch_page_in_block=1)
    short = ScratchDesc(HalfOpenRange(0, 2), (4,))  # block 1 needs t = 3 -> slot position 1: too few slots
    with pytest.raises(ValueError, match="too few"):
        converter([-1, -1], PER_LAYER, short)
    with pytest.raises(ValueError, match=r"scratch_slots\[0\] has 1 slot"):
        convert_page_tables_reference(*TableBatch([converter], PER_LAYER, [[-1, -1]], [short]).packed())
    # Only visited blocks need slots: with one block, one slot is enough for both.
    check_tables(
        convert_page_tables_reference(*TableBatch([converter], PER_LAYER, [[-1]], [short]).packed()),
        TableBatch([converter], PER_LAYER, [[-1]], [short]),
    )
    base_tables, num_blocks, ranges, slots, _ = TableBatch([converter], PER_LAYER, [[-1, -1]], [short]).packed()
    with pytest.raises(ValueError, match="requires index_mode=PageIndexMode.PER_LAYER"):
        convert_page_tables_reference(base_tables, num_blocks, ranges, slots, converter_params([converter], SHARED))
    base_tables, num_blocks, ranges, slots, params = TableBatch([converter], SHARED, [[2, -2]], [None]).packed()
    with pytest.raises(ValueError, match=r"base_tables\[0, 1\] = -2"):
        convert_page_tables_reference(base_tables, num_blocks, ranges, slots, params)
    with pytest.raises(ValueError, match="out_width 1 is too small"):
        convert_page_tables_reference(base_tables, num_blocks, ranges, slots, params, out_width=1)
    with pytest.raises(ValueError, match=r"params\[:, 1\] \(expansion\)"):
        convert_page_tables_reference(base_tables, num_blocks, ranges, slots, np.array([[1, 0, 0, 1, 0, 0]]))
    with pytest.raises(ValueError, match="overflow int32"):
        big = TableBatch([PageIndexConverter(8, 8, 0, 1, 0)], SHARED, [[2**28]], [None])
        convert_page_tables_reference(*big.packed())


def test_page_tables_refuse_a_layer_offset_that_wraps_int32() -> None:
    # Base 1 x scale 1 + layer_offset 2^31 - 1 = 2^31: the twin (and the kernel, through its int cast) returned
    # -2147483648, a negative page index other than -1, where the Python converter gives 2^31 (no int32). A layer
    # offset past the slot is now refused as such; within the slot, the largest index that fits int32 passes.
    params = np.array([[1, 1, 2**31 - 1, 1, 0, PER_LAYER.value]], dtype=np.int32)
    base_tables, num_blocks = np.array([[1, 0]], dtype=np.int32), np.array([2], dtype=np.int32)
    ranges, slots = np.zeros((1, 2), dtype=np.int32), np.zeros((1, 0), dtype=np.int32)
    with pytest.raises(ValueError, match=r"params\[0\] \(layer_offset\) puts pages outside the slot"):
        convert_page_tables_reference(base_tables, num_blocks, ranges, slots, params)
    params[0, :3] = (2**30, 1, 2**30 - 1)  # base 1 -> index 2^31 - 1, the largest int32: fits
    assert convert_page_tables_reference(base_tables, num_blocks, ranges, slots, params).tolist() == [
        [[2**31 - 1, 2**30 - 1]]
    ]
    with pytest.raises(ValueError, match="layer_offset up to 1073741823, x expansion 1, overflow int32"):
        convert_page_tables_reference(np.array([[2, 0]], dtype=np.int32), num_blocks, ranges, slots, params)


def test_page_tables_refuse_parameter_rows_that_leave_the_slot() -> None:
    """What ``PageIndexConverter`` refuses at construction, the launcher's checks refuse in a raw parameter row
    (``k >= ppb`` mapped a scratch block onto the next buffer's page; ``ppb > scale`` past the slot)."""
    base_tables, num_blocks = np.array([[0, 1]], dtype=np.int32), np.array([2], dtype=np.int32)
    ranges, slots = np.array([[0, 2]], dtype=np.int32), np.array([[3, 4]], dtype=np.int32)
    for row, name in (([2, 1, 2, 1, 0, 1], "layer_offset"), ([2, 1, 0, 3, 0, 1], "scratch_pages_per_block"),
                      ([2, 1, 0, 1, 1, 1], "scratch_page_in_block")):
        with pytest.raises(ValueError, match=rf"params\[0\] \({name}\) puts pages outside the slot"):
            convert_page_tables_reference(base_tables, num_blocks, ranges, slots, np.array([row], dtype=np.int32))
        with pytest.raises(ValueError, match=rf"PageIndexConverter.{name} must be in"):
            PageIndexConverter(*row[:5])


def test_page_tables_take_numpy_integers_and_a_wider_output() -> None:
    converter = PageIndexConverter(2, 2, 1, 1, 0)
    base_tables = np.array([[np.int64(3), -1]], dtype=np.int64)
    out = convert_page_tables_reference(
        base_tables,
        [np.int64(2)],
        np.zeros((1, 2), np.int64),
        np.zeros((1, 0), np.int64),
        converter_params([converter], PER_LAYER),
        out_width=np.int32(6),
    )
    assert out.tolist() == [[[14, 15, -1, -1, -1, -1]]]


# --- page copies ----------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_copy_rows_moves_each_pair(data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    row_bytes = data.draw(st.integers(0, 70))
    src = random_bytes(rng, data.draw(st.integers(1, 12)), row_bytes)
    dst = random_bytes(rng, data.draw(st.integers(1, 12)), row_bytes)
    dst_rows = data.draw(st.lists(st.integers(-1, dst.shape[0] - 1), unique=True, max_size=dst.shape[0]))
    src_rows = [data.draw(st.integers(-1, src.shape[0] - 1)) for _ in dst_rows]
    expected = dst.copy()
    for d, s in zip(dst_rows, src_rows):
        if d >= 0 and s >= 0:
            expected[d] = src[s]
    copy_rows_reference(dst, dst_rows, src, src_rows)
    assert np.array_equal(dst, expected)


def test_gather_and_scatter_through_a_staging_table() -> None:
    rng = np.random.default_rng(1)
    pool = random_bytes(rng, 8, 24)
    staging = np.zeros((3, 24), np.uint8)
    copy_rows_reference(staging, None, pool, [5, 0, 7])
    assert np.array_equal(staging, pool[[5, 0, 7]])
    target = np.zeros((8, 24), np.uint8)
    copy_rows_reference(target, [1, 2, 3], staging, None)
    assert np.array_equal(target[1:4], pool[[5, 0, 7]]) and not target[[0, 4, 5, 6, 7]].any()


def test_copy_rows_rejects_races_and_bad_rows() -> None:
    table = np.zeros((4, 8), np.uint8)
    other = np.zeros((4, 8), np.uint8)
    with pytest.raises(ValueError, match="dst_rows names 1 more than once"):
        copy_rows_reference(table, [1, 1], other, [0, 2])
    with pytest.raises(ValueError, match=r"row 2 of the same table is both .* \(in src_rows and dst_rows\)"):
        copy_rows_reference(table, [1, 2], table, [2, 3])
    with pytest.raises(ValueError, match=r"src_rows\[1\] = 4 is outside \[-1, 4\)"):
        copy_rows_reference(table, [0, 1], other, [0, 4])
    with pytest.raises(ValueError, match="dst_rows=None addresses 5 rows"):
        copy_rows_reference(table, None, np.zeros((9, 8), np.uint8), [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="cannot take src rows of 4 bytes"):
        copy_rows_reference(table, [0], np.zeros((4, 4), np.uint8), [0])
    with pytest.raises(ValueError, match="overlap without being the same table"):
        copy_rows_reference(table[1:], [0], table[:3], [2])
    with pytest.raises(ValueError, match="C-contiguous 2-D uint8"):
        copy_rows_reference(table[:, :4], [0], other[:, :4], [0])
    with pytest.raises(TypeError, match="dst_rows must hold integers"):
        copy_rows_reference(table, [0.5], other, [0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="dst must be a NumPy array"):
        copy_rows_reference([[0]], [0], other, [0])  # type: ignore[arg-type]


@SETTINGS
@given(st.data())
def test_batched_copy_moves_each_span(data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    src = random_bytes(rng, data.draw(st.integers(1, 300)))
    dst = random_bytes(rng, data.draw(st.integers(1, 300)))
    dst_offsets, src_offsets, sizes = data.draw(spans(dst.size, src.size))
    expected = dst.copy()
    for dst_offset, src_offset, size in zip(dst_offsets, src_offsets, sizes):
        expected[dst_offset : dst_offset + size] = src[src_offset : src_offset + size]
    batched_copy_reference(dst, dst_offsets, src, src_offsets, sizes)
    assert np.array_equal(dst, expected)


def test_batched_copy_rejects_overlaps_and_spans_past_the_end() -> None:
    dst = np.zeros(32, np.uint8)
    src = np.zeros(32, np.uint8)
    with pytest.raises(ValueError, match="destination spans overlap at byte offset 4"):
        batched_copy_reference(dst, [0, 4], src, [0, 8], [8, 8])
    with pytest.raises(ValueError, match=r"src_offsets \+ sizes\[0\] = 40"):
        batched_copy_reference(dst, [0], src, [30], [10])
    with pytest.raises(ValueError, match="dst and src overlap"):
        batched_copy_reference(dst[:16], [0], dst[8:], [0], [4])
    with pytest.raises(ValueError, match=r"sizes\[0\] = -1"):
        batched_copy_reference(dst, [0], src, [0], [-1])


def test_memory_copy_rows_between_host_pools_and_within_one_pool() -> None:
    rng = np.random.default_rng(2)
    src, dst = HostPoolMemory(6 * 16), HostPoolMemory(6 * 16)
    src.host_array()[:] = random_bytes(rng, 6 * 16)
    copy_rows(dst, [4, 0], src, [1, 5], 16)
    table = dst.host_array().reshape(6, 16)
    assert np.array_equal(table[[4, 0]], src.host_array().reshape(6, 16)[[1, 5]])
    # Rows both read and written within one pool go through staging: every source is read before any write.
    before = src.host_array().reshape(6, 16).copy()
    copy_rows(src, [1, 2, 3], src, [0, 1, 2], 16)
    assert np.array_equal(src.host_array().reshape(6, 16)[1:4], before[0:3])


# --- KV append ------------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data(), st.sampled_from([np.float16, np.uint16, np.float32, np.int8]))
def test_kv_append_writes_each_token_row_into_its_page(data: st.DataObject, dtype: type[np.generic]) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    heads, head_dim = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9))
    tokens_per_page = data.draw(st.integers(1, 5))
    itemsize = np.dtype(dtype).itemsize
    stride = tokens_per_page * heads * head_dim * itemsize + data.draw(st.integers(0, 5))
    num_pages = data.draw(st.integers(1, 6))
    pages = random_bytes(rng, num_pages, stride)
    targets = data.draw(st.lists(st.integers(0, num_pages * tokens_per_page - 1), unique=True, max_size=12))
    page_indices = [t // tokens_per_page if data.draw(st.integers(0, 4)) else -1 for t in targets]
    # Positions carry any multiple of tokens_per_page on top of the row: only position % tokens_per_page matters.
    positions = [t % tokens_per_page + tokens_per_page * data.draw(st.integers(0, 50)) for t in targets]
    new_rows = random_bytes(rng, len(targets), heads, head_dim * itemsize).view(dtype)
    expected = pages.copy()
    for token, (page, position) in enumerate(zip(page_indices, positions)):
        if page >= 0:
            used = expected[page, : tokens_per_page * heads * head_dim * itemsize]
            used.view(dtype).reshape(tokens_per_page, heads, head_dim)[position % tokens_per_page] = new_rows[token]
    kv_append_reference(pages, page_indices, positions, new_rows, tokens_per_page)
    assert np.array_equal(pages, expected)


def test_kv_append_rejects_bad_shapes_and_collisions() -> None:
    pages = np.zeros((4, 64), np.uint8)
    rows = np.zeros((2, 2, 4), np.float32)  # 32-byte rows
    with pytest.raises(ValueError, match="tokens_per_page 3 rows of 32 bytes do not fit in pages of 64 bytes"):
        kv_append_reference(pages, [0, 1], [0, 1], rows, 3)
    with pytest.raises(ValueError, match="put two tokens in page 1 row 0"):
        kv_append_reference(pages, [1, 1], [0, 2], rows, 2)
    with pytest.raises(ValueError, match=r"positions\[1\] = -1"):
        kv_append_reference(pages, [0, 1], [0, -1], rows, 2)
    with pytest.raises(ValueError, match=r"page_indices\[0\] = 4 is outside \[-1, 4\)"):
        kv_append_reference(pages, [4, 1], [0, 1], rows, 2)
    with pytest.raises(ValueError, match="page_indices must have 2 entries"):
        kv_append_reference(pages, [0], [0, 1], rows, 2)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        kv_append_reference(pages, [0, 1], [0, 1], rows.reshape(2, 8), 2)
    with pytest.raises(ValueError, match="tokens_per_page must be > 0"):
        kv_append_reference(pages, [0, 1], [0, 1], rows, 0)
    # NumPy integers are fine wherever ints are (compiled mode included).
    kv_append_reference(pages, np.array([0, 1]), [np.int64(0), np.int32(1)], rows, np.int64(2))


# --- SSM snapshot copy ----------------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_ssm_snapshot_copy_moves_each_pair(data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    num_slots = data.draw(st.integers(2, 12))
    slots = random_bytes(rng, num_slots, data.draw(st.integers(1, 40)))
    order = data.draw(st.permutations(range(num_slots)))
    half = data.draw(st.integers(0, num_slots // 2))
    src_slots = [s if data.draw(st.integers(0, 5)) else -1 for s in order[:half]]
    dst_slots = list(order[half : 2 * half])
    expected = slots.copy()
    for s, d in zip(src_slots, dst_slots):
        if s >= 0:
            expected[d] = slots[s]
    ssm_snapshot_copy_reference(slots, src_slots, dst_slots)
    assert np.array_equal(slots, expected)


def test_ssm_snapshot_copy_rejects_chains_and_duplicates() -> None:
    slots = np.zeros((4, 8), np.uint8)
    with pytest.raises(ValueError, match=r"slot 1 is both a source and a destination \(in src_slots and dst_slots\)"):
        ssm_snapshot_copy_reference(slots, [0, 1], [1, 2])
    with pytest.raises(ValueError, match="dst_slots names 3 more than once"):
        ssm_snapshot_copy_reference(slots, [0, 1], [3, 3])
    with pytest.raises(ValueError, match="dst_slots must have 2 entries"):
        ssm_snapshot_copy_reference(slots, [0, 1], [3])


# --- launch geometry ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row_bytes", [0, 1, 15, 16, 512, 1000, 4096, 65536, 2 << 20])
@pytest.mark.parametrize("num_rows", [1, 7, 300, 10**6])
def test_row_geometry_covers_each_row_with_full_blocks(row_bytes: int, num_rows: int) -> None:
    (grid_x, grid_y), (lanes, rows_per_block) = row_geometry(num_rows, row_bytes)
    assert lanes * rows_per_block == THREADS_PER_BLOCK and lanes % 32 == 0
    assert grid_x * lanes * VECTORS_IN_FLIGHT * 16 >= row_bytes
    assert grid_x * lanes * VECTORS_IN_FLIGHT * 16 < max(row_bytes, 1) + lanes * VECTORS_IN_FLIGHT * 16
    assert 1 <= grid_y <= 65535 and (grid_y * rows_per_block >= num_rows or grid_y == 65535)
