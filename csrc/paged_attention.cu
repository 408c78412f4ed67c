// Paged GQA decode attention for dense models (Llama, Qwen3): one query row per token over the
// first seq_lens[t] cached positions of its sequence.
//
//   K and V caches [num_blocks, block_size, kv_heads, head_dim]; query head h reads kv head
//   h / group (group = heads / kv_heads):
//
//   score_p = q . k_p * scale          out = sum_p softmax(score)_p v_p        [heads, head_dim]
//
// One block per (row, kv head, up to kMaxHeads of its query heads, split): a position's key and
// value are read once for the block's heads. Each warp streams its own positions, many keys and values
// in flight at once, with its own online softmax; the warps merge at the end. Long sequences are split
// over several blocks (flash-decoding) and the splits merged by their log-sum-exp (paged_combine_kernel).
// CUDA cores, any float dtype, head_dim <= 256.
#include "kernel_common.h"

namespace atom {
namespace {

constexpr int kTile = 32;  // positions of a split's unit: a split takes whole tiles
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kGroup;
constexpr int kMaxHeads = 8;  // query heads a block serves
constexpr int kMaxDim = 256;

struct PagedParams {
  const void* q;  // [rows, heads, dim] contiguous
  const void* k_cache;
  const void* v_cache;
  int64_t block_stride, token_stride, head_stride;  // elements; the same for K and V
  int block_size;
  const void* block_tables;  // [rows, >= ceil(seq_len / block_size)] at row stride bt_stride
  int64_t bt_stride;
  bool bt64;
  const void* seq_lens;  // [rows]
  bool sl64;
  void* out;        // [rows, heads, dim]
  float* o_part;    // [rows, splits, heads, dim]: each split's normalised output (splits > 1)
  float* lse_part;  // [rows, splits, heads]: natural-log sum of exp(score) of each split
  int heads, kv_heads, dim, num_splits;
  float scale;
  bool vec;  // dim == 32 * DPL and q, K and V rows aligned for DPL-element loads
};

// A lane owns DPL consecutive elements of a head row (lane l: l * DPL ...), zeros past dim.
template <typename T, int DPL>
__device__ __forceinline__ void load_lane(float (&x)[DPL], const T* row, int lane, int dim, bool vec) {
  if (vec) {
    const Pack<T, DPL> pk = *reinterpret_cast<const Pack<T, DPL>*>(row + lane * DPL);
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = to_float(pk.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = lane * DPL + i < dim ? to_float(row[lane * DPL + i]) : 0.f;
  }
}

// One block per (row, kv head, up to kMaxHeads of its query heads, split). Each warp streams its own
// positions of the split (kBatch at a time, warps interleaved) with its own online softmax, no block-wide
// barrier until the end, where the four warps' states are merged through shared memory.
template <typename T, typename OutT, int DPL>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(PagedParams p) {
  pdl_enter();
  constexpr int kBatch = 32 / DPL;  // positions a warp loads at once, all in flight together (64 floats a lane)
  const int group = p.heads / p.kv_heads;
  const int chunks = (group + kMaxHeads - 1) / kMaxHeads;
  const int kvh = blockIdx.x / chunks;
  const int h0 = kvh * group + (blockIdx.x % chunks) * kMaxHeads;  // the block's first query head
  const int nh = min(kMaxHeads, (kvh + 1) * group - h0);
  const int64_t row = blockIdx.y;
  const int split = blockIdx.z, S = p.num_splits;
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const int64_t seq_len = load_index(p.seq_lens, row, p.sl64);
  const int64_t per_split = ceil_div(ceil_div(seq_len, kTile), S) * kTile;
  const int64_t begin = split * per_split;
  const int64_t end = begin + per_split < seq_len ? begin + per_split : seq_len;
  if (begin >= end) {  // nothing to attend to: zeros, or an empty partial
    if (S == 1) {
      OutT* out = static_cast<OutT*>(p.out) + (row * p.heads + h0) * p.dim;
      for (int c = threadIdx.x; c < nh * p.dim; c += kThreads) out[c] = from_float<OutT>(0.f);
    } else if (threadIdx.x < nh) {
      p.lse_part[(row * S + split) * p.heads + h0 + threadIdx.x] = -INFINITY;
    }
    return;
  }
  float q[kMaxHeads][DPL], acc[kMaxHeads][DPL], m[kMaxHeads], l[kMaxHeads];
  const T* q_row = static_cast<const T*>(p.q) + (row * p.heads + h0) * p.dim;
#pragma unroll
  for (int g = 0; g < kMaxHeads; ++g) {
    if (g < nh) load_lane(q[g], q_row + g * p.dim, lane, p.dim, p.vec);
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[g][i] = 0.f;
  }
  const T* k_cache = static_cast<const T*>(p.k_cache) + kvh * p.head_stride;
  const T* v_cache = static_cast<const T*>(p.v_cache) + kvh * p.head_stride;

  // Warp w takes batches of kBatch positions at w * kBatch, then every kWarps * kBatch. Lane j < kBatch looks
  // up the cache offset of position i + j of the split; one past the end takes position i (valid) instead and
  // scores -inf, so every load is issued unconditionally. The next batch's lookups are issued before this
  // batch's math, so their latency hides behind it.
  const int len = static_cast<int>(end - begin), step = kWarps * kBatch;
  const auto lookup = [&](int i) -> int64_t {
    if (lane >= kBatch) return 0;
    const int pos = static_cast<int>(begin) + (i + lane < len ? i + lane : i);
    const int64_t block = load_index(p.block_tables, row * p.bt_stride + pos / p.block_size, p.bt64);
    return block * p.block_stride + static_cast<int64_t>(pos % p.block_size) * p.token_stride;
  };
  int64_t lane_off = warp * kBatch < len ? lookup(warp * kBatch) : 0;
  for (int i = warp * kBatch; i < len; i += step) {
    float k[kBatch][DPL], v[kBatch][DPL];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t off = __shfl_sync(0xffffffffu, lane_off, j, kGroup);
      load_lane(k[j], k_cache + off, lane, p.dim, p.vec);
      load_lane(v[j], v_cache + off, lane, p.dim, p.vec);
    }
    if (i + step < len) lane_off = lookup(i + step);
#pragma unroll
    for (int g = 0; g < kMaxHeads; ++g) {
      if (g >= nh) continue;  // the same for the whole block
      float score[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        score[j] = 0.f;
#pragma unroll
        for (int d = 0; d < DPL; ++d) score[j] = fmaf(q[g][d], k[j][d], score[j]);
      }
      // The kBatch sums over the lanes side by side: independent shuffles, no chain waits on another.
#pragma unroll
      for (int off = kGroup / 2; off > 0; off /= 2) {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) score[j] += __shfl_xor_sync(0xffffffffu, score[j], off, kGroup);
      }
      float mx = m[g];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        score[j] = i + j < len ? score[j] * p.scale : -INFINITY;
        mx = fmaxf(mx, score[j]);  // finite: position i is valid
      }
      const float alpha = expf(m[g] - mx);
      float sum = 0.f;
#pragma unroll
      for (int d = 0; d < DPL; ++d) acc[g][d] *= alpha;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float e = expf(score[j] - mx);
        sum += e;
#pragma unroll
        for (int d = 0; d < DPL; ++d) acc[g][d] = fmaf(e, v[j][d], acc[g][d]);
      }
      l[g] = l[g] * alpha + sum;
      m[g] = mx;
    }
  }

  // Merge the warps: shared [kWarps][nh][dim] accumulators, then [kWarps][nh] maxima and sums. A warp
  // with no position of its own left m = -inf, l = 0 and zeros, which weigh nothing.
  float* acc_s = dynamic_shared<float>();
  float* m_s = acc_s + kWarps * nh * p.dim;
  float* l_s = m_s + kWarps * nh;
#pragma unroll
  for (int g = 0; g < kMaxHeads; ++g) {
    if (g >= nh) continue;
#pragma unroll
    for (int i = 0; i < DPL; ++i)
      if (lane * DPL + i < p.dim) acc_s[(warp * nh + g) * p.dim + lane * DPL + i] = acc[g][i];
    if (lane == 0) {
      m_s[warp * nh + g] = m[g];
      l_s[warp * nh + g] = l[g];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < nh * p.dim; c += kThreads) {
    const int g = c / p.dim;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w * nh + g]);  // finite: warp 0 has position begin
    float total = 0.f, value = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = expf(m_s[w * nh + g] - mx);
      total = fmaf(l_s[w * nh + g], weight, total);
      value = fmaf(acc_s[w * nh * p.dim + c], weight, value);
    }
    if (S == 1) {
      static_cast<OutT*>(p.out)[(row * p.heads + h0) * p.dim + c] = from_float<OutT>(value / total);
    } else {
      p.o_part[((row * S + split) * p.heads + h0) * p.dim + c] = value / total;
      if (c % p.dim == 0) p.lse_part[(row * S + split) * p.heads + h0 + g] = mx + logf(total);
    }
  }
}

// Merges the splits of one (head, row) (merge_splits, kernel_common.h). grid (heads, rows), block kMergeThreads.
template <typename OutT>
__global__ void __launch_bounds__(kMergeThreads) paged_combine_kernel(PagedParams p) {
  pdl_enter();
  const int h = blockIdx.x, S = p.num_splits;
  const int64_t row = blockIdx.y;
  merge_splits(p.lse_part + row * S * p.heads + h, p.heads, p.o_part + (row * S * p.heads + h) * p.dim,
               static_cast<int64_t>(p.heads) * p.dim, S, p.dim,
               static_cast<OutT*>(p.out) + (row * p.heads + h) * p.dim);
}

template <typename T, typename OutT, int DPL>
const char* launch_paged(PagedParams p, int64_t rows, cudaStream_t stream) {
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % (DPL * sizeof(T)) == 0; };
  p.vec = p.dim == 32 * DPL && aligned(p.q) && aligned(p.k_cache) && aligned(p.v_cache) &&
          p.block_stride % DPL == 0 && p.token_stride % DPL == 0 && p.head_stride % DPL == 0;
  const int chunks = static_cast<int>(ceil_div(p.heads / p.kv_heads, kMaxHeads));
  const int nh_max = min(kMaxHeads, p.heads / p.kv_heads);
  const size_t smem = static_cast<size_t>(kWarps) * nh_max * (p.dim + 2) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(p.kv_heads * chunks), static_cast<unsigned>(rows),
                  static_cast<unsigned>(p.num_splits));
  launch_kernel(paged_decode_kernel<T, OutT, DPL>, grid, kThreads, smem, stream, p);
  const char* err = last_launch_error();
  if (err != nullptr || p.num_splits == 1) return err;
  const dim3 merge(static_cast<unsigned>(p.heads), static_cast<unsigned>(rows));
  launch_kernel(paged_combine_kernel<OutT>, merge, kMergeThreads, merge_shared_bytes(p.num_splits), stream, p);
  return last_launch_error();
}

template <typename T, typename OutT>
const char* launch_paged(const PagedParams& p, int64_t rows, cudaStream_t stream) {
  if (p.dim <= 64) return launch_paged<T, OutT, 2>(p, rows, stream);
  if (p.dim <= 128) return launch_paged<T, OutT, 4>(p, rows, stream);
  return launch_paged<T, OutT, 8>(p, rows, stream);
}

// ---- rotary_write_kv: neox rotary on q and k, then k and v into the caches.
//
// One block per token. angle_j = position * inv_freq[j] in fp32; cos and sin rounded to T (as the layer casts
// them); with x = x1 | x2 (halves of a head), out = x * cos + rotate_half(x) * sin, rotate_half(x) = -x2 | x1,
// each product and the sum rounded to T as torch's separate ops round them (no fused multiply-add).
struct RotaryParams {
  const void *q, *k, *v;  // rows of heads * dim (q) or kv_heads * dim (k, v) at the row strides (elements)
  int64_t q_stride, k_stride, v_stride;
  const void* positions;
  bool pos64;
  const float* inv_freq;  // [dim / 2]
  void* q_out;            // [tokens, heads, dim] contiguous
  void *k_cache, *v_cache;
  int64_t block_stride, token_stride, head_stride, block_size;  // elements; the same for K and V
  const void* slot_mapping;
  bool slots64;
  int heads, kv_heads, dim;
};

constexpr int kRotaryThreads = 128;

template <typename T>
__device__ __forceinline__ void rotate_pair(T* out, const T* x, int half, int j, float c, float s) {
  const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
  out[j] = from_float<T>(__fadd_rn(round_to<T>(__fmul_rn(x1, c)), -round_to<T>(__fmul_rn(x2, s))));
  out[j + half] = from_float<T>(__fadd_rn(round_to<T>(__fmul_rn(x2, c)), round_to<T>(__fmul_rn(x1, s))));
}

template <typename T>
__global__ void __launch_bounds__(kRotaryThreads) rotary_write_kv_kernel(RotaryParams p) {
  pdl_enter();
  __shared__ float cos_s[kMaxDim / 2], sin_s[kMaxDim / 2];
  const int64_t t = blockIdx.x;
  const int half = p.dim / 2;
  const float pos = static_cast<float>(load_index(p.positions, t, p.pos64));
  for (int j = threadIdx.x; j < half; j += kRotaryThreads) {
    const float angle = __fmul_rn(pos, p.inv_freq[j]);
    cos_s[j] = round_to<T>(cosf(angle));
    sin_s[j] = round_to<T>(sinf(angle));
  }
  __syncthreads();
  const int64_t slot = load_index(p.slot_mapping, t, p.slots64);
  const int64_t at = slot < 0 ? -1 : (slot / p.block_size) * p.block_stride + (slot % p.block_size) * p.token_stride;
  const T* q = static_cast<const T*>(p.q) + t * p.q_stride;
  const T* k = static_cast<const T*>(p.k) + t * p.k_stride;
  const T* v = static_cast<const T*>(p.v) + t * p.v_stride;
  T* q_out = static_cast<T*>(p.q_out) + t * p.heads * p.dim;
  // Items: a rotated pair of each q head, then of each k head (written only at a slot).
  for (int i = threadIdx.x; i < (p.heads + p.kv_heads) * half; i += kRotaryThreads) {
    const int h = i / half, j = i - h * half;
    if (h < p.heads) {
      rotate_pair(q_out + h * p.dim, q + h * p.dim, half, j, cos_s[j], sin_s[j]);
    } else if (at >= 0) {
      const int kh = h - p.heads;
      rotate_pair(static_cast<T*>(p.k_cache) + at + kh * p.head_stride, k + kh * p.dim, half, j, cos_s[j],
                  sin_s[j]);
    }
  }
  if (at < 0) return;
  for (int i = threadIdx.x; i < p.kv_heads * p.dim; i += kRotaryThreads) {
    const int h = i / p.dim, d = i - h * p.dim;
    static_cast<T*>(p.v_cache)[at + h * p.head_stride + d] = v[h * p.dim + d];
  }
}

}  // namespace

const char* rotary_write_kv(uintptr_t q, int64_t q_stride, uintptr_t k, int64_t k_stride, uintptr_t v,
                            int64_t v_stride, uintptr_t positions, int positions_dtype, uintptr_t inv_freq,
                            uintptr_t q_out, uintptr_t k_cache, uintptr_t v_cache, int64_t block_stride,
                            int64_t token_stride, int64_t head_stride, int64_t block_size, uintptr_t slot_mapping,
                            int slot_dtype, int64_t num_tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int dtype, uintptr_t stream) {
  if (num_tokens < 0 || heads < 1 || kv_heads < 1 || block_size < 1 || head_dim < 2 || head_dim % 2 != 0)
    return "rotary_write_kv: needs num_tokens >= 0, heads, kv_heads, block_size >= 1 and an even head_dim";
  if (head_dim > kMaxDim) return "rotary_write_kv: head_dim must be <= 256";
  if ((positions_dtype != kInt32 && positions_dtype != kInt64) || (slot_dtype != kInt32 && slot_dtype != kInt64))
    return "rotary_write_kv: positions and slot_mapping must be int32 or int64";
  if (num_tokens > INT32_MAX) return "rotary_write_kv: too many tokens";
  if (num_tokens == 0) return nullptr;
  const RotaryParams p{reinterpret_cast<const void*>(q),
                       reinterpret_cast<const void*>(k),
                       reinterpret_cast<const void*>(v),
                       q_stride,
                       k_stride,
                       v_stride,
                       reinterpret_cast<const void*>(positions),
                       positions_dtype == kInt64,
                       reinterpret_cast<const float*>(inv_freq),
                       reinterpret_cast<void*>(q_out),
                       reinterpret_cast<void*>(k_cache),
                       reinterpret_cast<void*>(v_cache),
                       block_stride,
                       token_stride,
                       head_stride,
                       block_size,
                       reinterpret_cast<const void*>(slot_mapping),
                       slot_dtype == kInt64,
                       static_cast<int>(heads),
                       static_cast<int>(kv_heads),
                       static_cast<int>(head_dim)};
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "rotary_write_kv", [&]() -> const char* {
    launch_kernel(rotary_write_kv_kernel<scalar_t>, dim3(static_cast<unsigned>(num_tokens)), kRotaryThreads, 0, st,
                  p);
    return last_launch_error();
  });
}

const char* paged_decode_attention(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, int64_t block_stride,
                                   int64_t token_stride, int64_t head_stride, int64_t block_size,
                                   uintptr_t block_tables, int64_t block_table_stride, int block_table_dtype,
                                   uintptr_t seq_lens, int seq_lens_dtype, uintptr_t out, uintptr_t o_part,
                                   uintptr_t lse_part, int64_t rows, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, int64_t num_splits, double scale, int dtype, int out_dtype,
                                   uintptr_t stream) {
  if (rows < 0 || heads < 1 || kv_heads < 1 || block_size < 1 || head_dim < 1)
    return "paged_decode_attention: needs rows >= 0 and heads, kv_heads, head_dim, block_size >= 1";
  if (heads % kv_heads != 0) return "paged_decode_attention: heads must be a multiple of kv_heads";
  if (head_dim > kMaxDim) return "paged_decode_attention: head_dim must be <= 256";
  if (num_splits < 1 || num_splits > 1024) return "paged_decode_attention: num_splits must be in 1..1024";
  if (rows > 65535 || heads > 65535) return "paged_decode_attention: rows and heads must be <= 65535";
  const bool idx_ok = (block_table_dtype == kInt32 || block_table_dtype == kInt64) &&
                      (seq_lens_dtype == kInt32 || seq_lens_dtype == kInt64);
  if (!idx_ok) return "paged_decode_attention: block_tables and seq_lens must be int32 or int64";
  if (num_splits > 1 && (o_part == 0 || lse_part == 0))
    return "paged_decode_attention: num_splits > 1 needs o_part and lse_part";
  if (out_dtype != dtype && out_dtype != kFloat32)
    return "paged_decode_attention: out must be float32 or the cache's dtype";
  if (rows == 0) return nullptr;
  const PagedParams p{reinterpret_cast<const void*>(q),
                      reinterpret_cast<const void*>(k_cache),
                      reinterpret_cast<const void*>(v_cache),
                      block_stride,
                      token_stride,
                      head_stride,
                      static_cast<int>(block_size),
                      reinterpret_cast<const void*>(block_tables),
                      block_table_stride,
                      block_table_dtype == kInt64,
                      reinterpret_cast<const void*>(seq_lens),
                      seq_lens_dtype == kInt64,
                      reinterpret_cast<void*>(out),
                      reinterpret_cast<float*>(o_part),
                      reinterpret_cast<float*>(lse_part),
                      static_cast<int>(heads),
                      static_cast<int>(kv_heads),
                      static_cast<int>(head_dim),
                      static_cast<int>(num_splits),
                      static_cast<float>(scale),
                      false};
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "paged_decode_attention", [&]() -> const char* {
    return out_dtype == kFloat32 ? launch_paged<scalar_t, float>(p, rows, st)
                                 : launch_paged<scalar_t, scalar_t>(p, rows, st);
  });
}

}  // namespace atom
