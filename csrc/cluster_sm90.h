// Hopper (sm_90) thread-block clusters: the blocks of one cluster run at the
// same time on one GPC and can read and write each other's shared memory
// (distributed shared memory). NVIDIA only, like bulk_copy_sm90.h; on older targets the
// helpers trap (callers launch clusters only on sm_90+ devices).
#pragma once

#include <cstdint>

#include "mma_sm80.h"  // smem_addr

namespace atom {
namespace ptx {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ATOM_CLUSTER_ASM(...) asm volatile(__VA_ARGS__)
#else
#define ATOM_CLUSTER_ASM(...) __trap()
#endif

// Every thread of every block in the cluster arrives and waits. The arrival does not release (no
// memory fence): it orders only what has completed before it (reads whose values were used, and
// mbarrier initialisations published by fence_mbar_init) before the other blocks' accesses after it.
__device__ __forceinline__ void cluster_sync_relaxed() {
  ATOM_CLUSTER_ASM("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  ATOM_CLUSTER_ASM("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// The shared::cluster address of `p` (this block's shared memory) in the cluster's block `rank`.
__device__ __forceinline__ uint32_t cluster_map(const void* p, int rank) {
  uint32_t out = 0;
  ATOM_CLUSTER_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem_addr(p)), "r"(rank));
  return out;
}

// Stores to another block's shared memory (an address from cluster_map) that complete their bytes
// on that block's mbarrier `bar` (its address from cluster_map too): a thread that waits on that
// mbarrier sees them. The mbarrier's initialisation must have been published to the cluster first
// (fence_mbar_init, then a cluster barrier).
__device__ __forceinline__ void cluster_store_async(uint32_t addr, float v, uint32_t bar) {
  ATOM_CLUSTER_ASM("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr),
                   "r"(__float_as_uint(v)), "r"(bar)
                   : "memory");
}
__device__ __forceinline__ void cluster_store4_async(uint32_t addr, float4 v, uint32_t bar) {
  ATOM_CLUSTER_ASM("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                       addr),
                   "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
                   "r"(__float_as_uint(v.w)), "r"(bar)
                   : "memory");
}

#undef ATOM_CLUSTER_ASM

}  // namespace ptx
}  // namespace atom
