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
// groups, warps and splits merge by the same rule. With several rows per item a warp loads its next keys before
// scoring the ones in hand (double buffering), which keeps more bytes in flight than unrolling deeper would.
// With num_splits > 1 each CTA leaves its result in `partial` and the last CTA of the item (counted in
// `counters`: zero on entry, reset by that CTA) writes the output.
// Scores come pre-multiplied by log2(e) (scale_log2 = softmax_scale * log2(e)) so exp2f does the exponentials.

#include "paged_attention_common.cuh"

namespace attention {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kVectorBytes = 16;
constexpr int kMaxSplits = 256;  // split-K factor limit (the launcher's MAX_SPLITS)

// Compile-time shape of one variant: a lane group reads one key's head row with 16-byte loads.
template <int DT, int HEAD_DIM, int ROWS>
struct Shape {
    typedef Element<DT> E;
    static constexpr int kVectorElems = kVectorBytes / E::kBytes;        // elements per 16-byte load
    static constexpr int kVectors = HEAD_DIM / kVectorElems;             // 16-byte loads per head row
    static constexpr int kLanes = kVectors < 32 ? kVectors : 32;         // lanes sharing one key (a lane group)
    static constexpr int kVectorsPerLane = kVectors / kLanes;
    static constexpr int kElems = kVectorsPerLane * kVectorElems;        // head dims held by one lane
    static constexpr int kGroups = 32 / kLanes;                          // keys a warp reads side by side
    // Keys per group in flight, and whether a warp loads its next step's keys before scoring this one's. Picked
    // on an H100 (tools/bench_attention.py): with several rows the accumulators leave few registers, so one
    // key per group, double-buffered, keeps more bytes in flight than a deeper unroll at lower occupancy.
    static constexpr int kUnroll = ROWS == 1 ? 8 : (ROWS == 4 ? 1 : 2);
    static constexpr bool kPrefetch = ROWS > 1;
    static constexpr int kBatch = kGroups * kUnroll;                     // keys per warp step
    // Per split in `partial`: ROWS x HEAD_DIM accumulators, then ROWS (max, sum) pairs, padded to whole float4s.
    static constexpr int kSplitFloats = ROWS * HEAD_DIM + (2 * ROWS + 3) / 4 * 4;
    static_assert(kVectors * kVectorElems == HEAD_DIM, "head_dim must fill whole 16-byte vectors");
    static_assert((kLanes & (kLanes - 1)) == 0 && kVectorsPerLane * kLanes == kVectors,
                  "16-byte vectors per head row must be a power of two");
};

// Which query rows this CTA serves and where this thread sits in it.
struct Work {
    int lane;
    int warp;
    int group;  // lane group within the warp
    int sub;    // lane within the group
    int item;   // blockIdx.x: (sequence, row tile, kv head), kv head fastest
    int kv_head;
    int seq;
    int split;
    int num_splits;
    int group_size;
    int first_token;
    int first_row;
    int rows_here;
    int num_heads;
};

// One thread's online softmax state of each row: running max and sum (log2 units) and its accumulators.
template <int ROWS, int ELEMS>
struct Softmax {
    float running_max[ROWS];
    float running_sum[ROWS];
    float acc[ROWS][ELEMS];
    unsigned missing;  // bit r: row r sees a key that has no page

    __device__ __forceinline__ void reset() {
        missing = 0;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            running_max[r] = minus_infinity();
            running_sum[r] = 0.0f;
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) {
                acc[r][e] = 0.0f;
            }
        }
    }
};

// Keys one warp step reads: per unrolled key, its position, whether it is in the chunk and has a page, and this
// lane's 16-byte vectors of its K and V rows.
template <int UNROLL, int VECTORS_PER_LANE>
struct KeyBatch {
    uint4 k_vec[UNROLL][VECTORS_PER_LANE];
    uint4 v_vec[UNROLL][VECTORS_PER_LANE];
    int position[UNROLL];
    bool in_range[UNROLL];
    bool found[UNROLL];
};

// This lane's slice of each query row, pre-scaled: dims (v * kLanes + sub) * kVectorElems + e.
template <int DT, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void load_query(float (&q)[ROWS][Shape<DT, HEAD_DIM, ROWS>::kElems],
                                           const void* __restrict__ query, const Work& w, float scale_log2) {
    typedef Shape<DT, HEAD_DIM, ROWS> S;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const i64 start = row_start_of<HEAD_DIM>(w.first_token, w.first_row + r, w.group_size, w.num_heads, w.kv_head);
#pragma unroll
        for (int v = 0; v < S::kVectorsPerLane; ++v) {
#pragma unroll
            for (int e = 0; e < S::kVectorElems; ++e) {
                const int dim = (v * S::kLanes + w.sub) * S::kVectorElems + e;
                q[r][v * S::kVectorElems + e] = r < w.rows_here ? S::E::load(query, start + dim) * scale_log2 : 0.0f;
            }
        }
    }
}

// Loads the keys of one warp step: key index step + u * kGroups + group is the sink run's, then the window run's.
template <int DT, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void load_keys(
    KeyBatch<Shape<DT, HEAD_DIM, ROWS>::kUnroll, Shape<DT, HEAD_DIM, ROWS>::kVectorsPerLane>& keys, int step,
    int key_end, int sink_end, int window_begin, const PageLookup& pages, const char* key_bytes,
    const char* value_bytes, const Work& w) {
    typedef Shape<DT, HEAD_DIM, ROWS> S;
#pragma unroll
    for (int u = 0; u < S::kUnroll; ++u) {
        const int index = step + u * S::kGroups + w.group;
        keys.in_range[u] = index < key_end;
        keys.position[u] = index < sink_end ? index : window_begin + (index - sink_end);
        i64 key_offset = 0;
        i64 value_offset = 0;
        keys.found[u] = keys.in_range[u] && pages.find(keys.position[u], key_offset, value_offset);
#pragma unroll
        for (int v = 0; v < S::kVectorsPerLane; ++v) {
            if (keys.found[u]) {
                keys.k_vec[u][v] = __ldg(reinterpret_cast<const uint4*>(key_bytes + key_offset) + v * S::kLanes);
                keys.v_vec[u][v] = __ldg(reinterpret_cast<const uint4*>(value_bytes + value_offset) + v * S::kLanes);
            } else {
                keys.k_vec[u][v] = make_uint4(0, 0, 0, 0);
                keys.v_vec[u][v] = make_uint4(0, 0, 0, 0);
            }
        }
    }
}

// Scores (log2 units) of every row against every key of the step, summed over the kLanes lanes of each group.
template <int DT, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void scores(
    float (&score)[Shape<DT, HEAD_DIM, ROWS>::kUnroll][ROWS], const float (&q)[ROWS][Shape<DT, HEAD_DIM, ROWS>::kElems],
    const KeyBatch<Shape<DT, HEAD_DIM, ROWS>::kUnroll, Shape<DT, HEAD_DIM, ROWS>::kVectorsPerLane>& keys) {
    typedef Shape<DT, HEAD_DIM, ROWS> S;
#pragma unroll
    for (int u = 0; u < S::kUnroll; ++u) {
        float k[S::kElems];
#pragma unroll
        for (int v = 0; v < S::kVectorsPerLane; ++v) {
            S::E::unpack(keys.k_vec[u][v], k + v * S::kVectorElems);
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < S::kElems; ++e) {
                dot = fmaf(q[r][e], k[e], dot);
            }
            score[u][r] = dot;
        }
    }
#pragma unroll
    for (int offset = S::kLanes / 2; offset > 0; offset >>= 1) {
#pragma unroll
        for (int u = 0; u < S::kUnroll; ++u) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                score[u][r] += __shfl_xor_sync(0xffffffffu, score[u][r], offset);
            }
        }
    }
}

// Visibility (SPEC §3), then the online softmax update of each row and the weighted values added in.
template <int DT, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void online_softmax(
    Softmax<ROWS, Shape<DT, HEAD_DIM, ROWS>::kElems>& state, float (&score)[Shape<DT, HEAD_DIM, ROWS>::kUnroll][ROWS],
    const KeyBatch<Shape<DT, HEAD_DIM, ROWS>::kUnroll, Shape<DT, HEAD_DIM, ROWS>::kVectorsPerLane>& keys,
    const int (&position)[ROWS], int window, int num_sink_tokens) {
    typedef Shape<DT, HEAD_DIM, ROWS> S;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float step_max = minus_infinity();
#pragma unroll
        for (int u = 0; u < S::kUnroll; ++u) {
            const int j = keys.position[u];
            const bool visible = keys.in_range[u] && j <= position[r] &&
                                 (window <= 0 || j > position[r] - window || j < num_sink_tokens);
            if (visible && !keys.found[u]) {
                state.missing |= 1u << r;
            }
            if (!(visible && keys.found[u])) {
                score[u][r] = minus_infinity();
            }
            step_max = fmaxf(step_max, score[u][r]);
        }
        const float new_max = fmaxf(state.running_max[r], step_max);
        if (new_max == minus_infinity()) {
            continue;  // nothing visible to this row yet
        }
        const float correction = rescale(state.running_max[r], new_max);
        state.running_max[r] = new_max;
        state.running_sum[r] *= correction;
#pragma unroll
        for (int e = 0; e < S::kElems; ++e) {
            state.acc[r][e] *= correction;
        }
#pragma unroll
        for (int u = 0; u < S::kUnroll; ++u) {
            score[u][r] = exp2f(score[u][r] - new_max);  // now the weight; 0 for masked keys
            state.running_sum[r] += score[u][r];
        }
    }
#pragma unroll
    for (int u = 0; u < S::kUnroll; ++u) {
        float value[S::kElems];
#pragma unroll
        for (int v = 0; v < S::kVectorsPerLane; ++v) {
            S::E::unpack(keys.v_vec[u][v], value + v * S::kVectorElems);
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float weight = state.running_max[r] == minus_infinity() ? 0.0f : score[u][r];
#pragma unroll
            for (int e = 0; e < S::kElems; ++e) {
                state.acc[r][e] = fmaf(weight, value[e], state.acc[r][e]);
            }
        }
    }
}

// Merges the lane groups of each warp (all lanes take part in every shuffle).
template <int DT, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void merge_lane_groups(Softmax<ROWS, Shape<DT, HEAD_DIM, ROWS>::kElems>& state) {
    typedef Shape<DT, HEAD_DIM, ROWS> S;
#pragma unroll
    for (int offset = S::kLanes; offset < 32; offset <<= 1) {
        state.missing |= __shfl_xor_sync(0xffffffffu, state.missing, offset);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float other_max = __shfl_xor_sync(0xffffffffu, state.running_max[r], offset);
            const float other_sum = __shfl_xor_sync(0xffffffffu, state.running_sum[r], offset);
            const float new_max = fmaxf(state.running_max[r], other_max);
            const float mine = rescale(state.running_max[r], new_max);
            const float theirs = rescale(other_max, new_max);
            state.running_sum[r] = state.running_sum[r] * mine + other_sum * theirs;
#pragma unroll
            for (int e = 0; e < S::kElems; ++e) {
                const float other = __shfl_xor_sync(0xffffffffu, state.acc[r][e], offset);
                state.acc[r][e] = state.acc[r][e] * mine + other * theirs;
            }
            state.running_max[r] = new_max;
        }
    }
}

// Merges the warps through shared memory; writes the output (one split) or this split's partial result.
template <int DT, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void merge_warps(const Softmax<ROWS, Shape<DT, HEAD_DIM, ROWS>::kElems>& state,
                                            void* __restrict__ out, float* work_partial, const Work& w) {
    typedef Shape<DT, HEAD_DIM, ROWS> S;
    __shared__ float warp_max[kWarps][ROWS];
    __shared__ float warp_sum[kWarps][ROWS];
    __shared__ float warp_acc[kWarps][ROWS][HEAD_DIM];
    __shared__ unsigned warp_missing[kWarps];
    if (w.group == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int v = 0; v < S::kVectorsPerLane; ++v) {
#pragma unroll
                for (int e = 0; e < S::kVectorElems; ++e) {
                    warp_acc[w.warp][r][(v * S::kLanes + w.sub) * S::kVectorElems + e] =
                        state.acc[r][v * S::kVectorElems + e];
                }
            }
        }
    }
    if (w.lane == 0) {
        warp_missing[w.warp] = state.missing;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            warp_max[w.warp][r] = state.running_max[r];
            warp_sum[w.warp][r] = state.running_sum[r];
        }
    }
    __syncthreads();
    unsigned cta_missing = 0;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {
        cta_missing |= warp_missing[v];
    }
    for (int index = threadIdx.x; index < ROWS * HEAD_DIM; index += kThreads) {
        const int r = index / HEAD_DIM;
        const int dim = index % HEAD_DIM;
        float cta_max = minus_infinity();
#pragma unroll
        for (int v = 0; v < kWarps; ++v) {
            cta_max = fmaxf(cta_max, warp_max[v][r]);
        }
        float sum = 0.0f;
        float total = 0.0f;
#pragma unroll
        for (int v = 0; v < kWarps; ++v) {
            const float factor = rescale(warp_max[v][r], cta_max);
            sum += warp_sum[v][r] * factor;
            total += warp_acc[v][r][dim] * factor;
        }
        if ((cta_missing >> r) & 1u) {
            sum = __int_as_float(0x7fc00000);  // NaN: a visible key had no page
        }
        if (w.num_splits == 1) {
            if (r < w.rows_here) {
                const i64 start =
                    row_start_of<HEAD_DIM>(w.first_token, w.first_row + r, w.group_size, w.num_heads, w.kv_head);
                S::E::store(out, start + dim, total / sum);
            }
        } else {
            float* mine = work_partial + w.split * S::kSplitFloats;
            mine[r * HEAD_DIM + dim] = total;
            if (dim == 0) {
                mine[ROWS * HEAD_DIM + 2 * r] = cta_max;
                mine[ROWS * HEAD_DIM + 2 * r + 1] = sum;
            }
        }
    }
}

// One CTA's work: its rows, its chunk of their keys (load query, then per warp step load keys, score, online
// softmax), then the merges of lane groups, warps and (with split-K) splits.
template <int DT, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void attend(const void* __restrict__ query, void* __restrict__ out, u64 key_base,
                                       u64 value_base, i64 page_stride, int num_key_pages, int num_value_pages,
                                       const int* __restrict__ key_table, const int* __restrict__ value_table,
                                       int table_width, const int* __restrict__ kv_page_offset,
                                       const int* __restrict__ query_start, const int* __restrict__ positions,
                                       int num_heads, int num_kv_heads, int tokens_per_block, int expansion,
                                       int window, int num_sink_tokens, float scale_log2, int tiles_per_seq,
                                       float* __restrict__ partial, unsigned* __restrict__ counters) {
    typedef Shape<DT, HEAD_DIM, ROWS> S;
    Work w;
    w.lane = threadIdx.x & 31;
    w.warp = threadIdx.x >> 5;
    w.group = w.lane / S::kLanes;
    w.sub = w.lane % S::kLanes;
    // kv heads vary fastest over CTAs, so the CTAs reading the kv heads of the same tokens run side by side
    // and together read whole token rows of a page.
    w.item = blockIdx.x;
    w.kv_head = w.item % num_kv_heads;
    w.seq = w.item / num_kv_heads / tiles_per_seq;
    const int tile = w.item / num_kv_heads % tiles_per_seq;
    w.split = blockIdx.y;
    w.num_splits = gridDim.y;
    w.num_heads = num_heads;
    w.group_size = num_heads / num_kv_heads;
    w.first_token = query_start[w.seq];
    const int num_rows = (query_start[w.seq + 1] - w.first_token) * w.group_size;
    w.first_row = tile * ROWS;
    if (w.first_row >= num_rows) {
        return;  // the whole CTA (and every split of this tile) leaves together
    }
    w.rows_here = min(ROWS, num_rows - w.first_row);

    // Rows: (token, head) pairs; position -1 marks a padding row that sees no key.
    int position[ROWS];
    int lowest = 0x7fffffff;
    int highest = -1;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        position[r] = -1;
        if (r < w.rows_here) {
            position[r] = positions[w.first_token + (w.first_row + r) / w.group_size];
            lowest = min(lowest, position[r]);
            highest = max(highest, position[r]);
        }
    }
    const int window_begin = window > 0 ? max(0, lowest - window + 1) : 0;
    const int sink_end = window > 0 ? min(num_sink_tokens, window_begin) : 0;
    const int num_keys = max(0, sink_end + highest - window_begin + 1);
    const int chunk = ((num_keys + w.num_splits - 1) / w.num_splits + S::kBatch - 1) / S::kBatch * S::kBatch;
    const int key_begin = min(num_keys, w.split * chunk);
    const int key_end = min(num_keys, key_begin + chunk);

    float q[ROWS][S::kElems];
    load_query<DT, HEAD_DIM, ROWS>(q, query, w, scale_log2);

    PageLookup pages;
    pages.key_table = key_table + static_cast<i64>(w.seq) * table_width;
    pages.value_table = value_table + static_cast<i64>(w.seq) * table_width;
    pages.table_width = table_width;
    pages.tokens_per_page = tokens_per_block / expansion;
    pages.sink_pages = (num_sink_tokens + tokens_per_block - 1) / tokens_per_block * expansion;
    pages.removed_pages = kv_page_offset[w.seq] * expansion;
    pages.num_key_pages = num_key_pages;
    pages.num_value_pages = num_value_pages;
    pages.page_stride = page_stride;
    pages.token_bytes = static_cast<i64>(num_kv_heads) * HEAD_DIM * S::E::kBytes;
    pages.row_offset = static_cast<i64>(w.kv_head) * HEAD_DIM * S::E::kBytes + w.sub * kVectorBytes;
    const char* key_bytes = reinterpret_cast<const char*>(key_base);
    const char* value_bytes = reinterpret_cast<const char*>(value_base);

    Softmax<ROWS, S::kElems> state;
    state.reset();
    constexpr int kStride = kWarps * S::kBatch;
    int step = key_begin + w.warp * S::kBatch;
    KeyBatch<S::kUnroll, S::kVectorsPerLane> keys;
    if (S::kPrefetch && step < key_end) {
        load_keys<DT, HEAD_DIM, ROWS>(keys, step, key_end, sink_end, window_begin, pages, key_bytes, value_bytes, w);
    }
    for (; step < key_end; step += kStride) {
        KeyBatch<S::kUnroll, S::kVectorsPerLane> next;
        if (!S::kPrefetch) {
            load_keys<DT, HEAD_DIM, ROWS>(keys, step, key_end, sink_end, window_begin, pages, key_bytes, value_bytes,
                                          w);
        } else if (step + kStride < key_end) {
            load_keys<DT, HEAD_DIM, ROWS>(next, step + kStride, key_end, sink_end, window_begin, pages, key_bytes,
                                          value_bytes, w);
        }
        float score[S::kUnroll][ROWS];
        scores<DT, HEAD_DIM, ROWS>(score, q, keys);
        online_softmax<DT, HEAD_DIM, ROWS>(state, score, keys, position, window, num_sink_tokens);
        if (S::kPrefetch) {
            keys = next;
        }
    }

    merge_lane_groups<DT, HEAD_DIM, ROWS>(state);
    float* work_partial = partial + static_cast<i64>(w.item) * w.num_splits * S::kSplitFloats;
    merge_warps<DT, HEAD_DIM, ROWS>(state, out, work_partial, w);
    if (w.num_splits == 1) {
        return;
    }
    __shared__ float split_weight[kMaxSplits * ROWS];
    merge_splits<DT, HEAD_DIM, ROWS, kWarps, S::kSplitFloats>(split_weight, out, work_partial, counters, w);
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
