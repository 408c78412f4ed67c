// Hopper warpgroup MMA (wgmma.mma_async, sm_90a only): 128 threads multiply
// operands that the tensor cores read straight from shared memory, described
// by 64-bit matrix descriptors, into fp32 accumulators in registers.
// NVIDIA only, like mma_sm80.h. The instructions exist only in sm_90a code
// (__CUDA_ARCH_FEAT_SM90_ALL); other targets compile them to a trap, and the
// host selects kernels that use them only where the build has sm_90a code
// (ATOM_SM90A) and the device is compute capability 9.0.
#pragma once

#include <cstdint>

#include "mma_sm80.h"

namespace atom {
namespace ptx {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATOM_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define ATOM_SM90A_ASM(...) __trap()
#endif

// Descriptor of an operand in the 128-byte swizzle layout: rows of 128 bytes
// (64 bf16), groups of 8 rows (1024 bytes, 1024-byte aligned) in which the
// 16-byte chunk c of row r is stored at chunk c ^ r (swizzle_128b below).
// A K-major operand (rows along K: one row per M or N index) steps k by
// moving the start address 32 bytes along the row; sbo = byte stride between
// its 8-row groups along M (N); lbo is unused. An M-major (N-major) operand
// has rows along M and one row per k: sbo = byte stride between 8-row groups
// along K, lbo = byte stride between 64-element blocks along M.
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* p, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_addr(p) & 0x3FFFFu) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32 | uint64_t{1} << 62;
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in the 128-byte swizzle layout.
__host__ __device__ constexpr int swizzle_128b(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// Orders this warpgroup's register writes (accumulators) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() { ATOM_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { ATOM_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most N committed wgmma groups of this warpgroup are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  ATOM_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// An accumulator is written asynchronously: this keeps the compiler from
// moving its uses across the wait (or its definitions across the fence).
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// d[64 x 32] += A[64 x 16] B[16 x 32], bf16 in, fp32 accumulate, both operands
// in shared memory. B is K-major; A is K-major (kTransA = 0) or M-major (1).
// Fragment: thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4
// (+8 for d[i] with i & 2) and columns 8 (i / 4) + 2 (t % 4) + (i & 1).
template <int kTransA>
__device__ __forceinline__ void wgmma_m64n32k16_bf16(float (&d)[16], uint64_t a, uint64_t b) {
  ATOM_SM90A_ASM(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(1), "n"(kTransA)
      : "memory");
}

#undef ATOM_SM90A_ASM

}  // namespace ptx
}  // namespace atom
