"""The paged attention twin (SPEC §3, §9.1) against a dense attention written here, on a real manager's pages.

Each scenario builds a ``KVCacheManager`` (cpu backend), picks distinct slot ids of its pool group, writes
ground-truth K/V token by token into the pages the manager's converter names (PER_LAYER, scratch blocks too),
builds page tables the way an engine would (full, or window-local with ``kv_page_offset``), and checks that the
twin, reading only through those tables, matches a plain softmax over the ground truth gathered by position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest

from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    HalfOpenRange,
    KVCacheManager,
    PageIndexMode,
    ScratchDesc,
)
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.kernels.attention import (
    MMA_MAX_SPLITS,
    AttentionBatch,
    AttentionParams,
    paged_attention_reference,
    plan_launch,
    uses_tensor_cores,
)
from tests.helpers import MIB, make_config

SHARED = PageIndexMode.SHARED
PER_LAYER = PageIndexMode.PER_LAYER
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}

Floats = npt.NDArray[np.float64]


def bf16_bits(values: Floats) -> npt.NDArray[np.uint16]:
    """Round to nearest even, as 16 raw bits (values here are finite)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.int64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def to_storage(values: Floats, element_type: str) -> npt.NDArray[np.generic]:
    return bf16_bits(values) if element_type == "bfloat16" else values.astype(STORAGE[element_type])


def to_float(stored: npt.NDArray[np.generic], element_type: str) -> Floats:
    if element_type == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return stored.astype(np.float64)


def stale_range(history: int, tpb: int, window: int | None, sinks: int) -> range:
    """SPEC §3: start = min(ceil(h/tpb), S); end = max(start, (h + 1 - W) // tpb); empty without a window."""
    sink_blocks = -(-sinks // tpb)
    start = min(-(-history // tpb), sink_blocks)
    if window is None:
        return range(start, start)
    return range(start, max(start, (history + 1 - window) // tpb))


def scratch_range(history: int, capacity: int, tpb: int, window: int, sinks: int) -> range:
    """SPEC §3 with max_rewind_len 0: stale(capacity) ∩ [ceil(history/tpb), ceil(capacity/tpb))."""
    stale = stale_range(capacity, tpb, window, sinks)
    return range(max(stale.start, -(-history // tpb)), min(stale.stop, -(-capacity // tpb)))


@dataclass
class Sequence:
    """One request's step: queries at [history, history + num_queries), K/V ground truth for every position."""

    history: int
    positions: list[int]
    keys: npt.NDArray[np.generic]  # [context, kv_heads, head_dim], storage type
    values: npt.NDArray[np.generic]
    base: list[int]  # base page index per block ordinal; -1 for stale and scratch blocks
    stale: range
    scratch: ScratchDesc | None = None
    queries: Floats = field(default_factory=lambda: np.zeros(0))


class Scene:
    """A manager whose attention layers all share one shape; writes and reads K/V of sequences through it."""

    def __init__(
        self,
        num_layers: int = 1,
        window: int | None = None,
        sinks: int = 0,
        tpb: int = 16,
        kv_heads: int = 2,
        num_heads: int = 8,
        head_dim: int = 64,
        element_type: str = "float16",
        expansion: int = 1,
        seed: int = 0,
        backend: str = "cpu",
        gpu_quota: int = 8 * MIB,
    ) -> None:
        self.tpb, self.kv_heads, self.num_heads, self.head_dim = tpb, kv_heads, num_heads, head_dim
        self.window, self.sinks, self.element_type, self.expansion = window, sinks, element_type, expansion
        self.row_bytes = kv_heads * head_dim * np.dtype(STORAGE[element_type]).itemsize
        override = tpb // expansion if expansion > 1 else None
        buffers = [BufferConfig(role, tpb * self.row_bytes, override) for role in ("key", "value")]
        layers: list[LayerConfig] = [
            AttentionLayerConfig(i, buffers, sliding_window_size=window, num_sink_tokens=sinks or None)
            for i in range(num_layers)
        ]
        self.manager = KVCacheManager(make_config(layers, gpu_quota=gpu_quota, tokens_per_block=tpb, backend=backend))
        pool_group = self.manager.get_pool_group_index(0)
        total = self.manager.get_storage_statistics(0)[pool_group].total
        self.rng = np.random.default_rng(seed)
        self.free_slots = [int(slot) for slot in self.rng.permutation(total)]
        self.params = AttentionParams(
            num_kv_heads=kv_heads,
            tokens_per_block=tpb,
            element_type=element_type,
            expansion=expansion,
            sliding_window_size=window,
            num_sink_tokens=sinks,
        )

    def close(self) -> None:
        self.manager.shutdown()

    def sequence(self, history: int, num_queries: int, scratch: bool = False) -> Sequence:
        context = history + num_queries
        stale = stale_range(history, self.tpb, self.window, self.sinks)
        scratch_blocks = range(0)
        desc = None
        if scratch:
            assert self.window is not None
            scratch_blocks = scratch_range(history, context, self.tpb, self.window, self.sinks)
            converter = self.manager.get_page_index_converter(0, "key")
            pages = len(scratch_blocks) * converter.scratch_pages_per_block
            slots = tuple(self.free_slots.pop() for _ in range(-(-pages // converter.scale)))
            desc = ScratchDesc(HalfOpenRange(scratch_blocks.start, scratch_blocks.stop), slots)
        base = [
            -1 if block in stale or block in scratch_blocks else self.free_slots.pop()
            for block in range(-(-context // self.tpb))
        ]
        shape = (context, self.kv_heads, self.head_dim)
        return Sequence(
            history=history,
            positions=list(range(history, context)),
            keys=to_storage(self.rng.standard_normal(shape), self.element_type),
            values=to_storage(self.rng.standard_normal(shape), self.element_type),
            base=base,
            stale=stale,
            scratch=desc,
            queries=self.rng.standard_normal((num_queries, self.num_heads, self.head_dim)),
        )

    def write(self, layer: int, sequences: list[Sequence]) -> None:
        """Every token with a page goes to page ``table[block * expansion + sub-page]``, row ``j % tokens_per_page``."""
        per_page = self.tpb // self.expansion
        for seq in sequences:
            for role, data in (("key", seq.keys), ("value", seq.values)):
                table = self.manager.get_page_index_converter(layer, role)(seq.base, PER_LAYER, seq.scratch)
                view = self.manager.get_page_view(layer, role, PER_LAYER)
                host = view if isinstance(view, np.ndarray) else view.get()  # type: ignore[attr-defined]
                for position in range(data.shape[0]):
                    block = position // self.tpb
                    if block in seq.stale:
                        continue
                    page = table[block * self.expansion + position % self.tpb // per_page]
                    row = position % per_page
                    row_bytes = data[position].reshape(-1).view(np.uint8)
                    host[page, row * self.row_bytes : (row + 1) * self.row_bytes] = row_bytes
                if host is not view:
                    view.set(host)  # type: ignore[attr-defined]

    def inputs(
        self, layer: int, sequences: list[Sequence], mode: PageIndexMode = PER_LAYER, window_local: bool = False
    ) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.uint8], npt.NDArray[np.uint8], AttentionBatch]:
        """Query, K/V pages (the manager's views) and batch as an engine builds them; window-local tables drop the
        stale blocks."""
        tables: dict[str, list[list[int]]] = {"key": [], "value": []}
        offsets = []
        for seq in sequences:
            for role in ("key", "value"):
                scratch = seq.scratch if mode == PER_LAYER else None
                table = self.manager.get_page_index_converter(layer, role)(seq.base, mode, scratch)
                if window_local:
                    del table[seq.stale.start * self.expansion : seq.stale.stop * self.expansion]
                tables[role].append(table)
            offsets.append(len(seq.stale) if window_local else 0)
        width = max(len(table) for table in tables["key"])
        padded = {role: [table + [-1] * (width - len(table)) for table in rows] for role, rows in tables.items()}
        counts = [len(seq.positions) for seq in sequences]
        batch = AttentionBatch(
            query_start=np.concatenate([[0], np.cumsum(counts)]),
            positions=[position for seq in sequences for position in seq.positions],
            key_page_table=padded["key"],
            value_page_table=None if mode == SHARED else padded["value"],
            kv_page_offset=offsets,
        )
        query = to_storage(np.concatenate([seq.queries for seq in sequences]), self.element_type)
        key_pages = self.manager.get_page_view(layer, "key", mode)
        value_pages = self.manager.get_page_view(layer, "value", mode)
        return query, key_pages, value_pages, batch  # type: ignore[return-value]

    def dense(self, sequences: list[Sequence]) -> Floats:
        """Plain softmax per (query, head) over the keys SPEC §3 makes visible, gathered from the ground truth."""
        group = self.num_heads // self.kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        outputs = []
        for seq in sequences:
            keys = to_float(seq.keys, self.element_type)
            values = to_float(seq.values, self.element_type)
            queries = to_float(to_storage(seq.queries, self.element_type), self.element_type)
            out = np.zeros_like(queries)
            for t, p in enumerate(seq.positions):
                visible = [
                    j for j in range(p + 1) if self.window is None or j > p - self.window or j < self.sinks
                ]
                for h in range(self.num_heads):
                    scores = keys[visible, h // group] @ queries[t, h] * scale
                    weights = np.exp(scores - scores.max())
                    out[t, h] = weights @ values[visible, h // group] / weights.sum()
            outputs.append(out)
        return np.concatenate(outputs)

    def check(self, out: npt.NDArray[np.generic], sequences: list[Sequence]) -> None:
        # Both compute in float64 (errors ~1e-16) and round once to nearest even, so they agree bit for bit; a
        # float64 result within 1e-16 of a rounding boundary is too unlikely to matter for seeded data.
        np.testing.assert_array_equal(out, to_storage(self.dense(sequences), self.element_type))


@pytest.mark.parametrize("element_type", ["float16", "bfloat16", "float32"])
def test_full_attention_decode_and_prefill_with_gqa(element_type: str) -> None:
    scene = Scene(num_layers=2, element_type=element_type)
    # Decode at 100, a 24-token prefill chunk after 40 tokens of history, and a first token (one key).
    sequences = [scene.sequence(100, 1), scene.sequence(40, 24), scene.sequence(0, 1)]
    scene.write(1, sequences)
    out = paged_attention_reference(*scene.inputs(1, sequences), scene.params)
    assert out.dtype == STORAGE[element_type] and out.shape == (26, 8, 64)
    scene.check(out, sequences)
    scene.close()


@pytest.mark.parametrize(("kv_heads", "num_heads"), [(4, 4), (1, 8), (2, 6)])
def test_group_sizes(kv_heads: int, num_heads: int) -> None:
    scene = Scene(kv_heads=kv_heads, num_heads=num_heads, element_type="float32")
    sequences = [scene.sequence(37, 1), scene.sequence(5, 9)]
    scene.write(0, sequences)
    scene.check(paged_attention_reference(*scene.inputs(0, sequences), scene.params), sequences)
    scene.close()


def test_sliding_window_with_sinks_full_and_window_local_tables_agree() -> None:
    # Window 40, 5 sink tokens (one sink block of 16). History 300: stale blocks [1, 16) have no page at all.
    scene = Scene(window=40, sinks=5, element_type="float32", seed=1)
    sequences = [scene.sequence(300, 1), scene.sequence(20, 1), scene.sequence(130, 12), scene.sequence(3, 6)]
    assert sequences[0].stale == range(1, 16) and len(sequences[1].stale) == 0
    scene.write(0, sequences)
    full = paged_attention_reference(*scene.inputs(0, sequences), scene.params)
    local_inputs = scene.inputs(0, sequences, window_local=True)
    assert local_inputs[3].kv_page_offset.tolist() == [15, 0, 4, 0]
    local = paged_attention_reference(*local_inputs, scene.params)
    scene.check(full, sequences)
    np.testing.assert_array_equal(local, full)
    scene.close()


def test_sinks_and_window_change_the_result() -> None:
    # Guards the scenario above against vacuity: dropping the sinks or the window moves the output.
    scene = Scene(window=40, sinks=5, element_type="float32", seed=2)
    sequences = [scene.sequence(200, 1)]
    scene.write(0, sequences)
    inputs = scene.inputs(0, sequences)
    with_sinks = paged_attention_reference(*inputs, scene.params)
    for params in (
        AttentionParams(2, 16, "float32", sliding_window_size=40),
        AttentionParams(2, 16, "float32", sliding_window_size=41, num_sink_tokens=5),
    ):
        assert not np.allclose(paged_attention_reference(*inputs, params), with_sinks, atol=1e-3)
    scene.close()


def test_scratch_blocks_in_per_layer_mode_one_layer_at_a_time() -> None:
    # Prefill chunk [0, 160), window 32, 4 sinks: blocks [1, 8) are out of window when the chunk ends, so they
    # live in scratch slots shared by both layers (scale 4, ppb 2: ceil(7 * 2 / 4) = 4 slots).
    scene = Scene(num_layers=2, window=32, sinks=4, seed=3)
    sequence = scene.sequence(0, 160, scratch=True)
    assert sequence.scratch is not None and sequence.scratch.range == HalfOpenRange(1, 8)
    assert len(sequence.scratch.slot_ids) == 4 and sequence.base[1:8] == [-1] * 7
    for layer in (0, 1):
        # Layer 1's writes reuse the scratch pages of layer 0, so each layer attends right after its own write.
        layer_sequence = Sequence(
            sequence.history,
            sequence.positions,
            to_storage(scene.rng.standard_normal(sequence.keys.shape), scene.element_type),
            to_storage(scene.rng.standard_normal(sequence.values.shape), scene.element_type),
            sequence.base,
            sequence.stale,
            sequence.scratch,
            sequence.queries,
        )
        scene.write(layer, [layer_sequence])
        query, key_pages, value_pages, batch = scene.inputs(layer, [layer_sequence])
        slots = {index // (4 * scene.expansion) for index in batch.key_page_table[0, 1:8]}
        assert slots <= set(sequence.scratch.slot_ids)
        scene.check(paged_attention_reference(query, key_pages, value_pages, batch, scene.params), [layer_sequence])
    scene.close()


def test_shared_and_per_layer_modes_give_identical_outputs() -> None:
    scene = Scene(num_layers=3, window=48, sinks=2, element_type="bfloat16", seed=4)
    sequences = [scene.sequence(150, 1), scene.sequence(60, 5)]
    scene.write(2, sequences)
    per_layer = paged_attention_reference(*scene.inputs(2, sequences, PER_LAYER, window_local=True), scene.params)
    shared_inputs = scene.inputs(2, sequences, SHARED, window_local=True)
    # SHARED: one table serves K and V (and every layer); only the views' base rows differ.
    np.testing.assert_array_equal(shared_inputs[3].key_page_table, shared_inputs[3].value_page_table)
    shared = paged_attention_reference(*shared_inputs, scene.params)
    np.testing.assert_array_equal(shared, per_layer)
    scene.check(shared, sequences)
    scene.close()


@pytest.mark.parametrize("window_local", [False, True])
def test_expansion_spreads_a_block_over_several_pages(window_local: bool) -> None:
    # tokens_per_block 16 with an override of 4: each block is 4 pages of 4 tokens, 4 table entries per block.
    scene = Scene(num_layers=2, window=24, sinks=6, expansion=4, element_type="float16", seed=5)
    assert scene.manager.get_page_index_converter(1, "value").expansion == 4
    sequences = [scene.sequence(90, 1), scene.sequence(33, 7)]
    scene.write(1, sequences)
    query, key_pages, value_pages, batch = scene.inputs(1, sequences, window_local=window_local)
    assert batch.table_width % 4 == 0
    scene.check(paged_attention_reference(query, key_pages, value_pages, batch, scene.params), sequences)
    scene.close()


def test_head_dim_128_and_a_long_prefill() -> None:
    scene = Scene(head_dim=128, kv_heads=1, num_heads=4, tpb=32, element_type="float16", seed=6)
    sequences = [scene.sequence(64, 64)]
    scene.write(0, sequences)
    scene.check(paged_attention_reference(*scene.inputs(0, sequences), scene.params), sequences)
    scene.close()


def test_the_twin_reads_only_through_the_tables() -> None:
    scene = Scene(element_type="float32", seed=7)
    sequences = [scene.sequence(50, 1)]
    scene.write(0, sequences)
    query, key_pages, value_pages, batch = scene.inputs(0, sequences)
    before = paged_attention_reference(query, key_pages, value_pages, batch, scene.params)
    # PER_LAYER: K and V pages are rows of one pool, so "unused" means in neither table.
    used = set(batch.key_page_table[0].tolist()) | set(batch.value_page_table[0].tolist())
    key_pages[sorted(set(range(key_pages.shape[0])) - used)] = 0xFF  # NaN wherever no table entry points
    np.testing.assert_array_equal(paged_attention_reference(query, key_pages, value_pages, batch, scene.params), before)
    key_pages[batch.key_page_table[0, 1]] = 0  # a visible block's keys
    assert not np.allclose(paged_attention_reference(query, key_pages, value_pages, batch, scene.params), before)
    scene.close()


def test_a_visible_key_without_a_page_is_an_error() -> None:
    scene = Scene(window=40, sinks=5, element_type="float32", seed=8)
    sequences = [scene.sequence(300, 1)]
    scene.write(0, sequences)
    query, key_pages, value_pages, batch = scene.inputs(0, sequences, window_local=True)
    key_table = batch.key_page_table.copy()
    cases = [
        (np.where(np.arange(key_table.shape[1]) == 1, -1, key_table), 15, "table entry 1 holds key page -1"),
        (key_table, 16, "key position 261 .* block 16 was removed (kv_page_offset 16)"),
        (np.where(np.arange(key_table.shape[1]) == 0, -1, key_table), 15, "key position 0 .* table entry 0 holds"),
    ]
    for table, offset, message in cases:
        broken = AttentionBatch([0, 1], [300], table, batch.value_page_table, [offset])
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            paged_attention_reference(query, key_pages, value_pages, broken, scene.params)
    short = AttentionBatch([0, 1], [300], key_table[:, :3], batch.value_page_table[:, :3], [15])
    with pytest.raises(ValueError, match="past table_width 3"):
        paged_attention_reference(query, key_pages, value_pages, short, scene.params)
    scene.close()


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="element_type"):
        AttentionParams(2, 16, "float64")
    with pytest.raises(ValueError, match="expansion 3 must divide tokens_per_block 16"):
        AttentionParams(2, 16, expansion=3)
    with pytest.raises(ValueError, match="num_sink_tokens=4 requires a sliding_window_size"):
        AttentionParams(2, 16, num_sink_tokens=4)
    with pytest.raises(ValueError, match="query_start must be non-decreasing"):
        AttentionBatch([0, 2, 1, 2], [0, 1], [[0], [1], [2]])
    with pytest.raises(ValueError, match="positions must be >= 0"):
        AttentionBatch([0, 1], [-1], [[0]])
    with pytest.raises(ValueError, match="key_page_table entries must be >= -1"):
        AttentionBatch([0, 1], [0], [[-2]])
    numpy_scalars = AttentionParams(np.int64(2), np.int32(16), softmax_scale=np.float32(0.5))  # type: ignore[arg-type]
    assert numpy_scalars == AttentionParams(2, 16, softmax_scale=0.5) and type(numpy_scalars.num_kv_heads) is int
    params = numpy_scalars
    pages = np.zeros((4, 16 * 2 * 64 * 2), dtype=np.uint8)
    batch = AttentionBatch([0, 1], [3], [[0]])
    with pytest.raises(ValueError, match="query dtype must be float16"):
        paged_attention_reference(np.zeros((1, 4, 64), np.float32), pages, pages, batch, params)
    with pytest.raises(ValueError, match="num_heads 3 must be a multiple of num_kv_heads 2"):
        paged_attention_reference(np.zeros((1, 3, 64), np.float16), pages, pages, batch, params)
    with pytest.raises(ValueError, match="cannot hold"):
        paged_attention_reference(np.zeros((1, 4, 128), np.float16), pages, pages, batch, params)
    with pytest.raises(ValueError, match="key_page_table entry 7 is past the 4 pages"):
        past = AttentionBatch([0, 1], [3], [[7]])
        paged_attention_reference(np.zeros((1, 4, 64), np.float16), pages, pages, past, params)


def test_launch_plan_rows_tiles_and_splits() -> None:
    params = AttentionParams(num_kv_heads=8, tokens_per_block=32)
    decode = AttentionBatch([0, 1], [8191], [[0] * 256])
    plan = plan_launch(decode, params, num_heads=32, resident_ctas=132 * 3)
    # Group of 4 heads -> 4-row tiles; 8 work items fill 396 resident CTAs with 49 splits of ~168 keys.
    assert (plan.rows, plan.tiles_per_seq, plan.num_splits, plan.grid) == (4, 1, 49, (8, 49, 1))
    assert plan.partial_floats(128) == 8 * 49 * (4 * 128 + 8)
    many = AttentionBatch(list(range(129)), [1000] * 128, [[0] * 32] * 128)
    assert plan_launch(many, params, num_heads=32, resident_ctas=396).num_splits == 1
    short = AttentionBatch([0, 1], [200], [[0] * 7])
    assert plan_launch(short, params, num_heads=32, resident_ctas=396).num_splits == 1  # 201 keys: one chunk
    prefill = AttentionBatch([0, 3, 40], list(range(3)) + list(range(37)), [[0] * 2] * 2)
    plan = plan_launch(prefill, params, num_heads=8, resident_ctas=4)
    assert (plan.rows, plan.tiles_per_seq, plan.grid) == (8, 5, (80, 1, 1))
    windowed = AttentionParams(8, 32, sliding_window_size=256, num_sink_tokens=4)
    assert plan_launch(decode, windowed, num_heads=32, resident_ctas=396).num_splits == 2  # 261 keys at most
    huge = AttentionBatch([0, 1], [10**6], [[0] * 32768])
    assert plan_launch(huge, params, num_heads=8, resident_ctas=10**5).num_splits == 256  # MAX_SPLITS


def test_tensor_core_plan_rows_and_split_limit() -> None:
    params = AttentionParams(num_kv_heads=8, tokens_per_block=32)
    decode = AttentionBatch([0, 1], [8191], [[0] * 256])
    plan = plan_launch(decode, params, num_heads=64, resident_ctas=132 * 2, tensor_cores=True)
    # GQA 8 -> one 16-row mma tile per (token, kv head); the wave-fit policy fills one wave of 264 resident CTAs
    # with the 8 work items: 33 splits (66 would start a second wave for less than half the keys each).
    assert (plan.rows, plan.tiles_per_seq, plan.num_splits, plan.tensor_cores) == (16, 1, 33, True)
    assert plan.partial_floats(128) == 8 * 33 * (16 * 128 + 32)
    prefill = AttentionBatch([0, 3, 40], list(range(3)) + list(range(37)), [[0] * 2] * 2)
    plan = plan_launch(prefill, params, num_heads=32, resident_ctas=4, tensor_cores=True)
    # the default prefill CTA has 64 rows: 37 tokens x 4 heads in 3 tiles, for each of 2 sequences x 8 kv heads
    assert (plan.rows, plan.tiles_per_seq, plan.grid) == (64, 3, (48, 1, 1))
    huge = AttentionBatch([0, 1], [10**6], [[0] * 32768])
    assert plan_launch(huge, params, num_heads=8, resident_ctas=10**5, tensor_cores=True).num_splits == MMA_MAX_SPLITS
    # Batch 32 x 8 kv heads = 256 items on 132 SMs x 3 CTAs: the default decode policy splits to make two whole waves
    # (768 of 792 CTA places: 3 splits; within 5% of the fastest forced factor in the H200 sweep of 2026-11-27).
    batch32 = AttentionBatch(list(range(33)), [8191] * 32, [[0] * 256] * 32)
    assert plan_launch(batch32, params, num_heads=32, resident_ctas=396, tensor_cores=True).num_splits == 3


def test_kernel_choice() -> None:
    half = AttentionParams(num_kv_heads=1, tokens_per_block=16)
    single = AttentionParams(num_kv_heads=1, tokens_per_block=16, element_type="float32")
    assert uses_tensor_cores(half, "auto") and not uses_tensor_cores(single, "auto")
    assert not uses_tensor_cores(half, "cuda_cores") and uses_tensor_cores(half, "tensor_cores")
    with pytest.raises(ValueError, match="kernel must be one of"):
        uses_tensor_cores(half, "wgmma")
    with pytest.raises(ValueError, match="kernel 'tensor_cores' serves element types"):
        uses_tensor_cores(single, "tensor_cores")
