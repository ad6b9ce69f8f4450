// Page-table conversion on the device (SPEC §1.1, §3, §9.3): the base page tables and scratch descriptors of a whole
// batch -> one page table per (layer, role) converter, in one launch and without a Python loop per layer.
// Exactly the mapping of PageIndexConverter.__call__ (kv_cache_manager_v2/_addressing.py):
//   block o of sequence s, converter c (scale, expansion, layer_offset, ppb, k, mode):
//     o in [scratch_beg, scratch_end) and mode PER_LAYER:  t = (o - scratch_beg) * ppb + k,
//                                                          index = scratch_slots[s][t / scale] * scale + t % scale
//     otherwise, base = base_tables[s][o]:  index = base * scale (+ layer_offset in PER_LAYER mode), -1 if base < 0
//   out[c][s][o * expansion + j] = index * expansion + j  (j < expansion), -1 where index is -1.
// Example: scale 4, offset 1, expansion 2, PER_LAYER: base [3, -1] -> [26, 27, -1, -1].
// Entries at or past num_blocks[s] * expansion are -1, as are a scratch block whose slot is missing and an index
// past int32 (the NumPy twin rejects such input). NumPy twin and launcher: kv_cache_manager_v2/kernels/page_table.py.

// Columns of the converter parameter table, in the order of page_table.converter_params().
enum ConverterParam {
    PARAM_SCALE = 0,
    PARAM_EXPANSION = 1,
    PARAM_LAYER_OFFSET = 2,
    PARAM_PAGES_PER_BLOCK = 3,
    PARAM_PAGE_IN_BLOCK = 4,
    PARAM_MODE = 5,  // PageIndexMode value: 0 SHARED, 1 PER_LAYER
    NUM_PARAMS = 6,
};

enum { MODE_PER_LAYER = 1 };

// out: [num_converters, num_seqs, out_width]; base_tables: [num_seqs, max_blocks]; num_blocks: [num_seqs];
// scratch_ranges: [num_seqs, 2] (beg, end); scratch_slots: [num_seqs, max_scratch_slots]; params: [num_converters,
// NUM_PARAMS]. One thread per output entry, grid-stride.
extern "C" __global__ void convert_page_tables(int* out, const int* base_tables, const int* num_blocks,
                                               const int* scratch_ranges, const int* scratch_slots, const int* params,
                                               int num_converters, int num_seqs, int max_blocks, int max_scratch_slots,
                                               int out_width) {
    const long long total = (long long)num_converters * num_seqs * out_width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long column = i % out_width;
        const long long seq = (i / out_width) % num_seqs;
        const int* param = params + (i / out_width / num_seqs) * NUM_PARAMS;
        const long long scale = param[PARAM_SCALE];
        const long long expansion = param[PARAM_EXPANSION];
        const bool per_layer = param[PARAM_MODE] == MODE_PER_LAYER;
        const long long block = column / expansion;
        long long index = -1;
        if (block < num_blocks[seq] && block < max_blocks) {
            const long long scratch_beg = scratch_ranges[2 * seq];
            const long long scratch_end = scratch_ranges[2 * seq + 1];
            if (per_layer && scratch_beg <= block && block < scratch_end) {
                const long long t = (block - scratch_beg) * param[PARAM_PAGES_PER_BLOCK] + param[PARAM_PAGE_IN_BLOCK];
                const long long position = t / scale;
                const long long slot =
                    position < max_scratch_slots ? scratch_slots[seq * max_scratch_slots + position] : -1;
                index = slot < 0 ? -1 : slot * scale + t % scale;
            } else {
                const long long base = base_tables[seq * max_blocks + block];
                index = base < 0 ? -1 : base * scale + (per_layer ? param[PARAM_LAYER_OFFSET] : 0);
            }
        }
        // An index whose expanded entries do not fit int32 (a device base index the host could not check) is "no
        // page", never a wrapped index of another page: (index + 1) * expansion <= 2^31.
        const bool fits = index >= 0 && index < 2147483648LL / expansion;
        out[i] = fits ? (int)(index * expansion + column % expansion) : -1;
    }
}
