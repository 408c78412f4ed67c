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
//   2. kda_prefill_scan_kernel, one block per (sequence, head, V tile): walks
//      the sequence's chunks in order carrying S [K, VT] in registers. Each
//      chunk's inputs are loaded into registers while the chunk before is
//      worked on, and independent sums (four tokens in stage 2, a thread's
//      elements in stage 3) are interleaved: with one block of 4 warps per SM
//      nothing else hides the latency (1.3-2.2x faster, same results to the
//      bit: GPU_NOTES.md, session 10).
//
// Kernel 2's threads, for a V tile of VT columns and RG row groups:
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
#include "kernel_common.h"

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
          const float kj = kn[j][c] * expf(gt[m] - cum[j][c]);
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
    for (int64_t i = threadIdx.x; i < (end - start) * VT; i += kThreads) {
      const int64_t tok = start + i / VT;
      const int c = tile + static_cast<int>(i % VT);
      if (c < V) out[(tok * H + h) * V + c] = from_float<T>(0.f);
    }
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

template <typename T, int KP, int VT, int RG>
const char* launch_scan(const PrefillParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>(ceil_div(p.value_dim, VT)));
  kda_prefill_scan_kernel<T, KP, VT, RG><<<grid, RG * VT / 2, 0, stream>>>(p);
  return last_launch_error();
}

// V tile: 64 columns where that still gives two blocks per SM, else 32 (one long sequence).
template <typename T, int KP>
const char* launch_scan_tiled(const PrefillParams& p, cudaStream_t stream) {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return last_launch_error();
  const int64_t wide_blocks = static_cast<int64_t>(p.num_seqs) * p.heads * ceil_div(p.value_dim, 64);
  if (wide_blocks >= 2 * static_cast<int64_t>(sms)) return launch_scan<T, KP, 64, 4>(p, stream);
  return launch_scan<T, KP, 32, 8>(p, stream);
}

}  // namespace

const char* kda_prefill(uintptr_t q, int64_t q_st, uintptr_t k, int64_t k_st, uintptr_t v, int64_t v_st, uintptr_t g,
                        uintptr_t beta, uintptr_t cu_seqlens, int cu_seqlens_dtype, uintptr_t state,
                        int64_t slot_stride, uintptr_t state_slots, uintptr_t out_slots, uintptr_t has_initial_state,
                        uintptr_t out, uintptr_t workspace, int64_t total_tokens, int64_t num_seqs, int64_t heads,
                        int64_t key_dim, int64_t value_dim, double scale, double eps, int dtype, uintptr_t stream) {
  if (total_tokens < 0 || num_seqs < 0 || heads < 1 || key_dim < 1 || value_dim < 1)
    return "kda_prefill: needs total_tokens, num_seqs >= 0 and heads, key_dim, value_dim >= 1";
  if (key_dim > kMaxKeyDim) return "kda_prefill: key_dim must be <= 128";
  if (heads > 65535 || num_seqs > INT32_MAX || total_tokens > INT32_MAX)
    return "kda_prefill: heads must be <= 65535 and tokens, sequences < 2^31";
  if (cu_seqlens_dtype != kInt32 && cu_seqlens_dtype != kInt64) return "kda_prefill: cu_seqlens must be int32 or int64";
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
    if (key_dim <= 64) return launch_scan_tiled<scalar_t, 64>(p, st);
    return launch_scan_tiled<scalar_t, 128>(p, st);
  });
}

int64_t kda_prefill_num_chunk_ids(int64_t total_tokens, int64_t num_seqs) { return total_tokens / kChunk + num_seqs; }

int64_t kda_prefill_workspace_floats(int64_t total_tokens, int64_t num_seqs, int64_t heads) {
  return kda_prefill_num_chunk_ids(total_tokens, num_seqs) * heads * kMatFloats + total_tokens * heads * 2;
}

}  // namespace atom
