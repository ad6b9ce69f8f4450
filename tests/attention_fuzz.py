"""Seeded random paged-attention scenarios and an independent dense reference, for the differential fuzz
(tests/test_attention_differential.py): the CPU builds of both CUDA kernels vs the NumPy twin vs this reference.

The reference is written from the documented contract only (``kernels/attention.py``'s module docstring, SPEC §3):
visibility ``j <= p and (j > p - W or j < sinks)``, GQA head ``h`` reads kv head ``h // group``, page ordinal
``j // tokens_per_page`` found through a full or window-local table, float64 softmax rounded once. It shares no code
with ``attention_reference.py``.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kv_cache_manager_v2.kernels._source import kernel_directory
from kv_cache_manager_v2.kernels.attention import AttentionBatch, AttentionParams, kernel_arguments, plan_launch
from kv_cache_manager_v2.kernels.attention_variants import MmaVariant, choose_variant, mma_threads
from kv_cache_manager_v2.kernels.attention import mma_launch_kind
from tests.test_attention_cuda_on_cpu import SHORT_TYPES, pack_arguments
from tests.test_attention_reference import to_float, to_storage

Floats = npt.NDArray[np.float64]
BLOCK_ORDER_ENV = "KVCM_CPU_BLOCK_ORDER_SEED"  # kernels/paged_attention_cpu.cuh
ENUMS = {"float16": "attention::kFloat16", "bfloat16": "attention::kBFloat16", "float32": "attention::kFloat32"}


@dataclass
class Scenario:
    """One batch: query, K/V pools, tables and params, plus the float values the pages hold."""

    params: AttentionParams
    query: npt.NDArray[np.generic]
    key_pages: npt.NDArray[np.uint8]
    value_pages: npt.NDArray[np.uint8]
    batch: AttentionBatch
    head_dim: int
    description: str


def random_scenario(
    rng: np.random.Generator,
    head_dims: tuple[int, ...],
    element_types: tuple[str, ...],
    decode_only: bool = False,
    max_history: int = 160,
) -> Scenario:
    """Shapes drawn over the edges: tpb 1/3/16/64, expansion, GQA 1..8, zero-history, zero-query and one-token
    sequences, windows (1, smaller than, larger than the sequence) with sinks below and above the window, chunked
    prefill starting mid-block, window-local tables, permuted and repeated pages, the pool's last page, empty
    batches. ``decode_only``: at most one query token per sequence (the kernels' decode tiles)."""
    element_type = str(rng.choice(element_types))
    head_dim = int(rng.choice(head_dims))
    kv_heads = int(rng.integers(1, 4))
    group = int(rng.choice([1, 2, 3, 4, 5, 8]))
    tpb = int(rng.choice([1, 3, 16, 64]))
    expansion = int(rng.choice([d for d in (1, 2, 4) if tpb % d == 0]))
    window: int | None = None
    sinks = 0
    if rng.random() < 0.6:
        window = int(rng.choice([1, 2, int(rng.integers(1, 40)), int(rng.integers(40, 400))]))
        sinks = int(rng.choice([0, 0, 1, int(rng.integers(0, 2 * window + 2)), window, window + 3]))
    params = AttentionParams(
        num_kv_heads=kv_heads,
        tokens_per_block=tpb,
        element_type=element_type,
        expansion=expansion,
        sliding_window_size=window,
        num_sink_tokens=sinks,
        softmax_scale=None if rng.random() < 0.7 else float(rng.uniform(0.02, 0.3)),
    )
    num_seqs = int(rng.choice([0, 1, 1, 2, 3, 5])) if rng.random() < 0.95 else 0
    histories = [int(rng.choice([0, 1, int(rng.integers(0, max_history))])) for _ in range(num_seqs)]
    queries = [int(rng.choice([0, 1, 1, 1, 2, int(rng.integers(1, 40))])) for _ in range(num_seqs)]
    if decode_only:
        queries = [min(count, 1) for count in queries]  # a sequence without a query token this step stays
    tpp = params.tokens_per_page
    window_local = window is not None and rng.random() < 0.5
    if window_local:
        histories = [h + int(rng.integers(0, 4 * tpb + 8)) for h in histories]  # long enough to drop blocks
    sink_blocks = params.sink_blocks
    # Per sequence: which table entries it needs (block ordinals), kv_page_offset, invisible blocks.
    layouts: list[tuple[list[int], int]] = []
    for history, count in zip(histories, queries):
        blocks = -(-(history + count) // tpb)
        removable = 0
        if window is not None:
            removable = max(0, (history + 1 - window) // tpb - sink_blocks)
        offset = int(rng.integers(0, removable + 1)) if window_local and removable else 0
        kept = [b for b in range(blocks) if b < sink_blocks or b >= sink_blocks + offset]
        layouts.append((kept, offset))
    entries = sum(len(kept) for kept, _ in layouts) * expansion
    num_pages = max(1, entries + int(rng.integers(0, 4)))
    order = rng.permutation(num_pages)
    width = max((len(kept) for kept, _ in layouts), default=0) * expansion + int(rng.integers(0, 3))
    table = np.full((num_seqs, width), -1, dtype=np.int64)
    used = 0
    for s, (kept, _) in enumerate(layouts):
        for e in range(len(kept) * expansion):
            if used and rng.random() < 0.1:
                table[s, e] = order[int(rng.integers(0, used))]  # a repeated page (read twice: legal)
            else:
                table[s, e] = order[used % num_pages]
                used += 1
    if table.size and num_pages - 1 not in table:
        filled = np.argwhere(table >= 0)
        if filled.size:
            s, e = filled[int(rng.integers(0, len(filled)))]
            table[s, e] = num_pages - 1  # the pool's last page
    # Blocks no query sees may lose their page (stale blocks hold none).
    for s, (history, (kept, offset)) in enumerate(zip(histories, layouts)):
        if window is None:
            continue
        for index, block in enumerate(kept):
            last_key = (block + 1) * tpb - 1
            if block >= sink_blocks and last_key <= history - window and rng.random() < 0.5:
                table[s, index * expansion : (index + 1) * expansion] = -1
    if table.size and rng.random() < 0.15:
        filled = np.argwhere(table >= 0)
        if filled.size:
            s, e = filled[int(rng.integers(0, len(filled)))]
            table[s, e] = -1  # may be a visible key's page: its queries get NaN, the twin raises
    value_table = table.copy()
    if table.size and rng.random() < 0.5:
        value_table = np.where(table >= 0, (table + 1) % num_pages, -1)  # K and V in different pages
    itemsize = 4 if element_type == "float32" else 2
    page_bytes = tpp * kv_heads * head_dim * itemsize
    stride = page_bytes + 16 * int(rng.integers(0, 3))
    key_pages = _random_pages(rng, num_pages, stride, page_bytes, element_type)
    value_pages = _random_pages(rng, num_pages, stride, page_bytes, element_type)
    starts = np.concatenate([[0], np.cumsum(queries)]).astype(np.int64)
    runs = [np.arange(h, h + q) for h, q in zip(histories, queries)]
    positions = np.concatenate([np.zeros(0, dtype=np.int64), *runs])
    num_tokens = int(starts[-1])
    query = to_storage(rng.normal(size=(num_tokens, kv_heads * group, head_dim)), element_type)
    batch = AttentionBatch(
        starts,
        positions.astype(np.int64),
        table,
        value_table,
        [offset for _, offset in layouts] if window_local else None,
    )
    description = (
        f"{element_type} d{head_dim} kv{kv_heads}x{group} tpb{tpb}/x{expansion} W{window} sinks{sinks} "
        f"hist{histories} q{queries} offsets{[o for _, o in layouts]} pages{num_pages}"
    )
    return Scenario(params, np.ascontiguousarray(query), key_pages, value_pages, batch, head_dim, description)


def _random_pages(
    rng: np.random.Generator, num_pages: int, stride: int, page_bytes: int, element_type: str
) -> npt.NDArray[np.uint8]:
    """Pages of normal values; the padding past each page's elements is NaN bytes (a read of it shows)."""
    pages = np.full((num_pages, stride), 0xFF, dtype=np.uint8)
    itemsize = 4 if element_type == "float32" else 2
    values = to_storage(rng.normal(size=(num_pages, page_bytes // itemsize)), element_type)
    pages[:, :page_bytes] = np.ascontiguousarray(values).view(np.uint8).reshape(num_pages, page_bytes)
    return pages


def visible(key: int, position: int, params: AttentionParams) -> bool:
    window = params.sliding_window_size
    return key <= position and (window is None or key > position - window or key < params.num_sink_tokens)


def page_of(scenario: Scenario, seq: int, key: int, table: npt.NDArray[np.int32]) -> int:
    """The page holding ``key`` of sequence ``seq`` through ``table``, or -1 (removed, past the table, no page)."""
    params = scenario.params
    ordinal = key // params.tokens_per_page
    sink_pages = params.sink_blocks * params.expansion
    entry = ordinal
    if ordinal >= sink_pages:
        entry = ordinal - int(scenario.batch.kv_page_offset[seq]) * params.expansion
        if entry < sink_pages:
            return -1
    if entry >= table.shape[1]:
        return -1
    return int(table[seq, entry])


def dense_reference(scenario: Scenario) -> tuple[Floats, npt.NDArray[np.bool_]]:
    """float64 attention of every token and head, and which tokens see a key without a page (NaN rows)."""
    params, batch, head_dim = scenario.params, scenario.batch, scenario.head_dim
    kv_heads = params.num_kv_heads
    tpp = params.tokens_per_page
    num_heads = int(scenario.query.shape[1])
    group = num_heads // kv_heads
    itemsize = 4 if params.element_type == "float32" else 2
    page_bytes = tpp * kv_heads * head_dim * itemsize
    storage = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}[params.element_type]

    def rows(pages: npt.NDArray[np.uint8], page: int, key: int) -> Floats:
        raw = np.ascontiguousarray(pages[page, :page_bytes]).view(storage).reshape(tpp, kv_heads, head_dim)
        return to_float(raw[key % tpp], params.element_type)

    query = to_float(scenario.query, params.element_type)
    out = np.zeros(query.shape)
    missing = np.zeros(batch.num_tokens, dtype=bool)
    scale = params.scale_for(head_dim)
    for seq in range(batch.num_seqs):
        for token in range(int(batch.query_start[seq]), int(batch.query_start[seq + 1])):
            position = int(batch.positions[token])
            keys = [j for j in range(position + 1) if visible(j, position, params)]
            k_pages = [page_of(scenario, seq, j, batch.key_page_table) for j in keys]
            v_pages = [page_of(scenario, seq, j, batch.value_page_table) for j in keys]
            if min(k_pages + v_pages) < 0:
                missing[token] = True
                continue
            k = np.stack([rows(scenario.key_pages, p, j) for p, j in zip(k_pages, keys)])  # [n, kv, d]
            v = np.stack([rows(scenario.value_pages, p, j) for p, j in zip(v_pages, keys)])
            for head in range(num_heads):
                kv = head // group
                scores = k[:, kv, :] @ query[token, head] * scale
                weights = np.exp(scores - scores.max())
                out[token, head] = weights @ v[:, kv, :] / weights.sum()
    return out, missing


# ------------------------------------------------------------------------------------------- CPU kernel builds
class KernelBuilds:
    """The CPU builds of both CUDA kernels, one shared library per variant, compiled on first use."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.libraries: dict[str, ctypes.CDLL] = {}

    def library(self, name: str, source: str, entry: str) -> ctypes.CDLL:
        if name not in self.libraries:
            lines = ['#include "paged_attention_cpu.cuh"', "#define PAGED_ATTENTION_NO_ENTRIES", f'#include "{source}"']
            lines += [entry, f"CPU_EXPORT({name})"]
            path = self.directory / f"{name}.cpp"
            path.write_text("\n".join(lines) + "\n")
            target = self.directory / f"{name}.so"
            command = ["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC"]
            subprocess.run([*command, f"-I{kernel_directory()}", str(path), "-o", str(target)], check=True)
            self.libraries[name] = ctypes.CDLL(str(target))
        return self.libraries[name]

    def run(
        self, scenario: Scenario, resident_ctas: int, tensor_cores: bool, block_order_seed: int = 0
    ) -> tuple[npt.NDArray[np.generic], int]:
        """The kernel's output (NaN-poisoned first) and its split count, with the launcher's plan and arguments;
        blocks run in an order shuffled by ``block_order_seed`` (0: x fastest)."""
        params, batch, head_dim = scenario.params, scenario.batch, scenario.head_dim
        num_heads = int(scenario.query.shape[1])
        short = SHORT_TYPES[params.element_type]
        variant: MmaVariant | None = None
        if tensor_cores:
            variant = choose_variant(head_dim, mma_launch_kind(batch, num_heads // params.num_kv_heads))
        plan = plan_launch(batch, params, num_heads, resident_ctas, tensor_cores, variant)
        if tensor_cores:
            assert plan.variant is not None
            v = plan.variant
            name = f"mma_{short}_d{head_dim}_r{plan.rows}_s{v.stages}_k{v.tile_keys}"
            entry = (
                f"PAGED_ATTENTION_MMA_ENTRY({name}, {ENUMS[params.element_type]}, {head_dim}, {plan.rows // 16}, "
                f"{v.stages}, {v.tile_keys})"
            )
            library = self.library(name, "paged_attention_mma.cu", entry)
            threads = mma_threads(plan.rows)
        else:
            name = f"cc_{short}_d{head_dim}_r{plan.rows}"
            entry = f"PAGED_ATTENTION_ENTRY({name}, {ENUMS[params.element_type]}, {head_dim}, {plan.rows})"
            library = self.library(name, "paged_attention.cu", entry)
            threads = 128
        poison = np.nan if params.element_type == "float32" else 0x7E00
        out = np.full_like(scenario.query, poison)
        if batch.num_tokens == 0:
            return out, 0  # the launcher launches nothing
        partial = np.full(max(1, plan.partial_floats(head_dim)), np.nan, dtype=np.float32)
        counters = np.zeros(plan.num_work_items, dtype=np.uint32)
        key_pages, value_pages = scenario.key_pages, scenario.value_pages
        tables = (batch.key_page_table, batch.value_page_table)
        arrays = (batch.query_start, batch.positions, *tables, batch.kv_page_offset)
        pages = (key_pages.ctypes.data, value_pages.ctypes.data, key_pages.strides[0], len(key_pages), len(value_pages))
        arguments = kernel_arguments(
            scenario.query, out, pages, arrays, batch, params, (num_heads, head_dim), plan, (partial, counters)
        )
        packed = pack_arguments(arguments)
        previous = os.environ.get(BLOCK_ORDER_ENV)
        os.environ[BLOCK_ORDER_ENV] = str(block_order_seed)
        try:
            status = getattr(library, f"cpu_{name}")(*plan.grid, threads, packed.pointers)
        finally:
            if previous is None:
                del os.environ[BLOCK_ORDER_ENV]
            else:
                os.environ[BLOCK_ORDER_ENV] = previous
        assert status == 0, f"launch failed ({status}: 1 a barrier deadlocked, 2 a fault): {scenario.description}"
        assert not counters.any(), "the last CTA of each work item resets its counter"
        return out, plan.num_splits
