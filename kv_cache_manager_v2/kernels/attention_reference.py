"""The NumPy twin of paged attention (``paged_attention_reference``): float64, one rounding at the end; the
CUDA kernel is checked against it within ``TOLERANCES``."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .attention_params import (
    NUMPY_TYPES,
    AttentionBatch,
    AttentionParams,
    FloatArray,
    check_page_bytes,
    check_query,
    check_table_range,
)


def paged_attention_reference(
    query: npt.NDArray[np.generic],
    key_pages: npt.NDArray[np.uint8],
    value_pages: npt.NDArray[np.uint8],
    batch: AttentionBatch,
    params: AttentionParams,
) -> npt.NDArray[np.generic]:
    """Attention of every query token over its visible keys, read through the page tables (float64 math).

    ``query``: ``[num_tokens, num_heads, head_dim]`` of the element type (bf16 as uint16). Returns the output in
    the same shape and type. Raises ``ValueError`` when a visible key has no page.
    """
    for name, array in (("query", query), ("key_pages", key_pages), ("value_pages", value_pages)):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(array).__name__}")
    num_heads, head_dim = check_query(query, batch, params)
    keys = _token_rows(key_pages, "key_pages", params, head_dim)
    values = _token_rows(value_pages, "value_pages", params, head_dim)
    check_table_range(batch, int(keys.shape[0]), int(values.shape[0]))
    group_size = num_heads // params.num_kv_heads
    scale = params.scale_for(head_dim)
    queries = _to_float(query, params.element_type)
    result = np.zeros(queries.shape, dtype=np.float64)
    for seq in range(batch.num_seqs):
        begin = int(batch.query_start[seq])
        end = int(batch.query_start[seq + 1])
        if begin == end:
            continue
        positions = batch.positions[begin:end].astype(np.int64)
        visible = _visibility(positions, params)
        needed = np.flatnonzero(visible.any(axis=0))
        key_rows, value_rows, in_page = _locate(batch, seq, needed, params)
        k = _to_float(keys[key_rows, in_page], params.element_type)  # [keys, kv_heads, head_dim]
        v = _to_float(values[value_rows, in_page], params.element_type)
        # Query head h = kv_head * group_size + g reads kv head h // group_size.
        grouped = queries[begin:end].reshape(end - begin, params.num_kv_heads, group_size, head_dim)
        scores = np.einsum("tkgd,jkd->kgtj", grouped, k) * scale
        scores = np.where(visible[:, needed], scores, -np.inf)
        scores -= scores.max(axis=3, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=3, keepdims=True)
        result[begin:end] = np.einsum("kgtj,jkd->tkgd", weights, v).reshape(end - begin, num_heads, head_dim)
    return _from_float(result, params.element_type)


def _token_rows(
    pages: npt.NDArray[np.uint8], name: str, params: AttentionParams, head_dim: int
) -> npt.NDArray[np.generic]:
    """Pages seen as ``[num_pages, tokens_per_page, num_kv_heads, head_dim]`` of the element type (a view)."""
    if pages.ndim != 2 or pages.dtype != np.uint8 or pages.strides[1] != 1:
        raise ValueError(
            f"{name} must be a 2-D uint8 array [num_pages, page_stride] with contiguous rows, got shape "
            f"{pages.shape} dtype {pages.dtype}"
        )
    needed = check_page_bytes(name, int(pages.shape[1]), params, head_dim)
    typed = pages[:, :needed].view(NUMPY_TYPES[params.element_type])
    return typed.reshape(int(pages.shape[0]), params.tokens_per_page, params.num_kv_heads, head_dim)


def _visibility(positions: npt.NDArray[np.int64], params: AttentionParams) -> npt.NDArray[np.bool_]:
    """``[num_queries, max_position + 1]``: key ``j`` visible to query ``t``."""
    keys = np.arange(int(np.max(positions)) + 1, dtype=np.int64)[None, :]
    query_positions = positions[:, None]
    visible = keys <= query_positions
    window = params.sliding_window_size
    if window is not None:
        visible &= (keys > query_positions - window) | (keys < params.num_sink_tokens)
    return visible


def _locate(
    batch: AttentionBatch, seq: int, key_positions: npt.NDArray[np.int64], params: AttentionParams
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """K pages, V pages and rows in page of ``key_positions`` of sequence ``seq``; ``ValueError`` if one has none."""
    per_page = params.tokens_per_page
    ordinals = key_positions // per_page
    sink_pages = params.sink_blocks * params.expansion
    removed_pages = int(batch.kv_page_offset[seq]) * params.expansion
    entries = np.where(ordinals >= sink_pages, ordinals - removed_pages, ordinals)
    removed = (ordinals >= sink_pages) & (entries < sink_pages)
    past = entries >= batch.table_width
    usable = ~(removed | past)
    clipped = np.where(usable, entries, 0)
    key_rows = batch.key_page_table[seq, clipped].astype(np.int64)
    value_rows = batch.value_page_table[seq, clipped].astype(np.int64)
    missing = ~usable | (key_rows < 0) | (value_rows < 0)
    if missing.any():
        first = int(np.argmax(missing))
        position = int(key_positions[first])
        block = position // params.tokens_per_block
        if removed[first]:
            reason = f"block {block} was removed (kv_page_offset {int(batch.kv_page_offset[seq])})"
        elif past[first]:
            reason = f"table entry {int(entries[first])} is past table_width {batch.table_width}"
        else:
            reason = (
                f"table entry {int(entries[first])} holds key page {int(key_rows[first])} and value page "
                f"{int(value_rows[first])}"
            )
        raise ValueError(f"sequence {seq}: key position {position} is visible to a query but has no page: {reason}")
    return key_rows, value_rows, key_positions - ordinals * per_page


def _to_float(array: npt.NDArray[np.generic], element_type: str) -> FloatArray:
    if element_type == "bfloat16":
        bits = array.astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def _from_float(array: FloatArray, element_type: str) -> npt.NDArray[np.generic]:
    if element_type != "bfloat16":
        return array.astype(NUMPY_TYPES[element_type])
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    nan = np.isnan(array)
    return np.where(nan, np.uint64(0x7FC0), rounded).astype(np.uint16)
