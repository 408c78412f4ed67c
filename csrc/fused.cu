// Small fused ops of the decode step. Each replaces a chain of 3-12 torch
// kernels whose launches, not their bytes, cost the time at decode batch
// sizes (inside a CUDA graph a node still costs ~1.5-2.5 us). Every one
// rounds to the model dtype exactly where its torch reference does (see
// atom/ops/cuda/reference.py), so the fp32 results agree to rounding order.
//
//   rms_norm     out = weight * round(x * rsqrt(mean(x^2) + eps)), x optionally round(x + residual) first
//   silu_mul     out = round(silu(gate)) * up, gate | up halves of one row
//   kda_gate     g = -exp(A_log[h]) * softplus(f + dt_bias) and beta = round(sigmoid(b))
//   kda_gate_proj  kda_gate with its two low-rank up-projections: f = round(f_a W_f^T) and the output
//                gate round(g_a W_g^T), at decode sizes
//   router_logits  logits = x W^T in fp32 (x in the model dtype, W fp32): the router's matmul at decode sizes
//   moe_route    sigmoid scores, top-k on score + bias, weights renormalised and scaled
//   moe_align    (token, pick) pairs grouped by expert: positions and group ends
//   moe_combine  out = round(sum_j w_j * y[row_j]) (+ addend), summed in pick order; row_j = pos_j, or
//                ids_j * T + t for every expert's output on every token (expert-major y)
//   advance_decode  the CUDA-graph decode buffers moved one step on (multi-step decoding)
//   pack_verification  a verification step's outcome in one tensor: each row's targets, accepted count, next drafts
//   settle_verification  verification rows planned while the step before ran, made right from its outcome
//   accept_drafts  each verified row's accepted drafts, its next token and its targets, from the checks of its drafts
#include <type_traits>

#include "kernel_common.h"

namespace atom {
namespace {

constexpr int kRowsPerBlock = 8;  // one 32-thread group per row
constexpr int kThreads = 256;
constexpr int kNormThreads = 512;  // rms_norm's largest block

// ---- rms_norm ---------------------------------------------------------------------------------------------------

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  v = group_sum(v);
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / kGroup) ? partial[lane] : 0.f;
  return group_sum(v);
}

// One block per row: at decode sizes there are few rows, and a row's loads
// must be spread over many threads to hide their latency. With a residual r,
// the row is first s = round(x + r) (written to sum), then normalised: the
// residual add of the layer before, fused.
//
// kVecs > 0: every row pointer 16-byte aligned and dim a multiple of a
// vector (16 bytes of T): each thread loads kVecs vectors of x (and r, and
// the weight) at once, so a row costs one memory latency, not one per
// element (dim 2304 in bf16: 288 threads, one vector each). kVecs == 0: any
// dim and alignment, element by element in loops.
template <typename T, int kVecs>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ residual, int64_t residual_stride,
                    T* __restrict__ sum, int64_t sum_stride, const T* __restrict__ weight, T* __restrict__ out,
                    int64_t out_stride, int dim, float eps) {
  pdl_enter();
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const T* rr = residual == nullptr ? nullptr : residual + row * residual_stride;
  T* sr = sum == nullptr ? nullptr : sum + row * sum_stride;
  T* o = out + row * out_stride;
  float ss = 0.f;
  if constexpr (kVecs > 0) {
    constexpr int kN = 16 / sizeof(T);
    using V = Pack<T, kN>;
    const int nvec = dim / kN;
    V xv[kVecs], wv[kVecs], rv[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {  // every load issued before the first use
      const int c = threadIdx.x + i * blockDim.x;
      if (c < nvec) {
        xv[i] = reinterpret_cast<const V*>(xr)[c];
        wv[i] = reinterpret_cast<const V*>(weight)[c];
        if (rr != nullptr) rv[i] = reinterpret_cast<const V*>(rr)[c];
      }
    }
    float v[kVecs][kN];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const bool in = threadIdx.x + i * blockDim.x < nvec;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        v[i][j] = in ? to_float(xv[i].v[j]) : 0.f;
        if (rr != nullptr) v[i][j] = in ? round_to<T>(v[i][j] + to_float(rv[i].v[j])) : 0.f;
        ss = fmaf(v[i][j], v[i][j], ss);
      }
      if (rr != nullptr && in) {
        V s;
#pragma unroll
        for (int j = 0; j < kN; ++j) s.v[j] = from_float<T>(v[i][j]);
        reinterpret_cast<V*>(sr)[threadIdx.x + i * blockDim.x] = s;
      }
    }
    const float inv = rsqrtf(block_sum(ss) / dim + eps);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < nvec) {
        V r;
#pragma unroll
        for (int j = 0; j < kN; ++j) r.v[j] = from_float<T>(to_float(wv[i].v[j]) * round_to<T>(v[i][j] * inv));
        reinterpret_cast<V*>(o)[c] = r;
      }
    }
  } else {
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
      float v = to_float(xr[d]);
      if (rr != nullptr) {
        v = round_to<T>(v + to_float(rr[d]));
        sr[d] = from_float<T>(v);
      }
      ss = fmaf(v, v, ss);
    }
    const float inv = rsqrtf(block_sum(ss) / dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
      const float v = rr != nullptr ? to_float(sr[d]) : to_float(xr[d]);  // sr[d]: this thread's own store
      o[d] = from_float<T>(to_float(weight[d]) * round_to<T>(v * inv));
    }
  }
}

// ---- silu_mul ---------------------------------------------------------------------------------------------------

// kN elements a thread: 16-byte vectors where rows, strides and width allow (16 / sizeof(T)), else 1.
template <typename T, int kN>
__global__ void silu_mul_kernel(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t rows, int64_t width) {
  pdl_enter();
  using V = Pack<T, kN>;
  const int64_t vecs = width / kN, n = rows * vecs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / vecs, c = i % vecs * kN;
    const V gate = *reinterpret_cast<const V*>(x + r * x_stride + c);
    const V up = *reinterpret_cast<const V*>(x + r * x_stride + width + c);
    V o;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const float a = to_float(gate.v[j]);
      o.v[j] = from_float<T>(round_to<T>(a / (1.f + expf(-a))) * to_float(up.v[j]));
    }
    *reinterpret_cast<V*>(out + r * out_stride + c) = o;
  }
}

// ---- kda_gate ---------------------------------------------------------------------------------------------------

// kda_gate's two formulas (also kda_gate_proj's): softplus as transformers writes it out (the identity above 20),
// and beta = sigmoid(b) rounded to the model dtype.
__device__ __forceinline__ float kda_softplus(float raw) { return raw > 20.f ? raw : logf(1.f + expf(raw)); }

template <typename T>
__device__ __forceinline__ float kda_beta(T b) { return round_to<T>(1.f / (1.f + expf(-to_float(b)))); }

// A thread takes kN channels of one token (one 16-byte load of f when kN > 1: the head dim and f's rows
// are multiples of kN) and writes their kN fp32 decays; then, past the decays, one beta a thread.
template <typename T, int kN>
__global__ void kda_gate_kernel(const T* f, int64_t f_stride, const float* dt_bias, const T* a_log, const T* b,
                                int64_t b_stride, float* g, float* beta, int64_t tokens, int heads, int head_dim) {
  pdl_enter();
  using V = Pack<T, kN>;
  const int64_t channels = static_cast<int64_t>(heads) * head_dim, vecs = channels / kN;
  const int64_t n_g = tokens * vecs, n = n_g + tokens * heads;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < n_g) {
      const int64_t t = i / vecs, c = i % vecs * kN;
      const V fv = *reinterpret_cast<const V*>(f + t * f_stride + c);
      const float decay = -expf(to_float(a_log[c / head_dim]));  // kN channels never straddle two heads
      float out[kN];
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const float raw = to_float(fv.v[j]) + dt_bias[c + j];
        out[j] = decay * kda_softplus(raw);
      }
      if constexpr (kN % 4 == 0) {
#pragma unroll
        for (int j = 0; j < kN; j += 4)
          *reinterpret_cast<Pack<float, 4>*>(g + t * channels + c + j) = {out[j], out[j + 1], out[j + 2], out[j + 3]};
      } else {
#pragma unroll
        for (int j = 0; j < kN; ++j) g[t * channels + c + j] = out[j];
      }
    } else {
      const int64_t j = i - n_g, t = j / heads, h = j % heads;
      beta[j] = kda_beta(b[t * b_stride + h]);
    }
  }
}

// ---- kda_gate_proj -----------------------------------------------------------------------------------------------

// At decode sizes KDA's two low-rank up-projections (W_f, W_g: [channels, dim], dim = 128 in Kimi-Linear) are
// 1 MB reads each, and as two linears and kda_gate they were three launches whose fixed cost outweighs their
// bytes. Here one launch: 16 lanes split a row's dot product (a 128-element bf16 row is one 16-byte vector a
// lane) for kProjRows rows and kTokens tokens; blocks [0, gridDim.x / 2) take W_f's rows, the rest W_g's, so a
// block reads one input. Where the rows take 16-byte loads (the layer's do), a token's sums do not depend on the
// other tokens of the launch.
constexpr int kProjLanes = 16;
constexpr int kProjRows = 2;  // rows a 16-lane group
constexpr int kProjRowsPerBlock = kThreads / kProjLanes * kProjRows;
constexpr int kProjMaxTokens = 8;  // tokens a block; a lane of the 16 finishes each (row, token) pair
static_assert(kProjRows * kProjMaxTokens <= kProjLanes, "kda_gate_proj: more pairs than lanes");
constexpr int kPrefetchLoads = 2;  // loads of each row a lane asks L2 for before pdl_enter (the layer's rows: 1)

template <typename T, int kN, int kTokens>  // kTokens <= kProjMaxTokens
__global__ void __launch_bounds__(kThreads)
    kda_gate_proj_kernel(const T* __restrict__ f_a, const T* __restrict__ g_a, int64_t x_stride,
                         const T* __restrict__ b, int64_t b_stride, int tokens, const T* __restrict__ w_f,
                         const T* __restrict__ w_g, int channels, int dim, const float* __restrict__ dt_bias,
                         const T* __restrict__ a_log, int heads, float* __restrict__ g, float* __restrict__ beta,
                         T* __restrict__ gate) {
  using V = Pack<T, kN>;
  const int t0 = blockIdx.y * kTokens;  // this block's tokens; those past `tokens` repeat the last, not written
  const int valid = min(kTokens, tokens - t0);
  const int half = gridDim.x / 2;
  const bool decay = blockIdx.x < half;  // W_f's rows: their sums become g; W_g's become the gate
  const int lane = threadIdx.x % kProjLanes;
  const int row0 = ((decay ? blockIdx.x : blockIdx.x - half) * (kThreads / kProjLanes) + threadIdx.x / kProjLanes) *
                   kProjRows;
  const T* w = decay ? w_f : w_g;
  const T* x = decay ? f_a : g_a;
  const V* wr[kProjRows];
#pragma unroll
  for (int r = 0; r < kProjRows; ++r) {  // a row past the end repeats the last, and is not written
    wr[r] = reinterpret_cast<const V*>(w + static_cast<int64_t>(min(row0 + r, channels - 1)) * dim);
  }
  const int vecs = dim / kN;
  prefetch_rows_l2(wr, lane, vecs, kProjLanes, kPrefetchLoads);  // the first weight loads' lines, before the wait
  pdl_enter();
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < valid * heads; i += kThreads) {
      const int64_t t = t0 + i / heads;
      beta[t * heads + i % heads] = kda_beta(b[t * b_stride + i % heads]);
    }
  }
  const V* xr[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) xr[t] = reinterpret_cast<const V*>(x + (t0 + min(t, valid - 1)) * x_stride);
  float acc[kProjRows][kTokens] = {};
  for (int c = lane; c < vecs; c += kProjLanes) {
    V wv[kProjRows];
#pragma unroll
    for (int r = 0; r < kProjRows; ++r) wv[r] = wr[r][c];
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      const V xv = xr[t][c];
#pragma unroll
      for (int r = 0; r < kProjRows; ++r) acc[r][t] += pack_dot<T, kN>(wv[r], xv);
    }
  }
  // Every lane ends up holding every sum; lane j keeps the one of pair j = (row r, token t), so the epilogue's
  // transcendentals run once, in parallel, not once a pair in turn.
  float mine = 0.f;
#pragma unroll
  for (int r = 0; r < kProjRows; ++r) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      float s = acc[r][t];
#pragma unroll
      for (int off = kProjLanes / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off, kProjLanes);
      if (lane == r * kTokens + t) mine = s;
    }
  }
  const int row = row0 + lane / kTokens, t = lane % kTokens;
  if (lane >= kProjRows * kTokens || row >= channels || t >= valid) return;
  const int64_t i = static_cast<int64_t>(t0 + t) * channels + row;
  if (decay) {  // kda_gate on the rounded projection
    const float raw = round_to<T>(mine) + dt_bias[row];
    g[i] = -expf(to_float(a_log[row / (channels / heads)])) * kda_softplus(raw);
  } else {
    gate[i] = from_float<T>(mine);
  }
}

// ---- router_logits ----------------------------------------------------------------------------------------------

// router_logits_per_token: one block of 32 groups (1024 threads) per token, no shared
// staging: each expert's dot product is split over `split` groups (E = 16: two groups of 32
// lanes per expert, each over half the dim), each lane issuing kRouterBatch
// 16-byte weight loads (4 with fp32 x: registers), with the matching x
// elements, before its first FMA.
// Both the weight and the token's row come from L2 after the first block.
// vec: dim % 4 == 0, w 16-byte aligned and x's rows aligned to 4 elements;
// else element by element.
constexpr int kRouterThreads = 1024;

template <typename T>
__global__ void __launch_bounds__(kRouterThreads)
    router_logits_per_token_kernel(const T* __restrict__ x, int64_t x_stride, const float* __restrict__ w,
                                   float* __restrict__ logits, int experts, int dim, int split, bool vec) {
  constexpr int kRouterBatch = sizeof(T) == 4 ? 4 : 5;
  __shared__ float partial[kRouterThreads / kGroup];
  const int64_t t = blockIdx.x;
  const T* xr = x + t * x_stride;
  const int group = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const int per_round = blockDim.x / kGroup / split;  // experts summed at once
  const int part = group % split, lanes = split * kGroup, l = part * kGroup + lane;
  if (vec && group / split < min(per_round, experts)) {  // the first round's weight lines, before the wait
    const float4* we[1] = {reinterpret_cast<const float4*>(w + static_cast<int64_t>(group / split) * dim)};
    prefetch_rows_l2(we, l, dim / 4, lanes, kRouterBatch);
  }
  pdl_enter();
  for (int e0 = 0; e0 < experts; e0 += per_round) {  // the same trip count in every group (syncs inside)
    const int e = e0 + group / split;
    float acc = 0.f;
    if (e < experts && group / split < per_round) {
      const float* we = w + static_cast<int64_t>(e) * dim;
      if (vec) {
        using X4 = Pack<T, 4>;
        const int n4 = dim / 4;
        for (int base = l; base < n4; base += lanes * kRouterBatch) {
          float4 wv[kRouterBatch];
          X4 xv[kRouterBatch];
#pragma unroll
          for (int c = 0; c < kRouterBatch; ++c) {
            const int i = base + c * lanes;
            if (i < n4) {
              wv[c] = reinterpret_cast<const float4*>(we)[i];
              xv[c] = reinterpret_cast<const X4*>(xr)[i];
            }
          }
#pragma unroll
          for (int c = 0; c < kRouterBatch; ++c) {
            if (base + c * lanes < n4) {
              acc = fmaf(to_float(xv[c].v[0]), wv[c].x, acc);
              acc = fmaf(to_float(xv[c].v[1]), wv[c].y, acc);
              acc = fmaf(to_float(xv[c].v[2]), wv[c].z, acc);
              acc = fmaf(to_float(xv[c].v[3]), wv[c].w, acc);
            }
          }
        }
      } else {
        for (int d = l; d < dim; d += lanes) acc = fmaf(to_float(xr[d]), we[d], acc);
      }
    }
    acc = group_sum(acc);
    if (split == 1) {
      if (lane == 0 && e < experts) logits[t * experts + e] = acc;
      continue;
    }
    if (lane == 0) partial[group] = acc;
    __syncthreads();
    if (part == 0 && lane == 0 && e < experts && group / split < per_round) {
      float total = 0.f;
      for (int s = 0; s < split; ++s) total += partial[group + s];
      logits[t * experts + e] = total;
    }
    __syncthreads();  // partial[] is rewritten next round
  }
}

// router_logits_spread: a block of 8 groups computes 4 experts for up to 8 tokens.
// Thread i of the block takes the 16-byte weight vectors i, i + 256, ... of each of
// the 4 rows (two passes' loads issued before the first FMA), each used for every
// token. So the router's weight (fp32, 256 x 2304 in Kimi-Linear: 2.4 MB) is read once
// per 8 tokens, spread over E/4 blocks, where the per-token kernel reads it all in
// each token's one block. Each group's 32 sums (4 experts x 8 tokens) are reduced
// across its lanes in 31 shuffles (lane l ends with sum l), then the 8 groups' in
// group order. A token's sums depend on the shapes only, not on the other tokens of
// the launch. vec: as for the per-token kernel.
constexpr int kRouterGroups = 8, kRouterRows = 4, kRouterTokens = 8, kRouterLoads = 2;
static_assert(kRouterRows * kRouterTokens == kGroup, "one sum per lane after the reduction");

// One step of router_logits_spread's reduce-scatter: sums [0, 2 off) -> [0, off), exchanged with the lane off
// away.
template <int off>
__device__ __forceinline__ void router_reduce_step(float* acc, int lane) {
  const bool upper = (lane & off) != 0;
#pragma unroll
  for (int k = 0; k < off; ++k) {
    const float send = upper ? acc[k] : acc[k + off];
    const float keep = upper ? acc[k + off] : acc[k];
    acc[k] = keep + __shfl_xor_sync(0xffffffffu, send, off, kGroup);
  }
}

template <typename T>
__global__ void __launch_bounds__(kRouterGroups * kGroup)
    router_logits_spread_kernel(const T* __restrict__ x, int64_t x_stride, const float* __restrict__ w,
                                float* __restrict__ logits, int64_t tokens, int experts, int dim, bool vec) {
  __shared__ float partial[kRouterGroups][kGroup];
  const int e0 = blockIdx.x * kRouterRows;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kRouterTokens;
  const int rows = min(kRouterRows, experts - e0);
  const int nt = tokens - t0 < kRouterTokens ? static_cast<int>(tokens - t0) : kRouterTokens;
  const T* xr = x + t0 * x_stride;
  const float* wr = w + static_cast<int64_t>(e0) * dim;
  constexpr int kStep = kRouterGroups * kGroup;
  if (vec) {  // the first weight loads' lines, before the wait (prefetch_l2); rows past `rows` repeat the last
    const float4* w4[kRouterRows];
#pragma unroll
    for (int r = 0; r < kRouterRows; ++r) {
      w4[r] = reinterpret_cast<const float4*>(wr + static_cast<int64_t>(min(r, rows - 1)) * dim);
    }
    prefetch_rows_l2(w4, threadIdx.x, dim / 4, kStep, kRouterLoads);
  }
  pdl_enter();
  float acc[kRouterRows * kRouterTokens] = {};  // [row][token]
  if (vec) {
    using X4 = Pack<T, 4>;
    const int n4 = dim / 4;
    for (int base = threadIdx.x; base < n4; base += kStep * kRouterLoads) {
      float4 wv[kRouterLoads][kRouterRows];
      X4 xv[kRouterLoads][kRouterTokens];
#pragma unroll
      for (int c = 0; c < kRouterLoads; ++c) {
        const int i = base + c * kStep;
#pragma unroll
        for (int r = 0; r < kRouterRows; ++r)
          if (i < n4 && r < rows) wv[c][r] = reinterpret_cast<const float4*>(wr + static_cast<int64_t>(r) * dim)[i];
#pragma unroll
        for (int t = 0; t < kRouterTokens; ++t)
          if (i < n4 && t < nt) xv[c][t] = reinterpret_cast<const X4*>(xr + t * x_stride)[i];
      }
#pragma unroll
      for (int c = 0; c < kRouterLoads; ++c) {
        if (base + c * kStep >= n4) continue;
#pragma unroll
        for (int r = 0; r < kRouterRows; ++r) {
#pragma unroll
          for (int t = 0; t < kRouterTokens; ++t) {
            if (r >= rows || t >= nt) continue;
            float& a = acc[r * kRouterTokens + t];
            a = fmaf(to_float(xv[c][t].v[0]), wv[c][r].x, a);
            a = fmaf(to_float(xv[c][t].v[1]), wv[c][r].y, a);
            a = fmaf(to_float(xv[c][t].v[2]), wv[c][r].z, a);
            a = fmaf(to_float(xv[c][t].v[3]), wv[c][r].w, a);
          }
        }
      }
    }
  } else {
    for (int d = threadIdx.x; d < dim; d += kStep) {
#pragma unroll
      for (int r = 0; r < kRouterRows; ++r) {
        const float wd = r < rows ? wr[static_cast<int64_t>(r) * dim + d] : 0.f;
#pragma unroll
        for (int t = 0; t < kRouterTokens; ++t)
          if (t < nt) acc[r * kRouterTokens + t] = fmaf(to_float(xr[t * x_stride + d]), wd, acc[r * kRouterTokens + t]);
      }
    }
  }
  // Reduce-scatter over the lanes: each step halves the sums a lane holds, keeping the half its lane bit picks.
  const int lane = threadIdx.x % kGroup;
  router_reduce_step<16>(acc, lane);
  router_reduce_step<8>(acc, lane);
  router_reduce_step<4>(acc, lane);
  router_reduce_step<2>(acc, lane);
  router_reduce_step<1>(acc, lane);
  partial[threadIdx.x / kGroup][lane] = acc[0];  // the group's sum for (row, token) = (lane / 8, lane % 8)
  __syncthreads();
  if (threadIdx.x >= kGroup) return;
  float total = 0.f;
#pragma unroll
  for (int g = 0; g < kRouterGroups; ++g) total += partial[g][lane];
  const int r = lane / kRouterTokens, t = lane % kRouterTokens;
  if (r < rows && t < nt) logits[(t0 + t) * experts + e0 + r] = total;
}

// ---- moe_route --------------------------------------------------------------------------------------------------

constexpr int kMaxExpertsPerLane = 8;  // up to 256 experts

// A float's bits as an unsigned number that orders like the float (-0 just below +0).
__device__ __forceinline__ unsigned ordered_bits(float v) {
  const unsigned u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The largest (kMax) or the smallest value over a 32-lane group: one instruction on sm_80+.
template <bool kMax>
__device__ __forceinline__ unsigned group_extreme_u32(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return kMax ? __reduce_max_sync(0xffffffffu, v) : __reduce_min_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int off = kGroup / 2; off > 0; off /= 2) {
    const auto other = static_cast<unsigned>(__shfl_xor_sync(0xffffffffu, v, off, kGroup));
    v = kMax ? max(v, other) : min(v, other);
  }
  return v;
#endif
}

// One 32-thread group per token. Lane l holds experts l, l + 32, ..., sorted best
// first by (biased score, then lowest id); each of the k rounds takes the best of
// the lanes' heads (the largest key, then the lowest id with it) and its owner
// drops it. Experts past the count have key 0, below any float's.
__global__ void __launch_bounds__(kRowsPerBlock * kGroup)
    moe_route_kernel(const float* logits, int64_t logits_stride, const float* bias, int64_t tokens, int experts,
                     int top_k, bool renormalize, float scale, int64_t* ids, float* weights) {
  pdl_enter();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kGroup;
  if (t >= tokens) return;  // whole groups: a group is a warp
  const int lane = threadIdx.x % kGroup;
  unsigned key[kMaxExpertsPerLane], id[kMaxExpertsPerLane];
  float score[kMaxExpertsPerLane], logit[kMaxExpertsPerLane], shift[kMaxExpertsPerLane];
  // Every load first, none behind a per-expert branch: issued together, they wait for one round trip, not one each
  // (loaded under `e < experts`, one after another, they cost 2.3 us more at 256 experts than at 32; session 26).
#pragma unroll
  for (int j = 0; j < kMaxExpertsPerLane; ++j) {
    const int e = min(lane + j * kGroup, experts - 1);  // past the count: a repeat, not used
    logit[j] = logits[t * logits_stride + e];
    shift[j] = bias != nullptr ? bias[e] : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kMaxExpertsPerLane; ++j) {
    const int e = lane + j * kGroup;
    score[j] = e < experts ? 1.f / (1.f + expf(-logit[j])) : 0.f;
    key[j] = e < experts ? ordered_bits(score[j] + shift[j]) : 0u;
    id[j] = static_cast<unsigned>(e);
  }
#pragma unroll
  for (int i = 1; i < kMaxExpertsPerLane; ++i) {  // insertion sort; equal keys keep their (id) order
#pragma unroll
    for (int j = i; j > 0; --j) {
      if (key[j] > key[j - 1]) {
        const unsigned k = key[j], d = id[j];
        const float sc = score[j];
        key[j] = key[j - 1], id[j] = id[j - 1], score[j] = score[j - 1];
        key[j - 1] = k, id[j - 1] = d, score[j - 1] = sc;
      }
    }
  }
  float picked_sum = 0.f, mine = 0.f;  // lane r keeps pick r's weight
  int64_t my_id = 0;
  for (int r = 0; r < top_k; ++r) {
    const unsigned best = group_extreme_u32<true>(key[0]);
    const unsigned pick = group_extreme_u32<false>(key[0] == best ? id[0] : 0xffffffffu);
    const float picked = __shfl_sync(0xffffffffu, score[0], static_cast<int>(pick % kGroup), kGroup);
    if (id[0] == pick) {  // the owner drops its head
#pragma unroll
      for (int j = 0; j + 1 < kMaxExpertsPerLane; ++j) key[j] = key[j + 1], id[j] = id[j + 1], score[j] = score[j + 1];
      key[kMaxExpertsPerLane - 1] = 0u;
    }
    picked_sum += picked;
    if (lane == r) {
      mine = picked;
      my_id = pick;
    }
  }
  if (lane < top_k) {
    const float w = renormalize ? mine / (picked_sum + 1e-20f) : mine;
    ids[t * top_k + lane] = my_id;
    weights[t * top_k + lane] = w * scale;
  }
}

// ---- moe_align --------------------------------------------------------------------------------------------------

constexpr int kAlignThreads = 1024;
constexpr int kAlignChunk = 4096;  // pairs staged in shared memory at a time

// One block. Thread t works on expert e = t % experts over segment s = t / experts
// of each chunk (segments = 1024 / experts of them), so a chunk of P pairs costs each
// thread P * experts / 1024 steps. Pass 1 counts each expert's pairs; pass 2 gives
// each pair its row: the expert's start, plus the expert's pairs in earlier chunks
// and earlier segments, plus its rank within the segment (pair order is kept).
__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int64_t* ids, int64_t pairs, int experts, int top_k, int64_t* src_token, int64_t* pos,
                     int32_t* ends) {
  pdl_enter();
  __shared__ int32_t chunk[kAlignChunk];
  __shared__ int32_t seg_count[kAlignThreads];  // [segment][expert]
  __shared__ int64_t base[1024];                 // per expert: first row not yet handed out
  const int segments = kAlignThreads / experts;
  const int e = threadIdx.x % experts, s = threadIdx.x / experts;
  const bool active = s < segments;
  if (threadIdx.x < experts) base[threadIdx.x] = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t first = 0; first < pairs; first += kAlignChunk) {
      const int n = static_cast<int>(pairs - first < kAlignChunk ? pairs - first : kAlignChunk);
      const int len = static_cast<int>(ceil_div(n, segments));
      const int lo = s * len, hi = min(n, lo + len);
      __syncthreads();  // the previous chunk's reads are done
      for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] = static_cast<int32_t>(ids[first + i]);
      __syncthreads();
      int count = 0;
      if (active)
        for (int i = lo; i < hi; ++i) count += chunk[i] == e;
      if (pass == 0) {  // totals only
        if (active && count) atomicAdd(reinterpret_cast<unsigned long long*>(&base[e]), count);
        continue;
      }
      seg_count[threadIdx.x] = count;
      __syncthreads();
      if (active) {
        int64_t row = base[e];
        for (int j = 0; j < s; ++j) row += seg_count[j * experts + e];
        for (int i = lo; i < hi; ++i) {
          if (chunk[i] != e) continue;
          pos[first + i] = row;
          src_token[row] = (first + i) / top_k;
          ++row;
        }
      }
      __syncthreads();  // every thread has read base[]
      if (active && s == segments - 1) {
        int64_t total = 0;
        for (int j = 0; j < segments; ++j) total += seg_count[j * experts + e];
        base[e] += total;
      }
    }
    if (pass == 0) {  // counts -> starts (exclusive) and ends (inclusive)
      __syncthreads();
      if (threadIdx.x == 0) {
        int64_t run = 0;
        for (int i = 0; i < experts; ++i) {
          const int64_t c = base[i];
          base[i] = run;
          run += c;
          ends[i] = static_cast<int32_t>(run);
        }
      }
    }
  }
}

// The tiled form, for many pairs: a block a tile of kAlignTile pairs, in two launches. First each tile's count
// of pairs per expert (counts [tiles, experts]); then each tile places its pairs, expert e's rows starting after
// every pair of a lower expert and after e's pairs in earlier tiles. A block loads its whole tile at once (one
// round trip to memory), then places kAlignTileThreads pairs a round: a pair's rank among its expert's pairs
// earlier in the round is counted over the round's ids in shared memory.
constexpr int kAlignTileThreads = 256, kAlignPerThread = 8, kAlignTile = kAlignTileThreads * kAlignPerThread;
// Fewer pairs: the one-block kernel above (one launch). On an H200 the tiled form took 22-25 us from 2048 to
// 64000 pairs, the one-block kernel 19.8 us at 2048 and 29.9 us at 4096 (GPU_NOTES.md, session 19).
constexpr int64_t kAlignTiledMinPairs = 3072;

__global__ void __launch_bounds__(kAlignTileThreads)
    moe_align_count_kernel(const int64_t* ids, int64_t pairs, int experts, int32_t* counts) {
  pdl_enter();
  __shared__ int32_t hist[1024];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kAlignTile;
  const int n = static_cast<int>(min(static_cast<int64_t>(kAlignTile), pairs - first));
  int mine[kAlignPerThread];
#pragma unroll
  for (int r = 0; r < kAlignPerThread; ++r) {
    const int i = r * kAlignTileThreads + threadIdx.x;
    mine[r] = i < n ? static_cast<int>(ids[first + i]) : -1;
  }
  __syncthreads();  // hist[] zeroed
#pragma unroll
  for (int r = 0; r < kAlignPerThread; ++r)
    if (mine[r] >= 0) atomicAdd(&hist[mine[r]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[blockIdx.x * experts + e] = hist[e];
}

__global__ void __launch_bounds__(kAlignTileThreads)
    moe_align_place_kernel(const int64_t* ids, int64_t pairs, int experts, int top_k, const int32_t* counts,
                           int64_t* src_token, int64_t* pos, int32_t* ends) {
  pdl_enter();
  constexpr int kPer = 1024 / kAlignTileThreads;  // experts a thread sums (consecutive ones)
  __shared__ int32_t base[1024];                   // per expert: this tile's next row
  __shared__ int32_t scan[kAlignTileThreads];
  __shared__ __align__(16) int32_t tile_ids[kAlignTile];
  const int tiles = static_cast<int>(gridDim.x), tid = threadIdx.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kAlignTile;
  const int n = static_cast<int>(min(static_cast<int64_t>(kAlignTile), pairs - first));
#pragma unroll
  for (int r = 0; r < kAlignPerThread; ++r) {  // the tile's ids, all loads in flight together
    const int i = r * kAlignTileThreads + tid;
    tile_ids[i] = i < n ? static_cast<int32_t>(ids[first + i]) : -1;
  }
  int32_t total[kPer], before[kPer], sum = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = tid * kPer + j;
    total[j] = before[j] = 0;
    if (e >= experts) continue;
    for (int t = 0; t < tiles; ++t) {
      const int32_t c = counts[t * experts + e];
      total[j] += c;
      if (t < static_cast<int>(blockIdx.x)) before[j] += c;
    }
    sum += total[j];
  }
  scan[tid] = sum;  // exclusive scan of the threads' sums (Hillis-Steele over kAlignTileThreads)
  __syncthreads();
  for (int off = 1; off < kAlignTileThreads; off *= 2) {
    const int32_t add = tid >= off ? scan[tid - off] : 0;
    __syncthreads();
    scan[tid] += add;
    __syncthreads();
  }
  int32_t start = scan[tid] - sum;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = tid * kPer + j;
    if (e >= experts) continue;
    base[e] = start + before[j];
    if (blockIdx.x == 0) ends[e] = start + total[j];
    start += total[j];
  }
  for (int done = 0; done < n; done += kAlignTileThreads) {
    const int i = done + tid;
    const int e = i < n ? tile_ids[i] : -1;
    __syncthreads();  // base[] in place (and, the first time, tile_ids[])
    if (e >= 0) {
      int32_t row = base[e];
      const int4* quads = reinterpret_cast<const int4*>(tile_ids + done);  // the round's earlier ids, four at a time
#pragma unroll 8
      for (int q = 0; q < tid / 4; ++q) {
        const int4 v = quads[q];
        row += (v.x == e) + (v.y == e) + (v.z == e) + (v.w == e);
      }
      for (int j = tid / 4 * 4; j < tid; ++j) row += tile_ids[done + j] == e;
      pos[first + i] = row;
      src_token[row] = (first + i) / top_k;
    }
    __syncthreads();  // every base[] read done
    if (e >= 0) atomicAdd(&base[e], 1);
  }
}

// ---- moe_combine ------------------------------------------------------------------------------------------------

// A thread sums kN consecutive elements of one token's row over its picks (16-byte loads and stores when
// kN > 1: the dim a multiple of kN), in pick order as the reference does.
template <typename T, int kN>
__global__ void moe_combine_kernel(const T* y, const int64_t* pos, const float* weights, const T* addend, T* out,
                                   int64_t tokens, int top_k, int64_t dim, int64_t pick_stride) {
  pdl_enter();
  using V = Pack<T, kN>;
  const int64_t vecs = dim / kN, n = tokens * vecs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / vecs, d = i % vecs * kN;
    float acc[kN] = {};
    for (int j = 0; j < top_k; ++j) {
      const int64_t p = pos[t * top_k + j], row = pick_stride > 0 ? p * pick_stride + t : p;
      const float w = weights[t * top_k + j];
      const V yv = *reinterpret_cast<const V*>(y + row * dim + d);
#pragma unroll
      for (int e = 0; e < kN; ++e) acc[e] += to_float(yv.v[e]) * w;
    }
    V o;
    if (addend != nullptr) {
      const V a = *reinterpret_cast<const V*>(addend + t * dim + d);
#pragma unroll
      for (int e = 0; e < kN; ++e) o.v[e] = from_float<T>(round_to<T>(acc[e]) + to_float(a.v[e]));
    } else {
#pragma unroll
      for (int e = 0; e < kN; ++e) o.v[e] = from_float<T>(acc[e]);
    }
    *reinterpret_cast<V*>(out + t * dim + d) = o;
  }
}


// ---- advance_decode -----------------------------------------------------------------------------------------

// The decode buffers' rows, in the order the CUDA-graph buffers hold them (atom/worker/cuda_graph.py).
enum DecodeRow { kInputIds, kPositions, kSlotMapping, kStateSlots, kStateOutSlots, kHasInitialState, kSeqLens };

__global__ void advance_decode_kernel(int64_t* rows, int64_t row_stride, const int64_t* tables, int64_t table_stride,
                                      const int64_t* next_ids, int64_t n, int64_t block_size) {
  pdl_enter();
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= n) return;
  auto at = [&](DecodeRow r) -> int64_t& { return rows[r * row_stride + c]; };
  const int64_t pos = at(kPositions) + 1;
  at(kInputIds) = next_ids[c];
  at(kPositions) = pos;
  at(kSeqLens) += 1;
  at(kHasInitialState) = 1;
  at(kStateSlots) = at(kStateOutSlots);
  at(kSlotMapping) = tables[c * table_stride + pos / block_size] * block_size + pos % block_size;
}

// Speculation with overlap (atom/worker/model_runner.py): a verification step's outcome, packed as
// targets [n, w] | accepted [n] | drafts [w - 1, n]. A row's accepted count is the leading run of its own drafts
// (the columns past its first with seq_len > 0) equal to the targets of the columns before them.
__global__ void pack_verification_kernel(const int64_t* rows, int64_t row_stride, const int64_t* targets,
                                         const int64_t* drafts, int64_t drafts_stride, int64_t n, int64_t width,
                                         int64_t k, int64_t* out) {
  pdl_enter();
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= n) return;
  const int64_t* ids = rows + kInputIds * row_stride + r * width;
  const int64_t* lens = rows + kSeqLens * row_stride + r * width;
  const int64_t* row_targets = targets + r * width;
  int64_t accepted = 0;
  while (accepted + 1 < width && lens[accepted + 1] > 0 && ids[accepted + 1] == row_targets[accepted]) ++accepted;
  for (int64_t j = 0; j < width; ++j) out[r * width + j] = row_targets[j];
  out[n * width + r] = accepted;
  for (int64_t d = 0; d < k; ++d) out[n * (width + 1) + d * n + r] = drafts[d * drafts_stride + r];
}

// Rows planned while the step before ran, written as if it had accepted every draft: for this step's row
// index[i] (its column index[m + i] there, index[2m + i] drafts planned for it), token j of the row reads that
// step's last emitted token (j = 0) or its (j-1)-th next draft, and moves back by the drafts it rejected.
__global__ void settle_verification_kernel(int64_t* rows, int64_t row_stride, const int64_t* tables,
                                           int64_t table_stride, const int64_t* index, int64_t m,
                                           const int64_t* packed, int64_t n_prev, int64_t width, int64_t block_size) {
  pdl_enter();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= m * width) return;
  const int64_t i = t / width, j = t % width;
  const int64_t here = index[i], there = index[m + i];
  const int64_t accepted = packed[n_prev * width + there];
  const int64_t back = index[2 * m + i] - accepted;
  const int64_t c = here * width + j;
  auto at = [&](DecodeRow r) -> int64_t& { return rows[r * row_stride + c]; };
  at(kInputIds) = j == 0 ? packed[there * width + accepted] : packed[n_prev * (width + 1) + (j - 1) * n_prev + there];
  const int64_t pos = at(kPositions) - back;
  at(kPositions) = pos;
  at(kSeqLens) = pos + 1;
  at(kSlotMapping) = tables[here * table_stride + pos / block_size] * block_size + pos % block_size;
  if (j == 0) {
    int64_t& state = rows[kStateSlots * row_stride + here];
    if (state >= 0) state -= back;
  }
}

// Row r's drafts (proposed[r, :num_drafts[r]]) checked in turn: draft j against the logits row at[r, j], where it
// holds if that row's token is the draft (probs == nullptr: greedy), else if u < p(draft) for u = exp(-E) of that
// row's last draw. out: accepted [n] | final [n] (the token of the first row not accepted) | targets [n, k + 1]
// (the accepted drafts, then final repeated).
__global__ void accept_drafts_kernel(const int64_t* tokens, const float* probs, const float* draws,
                                     int64_t draws_stride, const int64_t* at, const int64_t* proposed,
                                     int64_t proposed_stride, const int64_t* num_drafts, int64_t n, int64_t k,
                                     int64_t* out) {
  pdl_enter();
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= n) return;
  const int64_t* row_at = at + r * (k + 1);
  const int64_t* drafts = proposed + r * proposed_stride;
  const int64_t own = num_drafts[r] < k ? num_drafts[r] : k;
  int64_t accepted = 0;
  for (; accepted < own; ++accepted) {
    const int64_t row = row_at[accepted];
    const bool holds = probs == nullptr ? tokens[row] == drafts[accepted]
                                        : expf(-draws[row * draws_stride]) < probs[row];
    if (!holds) break;
  }
  const int64_t last = tokens[row_at[accepted]];
  out[r] = accepted;
  out[n + r] = last;
  for (int64_t j = 0; j <= k; ++j) out[2 * n + r * (k + 1) + j] = j < accepted ? drafts[j] : last;
}

unsigned elementwise_blocks(int64_t n) {
  const int64_t blocks = ceil_div(n, kThreads);
  return static_cast<unsigned>(blocks < 132 * 16 ? (blocks > 0 ? blocks : 1) : 132 * 16);
}

}  // namespace

const char* rms_norm(uintptr_t x, int64_t x_stride, uintptr_t residual, int64_t residual_stride, uintptr_t sum,
                     int64_t sum_stride, uintptr_t weight, uintptr_t out, int64_t out_stride, int64_t rows, int64_t dim,
                     double eps, int dtype, uintptr_t stream) {
  if (rows < 0 || dim < 1 || dim > INT32_MAX) return "rms_norm: needs rows >= 0 and dim >= 1";
  if ((residual == 0) != (sum == 0)) return "rms_norm: a residual needs a sum output, and only then";
  if (rows == 0) return nullptr;
  if (rows > INT32_MAX) return "rms_norm: too many rows";
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "rms_norm", [&]() {
    constexpr int64_t kN = 16 / sizeof(scalar_t);  // elements per 16-byte vector
    const auto aligned = [&](uintptr_t p, int64_t stride) { return p % 16 == 0 && stride % kN == 0; };
    const bool vec = dim % kN == 0 && aligned(x, x_stride) && aligned(weight, 0) && aligned(out, out_stride) &&
                     (residual == 0 || (aligned(residual, residual_stride) && aligned(sum, sum_stride)));
    const int64_t units = vec ? dim / kN : dim;  // what the threads share out: vectors, or elements
    const int threads = static_cast<int>(units >= kNormThreads ? kNormThreads : ceil_div(units, kGroup) * kGroup);
    const int64_t per = ceil_div(units, threads);
    auto launch = [&](auto kernel) {
      launch_kernel(
          kernel, static_cast<unsigned>(rows), threads, 0, as_stream(stream),
          reinterpret_cast<const scalar_t*>(x), x_stride, reinterpret_cast<const scalar_t*>(residual),
          residual_stride, reinterpret_cast<scalar_t*>(sum), sum_stride, reinterpret_cast<const scalar_t*>(weight),
          reinterpret_cast<scalar_t*>(out), out_stride, static_cast<int>(dim), static_cast<float>(eps));
      return last_launch_error();
    };
    if (vec && per == 1) return launch(rms_norm_kernel<scalar_t, 1>);
    if (vec && per == 2) return launch(rms_norm_kernel<scalar_t, 2>);
    if (vec && per <= 4) return launch(rms_norm_kernel<scalar_t, 4>);
    return launch(rms_norm_kernel<scalar_t, 0>);
  });
}

const char* silu_mul(uintptr_t x, int64_t x_stride, uintptr_t out, int64_t out_stride, int64_t rows, int64_t width,
                     int dtype, uintptr_t stream) {
  if (rows < 0 || width < 1) return "silu_mul: needs rows >= 0 and width >= 1";
  if (rows == 0) return nullptr;
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "silu_mul", [&]() {
    constexpr int kN = 16 / sizeof(scalar_t);
    const bool vec = x % 16 == 0 && out % 16 == 0 && width % kN == 0 && x_stride % kN == 0 && out_stride % kN == 0;
    auto launch = [&](auto kernel, int n) {
      launch_kernel(kernel, elementwise_blocks(rows * width / n), kThreads, 0, as_stream(stream),
                    reinterpret_cast<const scalar_t*>(x), x_stride, reinterpret_cast<scalar_t*>(out), out_stride, rows,
                    width);
      return last_launch_error();
    };
    return vec ? launch(silu_mul_kernel<scalar_t, kN>, kN) : launch(silu_mul_kernel<scalar_t, 1>, 1);
  });
}

const char* kda_gate(uintptr_t f, int64_t f_stride, uintptr_t dt_bias, uintptr_t a_log, uintptr_t b, int64_t b_stride,
                     uintptr_t g, uintptr_t beta, int64_t tokens, int64_t heads, int64_t head_dim, int dtype,
                     uintptr_t stream) {
  if (tokens < 0 || heads < 1 || head_dim < 1) return "kda_gate: needs tokens >= 0, heads >= 1, head_dim >= 1";
  if (tokens == 0) return nullptr;
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "kda_gate", [&]() {
    constexpr int kN = 16 / sizeof(scalar_t);
    const bool vec = f % 16 == 0 && dt_bias % 16 == 0 && g % 16 == 0 && head_dim % kN == 0 && f_stride % kN == 0;
    auto launch = [&](auto kernel, int n) {
      launch_kernel(
          kernel, elementwise_blocks(tokens * heads * (head_dim / n + 1)), kThreads, 0, as_stream(stream),
          reinterpret_cast<const scalar_t*>(f), f_stride, reinterpret_cast<const float*>(dt_bias),
          reinterpret_cast<const scalar_t*>(a_log), reinterpret_cast<const scalar_t*>(b), b_stride,
          reinterpret_cast<float*>(g), reinterpret_cast<float*>(beta), tokens, static_cast<int>(heads),
          static_cast<int>(head_dim));
      return last_launch_error();
    };
    return vec ? launch(kda_gate_kernel<scalar_t, kN>, kN) : launch(kda_gate_kernel<scalar_t, 1>, 1);
  });
}

const char* kda_gate_proj(uintptr_t f_a, uintptr_t g_a, int64_t x_stride, uintptr_t b, int64_t b_stride,
                          int64_t tokens, uintptr_t w_f, uintptr_t w_g, int64_t channels, int64_t dim,
                          uintptr_t dt_bias, uintptr_t a_log, int64_t heads, uintptr_t g, uintptr_t beta,
                          uintptr_t gate, int dtype, uintptr_t stream) {
  if (tokens < 0 || heads < 1 || dim < 1 || channels < 1 || channels % heads != 0) {
    return "kda_gate_proj: needs tokens >= 0, dim >= 1 and channels a positive multiple of heads >= 1";
  }
  if (x_stride < dim || b_stride < heads) return "kda_gate_proj: x_stride must be >= dim and b_stride >= heads";
  if (channels > INT32_MAX / 2 || dim > INT32_MAX || tokens > INT32_MAX) {
    return "kda_gate_proj: tokens, channels or dim too large";
  }
  if (tokens == 0) return nullptr;
  const int64_t row_blocks = ceil_div(channels, kProjRowsPerBlock);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "kda_gate_proj", [&]() {
    constexpr int kN = 16 / sizeof(scalar_t);
    const bool vec =
        dim % kN == 0 && x_stride % kN == 0 && f_a % 16 == 0 && g_a % 16 == 0 && w_f % 16 == 0 && w_g % 16 == 0;
    auto launch = [&](auto tokens_tag) -> const char* {
      constexpr int kT = decltype(tokens_tag)::value;
      const dim3 grid(static_cast<unsigned>(2 * row_blocks), static_cast<unsigned>(ceil_div(tokens, kT)));
      if (grid.y > 65535) return "kda_gate_proj: too many tokens";
      auto run = [&](auto kernel) {
        launch_kernel(kernel, grid, kThreads, 0, as_stream(stream), reinterpret_cast<const scalar_t*>(f_a),
                      reinterpret_cast<const scalar_t*>(g_a), x_stride, reinterpret_cast<const scalar_t*>(b),
                      b_stride, static_cast<int>(tokens), reinterpret_cast<const scalar_t*>(w_f),
                      reinterpret_cast<const scalar_t*>(w_g), static_cast<int>(channels), static_cast<int>(dim),
                      reinterpret_cast<const float*>(dt_bias), reinterpret_cast<const scalar_t*>(a_log),
                      static_cast<int>(heads), reinterpret_cast<float*>(g), reinterpret_cast<float*>(beta),
                      reinterpret_cast<scalar_t*>(gate));
        return last_launch_error();
      };
      return vec ? run(kda_gate_proj_kernel<scalar_t, kN, kT>) : run(kda_gate_proj_kernel<scalar_t, 1, kT>);
    };
    return tokens == 1   ? launch(std::integral_constant<int, 1>{})
           : tokens == 2 ? launch(std::integral_constant<int, 2>{})
           : tokens <= 4 ? launch(std::integral_constant<int, 4>{})
                         : launch(std::integral_constant<int, kProjMaxTokens>{});  // grid.y blocks of 8 tokens
  });
}

// The spread kernel where many experts are summed for few tokens (Kimi-Linear's 256 at decode: 8.0 against 38.1
// us at one token, 12.8 against 37.9 at 8; session 23); the per-token one elsewhere (the bench model's 16 experts:
// 7.3-11.6 against 7.7-13.6 us; 256 experts at 256 tokens: 71 against 118 us).
constexpr int64_t kRouterSpreadMinExperts = 64, kRouterSpreadMaxTokens = 64;

const char* router_logits(uintptr_t x, int64_t x_stride, uintptr_t weight, uintptr_t logits, int64_t tokens,
                          int64_t experts, int64_t dim, int dtype, uintptr_t stream) {
  if (tokens < 0 || experts < 1 || dim < 1) return "router_logits: needs tokens >= 0, experts >= 1, dim >= 1";
  if (tokens == 0) return nullptr;
  const bool spread = experts >= kRouterSpreadMinExperts && tokens <= kRouterSpreadMaxTokens;
  const int64_t groups = kRouterThreads / kGroup;
  const int split = static_cast<int>(experts >= groups ? 1 : groups / experts);  // groups summing one expert
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "router_logits", [&]() {
    const bool vec = dim % 4 == 0 && weight % 16 == 0 && x % (4 * sizeof(scalar_t)) == 0 && x_stride % 4 == 0;
    if (spread) {
      const dim3 grid(static_cast<unsigned>(ceil_div(experts, kRouterRows)),
                      static_cast<unsigned>(ceil_div(tokens, kRouterTokens)));
      launch_kernel(router_logits_spread_kernel<scalar_t>, grid, kRouterGroups * kGroup, 0, as_stream(stream),
                    reinterpret_cast<const scalar_t*>(x), x_stride, reinterpret_cast<const float*>(weight),
                    reinterpret_cast<float*>(logits), tokens, static_cast<int>(experts), static_cast<int>(dim), vec);
    } else {
      launch_kernel(
          router_logits_per_token_kernel<scalar_t>, static_cast<unsigned>(tokens), kRouterThreads, 0,
          as_stream(stream), reinterpret_cast<const scalar_t*>(x), x_stride, reinterpret_cast<const float*>(weight),
          reinterpret_cast<float*>(logits), static_cast<int>(experts), static_cast<int>(dim), split, vec);
    }
    return last_launch_error();
  });
}

const char* moe_route(uintptr_t logits, int64_t logits_stride, uintptr_t bias, int64_t tokens, int64_t experts,
                      int64_t top_k, bool renormalize, double scale, uintptr_t ids, uintptr_t weights,
                      uintptr_t stream) {
  if (experts < 1 || experts > kGroup * kMaxExpertsPerLane) return "moe_route: takes 1 to 256 experts";
  if (top_k < 1 || top_k > experts || top_k > kGroup) return "moe_route: needs 1 <= top_k <= min(experts, 32)";
  if (tokens <= 0) return tokens < 0 ? "moe_route: tokens < 0" : nullptr;
  launch_kernel(moe_route_kernel, static_cast<unsigned>(ceil_div(tokens, kRowsPerBlock)), kRowsPerBlock * kGroup, 0,
                as_stream(stream), reinterpret_cast<const float*>(logits), logits_stride,
                reinterpret_cast<const float*>(bias), tokens, static_cast<int>(experts), static_cast<int>(top_k),
                renormalize, static_cast<float>(scale), reinterpret_cast<int64_t*>(ids),
                reinterpret_cast<float*>(weights));
  return last_launch_error();
}

const char* moe_align(uintptr_t ids, int64_t pairs, int64_t experts, int64_t top_k, uintptr_t src_token, uintptr_t pos,
                      uintptr_t ends, uintptr_t workspace, uintptr_t stream) {
  if (experts < 1 || experts > 1024) return "moe_align: takes 1 to 1024 experts";
  if (top_k < 1 || pairs < 0 || pairs % top_k != 0) return "moe_align: pairs must be tokens * top_k";
  if (pairs > INT32_MAX) return "moe_align: too many pairs";
  const auto* id_ptr = reinterpret_cast<const int64_t*>(ids);
  auto* src_ptr = reinterpret_cast<int64_t*>(src_token);
  auto* pos_ptr = reinterpret_cast<int64_t*>(pos);
  auto* ends_ptr = reinterpret_cast<int32_t*>(ends);
  if (pairs < kAlignTiledMinPairs) {
    launch_kernel(moe_align_kernel, 1, kAlignThreads, 0, as_stream(stream), id_ptr, pairs, static_cast<int>(experts),
                  static_cast<int>(top_k), src_ptr, pos_ptr, ends_ptr);
    return last_launch_error();
  }
  if (workspace == 0) return "moe_align: needs moe_align_workspace_ints(pairs, experts) int32 of workspace";
  const auto tiles = static_cast<unsigned>(ceil_div(pairs, kAlignTile));
  auto* counts = reinterpret_cast<int32_t*>(workspace);
  launch_kernel(moe_align_count_kernel, tiles, kAlignTileThreads, 0, as_stream(stream), id_ptr, pairs,
                static_cast<int>(experts), counts);
  if (const char* err = last_launch_error()) return err;
  launch_kernel(moe_align_place_kernel, tiles, kAlignTileThreads, 0, as_stream(stream), id_ptr, pairs,
                static_cast<int>(experts), static_cast<int>(top_k), counts, src_ptr, pos_ptr, ends_ptr);
  return last_launch_error();
}

int64_t moe_align_workspace_ints(int64_t pairs, int64_t experts) {
  return pairs < kAlignTiledMinPairs ? 0 : ceil_div(pairs, kAlignTile) * experts;
}

const char* moe_combine(uintptr_t y, uintptr_t pos, uintptr_t weights, uintptr_t addend, uintptr_t out, int64_t tokens,
                        int64_t top_k, int64_t dim, int64_t pick_stride, int dtype, uintptr_t stream) {
  if (tokens < 0 || top_k < 1 || dim < 1) return "moe_combine: needs tokens >= 0, top_k >= 1, dim >= 1";
  if (tokens == 0) return nullptr;
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "moe_combine", [&]() {
    constexpr int kN = 16 / sizeof(scalar_t);
    const bool vec = y % 16 == 0 && addend % 16 == 0 && out % 16 == 0 && dim % kN == 0;
    auto launch = [&](auto kernel, int n) {
      launch_kernel(
          kernel, elementwise_blocks(tokens * dim / n), kThreads, 0, as_stream(stream),
          reinterpret_cast<const scalar_t*>(y), reinterpret_cast<const int64_t*>(pos),
          reinterpret_cast<const float*>(weights), reinterpret_cast<const scalar_t*>(addend),
          reinterpret_cast<scalar_t*>(out), tokens, static_cast<int>(top_k), dim, pick_stride);
      return last_launch_error();
    };
    return vec ? launch(moe_combine_kernel<scalar_t, kN>, kN) : launch(moe_combine_kernel<scalar_t, 1>, 1);
  });
}

const char* advance_decode(uintptr_t rows, int64_t row_stride, uintptr_t tables, int64_t table_stride,
                           uintptr_t next_ids, int64_t n, int64_t block_size, uintptr_t stream) {
  if (n < 0 || block_size < 1) return "advance_decode: needs n >= 0 and block_size >= 1";
  if (row_stride < n) return "advance_decode: row_stride < n (the rows would overlap)";
  if (n == 0) return nullptr;
  launch_kernel(
      advance_decode_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, as_stream(stream),
      reinterpret_cast<int64_t*>(rows), row_stride, reinterpret_cast<const int64_t*>(tables), table_stride,
      reinterpret_cast<const int64_t*>(next_ids), n, block_size);
  return last_launch_error();
}

const char* pack_verification(uintptr_t rows, int64_t row_stride, uintptr_t targets, uintptr_t drafts,
                              int64_t drafts_stride, int64_t n, int64_t width, int64_t k, uintptr_t out,
                              uintptr_t stream) {
  if (n < 0 || width < 1 || k < 0) return "pack_verification: needs n >= 0, width >= 1 and k >= 0";
  if (row_stride < n * width) return "pack_verification: row_stride < n * width";
  if (k > 0 && drafts_stride < n) return "pack_verification: drafts_stride < n";
  if (n == 0) return nullptr;
  launch_kernel(pack_verification_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0,
                as_stream(stream), reinterpret_cast<const int64_t*>(rows), row_stride,
                reinterpret_cast<const int64_t*>(targets), reinterpret_cast<const int64_t*>(drafts), drafts_stride, n,
                width, k, reinterpret_cast<int64_t*>(out));
  return last_launch_error();
}

const char* settle_verification(uintptr_t rows, int64_t row_stride, uintptr_t tables, int64_t table_stride,
                                uintptr_t index, int64_t m, uintptr_t packed, int64_t n_prev, int64_t width,
                                int64_t block_size, uintptr_t stream) {
  if (m < 0 || n_prev < 0 || width < 1 || block_size < 1) {
    return "settle_verification: needs m >= 0, n_prev >= 0, width >= 1 and block_size >= 1";
  }
  if (m == 0) return nullptr;
  launch_kernel(settle_verification_kernel, static_cast<unsigned>(ceil_div(m * width, kThreads)), kThreads, 0,
                as_stream(stream), reinterpret_cast<int64_t*>(rows), row_stride,
                reinterpret_cast<const int64_t*>(tables), table_stride, reinterpret_cast<const int64_t*>(index), m,
                reinterpret_cast<const int64_t*>(packed), n_prev, width, block_size);
  return last_launch_error();
}

const char* accept_drafts(uintptr_t tokens, uintptr_t probs, uintptr_t draws, int64_t draws_stride, uintptr_t at,
                          uintptr_t proposed, int64_t proposed_stride, uintptr_t num_drafts, int64_t n, int64_t k,
                          uintptr_t out, uintptr_t stream) {
  if (n < 0 || k < 0) return "accept_drafts: needs n >= 0 and k >= 0";
  if ((probs == 0) != (draws == 0)) return "accept_drafts: probs and draws come together (sampled) or not at all";
  if (k > 0 && proposed_stride < k) return "accept_drafts: proposed_stride < k";
  if (n == 0) return nullptr;
  launch_kernel(accept_drafts_kernel, static_cast<unsigned>(ceil_div(n, kThreads)), kThreads, 0, as_stream(stream),
                reinterpret_cast<const int64_t*>(tokens), reinterpret_cast<const float*>(probs),
                reinterpret_cast<const float*>(draws), draws_stride, reinterpret_cast<const int64_t*>(at),
                reinterpret_cast<const int64_t*>(proposed), proposed_stride,
                reinterpret_cast<const int64_t*>(num_drafts), n, k, reinterpret_cast<int64_t*>(out));
  return last_launch_error();
}

}  // namespace atom
