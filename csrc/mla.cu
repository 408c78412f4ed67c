// MLA decode attention over the paged latent cache, absorbed form.
//
// Every head of sequence b attends over the same cached rows
// [c (rank) | k_rot (rope)] of its first seq_lens[b] positions:
//
//   score_p = (q_latent . c_p + q_pe . k_rot_p) * scale
//   out     = sum_p softmax(score)_p c_p                  [H, rank]
//
// so a sequence's cache is read once for all its heads (multi-query shape).
// With 32 heads that is ~60 flop per cache byte: more than CUDA cores can do
// at HBM speed, so the bf16 512/64 case (Kimi-Linear, DeepSeek) runs on the
// tensor cores (mma.sync m16n8k16). Tiles of 64 positions stream through a
// two-stage cp.async ring; each block owns 32 heads and one split of the
// positions (flash-decoding); a combine kernel merges splits by their
// log-sum-exp. Other dtypes / sizes, and HIP, use a CUDA-core kernel.
//
//   block (split s, head group, b), 8 warps, per 64-position tile:
//     S[32 x 64]  = Q[32 x 576] K^T      warp w: heads 16*(w&1).., positions 16*(w>>1)..
//     online softmax (fp32, base 2)       warp w: rows 4w .. 4w+3
//     O[32 x 512] = a O + P[32 x 64] C    warp w: latent columns 64w .. 64w+63
#include "kernel_common.h"

#if !defined(__HIPCC__) && !defined(USE_ROCM)
#define ATOM_MLA_MMA 1
#include "mma_sm80.h"
#endif

namespace atom {
namespace {

// ---- CUDA-core kernel: any dtype, rank <= 1024, any rope.
// grid (H, B, splits), block 128; warp w scores positions 8w .. 8w+7 of each
// 32-position tile, then every thread updates its latent columns.
constexpr int kGenericTile = 32;
constexpr int kGenericThreads = 128;
constexpr int kGenericMaxCols = 8;  // rank <= 128 * 8

template <typename T, typename OutT>
__global__ void __launch_bounds__(kGenericThreads) mla_decode_generic_kernel(MlaParams p) {
  extern __shared__ float q_s[];  // rank + rope
  __shared__ float score[kGenericTile];
  const int h = blockIdx.x, split = blockIdx.z;
  const int64_t b = blockIdx.y;
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const int dim = p.rank + p.rope;
  const int64_t seq_len = load_index(p.seq_lens, b, p.sl64);
  const TileRange tiles = split_tiles(seq_len, kGenericTile, split, p.num_splits);
  if (tiles.begin >= tiles.end) {
    write_empty<OutT>(p, b, split, h, 1);
    return;
  }
  const T* ql = static_cast<const T*>(p.q_latent) + (b * p.heads + h) * p.rank;
  const T* qp = static_cast<const T*>(p.q_pe) + (b * p.heads + h) * p.rope;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) q_s[d] = to_float(d < p.rank ? ql[d] : qp[d - p.rank]);
  __syncthreads();

  const T* cache = static_cast<const T*>(p.cache);
  float m = -INFINITY, l = 0.f, acc[kGenericMaxCols];
#pragma unroll
  for (int i = 0; i < kGenericMaxCols; ++i) acc[i] = 0.f;

  for (int64_t tile = tiles.begin; tile < tiles.end; ++tile) {
    for (int j = 0; j < kGenericTile / 4; ++j) {
      const int jj = warp * (kGenericTile / 4) + j;
      const int64_t pos = tile * kGenericTile + jj;
      float dot = 0.f;
      if (pos < seq_len) {
        const T* row = cache + row_offset(p, b, pos);
        for (int d = lane; d < dim; d += kGroup) dot = fmaf(q_s[d], to_float(row[d]), dot);
      }
      dot = group_sum(dot);
      if (lane == 0) score[jj] = pos < seq_len ? dot * p.scale : -INFINITY;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int j = 0; j < kGenericTile; ++j) mx = fmaxf(mx, score[j]);
    const float m_new = fmaxf(m, mx);  // finite: a tile's first position is valid
    const float alpha = expf(m - m_new);
    l *= alpha;
#pragma unroll
    for (int i = 0; i < kGenericMaxCols; ++i) acc[i] *= alpha;
    for (int j = 0; j < kGenericTile; ++j) {
      const int64_t pos = tile * kGenericTile + j;
      if (pos >= seq_len) break;
      const float pj = expf(score[j] - m_new);
      l += pj;
      const T* row = cache + row_offset(p, b, pos);
#pragma unroll
      for (int i = 0; i < kGenericMaxCols; ++i) {
        const int d = threadIdx.x + i * kGenericThreads;
        if (d < p.rank) acc[i] = fmaf(pj, to_float(row[d]), acc[i]);
      }
    }
    m = m_new;
    __syncthreads();  // score is rewritten next tile
  }

  const float inv = 1.f / l;
  if (p.num_splits == 1) {
    OutT* out = static_cast<OutT*>(p.out) + (b * p.heads + h) * p.rank;
#pragma unroll
    for (int i = 0; i < kGenericMaxCols; ++i) {
      const int d = threadIdx.x + i * kGenericThreads;
      if (d < p.rank) out[d] = from_float<OutT>(acc[i] * inv);
    }
  } else {
    const int64_t part = (b * p.num_splits + split) * p.heads + h;
    float* o = p.o_part + part * p.rank;
#pragma unroll
    for (int i = 0; i < kGenericMaxCols; ++i) {
      const int d = threadIdx.x + i * kGenericThreads;
      if (d < p.rank) o[d] = acc[i] * inv;
    }
    if (threadIdx.x == 0) p.lse_part[part] = m + logf(l);
  }
}

// ---- merge splits: out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M). grid (H, B), block 128.
template <typename OutT>
__global__ void __launch_bounds__(128) mla_combine_kernel(MlaParams p) {
  extern __shared__ float weight[];  // num_splits
  const int h = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int S = p.num_splits;
  const float* lse = p.lse_part + b * S * p.heads + h;
  float mx = -INFINITY;
  for (int s = 0; s < S; ++s) mx = fmaxf(mx, lse[static_cast<int64_t>(s) * p.heads]);
  OutT* out = static_cast<OutT*>(p.out) + (b * p.heads + h) * p.rank;
  if (mx == -INFINITY) {  // no positions at all
    for (int d = threadIdx.x; d < p.rank; d += blockDim.x) out[d] = from_float<OutT>(0.f);
    return;
  }
  for (int s = threadIdx.x; s < S; s += blockDim.x) weight[s] = expf(lse[static_cast<int64_t>(s) * p.heads] - mx);
  __syncthreads();
  float total = 0.f;
  for (int s = 0; s < S; ++s) total += weight[s];
  const float inv = 1.f / total;
  for (int d = threadIdx.x; d < p.rank; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < S; ++s) {
      if (weight[s] == 0.f) continue;  // empty split: its partial was never written
      acc = fmaf(weight[s], p.o_part[((b * S + s) * p.heads + h) * p.rank + d], acc);
    }
    out[d] = from_float<OutT>(acc * inv);
  }
}

template <typename T, typename OutT>
const char* launch_decode(const MlaParams& p, int64_t batch, bool use_mma, cudaStream_t stream) {
#ifdef ATOM_MLA_MMA
  if (use_mma) {
    const size_t smem = sizeof(mma::Smem);
    auto kernel = mma::mla_decode_mma_kernel<OutT>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return cudaGetErrorString(err);
    const dim3 grid(p.num_splits, static_cast<unsigned>(ceil_div(p.heads, mma::kHeads)), static_cast<unsigned>(batch));
    kernel<<<grid, mma::kThreads, smem, stream>>>(p);
  } else
#endif
  {
    (void)use_mma;
    const size_t smem = static_cast<size_t>(p.rank + p.rope) * sizeof(float);
    const dim3 grid(p.heads, static_cast<unsigned>(batch), p.num_splits);
    mla_decode_generic_kernel<T, OutT><<<grid, kGenericThreads, smem, stream>>>(p);
  }
  if (const char* err = last_launch_error()) return err;
  if (p.num_splits > 1) {
    const dim3 grid(p.heads, static_cast<unsigned>(batch));
    mla_combine_kernel<OutT><<<grid, 128, p.num_splits * sizeof(float), stream>>>(p);
  }
  return last_launch_error();
}

template <typename T>
const char* dispatch_out(const MlaParams& p, int64_t batch, bool use_mma, int out_dtype, cudaStream_t stream) {
  switch (out_dtype) {
    case kFloat32:
      return launch_decode<T, float>(p, batch, use_mma, stream);
    case kBFloat16:
      return launch_decode<T, bf16_t>(p, batch, use_mma, stream);
    case kFloat16:
      return launch_decode<T, fp16_t>(p, batch, use_mma, stream);
    default:
      return "mla_decode: out must be float32, bfloat16 or float16";
  }
}

}  // namespace

bool mla_decode_has_tensor_cores() {
#ifdef ATOM_MLA_MMA
  return true;
#else
  return false;
#endif
}

const char* mla_decode(uintptr_t q_latent, uintptr_t q_pe, uintptr_t cache, int64_t block_stride,
                       int64_t row_stride, int64_t block_size, uintptr_t block_tables, int64_t block_table_stride,
                       int block_table_dtype, uintptr_t seq_lens, int seq_lens_dtype, uintptr_t out,
                       uintptr_t o_part, uintptr_t lse_part, int64_t batch, int64_t heads, int64_t rank,
                       int64_t rope_dim, int64_t num_splits, double scale, int dtype, int out_dtype,
                       bool allow_tensor_cores, uintptr_t stream) {
  if (batch < 0 || heads < 1 || rank < 1 || rope_dim < 0 || block_size < 1)
    return "mla_decode: needs batch >= 0, heads, rank, block_size >= 1, rope_dim >= 0";
  if (num_splits < 1 || num_splits > 1024) return "mla_decode: num_splits must be in 1..1024";
  if (num_splits > 1 && (o_part == 0 || lse_part == 0)) return "mla_decode: num_splits > 1 needs o_part and lse_part";
  if (batch > 65535 || heads > 65535) return "mla_decode: batch and heads must be <= 65535";
  const bool idx_ok = (block_table_dtype == kInt32 || block_table_dtype == kInt64) &&
                      (seq_lens_dtype == kInt32 || seq_lens_dtype == kInt64);
  if (!idx_ok) return "mla_decode: block_tables and seq_lens must be int32 or int64";
  if (batch == 0) return nullptr;
  MlaParams p{reinterpret_cast<const void*>(q_latent),
              reinterpret_cast<const void*>(q_pe),
              reinterpret_cast<const void*>(cache),
              block_stride,
              row_stride,
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
              static_cast<int>(rank),
              static_cast<int>(rope_dim),
              static_cast<int>(num_splits),
              static_cast<float>(scale)};
  cudaStream_t st = as_stream(stream);
  const bool aligned16 = (q_latent | q_pe | cache) % 16 == 0 && block_stride % 8 == 0 && row_stride % 8 == 0;
  const bool use_mma = allow_tensor_cores && mla_decode_has_tensor_cores() && dtype == kBFloat16 &&
                       rank == 512 && rope_dim == 64 && aligned16;
  if (!use_mma && rank > kGenericThreads * kGenericMaxCols) return "mla_decode: rank must be <= 1024";
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "mla_decode", [&]() {
    return dispatch_out<scalar_t>(p, batch, use_mma, out_dtype, st);
  });
}

}  // namespace atom
