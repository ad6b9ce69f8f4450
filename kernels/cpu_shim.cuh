// CPU shim: lets g++ (C++20) compile an unmodified simple CUDA kernel so tests can run it through ctypes on a machine
// without a GPU (TOOLCHAIN.md). Include it before the .cu file, then export launchers with SHIM_EXPORT:
//
//     #include "cpu_shim.cuh"
//     #include "page_copy.cu"
//     SHIM_EXPORT(page_copy_rows)   // -> extern "C" void shim_page_copy_rows(grid xyz, block xyz, void** args)
//
// `args` is an array of pointers to the argument values, as for cuLaunchKernel. Blocks run one after another; the
// threads of a block run as real threads, so __syncthreads() is a barrier and __shared__ (a function-local static)
// is per block. Not covered: warp intrinsics, cooperative groups, inline PTX, textures. Never seen by NVRTC.
#pragma once

#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.cuh"

// fp16 as the compiler's native half type; bf16 as its raw 16 bits (what the data-movement kernels move).
using __half = _Float16;
struct __nv_bfloat16 {
    unsigned short bits;
};

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace shim {
inline thread_local std::barrier<>* block_barrier = nullptr;
}

inline void __syncthreads() { shim::block_barrier->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
T atomicAdd(T* address, T value) {
    return std::atomic_ref<T>(*address).fetch_add(value);
}

template <typename T>
T atomicExch(T* address, T value) {
    return std::atomic_ref<T>(*address).exchange(value);
}

template <typename T>
T atomicCAS(T* address, T expected, T desired) {
    std::atomic_ref<T>(*address).compare_exchange_strong(expected, desired);
    return expected;
}

template <typename T>
T atomicMax(T* address, T value) {
    std::atomic_ref<T> ref(*address);
    T old = ref.load();
    while (old < value && !ref.compare_exchange_weak(old, value)) {
    }
    return old;
}

template <typename T>
T atomicMin(T* address, T value) {
    std::atomic_ref<T> ref(*address);
    T old = ref.load();
    while (value < old && !ref.compare_exchange_weak(old, value)) {
    }
    return old;
}

namespace shim {

// Runs kernel<<<grid, block>>>(args...): block after block, each block's threads concurrently.
template <typename... Params, typename... Args>
void launch(dim3 grid, dim3 block, void (*kernel)(Params...), Args... args) {
    const unsigned threads_per_block = block.x * block.y * block.z;
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                std::barrier<> barrier(threads_per_block);
                std::vector<std::thread> threads;
                threads.reserve(threads_per_block);
                for (unsigned t = 0; t < threads_per_block; ++t) {
                    threads.emplace_back([&, t] {
                        threadIdx = dim3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
                        blockIdx = dim3{bx, by, bz};
                        blockDim = block;
                        gridDim = grid;
                        block_barrier = &barrier;
                        kernel(args...);
                    });
                }
                for (std::thread& thread : threads) {
                    thread.join();
                }
            }
        }
    }
}

// Unpacks cuLaunchKernel-style argument pointers into the kernel's parameter types.
template <typename... Params, std::size_t... I>
void launch_packed(dim3 grid, dim3 block, void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
    launch(grid, block, kernel, *static_cast<std::remove_cv_t<Params>*>(args[I])...);
}

template <typename... Params>
void launch_packed(dim3 grid, dim3 block, void (*kernel)(Params...), void** args) {
    launch_packed(grid, block, kernel, args, std::index_sequence_for<Params...>{});
}

}  // namespace shim

#define SHIM_EXPORT(kernel)                                                                                      \
    extern "C" void shim_##kernel(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
                                  void** args) {                                                                 \
        shim::launch_packed(dim3{gx, gy, gz}, dim3{bx, by, bz}, kernel, args);                                   \
    }
