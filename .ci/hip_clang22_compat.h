// Force-included by .ci/check_cuda_build.sh when it compiles the kernels for
// gfx950 with clang 22 against Debian's ROCm 5.2 HIP headers. Those headers use
// two names that clang has since dropped; this restores them as the older
// clang headers defined them. Nothing else includes this file.
#pragma once

#ifndef __AMDGCN_WAVEFRONT_SIZE
#define __AMDGCN_WAVEFRONT_SIZE 64  // CDNA runs 64-lane waves
#endif

__device__ inline _Float16 __llvm_amdgcn_rcp_f16(_Float16 x) { return static_cast<_Float16>(1.0f) / x; }
__device__ inline __2f16 __llvm_amdgcn_rcp_2f16(__2f16 x) { return static_cast<__2f16>(1.0f) / x; }
