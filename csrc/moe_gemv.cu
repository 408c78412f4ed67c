// Routed experts at decode batch sizes as matrix-vector products over the
// picked experts' weights (atom/ops/cuda/fused.py: moe_gemv).
//
// With a handful of tokens, the grouped path (moe_align, a gather, two grouped
// matmuls, silu_mul, moe_combine) is eight launches, and its matmuls read the
// picked experts' weights at a third of the bandwidth: their tiles are sized
// for many rows per expert, and here an expert has one or two. These two
// kernels read each picked expert's rows once per (token, pick) and do
// nothing else:
//
//   moe_gemv_up    act[p] = round(silu(round(x[t] . Wg[e]))) * round(x[t] . Wu[e])
//                  for every pair p = t * top_k + j, e = ids[p]: gate_up then silu_mul
//   moe_gemv_down  out[t] = round(sum_j w[t, j] * round(act[p_j] . Wd[e_j])), j in pick order,
//                  plus addend[t] as a separate rounded add: the down matmul then moe_combine
//
// With shared-expert weights, the shared expert (a gated MLP on every token)
// runs as one more pair a token: moe_gemv_up writes its activation after the
// pairs', and moe_gemv_down computes its output row and adds it where the
// addend would go, rounded as the separate MLP's output would be.
//
// They round where the grouped path and the separate MLP round (their matmuls
// write the model dtype), so they differ only in the order of each dot
// product's fp32 sums.
//
// A 32-thread group ("warp") computes one output row (two in moe_gemv_up); its lanes split the dot product.
// Blocks of one row range run for every pair (token) next to each other in the
// grid (pairs are the fast index), so tokens that picked the same expert read
// its rows at about the same time and the second read finds them in L2.
#include "kernel_common.h"

namespace atom {
namespace {

constexpr int kUpThreads = 256;  // moe_gemv_up's block
constexpr int kUpWarps = kUpThreads / kGroup;
constexpr int kThreads = 256;  // moe_gemv_down's block
constexpr int kWarps = kThreads / kGroup;
constexpr int kUpRows = 2;     // intermediate rows a warp of moe_gemv_up computes (each a gate and an up row)
constexpr int kDownPicks = 4;  // picks whose loads a warp of moe_gemv_down keeps in flight together
// Vectors a lane loads of each row before it uses the first: enough bytes in flight per SM to cover the
// memory's latency (a lane of moe_gemv_up holds 2 x 4 weight vectors, one of moe_gemv_down 2 x 4). 4 in
// moe_gemv_up ran 3-9% slower at 1-2 tokens, at 110-112 registers against 73-74 (GPU_NOTES.md, session 16).
constexpr int kUpBatch = 2;
constexpr int kDownBatch = 2;

// kN elements a load: 16-byte vectors (kN = 16 / sizeof(T)) where every row, stride and length allows, else 1.
template <typename T, int kN>
__global__ void __launch_bounds__(kUpThreads)
    moe_gemv_up_kernel(const T* __restrict__ x, int64_t x_stride, const int64_t* __restrict__ ids, int64_t pairs,
                       int top_k, const T* __restrict__ w, int64_t expert_stride, int routed_inter,
                       const T* __restrict__ shared_w, int shared_inter, T* __restrict__ act, int dim) {
  using V = Pack<T, kN>;
  const int64_t p = blockIdx.x;  // blocks past the pairs: the shared expert on token p - pairs
  const bool shared = p >= pairs;
  const int inter = shared ? shared_inter : routed_inter;
  const int lane = threadIdx.x % kGroup;
  const int row0 = (blockIdx.y * kUpWarps + threadIdx.x / kGroup) * kUpRows;
  if (shared && row0 < inter) {  // the shared expert's first weight loads' lines, before the wait
                                 // (prefetch_l2); a routed expert's rows come from ids, which the kernels
                                 // before write
    const V* rows[2 * kUpRows];  // gate rows, then up rows
#pragma unroll
    for (int r = 0; r < kUpRows; ++r) {
      const int64_t row = min(row0 + r, inter - 1);
      rows[r] = reinterpret_cast<const V*>(shared_w + row * dim);
      rows[kUpRows + r] = reinterpret_cast<const V*>(shared_w + (inter + row) * dim);
    }
    prefetch_rows_l2(rows, lane, dim / kN, kGroup, kUpBatch);
  }
  pdl_enter();
  if (row0 >= inter) return;
  const V* xr = reinterpret_cast<const V*>(x + (shared ? p - pairs : p / top_k) * x_stride);
  const T* we = shared ? shared_w : w + ids[p] * expert_stride;
  T* out = shared ? act + pairs * routed_inter + (p - pairs) * shared_inter : act + p * routed_inter;
  const V* gate[kUpRows];
  const V* up[kUpRows];
#pragma unroll
  for (int r = 0; r < kUpRows; ++r) {
    const int row = min(row0 + r, inter - 1);  // a row past the end repeats the last, and is not written
    gate[r] = reinterpret_cast<const V*>(we + static_cast<int64_t>(row) * dim);
    up[r] = reinterpret_cast<const V*>(we + static_cast<int64_t>(inter + row) * dim);
  }
  float g[kUpRows] = {}, u[kUpRows] = {};
  const int vecs = dim / kN;
  for (int c0 = lane; c0 < vecs; c0 += kGroup * kUpBatch) {
    V xv[kUpBatch], gv[kUpBatch][kUpRows], uv[kUpBatch][kUpRows];
#pragma unroll
    for (int b = 0; b < kUpBatch; ++b) {  // every load of the batch issued before the first use
      const int c = min(c0 + b * kGroup, vecs - 1);  // past the end: reloads the last vector, not summed
      xv[b] = xr[c];
#pragma unroll
      for (int r = 0; r < kUpRows; ++r) {
        gv[b][r] = gate[r][c];
        uv[b][r] = up[r][c];
      }
    }
#pragma unroll
    for (int b = 0; b < kUpBatch; ++b) {
      if (c0 + b * kGroup < vecs) {
#pragma unroll
        for (int r = 0; r < kUpRows; ++r) {
          g[r] += pack_dot<T, kN>(gv[b][r], xv[b]);
          u[r] += pack_dot<T, kN>(uv[b][r], xv[b]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kUpRows; ++r) {
    const float gr = round_to<T>(group_sum(g[r])), ur = round_to<T>(group_sum(u[r]));
    if (lane == r && row0 + r < inter) out[row0 + r] = from_float<T>(round_to<T>(gr / (1.f + expf(-gr))) * ur);
  }
}

// part[i] += a[i] . w[i] for kRows pairs of rows of `vecs` vectors, split over a warp's lanes; a lane
// issues kDownBatch vectors of every row before it uses the first.
template <typename T, int kN, int kRows>
__device__ __forceinline__ void row_dots(const Pack<T, kN>* const (&a)[kRows], const Pack<T, kN>* const (&w)[kRows],
                                         int vecs, int lane, float (&part)[kRows]) {
  using V = Pack<T, kN>;
  for (int c0 = lane; c0 < vecs; c0 += kGroup * kDownBatch) {
    V av[kDownBatch][kRows], wv[kDownBatch][kRows];
#pragma unroll
    for (int b = 0; b < kDownBatch; ++b) {
      const int c = min(c0 + b * kGroup, vecs - 1);  // past the end: reloads the last vector, not summed
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        av[b][i] = a[i][c];
        wv[b][i] = w[i][c];
      }
    }
#pragma unroll
    for (int b = 0; b < kDownBatch; ++b) {
      if (c0 + b * kGroup < vecs) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) part[i] += pack_dot<T, kN>(av[b][i], wv[b][i]);
      }
    }
  }
}

template <typename T, int kN>
__global__ void __launch_bounds__(kThreads)
    moe_gemv_down_kernel(const T* __restrict__ act, const int64_t* __restrict__ ids, const float* __restrict__ weights,
                         int top_k, const T* __restrict__ w, int64_t expert_stride, int inter,
                         const T* __restrict__ shared_act, const T* __restrict__ shared_w, int shared_inter,
                         const T* __restrict__ addend, T* __restrict__ out, int dim) {
  using V = Pack<T, kN>;
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x % kGroup;
  const int row = blockIdx.y * kWarps + threadIdx.x / kGroup;
  // The shared expert's first weight loads' lines, before the wait (prefetch_l2); a routed expert's rows come
  // from ids, which the kernels before write.
  const V* shared_row = reinterpret_cast<const V*>(shared_w + static_cast<int64_t>(row) * shared_inter);
  if (shared_w != nullptr && row < dim) {
    const V* rows[1] = {shared_row};
    prefetch_rows_l2(rows, lane, shared_inter / kN, kGroup, kDownBatch);
  }
  pdl_enter();
  if (row >= dim) return;
  float acc = 0.f;
  for (int j0 = 0; j0 < top_k; j0 += kDownPicks) {
    const V* a[kDownPicks];
    const V* wr[kDownPicks];
    float part[kDownPicks] = {};
#pragma unroll
    for (int jj = 0; jj < kDownPicks; ++jj) {
      const int64_t p = t * top_k + min(j0 + jj, top_k - 1);  // past the last pick: repeats it, not summed
      a[jj] = reinterpret_cast<const V*>(act + p * inter);
      wr[jj] = reinterpret_cast<const V*>(w + ids[p] * expert_stride + static_cast<int64_t>(row) * inter);
    }
    row_dots<T, kN, kDownPicks>(a, wr, inter / kN, lane, part);
#pragma unroll
    for (int jj = 0; jj < kDownPicks; ++jj) {  // in pick order
      const float y = round_to<T>(group_sum(part[jj]));
      if (j0 + jj < top_k) acc += weights[t * top_k + j0 + jj] * y;
    }
  }
  const int64_t i = t * dim + row;
  if (shared_w != nullptr) {  // the shared expert's output row: the addend
    const V* a[1] = {reinterpret_cast<const V*>(shared_act + t * shared_inter)};
    const V* wr[1] = {shared_row};
    float part[1] = {};
    row_dots<T, kN, 1>(a, wr, shared_inter / kN, lane, part);
    const float s = round_to<T>(group_sum(part[0]));
    if (lane == 0) out[i] = from_float<T>(round_to<T>(acc) + s);
  } else if (lane == 0) {
    out[i] = addend != nullptr ? from_float<T>(round_to<T>(acc) + to_float(addend[i])) : from_float<T>(acc);
  }
}

}  // namespace

const char* moe_gemv_up(uintptr_t x, int64_t x_stride, uintptr_t ids, int64_t tokens, int64_t top_k, uintptr_t w,
                        int64_t expert_stride, int64_t inter, uintptr_t shared_w, int64_t shared_inter, uintptr_t act,
                        int64_t dim, int dtype, uintptr_t stream) {
  if (tokens < 0 || top_k < 1 || inter < 1 || dim < 1) return "moe_gemv_up: needs tokens >= 0, top_k, inter, dim >= 1";
  if (shared_w != 0 && shared_inter < 1) return "moe_gemv_up: shared-expert weights need shared_inter >= 1";
  if (inter > INT32_MAX / 2 || shared_inter > INT32_MAX / 2 || dim > INT32_MAX) {
    return "moe_gemv_up: inter, shared_inter or dim too large";
  }
  if (tokens == 0) return nullptr;
  const int64_t pairs = tokens * top_k, blocks = pairs + (shared_w != 0 ? tokens : 0);
  if (blocks > INT32_MAX) return "moe_gemv_up: too many pairs";
  const int64_t rows = shared_w != 0 && shared_inter > inter ? shared_inter : inter;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(ceil_div(rows, kUpWarps * kUpRows)));
  if (grid.y > 65535) return "moe_gemv_up: inter too large";
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "moe_gemv_up", [&]() {
    constexpr int kN = 16 / sizeof(scalar_t);
    const bool vec = dim % kN == 0 && x % 16 == 0 && x_stride % kN == 0 && w % 16 == 0 && expert_stride % kN == 0 &&
                     shared_w % 16 == 0;
    auto launch = [&](auto kernel) {
      launch_kernel(
          kernel, grid, kUpThreads, 0, as_stream(stream),
          reinterpret_cast<const scalar_t*>(x), x_stride, reinterpret_cast<const int64_t*>(ids), pairs,
          static_cast<int>(top_k), reinterpret_cast<const scalar_t*>(w), expert_stride, static_cast<int>(inter),
          reinterpret_cast<const scalar_t*>(shared_w), static_cast<int>(shared_inter),
          reinterpret_cast<scalar_t*>(act), static_cast<int>(dim));
      return last_launch_error();
    };
    return vec ? launch(moe_gemv_up_kernel<scalar_t, kN>) : launch(moe_gemv_up_kernel<scalar_t, 1>);
  });
}

const char* moe_gemv_down(uintptr_t act, uintptr_t ids, uintptr_t weights, int64_t tokens, int64_t top_k, uintptr_t w,
                          int64_t expert_stride, int64_t inter, uintptr_t shared_act, uintptr_t shared_w,
                          int64_t shared_inter, uintptr_t addend, uintptr_t out, int64_t dim, int dtype,
                          uintptr_t stream) {
  if (tokens < 0 || top_k < 1 || inter < 1 || dim < 1) {
    return "moe_gemv_down: needs tokens >= 0, top_k, inter, dim >= 1";
  }
  if (shared_w != 0 && (shared_inter < 1 || shared_act == 0)) {
    return "moe_gemv_down: shared-expert weights need their activations and shared_inter >= 1";
  }
  if (shared_w != 0 && addend != 0) return "moe_gemv_down: the shared expert's output is the addend; pass one";
  if (inter > INT32_MAX || shared_inter > INT32_MAX || dim > INT32_MAX) {
    return "moe_gemv_down: inter, shared_inter or dim too large";
  }
  if (tokens == 0) return nullptr;
  if (tokens > INT32_MAX) return "moe_gemv_down: too many tokens";
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(ceil_div(dim, kWarps)));
  if (grid.y > 65535) return "moe_gemv_down: dim too large";
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "moe_gemv_down", [&]() {
    constexpr int kN = 16 / sizeof(scalar_t);
    const bool vec = inter % kN == 0 && act % 16 == 0 && w % 16 == 0 && expert_stride % kN == 0 &&
                     (shared_w == 0 || (shared_inter % kN == 0 && shared_act % 16 == 0 && shared_w % 16 == 0));
    auto launch = [&](auto kernel) {
      launch_kernel(
          kernel, grid, kThreads, 0, as_stream(stream),
          reinterpret_cast<const scalar_t*>(act), reinterpret_cast<const int64_t*>(ids),
          reinterpret_cast<const float*>(weights), static_cast<int>(top_k), reinterpret_cast<const scalar_t*>(w),
          expert_stride, static_cast<int>(inter), reinterpret_cast<const scalar_t*>(shared_act),
          reinterpret_cast<const scalar_t*>(shared_w), static_cast<int>(shared_inter),
          reinterpret_cast<const scalar_t*>(addend), reinterpret_cast<scalar_t*>(out), static_cast<int>(dim));
      return last_launch_error();
    };
    return vec ? launch(moe_gemv_down_kernel<scalar_t, kN>) : launch(moe_gemv_down_kernel<scalar_t, 1>);
  });
}

}  // namespace atom
