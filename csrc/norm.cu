// Fused gated RMSNorm (KDA's output norm), one row per 32-thread group:
//
//   out = (weight * (x * rsqrt(mean(x^2) + eps))) * sigmoid(gate)
//
// all in fp32, rounded once to the model dtype at the end, as
// atom.layers.norm.GatedRMSNorm does. Rows may be strided (x [T, H, D]
// viewed as [T*H, D]; gate [T, H*D] likewise); the last dim is contiguous.
#include "kernel_common.h"

namespace atom {
namespace {

struct NormParams {
  const void* x;
  int64_t x_stride;
  const void* gate;
  int64_t gate_stride;
  const void* weight;
  void* out;
  int64_t out_stride;
  int64_t rows;
  int dim;
  float eps;
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

constexpr int kRowsPerBlock = 8;
constexpr int kCached = 4;  // vectors per lane kept in registers between the two passes

// N elements per lane per access (up to 16 bytes, chosen so every lane has
// work); the first kCached vectors of a lane stay in registers, longer rows
// re-read the rest.
template <typename T, int N>
__global__ void __launch_bounds__(kRowsPerBlock * 32) gated_rmsnorm_kernel(NormParams p) {
  pdl_enter();
  using V = Vec<T, N>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kGroup;
  if (row >= p.rows) return;  // whole group: no shuffle is left half-empty
  const int lane = threadIdx.x % kGroup;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  const T* gate = static_cast<const T*>(p.gate) + row * p.gate_stride;
  const T* weight = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + row * p.out_stride;

  V xs[kCached];
  float ss = 0.f;
#pragma unroll
  for (int it = 0; it < kCached; ++it) {
    const int d = (lane + it * kGroup) * N;
    if (d < p.dim) {
      xs[it] = *reinterpret_cast<const V*>(x + d);
#pragma unroll
      for (int i = 0; i < N; ++i) ss = fmaf(to_float(xs[it].v[i]), to_float(xs[it].v[i]), ss);
    }
  }
  for (int d = (lane + kCached * kGroup) * N; d < p.dim; d += kGroup * N) {
    const V a = *reinterpret_cast<const V*>(x + d);
#pragma unroll
    for (int i = 0; i < N; ++i) ss = fmaf(to_float(a.v[i]), to_float(a.v[i]), ss);
  }
  const float inv = gated_norm_inv(ss, p.dim, p.eps);
  auto emit = [&](int d, const V& a) {
    const V g = *reinterpret_cast<const V*>(gate + d);
    const V w = *reinterpret_cast<const V*>(weight + d);
    V o;
#pragma unroll
    for (int i = 0; i < N; ++i) o.v[i] = gated_norm_value<T>(to_float(a.v[i]), inv, to_float(w.v[i]), to_float(g.v[i]));
    *reinterpret_cast<V*>(out + d) = o;
  };
#pragma unroll
  for (int it = 0; it < kCached; ++it) {
    const int d = (lane + it * kGroup) * N;
    if (d < p.dim) emit(d, xs[it]);
  }
  for (int d = (lane + kCached * kGroup) * N; d < p.dim; d += kGroup * N) emit(d, *reinterpret_cast<const V*>(x + d));
}

template <typename T>
const char* launch(const NormParams& p, cudaStream_t stream) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.gate) |
                        reinterpret_cast<uintptr_t>(p.weight) | reinterpret_cast<uintptr_t>(p.out) |
                        static_cast<uint64_t>((p.x_stride | p.gate_stride | p.out_stride | p.dim) * sizeof(T));
  // Widest vector that divides the row, is aligned, and still gives all 32 lanes work.
  int n = 16 / static_cast<int>(sizeof(T));
  while (n > 1 && (bits % (n * sizeof(T)) != 0 || p.dim < kGroup * n)) n /= 2;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.rows, kRowsPerBlock)));
  const int threads = kRowsPerBlock * 32;
  switch (n) {
    case 8:
      launch_kernel(gated_rmsnorm_kernel<T, 8>, grid, threads, 0, stream, p);
      break;
    case 4:
      launch_kernel(gated_rmsnorm_kernel<T, 4>, grid, threads, 0, stream, p);
      break;
    case 2:
      launch_kernel(gated_rmsnorm_kernel<T, 2>, grid, threads, 0, stream, p);
      break;
    default:
      launch_kernel(gated_rmsnorm_kernel<T, 1>, grid, threads, 0, stream, p);
  }
  return last_launch_error();
}

}  // namespace

const char* gated_rmsnorm(uintptr_t x, int64_t x_stride, uintptr_t gate, int64_t gate_stride, uintptr_t weight,
                          uintptr_t out, int64_t out_stride, int64_t rows, int64_t dim, double eps, int dtype,
                          uintptr_t stream) {
  if (rows < 0 || dim < 1 || dim > INT32_MAX) return "gated_rmsnorm: needs rows >= 0 and dim >= 1";
  if (rows == 0) return nullptr;
  if (ceil_div(rows, kRowsPerBlock) > INT32_MAX) return "gated_rmsnorm: too many rows";
  NormParams p{reinterpret_cast<const void*>(x), x_stride, reinterpret_cast<const void*>(gate), gate_stride,
               reinterpret_cast<const void*>(weight), reinterpret_cast<void*>(out), out_stride, rows,
               static_cast<int>(dim), static_cast<float>(eps)};
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "gated_rmsnorm", [&]() { return launch<scalar_t>(p, as_stream(stream)); });
}

}  // namespace atom
