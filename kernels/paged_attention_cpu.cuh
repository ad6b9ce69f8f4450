// CPU emulation of what paged_attention.cu uses, so g++ (C++20) runs the unmodified kernel in tests on machines
// without a GPU (tests/test_attention_cuda_on_cpu.py). Never seen by NVRTC. Include it before the .cu file:
//
//     #include "paged_attention_cpu.cuh"
//     #define PAGED_ATTENTION_NO_ENTRIES
//     #include "paged_attention.cu"
//     PAGED_ATTENTION_ENTRY(attention_f16_d64_r4, attention::kFloat16, 64, 4)
//     CPU_EXPORT(attention_f16_d64_r4)   // -> extern "C" int cpu_attention_f16_d64_r4(gx, gy, gz, bx, void** args)
//
// Unlike kernels/cpu_shim.cuh (threads, no warp intrinsics), the threads of a block run as fibers (ucontext) on
// one OS thread: __syncthreads() and warp shuffles are barriers that switch fibers, which is fast enough for the
// thousands of shuffles attention does and deterministic. Blocks run one after another, so a function-local
// static is per-block __shared__ memory and atomics need no hardware. A barrier that can never complete (a
// divergent shuffle, a thread that left early) makes the launch return 1 instead of hanging.
//
// Never more forgiving than a GPU where that hides a kernel bug: blocks run in a shuffled order when the
// environment variable KVCM_CPU_BLOCK_ORDER_SEED is a non-zero seed (a GPU runs CTAs in any order: which split-K CTA
// finishes last is not fixed); dynamic shared memory is 0xFF bytes (NaN, -1) at every block's start (a GPU's is
// uninitialized, not the previous block's); a cp.async poisons its destination when issued and lands only at the
// cp_async_wait that covers its group; misaligned cp.async or ldmatrix addresses (a GPU fault) make the launch
// return 2. (Static __shared__ arrays keep the previous block's contents: g++ cannot place them anywhere to poison.)
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.cuh"

struct alignas(16) float4 {
    float x, y, z, w;
};

inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

template <typename To, typename From>
inline To cpu_bit_cast(From value) {
    static_assert(sizeof(To) == sizeof(From), "bit casts keep the size");
    To result;
    std::memcpy(&result, &value, sizeof(To));
    return result;
}
inline float __int_as_float(int value) { return cpu_bit_cast<float>(value); }
inline float __uint_as_float(unsigned value) { return cpu_bit_cast<float>(value); }
inline unsigned __float_as_uint(float value) { return cpu_bit_cast<unsigned>(value); }

template <typename T>
inline T __ldg(const T* address) {
    return *address;
}
template <typename T>
inline T __ldcg(const T* address) {
    return *address;
}
inline void __threadfence() {}

template <typename T>
inline T atomicAdd(T* address, T value) {
    const T old = *address;
    *address = old + value;
    return old;
}

namespace cpu {

constexpr std::size_t kStackBytes = 256 * 1024;
constexpr std::size_t kDynamicSharedBytes = 256 * 1024;
alignas(16) inline unsigned char dynamic_shared[kDynamicSharedBytes];

// One 16-byte cp.async: lands (or zero-fills) at the wait that covers its group.
struct PendingCopy {
    void* shared;
    const void* global;
    bool fill;
};

struct Fiber {
    ucontext_t context;
    dim3 thread_idx;
    bool done = false;
    std::vector<char> stack = std::vector<char>(kStackBytes);
    std::vector<PendingCopy> open_group;                // issued, not yet committed
    std::vector<std::vector<PendingCopy>> committed;    // oldest first
};

struct Barrier {
    unsigned participants = 0;
    unsigned arrived = 0;
    unsigned long long generation = 0;
};

inline dim3 block_idx, block_dim, grid_dim;
inline Fiber* current = nullptr;
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline std::vector<Barrier> barriers;  // [0]: the block, [1 + w]: warp w
inline std::vector<unsigned long long> shuffle_slots;
inline std::vector<unsigned long long> fragment_slots;  // per warp: 32 lanes x kFragmentWords (mma, ldmatrix)
constexpr unsigned kFragmentWords = 8;
inline unsigned long long progress = 0;
inline std::function<void()> body;
inline const char* fault_reason = nullptr;  // the first GPU fault of this launch (misaligned address)

inline void fault(const char* reason) {
    if (fault_reason == nullptr) {
        fault_reason = reason;
        std::fprintf(stderr, "paged_attention_cpu: %s (block %u,%u,%u)\n", reason, block_idx.x, block_idx.y, block_idx.z);
    }
}

// The blocks of a grid in the order they run: x fastest, or shuffled by KVCM_CPU_BLOCK_ORDER_SEED.
inline std::vector<dim3> block_order(dim3 grid) {
    std::vector<dim3> order;
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                order.push_back(dim3{bx, by, bz});
            }
        }
    }
    const char* seed = std::getenv("KVCM_CPU_BLOCK_ORDER_SEED");
    if (seed != nullptr && std::strtoull(seed, nullptr, 10) != 0) {
        std::mt19937_64 random(std::strtoull(seed, nullptr, 10));
        std::shuffle(order.begin(), order.end(), random);
    }
    return order;
}

inline void wait(Barrier& barrier) {
    ++progress;
    if (++barrier.arrived == barrier.participants) {
        barrier.arrived = 0;
        ++barrier.generation;
        return;
    }
    const unsigned long long generation = barrier.generation;
    while (barrier.generation == generation) {
        swapcontext(&current->context, &scheduler);
    }
}

inline unsigned linear_thread() {
    const dim3& t = current->thread_idx;
    return t.x + block_dim.x * (t.y + block_dim.y * t.z);
}

inline void run_fiber() {
    body();
    current->done = true;
    ++progress;
}

// Runs every block of kernel<<<grid, block>>>(args...): 0, 1 when a barrier deadlocks, 2 on a fault.
template <typename... Params, typename... Args>
int launch(dim3 grid, dim3 block, void (*kernel)(Params...), Args... args) {
    const unsigned threads = block.x * block.y * block.z;
    const unsigned warps = (threads + 31) / 32;
    fibers.resize(threads);
    barriers.assign(1 + warps, Barrier{});
    barriers[0].participants = threads;
    for (unsigned w = 0; w < warps; ++w) {
        barriers[1 + w].participants = std::min(32u, threads - 32 * w);
    }
    shuffle_slots.assign(32 * warps, 0);
    fragment_slots.assign(32 * warps * kFragmentWords, 0);
    block_dim = block;
    grid_dim = grid;
    body = [&] { kernel(args...); };
    fault_reason = nullptr;
    for (const dim3& index : block_order(grid)) {
        block_idx = index;
        std::memset(dynamic_shared, 0xFF, sizeof(dynamic_shared));
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& fiber = fibers[t];
            fiber.thread_idx = dim3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            fiber.done = false;
            fiber.open_group.clear();
            fiber.committed.clear();
            getcontext(&fiber.context);
            fiber.context.uc_stack.ss_sp = fiber.stack.data();
            fiber.context.uc_stack.ss_size = fiber.stack.size();
            fiber.context.uc_link = &scheduler;
            makecontext(&fiber.context, run_fiber, 0);
        }
        for (;;) {
            const unsigned long long before = progress;
            bool all_done = true;
            for (Fiber& fiber : fibers) {
                if (!fiber.done) {
                    current = &fiber;
                    swapcontext(&scheduler, &fiber.context);
                    all_done = all_done && fiber.done;
                }
            }
            if (all_done) {
                break;
            }
            if (progress == before) {
                return 1;
            }
        }
        if (fault_reason != nullptr) {
            return 2;
        }
    }
    return 0;
}

template <typename... Params, std::size_t... I>
int launch_packed(dim3 grid, dim3 block, void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
    return launch(grid, block, kernel, *static_cast<std::remove_cv_t<Params>*>(args[I])...);
}

template <typename... Params>
int launch_packed(dim3 grid, dim3 block, void (*kernel)(Params...), void** args) {
    return launch_packed(grid, block, kernel, args, std::index_sequence_for<Params...>{});
}

}  // namespace cpu

#define threadIdx (cpu::current->thread_idx)
#define blockIdx (cpu::block_idx)
#define blockDim (cpu::block_dim)
#define gridDim (cpu::grid_dim)

inline void __syncthreads() { cpu::wait(cpu::barriers[0]); }

namespace cpu {
// Every lane publishes `value`, then reads the one of lane `source` (both shuffles below).
template <typename T>
inline T shuffle_from(T value, unsigned source) {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "shuffles move at most 8 bytes");
    const unsigned thread = linear_thread();
    const unsigned warp = thread / 32;
    unsigned long long* slots = shuffle_slots.data() + 32 * warp;
    std::memcpy(&slots[thread % 32], &value, sizeof(T));
    wait(barriers[1 + warp]);
    T result;
    std::memcpy(&result, &slots[source % 32], sizeof(T));
    wait(barriers[1 + warp]);
    return result;
}
}  // namespace cpu

template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask) {
    return cpu::shuffle_from(value, (cpu::linear_thread() % 32) ^ static_cast<unsigned>(lane_mask));
}

template <typename T>
inline T __shfl_sync(unsigned, T value, int source_lane) {
    return cpu::shuffle_from(value, static_cast<unsigned>(source_lane));
}

inline bool __any_sync(unsigned, bool predicate) {
    const unsigned thread = cpu::linear_thread();
    const unsigned warp = thread / 32;
    unsigned long long* slots = cpu::shuffle_slots.data() + 32 * warp;
    slots[thread % 32] = predicate ? 1u : 0u;
    cpu::wait(cpu::barriers[1 + warp]);
    bool any = false;
    for (unsigned lane = 0; lane < 32; ++lane) {
        any = any || slots[lane] != 0;
    }
    cpu::wait(cpu::barriers[1 + warp]);
    return any;
}

#define CPU_EXPORT(kernel)                                                                                 \
    extern "C" int cpu_##kernel(unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** args) {        \
        return cpu::launch_packed(dim3{gx, gy, gz}, dim3{bx, 1, 1}, kernel, args);                        \
    }

// ---- Tensor-core primitives of paged_attention_mma.cu, emulated lane by lane from the PTX ISA's fragment layouts
// (g = lane / 4, t = lane % 4). Each warp-wide operation publishes every lane's operands in the warp's fragment
// slots, meets at the warp barrier, computes this lane's own results, and meets again before the slots are reused.
#define PAGED_ATTENTION_DYNAMIC_SHARED(name) unsigned char* const name = cpu::dynamic_shared

namespace cpu {

inline bool aligned_16(const void* address) { return reinterpret_cast<std::uintptr_t>(address) % 16 == 0; }

inline void land(const PendingCopy& copy) {
    if (copy.fill) {
        std::memcpy(copy.shared, copy.global, 16);
    } else {
        std::memset(copy.shared, 0, 16);
    }
}

inline unsigned long long* warp_fragments() {
    return fragment_slots.data() + (linear_thread() / 32) * 32 * kFragmentWords;
}

inline void warp_barrier() { wait(barriers[1 + linear_thread() / 32]); }

inline float element_to_float(unsigned short bits, bool bf16) {
    return bf16 ? cpu_bit_cast<float>(static_cast<unsigned>(bits) << 16)
                : static_cast<float>(cpu_bit_cast<_Float16>(bits));
}

// Element `index` (0 = low half) of a register of two 16-bit elements.
inline unsigned short half_of(unsigned long long word, int index) {
    return static_cast<unsigned short>(word >> (16 * index));
}

}  // namespace cpu

namespace attention {
namespace mma {

// m16n8k16, A row-major 16x16 in 4 registers: a0 (row g, cols 2t, 2t+1), a1 (row g+8, same cols), a2 (row g,
// cols 2t+8, 2t+9), a3 (row g+8, cols 2t+8, 2t+9). B 16x8 (k x n) in 2 registers: b0 (rows 2t, 2t+1, col g),
// b1 (rows 2t+8, 2t+9, col g). C/D fp32 16x8: d0, d1 (row g, cols 2t, 2t+1), d2, d3 (row g+8, same cols).
template <bool BF16>
inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    const unsigned lane = cpu::linear_thread() % 32;
    unsigned long long* slots = cpu::warp_fragments();
    unsigned long long* mine = slots + lane * cpu::kFragmentWords;
    for (int i = 0; i < 4; ++i) {
        mine[i] = a[i];
    }
    mine[4] = b0;
    mine[5] = b1;
    cpu::warp_barrier();
    auto a_element = [&](int row, int col) {
        const unsigned owner = (row % 8) * 4 + (col % 8) / 2;
        const int reg = (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0);
        return cpu::element_to_float(cpu::half_of(slots[owner * cpu::kFragmentWords + reg], col % 2), BF16);
    };
    auto b_element = [&](int k, int n) {
        const unsigned owner = n * 4 + (k % 8) / 2;
        const int reg = 4 + (k >= 8 ? 1 : 0);
        return cpu::element_to_float(cpu::half_of(slots[owner * cpu::kFragmentWords + reg], k % 2), BF16);
    };
    float result[4];
    for (int i = 0; i < 4; ++i) {
        const int row = static_cast<int>(lane / 4) + (i >= 2 ? 8 : 0);
        const int col = static_cast<int>(lane % 4) * 2 + (i & 1);
        float sum = d[i];
        for (int k = 0; k < 16; ++k) {
            sum += a_element(row, k) * b_element(k, col);
        }
        result[i] = sum;
    }
    cpu::warp_barrier();
    for (int i = 0; i < 4; ++i) {
        d[i] = result[i];
    }
}

// Shared-window addresses: offsets into the dynamic shared memory, the only shared memory ldmatrix and cp.async
// touch here.
inline unsigned shared_address(const void* pointer) {
    const auto offset = static_cast<const unsigned char*>(pointer) - cpu::dynamic_shared;
    if (offset < 0 || offset >= static_cast<std::ptrdiff_t>(cpu::kDynamicSharedBytes)) {
        cpu::fault("shared address outside dynamic shared memory");
        return 0;
    }
    return static_cast<unsigned>(offset);
}

inline unsigned char* shared_pointer(unsigned address) {
    if (address >= cpu::kDynamicSharedBytes) {
        cpu::fault("shared address outside dynamic shared memory");
        return cpu::dynamic_shared;
    }
    return cpu::dynamic_shared + address;
}

// ldmatrix .x4: lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (8 x 8 b16 elements each); register i
// of lane l receives matrix i's (row l / 4, cols 2 (l % 4), 2 (l % 4) + 1), or with .trans its (rows 2 (l % 4),
// 2 (l % 4) + 1, col l / 4).
inline void ldmatrix_emulated(unsigned (&r)[4], unsigned address, bool transposed) {
    const unsigned char* row = shared_pointer(address);
    if (!cpu::aligned_16(row)) {
        cpu::fault("ldmatrix row address not 16-byte aligned");
    }
    const unsigned lane = cpu::linear_thread() % 32;
    unsigned long long* slots = cpu::warp_fragments();
    slots[lane * cpu::kFragmentWords] = reinterpret_cast<unsigned long long>(row);
    cpu::warp_barrier();
    auto element = [&](int matrix, int matrix_row, int col) {
        const auto* row_address = reinterpret_cast<const unsigned short*>(
            slots[static_cast<unsigned>(matrix * 8 + matrix_row) * cpu::kFragmentWords]);
        return static_cast<unsigned>(row_address[col]);
    };
    unsigned result[4];
    for (int i = 0; i < 4; ++i) {
        const int a = static_cast<int>(lane / 4);
        const int b = static_cast<int>(lane % 4) * 2;
        const unsigned low = transposed ? element(i, b, a) : element(i, a, b);
        const unsigned high = transposed ? element(i, b + 1, a) : element(i, a, b + 1);
        result[i] = low | (high << 16);
    }
    cpu::warp_barrier();
    for (int i = 0; i < 4; ++i) {
        r[i] = result[i];
    }
}

inline void ldmatrix_x4(unsigned (&r)[4], unsigned row) { ldmatrix_emulated(r, row, false); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], unsigned row) { ldmatrix_emulated(r, row, true); }

// cp.async as the PTX ISA gives it: the destination holds nothing defined (here: 0xFF bytes) until a
// cp.async.wait_group leaves at most PENDING of this thread's newer committed groups in flight.
inline void cp_async_16(unsigned shared_window, const void* global, bool fill) {
    unsigned char* shared = shared_pointer(shared_window);
    if (!cpu::aligned_16(shared) || !cpu::aligned_16(global)) {
        cpu::fault("cp.async address not 16-byte aligned");
    }
    std::memset(shared, 0xFF, 16);
    cpu::current->open_group.push_back(cpu::PendingCopy{shared, global, fill});
}
inline void cp_async_commit() {
    cpu::current->committed.push_back(std::move(cpu::current->open_group));
    cpu::current->open_group.clear();
}
template <int PENDING>
inline void cp_async_wait() {
    std::vector<std::vector<cpu::PendingCopy>>& groups = cpu::current->committed;
    while (groups.size() > static_cast<std::size_t>(PENDING)) {
        for (const cpu::PendingCopy& copy : groups.front()) {
            cpu::land(copy);
        }
        groups.erase(groups.begin());
    }
}

// ex2.approx.ftz.f32: a result below the smallest normal float flushes to +0 (so does -inf's).
inline float exp2_approx(float x) {
    const float result = std::exp2(x);
    return std::fpclassify(result) == FP_SUBNORMAL ? 0.0f : result;
}

// cvt.rn.{f16,bf16}x2.f32: round to nearest even; `low` in bits 0-15.
template <bool BF16>
inline unsigned pack_pair(float low, float high) {
    auto round = [](float value) -> unsigned {
        if (!BF16) {
            return cpu_bit_cast<unsigned short>(static_cast<_Float16>(value));
        }
        unsigned bits = cpu_bit_cast<unsigned>(value);
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
            return 0x7fc0u;
        }
        bits += 0x7fffu + ((bits >> 16) & 1u);
        return bits >> 16;
    };
    return round(low) | (round(high) << 16);
}

}  // namespace mma
}  // namespace attention
