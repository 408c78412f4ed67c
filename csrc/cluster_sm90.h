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

// Every thread of every block in the cluster arrives and waits: this block's shared-memory
// writes before it (to its own or another block's memory) are visible to the other blocks'
// reads after it (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  ATOM_CLUSTER_ASM("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  ATOM_CLUSTER_ASM("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The shared::cluster address of `p` (this block's shared memory) in the cluster's block `rank`.
__device__ __forceinline__ uint32_t cluster_map(const void* p, int rank) {
  uint32_t out = 0;
  ATOM_CLUSTER_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem_addr(p)), "r"(rank));
  return out;
}

// A store to another block's shared memory (an address from cluster_map). It does not wait for
// the store to land: the next cluster_sync does.
__device__ __forceinline__ void cluster_store(uint32_t addr, float v) {
  ATOM_CLUSTER_ASM("st.shared::cluster.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}

__device__ __forceinline__ void cluster_store4(uint32_t addr, float4 v) {  // addr 16-byte aligned
  ATOM_CLUSTER_ASM("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z),
                   "f"(v.w)
                   : "memory");
}

#undef ATOM_CLUSTER_ASM

}  // namespace ptx
}  // namespace atom
