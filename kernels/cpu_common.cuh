// What both CPU emulations of CUDA share (kernels/cpu_shim.cuh: threads; kernels/paged_attention_cpu.cuh: fibers):
// the function and memory-space qualifiers as no-ops (a function-local static is per-block __shared__ memory,
// since blocks run one after another), dim3 and uint4, and min/max. Never seen by NVRTC.
#pragma once

#include <algorithm>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

using std::max;
using std::min;
