// The tensor-core primitives paged_attention_mma.cu uses, as inline PTX for NVRTC: mma.sync m16n8k16, ldmatrix
// (plain and transposed), cp.async with its commit/wait, the fast exponential and fp32 pair packing.
// kernels/paged_attention_cpu.cuh emulates each of them lane by lane for the CPU tests; keep the two in step.
#pragma once

namespace attention {
namespace mma {

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    unsigned long long address;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(address) : "l"(pointer));
    return static_cast<unsigned>(address);
}

// d += a * b for one 16x8x16 tile (PTX ISA fragment layouts; fp32 accumulators).
template <bool BF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the shared-window addresses (shared_address) of the rows of matrix i,
// register i receives matrix i. The primitives take 32-bit shared addresses, so a loop adds offsets to one
// instead of converting a 64-bit pointer for every instruction.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}

// The same, each matrix transposed on the way.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}

// 16 bytes global -> shared (a shared-window address) without passing through registers; zeros when !fill
// (nothing is read then).
__device__ __forceinline__ void cp_async_16(unsigned shared, const void* global, bool fill) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(global), "r"(fill ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

// 2^x on the special-function unit alone: exp2f adds a rescale around it for results below the smallest normal
// float, which a softmax weight can drop (they flush to +0, as -inf's does).
__device__ __forceinline__ float exp2_approx(float x) {
    float result;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(result) : "f"(x));
    return result;
}

// Two fp32 values rounded to nearest into one register of 16-bit elements, `low` in the low half.
template <bool BF16>
__device__ __forceinline__ unsigned pack_pair(float low, float high) {
    unsigned packed;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    }
    return packed;
}
#define PAGED_ATTENTION_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]

}  // namespace mma
}  // namespace attention
