// Paged attention (SPEC §3, §9.1): queries attend to K/V read through converted page tables.
// NumPy twin, launcher and numeric tolerances: kv_cache_manager_v2/kernels/attention.py.
//
// Memory (SPEC §1.1). K page p starts at key_base + p * page_stride bytes, V page p at value_base + p *
// page_stride: the pages of one (layer, role) buffer, indexed by a PageIndexConverter's output (SHARED with a
// per-(layer, role) base, or PER_LAYER with the pool base, which also reaches scratch slots). Inside one page:
//     [tokens_per_page, num_kv_heads, head_dim]   row-major, tokens_per_page = tokens_per_block / expansion
// query and out are [num_tokens, num_heads, head_dim], contiguous, of the pages' element type: fp16, bf16 (raw
// 16-bit) or fp32. Math is fp32.
//
// Batch. Sequence s owns query tokens [query_start[s], query_start[s + 1]); token t at positions[t] sees key j
// iff j <= positions[t] and, with window > 0, j > positions[t] - window or j < num_sink_tokens. Query head h
// reads kv head h / (num_heads / num_kv_heads). Table row s holds table_width page indices, expansion per block
// (page ordinal P covers positions [P * tokens_per_page, (P + 1) * tokens_per_page)). It may be window-local:
// entry e holds page ordinal e when e < sink_pages, else e + kv_page_offset[s] * expansion, with sink_pages =
// ceil(num_sink_tokens / tokens_per_block) * expansion; full tables have kv_page_offset 0. A visible key
// without a page (removed, -1, past the table, or not below num_key_pages / num_value_pages) makes its query's
// output NaN instead of reading stray memory (the twin raises ValueError there).
//
// Work. grid = (num_seqs * tiles_per_seq * num_kv_heads, num_splits); a work item (blockIdx.x, kv head fastest)
// is ROWS query rows (token, head) of one sequence that share one kv head, so each K/V row is loaded once for
// all of them: the GQA group of a decode token, or consecutive tokens of a prefill. The item's keys (the sink
// run, then the window run, of the union of its rows' visible keys) are cut into num_splits contiguous chunks,
// one CTA (4 warps) each: split-K as in flash-decoding, so few sequences still fill the GPU. Lane groups of a
// warp stream keys with 16-byte loads and keep an online softmax (running max, sum, accumulators) in registers;
// groups, warps and splits merge by the same rule. With num_splits > 1 each CTA leaves its result in `partial`
// and the last CTA of the item (counted in `counters`: zero on entry, reset by that CTA) writes the output.
// Scores come pre-multiplied by log2(e) (scale_log2 = softmax_scale * log2(e)) so exp2f does the exponentials.

namespace attention {

typedef long long i64;
typedef unsigned long long u64;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kVectorBytes = 16;
constexpr int kMaxSplits = 256;  // split-K factor limit (the launcher's MAX_SPLITS)

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

template <int DT, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void attend(const void* __restrict__ query, void* __restrict__ out, u64 key_base,
                                       u64 value_base, i64 page_stride, int num_key_pages, int num_value_pages,
                                       const int* __restrict__ key_table, const int* __restrict__ value_table,
                                       int table_width, const int* __restrict__ kv_page_offset,
                                       const int* __restrict__ query_start, const int* __restrict__ positions,
                                       int num_heads, int num_kv_heads, int tokens_per_block, int expansion,
                                       int window, int num_sink_tokens, float scale_log2, int tiles_per_seq,
                                       float* __restrict__ partial, unsigned* __restrict__ counters) {
    typedef Element<DT> E;
    constexpr int kVectorElems = kVectorBytes / E::kBytes;        // elements per 16-byte load
    constexpr int kVectors = HEAD_DIM / kVectorElems;             // 16-byte loads per head row
    constexpr int kLanes = kVectors < 32 ? kVectors : 32;         // lanes sharing one key (a lane group)
    constexpr int kVectorsPerLane = kVectors / kLanes;
    constexpr int kElems = kVectorsPerLane * kVectorElems;        // head dims held by one lane
    constexpr int kGroups = 32 / kLanes;                          // keys a warp reads side by side
    constexpr int kUnroll = ROWS <= 2 ? 8 : (ROWS == 4 ? 4 : 2);  // keys per group in flight (register budget)
    constexpr int kBatch = kGroups * kUnroll;                     // keys per warp step
    static_assert(kVectors * kVectorElems == HEAD_DIM, "head_dim must fill whole 16-byte vectors");
    static_assert((kLanes & (kLanes - 1)) == 0 && kVectorsPerLane * kLanes == kVectors,
                  "16-byte vectors per head row must be a power of two");

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int group = lane / kLanes;
    const int sub = lane % kLanes;
    // kv heads vary fastest over CTAs, so the CTAs reading the kv heads of the same tokens run side by side
    // and together read whole token rows of a page.
    const int work = blockIdx.x;
    const int kv_head = work % num_kv_heads;
    const int seq = work / num_kv_heads / tiles_per_seq;
    const int tile = work / num_kv_heads % tiles_per_seq;
    const int split = blockIdx.y;
    const int num_splits = gridDim.y;
    const int group_size = num_heads / num_kv_heads;
    const int first_token = query_start[seq];
    const int num_rows = (query_start[seq + 1] - first_token) * group_size;
    const int first_row = tile * ROWS;
    if (first_row >= num_rows) {
        return;  // the whole CTA (and every split of this tile) leaves together
    }
    const int rows_here = min(ROWS, num_rows - first_row);

    // Rows: (token, head) pairs; position -1 marks a padding row that sees no key.
    int position[ROWS];
    int lowest = 0x7fffffff;
    int highest = -1;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        position[r] = -1;
        if (r < rows_here) {
            position[r] = positions[first_token + (first_row + r) / group_size];
            lowest = min(lowest, position[r]);
            highest = max(highest, position[r]);
        }
    }
    const int window_begin = window > 0 ? max(0, lowest - window + 1) : 0;
    const int sink_end = window > 0 ? min(num_sink_tokens, window_begin) : 0;
    const int num_keys = max(0, sink_end + highest - window_begin + 1);
    const int chunk = ((num_keys + num_splits - 1) / num_splits + kBatch - 1) / kBatch * kBatch;
    const int key_begin = min(num_keys, split * chunk);
    const int key_end = min(num_keys, key_begin + chunk);

    // This lane's slice of each query row, pre-scaled: dims (v * kLanes + sub) * kVectorElems + e.
    float q[ROWS][kElems];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const i64 start = row_start_of<HEAD_DIM>(first_token, first_row + r, group_size, num_heads, kv_head);
#pragma unroll
        for (int v = 0; v < kVectorsPerLane; ++v) {
#pragma unroll
            for (int e = 0; e < kVectorElems; ++e) {
                const int dim = (v * kLanes + sub) * kVectorElems + e;
                q[r][v * kVectorElems + e] = r < rows_here ? E::load(query, start + dim) * scale_log2 : 0.0f;
            }
        }
    }

    PageLookup pages;
    pages.key_table = key_table + static_cast<i64>(seq) * table_width;
    pages.value_table = value_table + static_cast<i64>(seq) * table_width;
    pages.table_width = table_width;
    pages.tokens_per_page = tokens_per_block / expansion;
    pages.sink_pages = (num_sink_tokens + tokens_per_block - 1) / tokens_per_block * expansion;
    pages.removed_pages = kv_page_offset[seq] * expansion;
    pages.num_key_pages = num_key_pages;
    pages.num_value_pages = num_value_pages;
    pages.page_stride = page_stride;
    pages.token_bytes = static_cast<i64>(num_kv_heads) * HEAD_DIM * E::kBytes;
    pages.row_offset = static_cast<i64>(kv_head) * HEAD_DIM * E::kBytes + sub * kVectorBytes;
    const char* keys = reinterpret_cast<const char*>(key_base);
    const char* values = reinterpret_cast<const char*>(value_base);

    float running_max[ROWS];
    float running_sum[ROWS];
    float acc[ROWS][kElems];
    unsigned missing = 0;  // bit r: row r sees a key that has no page
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        running_max[r] = minus_infinity();
        running_sum[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) {
            acc[r][e] = 0.0f;
        }
    }

    for (int step = key_begin + warp * kBatch; step < key_end; step += kWarps * kBatch) {
        uint4 k_vec[kUnroll][kVectorsPerLane];
        uint4 v_vec[kUnroll][kVectorsPerLane];
        int key_position[kUnroll];
        bool in_range[kUnroll];
        bool found[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int index = step + u * kGroups + group;
            in_range[u] = index < key_end;
            key_position[u] = index < sink_end ? index : window_begin + (index - sink_end);
            i64 key_offset = 0;
            i64 value_offset = 0;
            found[u] = in_range[u] && pages.find(key_position[u], key_offset, value_offset);
#pragma unroll
            for (int v = 0; v < kVectorsPerLane; ++v) {
                if (found[u]) {
                    k_vec[u][v] = __ldg(reinterpret_cast<const uint4*>(keys + key_offset) + v * kLanes);
                    v_vec[u][v] = __ldg(reinterpret_cast<const uint4*>(values + value_offset) + v * kLanes);
                } else {
                    k_vec[u][v] = make_uint4(0, 0, 0, 0);
                    v_vec[u][v] = make_uint4(0, 0, 0, 0);
                }
            }
        }

        // Scores (log2 units), summed over the kLanes lanes of each group.
        float score[kUnroll][ROWS];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float k[kElems];
#pragma unroll
            for (int v = 0; v < kVectorsPerLane; ++v) {
                E::unpack(k_vec[u][v], k + v * kVectorElems);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < kElems; ++e) {
                    dot = fmaf(q[r][e], k[e], dot);
                }
                score[u][r] = dot;
            }
        }
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    score[u][r] += __shfl_xor_sync(0xffffffffu, score[u][r], offset);
                }
            }
        }

        // Visibility (SPEC §3), then the online softmax update of each row.
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float step_max = minus_infinity();
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int j = key_position[u];
                const bool visible = in_range[u] && j <= position[r] &&
                                     (window <= 0 || j > position[r] - window || j < num_sink_tokens);
                if (visible && !found[u]) {
                    missing |= 1u << r;
                }
                if (!(visible && found[u])) {
                    score[u][r] = minus_infinity();
                }
                step_max = fmaxf(step_max, score[u][r]);
            }
            const float new_max = fmaxf(running_max[r], step_max);
            if (new_max == minus_infinity()) {
                continue;  // nothing visible to this row yet
            }
            const float correction = rescale(running_max[r], new_max);
            running_max[r] = new_max;
            running_sum[r] *= correction;
#pragma unroll
            for (int e = 0; e < kElems; ++e) {
                acc[r][e] *= correction;
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                score[u][r] = exp2f(score[u][r] - new_max);  // now the weight; 0 for masked keys
                running_sum[r] += score[u][r];
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float value[kElems];
#pragma unroll
            for (int v = 0; v < kVectorsPerLane; ++v) {
                E::unpack(v_vec[u][v], value + v * kVectorElems);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float weight = running_max[r] == minus_infinity() ? 0.0f : score[u][r];
#pragma unroll
                for (int e = 0; e < kElems; ++e) {
                    acc[r][e] = fmaf(weight, value[e], acc[r][e]);
                }
            }
        }
    }

    // Merge the lane groups of each warp (all lanes take part in every shuffle).
#pragma unroll
    for (int offset = kLanes; offset < 32; offset <<= 1) {
        missing |= __shfl_xor_sync(0xffffffffu, missing, offset);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float other_max = __shfl_xor_sync(0xffffffffu, running_max[r], offset);
            const float other_sum = __shfl_xor_sync(0xffffffffu, running_sum[r], offset);
            const float new_max = fmaxf(running_max[r], other_max);
            const float mine = rescale(running_max[r], new_max);
            const float theirs = rescale(other_max, new_max);
            running_sum[r] = running_sum[r] * mine + other_sum * theirs;
#pragma unroll
            for (int e = 0; e < kElems; ++e) {
                const float other = __shfl_xor_sync(0xffffffffu, acc[r][e], offset);
                acc[r][e] = acc[r][e] * mine + other * theirs;
            }
            running_max[r] = new_max;
        }
    }

    // Merge the warps through shared memory.
    __shared__ float warp_max[kWarps][ROWS];
    __shared__ float warp_sum[kWarps][ROWS];
    __shared__ float warp_acc[kWarps][ROWS][HEAD_DIM];
    __shared__ unsigned warp_missing[kWarps];
    __shared__ bool is_last;
    if (group == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int v = 0; v < kVectorsPerLane; ++v) {
#pragma unroll
                for (int e = 0; e < kVectorElems; ++e) {
                    warp_acc[warp][r][(v * kLanes + sub) * kVectorElems + e] = acc[r][v * kVectorElems + e];
                }
            }
        }
    }
    if (lane == 0) {
        warp_missing[warp] = missing;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            warp_max[warp][r] = running_max[r];
            warp_sum[warp][r] = running_sum[r];
        }
    }
    __syncthreads();
    unsigned cta_missing = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        cta_missing |= warp_missing[w];
    }

    // Per split: ROWS x HEAD_DIM accumulators, then ROWS (max, sum) pairs, padded to whole float4s.
    constexpr int kSplitFloats = ROWS * HEAD_DIM + (2 * ROWS + 3) / 4 * 4;
    float* work_partial = partial + static_cast<i64>(work) * num_splits * kSplitFloats;
    for (int index = threadIdx.x; index < ROWS * HEAD_DIM; index += kThreads) {
        const int r = index / HEAD_DIM;
        const int dim = index % HEAD_DIM;
        float cta_max = minus_infinity();
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            cta_max = fmaxf(cta_max, warp_max[w][r]);
        }
        float sum = 0.0f;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float factor = rescale(warp_max[w][r], cta_max);
            sum += warp_sum[w][r] * factor;
            total += warp_acc[w][r][dim] * factor;
        }
        if ((cta_missing >> r) & 1u) {
            sum = __int_as_float(0x7fc00000);  // NaN: a visible key had no page
        }
        if (num_splits == 1) {
            if (r < rows_here) {
                const i64 start = row_start_of<HEAD_DIM>(first_token, first_row + r, group_size, num_heads, kv_head);
                E::store(out, start + dim, total / sum);
            }
        } else {
            float* mine = work_partial + split * kSplitFloats;
            mine[r * HEAD_DIM + dim] = total;
            if (dim == 0) {
                mine[ROWS * HEAD_DIM + 2 * r] = cta_max;
                mine[ROWS * HEAD_DIM + 2 * r + 1] = sum;
            }
        }
    }
    if (num_splits == 1) {
        return;
    }

    // Split-K: the last CTA of this work item to finish merges every split's partial result.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned done = atomicAdd(counters + work, 1u);
        is_last = done == static_cast<unsigned>(num_splits - 1);
        if (is_last) {
            counters[work] = 0;  // ready for the next launch
        }
    }
    __syncthreads();
    if (!is_last) {
        return;
    }
    // Weight of split s in row r: exp2(max_s - max) / total sum, one warp per row, lanes over splits.
    __shared__ float split_weight[kMaxSplits][ROWS];
    for (int r = warp; r < ROWS; r += kWarps) {
        float row_max = minus_infinity();
        for (int s = lane; s < num_splits; s += 32) {
            row_max = fmaxf(row_max, __ldcg(work_partial + s * kSplitFloats + ROWS * HEAD_DIM + 2 * r));
        }
        float row_sum = 0.0f;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, offset));
        }
        for (int s = lane; s < num_splits; s += 32) {
            const float* pair = work_partial + s * kSplitFloats + ROWS * HEAD_DIM + 2 * r;
            const float factor = rescale(__ldcg(pair), row_max);
            split_weight[s][r] = factor;
            row_sum += __ldcg(pair + 1) * factor;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            row_sum += __shfl_xor_sync(0xffffffffu, row_sum, offset);
        }
        for (int s = lane; s < num_splits; s += 32) {
            split_weight[s][r] /= row_sum;  // a NaN sum (missing page) poisons the row
        }
    }
    __syncthreads();
    constexpr int kQuads = HEAD_DIM / 4;
    for (int index = threadIdx.x; index < rows_here * kQuads; index += kThreads) {
        const int r = index / kQuads;
        const int quad = index % kQuads;
        const float* first = work_partial + r * HEAD_DIM + quad * 4;
        float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
        for (int s = 0; s < num_splits; ++s) {
            const float4 part = __ldcg(reinterpret_cast<const float4*>(first + s * kSplitFloats));
            const float weight = split_weight[s][r];
            total.x = fmaf(part.x, weight, total.x);
            total.y = fmaf(part.y, weight, total.y);
            total.z = fmaf(part.z, weight, total.z);
            total.w = fmaf(part.w, weight, total.w);
        }
        const i64 start =
            row_start_of<HEAD_DIM>(first_token, first_row + r, group_size, num_heads, kv_head) + quad * 4;
        E::store(out, start, total.x);
        E::store(out, start + 1, total.y);
        E::store(out, start + 2, total.z);
        E::store(out, start + 3, total.w);
    }
}

}  // namespace attention

// extern "C" entry points (NVRTC needs no name expressions), all with this parameter list.
#define PAGED_ATTENTION_ENTRY(NAME, DT, HEAD_DIM, ROWS)                                                          \
    extern "C" __global__ void __launch_bounds__(attention::kThreads)                                             \
        NAME(const void* __restrict__ query, void* __restrict__ out, unsigned long long key_base,                \
             unsigned long long value_base, long long page_stride, int num_key_pages, int num_value_pages,        \
             const int* __restrict__ key_table, const int* __restrict__ value_table, int table_width,            \
             const int* __restrict__ kv_page_offset, const int* __restrict__ query_start,                        \
             const int* __restrict__ positions, int num_heads, int num_kv_heads, int tokens_per_block,           \
             int expansion, int window, int num_sink_tokens, float scale_log2, int tiles_per_seq,                \
             float* __restrict__ partial, unsigned* __restrict__ counters) {                                     \
        attention::attend<DT, HEAD_DIM, ROWS>(query, out, key_base, value_base, page_stride, num_key_pages,       \
                                              num_value_pages, key_table, value_table, table_width,              \
                                              kv_page_offset, query_start, positions, num_heads, num_kv_heads,   \
                                              tokens_per_block, expansion, window, num_sink_tokens, scale_log2,  \
                                              tiles_per_seq, partial, counters);                                 \
    }

#if defined(PAGED_ATTENTION_DTYPE) && defined(PAGED_ATTENTION_HEAD_DIM) && defined(PAGED_ATTENTION_ROWS)
// The launcher compiles only the variant it runs (about 1 s instead of about 20 s for all of them), e.g.
// -DPAGED_ATTENTION_DTYPE=0 -DPAGED_ATTENTION_HEAD_DIM=128 -DPAGED_ATTENTION_ROWS=4 -> "paged_attention".
PAGED_ATTENTION_ENTRY(paged_attention, PAGED_ATTENTION_DTYPE, PAGED_ATTENTION_HEAD_DIM, PAGED_ATTENTION_ROWS)
#elif !defined(PAGED_ATTENTION_NO_ENTRIES)  // (tests on the CPU instantiate the variants they run)
// Every variant the launcher can ask for, paged_attention_<f16|bf16|f32>_d<head_dim>_r<rows> (the CI check).
#define PAGED_ATTENTION_ALL_ROWS(NAME, DT, HEAD_DIM)  \
    PAGED_ATTENTION_ENTRY(NAME##_r1, DT, HEAD_DIM, 1) \
    PAGED_ATTENTION_ENTRY(NAME##_r2, DT, HEAD_DIM, 2) \
    PAGED_ATTENTION_ENTRY(NAME##_r4, DT, HEAD_DIM, 4) \
    PAGED_ATTENTION_ENTRY(NAME##_r8, DT, HEAD_DIM, 8)
#define PAGED_ATTENTION_ALL_HEAD_DIMS(NAME, DT)    \
    PAGED_ATTENTION_ALL_ROWS(NAME##_d64, DT, 64)   \
    PAGED_ATTENTION_ALL_ROWS(NAME##_d128, DT, 128) \
    PAGED_ATTENTION_ALL_ROWS(NAME##_d256, DT, 256)
PAGED_ATTENTION_ALL_HEAD_DIMS(paged_attention_f16, attention::kFloat16)
PAGED_ATTENTION_ALL_HEAD_DIMS(paged_attention_bf16, attention::kBFloat16)
PAGED_ATTENTION_ALL_HEAD_DIMS(paged_attention_f32, attention::kFloat32)
#endif
