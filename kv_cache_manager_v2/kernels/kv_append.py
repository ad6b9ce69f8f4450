"""KV append (``kernels/kv_append.cu``): the new tokens' K or V rows scattered into their pages.

Page layout inside one K or V page: ``[tokens_per_page, num_kv_heads, head_dim]``, row-major, so one token's row of
``num_kv_heads * head_dim`` elements is contiguous; ``tokens_per_page = tokens_per_block / expansion``.
``pages`` is a page table ``[num_pages, page_stride]`` of uint8 whose row ``i`` is page index ``i`` — exactly what
``KVCacheManager.get_page_view(layer_id, role, index_mode)`` returns — and ``page_indices`` are indices converted
for that view (SHARED or PER_LAYER, see ``PageIndexConverter``). Token ``t`` lands in page ``page_indices[t]`` at
row ``positions[t] % tokens_per_page``; a page index of -1 skips the token (padding). Elements move as raw bits,
so fp16, bf16 (as uint16), fp32 and fp8 rows all work.
"""

from __future__ import annotations

from typing import SupportsIndex

import numpy as np
import numpy.typing as npt

from .._base.validation import as_positive_int
from ._checks import ArrayMeta, HostRows, IndexVector, as_int32, index_vector, require_host, row_table
from ._launch import device_array, kernel, on_stream, row_geometry, upload


def kv_append_reference(
    pages: HostRows,
    page_indices: IndexVector,
    positions: IndexVector,
    new_rows: npt.NDArray[np.generic],
    tokens_per_page: SupportsIndex,
) -> None:
    """Writes ``new_rows[t]`` (``[num_tokens, num_kv_heads, head_dim]``, C-contiguous) into its page, for every ``t``.

    Positions must be >= 0 and no two tokens may land in the same (page, row).
    """
    require_host(pages, "pages")
    require_host(new_rows, "new_rows")
    page_ids, token_positions, row_bytes, per_page = _checked(pages, page_indices, positions, new_rows, tokens_per_page)
    keep = page_ids >= 0
    starts = page_ids[keep] * int(pages.shape[1]) + token_positions[keep] % per_page * row_bytes
    source = new_rows.reshape(int(page_ids.shape[0]), row_bytes // new_rows.dtype.itemsize).view(np.uint8)[keep]
    pages.reshape(-1)[starts[:, None] + np.arange(row_bytes, dtype=np.int64)] = source


def kv_append_cuda(
    pages: object,
    page_indices: IndexVector,
    positions: IndexVector,
    new_rows: object,
    tokens_per_page: SupportsIndex,
    stream: object | None = None,
) -> None:
    """``kv_append_reference`` on CuPy ``pages``/``new_rows``, in one launch; indices and positions are host data."""
    pages_meta = device_array(pages, "pages")
    page_ids, token_positions, row_bytes, per_page = _checked(
        pages_meta, page_indices, positions, device_array(new_rows, "new_rows"), tokens_per_page
    )
    count = int(page_ids.shape[0])
    if count == 0:
        return
    grid, block = row_geometry(count, row_bytes)
    with on_stream(stream):
        kernel("kv_append.cu", "kv_append")(
            grid,
            block,
            (
                pages,
                np.int64(pages_meta.shape[1]),
                upload(as_int32(page_ids, "page_indices")),
                upload(as_int32(token_positions, "positions")),
                new_rows,
                np.int64(row_bytes),
                np.int32(count),
                np.int32(per_page),
            ),
        )


def _checked(
    pages: ArrayMeta,
    page_indices: IndexVector,
    positions: IndexVector,
    new_rows: ArrayMeta,
    tokens_per_page: SupportsIndex,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int]:
    """Page ids, token positions, bytes per token row and tokens per page, all checked."""
    num_pages, page_stride = row_table(pages, "pages")
    per_page = as_positive_int(tokens_per_page, "tokens_per_page")
    shape = new_rows.shape
    if len(shape) != 3 or not new_rows.flags.c_contiguous:
        raise ValueError(f"new_rows must be C-contiguous [num_tokens, num_kv_heads, head_dim], got shape {shape}")
    if new_rows.dtype.kind not in "fiu":
        raise TypeError(f"new_rows must hold numbers (fp16, bf16 bits, fp32, ...), got dtype {new_rows.dtype}")
    row_bytes = int(shape[1]) * int(shape[2]) * int(new_rows.dtype.itemsize)
    if per_page * row_bytes > page_stride:
        raise ValueError(
            f"tokens_per_page {per_page} rows of {row_bytes} bytes do not fit in pages of {page_stride} bytes"
        )
    count = int(shape[0])
    page_ids = index_vector(page_indices, "page_indices", count, -1, num_pages)
    token_positions = index_vector(positions, "positions", count, 0, 2**31)
    targets = (page_ids * per_page + token_positions % per_page)[page_ids >= 0]
    values, counts = np.unique(targets, return_counts=True)
    if values.size and int(counts.max()) > 1:
        target = int(values[int(np.argmax(counts))])
        page, row = divmod(target, per_page)
        raise ValueError(f"page_indices and positions put two tokens in page {page} row {row}")
    return page_ids, token_positions, row_bytes, per_page
