// KDA decode step over the slot-indexed recurrent state, in place.
//
// Per sequence b, head h and new token t (T tokens: 1, or 1 + k under
// speculative decoding), with S = state[slot] [K, V] fp32:
//
//   q <- q / sqrt(|q|^2 + eps) * scale      k <- k / sqrt(|k|^2 + eps)
//   S <- exp(g)[:, None] * S                 (per-row decay, g <= 0)
//   u  = beta * (v - S^T k)
//   S <- S + k u^T
//   o  = S^T q  =  (decayed S)^T q + (k . q) u
//
// Columns of S are independent: column j needs only the two dot products
// a_j = sum_i d_i S_ij k_i and c_j = sum_i d_i S_ij q_i. The fast kernel keeps
// a [K, 128] column tile of S in registers for all T tokens:
//
//            lanes 0..31, 4 columns each (one float4)
//   warp 0   rows 0 .. K/NW-1         a, c partial sums per warp
//   warp 1   rows K/NW .. 2K/NW-1  -> smem [NW][32] float4 -> summed by every
//   ...                               thread for its own 4 columns
//
// so S is read once and written once per step (per token when every
// token's state is kept), the minimum traffic.
//
// Slots (AttentionMetadata's state_slots / state_out_slots): read
// state_slots[b]; write the state after the last token to out_slots[b], or,
// per_token, the state after token t to out_slots[b] + t (the 1 + k
// speculative slots: whichever prefix is accepted, its state is stored).
// A sequence's reads happen before its writes, so out may alias in.
// state_slots[b] < 0 marks a padding row: outputs zero, no state touched.
#include "kernel_common.h"

namespace atom {
namespace {

struct KdaParams {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_st, k_sb, k_st, v_sb, v_st;  // element strides over batch and token
  const float* g;
  const float* beta;
  float* state;
  int64_t slot_stride;
  const int64_t* in_slots;
  const int64_t* out_slots;
  bool per_token;
  const uint8_t* has_initial_state;
  void* out;
  int tokens, heads, key_dim, value_dim;
  float scale, eps;
  // Optional output norm (the fast kernel, V = 128): out = gated_rmsnorm(o, gate, norm_weight, norm_eps)
  // instead of o, as csrc/norm.cu computes it. gate: token row b * tokens + t at norm_gate_stride elements,
  // its [heads, V] contiguous; norm_weight [V].
  const void* norm_gate;
  int64_t norm_gate_stride;
  const void* norm_weight;
  float norm_eps;
};

__device__ __forceinline__ float4 operator*(float4 a, float s) { return {a.x * s, a.y * s, a.z * s, a.w * s}; }
__device__ __forceinline__ float4 operator+(float4 a, float4 b) { return {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w}; }
__device__ __forceinline__ float4 operator-(float4 a, float4 b) { return {a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w}; }
__device__ __forceinline__ float4 fma4(float4 a, float s, float4 c) {
  return {fmaf(a.x, s, c.x), fmaf(a.y, s, c.y), fmaf(a.z, s, c.z), fmaf(a.w, s, c.w)};
}

// Loads q, k (raw) and exp(g) of one token and head into shared memory.
template <typename T>
__device__ __forceinline__ void load_token(const KdaParams& p, int64_t b, int t, int h, float* q_s, float* k_s,
                                           float* d_s) {
  const T* q = static_cast<const T*>(p.q) + b * p.q_sb + t * p.q_st + static_cast<int64_t>(h) * p.key_dim;
  const T* k = static_cast<const T*>(p.k) + b * p.k_sb + t * p.k_st + static_cast<int64_t>(h) * p.key_dim;
  const float* g = p.g + ((b * p.tokens + t) * p.heads + h) * p.key_dim;
  for (int i = threadIdx.x; i < p.key_dim; i += blockDim.x) {
    q_s[i] = to_float(q[i]);
    k_s[i] = to_float(k[i]);
    d_s[i] = expf(g[i]);
  }
}

// 1 / norms and the normalised k . q, computed by every 32-thread group alone
// (no block-wide reduction needed): {q factor (incl. scale), k factor, k.q}.
__device__ __forceinline__ float3 norm_factors(const KdaParams& p, const float* q_s, const float* k_s) {
  const int lane = threadIdx.x % kGroup;
  float sq = 0.f, sk = 0.f, qk = 0.f;
  for (int i = lane; i < p.key_dim; i += kGroup) {
    sq = fmaf(q_s[i], q_s[i], sq);
    sk = fmaf(k_s[i], k_s[i], sk);
    qk = fmaf(q_s[i], k_s[i], qk);
  }
  sq = group_sum(sq);
  sk = group_sum(sk);
  qk = group_sum(qk);
  const float qf = p.scale / sqrtf(sq + p.eps);
  const float kf = 1.f / sqrtf(sk + p.eps);
  return {qf, kf, qk * qf * kf};
}

template <typename T>
__device__ __forceinline__ void zero_outputs(const KdaParams& p, int b, int h) {
  T* out = static_cast<T*>(p.out);
  for (int t = 0; t < p.tokens; ++t) {
    const int64_t base = ((static_cast<int64_t>(b) * p.tokens + t) * p.heads + h) * p.value_dim;
    for (int j = threadIdx.x; j < p.value_dim; j += blockDim.x) out[base + j] = from_float<T>(0.f);
  }
}

constexpr int kColsPerTile = 4 * kGroup;  // 128 columns: 32 lanes x float4

// The fast kernel's optional output norm, by one warp holding a token's whole [V = 128] output (lane l: columns
// 4l .. 4l + 3): o rounded to T as it would be stored, then gated_rmsnorm_kernel<T, 4>'s arithmetic for a
// 128-wide row (the same lane split, and kernel_common.h's gated_norm_* helpers). So the bits equal kda_decode's
// output through gated_rmsnorm.
template <typename T>
__device__ __forceinline__ void store_gated_norm(const KdaParams& p, int64_t row, int h, int col, float4 o, T* op) {
  const float x[4] = {round_to<T>(o.x), round_to<T>(o.y), round_to<T>(o.z), round_to<T>(o.w)};
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) ss = fmaf(x[i], x[i], ss);
  const float inv = gated_norm_inv(ss, p.value_dim, p.norm_eps);
  const T* gate =
      static_cast<const T*>(p.norm_gate) + row * p.norm_gate_stride + static_cast<int64_t>(h) * p.value_dim + col;
  const T* weight = static_cast<const T*>(p.norm_weight) + col;
#pragma unroll
  for (int i = 0; i < 4; ++i) op[i] = gated_norm_value<T>(x[i], inv, to_float(weight[i]), to_float(gate[i]));
}

// grid (H, B, ceil(V / 128)), block NW * 32 threads.
template <typename T, int K, int NW>
__global__ void __launch_bounds__(NW * 32, 16 / NW) kda_decode_fast_kernel(KdaParams p) {
  pdl_enter();
  constexpr int kRows = K / NW;  // rows of S per warp
  __shared__ float q_s[K], k_s[K], d_s[K];
  __shared__ float4 red[2][NW][kGroup];

  const int h = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const int col = blockIdx.z * kColsPerTile + lane * 4;
  const bool col_ok = col < p.value_dim;
  const int64_t V = p.value_dim;
  const int64_t slot0 = p.in_slots[b];
  if (slot0 < 0) {
    if (blockIdx.z == 0) zero_outputs<T>(p, b, h);
    return;
  }
  const bool init = p.has_initial_state == nullptr || p.has_initial_state[b] != 0;
  const int64_t head_offset = static_cast<int64_t>(h) * K * V;

  float4 s[kRows];
  {
    const float* src = p.state + slot0 * p.slot_stride + head_offset;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = warp * kRows + r;
      s[r] = (init && col_ok) ? *reinterpret_cast<const float4*>(src + row * V + col) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }

  for (int t = 0; t < p.tokens; ++t) {
    const int64_t tok_head = (static_cast<int64_t>(b) * p.tokens + t) * p.heads + h;
    __syncthreads();  // the previous token is done with q_s / k_s / red
    load_token<T>(p, b, t, h, q_s, k_s, d_s);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (col_ok) {
      const T* vp = static_cast<const T*>(p.v) + b * p.v_sb + t * p.v_st + h * V + col;
      v = make_float4(to_float(vp[0]), to_float(vp[1]), to_float(vp[2]), to_float(vp[3]));
    }
    const float beta = p.beta[tok_head];
    __syncthreads();

    const float3 f = norm_factors(p, q_s, k_s);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f), c = a;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = warp * kRows + r;
      s[r] = s[r] * d_s[row];
      a = fma4(s[r], k_s[row] * f.y, a);
      c = fma4(s[r], q_s[row] * f.x, c);
    }
    red[0][warp][lane] = a;
    red[1][warp][lane] = c;
    __syncthreads();
    float4 sum_a = red[0][0][lane], sum_c = red[1][0][lane];
#pragma unroll
    for (int w = 1; w < NW; ++w) {
      sum_a = sum_a + red[0][w][lane];
      sum_c = sum_c + red[1][w][lane];
    }
    const float4 u = (v - sum_a) * beta;
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = fma4(u, k_s[warp * kRows + r] * f.y, s[r]);

    if (warp == 0 && col_ok) {
      const float4 o = fma4(u, f.z, sum_c);
      T* op = static_cast<T*>(p.out) + tok_head * V + col;
      if (p.norm_gate != nullptr) {
        store_gated_norm<T>(p, b * p.tokens + t, h, col, o, op);
      } else {
        op[0] = from_float<T>(o.x);
        op[1] = from_float<T>(o.y);
        op[2] = from_float<T>(o.z);
        op[3] = from_float<T>(o.w);
      }
    }
    if (p.per_token || t == p.tokens - 1) {
      const int64_t base = p.out_slots[b];
      const int64_t dst_slot = base + (p.per_token ? t : 0);
      if (base >= 0 && col_ok) {
        float* dst = p.state + dst_slot * p.slot_stride + head_offset;
#pragma unroll
        for (int r = 0; r < kRows; ++r) *reinterpret_cast<float4*>(dst + (warp * kRows + r) * V + col) = s[r];
      }
    }
  }
}

// Any K, V: one thread per column, S streamed from global memory twice per
// token (reduce, then update). For shapes the fast kernel does not cover.
// grid (H, B), block 128, dynamic smem 3 * K floats.
template <typename T>
__global__ void __launch_bounds__(128) kda_decode_generic_kernel(KdaParams p) {
  pdl_enter();
  float* smem = dynamic_shared<float>();
  float* q_s = smem;
  float* k_s = smem + p.key_dim;
  float* d_s = smem + 2 * p.key_dim;
  const int h = blockIdx.x, b = blockIdx.y;
  const int64_t K = p.key_dim, V = p.value_dim;
  const int64_t slot0 = p.in_slots[b];
  if (slot0 < 0) {
    zero_outputs<T>(p, b, h);
    return;
  }
  const bool init = p.has_initial_state == nullptr || p.has_initial_state[b] != 0;
  const int64_t head_offset = static_cast<int64_t>(h) * K * V;
  const float* src = init ? p.state + slot0 * p.slot_stride + head_offset : nullptr;
  const int64_t base = p.out_slots[b] >= 0 ? p.out_slots[b] : slot0;  // < 0 is not allowed; stay in bounds

  for (int t = 0; t < p.tokens; ++t) {
    const int64_t tok_head = (static_cast<int64_t>(b) * p.tokens + t) * p.heads + h;
    __syncthreads();
    load_token<T>(p, b, t, h, q_s, k_s, d_s);
    __syncthreads();
    const float3 f = norm_factors(p, q_s, k_s);
    const float beta = p.beta[tok_head];
    // Every token's state goes to its destination; the next token reads it back from there.
    const int64_t dst_slot = base + (p.per_token ? t : 0);
    float* dst = p.state + dst_slot * p.slot_stride + head_offset;
    const T* v = static_cast<const T*>(p.v) + b * p.v_sb + t * p.v_st + h * V;
    T* out = static_cast<T*>(p.out) + tok_head * V;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float a = 0.f, c = 0.f;
      for (int64_t i = 0; i < K; ++i) {
        const float s = src ? src[i * V + j] * d_s[i] : 0.f;
        a = fmaf(s, k_s[i] * f.y, a);
        c = fmaf(s, q_s[i] * f.x, c);
      }
      const float u = (to_float(v[j]) - a) * beta;
      for (int64_t i = 0; i < K; ++i) {
        const float s = src ? src[i * V + j] * d_s[i] : 0.f;
        dst[i * V + j] = fmaf(k_s[i] * f.y, u, s);
      }
      out[j] = from_float<T>(fmaf(u, f.z, c));
    }
    src = dst;  // each thread re-reads only the columns it wrote
  }
}

template <typename T, int K, int NW>
const char* launch_fast(const KdaParams& p, int64_t batch, cudaStream_t stream) {
  const dim3 grid(p.heads, static_cast<unsigned>(batch), static_cast<unsigned>(ceil_div(p.value_dim, kColsPerTile)));
  launch_kernel(kda_decode_fast_kernel<T, K, NW>, grid, NW * 32, 0, stream, p);
  return last_launch_error();
}

}  // namespace

bool kda_decode_fuses_norm(uintptr_t state, int64_t slot_stride, int64_t key_dim, int64_t value_dim) {
  return state % 16 == 0 && slot_stride % 4 == 0 && (key_dim == 128 || key_dim == 64) && value_dim == kColsPerTile;
}

const char* kda_decode(uintptr_t q, int64_t q_sb, int64_t q_st, uintptr_t k, int64_t k_sb, int64_t k_st, uintptr_t v,
                       int64_t v_sb, int64_t v_st, uintptr_t g, uintptr_t beta, uintptr_t state,
                       int64_t slot_stride, uintptr_t state_slots, uintptr_t out_slots, bool per_token,
                       uintptr_t has_initial_state, uintptr_t out, int64_t batch, int64_t tokens, int64_t heads,
                       int64_t key_dim, int64_t value_dim, double scale, double eps, uintptr_t norm_gate,
                       int64_t norm_gate_stride, uintptr_t norm_weight, double norm_eps, int dtype,
                       uintptr_t stream) {
  if (batch < 0 || tokens < 1 || heads < 1 || key_dim < 1 || value_dim < 1)
    return "kda_decode: needs batch >= 0 and tokens, heads, key_dim, value_dim >= 1";
  if (batch > 65535 || heads > 65535 || tokens > INT32_MAX) return "kda_decode: batch and heads must be <= 65535";
  if (batch == 0) return nullptr;
  KdaParams p{reinterpret_cast<const void*>(q),
              reinterpret_cast<const void*>(k),
              reinterpret_cast<const void*>(v),
              q_sb,
              q_st,
              k_sb,
              k_st,
              v_sb,
              v_st,
              reinterpret_cast<const float*>(g),
              reinterpret_cast<const float*>(beta),
              reinterpret_cast<float*>(state),
              slot_stride,
              reinterpret_cast<const int64_t*>(state_slots),
              reinterpret_cast<const int64_t*>(out_slots),
              per_token,
              reinterpret_cast<const uint8_t*>(has_initial_state),
              reinterpret_cast<void*>(out),
              static_cast<int>(tokens),
              static_cast<int>(heads),
              static_cast<int>(key_dim),
              static_cast<int>(value_dim),
              static_cast<float>(scale),
              static_cast<float>(eps),
              reinterpret_cast<const void*>(norm_gate),
              norm_gate_stride,
              reinterpret_cast<const void*>(norm_weight),
              static_cast<float>(norm_eps)};
  cudaStream_t st = as_stream(stream);
  // The fast kernel moves float4 columns of S: every slot and row must start 16-byte aligned.
  const bool aligned = state % 16 == 0 && slot_stride % 4 == 0 && value_dim % 4 == 0;
  if (norm_gate != 0 && !kda_decode_fuses_norm(state, slot_stride, key_dim, value_dim))
    return "kda_decode: the fused output norm needs the fast kernel (key_dim 64 or 128, 16-byte aligned slots) "
           "and value_dim 128";
  if (norm_gate != 0 && (norm_weight == 0 || norm_gate_stride < heads * value_dim))
    return "kda_decode: the fused output norm needs its weight and gate rows of heads * value_dim elements";
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "kda_decode", [&]() -> const char* {
    if (aligned && key_dim == 128) return launch_fast<scalar_t, 128, 8>(p, batch, st);
    if (aligned && key_dim == 64) return launch_fast<scalar_t, 64, 4>(p, batch, st);
    const size_t smem = 3 * static_cast<size_t>(key_dim) * sizeof(float);
    if (smem > 48 * 1024) return "kda_decode: key_dim too large (at most 4096)";
    launch_kernel(kda_decode_generic_kernel<scalar_t>, dim3(heads, batch), 128, smem, st, p);
    return last_launch_error();
  });
}

}  // namespace atom
