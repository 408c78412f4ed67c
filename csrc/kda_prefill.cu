// KDA prefill over varlen packed sequences: the chunked (WY) form of the
// gated delta rule, reading each sequence's initial state from the fp32 slot
// pool and writing its final state back.
//
// Per head, chunks of C = 16 tokens. With q, k l2-normalised (q also scaled),
// G_t = cumsum(g)_t inside the chunk (inclusive, per channel, <= 0) and S the
// state at the chunk start (atom/ops/kda.py::kda_chunked has the derivation):
//
//   A[t, j] = sum_c k_tc k_jc exp(G_tc - G_jc)    (j < t)    intra-chunk k.k
//   P[t, j] = sum_c q_tc k_jc exp(G_tc - G_jc)    (j <= t)   intra-chunk q.k
//   Tb      = (I + diag(beta) A)^-1 diag(beta)               forward substitution
//   U       = Tb (V - (k * exp(G)) S)                         the delta corrections
//   O       = (q * exp(G)) S + P U
//   S      <- exp(G_last) * S + (k * exp(G_last - G))^T U
//
// Every exponent is <= 0 (j <= t), so no exp can overflow whatever the decay.
//
// Two kernels:
//   1. kda_prefill_chunk_kernel, one block per (chunk, head), all chunks in
//      parallel: the V-independent part (norm factors, Tb, P) into a scratch
//      buffer.
//   2. the scan, one block per (sequence, head, V tile): walks the sequence's
//      chunks in order carrying S in registers, each chunk's inputs loaded
//      while the chunk before is worked on. Two forms:
//      - kda_prefill_scan_tc_kernel (below, sm_80+): the products on tensor
//        cores, tf32 operands, fp32 accumulation and state; bf16/fp16's
//        default (2.7-3.4x as fast as the fp32 form on an H200: GPU_NOTES.md,
//        session 18);
//      - kda_prefill_scan_kernel: fp32 throughout on CUDA cores, S [K, VT];
//        independent sums (four tokens in stage 2, a thread's elements in
//        stage 3) are interleaved: with one block of 4 warps per SM nothing
//        else hides the latency (1.3-2.2x faster, same results to the bit:
//        GPU_NOTES.md, session 10).
//
// kda_prefill_scan_kernel's threads, for a V tile of VT columns and RG row groups:
//
//   thread = rg + RG * cp      cp: column pair (2 columns, float2)
//                              rg: rows 4 * (rg + RG * m) .. + 3, m < K / (4 RG)
//
// so the RG lanes that share a column pair sit side by side in one warp:
// (k * exp(G)) S and (q * exp(G)) S are summed over them with shuffles, and
// their float4 reads of a row quad hit distinct banks.
//
// Chunk ids (where a chunk's Tb and P live in the scratch): chunk i of
// sequence n is cu[n] / C + n + i. Ids are distinct across sequences and
// below T / C + N, so the scratch size needs no host sync.
#include <type_traits>

#include "kernel_common.h"

#if !defined(__HIPCC__) && !defined(USE_ROCM)
#define ATOM_KDA_SCAN_TC 1
#include "mma_sm80.h"
#endif

namespace atom {
namespace {

constexpr int kChunk = 16;
constexpr int kMaxKeyDim = 128;
constexpr int kMatFloats = 2 * kChunk * kChunk;  // Tb then P, per chunk and head

struct PrefillParams {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_st, k_st, v_st;  // token strides in elements; each token's [H, D] contiguous
  const float* g;            // [T, H, K]
  const float* beta;         // [T, H]
  const void* cu_seqlens;    // [N + 1], int32 or int64
  bool cu_is64;
  float* state;
  int64_t slot_stride;
  const int64_t* in_slots;
  const int64_t* out_slots;
  const uint8_t* has_initial_state;
  void* out;    // [T, H, V]
  float* mats;  // [T / C + N, H, 2, C, C]
  float* norms; // [T, H, 2]: q factor (scale included), k factor
  int num_seqs, heads, key_dim, value_dim;
  float scale, eps;
};

__device__ __forceinline__ int64_t seq_start(const PrefillParams& p, int n) {
  return load_index(p.cu_seqlens, n, p.cu_is64);
}

__device__ __forceinline__ int64_t chunk_base(const PrefillParams& p, int n) { return seq_start(p, n) / kChunk + n; }

// exp(x) for x <= 0 in the intra-chunk sums: expf for fp32 inputs (the fp32 scan keeps fp32 throughout), the
// hardware approximation for bf16/fp16 (their scan rounds operands to tf32, far coarser than its error; the
// chunk kernel is bound by these exps).
template <typename T>
__device__ __forceinline__ float pair_exp(float x) {
  if constexpr (std::is_same_v<T, float>) return expf(x);
  else return __expf(x);
}

// grid (T / C + N, H), block 128 (4 warps).
template <typename T>
__global__ void __launch_bounds__(128) kda_prefill_chunk_kernel(PrefillParams p) {
  __shared__ float qn[kChunk][kMaxKeyDim];
  __shared__ float kn[kChunk][kMaxKeyDim];
  __shared__ float cum[kChunk][kMaxKeyDim];
  __shared__ float a_s[kChunk][kChunk + 1];
  __shared__ float beta_s[kChunk];

  const int64_t id = blockIdx.x;
  const int h = blockIdx.y;
  // the sequence holding this id: the last n with chunk_base(n) <= id (chunk_base increases with n)
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (chunk_base(p, mid) <= id) lo = mid;
    else hi = mid - 1;
  }
  const int64_t t0 = seq_start(p, lo) + (id - chunk_base(p, lo)) * kChunk;
  const int64_t end = seq_start(p, lo + 1);
  if (t0 >= end) return;  // an id past its sequence's last chunk
  const int len = static_cast<int>(end - t0 < kChunk ? end - t0 : kChunk);
  const int K = p.key_dim, H = p.heads;
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  constexpr int kWarps = 4;

  // l2-normalise q and k of each token (one warp per token); padding rows are zero
  for (int t = warp; t < kChunk; t += kWarps) {
    const int64_t tok = t0 + t;
    if (t >= len) {
      for (int c = lane; c < K; c += kGroup) qn[t][c] = kn[t][c] = 0.f;
      if (lane == 0) beta_s[t] = 0.f;
      continue;
    }
    const T* qp = static_cast<const T*>(p.q) + tok * p.q_st + static_cast<int64_t>(h) * K;
    const T* kp = static_cast<const T*>(p.k) + tok * p.k_st + static_cast<int64_t>(h) * K;
    float sq = 0.f, sk = 0.f;
    for (int c = lane; c < K; c += kGroup) {
      const float x = to_float(qp[c]), y = to_float(kp[c]);
      qn[t][c] = x;
      kn[t][c] = y;
      sq = fmaf(x, x, sq);
      sk = fmaf(y, y, sk);
    }
    const float qf = p.scale / sqrtf(group_sum(sq) + p.eps);
    const float kf = 1.f / sqrtf(group_sum(sk) + p.eps);
    for (int c = lane; c < K; c += kGroup) {  // this lane wrote these: no barrier needed
      qn[t][c] *= qf;
      kn[t][c] *= kf;
    }
    if (lane == 0) {
      p.norms[(tok * H + h) * 2] = qf;
      p.norms[(tok * H + h) * 2 + 1] = kf;
      beta_s[t] = p.beta[tok * H + h];
    }
  }
  for (int c = threadIdx.x; c < K; c += blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < kChunk; ++t) {
      if (t < len) acc += p.g[((t0 + t) * H + h) * K + c];
      cum[t][c] = acc;
    }
  }
  __syncthreads();

  // A and P, one row t per warp at a time; rows spread so every warp gets 34 (t, j) pairs
  float* mats = p.mats + (id * H + h) * kMatFloats;
  float* pm = mats + kChunk * kChunk;
  constexpr int kSlices = kMaxKeyDim / kGroup;
  for (int r = 0; r < kChunk / kWarps; ++r) {
    const int t = (r % 2 == 0) ? r / 2 * 2 * kWarps + warp : (r / 2 + 1) * 2 * kWarps - 1 - warp;
    float qt[kSlices], kt[kSlices], gt[kSlices];
#pragma unroll
    for (int m = 0; m < kSlices; ++m) {
      const int c = lane + m * kGroup;
      qt[m] = c < K ? qn[t][c] : 0.f;
      kt[m] = c < K ? kn[t][c] : 0.f;
      gt[m] = c < K ? cum[t][c] : 0.f;
    }
    for (int j = 0; j <= t; ++j) {
      float a = 0.f, s = 0.f;
#pragma unroll
      for (int m = 0; m < kSlices; ++m) {
        const int c = lane + m * kGroup;
        if (c < K) {
          const float kj = kn[j][c] * pair_exp<T>(gt[m] - cum[j][c]);
          a = fmaf(kt[m], kj, a);
          s = fmaf(qt[m], kj, s);
        }
      }
      a = group_sum(a);
      s = group_sum(s);
      if (lane == 0) {
        a_s[t][j] = a;
        pm[t * kChunk + j] = s;
      }
    }
    if (lane > t && lane < kChunk) pm[t * kChunk + lane] = 0.f;
  }
  __syncthreads();

  // Tb = (I + diag(beta) A)^-1 diag(beta), one column per thread, forward substitution
  if (threadIdx.x < kChunk) {
    const int j = threadIdx.x;
    float x[kChunk];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      float acc = 0.f;
#pragma unroll
      for (int s = 0; s < t; ++s) acc = fmaf(a_s[t][s], x[s], acc);
      x[t] = t < j ? 0.f : (t == j ? 1.f : -beta_s[t] * acc);
    }
#pragma unroll
    for (int t = 0; t < kChunk; ++t) mats[t * kChunk + j] = x[t] * beta_s[j];
  }
}

// A padding sequence's output rows (tokens start .. end) in this block's V tile: zeros.
template <int VT, int kThreads, typename T>
__device__ __forceinline__ void zero_output(const PrefillParams& p, T* out, int h, int tile, int64_t start,
                                            int64_t end) {
  for (int64_t i = threadIdx.x; i < (end - start) * VT; i += kThreads) {
    const int64_t tok = start + i / VT;
    const int c = tile + static_cast<int>(i % VT);
    if (c < p.value_dim) out[(tok * p.heads + h) * p.value_dim + c] = from_float<T>(0.f);
  }
}

// A chunk's inputs to the scan, in registers: loaded while the chunk before is worked on, so their
// latency hides behind its stages 2 and 3 (one block of 4 warps per SM: nothing else would hide it).
// Thread tid holds elements tid + i * kThreads of Tb | P and of the [C, VT] v tile (as stage 1 stores
// them), norm factor tid (tid < 2 C), and the chunk's g, k, q in column c = tid (tid < KP).
template <typename T, int KP, int VT, int kThreads>
struct ChunkInputs {
  static constexpr int kMats = kMatFloats / kThreads, kV = kChunk * VT / kThreads;
  static_assert(kMatFloats % kThreads == 0 && kChunk * VT % kThreads == 0, "whole elements per thread");
  static_assert(2 * kChunk <= kThreads && KP <= kThreads, "one norm factor and one column per thread at most");
  float mats[kMats], v[kV], nf, g[kChunk], k[kChunk], q[kChunk];

  __device__ __forceinline__ void load(const PrefillParams& p, int h, int tile, int64_t t0, int64_t id, int len) {
    const int tid = threadIdx.x, K = p.key_dim, V = p.value_dim, H = p.heads;
    const float* src = p.mats + (id * H + h) * kMatFloats;
#pragma unroll
    for (int i = 0; i < kMats; ++i) mats[i] = src[tid + i * kThreads];
    nf = tid < 2 * kChunk && tid / 2 < len ? p.norms[((t0 + tid / 2) * H + h) * 2 + tid % 2] : 0.f;
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      const int e = tid + i * kThreads, t = e / VT, c = tile + e % VT;
      v[i] = t < len && c < V ? to_float(static_cast<const T*>(p.v)[(t0 + t) * p.v_st + h * V + c]) : 0.f;
    }
    const int64_t at = static_cast<int64_t>(h) * K + tid;
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      const bool ok = t < len && tid < K;
      g[t] = ok ? p.g[(t0 + t) * H * K + at] : 0.f;
      k[t] = ok ? to_float(static_cast<const T*>(p.k)[(t0 + t) * p.k_st + at]) : 0.f;
      q[t] = ok ? to_float(static_cast<const T*>(p.q)[(t0 + t) * p.q_st + at]) : 0.f;
    }
  }
};

// Stage 3's products by a lower-triangular [C, C] matrix: acc[i] += sum over j <= t of m[t][j] x[j][c] for
// this thread's tokens t = t0 + i * kStride, each summed over j in order. The kE sums run side by side, so
// their chains of FMAs overlap (one block of 4 warps per SM: nothing else would hide their latency).
template <int kStride, int kE, int VT>
__device__ __forceinline__ void stage3_rows(float (&acc)[kE], const float (&m)[kChunk][kChunk],
                                            const float (&x)[kChunk][VT], int t0, int c, int len) {
  for (int j = 0; j < len; ++j) {
    const float xj = x[j][c];
#pragma unroll
    for (int i = 0; i < kE; ++i) {
      const int t = t0 + i * kStride;
      if (j <= t) acc[i] = fmaf(m[t][j], xj, acc[i]);
    }
  }
}

// grid (N, H, ceil(V / VT)), block RG * VT / 2. KP: key_dim rounded up (64 or 128).
template <typename T, int KP, int VT, int RG>
__global__ void __launch_bounds__(RG* VT / 2) kda_prefill_scan_kernel(PrefillParams p) {
  constexpr int kThreads = RG * VT / 2;
  constexpr int kQuads = KP / (4 * RG);  // row quads per thread
  __shared__ __align__(16) float kg[kChunk][KP];  // k * exp(G)
  __shared__ __align__(16) float qg[kChunk][KP];  // q * exp(G)
  __shared__ __align__(16) float kd[kChunk][KP];  // k * exp(G_last - G)
  __shared__ float decay_last[KP];                // exp(G_last)
  __shared__ float tb[kChunk][kChunk], pm[kChunk][kChunk];
  __shared__ float vx[kChunk][VT];  // v, then v - (k * exp(G)) S
  __shared__ float ys[kChunk][VT];  // (q * exp(G)) S
  __shared__ __align__(8) float us[kChunk][VT];
  __shared__ float nf[kChunk][2];

  const int n = blockIdx.x, h = blockIdx.y;
  const int rg = threadIdx.x % RG, cp = threadIdx.x / RG;
  const int tile = blockIdx.z * VT;
  const int col = tile + 2 * cp;  // this thread's columns: col, col + 1
  const int K = p.key_dim, V = p.value_dim, H = p.heads;
  const int64_t start = seq_start(p, n), end = seq_start(p, n + 1);
  T* out = static_cast<T*>(p.out);
  const int64_t slot = p.in_slots[n];
  if (slot < 0) {  // padding sequence: zero output, no state touched
    zero_output<VT, kThreads>(p, out, h, tile, start, end);
    return;
  }
  const bool init = p.has_initial_state == nullptr || p.has_initial_state[n] != 0;
  const int64_t head_offset = static_cast<int64_t>(h) * K * V;

  float2 s[4 * kQuads];
  {
    const float* src = p.state + slot * p.slot_stride + head_offset;
#pragma unroll
    for (int m = 0; m < kQuads; ++m) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = 4 * (rg + RG * m) + r;
        const bool ok = init && row < K;
        s[4 * m + r].x = ok && col < V ? src[row * V + col] : 0.f;
        s[4 * m + r].y = ok && col + 1 < V ? src[row * V + col + 1] : 0.f;
      }
    }
  }

  const int64_t base_id = chunk_base(p, n);
  auto chunk_len = [&](int64_t t0) { return static_cast<int>(end - t0 < kChunk ? end - t0 : kChunk); };
  ChunkInputs<T, KP, VT, kThreads> in;
  if (start < end) in.load(p, h, tile, start, base_id, chunk_len(start));
  for (int64_t t0 = start, id = base_id; t0 < end; t0 += kChunk, ++id) {
    const int len = chunk_len(t0);
    // ---- stage 1: this chunk's inputs into shared memory
    if (threadIdx.x < 2 * kChunk) nf[threadIdx.x / 2][threadIdx.x % 2] = in.nf;
#pragma unroll
    for (int i = 0; i < in.kMats; ++i) {  // element e of Tb, then of P
      const int e = threadIdx.x + i * kThreads, at = e % (kChunk * kChunk);
      if (e < kChunk * kChunk) tb[at / kChunk][at % kChunk] = in.mats[i];
      else pm[at / kChunk][at % kChunk] = in.mats[i];
    }
#pragma unroll
    for (int i = 0; i < in.kV; ++i) {
      const int e = threadIdx.x + i * kThreads;
      vx[e / VT][e % VT] = in.v[i];
    }
    __syncthreads();
    if (threadIdx.x < KP) {
      const int c = threadIdx.x;
      float cum[kChunk];
      float acc = 0.f;
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        if (t < len && c < K) acc += in.g[t];
        cum[t] = acc;
      }
      decay_last[c] = expf(acc);
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        float kv = 0.f, qv = 0.f;
        if (t < len && c < K) {
          kv = in.k[t] * nf[t][1];
          qv = in.q[t] * nf[t][0];
        }
        const float e = expf(cum[t]);
        kg[t][c] = kv * e;
        qg[t][c] = qv * e;
        kd[t][c] = kv * expf(acc - cum[t]);
      }
    }
    // the next chunk's inputs, in flight during this one's stages 2 and 3
    if (t0 + kChunk < end) in.load(p, h, tile, t0 + kChunk, id + 1, chunk_len(t0 + kChunk));
    __syncthreads();

    // ---- stage 2: (k * exp(G)) S and (q * exp(G)) S per token, summed over the RG lanes; four tokens at a
    // time, as independent sums (rows past len are zero in kg and qg, and their sums are not stored)
    for (int t4 = 0; t4 < len; t4 += 4) {
      float2 x[4], y[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = y[u] = make_float2(0.f, 0.f);
#pragma unroll
      for (int m = 0; m < kQuads; ++m) {
        const int row = 4 * (rg + RG * m);
        const float2* sm = s + 4 * m;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float4 k4 = *reinterpret_cast<const float4*>(&kg[t4 + u][row]);
          const float4 q4 = *reinterpret_cast<const float4*>(&qg[t4 + u][row]);
          x[u].x = fmaf(k4.x, sm[0].x, fmaf(k4.y, sm[1].x, fmaf(k4.z, sm[2].x, fmaf(k4.w, sm[3].x, x[u].x))));
          x[u].y = fmaf(k4.x, sm[0].y, fmaf(k4.y, sm[1].y, fmaf(k4.z, sm[2].y, fmaf(k4.w, sm[3].y, x[u].y))));
          y[u].x = fmaf(q4.x, sm[0].x, fmaf(q4.y, sm[1].x, fmaf(q4.z, sm[2].x, fmaf(q4.w, sm[3].x, y[u].x))));
          y[u].y = fmaf(q4.x, sm[0].y, fmaf(q4.y, sm[1].y, fmaf(q4.z, sm[2].y, fmaf(q4.w, sm[3].y, y[u].y))));
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int off = 1; off < RG; off *= 2) {
          x[u].x += __shfl_xor_sync(0xffffffffu, x[u].x, off, kGroup);
          x[u].y += __shfl_xor_sync(0xffffffffu, x[u].y, off, kGroup);
          y[u].x += __shfl_xor_sync(0xffffffffu, y[u].x, off, kGroup);
          y[u].y += __shfl_xor_sync(0xffffffffu, y[u].y, off, kGroup);
        }
        const int t = t4 + u;
        if (t < len && rg == t % RG) {
          vx[t][2 * cp] -= x[u].x;
          vx[t][2 * cp + 1] -= x[u].y;
          ys[t][2 * cp] = y[u].x;
          ys[t][2 * cp + 1] = y[u].y;
        }
      }
    }
    __syncthreads();

    // ---- stage 3: U = Tb (V - X); then O = Y + P U and S = exp(G_last) S + kd^T U
    constexpr int kE = kChunk * VT / kThreads;
    const int c3 = threadIdx.x % VT, t3 = threadIdx.x / VT;  // this thread's elements (stage3_rows)
    {
      float acc[kE];
#pragma unroll
      for (int i = 0; i < kE; ++i) acc[i] = 0.f;
      stage3_rows<kThreads / VT>(acc, tb, vx, t3, c3, len);
#pragma unroll
      for (int i = 0; i < kE; ++i) {
        const int t = t3 + i * (kThreads / VT);
        if (t < len) us[t][c3] = acc[i];
      }
    }
    __syncthreads();
    {
      float acc[kE];
#pragma unroll
      for (int i = 0; i < kE; ++i) acc[i] = ys[t3 + i * (kThreads / VT)][c3];
      stage3_rows<kThreads / VT>(acc, pm, us, t3, c3, len);
#pragma unroll
      for (int i = 0; i < kE; ++i) {
        const int t = t3 + i * (kThreads / VT);
        if (t < len && tile + c3 < V) out[((t0 + t) * H + h) * V + tile + c3] = from_float<T>(acc[i]);
      }
    }
#pragma unroll
    for (int m = 0; m < kQuads; ++m) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float d = decay_last[4 * (rg + RG * m) + r];
        s[4 * m + r].x *= d;
        s[4 * m + r].y *= d;
      }
    }
    for (int t = 0; t < len; ++t) {
      const float2 u = *reinterpret_cast<const float2*>(&us[t][2 * cp]);
#pragma unroll
      for (int m = 0; m < kQuads; ++m) {
        const float4 d4 = *reinterpret_cast<const float4*>(&kd[t][4 * (rg + RG * m)]);
        float2* sm = s + 4 * m;
        sm[0].x = fmaf(d4.x, u.x, sm[0].x);
        sm[0].y = fmaf(d4.x, u.y, sm[0].y);
        sm[1].x = fmaf(d4.y, u.x, sm[1].x);
        sm[1].y = fmaf(d4.y, u.y, sm[1].y);
        sm[2].x = fmaf(d4.z, u.x, sm[2].x);
        sm[2].y = fmaf(d4.z, u.y, sm[2].y);
        sm[3].x = fmaf(d4.w, u.x, sm[3].x);
        sm[3].y = fmaf(d4.w, u.y, sm[3].y);
      }
    }
    __syncthreads();  // the next chunk overwrites shared memory
  }

  float* dst = p.state + p.out_slots[n] * p.slot_stride + head_offset;
#pragma unroll
  for (int m = 0; m < kQuads; ++m) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = 4 * (rg + RG * m) + r;
      if (row >= K) continue;
      if (col < V) dst[row * V + col] = s[4 * m + r].x;
      if (col + 1 < V) dst[row * V + col + 1] = s[4 * m + r].y;
    }
  }
}

#if defined(ATOM_KDA_SCAN_TC)
// ---- The scan on tensor cores (sm_80+; bf16/fp16 inputs by default): the same chunk recurrence as
// kda_prefill_scan_kernel, its products as mma.sync m16n8k8 with tf32 operands and fp32 accumulation, so a
// chunk costs ~100 MMAs a warp instead of ~1700 FMAs a thread. Operands are rounded to tf32 (10-bit
// mantissa); the state stays fp32 between chunks. Everything runs transposed, value columns as M:
//
//   X^T = S^T kg^T,  Y^T = S^T qg^T      [16 v x 16 tokens], sums over the K keys
//   U^T = (V^T - X^T) Tb^T                [16 v x 16 tokens]
//   O^T = Y^T + U^T P^T
//   S^T = S^T diag(exp(G_last)) + U^T kd  [16 v x K keys]
//
// Warp w owns value columns v0 = tile + 16 w .. + 15 of S^T, all K keys, as K / 8 accumulator tiles, and
// every product above is the warp's own: the block shares only a chunk's kg, qg, kd, Tb and P (for few
// sequences the keys split over warp pairs instead: KS below). A
// product's accumulator feeds the next product as its A operand in registers: an accumulator tile holds
// columns (2t, 2t+1) where an A tile holds (t, t+4), so the reduction index runs permuted (logical k = t
// is column 2t, k = t + 4 is 2t + 1) and the B operand is read in the same order, as one float2.
constexpr int kTcWarps = 4;  // a tensor-core scan block

template <typename T, int KP>
struct TcChunkInputs {  // a chunk's inputs, loaded during the chunk before (as ChunkInputs)
  static constexpr int kThreads = 32 * kTcWarps, kCols = (KP + kThreads - 1) / kThreads, kMats = kMatFloats / kThreads;
  static_assert(kMatFloats % kThreads == 0 && 2 * kChunk <= kThreads, "whole elements per thread");
  // key columns tid + i * kThreads (g, k, q of every token); elements tid + i * kThreads of Tb | P; this
  // lane's v at its accumulator positions (tokens 8 nt + 2 t (+1), columns v0 + g (+8)); norm factor tid.
  // Raw values, converted where they are used: a conversion here would wait for its load at once (ncu
  // showed most of the scan's stalls on those conversions). Tokens past len and columns past K or V load
  // the last valid one's (no load is predicated, so none is waited for to pick a zero); their users mask
  // them or multiply them by zeros.
  float mats[kMats], nf, g[kCols][kChunk];
  T v[2][4], k[kCols][kChunk], q[kCols][kChunk];

  __device__ __forceinline__ void load(const PrefillParams& p, int h, int v0, int64_t t0, int64_t id, int len) {
    const int tid = threadIdx.x, lane = tid % 32, K = p.key_dim, V = p.value_dim, H = p.heads;
    const float* src = p.mats + (id * H + h) * kMatFloats;
#pragma unroll
    for (int i = 0; i < kMats; ++i) mats[i] = src[tid + i * kThreads];
    const int nt_tok = min(tid % (2 * kChunk) / 2, len - 1);
    nf = p.norms[((t0 + nt_tok) * H + h) * 2 + tid % 2];
    const int vs = static_cast<int>(p.v_st), ks = static_cast<int>(p.k_st);
    const T* vp = static_cast<const T*>(p.v) + t0 * p.v_st + static_cast<int64_t>(h) * V;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = min(8 * nt + 2 * (lane % 4) + (i & 1), len - 1), c = min(v0 + lane / 4 + 8 * (i >> 1), V - 1);
        v[nt][i] = vp[t * vs + c];
      }
    }
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci) {
      const int c = min(tid + ci * kThreads, K - 1);
      const float* gp = p.g + (t0 * H + h) * K + c;
      const T* kp = static_cast<const T*>(p.k) + t0 * p.k_st + static_cast<int64_t>(h) * K + c;
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        const int tt = min(t, len - 1);
        g[ci][t] = gp[tt * H * K];
        k[ci][t] = kp[tt * ks];
      }
    }
  }

  // q, issued apart from the rest: 48 loads a thread at once filled the load queue (ncu: one load held 10% of
  // the stall samples)
  __device__ __forceinline__ void load_q(const PrefillParams& p, int h, int64_t t0, int len) {
    const int K = p.key_dim, qs = static_cast<int>(p.q_st);
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci) {
      const int c = min(static_cast<int>(threadIdx.x) + ci * kThreads, K - 1);
      const T* qp = static_cast<const T*>(p.q) + t0 * p.q_st + static_cast<int64_t>(h) * K + c;
#pragma unroll
      for (int t = 0; t < kChunk; ++t) q[ci][t] = qp[min(t, len - 1) * qs];
    }
  }
};

__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(ptx::tf32_bits(x)); }

// The A operand of a product over tokens 8 ks .. 8 ks + 7 (or keys 8 j ..) from an accumulator tile c.
__device__ __forceinline__ void acc_as_a(uint32_t (&a)[4], const float (&c)[4]) {
  a[0] = ptx::tf32_bits(c[0]);
  a[1] = ptx::tf32_bits(c[2]);
  a[2] = ptx::tf32_bits(c[1]);
  a[3] = ptx::tf32_bits(c[3]);
}

// grid (N, H, ceil(V / VT)), block 4 warps; VT = 64 / KS. KP: key_dim rounded up (64 or 128). KS = 2 splits
// the keys over warp pairs (twice the blocks, for few sequences): warp w owns value columns 16 (w % 2) ..
// and key tiles of half w / 2, and the pair adds its partial X^T, Y^T through shared memory.
template <typename T, int KP, int KS>
__global__ void __launch_bounds__(32 * kTcWarps) kda_prefill_scan_tc_kernel(PrefillParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int W = kTcWarps, kThreads = 32 * W, kGroups = W / KS, VT = 16 * kGroups, kN = KP / 8 / KS;
  // row strides, so that a warp's reads hit distinct banks: float2 reads of 8 rows x 4 pairs (kg, qg, tb, pm),
  // scalar reads of 4 rows x 8 columns (kd)
  constexpr int kRow = KP + 8, kTok = kChunk + 8, kRowD = KP + 4;
  __shared__ __align__(16) float kg[kChunk][kRow];  // k * exp(G), tf32
  __shared__ __align__(16) float qg[kChunk][kRow];  // q * exp(G), tf32
  __shared__ __align__(16) float kd[kChunk][kRowD];  // k * exp(G_last - G), tf32
  __shared__ __align__(16) float tb[kChunk][kTok], pm[kChunk][kTok];  // tf32
  __shared__ __align__(16) float decay_last[KP];    // exp(G_last), fp32
  __shared__ float nf[kChunk][2];
  __shared__ float partial[KS > 1 ? W : 1][16][32];  // KS = 2: each warp's X^T, Y^T over its keys

  const int n = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid % 32, g8 = lane / 4, tq = lane % 4;
  const int warp = tid / 32, j0 = warp / kGroups * kN;  // this warp's first key tile
  const int tile = blockIdx.z * VT, v0 = tile + 16 * (warp % kGroups);
  const int K = p.key_dim, V = p.value_dim, H = p.heads;
  const int64_t start = seq_start(p, n), end = seq_start(p, n + 1);
  T* out = static_cast<T*>(p.out);
  const int64_t slot = p.in_slots[n];
  if (slot < 0) {  // padding sequence: zero output, no state touched
    zero_output<VT, kThreads>(p, out, h, tile, start, end);
    return;
  }
  const bool init = p.has_initial_state == nullptr || p.has_initial_state[n] != 0;
  const int64_t head_offset = static_cast<int64_t>(h) * K * V;
  // s[j] = S^T at value columns v0 + g8 (+8 for elements 2, 3) and keys 8 (j0 + j) + 2 tq (+1 for elements 1, 3)
  auto key_of = [&](int j, int i) { return 8 * (j0 + j) + 2 * tq + (i & 1); };
  auto col_of = [&](int i) { return v0 + g8 + 8 * (i >> 1); };
  float s[kN][4];
  {
    const float* src = p.state + slot * p.slot_stride + head_offset;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[j][i] = init && key_of(j, i) < K && col_of(i) < V ? src[key_of(j, i) * V + col_of(i)] : 0.f;
    }
  }

  const int64_t base_id = chunk_base(p, n);
  auto chunk_len = [&](int64_t t0) { return static_cast<int>(end - t0 < kChunk ? end - t0 : kChunk); };
  TcChunkInputs<T, KP> in;
  if (start < end) {
    in.load(p, h, v0, start, base_id, chunk_len(start));
    in.load_q(p, h, start, chunk_len(start));
  }
  for (int64_t t0 = start, id = base_id; t0 < end; t0 += kChunk, ++id) {
    const int len = chunk_len(t0);
    // ---- stage 1: the chunk's shared operands (Tb and P are zero past len: kda_prefill_chunk_kernel)
    if (tid < 2 * kChunk) nf[tid / 2][tid % 2] = in.nf;
#pragma unroll
    for (int i = 0; i < in.kMats; ++i) {
      const int e = tid + i * kThreads, at = e % (kChunk * kChunk);
      if (e < kChunk * kChunk) tb[at / kChunk][at % kChunk] = tf32_round(in.mats[i]);
      else pm[at / kChunk][at % kChunk] = tf32_round(in.mats[i]);
    }
    float v[2][4];  // V^T's accumulator tiles; past len, whatever Tb's zero columns multiply
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[nt][i] = to_float(in.v[nt][i]);
    }
    __syncthreads();
#pragma unroll
    for (int ci = 0; ci < in.kCols; ++ci) {
      const int c = tid + ci * kThreads;
      if (c >= KP) continue;
      float cum[kChunk];
      float acc = 0.f;
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        if (t < len && c < K) acc += in.g[ci][t];
        cum[t] = acc;
      }
      decay_last[c] = __expf(acc);
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        float kv = 0.f, qv = 0.f;
        if (t < len && c < K) {
          kv = to_float(in.k[ci][t]) * nf[t][1];
          qv = to_float(in.q[ci][t]) * nf[t][0];
        }
        const float e = __expf(cum[t]);  // each exponent <= 0; __expf's error is far below tf32's rounding
        kg[t][c] = tf32_round(kv * e);
        qg[t][c] = tf32_round(qv * e);
        kd[t][c] = tf32_round(kv * __expf(acc - cum[t]));
      }
    }
    // the next chunk's inputs, in flight during this one's products (q after stage 2's)
    const bool more = t0 + kChunk < end;
    if (more) in.load(p, h, v0, t0 + kChunk, id + 1, chunk_len(t0 + kChunk));
    __syncthreads();

    // ---- stage 2: X^T and Y^T, each as two accumulator chains (even and odd key tiles)
    float x[2][2][4] = {}, y[2][2][4] = {};  // [chain][token tile][element]
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      uint32_t a[4];
      acc_as_a(a, s[j]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float2 kb = *reinterpret_cast<const float2*>(&kg[8 * nt + g8][8 * (j0 + j) + 2 * tq]);
        const float2 qb = *reinterpret_cast<const float2*>(&qg[8 * nt + g8][8 * (j0 + j) + 2 * tq]);
        ptx::mma_tf32_1688(x[j % 2][nt], a, __float_as_uint(kb.x), __float_as_uint(kb.y));
        ptx::mma_tf32_1688(y[j % 2][nt], a, __float_as_uint(qb.x), __float_as_uint(qb.y));
      }
    }

    if (more) in.load_q(p, h, t0 + kChunk, chunk_len(t0 + kChunk));
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[0][nt][i] += x[1][nt][i];
        y[0][nt][i] += y[1][nt][i];
      }
    }
    if constexpr (KS > 1) {  // add the other key half's sums, from the warp of the same value columns
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        partial[warp][e][lane] = x[0][e / 4][e % 4];
        partial[warp][8 + e][lane] = y[0][e / 4][e % 4];
      }
      __syncthreads();
      const int other = warp ^ kGroups;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        x[0][e / 4][e % 4] += partial[other][e][lane];
        y[0][e / 4][e % 4] += partial[other][8 + e][lane];
      }
    }

    // ---- stage 3: U^T = (V^T - X^T) Tb^T; O^T = Y^T + U^T P^T; S^T = S^T exp(G_last) + U^T kd. With KS = 2
    // both warps of a pair compute U^T and O^T (a few MMAs); the first stores O.
    float u[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {  // tokens 8 ks .. 8 ks + 7
      float w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = v[ks][i] - x[0][ks][i];
      uint32_t a[4];
      acc_as_a(a, w);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float2 b = *reinterpret_cast<const float2*>(&tb[8 * nt + g8][8 * ks + 2 * tq]);
        ptx::mma_tf32_1688(u[nt], a, __float_as_uint(b.x), __float_as_uint(b.y));
      }
    }
    uint32_t ua[2][4];
    acc_as_a(ua[0], u[0]);
    acc_as_a(ua[1], u[1]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = y[0][nt][i];
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const float2 b = *reinterpret_cast<const float2*>(&pm[8 * nt + g8][8 * ks + 2 * tq]);
        ptx::mma_tf32_1688(o, ua[ks], __float_as_uint(b.x), __float_as_uint(b.y));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = 8 * nt + 2 * tq + (i & 1), c = col_of(i);
        if (j0 == 0 && t < len && c < V) out[((t0 + t) * H + h) * V + c] = from_float<T>(o[i]);
      }
    }
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(&decay_last[8 * (j0 + j) + 2 * tq]);
      s[j][0] *= d.x;
      s[j][1] *= d.y;
      s[j][2] *= d.x;
      s[j][3] *= d.y;
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const float* b = &kd[8 * ks + 2 * tq][8 * (j0 + j) + g8];
        ptx::mma_tf32_1688(s[j], ua[ks], __float_as_uint(b[0]), __float_as_uint(b[kRowD]));
      }
    }
    __syncthreads();  // the next chunk overwrites shared memory
  }

  float* dst = p.state + p.out_slots[n] * p.slot_stride + head_offset;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (key_of(j, i) < K && col_of(i) < V) dst[key_of(j, i) * V + col_of(i)] = s[j][i];
  }
#else
  __trap();  // launched only where the device has compute capability >= 8.0
#endif
}

template <typename T, int KP, int KS>
const char* launch_scan_tc(const PrefillParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>(ceil_div(p.value_dim, 16 * kTcWarps / KS)));
  kda_prefill_scan_tc_kernel<T, KP, KS><<<grid, 32 * kTcWarps, 0, stream>>>(p);
  return last_launch_error();
}

// Keys split over warp pairs (32 value columns a block) where 64 columns a block would leave SMs idle.
template <typename T, int KP>
const char* launch_scan_tc_tiled(const PrefillParams& p, cudaStream_t stream, int sms) {
  const int64_t wide_blocks = static_cast<int64_t>(p.num_seqs) * p.heads * ceil_div(p.value_dim, 16 * kTcWarps);
  return wide_blocks >= sms ? launch_scan_tc<T, KP, 1>(p, stream) : launch_scan_tc<T, KP, 2>(p, stream);
}
#endif  // ATOM_KDA_SCAN_TC

template <typename T, int KP, int VT, int RG>
const char* launch_scan(const PrefillParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>(ceil_div(p.value_dim, VT)));
  kda_prefill_scan_kernel<T, KP, VT, RG><<<grid, RG * VT / 2, 0, stream>>>(p);
  return last_launch_error();
}

// V tile: 64 columns where that still gives two blocks per SM, else 32 (one long sequence).
template <typename T, int KP>
const char* launch_scan_tiled(const PrefillParams& p, cudaStream_t stream, int sms) {
  const int64_t wide_blocks = static_cast<int64_t>(p.num_seqs) * p.heads * ceil_div(p.value_dim, 64);
  if (wide_blocks >= 2 * static_cast<int64_t>(sms)) return launch_scan<T, KP, 64, 4>(p, stream);
  return launch_scan<T, KP, 32, 8>(p, stream);
}

}  // namespace

const char* kda_prefill(uintptr_t q, int64_t q_st, uintptr_t k, int64_t k_st, uintptr_t v, int64_t v_st, uintptr_t g,
                        uintptr_t beta, uintptr_t cu_seqlens, int cu_seqlens_dtype, uintptr_t state,
                        int64_t slot_stride, uintptr_t state_slots, uintptr_t out_slots, uintptr_t has_initial_state,
                        uintptr_t out, uintptr_t workspace, int64_t total_tokens, int64_t num_seqs, int64_t heads,
                        int64_t key_dim, int64_t value_dim, double scale, double eps, int dtype, int scan,
                        uintptr_t stream) {
  if (total_tokens < 0 || num_seqs < 0 || heads < 1 || key_dim < 1 || value_dim < 1)
    return "kda_prefill: needs total_tokens, num_seqs >= 0 and heads, key_dim, value_dim >= 1";
  if (key_dim > kMaxKeyDim) return "kda_prefill: key_dim must be <= 128";
  if (heads > 65535 || num_seqs > INT32_MAX || total_tokens > INT32_MAX)
    return "kda_prefill: heads must be <= 65535 and tokens, sequences < 2^31";
  if (cu_seqlens_dtype != kInt32 && cu_seqlens_dtype != kInt64) return "kda_prefill: cu_seqlens must be int32 or int64";
  if (q_st < 0 || k_st < 0 || v_st < 0 || q_st > INT32_MAX / kChunk || k_st > INT32_MAX / kChunk ||
      v_st > INT32_MAX / kChunk)
    return "kda_prefill: token strides must be >= 0 and below 2^27";
  if (scan < kScanAuto || scan > kScanTf32) return "kda_prefill: scan must be one of the kScan* codes";
  const char* tc_error = nullptr;  // why the tensor-core scan cannot run here, if it cannot
  int device = 0, major = 0, sms = 0;
  (void)major;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return last_launch_error();
#if defined(ATOM_KDA_SCAN_TC)
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return last_launch_error();
  if (major < 8) tc_error = "kda_prefill: the tf32 scan needs a GPU of compute capability >= 8.0";
#else
  tc_error = "kda_prefill: the tf32 scan needs an NVIDIA GPU (mma.sync); use the fp32 scan";
#endif
  if (scan == kScanAuto) scan = dtype != kFloat32 && tc_error == nullptr ? kScanTf32 : kScanFp32;
  if (scan != kScanFp32 && tc_error != nullptr) return tc_error;
  if (num_seqs == 0) return nullptr;
  const int64_t num_ids = kda_prefill_num_chunk_ids(total_tokens, num_seqs);
  float* ws = reinterpret_cast<float*>(workspace);
  PrefillParams p{reinterpret_cast<const void*>(q),
                  reinterpret_cast<const void*>(k),
                  reinterpret_cast<const void*>(v),
                  q_st,
                  k_st,
                  v_st,
                  reinterpret_cast<const float*>(g),
                  reinterpret_cast<const float*>(beta),
                  reinterpret_cast<const void*>(cu_seqlens),
                  cu_seqlens_dtype == kInt64,
                  reinterpret_cast<float*>(state),
                  slot_stride,
                  reinterpret_cast<const int64_t*>(state_slots),
                  reinterpret_cast<const int64_t*>(out_slots),
                  reinterpret_cast<const uint8_t*>(has_initial_state),
                  reinterpret_cast<void*>(out),
                  ws,
                  ws + num_ids * heads * kMatFloats,
                  static_cast<int>(num_seqs),
                  static_cast<int>(heads),
                  static_cast<int>(key_dim),
                  static_cast<int>(value_dim),
                  static_cast<float>(scale),
                  static_cast<float>(eps)};
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "kda_prefill", [&]() -> const char* {
    if (total_tokens > 0) {
      kda_prefill_chunk_kernel<scalar_t><<<dim3(static_cast<unsigned>(num_ids), static_cast<unsigned>(heads)), 128, 0,
                                           st>>>(p);
      if (const char* err = last_launch_error()) return err;
    }
#if defined(ATOM_KDA_SCAN_TC)
    if (scan != kScanFp32) {
      if (key_dim <= 64) return launch_scan_tc_tiled<scalar_t, 64>(p, st, sms);
      return launch_scan_tc_tiled<scalar_t, 128>(p, st, sms);
    }
#endif
    if (key_dim <= 64) return launch_scan_tiled<scalar_t, 64>(p, st, sms);
    return launch_scan_tiled<scalar_t, 128>(p, st, sms);
  });
}

int64_t kda_prefill_num_chunk_ids(int64_t total_tokens, int64_t num_seqs) { return total_tokens / kChunk + num_seqs; }

int64_t kda_prefill_workspace_floats(int64_t total_tokens, int64_t num_seqs, int64_t heads) {
  return kda_prefill_num_chunk_ids(total_tokens, num_seqs) * heads * kMatFloats + total_tokens * heads * 2;
}

}  // namespace atom
