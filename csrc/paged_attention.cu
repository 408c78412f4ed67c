// Paged GQA decode attention for dense models (Llama, Qwen3): one query row per token over the
// first seq_lens[t] cached positions of its sequence.
//
//   K and V caches [num_blocks, block_size, kv_heads, head_dim]; query head h reads kv head
//   h / group (group = heads / kv_heads):
//
//   score_p = q . k_p * scale          out = sum_p softmax(score)_p v_p        [heads, head_dim]
//
// One block per (row, kv head, up to kMaxHeads of its query heads, split): a position's key and
// value are read once for the block's heads. A tile's block-table lookups are made once, into
// shared memory. Long sequences are split over several blocks (flash-decoding) and the splits
// merged by their log-sum-exp (paged_combine_kernel). CUDA cores, any float dtype, head_dim <= 256.
#include "kernel_common.h"

namespace atom {
namespace {

constexpr int kTile = 32;  // positions a block scores at once
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kGroup;
constexpr int kMaxHeads = 8;  // query heads a block serves
constexpr int kMaxDim = 256;
constexpr int kCells = kMaxHeads * kMaxDim / kThreads;  // output values a thread accumulates

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
};

template <typename T, typename OutT>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(PagedParams p) {
  pdl_enter();
  __shared__ float q_s[kMaxHeads * kMaxDim];
  __shared__ float prob[kMaxHeads][kTile];  // scores, then exp(score - running max)
  __shared__ int64_t offset[kTile];         // a tile's positions in the cache (-1: past the end)
  __shared__ float m_s[kMaxHeads], l_s[kMaxHeads], alpha_s[kMaxHeads];
  const int group = p.heads / p.kv_heads;
  const int chunks = (group + kMaxHeads - 1) / kMaxHeads;
  const int kvh = blockIdx.x / chunks;
  const int h0 = kvh * group + (blockIdx.x % chunks) * kMaxHeads;  // the block's first query head
  const int nh = min(kMaxHeads, (kvh + 1) * group - h0);
  const int cells = nh * p.dim;
  const int64_t row = blockIdx.y;
  const int split = blockIdx.z, S = p.num_splits;
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const int64_t seq_len = load_index(p.seq_lens, row, p.sl64);
  const int64_t tiles = ceil_div(seq_len, kTile);
  const int64_t per_split = ceil_div(tiles, S);
  const int64_t tile_begin = split * per_split;
  const int64_t tile_end = tile_begin + per_split < tiles ? tile_begin + per_split : tiles;
  if (tile_begin >= tile_end) {  // nothing to attend to: zeros, or an empty partial
    if (S == 1) {
      OutT* out = static_cast<OutT*>(p.out) + (row * p.heads + h0) * p.dim;
      for (int c = threadIdx.x; c < cells; c += kThreads) out[c] = from_float<OutT>(0.f);
    } else if (threadIdx.x < nh) {
      p.lse_part[(row * S + split) * p.heads + h0 + threadIdx.x] = -INFINITY;
    }
    return;
  }
  const T* q = static_cast<const T*>(p.q) + (row * p.heads + h0) * p.dim;  // the block's heads, back to back
  for (int c = threadIdx.x; c < cells; c += kThreads) q_s[c] = to_float(q[c]);
  if (threadIdx.x < nh) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.f;
  }
  const T* k_cache = static_cast<const T*>(p.k_cache) + kvh * p.head_stride;
  const T* v_cache = static_cast<const T*>(p.v_cache) + kvh * p.head_stride;
  float acc[kCells];
#pragma unroll
  for (int i = 0; i < kCells; ++i) acc[i] = 0.f;

  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    if (threadIdx.x < kTile) {
      const int64_t pos = tile * kTile + threadIdx.x;
      int64_t off = -1;
      if (pos < seq_len) {
        const int64_t block = load_index(p.block_tables, row * p.bt_stride + pos / p.block_size, p.bt64);
        off = block * p.block_stride + (pos % p.block_size) * p.token_stride;
      }
      offset[threadIdx.x] = off;
    }
    __syncthreads();  // (also: q_s, m_s and l_s are set; the last tile's probabilities are used)
    // Scores: warp w takes the tile's positions w, w + kWarps, ...; its lanes split the head dim.
    for (int j = warp; j < kTile; j += kWarps) {
      const int64_t off = offset[j];
      float dot[kMaxHeads];
#pragma unroll
      for (int g = 0; g < kMaxHeads; ++g) dot[g] = 0.f;
      if (off >= 0) {
        for (int d = lane; d < p.dim; d += kGroup) {
          const float k = to_float(k_cache[off + d]);
#pragma unroll
          for (int g = 0; g < kMaxHeads; ++g)
            if (g < nh) dot[g] = fmaf(q_s[g * p.dim + d], k, dot[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < kMaxHeads; ++g) {
        if (g < nh) {  // the same for the whole warp
          const float s = group_sum(dot[g]);
          if (lane == 0) prob[g][j] = off >= 0 ? s * p.scale : -INFINITY;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < nh) {  // the online softmax of one head over the tile
      const int g = threadIdx.x;
      float mx = m_s[g];
      for (int j = 0; j < kTile; ++j) mx = fmaxf(mx, prob[g][j]);  // finite: the tile's first position is valid
      const float alpha = expf(m_s[g] - mx);
      float sum = 0.f;
      for (int j = 0; j < kTile; ++j) {
        const float e = expf(prob[g][j] - mx);
        prob[g][j] = e;
        sum += e;
      }
      l_s[g] = l_s[g] * alpha + sum;
      m_s[g] = mx;
      alpha_s[g] = alpha;
    }
    __syncthreads();
    // Values: thread t accumulates the block's output values t, t + kThreads, ... (head c / dim, column c % dim).
    const int valid = static_cast<int>(seq_len - tile * kTile < kTile ? seq_len - tile * kTile : kTile);
#pragma unroll
    for (int i = 0; i < kCells; ++i) {
      const int c = threadIdx.x + i * kThreads;
      if (c < cells) {
        const int g = c / p.dim, d = c - g * p.dim;
        float a = acc[i] * alpha_s[g];
        for (int j = 0; j < valid; ++j) a = fmaf(prob[g][j], to_float(v_cache[offset[j] + d]), a);
        acc[i] = a;
      }
    }
    __syncthreads();  // offset and prob are rewritten for the next tile
  }

#pragma unroll
  for (int i = 0; i < kCells; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (c < cells) {
      const float value = acc[i] / l_s[c / p.dim];
      if (S == 1)
        static_cast<OutT*>(p.out)[(row * p.heads + h0) * p.dim + c] = from_float<OutT>(value);
      else
        p.o_part[((row * S + split) * p.heads + h0) * p.dim + c] = value;
    }
  }
  if (S > 1 && threadIdx.x < nh)
    p.lse_part[(row * S + split) * p.heads + h0 + threadIdx.x] = m_s[threadIdx.x] + logf(l_s[threadIdx.x]);
}

// Merges the splits of one (head, row) (merge_splits, kernel_common.h). grid (heads, rows), block 128.
template <typename OutT>
__global__ void __launch_bounds__(128) paged_combine_kernel(PagedParams p) {
  pdl_enter();
  const int h = blockIdx.x, S = p.num_splits;
  const int64_t row = blockIdx.y;
  merge_splits(p.lse_part + row * S * p.heads + h, p.heads, p.o_part + (row * S * p.heads + h) * p.dim,
               static_cast<int64_t>(p.heads) * p.dim, S, p.dim,
               static_cast<OutT*>(p.out) + (row * p.heads + h) * p.dim);
}

template <typename T, typename OutT>
const char* launch_paged(const PagedParams& p, int64_t rows, cudaStream_t stream) {
  const int chunks = static_cast<int>(ceil_div(p.heads / p.kv_heads, kMaxHeads));
  const dim3 grid(static_cast<unsigned>(p.kv_heads * chunks), static_cast<unsigned>(rows),
                  static_cast<unsigned>(p.num_splits));
  launch_kernel(paged_decode_kernel<T, OutT>, grid, kThreads, 0, stream, p);
  const char* err = last_launch_error();
  if (err != nullptr || p.num_splits == 1) return err;
  const dim3 merge(static_cast<unsigned>(p.heads), static_cast<unsigned>(rows));
  launch_kernel(paged_combine_kernel<OutT>, merge, 128, split_weights(p.num_splits) * sizeof(float), stream, p);
  return last_launch_error();
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
                      static_cast<float>(scale)};
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "paged_decode_attention", [&]() -> const char* {
    return out_dtype == kFloat32 ? launch_paged<scalar_t, float>(p, rows, st)
                                 : launch_paged<scalar_t, scalar_t>(p, rows, st);
  });
}

}  // namespace atom
