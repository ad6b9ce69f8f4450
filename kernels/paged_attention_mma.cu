// Paged attention on tensor cores (fp16 / bf16; issue #42). Same inputs, outputs, visibility rules and split-K
// workspace as paged_attention.cu (read its header for the memory layout and the tables); fp32 stays there.
// Launcher: kv_cache_manager_v2/kernels/attention.py (paged_attention_cuda picks this kernel for fp16/bf16).
//
// Work. A CTA serves kRows = 16 * ROW_WARPS query rows (token, head) of one sequence that share one kv head,
// heads fastest: decode packs a token's GQA group into the 16 rows of one mma tile (padding rows see no key),
// prefill packs 4 tiles of consecutive tokens x heads (4 warps) or 8 tiles (8 warps, FlashAttention-2's 128-row
// CTA: each K/V tile in shared memory serves twice the rows, halving K/V traffic per FLOP from L2). The CTA's
// keys (sink run, then window run, as in paged_attention.cu) go through shared memory in tiles of TILE_KEYS: one
// lane per key of a warp looks its pages up and shuffles the row addresses to the lanes that copy the row, and
// every thread issues cp.async copies of 16-byte pieces of K and V rows (zero-filled where a key is out of range
// or has no page) into a pipeline of STAGES tiles, so the next STAGES - 1 tiles stream in while one is multiplied
// (the template parameters are launch-time variants: kv_cache_manager_v2/kernels/attention_variants.py). The
// warps are ROW_WARPS row tiles x kKeyWarps key slices: warp (row tile, slice) multiplies its 16 rows with its
// slice's keys of each tile,
// S = Q K^T and O += P V with mma.sync m16n8k16 (fp32 accumulation; ldmatrix reads K, ldmatrix.trans reads V),
// and keeps a FlashAttention-2 online softmax of its rows in registers. Key slices merge through shared memory,
// splits (split-K over the keys, as in paged_attention.cu) through `partial` in the last CTA of the item.
// Scores are scaled by scale_log2 = softmax_scale * log2(e) after the product so ex2.approx does the exponentials; a
// warp whose rows see every key of its slice of a tile (each with a page) skips the mask and folds the scale into
// the exponent's fma, so only the tiles on the causal diagonal, a window's edge or the range's end pay the mask;
// a warp none of whose rows sees a key of its slice (above the diagonal, before the window) skips the slice, and
// the accumulators are rescaled only when some row's running maximum grew.
// Instruction count decides the speed here (two warps per scheduler; see the stop note of 2026-11-27's second
// session): the per-key page lookup, 64-bit shared addresses and exp2f's denormal handling once cost more issue
// slots than the mma and ldmatrix; `cuobjdump -sass` of an NVRTC cubin shows the loop without a GPU.
//
// The tensor-core primitives (mma, ldmatrix, cp.async, ex2.approx, fp32 pair packing) are inline PTX here and emulated
// lane by lane by kernels/paged_attention_cpu.cuh, so tests run this file on the CPU against the NumPy twin.

#include "paged_attention_mma_tile.cuh"

namespace attention {
namespace mma {

// Merges the key slices of each row tile through shared memory; writes the output (one split) or this split's
// partial result (the layout paged_attention.cu uses, with kRows rows).
template <int DT, int HEAD_DIM, int ROW_WARPS, int STAGES, int TILE_KEYS>
__device__ __forceinline__ void merge_key_warps(MmaSoftmax<HEAD_DIM>& state, unsigned char* shared,
                                                void* __restrict__ out, float* work_partial, const MmaWork& w) {
    typedef MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS> S;
    float* warp_acc = reinterpret_cast<float*>(shared);          // [kWarps][16][HEAD_DIM]
    float* warp_max = warp_acc + S::kWarps * 16 * HEAD_DIM;      // [kWarps][16]
    float* warp_sum = warp_max + S::kWarps * 16;                 // [kWarps][16]
    unsigned* warp_missing = reinterpret_cast<unsigned*>(warp_sum + S::kWarps * 16);  // [kWarps]: bit per row
    const int g = w.lane / 4;
    unsigned missing = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        state.running_sum[h] += __shfl_xor_sync(0xffffffffu, state.running_sum[h], 1);
        state.running_sum[h] += __shfl_xor_sync(0xffffffffu, state.running_sum[h], 2);
        if ((state.missing >> h) & 1u) {
            missing |= 1u << (g + 8 * h);
        }
    }
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        missing |= __shfl_xor_sync(0xffffffffu, missing, offset);
    }
#pragma unroll
    for (int t = 0; t < S::kDimTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e / 2);
            warp_acc[(w.warp * 16 + row) * HEAD_DIM + t * 8 + (w.lane % 4) * 2 + (e & 1)] = state.acc[t][e];
        }
    }
    if (w.lane % 4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            warp_max[w.warp * 16 + g + 8 * h] = state.running_max[h];
            warp_sum[w.warp * 16 + g + 8 * h] = state.running_sum[h];
        }
    }
    if (w.lane == 0) {
        warp_missing[w.warp] = missing;
    }
    __syncthreads();
    for (int index = threadIdx.x; index < S::kRows * HEAD_DIM; index += S::kThreads) {
        const int r = index / HEAD_DIM;
        const int dim = index % HEAD_DIM;
        const int first_warp = (r / 16) * S::kKeyWarps;
        const int in_tile = r % 16;
        float row_max = minus_infinity();
        bool row_missing = false;
#pragma unroll
        for (int k = 0; k < S::kKeyWarps; ++k) {
            row_max = fmaxf(row_max, warp_max[(first_warp + k) * 16 + in_tile]);
            row_missing = row_missing || ((warp_missing[first_warp + k] >> in_tile) & 1u);
        }
        float sum = 0.0f;
        float total = 0.0f;
#pragma unroll
        for (int k = 0; k < S::kKeyWarps; ++k) {
            const int slot = (first_warp + k) * 16 + in_tile;
            const float factor = rescale(warp_max[slot], row_max);
            sum += warp_sum[slot] * factor;
            total += warp_acc[slot * HEAD_DIM + dim] * factor;
        }
        if (row_missing) {
            sum = __int_as_float(0x7fc00000);  // NaN: a visible key had no page
        }
        if (w.num_splits == 1) {
            if (r < w.rows_here) {
                const i64 start =
                    row_start_of<HEAD_DIM>(w.first_token, w.first_row + r, w.group_size, w.num_heads, w.kv_head);
                Element<DT>::store(out, start + dim, total / sum);
            }
        } else {
            float* mine = work_partial + w.split * S::kSplitFloats;
            mine[r * HEAD_DIM + dim] = total;
            if (dim == 0) {
                mine[S::kRows * HEAD_DIM + 2 * r] = row_max;
                mine[S::kRows * HEAD_DIM + 2 * r + 1] = sum;
            }
        }
    }
}

// One CTA: its rows and key range, the pipelined tile loop, then the merges.
template <int DT, int HEAD_DIM, int ROW_WARPS, int STAGES, int TILE_KEYS>
__device__ __forceinline__ void attend(const void* __restrict__ query, void* __restrict__ out, u64 key_base,
                                       u64 value_base, i64 page_stride, int num_key_pages, int num_value_pages,
                                       const int* __restrict__ key_table, const int* __restrict__ value_table,
                                       int table_width, const int* __restrict__ kv_page_offset,
                                       const int* __restrict__ query_start, const int* __restrict__ positions,
                                       int num_heads, int num_kv_heads, int tokens_per_block, int expansion,
                                       int window, int num_sink_tokens, float scale_log2, int tiles_per_seq,
                                       float* __restrict__ partial, unsigned* __restrict__ counters) {
    typedef MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS> S;
    PAGED_ATTENTION_DYNAMIC_SHARED(shared);
    __shared__ int key_meta[STAGES][TILE_KEYS];
    __shared__ int missing_tile[STAGES];  // the last tile loaded into a stage that had a key without a page
    MmaWork w;
    w.lane = threadIdx.x & 31;
    w.warp = threadIdx.x >> 5;
    w.row_warp = w.warp / S::kKeyWarps;
    w.key_warp = w.warp % S::kKeyWarps;
    w.item = blockIdx.x;
    // Row tiles slowest and last tile first: causal tiles late in a chunk see the most keys, so the longest CTAs
    // start in the first wave instead of trailing alone at the end (decode has one tile per sequence).
    const int num_seqs = gridDim.x / (num_kv_heads * tiles_per_seq);
    w.kv_head = w.item % num_kv_heads;
    w.seq = w.item / num_kv_heads % num_seqs;
    const int tile = tiles_per_seq - 1 - w.item / num_kv_heads / num_seqs;
    w.split = blockIdx.y;
    w.num_splits = gridDim.y;
    w.num_heads = num_heads;
    w.group_size = num_heads / num_kv_heads;
    w.first_token = query_start[w.seq];
    const int num_rows = (query_start[w.seq + 1] - w.first_token) * w.group_size;
    w.first_row = tile * S::kRows;
    if (w.first_row >= num_rows) {
        return;  // the whole CTA (and every split of this tile) leaves together
    }
    w.rows_here = min(S::kRows, num_rows - w.first_row);

    int lowest = 0x7fffffff;
    int highest = -1;
    for (int token = w.first_row / w.group_size; token <= (w.first_row + w.rows_here - 1) / w.group_size; ++token) {
        const int position = positions[w.first_token + token];
        lowest = min(lowest, position);
        highest = max(highest, position);
    }
    int row_position[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = w.row_warp * 16 + w.lane / 4 + 8 * h;
        row_position[h] = row < w.rows_here ? positions[w.first_token + (w.first_row + row) / w.group_size] : -1;
    }
    // The lowest and highest position of the warp's real rows (padding rows see nothing and are never stored).
    int warp_lowest = row_position[0] >= 0 ? row_position[0] : 0x7fffffff;
    int warp_highest = max(row_position[0], row_position[1]);
    warp_lowest = row_position[1] >= 0 ? min(warp_lowest, row_position[1]) : warp_lowest;
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
        warp_lowest = min(warp_lowest, __shfl_xor_sync(0xffffffffu, warp_lowest, offset));
        warp_highest = max(warp_highest, __shfl_xor_sync(0xffffffffu, warp_highest, offset));
    }
    KeyRange keys;
    keys.window_begin = window > 0 ? max(0, lowest - window + 1) : 0;
    keys.sink_end = window > 0 ? min(num_sink_tokens, keys.window_begin) : 0;
    const int num_keys = max(0, keys.sink_end + highest - keys.window_begin + 1);
    const int chunk = ((num_keys + w.num_splits - 1) / w.num_splits + TILE_KEYS - 1) / TILE_KEYS * TILE_KEYS;
    keys.begin = min(num_keys, w.split * chunk);
    keys.end = min(num_keys, keys.begin + chunk);

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
    pages.token_bytes = static_cast<i64>(num_kv_heads) * HEAD_DIM * 2;
    pages.row_offset = static_cast<i64>(w.kv_head) * HEAD_DIM * 2;
    const char* key_bytes = reinterpret_cast<const char*>(key_base);
    const char* value_bytes = reinterpret_cast<const char*>(value_base);

    unsigned q[HEAD_DIM / 16][4];
    load_query_fragments<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>(q, query, w);
    MmaSoftmax<HEAD_DIM> state;
    state.missing = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        state.running_max[h] = minus_infinity();
        state.running_sum[h] = 0.0f;
    }
#pragma unroll
    for (int t = 0; t < S::kDimTiles; ++t) {
        state.acc[t][0] = state.acc[t][1] = state.acc[t][2] = state.acc[t][3] = 0.0f;
    }

    // A pipeline of STAGES tiles: tiles i + 1 .. i + STAGES - 1 are in flight while tile i is multiplied. One
    // group is committed per tile slot (possibly empty), so "all but the newest STAGES - 1 groups have landed"
    // always means tile i has.
    const int num_tiles = (keys.end - keys.begin + TILE_KEYS - 1) / TILE_KEYS;
    if (threadIdx.x < STAGES) {
        missing_tile[threadIdx.x] = -1;
    }
    __syncthreads();  // before any load may mark a stage
#pragma unroll
    for (int ahead = 0; ahead < STAGES - 1; ++ahead) {
        if (ahead < num_tiles) {
            load_tile<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>(shared + ahead * 2 * S::kMatrixBytes,
                                                                  key_meta[ahead], missing_tile + ahead, ahead,
                                                                  keys.begin + ahead * TILE_KEYS, keys, pages,
                                                                  key_bytes, value_bytes);
        }
        cp_async_commit();
    }
    for (int i = 0; i < num_tiles; ++i) {
        const int ahead = i + STAGES - 1;
        if (ahead < num_tiles) {
            const int next = ahead % STAGES;  // read in iteration i - 1, which ended with a barrier
            load_tile<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>(shared + next * 2 * S::kMatrixBytes,
                                                                  key_meta[next], missing_tile + next, ahead,
                                                                  keys.begin + ahead * TILE_KEYS, keys, pages,
                                                                  key_bytes, value_bytes);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncthreads();  // every thread's pieces of tile i are in shared memory
        const int stage = i % STAGES;
        const unsigned char* stage_bytes = shared + stage * 2 * S::kMatrixBytes;
        const int slice_first = keys.begin + i * TILE_KEYS + w.key_warp * S::kWarpKeys;
        const int slice_last = slice_first + S::kWarpKeys - 1;
        const bool all_visible = slice_last < keys.end && missing_tile[stage] != i &&
                                 keys.position(slice_last) <= warp_lowest &&
                                 (window <= 0 || keys.position(slice_first) > warp_highest - window);
        // None of the warp's rows sees any key of its slice (past the causal diagonal of its last row, or wholly
        // before the window of its first row and past the sinks): the slice would add nothing, skip its math.
        const int slice_end = min(slice_last + 1, keys.end);
        const bool none_visible =
            slice_first >= slice_end || keys.position(slice_first) > warp_highest ||
            (window > 0 && keys.position(slice_first) >= num_sink_tokens &&
             keys.position(slice_end - 1) <= warp_lowest - window);
        if (!none_visible) {
            float s[S::kKeyTiles][4];
            score_tile<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>(s, q, stage_bytes, key_meta[stage], row_position,
                                                                   window, num_sink_tokens, scale_log2,
                                                                   all_visible, state, w);
            accumulate_tile<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>(s, stage_bytes + S::kMatrixBytes, state, w);
        }
        __syncthreads();  // nobody reads this stage any more: tile i + STAGES may overwrite it
    }
    cp_async_wait<0>();

    float* work_partial = partial + static_cast<i64>(w.item) * w.num_splits * S::kSplitFloats;
    merge_key_warps<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>(state, shared, out, work_partial, w);
    if (w.num_splits == 1) {
        return;
    }
    merge_splits<DT, HEAD_DIM, S::kRows, S::kWarps, S::kSplitFloats>(reinterpret_cast<float*>(shared), out,
                                                                      work_partial, counters, w);
}

}  // namespace mma
}  // namespace attention

// extern "C" entry points with paged_attention.cu's parameter list; launched with MmaShape::kThreads threads and
// MmaShape::kSharedBytes of dynamic shared memory.
#define PAGED_ATTENTION_MMA_ENTRY(NAME, DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS)                              \
    extern "C" __global__ void __launch_bounds__(                                                                \
        attention::mma::MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>::kThreads,                          \
        attention::mma::min_ctas_per_sm(                                                                         \
            HEAD_DIM, ROW_WARPS, attention::mma::MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>::kSharedBytes)) \
        NAME(const void* __restrict__ query, void* __restrict__ out, unsigned long long key_base,                \
             unsigned long long value_base, long long page_stride, int num_key_pages, int num_value_pages,        \
             const int* __restrict__ key_table, const int* __restrict__ value_table, int table_width,            \
             const int* __restrict__ kv_page_offset, const int* __restrict__ query_start,                        \
             const int* __restrict__ positions, int num_heads, int num_kv_heads, int tokens_per_block,           \
             int expansion, int window, int num_sink_tokens, float scale_log2, int tiles_per_seq,                \
             float* __restrict__ partial, unsigned* __restrict__ counters) {                                     \
        attention::mma::attend<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>(                                       \
            query, out, key_base, value_base, page_stride, num_key_pages, num_value_pages, key_table,             \
            value_table, table_width, kv_page_offset, query_start, positions, num_heads, num_kv_heads,            \
            tokens_per_block, expansion, window, num_sink_tokens, scale_log2, tiles_per_seq, partial, counters);  \
    }

#if defined(PAGED_ATTENTION_MMA_DTYPE) && defined(PAGED_ATTENTION_HEAD_DIM) && defined(PAGED_ATTENTION_ROW_WARPS)
// The launcher compiles only the variant it runs -> "paged_attention_mma".
PAGED_ATTENTION_MMA_ENTRY(paged_attention_mma, PAGED_ATTENTION_MMA_DTYPE, PAGED_ATTENTION_HEAD_DIM,
                          PAGED_ATTENTION_ROW_WARPS, PAGED_ATTENTION_MMA_STAGES, PAGED_ATTENTION_MMA_TILE_KEYS)
#elif !defined(PAGED_ATTENTION_NO_ENTRIES)  // (tests on the CPU instantiate the variants they run)
// Every variant the launcher can ask for (attention_variants.py: DECODE_VARIANTS, PREFILL_VARIANTS), named
// paged_attention_mma_<f16|bf16>_d<head_dim>_w<row warps>_s<stages>_k<tile keys> (the CI check).
#define PAGED_ATTENTION_MMA_DECODE(NAME, DT, HEAD_DIM)         \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w1_s2_k64, DT, HEAD_DIM, 1, 2, 64) \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w1_s3_k64, DT, HEAD_DIM, 1, 3, 64)
#define PAGED_ATTENTION_MMA_DECODE_SMALL(NAME, DT, HEAD_DIM)     \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w1_s4_k64, DT, HEAD_DIM, 1, 4, 64)   \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w1_s2_k128, DT, HEAD_DIM, 1, 2, 128)
#define PAGED_ATTENTION_MMA_PREFILL(NAME, DT, HEAD_DIM)        \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w4_s2_k64, DT, HEAD_DIM, 4, 2, 64) \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w4_s3_k64, DT, HEAD_DIM, 4, 3, 64) \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w4_s2_k32, DT, HEAD_DIM, 4, 2, 32) \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w8_s2_k64, DT, HEAD_DIM, 8, 2, 64) \
    PAGED_ATTENTION_MMA_ENTRY(NAME##_w8_s3_k64, DT, HEAD_DIM, 8, 3, 64)
#define PAGED_ATTENTION_MMA_ALL_HEAD_DIMS(NAME, DT)                                                          \
    PAGED_ATTENTION_MMA_DECODE(NAME##_d64, DT, 64) PAGED_ATTENTION_MMA_DECODE_SMALL(NAME##_d64, DT, 64)       \
    PAGED_ATTENTION_MMA_PREFILL(NAME##_d64, DT, 64)                                                           \
    PAGED_ATTENTION_MMA_DECODE(NAME##_d128, DT, 128) PAGED_ATTENTION_MMA_DECODE_SMALL(NAME##_d128, DT, 128)   \
    PAGED_ATTENTION_MMA_PREFILL(NAME##_d128, DT, 128)                                                         \
    PAGED_ATTENTION_MMA_DECODE(NAME##_d256, DT, 256) PAGED_ATTENTION_MMA_PREFILL(NAME##_d256, DT, 256)
PAGED_ATTENTION_MMA_ALL_HEAD_DIMS(paged_attention_mma_f16, attention::kFloat16)
PAGED_ATTENTION_MMA_ALL_HEAD_DIMS(paged_attention_mma_bf16, attention::kBFloat16)
#endif
