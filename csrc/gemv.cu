// Dense linears at decode batch sizes (atom/ops/cuda/linear.py: linear).
//
//   out[t, n] = round(x[t] . w[n] + bias[n])     for a few tokens t, every row n of w
//
// With one to eight tokens a linear is a read of its weight matrix. cuBLAS's
// small-M tiles read the decode step's short matrices (a few hundred rows,
// or rows of 128 elements) at 5-10% of the copy ceiling and its o_proj at
// 45% (GPU_NOTES.md, session 22): too few blocks are in flight to cover the
// memory's latency. Here a 32-thread group ("warp") computes kRows rows for
// every token, so each weight vector is loaded once and used for all of them;
// the tokens' vectors come from L1. A row's dot product can be split over
// `k_split` warps of the block (short matrices: more warps in flight), whose
// partial sums are added in shared memory in warp order, so a result does
// not depend on scheduling. Sums are fp32; the output is rounded once, after
// the bias, as cuBLAS's bias epilogue does.
//
// On CUDA cores, from two tokens on the kernel runs out of instruction issue
// before bandwidth on the larger matrices (a bf16 multiply-add and conversions
// per element and token), where cuBLAS's tensor-core tiles stay at the speed
// of one token; atom/ops/cuda/linear.py picks between them.
#include <type_traits>

#include "kernel_common.h"

namespace atom {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kGroup;
constexpr int kMaxTokens = 8;  // tokens a launch computes; more run as several launches
// Rows a warp computes, and vectors of each a lane loads before it uses the first: 4 16-byte loads in flight
// a lane. Of (rows, vectors) = (1, 2), (1, 4), (2, 2), (2, 4), (4, 1), (4, 2), this read the decode step's
// matrices fastest at one token (GPU_NOTES.md, session 22).
constexpr int kRows = 2;
constexpr int kBatch = 2;
constexpr int kPrefetchBatches = 1;  // batches of weight vectors a lane asks L2 for before pdl_enter

// kTokens tokens (tokens past `tokens` repeat the last and are not written) and kRows rows a warp; kN
// elements a load (a 16-byte vector, or one where rows or strides do not allow vectors).
template <typename T, int kN, int kTokens>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(const T* __restrict__ x, int64_t x_stride, int tokens, const T* __restrict__ w, int rows, int dim,
                const T* __restrict__ bias, T* __restrict__ out, int64_t out_stride, int k_split) {
  using V = Pack<T, kN>;
  __shared__ float part[kWarps][kRows][kTokens];  // each warp's sums, added in warp order below
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const int groups = kWarps / k_split;  // row groups a block; a group's k_split warps split its dot products
  const int slice = warp % k_split;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * groups + warp / k_split) * kRows;
  const V* wr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {  // a row past the end repeats the last, and is not written
    const int64_t row = row0 + r < rows ? row0 + r : rows - 1;
    wr[r] = reinterpret_cast<const V*>(w + row * dim);
  }
  const V* xr[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) xr[t] = reinterpret_cast<const V*>(x + min(t, tokens - 1) * x_stride);

  const int vecs = dim / kN, step = kGroup * k_split;
  prefetch_rows_l2(wr, slice * kGroup + lane, vecs, step, kBatch * kPrefetchBatches);  // before the wait
  pdl_enter();

  float acc[kRows][kTokens] = {};
  for (int c0 = slice * kGroup + lane; c0 < vecs; c0 += step * kBatch) {
    V wv[kBatch][kRows];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {  // every weight load of the batch issued before the first use
      const int c = min(c0 + b * step, vecs - 1);  // past the end: reloads the last vector, not summed
#pragma unroll
      for (int r = 0; r < kRows; ++r) wv[b][r] = wr[r][c];
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int c = c0 + b * step;
      if (c < vecs) {
#pragma unroll
        for (int t = 0; t < kTokens; ++t) {
          const V xv = xr[t][c];
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[r][t] += pack_dot<T, kN>(wv[b][r], xv);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      const float s = group_sum(acc[r][t]);
      if (lane == 0) part[warp][r][t] = s;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < groups * kRows * kTokens; i += kThreads) {
    const int g = i / (kRows * kTokens), r = i / kTokens % kRows, t = i % kTokens;
    const int64_t row = (static_cast<int64_t>(blockIdx.x) * groups + g) * kRows + r;
    if (row >= rows || t >= tokens) continue;
    float s = 0.f;
    for (int k = 0; k < k_split; ++k) s += part[g * k_split + k][r][t];
    if (bias != nullptr) s += to_float(bias[row]);
    out[t * out_stride + row] = from_float<T>(s);
  }
}

// The smallest k_split (1, 2, 4 or 8) that puts at least kWarpsPerSm warps of work on every SM, without
// leaving a lane less than one vector of a row. It depends on the shape alone, not on the number of tokens,
// so a token's sums run in the same order in any launch. (32 warps an SM read the decode step's short
// matrices fastest of 16 and 32, GPU_NOTES.md, session 22.)
constexpr int kWarpsPerSm = 32;
int choose_k_split(int64_t rows, int64_t vecs, int sms) {
  const int64_t row_warps = ceil_div(rows, kRows);
  int k_split = 1;
  while (k_split < kWarps && row_warps * k_split < static_cast<int64_t>(kWarpsPerSm) * sms &&
         vecs >= static_cast<int64_t>(kGroup) * 2 * k_split) {
    k_split *= 2;
  }
  return k_split;
}

template <typename T, int kN, int kTokens>
const char* launch_gemv(const T* x, int64_t x_stride, int tokens, const T* w, int rows, int dim, const T* bias,
                        T* out, int64_t out_stride, int k_split, int sms, cudaStream_t stream) {
  if (k_split == 0) k_split = choose_k_split(rows, dim / kN, sms);
  const int64_t blocks = ceil_div(rows, static_cast<int64_t>(kWarps / k_split) * kRows);
  if (blocks > INT32_MAX) return "gemv: too many rows";
  launch_kernel(gemv_kernel<T, kN, kTokens>, static_cast<unsigned>(blocks), kThreads, 0, stream, x, x_stride, tokens,
                w, rows, dim, bias, out, out_stride, k_split);
  return last_launch_error();
}

}  // namespace

const char* gemv(uintptr_t x, int64_t x_stride, int64_t tokens, uintptr_t w, int64_t rows, int64_t dim, uintptr_t bias,
                 uintptr_t out, int64_t out_stride, int64_t k_split, int dtype, uintptr_t stream) {
  if (tokens < 0 || rows < 1 || dim < 1) return "gemv: needs tokens >= 0, rows >= 1 and dim >= 1";
  if (rows > INT32_MAX || dim > INT32_MAX) return "gemv: rows and dim must be below 2^31";
  if (x_stride < dim || out_stride < rows) return "gemv: x_stride must be >= dim and out_stride >= rows";
  if (k_split != 0 && k_split != 1 && k_split != 2 && k_split != 4 && k_split != 8) {
    return "gemv: k_split must be 0 (chosen here), 1, 2, 4 or 8";
  }
  if (tokens == 0) return nullptr;
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return last_launch_error();
  }
  const auto s = as_stream(stream);
  const int n = static_cast<int>(rows), d = static_cast<int>(dim);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "gemv", [&]() {
    constexpr int kN = 16 / sizeof(scalar_t);
    const bool vec = dim % kN == 0 && x % 16 == 0 && x_stride % kN == 0 && w % 16 == 0;
    const auto* xp = reinterpret_cast<const scalar_t*>(x);
    const auto* wp = reinterpret_cast<const scalar_t*>(w);
    const auto* bp = reinterpret_cast<const scalar_t*>(bias);
    auto* op = reinterpret_cast<scalar_t*>(out);
    const int ks = static_cast<int>(k_split);
    for (int64_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {  // eight tokens a launch, each launch reading w
      const int m = static_cast<int>(tokens - t0 < kMaxTokens ? tokens - t0 : kMaxTokens);
      const scalar_t* xt = xp + t0 * x_stride;
      scalar_t* ot = op + t0 * out_stride;
      auto launch = [&](auto tokens_tag) -> const char* {
        constexpr int kT = decltype(tokens_tag)::value;
        return vec ? launch_gemv<scalar_t, kN, kT>(xt, x_stride, m, wp, n, d, bp, ot, out_stride, ks, sms, s)
                   : launch_gemv<scalar_t, 1, kT>(xt, x_stride, m, wp, n, d, bp, ot, out_stride, ks, sms, s);
      };
      const char* error = m == 1   ? launch(std::integral_constant<int, 1>{})
                          : m == 2 ? launch(std::integral_constant<int, 2>{})
                          : m <= 4 ? launch(std::integral_constant<int, 4>{})
                                   : launch(std::integral_constant<int, 8>{});
      if (error != nullptr) return error;
    }
    return static_cast<const char*>(nullptr);
  });
}

}  // namespace atom
