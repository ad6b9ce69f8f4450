// Device helpers shared by the data-movement kernels (page_copy.cu, kv_append.cu, ssm_copy.cu).
//
// Every copy kernel moves "rows": contiguous byte spans (a page, a slot, one token's K or V row). The launch grid
// is two-dimensional so that small and large rows both keep the GPU busy:
//   x (blockIdx.x * blockDim.x + threadIdx.x)   lanes that stride over the bytes of one row;
//   y (blockIdx.y * blockDim.y + threadIdx.y)   rows, grid-stride (a row count may exceed gridDim.y * blockDim.y).
// The launchers (kv_cache_manager_v2/kernels/_launch.py) pick blockDim.x to fit the row and blockDim.y to fill
// a block of 256 threads. Raw bits move: element types (fp16, bf16, fp32, fp8) only set a row's byte count.
#pragma once

namespace kvcm {

typedef unsigned char byte_t;
typedef long long i64;
typedef unsigned long long u64;

// Lanes of this thread within a row, and the rows it visits.
struct RowGrid {
    i64 lane;
    i64 num_lanes;
    i64 first_row;
    i64 row_step;
};

__device__ __forceinline__ RowGrid row_grid() {
    RowGrid grid;
    grid.lane = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    grid.num_lanes = (i64)gridDim.x * blockDim.x;
    grid.first_row = (i64)blockIdx.y * blockDim.y + threadIdx.y;
    grid.row_step = (i64)gridDim.y * blockDim.y;
    return grid;
}

// Copies nbytes from src to dst (non-overlapping), this thread taking bytes or vectors lane, lane + num_lanes, ...
// When src and dst have the same offset modulo 16, a byte-wise head reaches 16-byte alignment, the body moves
// 16-byte vectors (four in flight per lane), and a byte-wise tail finishes; otherwise every byte moves alone.
// Example: src % 16 == dst % 16 == 12, nbytes 40 -> 4 head bytes, 2 vectors, 4 tail bytes.
__device__ __forceinline__ void copy_span(byte_t* __restrict__ dst, const byte_t* __restrict__ src, i64 nbytes,
                                          i64 lane, i64 num_lanes) {
    const u64 misalignment = reinterpret_cast<u64>(src) & 15u;
    if (misalignment != (reinterpret_cast<u64>(dst) & 15u)) {
        for (i64 i = lane; i < nbytes; i += num_lanes) {
            dst[i] = src[i];
        }
        return;
    }
    i64 head = misalignment == 0 ? 0 : 16 - (i64)misalignment;
    if (head > nbytes) {
        head = nbytes;
    }
    for (i64 i = lane; i < head; i += num_lanes) {
        dst[i] = src[i];
    }
    const i64 num_vectors = (nbytes - head) >> 4;
    const uint4* __restrict__ vsrc = reinterpret_cast<const uint4*>(src + head);
    uint4* __restrict__ vdst = reinterpret_cast<uint4*>(dst + head);
    i64 v = lane;
    for (; v + 3 * num_lanes < num_vectors; v += 4 * num_lanes) {
        const uint4 a = vsrc[v];
        const uint4 b = vsrc[v + num_lanes];
        const uint4 c = vsrc[v + 2 * num_lanes];
        const uint4 d = vsrc[v + 3 * num_lanes];
        vdst[v] = a;
        vdst[v + num_lanes] = b;
        vdst[v + 2 * num_lanes] = c;
        vdst[v + 3 * num_lanes] = d;
    }
    for (; v < num_vectors; v += num_lanes) {
        vdst[v] = vsrc[v];
    }
    for (i64 i = head + (num_vectors << 4) + lane; i < nbytes; i += num_lanes) {
        dst[i] = src[i];
    }
}

// Copies row src_rows[i] of src to row dst_rows[i] of dst for every i < num_rows (rows of row_bytes bytes).
// A null table stands for the identity (row i), which makes a gather (dst_rows null) or a scatter (src_rows null)
// through a contiguous staging buffer; a negative row id skips that pair.
__device__ __forceinline__ void copy_row_pairs(byte_t* dst, const int* dst_rows, const byte_t* src,
                                               const int* src_rows, i64 row_bytes, int num_rows) {
    const RowGrid grid = row_grid();
    for (i64 i = grid.first_row; i < num_rows; i += grid.row_step) {
        const i64 dst_row = dst_rows != nullptr ? dst_rows[i] : i;
        const i64 src_row = src_rows != nullptr ? src_rows[i] : i;
        if (dst_row < 0 || src_row < 0) {
            continue;
        }
        copy_span(dst + dst_row * row_bytes, src + src_row * row_bytes, row_bytes, grid.lane, grid.num_lanes);
    }
}

}  // namespace kvcm
