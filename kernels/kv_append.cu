// KV append (SPEC §9.2): scatters the new tokens' K (or V) rows into their pages, one launch per (layer, role).
//
// Page layout inside one K or V page (stride page_stride bytes, page_stride >= tokens_per_page * row_bytes):
//     [tokens_per_page, num_kv_heads, head_dim]   row-major, so one token's row of num_kv_heads * head_dim
//                                                  elements (row_bytes bytes) is contiguous.
// tokens_per_page = tokens_per_block / expansion (SPEC §1.1): with expansion, a block's tokens spread over
// `expansion` consecutive page indices. Token t goes to page page_indices[t] (already converted, SHARED or
// PER_LAYER, relative to `pages`), row positions[t] % tokens_per_page. A negative page index skips the token
// (padding). Elements move as raw bits: fp16 and bf16 rows are 2-byte elements, fp32 4-byte, fp8 1-byte.
// NumPy twin and launcher: kv_cache_manager_v2/kernels/kv_append.py.
#include "copy_common.cuh"

using kvcm::byte_t;
using kvcm::i64;

extern "C" __global__ void kv_append(byte_t* pages, i64 page_stride, const int* page_indices,
                                     const int* positions, const byte_t* new_rows, i64 row_bytes,
                                     int num_tokens, int tokens_per_page) {
    const kvcm::RowGrid grid = kvcm::row_grid();
    for (i64 t = grid.first_row; t < num_tokens; t += grid.row_step) {
        const i64 page = page_indices[t];
        if (page < 0) {
            continue;
        }
        const i64 row = positions[t] % tokens_per_page;
        kvcm::copy_span(pages + page * page_stride + row * row_bytes, new_rows + t * row_bytes, row_bytes, grid.lane,
                        grid.num_lanes);
    }
}
