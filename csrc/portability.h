// One kernel source for nvcc and hipcc: kernels are written against the CUDA
// runtime names, and under HIP this header maps them to their hip* twins.
// Add a mapping here when a kernel needs a name that is not yet listed.
#pragma once

#if defined(__HIPCC__) || defined(USE_ROCM)

#include <hip/hip_runtime.h>

using cudaStream_t = hipStream_t;
using cudaError_t = hipError_t;
#define cudaSuccess hipSuccess
#define cudaGetLastError hipGetLastError
#define cudaGetErrorString hipGetErrorString
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaGetDevice hipGetDevice
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaPointerAttributes hipPointerAttribute_t
#define cudaPointerGetAttributes hipPointerGetAttributes
#define cudaMemoryTypeHost hipMemoryTypeHost
#define cudaFuncSetAttribute(kernel, attr, value) \
  hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value)
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
// AMD has no opt-in past a block's shared-memory maximum (64 KiB on CDNA).
#define cudaDevAttrMaxSharedMemoryPerBlockOptin hipDeviceAttributeMaxSharedMemoryPerBlock
#if HIP_VERSION_MAJOR >= 6
#define ATOM_POINTER_TYPE(attributes) (attributes).type
#else  // ROCm 5 names the field memoryType
#define ATOM_POINTER_TYPE(attributes) (attributes).memoryType
#endif

// HIP's warp builtins take no mask (a wavefront always runs converged here);
// the variadic form keeps the optional `width` argument.
#define __shfl_xor_sync(mask, ...) __shfl_xor(__VA_ARGS__)
#define __shfl_sync(mask, ...) __shfl(__VA_ARGS__)
#define __shfl_down_sync(mask, ...) __shfl_down(__VA_ARGS__)
#define __shfl_up_sync(mask, ...) __shfl_up(__VA_ARGS__)

namespace atom {
constexpr int kWarpSize = 64;  // CDNA (gfx942, gfx950) wavefronts
}

#else

#include <cuda_runtime.h>

#define ATOM_POINTER_TYPE(attributes) (attributes).type

namespace atom {
constexpr int kWarpSize = 32;
}

#endif

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace atom {

// Launchers report failure as the runtime's message (a static string), and
// success as nullptr; bindings.cpp turns a message into a Python exception.
inline const char* last_launch_error() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

inline cudaStream_t as_stream(uintptr_t stream) {
  return reinterpret_cast<cudaStream_t>(stream);
}

// Programmatic dependent launch (NVIDIA sm_90+). A kernel started by launch_kernel may be scheduled while
// the kernel before it in the stream still runs; it first waits, in pdl_enter() (kernel_common.h, the first
// statement of every such kernel), until that kernel has finished and its writes are visible, then lets the
// kernel after it be scheduled. So a kernel's launch and block start-up overlap the one before, as in a
// decode graph's long chain of small kernels, and no kernel touches memory before its predecessor is done.
// pdl_state: -1 until the first launch decides (ATOM_PDL=0 turns it off; on by default where supported),
// then 0 or 1; set_pdl() changes it (kernels captured in a CUDA graph keep the setting they were captured with).
inline std::atomic<int> pdl_state{-1};

inline bool pdl_supported() {
#if defined(__HIPCC__) || defined(USE_ROCM)
  return false;
#else
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
#endif
}

inline void set_pdl(bool on) { pdl_state.store(on && pdl_supported() ? 1 : 0); }

inline bool pdl_enabled() {
  int state = pdl_state.load(std::memory_order_relaxed);
  if (state < 0) {
    const char* env = std::getenv("ATOM_PDL");
    set_pdl(env == nullptr || std::strcmp(env, "0") != 0);
    state = pdl_state.load();
  }
  return state == 1;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-dependent-launch attribute where
// pdl_enabled(). Errors are left for last_launch_error(), as after <<<>>>.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
#if !defined(__HIPCC__) && !defined(USE_ROCM)
  if (pdl_enabled()) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
    return;
  }
#endif
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
}

}  // namespace atom
