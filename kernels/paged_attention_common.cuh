// What both paged attention kernels share (paged_attention.cu on CUDA cores, paged_attention_mma.cu on tensor
// cores): element types and their fp32 conversions, the row layout of query/out, and the page lookup.
#pragma once

namespace attention {

typedef long long i64;
typedef unsigned long long u64;

enum DType { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// fp16 <-> fp32 in one cvt each, without cuda_fp16.h (so NVRTC needs no CUDA headers); plain C++ on the host.
__device__ __forceinline__ float half_to_float(unsigned short bits) {
#ifdef __CUDACC__
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
#else
    return static_cast<float>(__builtin_bit_cast(_Float16, bits));
#endif
}

__device__ __forceinline__ unsigned short half_from_float(float value) {
#ifdef __CUDACC__
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
#else
    return __builtin_bit_cast(unsigned short, static_cast<_Float16>(value));
#endif
}

// Conversions between storage elements and fp32.
template <int DT>
struct Element;

template <>
struct Element<kFloat16> {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ float load(const void* base, i64 index) {
        return half_to_float(reinterpret_cast<const unsigned short*>(base)[index]);
    }
    static __device__ __forceinline__ void store(void* base, i64 index, float value) {
        reinterpret_cast<unsigned short*>(base)[index] = half_from_float(value);
    }
    static __device__ __forceinline__ void unpack(const uint4& vector, float* out) {
        const unsigned words[4] = {vector.x, vector.y, vector.z, vector.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = half_to_float(static_cast<unsigned short>(words[i] & 0xffffu));
            out[2 * i + 1] = half_to_float(static_cast<unsigned short>(words[i] >> 16));
        }
    }
};

template <>
struct Element<kBFloat16> {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ float load(const void* base, i64 index) {
        return __uint_as_float(static_cast<unsigned>(reinterpret_cast<const unsigned short*>(base)[index]) << 16);
    }
    // Round to nearest even; any NaN becomes the canonical quiet NaN 0x7fc0.
    static __device__ __forceinline__ void store(void* base, i64 index, float value) {
        unsigned bits = __float_as_uint(value);
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
            bits = 0x7fc00000u;
        } else {
            bits += 0x7fffu + ((bits >> 16) & 1u);
        }
        reinterpret_cast<unsigned short*>(base)[index] = static_cast<unsigned short>(bits >> 16);
    }
    static __device__ __forceinline__ void unpack(const uint4& vector, float* out) {
        const unsigned words[4] = {vector.x, vector.y, vector.z, vector.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = __uint_as_float(words[i] << 16);
            out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
        }
    }
};

template <>
struct Element<kFloat32> {
    static constexpr int kBytes = 4;
    static __device__ __forceinline__ float load(const void* base, i64 index) {
        return reinterpret_cast<const float*>(base)[index];
    }
    static __device__ __forceinline__ void store(void* base, i64 index, float value) {
        reinterpret_cast<float*>(base)[index] = value;
    }
    static __device__ __forceinline__ void unpack(const uint4& vector, float* out) {
        out[0] = __uint_as_float(vector.x);
        out[1] = __uint_as_float(vector.y);
        out[2] = __uint_as_float(vector.z);
        out[3] = __uint_as_float(vector.w);
    }
};

__device__ __forceinline__ float minus_infinity() { return __int_as_float(0xff800000); }

// Element offset of query row `row` (token first_token + row / group_size, head kv_head * group_size + row %
// group_size) in query and out.
template <int HEAD_DIM>
__device__ __forceinline__ i64 row_start_of(int first_token, int row, int group_size, int num_heads, int kv_head) {
    return (static_cast<i64>(first_token + row / group_size) * num_heads + kv_head * group_size + row % group_size) *
           HEAD_DIM;
}

// exp2(a - b) that is 0 for an empty state (a = -inf), even when b is -inf too.
__device__ __forceinline__ float rescale(float a, float b) { return a == minus_infinity() ? 0.0f : exp2f(a - b); }

// Where the page tables put one key position: row byte offsets of its K and V, or false when it has no page.
struct PageLookup {
    const int* key_table;    // this sequence's table row
    const int* value_table;  // this sequence's table row
    int table_width;
    int tokens_per_page;
    int sink_pages;     // leading page ordinals kept in place (the sink blocks)
    int removed_pages;  // kv_page_offset * expansion
    int num_key_pages;
    int num_value_pages;
    i64 page_stride;
    i64 row_offset;  // (kv_head * head_dim) * element bytes: this kv head inside one token's row
    i64 token_bytes;  // num_kv_heads * head_dim * element bytes

    __device__ __forceinline__ bool find(int position, i64& key_offset, i64& value_offset) const {
        const int ordinal = position / tokens_per_page;
        int entry = ordinal;
        if (ordinal >= sink_pages) {
            entry -= removed_pages;
            if (entry < sink_pages) {
                return false;  // a removed (stale) block
            }
        }
        if (entry >= table_width) {
            return false;
        }
        const int key_page = key_table[entry];
        const int value_page = value_table[entry];
        if (key_page < 0 || key_page >= num_key_pages || value_page < 0 || value_page >= num_value_pages) {
            return false;
        }
        const i64 in_page = (position - ordinal * tokens_per_page) * token_bytes + row_offset;
        key_offset = key_page * page_stride + in_page;
        value_offset = value_page * page_stride + in_page;
        return true;
    }
};

// Split-K, shared by both kernels: the last CTA of a work item to finish weighs every split's partial result
// (ROWS x HEAD_DIM fp32 accumulators, then a (max, sum) pair per row; SPLIT_FLOATS apart) into the output.
// `split_weight` is shared memory of at least num_splits x ROWS floats; WORK names the CTA's rows (item, lane,
// warp, num_splits, rows_here, first_token, first_row, group_size, num_heads, kv_head).
template <int DT, int HEAD_DIM, int ROWS, int WARPS, int SPLIT_FLOATS, typename WORK>
__device__ __forceinline__ void merge_splits(float* split_weight, void* __restrict__ out, const float* work_partial,
                                             unsigned* __restrict__ counters, const WORK& w) {
    __shared__ bool is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned done = atomicAdd(counters + w.item, 1u);
        is_last = done == static_cast<unsigned>(w.num_splits - 1);
        if (is_last) {
            counters[w.item] = 0;  // ready for the next launch
        }
    }
    __syncthreads();
    if (!is_last) {
        return;
    }
    // Weight of split s in row r: exp2(max_s - max) / total sum, one warp per row, lanes over splits.
    for (int r = w.warp; r < ROWS; r += WARPS) {
        float row_max = minus_infinity();
        for (int s = w.lane; s < w.num_splits; s += 32) {
            row_max = fmaxf(row_max, __ldcg(work_partial + s * SPLIT_FLOATS + ROWS * HEAD_DIM + 2 * r));
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, offset));
        }
        float row_sum = 0.0f;
        for (int s = w.lane; s < w.num_splits; s += 32) {
            const float* pair = work_partial + s * SPLIT_FLOATS + ROWS * HEAD_DIM + 2 * r;
            const float factor = rescale(__ldcg(pair), row_max);
            split_weight[s * ROWS + r] = factor;
            row_sum += __ldcg(pair + 1) * factor;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            row_sum += __shfl_xor_sync(0xffffffffu, row_sum, offset);
        }
        for (int s = w.lane; s < w.num_splits; s += 32) {
            split_weight[s * ROWS + r] /= row_sum;  // a NaN sum (missing page) poisons the row
        }
    }
    __syncthreads();
    constexpr int kQuads = HEAD_DIM / 4;
    for (int index = threadIdx.x; index < w.rows_here * kQuads; index += WARPS * 32) {
        const int r = index / kQuads;
        const int quad = index % kQuads;
        const float* first = work_partial + r * HEAD_DIM + quad * 4;
        float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
        for (int s = 0; s < w.num_splits; ++s) {
            const float4 part = __ldcg(reinterpret_cast<const float4*>(first + s * SPLIT_FLOATS));
            const float weight = split_weight[s * ROWS + r];
            total.x = fmaf(part.x, weight, total.x);
            total.y = fmaf(part.y, weight, total.y);
            total.z = fmaf(part.z, weight, total.z);
            total.w = fmaf(part.w, weight, total.w);
        }
        const i64 start =
            row_start_of<HEAD_DIM>(w.first_token, w.first_row + r, w.group_size, w.num_heads, w.kv_head) + quad * 4;
        Element<DT>::store(out, start, total.x);
        Element<DT>::store(out, start + 1, total.y);
        Element<DT>::store(out, start + 2, total.z);
        Element<DT>::store(out, start + 3, total.w);
    }
}

}  // namespace attention
