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
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
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

struct Fiber {
    ucontext_t context;
    dim3 thread_idx;
    bool done = false;
    std::vector<char> stack = std::vector<char>(kStackBytes);
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
inline unsigned long long progress = 0;
inline std::function<void()> body;

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

// Runs every block of kernel<<<grid, block>>>(args...); false when a barrier deadlocks.
template <typename... Params, typename... Args>
bool launch(dim3 grid, dim3 block, void (*kernel)(Params...), Args... args) {
    const unsigned threads = block.x * block.y * block.z;
    const unsigned warps = (threads + 31) / 32;
    fibers.resize(threads);
    barriers.assign(1 + warps, Barrier{});
    barriers[0].participants = threads;
    for (unsigned w = 0; w < warps; ++w) {
        barriers[1 + w].participants = std::min(32u, threads - 32 * w);
    }
    shuffle_slots.assign(32 * warps, 0);
    block_dim = block;
    grid_dim = grid;
    body = [&] { kernel(args...); };
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                block_idx = dim3{bx, by, bz};
                for (unsigned t = 0; t < threads; ++t) {
                    Fiber& fiber = fibers[t];
                    fiber.thread_idx = dim3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
                    fiber.done = false;
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
                        return false;
                    }
                }
            }
        }
    }
    return true;
}

template <typename... Params, std::size_t... I>
bool launch_packed(dim3 grid, dim3 block, void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
    return launch(grid, block, kernel, *static_cast<std::remove_cv_t<Params>*>(args[I])...);
}

template <typename... Params>
bool launch_packed(dim3 grid, dim3 block, void (*kernel)(Params...), void** args) {
    return launch_packed(grid, block, kernel, args, std::index_sequence_for<Params...>{});
}

}  // namespace cpu

#define threadIdx (cpu::current->thread_idx)
#define blockIdx (cpu::block_idx)
#define blockDim (cpu::block_dim)
#define gridDim (cpu::grid_dim)

inline void __syncthreads() { cpu::wait(cpu::barriers[0]); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask) {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "shuffles move at most 8 bytes");
    const unsigned thread = cpu::linear_thread();
    const unsigned warp = thread / 32;
    unsigned long long* slots = cpu::shuffle_slots.data() + 32 * warp;
    std::memcpy(&slots[thread % 32], &value, sizeof(T));
    cpu::wait(cpu::barriers[1 + warp]);
    T result;
    std::memcpy(&result, &slots[(thread % 32) ^ static_cast<unsigned>(lane_mask)], sizeof(T));
    cpu::wait(cpu::barriers[1 + warp]);
    return result;
}

#define CPU_EXPORT(kernel)                                                                                 \
    extern "C" int cpu_##kernel(unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** args) {        \
        return cpu::launch_packed(dim3{gx, gy, gz}, dim3{bx, 1, 1}, kernel, args) ? 0 : 1;                \
    }
