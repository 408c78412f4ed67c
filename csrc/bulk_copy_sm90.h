// Hopper (sm_90) bulk copies global -> shared that complete on an mbarrier
// (cp.async.bulk, the copy engine without a tensor map: one instruction moves
// a whole contiguous row). NVIDIA only, like mma_sm80.h. On older targets the
// helpers trap: callers select them only on sm_90+ devices.
#pragma once

#include <cstdint>

#include "mma_sm80.h"

namespace atom {
namespace ptx {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ATOM_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define ATOM_SM90_ASM(...) __trap()
#endif

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  ATOM_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes initialised mbarriers visible to the async proxy (the copy engine).
__device__ __forceinline__ void fence_mbar_init() {
  ATOM_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Orders this thread's earlier shared-memory accesses before its later async-proxy copies.
__device__ __forceinline__ void fence_proxy_async() { ATOM_SM90_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// One arrival that also announces `bytes` of copies completing on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  ATOM_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                : "memory");
}

// bytes (a multiple of 16, both addresses 16-byte aligned) global -> shared, completing on bar.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  ATOM_SM90_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                    smem_addr(dst)),
                "l"(src), "r"(bytes), "r"(smem_addr(bar))
                : "memory");
}

// Waits until the phase of bar with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  ATOM_SM90_ASM(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra.uni DONE;\n"
      "bra.uni WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

#undef ATOM_SM90_ASM

}  // namespace ptx
}  // namespace atom
