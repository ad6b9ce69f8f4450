// SSM snapshot copies (SPEC §5): slot-to-slot copies within one pool, all pairs in one launch. Used when a commit
// snapshots a live state and when the first resume copies a reused snapshot into the cache's private live slot.
// Pairs must not overlap (no slot is both a source and a destination). NumPy twin and launcher:
// kv_cache_manager_v2/kernels/ssm_copy.py.
#include "copy_common.cuh"

using kvcm::byte_t;
using kvcm::i64;

// slot dst_slots[i] <- slot src_slots[i] of the same pool (slots of slot_bytes); a negative id skips the pair.
extern "C" __global__ void ssm_snapshot_copy(byte_t* slots, const int* src_slots, const int* dst_slots,
                                             i64 slot_bytes, int num_pairs) {
    kvcm::copy_row_pairs(slots, dst_slots, slots, src_slots, slot_bytes, num_pairs);
}
