// Device helpers shared by the kernels: element types, fp32 conversion, and
// reductions over groups of 32 threads.
//
// "Warp" in these kernels always means 32 consecutive threads, also on CDNA
// where a wavefront has 64: every shuffle passes width 32, so a 64-wide
// wavefront runs as two independent 32-lane groups and the same source is
// correct on both vendors.
#pragma once

#include "ops.h"
#include "portability.h"

#if defined(__HIPCC__) || defined(USE_ROCM)
#include <hip/hip_fp16.h>
#if __has_include(<hip/hip_bf16.h>)  // ROCm >= 5.7
#include <hip/hip_bf16.h>
namespace atom {
using bf16_t = __hip_bfloat16;
}  // namespace atom
#else  // older ROCm: the struct type, with the CUDA-named conversions added
#include <hip/hip_bfloat16.h>
namespace atom {
using bf16_t = hip_bfloat16;
}  // namespace atom
__device__ __forceinline__ float __bfloat162float(hip_bfloat16 x) { return static_cast<float>(x); }
__device__ __forceinline__ hip_bfloat16 __float2bfloat16(float x) { return hip_bfloat16(x); }
#endif
namespace atom {
using fp16_t = __half;
}  // namespace atom
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
namespace atom {
using bf16_t = __nv_bfloat16;
using fp16_t = __half;
}  // namespace atom
#endif

namespace atom {

// The launch's dynamic shared memory as T[]. Declared here, outside the kernels'
// anonymous namespaces: clang's HIP rejects an extern __shared__ array with
// internal linkage ("has internal linkage but is not defined").
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
  extern __shared__ __align__(16) unsigned char atom_dynamic_shared[];
  return reinterpret_cast<T*>(atom_dynamic_shared);
}

constexpr int kGroup = 32;  // threads per reduction group ("warp")

// The first statement of every kernel started by launch_kernel (portability.h): wait until the kernel before it
// in the stream has finished and its writes are visible, then let the kernel after it be scheduled. A no-op for
// a kernel launched without the attribute, and outside sm_90+. Only prefetch_l2 may come before it: no read, no
// write and no return (a grid whose threads all returned first could finish before the kernel before it, and
// let the kernel after it read that one's outputs early).
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Asks L2 for the line that holds p. A hint: nothing comes back to the thread, so it cannot read a value that
// the kernel before has yet to write. The linears issue it for their first weight vectors before pdl_enter,
// so the weights' trip from memory overlaps the kernel before, and the loads after the wait find them in L2.
// A no-op on ROCm.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#else
  (void)p;
#endif
}

// prefetch_l2 of vectors first, first + step, ... (at most count of them, all below end) of each of the rows.
template <int kRows, typename V>
__device__ __forceinline__ void prefetch_rows_l2(const V* const (&rows)[kRows], int first, int end, int step,
                                                 int count) {
  for (int c = first, n = 0; c < end && n < count; c += step, ++n) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) prefetch_l2(rows[r] + c);
  }
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(fp16_t x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ fp16_t from_float<fp16_t>(float x) { return __float2half(x); }

// Rounds through T and back: reproduces where torch rounds an intermediate to
// the model dtype.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int off = kGroup / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off, kGroup);
  return v;
}

// KDA's gated RMSNorm of one row, for gated_rmsnorm (csrc/norm.cu) and kda_decode's fused form (csrc/kda.cu),
// which must give the same bits: 1 / rms from the lanes' sums of squares, then one output element,
// weight * (x * inv) * sigmoid(gate) in fp32, rounded once.
__device__ __forceinline__ float gated_norm_inv(float lane_sum_sq, int dim, float eps) {
  return rsqrtf(group_sum(lane_sum_sq) / dim + eps);
}

template <typename T>
__device__ __forceinline__ T gated_norm_value(float x, float inv, float weight, float gate) {
  const float sig = 1.f / (1.f + expf(-gate));
  return from_float<T>(weight * (x * inv) * sig);
}

__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int off = kGroup / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off, kGroup));
  return v;
}

// An int32 or int64 index array read as int64 (block tables, slot ids, lengths).
__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// n elements of T loaded or stored as one vector (n * sizeof(T) bytes, aligned to that).
template <typename T, int n>
struct alignas(n * sizeof(T)) Pack {
  T v[n];
};

// The dot product of two n-element vectors (16-byte loads, or single elements), summed in fp32 in order.
template <typename T, int n>
__device__ __forceinline__ float pack_dot(const Pack<T, n>& a, const Pack<T, n>& b) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < n; ++i) s += to_float(a.v[i]) * to_float(b.v[i]);
  return s;
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Flash-decoding's split of a sequence: the tiles [begin, end) of `tile` positions each that split `split` of
// num_splits owns (every split but the last takes the same whole number of tiles; begin >= end: none).
struct TileRange {
  int64_t begin, end;
};
__device__ __forceinline__ TileRange split_tiles(int64_t seq_len, int tile, int split, int num_splits) {
  const int64_t tiles = ceil_div(seq_len, tile);
  const int64_t per = ceil_div(tiles, num_splits);
  const int64_t begin = split * per;
  return {begin, begin + per < tiles ? begin + per : tiles};
}

// ---- Flash-decoding's merge of one output row from its splits (mla_decode, paged_decode_attention).
//
// Split s left its normalised output o_s (dim floats at part + s * part_stride) and the natural-log sum of
// exp(score) of its positions, lse_s (at lse + s * lse_stride; -inf: an empty split, whose o_s was never
// written). out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max_s lse_s); zeros when every split is
// empty. Called by every thread of a kMergeThreads block, with merge_shared_bytes(splits) of dynamic shared
// memory: the weights, padded with zeros to whole float4s (the unrolled loop may read a float4 of them at
// once, past the last split: memcheck saw 12-byte reads there before the padding), then room for partial sums.
// A thread takes four consecutive columns (or one, when dim % 4 != 0); where a row has fewer such columns than
// threads, the threads split the splits too (group g takes splits g, g + groups, ...) and sum their partials
// after, so a row of many splits is not one thread's long chain of loads.
constexpr int kMergeThreads = 128;
__host__ __device__ constexpr int split_weights(int splits) { return (splits + 3) / 4 * 4; }
__host__ __device__ constexpr int merge_shared_bytes(int splits) {
  return (split_weights(splits) + 4 * kMergeThreads) * static_cast<int>(sizeof(float));
}

template <int W>
__device__ __forceinline__ void add_weighted(float (&acc)[W], float w, const float* x) {
  if constexpr (W == 4) {
    const float4 v = *reinterpret_cast<const float4*>(x);
    acc[0] = fmaf(w, v.x, acc[0]);
    acc[1] = fmaf(w, v.y, acc[1]);
    acc[2] = fmaf(w, v.z, acc[2]);
    acc[3] = fmaf(w, v.w, acc[3]);
  } else {
    acc[0] = fmaf(w, x[0], acc[0]);
  }
}

// The merge with W columns a thread (W = 4 needs dim % 4 == 0: part is then 16-byte aligned).
template <int W, typename OutT>
__device__ void merge_columns(const float* weight, float* partial, const float* part, int64_t part_stride,
                              int splits, int dim, float inv, OutT* out) {
  const int cols = dim / W;
  const int groups = cols >= kMergeThreads ? 1 : min(kMergeThreads / cols, splits);
  if (groups == 1) {
    for (int c = threadIdx.x; c < cols; c += kMergeThreads) {
      float acc[W] = {};
#pragma unroll 4
      for (int s = 0; s < splits; ++s)
        if (weight[s] != 0.f) add_weighted(acc, weight[s], part + s * part_stride + c * W);  // 0: an empty split
#pragma unroll
      for (int w = 0; w < W; ++w) out[c * W + w] = from_float<OutT>(acc[w] * inv);
    }
    return;
  }
  const int group = threadIdx.x / cols, c = threadIdx.x % cols;
  if (group < groups) {
    float acc[W] = {};
#pragma unroll 4
    for (int s = group; s < splits; s += groups)
      if (weight[s] != 0.f) add_weighted(acc, weight[s], part + s * part_stride + c * W);
#pragma unroll
    for (int w = 0; w < W; ++w) partial[group * dim + c * W + w] = acc[w];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dim; d += kMergeThreads) {
    float total = 0.f;
    for (int g = 0; g < groups; ++g) total += partial[g * dim + d];
    out[d] = from_float<OutT>(total * inv);
  }
}

template <typename OutT>
__device__ void merge_splits(const float* lse, int64_t lse_stride, const float* part, int64_t part_stride,
                             int splits, int dim, OutT* out) {
  float* weight = dynamic_shared<float>();
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, lse[s * lse_stride]);
  if (mx == -INFINITY) {  // no positions at all
    for (int d = threadIdx.x; d < dim; d += blockDim.x) out[d] = from_float<OutT>(0.f);
    return;
  }
  for (int s = threadIdx.x; s < split_weights(splits); s += blockDim.x)
    weight[s] = s < splits ? expf(lse[s * lse_stride] - mx) : 0.f;
  __syncthreads();
  float total = 0.f;
  for (int s = 0; s < splits; ++s) total += weight[s];
  float* partial = weight + split_weights(splits);
  if (dim % 4 == 0)
    merge_columns<4>(weight, partial, part, part_stride, splits, dim, 1.f / total, out);
  else
    merge_columns<1>(weight, partial, part, part_stride, splits, dim, 1.f / total, out);
}

}  // namespace atom

// Calls F<T> with T the C++ element type of a DType code; returns an error
// message for codes the kernel does not take.
#define ATOM_DISPATCH_FLOAT_TYPES(code, name, ...)         \
  [&]() -> const char* {                                   \
    switch (code) {                                        \
      case ::atom::kFloat32: {                             \
        using scalar_t = float;                            \
        return __VA_ARGS__();                              \
      }                                                    \
      case ::atom::kBFloat16: {                            \
        using scalar_t = ::atom::bf16_t;                   \
        return __VA_ARGS__();                              \
      }                                                    \
      case ::atom::kFloat16: {                             \
        using scalar_t = ::atom::fp16_t;                   \
        return __VA_ARGS__();                              \
      }                                                    \
      default:                                             \
        return name ": unsupported dtype (float32, bfloat16 or float16 only)"; \
    }                                                      \
  }()
