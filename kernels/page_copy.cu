// Batched page copies: many pages move in one launch (tier migration, prefill -> decode handoff, SPEC §9.5).
//
// Device <-> pinned host moves are one page_copy_rows launch that reads or writes the pinned pool through its
// device-mapped address (kv_cache_manager_v2/kernels/mapped_copy.py). Moves to or from pageable host memory (the
// disk tier) go through a contiguous staging buffer: page_copy_rows gathers the pages into it on the source side
// (dst_rows null), one transfer moves the buffer, and page_copy_rows scatters it on the destination side (src_rows
// null); device -> device moves copy pool to pool directly. page_copy_batched takes arbitrary
// (dst offset, src offset, nbytes) triples, for pages of mixed sizes.
// NumPy twin and launcher: kv_cache_manager_v2/kernels/page_copy.py.
#include "copy_common.cuh"

using kvcm::byte_t;
using kvcm::i64;

// dst row dst_rows[i] <- src row src_rows[i] (rows of row_bytes); null table = identity; negative id = skip.
extern "C" __global__ void page_copy_rows(byte_t* dst, const int* dst_rows, const byte_t* src,
                                          const int* src_rows, i64 row_bytes, int num_rows) {
    kvcm::copy_row_pairs(dst, dst_rows, src, src_rows, row_bytes, num_rows);
}

// dst[dst_offsets[i] : + sizes[i]] <- src[src_offsets[i] : + sizes[i]] for every i < num_copies (byte offsets).
extern "C" __global__ void page_copy_batched(byte_t* dst, const i64* dst_offsets, const byte_t* src,
                                             const i64* src_offsets, const i64* sizes, int num_copies) {
    const kvcm::RowGrid grid = kvcm::row_grid();
    for (i64 i = grid.first_row; i < num_copies; i += grid.row_step) {
        kvcm::copy_span(dst + dst_offsets[i], src + src_offsets[i], sizes[i], grid.lane, grid.num_lanes);
    }
}
