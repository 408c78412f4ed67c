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

constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;

struct MlaParams {
  const void* q_latent;  // [B, H, rank] contiguous
  const void* q_pe;      // [B, H, rope] contiguous
  const void* cache;     // row of (block, i) at block * block_stride + i * row_stride elements
  int64_t block_stride, row_stride;
  int block_size;
  const void* block_tables;  // [B, >= ceil(seq_len / block_size)] at row stride bt_stride
  int64_t bt_stride;
  bool bt64;
  const void* seq_lens;  // [B]
  bool sl64;
  void* out;        // [B, H, rank]
  float* o_part;    // [B, splits, H, rank]: each split's normalised output (splits > 1)
  float* lse_part;  // [B, splits, H]: natural-log sum of exp(score) of each split
  int heads, rank, rope, num_splits;
  float scale;
};

// The positions [begin, end) of `tile`-sized tiles that split `split` owns.
struct TileRange {
  int64_t begin, end;
};
__device__ __forceinline__ TileRange split_tiles(int64_t seq_len, int tile, int split, int num_splits) {
  const int64_t tiles = ceil_div(seq_len, tile);
  const int64_t per = ceil_div(tiles, num_splits);
  const int64_t begin = split * per;
  return {begin, begin + per < tiles ? begin + per : tiles};
}

// Element offset of position `pos` of sequence b in the cache.
__device__ __forceinline__ int64_t row_offset(const MlaParams& p, int64_t b, int64_t pos) {
  const int64_t blk = load_index(p.block_tables, b * p.bt_stride + pos / p.block_size, p.bt64);
  return blk * p.block_stride + (pos % p.block_size) * p.row_stride;
}

// A split with no positions: zeros (single split) or an empty partial.
template <typename OutT>
__device__ void write_empty(const MlaParams& p, int64_t b, int split, int h0, int nh) {
  if (p.num_splits == 1) {
    OutT* out = static_cast<OutT*>(p.out);
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(nh) * p.rank; i += blockDim.x)
      out[(b * p.heads + h0) * p.rank + i] = from_float<OutT>(0.f);
  } else {
    for (int i = threadIdx.x; i < nh; i += blockDim.x)
      p.lse_part[(b * p.num_splits + split) * p.heads + h0 + i] = -INFINITY;
  }
}

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

#ifdef ATOM_MLA_MMA
// ---- tensor-core kernel: bf16, rank 512, rope 64.
namespace mma {

constexpr int kRank = 512, kRope = 64, kDim = kRank + kRope;
constexpr int kHeads = 32;            // heads per block (two m16 tiles)
constexpr int kTile = 64;             // positions per tile
constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kRowPad = kDim + 8;     // 1168-byte rows: ldmatrix's 8 rows hit distinct banks
constexpr int kSPad = kTile + 8;      // fp32 score rows
constexpr int kPPad = kTile + 8;      // bf16 probability rows
constexpr int kChunks = kDim / 8;     // 16-byte chunks per cache row

struct Smem {
  bf16_t kv[2][kTile][kRowPad];
  bf16_t q[kHeads][kRowPad];
  float s[kHeads][kSPad];
  bf16_t p[kHeads][kPPad];
  int64_t rows[2][kTile];  // element offsets of a tile's positions, -1 past the end
  float alpha[kHeads];
  float m[kHeads], l[kHeads];
};

__device__ __forceinline__ void load_tile(Smem& sm, int stage, const int64_t* rows, const bf16_t* cache) {
  for (int c = threadIdx.x; c < kTile * kChunks; c += kThreads) {
    const int j = c / kChunks, part = c % kChunks;
    const int64_t off = rows[j];
    ptx::cp_async_16(&sm.kv[stage][j][part * 8], off >= 0 ? cache + off + part * 8 : cache, off >= 0);
  }
}

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_mma_kernel(MlaParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t4 = lane & 3;  // mma fragment row / column pair
  const int split = blockIdx.x, h0 = blockIdx.y * kHeads;
  const int64_t b = blockIdx.z;
  const int nh = min(kHeads, p.heads - h0);
  const int64_t seq_len = load_index(p.seq_lens, b, p.sl64);
  const TileRange tiles = split_tiles(seq_len, kTile, split, p.num_splits);
  if (tiles.begin >= tiles.end) {
    write_empty<OutT>(p, b, split, h0, nh);
    return;
  }
  const bf16_t* cache = static_cast<const bf16_t*>(p.cache);
  auto tile_row = [&](int64_t tile, int j) -> int64_t {
    const int64_t pos = tile * kTile + j;
    return (tile < tiles.end && pos < seq_len) ? row_offset(p, b, pos) : -1;
  };

  // Prologue: offsets of the first two tiles, Q (zero rows past the last head), tile 0.
  if (threadIdx.x < kTile) {
    sm.rows[0][threadIdx.x] = tile_row(tiles.begin, threadIdx.x);
    sm.rows[1][threadIdx.x] = tile_row(tiles.begin + 1, threadIdx.x);
  }
  {
    const bf16_t* ql = static_cast<const bf16_t*>(p.q_latent);
    const bf16_t* qp = static_cast<const bf16_t*>(p.q_pe);
    for (int c = threadIdx.x; c < kHeads * kChunks; c += kThreads) {
      const int hh = c / kChunks, part = c % kChunks;
      const int64_t head = b * p.heads + h0 + hh;
      const bf16_t* src = part < kRank / 8 ? ql + head * kRank + part * 8 : qp + head * kRope + (part - kRank / 8) * 8;
      ptx::cp_async_16(&sm.q[hh][part * 8], hh < nh ? src : ql, hh < nh);
    }
  }
  __syncthreads();
  load_tile(sm, 0, sm.rows[0], cache);
  ptx::cp_async_commit();

  float o[2][8][4];  // [m tile][n tile][fragment]: heads 16mt+g(+8), columns 64w+8nt+2t4(+1)
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.f;
  float m_run[4], l_run[4];  // softmax rows 4w + i, same value in every lane
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.f;
  }
  const float scale_log2 = p.scale * kLog2e;

  for (int64_t tile = tiles.begin; tile < tiles.end; ++tile) {
    const int it = static_cast<int>(tile - tiles.begin), stage = it & 1;
    // Offsets two tiles ahead: loaded now, stored at the end, so the load's latency hides behind this tile.
    const int64_t next_row = threadIdx.x < kTile ? tile_row(tile + 2, threadIdx.x) : -1;
    if (tile + 1 < tiles.end) load_tile(sm, stage ^ 1, sm.rows[(it + 1) & 1], cache);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();  // this tile (and Q) landed for this thread ...
    __syncthreads();          // ... and for every thread

    {  // S = Q K^T, scaled to base 2, masked past seq_len
      const int mt = warp & 1, n0 = (warp >> 1) * 16;
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const bf16_t* a_ptr = &sm.q[mt * 16 + (lane & 15)][(lane >> 4) * 8];
      const bf16_t* b_ptr = &sm.kv[stage][n0 + (lane & 7) + ((lane >> 4) << 3)][((lane >> 3) & 1) * 8];
#pragma unroll 6
      for (int ks = 0; ks < kDim / 16; ++ks) {
        uint32_t a[4], bb[4];
        ptx::ldmatrix_x4(a, a_ptr + ks * 16);
        ptx::ldmatrix_x4(bb, b_ptr + ks * 16);
        ptx::mma_bf16_16816(acc[0], a, bb[0], bb[1]);
        ptx::mma_bf16_16816(acc[1], a, bb[2], bb[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = n0 + nt * 8 + 2 * t4;
        const int64_t pos = tile * kTile + col;
        const bool ok0 = pos < seq_len, ok1 = pos + 1 < seq_len;
        sm.s[mt * 16 + g][col] = ok0 ? acc[nt][0] * scale_log2 : -INFINITY;
        sm.s[mt * 16 + g][col + 1] = ok1 ? acc[nt][1] * scale_log2 : -INFINITY;
        sm.s[mt * 16 + g + 8][col] = ok0 ? acc[nt][2] * scale_log2 : -INFINITY;
        sm.s[mt * 16 + g + 8][col + 1] = ok1 ? acc[nt][3] * scale_log2 : -INFINITY;
      }
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < 4; ++i) {  // online softmax of rows 4w + i
      const int row = warp * 4 + i;
      const float x0 = sm.s[row][2 * lane], x1 = sm.s[row][2 * lane + 1];
      const float m_new = fmaxf(m_run[i], group_max(fmaxf(x0, x1)));  // finite: position 0 of a tile is valid
      const float alpha = exp2f(m_run[i] - m_new);
      const float p0 = exp2f(x0 - m_new), p1 = exp2f(x1 - m_new);
      l_run[i] = l_run[i] * alpha + group_sum(p0 + p1);
      m_run[i] = m_new;
      sm.p[row][2 * lane] = from_float<bf16_t>(p0);
      sm.p[row][2 * lane + 1] = from_float<bf16_t>(p1);
      if (lane == 0) sm.alpha[row] = alpha;
    }
    __syncthreads();

    {  // O = alpha * O + P C over this warp's 64 latent columns
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float a0 = sm.alpha[mt * 16 + g], a1 = sm.alpha[mt * 16 + g + 8];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          o[mt][nt][0] *= a0;
          o[mt][nt][1] *= a0;
          o[mt][nt][2] *= a1;
          o[mt][nt][3] *= a1;
        }
      }
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ptx::ldmatrix_x4(a[mt], &sm.p[mt * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bb[4];
          ptx::ldmatrix_x4_trans(bb, &sm.kv[stage][ks * 16 + (lane & 15)][warp * 64 + np * 16 + (lane >> 4) * 8]);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            ptx::mma_bf16_16816(o[mt][2 * np], a[mt], bb[0], bb[1]);
            ptx::mma_bf16_16816(o[mt][2 * np + 1], a[mt], bb[2], bb[3]);
          }
        }
      }
    }
    if (threadIdx.x < kTile) sm.rows[it & 1][threadIdx.x] = next_row;
    __syncthreads();  // stage, p, alpha and rows are rewritten next tile
  }

  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sm.m[warp * 4 + i] = m_run[i];
      sm.l[warp * 4 + i] = l_run[i];
    }
  }
  __syncthreads();
  const int64_t part = (b * p.num_splits + split) * p.heads + h0;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = mt * 16 + g + half * 8;
      if (row >= nh) continue;
      const float inv = 1.f / sm.l[row];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int col = warp * 64 + nt * 8 + 2 * t4;
        const float v0 = o[mt][nt][2 * half] * inv, v1 = o[mt][nt][2 * half + 1] * inv;
        if (p.num_splits == 1) {
          OutT* out = static_cast<OutT*>(p.out) + (b * p.heads + h0 + row) * kRank + col;
          out[0] = from_float<OutT>(v0);
          out[1] = from_float<OutT>(v1);
        } else {
          *reinterpret_cast<float2*>(p.o_part + (part + row) * kRank + col) = make_float2(v0, v1);
        }
      }
    }
  }
  if (p.num_splits > 1 && threadIdx.x < nh)
    p.lse_part[part + threadIdx.x] = (sm.m[threadIdx.x] + log2f(sm.l[threadIdx.x])) * kLn2;
}

}  // namespace mma
#endif  // ATOM_MLA_MMA

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
