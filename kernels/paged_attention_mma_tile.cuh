// The tensor-core kernel's building blocks (paged_attention_mma.cu describes the work and its layout): the
// variant's shape, the CTA's rows and key range, the cp.async loads of one key tile, and the per-tile products
// S = Q K^T and O += P V with their online softmax.

#pragma once

#include "paged_attention_common.cuh"
#ifdef __CUDACC__
#include "paged_attention_mma_ptx.cuh"  // (on the CPU, kernels/paged_attention_cpu.cuh defines these)
#endif

namespace attention {
namespace mma {

constexpr int kMinWarps = 4;  // CTAs of 16 or 64 rows: 4 warps; of 128 rows: one warp per 16-row tile (8)
constexpr int kMaxSharedBytes = 232448;  // dynamic + static shared memory one CTA may have on sm_90 (227 KiB)
constexpr int kPad = 8;        // elements after each shared row: conflict-free ldmatrix (rows start 16 bytes apart)
constexpr int kMaxSplits = 64;  // split-K factor limit (the launcher's MMA_MAX_SPLITS)
constexpr int kOutOfRange = -1;  // key_meta: not a key of this CTA; <= -2: -(position + 2) of a key without a page

// CTAs per SM the registers must leave room for (__launch_bounds__): three decode CTAs (168 registers a thread)
// keep three 32 KiB K/V tiles in flight per SM where two would be left at the compiler's own choice (178); a
// deeper pipeline or larger tiles fit fewer CTAs in shared memory, and asking for more would only cost registers.
__host__ __device__ constexpr int min_ctas_per_sm(int head_dim, int row_warps, int shared_bytes) {
    return row_warps != 1 || head_dim > 128 ? 1 : (kMaxSharedBytes / (shared_bytes + 1024) >= 3 ? 3 : 1);
}

template <int DT, int HEAD_DIM, int ROW_WARPS, int STAGES, int TILE_KEYS>
struct MmaShape {
    static constexpr bool kBF16 = DT == kBFloat16;
    static constexpr int kWarps = ROW_WARPS > kMinWarps ? ROW_WARPS : kMinWarps;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kKeyWarps = kWarps / ROW_WARPS;   // warps splitting each tile's keys
    static constexpr int kRows = 16 * ROW_WARPS;           // query rows per CTA
    static constexpr int kTileKeys = TILE_KEYS;            // keys per shared-memory stage
    static constexpr int kStages = STAGES;                 // stages of the cp.async pipeline
    static constexpr int kWarpKeys = kTileKeys / kKeyWarps;  // keys of a tile one warp multiplies
    static constexpr int kKeyTiles = kWarpKeys / 8;        // n-tiles of S per warp
    static constexpr int kDimSteps = HEAD_DIM / 16;        // k-steps of Q K^T
    static constexpr int kDimTiles = HEAD_DIM / 8;         // n-tiles of O
    static constexpr int kRowElems = HEAD_DIM + kPad;      // shared row stride in elements
    static constexpr int kChunks = HEAD_DIM / 8;           // 16-byte pieces of one K or V row
    static constexpr int kMatrixBytes = kTileKeys * kRowElems * 2;  // one stage's K (or V)
    static constexpr int kSharedBytes = kStages * 2 * kMatrixBytes;  // the launcher's mma_shared_bytes
    static constexpr int kSplitFloats = kRows * HEAD_DIM + (2 * kRows + 3) / 4 * 4;
    static_assert(ROW_WARPS == 1 || ROW_WARPS == 2 || ROW_WARPS == 4 || ROW_WARPS == 8,
                  "4 warps (row tiles x key slices) or 8 row tiles sharing each whole key tile");
    static_assert(kWarpKeys % 16 == 0, "P V needs whole 16-key steps");
    static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 stages");
    static_assert(kSharedBytes + STAGES * TILE_KEYS * 4 <= kMaxSharedBytes, "the stages fit in shared memory");
    static_assert(HEAD_DIM % 16 == 0 && kThreads % kChunks == 0 && kTileKeys % (kThreads / kChunks) == 0,
                  "head_dim must split into whole 16-byte pieces over the CTA");
    static_assert(kWarps * 16 * (HEAD_DIM + 2) * 4 + kWarps * 4 <= kSharedBytes, "the key-slice merge fits");
    static_assert(kMaxSplits * kRows * 4 <= kSharedBytes, "the split weights fit");
};

// Which rows this CTA serves and where this warp sits.
struct MmaWork {
    int lane;
    int warp;
    int row_warp;  // this warp's 16-row tile
    int key_warp;  // this warp's slice of each key tile
    int item;
    int kv_head;
    int seq;
    int split;
    int num_splits;
    int group_size;
    int num_heads;
    int first_token;
    int first_row;
    int rows_here;
};

// The key range of the CTA, in key indices: [0, sink_end) are positions, then window_begin + (index - sink_end).
struct KeyRange {
    int sink_end;
    int window_begin;
    int begin;  // this split's keys
    int end;

    __device__ __forceinline__ int position(int index) const {
        return index < sink_end ? index : window_begin + (index - sink_end);
    }
};

// Issues the cp.async copies of one tile of keys into a stage and records each key's position (or why it has
// none) in `meta`, and the tile's number in `missing_tile` when one of its keys has no page. Consecutive threads
// copy consecutive 16-byte pieces of one row, so a warp's pass covers 32 / kChunks keys; each of the warp's keys of
// the tile is looked up once, by one lane, and its pages are shuffled to the lanes that copy it (the lookup, a
// division and two table reads, cost more instructions than the copies when every lane repeated it).
template <int DT, int HEAD_DIM, int ROW_WARPS, int STAGES, int TILE_KEYS>
__device__ __forceinline__ void load_tile(unsigned char* stage, int* meta, int* missing_tile, int tile,
                                          int first_key, const KeyRange& keys, const PageLookup& pages,
                                          const char* key_bytes, const char* value_bytes) {
    typedef MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS> S;
    constexpr int kKeysPerPass = S::kThreads / S::kChunks;  // keys the whole CTA covers in one pass
    constexpr int kWarpPassKeys = 32 / S::kChunks;          // keys one warp covers in one pass
    static_assert(TILE_KEYS / kKeysPerPass * kWarpPassKeys <= 32, "one lane looks up each of the warp's keys");
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    // Lane L looks up key (pass L / kWarpPassKeys, L % kWarpPassKeys of the warp's keys in that pass): the
    // addresses of its K and V rows, or (no page) the pools' starts with the K address's low bit set as the flag
    // (rows are 16-byte aligned), so a pass moves two 64-bit words per key.
    u64 own_key_row = reinterpret_cast<u64>(key_bytes) | 1u;
    u64 own_value_row = reinterpret_cast<u64>(value_bytes);
    if (lane < TILE_KEYS / kKeysPerPass * kWarpPassKeys) {
        const int k = (lane / kWarpPassKeys) * kKeysPerPass + warp * kWarpPassKeys + lane % kWarpPassKeys;
        const int index = first_key + k;
        const bool in_range = index < keys.end;
        const int position = keys.position(index);
        i64 key_offset = 0;
        i64 value_offset = 0;
        const bool found = in_range && pages.find(position, key_offset, value_offset);
        if (found) {
            own_key_row = reinterpret_cast<u64>(key_bytes + key_offset);
            own_value_row = reinterpret_cast<u64>(value_bytes + value_offset);
        }
        meta[k] = !in_range ? kOutOfRange : (found ? position : -(position + 2));
        if (in_range && !found) {
            *missing_tile = tile;  // the stage's tile has a key without a page: no fast path
        }
    }
    const int chunk = threadIdx.x % S::kChunks;
    const unsigned key_target = shared_address(stage) + (threadIdx.x / S::kChunks) * S::kRowElems * 2 + chunk * 16;
#pragma unroll
    for (int pass = 0; pass < TILE_KEYS / kKeysPerPass; ++pass) {
        const int source = pass * kWarpPassKeys + lane / S::kChunks;
        const u64 key_row = __shfl_sync(0xffffffffu, own_key_row, source);
        const u64 value_row = __shfl_sync(0xffffffffu, own_value_row, source);
        const bool found = (key_row & 1u) == 0;
        const unsigned target = key_target + pass * kKeysPerPass * S::kRowElems * 2;
        cp_async_16(target, reinterpret_cast<const char*>(key_row & ~static_cast<u64>(1)) + chunk * 16, found);
        cp_async_16(target + S::kMatrixBytes, reinterpret_cast<const char*>(value_row) + chunk * 16, found);
    }
}

// One warp's online softmax over its 16 rows: this lane holds rows g = lane / 4 and g + 8 (index 0 and 1).
template <int HEAD_DIM>
struct MmaSoftmax {
    float running_max[2];
    float running_sum[2];  // this lane's share (its columns); the quad's lanes are summed at the end
    float acc[HEAD_DIM / 8][4];
    unsigned missing;  // bit h: row g + 8h sees a key without a page
};

// S = Q K^T for the warp's keys of one stage, masked and turned into P (fp32) with the online softmax update.
// `all_visible` (warp-uniform): every row of the warp sees every key of its slice, each with a page, so the
// per-element mask is skipped and the scale folds into the exponent's fma (FlashAttention's non-diagonal tiles).
template <int DT, int HEAD_DIM, int ROW_WARPS, int STAGES, int TILE_KEYS>
__device__ __forceinline__ void score_tile(float (&s)[MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>::kKeyTiles][4],
                                           const unsigned (&q)[HEAD_DIM / 16][4], const unsigned char* key_stage,
                                           const int* meta, const int (&row_position)[2], int window,
                                           int num_sink_tokens, float scale_log2, bool all_visible,
                                           MmaSoftmax<HEAD_DIM>& state, const MmaWork& w) {
    typedef MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS> S;
    const unsigned short* k_rows = reinterpret_cast<const unsigned short*>(key_stage);
    const int first = w.key_warp * S::kWarpKeys;
    const int matrix = w.lane / 8;
#pragma unroll
    for (int n = 0; n < S::kKeyTiles; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    }
#pragma unroll
    for (int n = 0; n < S::kKeyTiles; n += 2) {
        // matrices: (keys +0, dims +0), (keys +0, dims +8), (keys +8, dims +0), (keys +8, dims +8)
        const unsigned row = shared_address(k_rows + (first + n * 8 + w.lane % 8 + 8 * (matrix / 2)) * S::kRowElems +
                                            8 * (matrix % 2));
#pragma unroll
        for (int d = 0; d < S::kDimSteps; ++d) {
            unsigned b[4];
            ldmatrix_x4(b, row + d * 32);  // 16 elements further
            mma_m16n8k16<S::kBF16>(s[n], q[d], b[0], b[1]);
            mma_m16n8k16<S::kBF16>(s[n + 1], q[d], b[2], b[3]);
        }
    }
    float tile_max[2] = {minus_infinity(), minus_infinity()};
    if (all_visible) {
#pragma unroll
        for (int n = 0; n < S::kKeyTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < S::kKeyTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e / 2;
                const int code = meta[first + n * 8 + (w.lane % 4) * 2 + (e & 1)];
                const int key = code >= 0 ? code : -(code + 2);
                const int rp = row_position[h];
                const bool visible = code != kOutOfRange && key <= rp &&
                                     (window <= 0 || key > rp - window || key < num_sink_tokens);
                if (visible && code < 0) {
                    state.missing |= 1u << h;
                }
                s[n][e] = visible && code >= 0 ? s[n][e] * scale_log2 : minus_infinity();
                tile_max[h] = fmaxf(tile_max[h], s[n][e]);
            }
        }
    }
    float correction[2];
    bool grew = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        if (all_visible) {
            tile_max[h] *= scale_log2;  // the scale is positive: the largest raw score is the largest scaled one
        }
        const float new_max = fmaxf(state.running_max[h], tile_max[h]);
        grew = grew || new_max > state.running_max[h];
        correction[h] = rescale(state.running_max[h], new_max);
        state.running_max[h] = new_max;
        state.running_sum[h] *= correction[h];
    }
    // A row whose maximum did not grow has correction 1 (or 0 times an accumulator still 0): the accumulators
    // change only where some row's maximum grew, which after a sequence's first tiles is rare.
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int t = 0; t < S::kDimTiles; ++t) {
                state.acc[t][2 * h] *= correction[h];
                state.acc[t][2 * h + 1] *= correction[h];
            }
        }
    }
    // Two loops, not one test per element: the compiler does not take a warp-uniform test out of the loop.
    if (all_visible) {
#pragma unroll
        for (int n = 0; n < S::kKeyTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2_approx(fmaf(s[n][e], scale_log2, -state.running_max[e / 2]));
                state.running_sum[e / 2] += s[n][e];
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < S::kKeyTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                // (a row that has seen no key yet keeps -inf as its maximum: -inf - -inf would be NaN)
                s[n][e] = s[n][e] == minus_infinity() ? 0.0f : exp2_approx(s[n][e] - state.running_max[e / 2]);
                state.running_sum[e / 2] += s[n][e];
            }
        }
    }
}

// O += P V for the warp's keys of one stage; P's accumulator fragments become the A fragments directly.
template <int DT, int HEAD_DIM, int ROW_WARPS, int STAGES, int TILE_KEYS>
__device__ __forceinline__ void accumulate_tile(const float (&p)[MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS>::kKeyTiles][4],
                                                const unsigned char* value_stage, MmaSoftmax<HEAD_DIM>& state,
                                                const MmaWork& w) {
    typedef MmaShape<DT, HEAD_DIM, ROW_WARPS, STAGES, TILE_KEYS> S;
    const unsigned short* v_rows = reinterpret_cast<const unsigned short*>(value_stage);
    const int matrix = w.lane / 8;
#pragma unroll
    for (int k = 0; k < S::kWarpKeys / 16; ++k) {
        unsigned a[4];
        a[0] = pack_pair<S::kBF16>(p[2 * k][0], p[2 * k][1]);
        a[1] = pack_pair<S::kBF16>(p[2 * k][2], p[2 * k][3]);
        a[2] = pack_pair<S::kBF16>(p[2 * k + 1][0], p[2 * k + 1][1]);
        a[3] = pack_pair<S::kBF16>(p[2 * k + 1][2], p[2 * k + 1][3]);
        // matrices: (keys +0, dims +0), (keys +8, dims +0), (keys +0, dims +8), (keys +8, dims +8), transposed
        const unsigned row = shared_address(
            v_rows + (w.key_warp * S::kWarpKeys + k * 16 + w.lane % 8 + 8 * (matrix % 2)) * S::kRowElems +
            8 * (matrix / 2));
#pragma unroll
        for (int t = 0; t < S::kDimTiles; t += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, row + t * 16);  // 8 elements further
            mma_m16n8k16<S::kBF16>(state.acc[t], a, b[0], b[1]);
            mma_m16n8k16<S::kBF16>(state.acc[t + 1], a, b[2], b[3]);
        }
    }
}

// The A fragments of this warp's 16 query rows (zeros for padding rows), unscaled.
template <int DT, int HEAD_DIM, int ROW_WARPS, int STAGES, int TILE_KEYS>
__device__ __forceinline__ void load_query_fragments(unsigned (&q)[HEAD_DIM / 16][4], const void* __restrict__ query,
                                                     const MmaWork& w) {
    const unsigned* words = reinterpret_cast<const unsigned*>(query);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = w.row_warp * 16 + w.lane / 4 + 8 * h;
        const bool real = row < w.rows_here;
        const i64 start = real ? row_start_of<HEAD_DIM>(w.first_token, w.first_row + row, w.group_size,
                                                        w.num_heads, w.kv_head)
                               : 0;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 16; ++d) {
            const i64 column = d * 16 + (w.lane % 4) * 2;
            q[d][h] = real ? words[(start + column) / 2] : 0u;
            q[d][2 + h] = real ? words[(start + column + 8) / 2] : 0u;
        }
    }
}

}  // namespace mma
}  // namespace attention
