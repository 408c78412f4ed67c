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

namespace atom {
constexpr int kWarpSize = 32;
}

#endif

#include <cstdint>

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

}  // namespace atom
