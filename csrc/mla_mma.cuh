// Tensor-core (mma.sync m16n8k16, bf16 in, fp32 accumulate) MLA decode for
// rank 512 + rope 64, included by mla.cu on CUDA builds only.
//
// A block owns one sequence, 32 heads (two m16 tiles) and one split of the
// positions; 64-position tiles of cache rows stream through a two-stage
// cp.async ring. Per tile:
//
//   S[32 x 64]  = Q[32 x 576] K^T          partial sums over four k quarters
//   online softmax in fp32, base 2          (P rounded to bf16 for the next product)
//   O[32 x 512] = alpha O + P[32 x 64] C    C = the tile's first 512 columns
//
// mla_decode_mma_kernel<W, kLean, kBulk> (W = 8 or 16 warps): warp w keeps Q's
// fragments for heads 16*(w&1).. and k quarter (w>>1)&3 in registers all
// along, so the S product reads only K from shared memory (9 k-steps, up to
// 8 independent accumulators); the softmax sums the four k-quarter partials.
// PV: warp w owns 512/W latent columns. kLean: each row's softmax on 32/R
// lanes (R rows per warp at once, shorter shuffle chains) and 3 barriers per
// tile instead of 4 (the next tile's data is awaited at the end of this one).
// kBulk (with kLean, sm_90): each cache row arrives by one cp.async.bulk
// completing on the stage's mbarrier instead of 72 16-byte cp.async.
// Where the build has no sm_90a code (or the GPU is not compute capability
// 9.0) the default is 16 warps, lean, no bulk copies: the fastest of these on
// an H200 (GPU_NOTES.md: 62% of the copy ceiling at batch 64, ctx 4096; the
// sm_90a kernel in mla_wgmma.cuh reaches 66%); the others stay selectable
// (MlaKernel) to re-measure.
#pragma once

#include "mla_common.cuh"
#include "bulk_copy_sm90.h"
#include "mma_sm80.h"

namespace atom {
namespace {
namespace mma {

constexpr int kRank = 512, kRope = 64, kDim = kRank + kRope;
constexpr int kHeads = 32;         // heads per block (two m16 tiles)
constexpr int kTile = 64;          // positions per tile
constexpr int kRowPad = kDim + 8;  // 1168-byte rows: ldmatrix's 8 rows land on distinct banks
constexpr int kSPad = kTile + 8;   // fp32 score rows
constexpr int kPPad = kTile + 8;   // bf16 probability rows
constexpr int kChunks = kDim / 8;  // 16-byte chunks per cache row
constexpr int kKSteps = kDim / 16;  // 36 k-steps of 16
constexpr int kKSplit = 4;          // S's k range in quarters ...
constexpr int kKPer = kKSteps / kKSplit;  // ... of 9 k-steps, Q fragments in registers
constexpr int kQBytes = kHeads * kRowPad * 2;
constexpr int kSBytes = kKSplit * kHeads * kSPad * 4;

struct Smem {
  bf16_t kv[2][kTile][kRowPad];
  // Q until its fragments are in registers, then the k-quarter partial scores.
  alignas(16) unsigned char qs[kQBytes > kSBytes ? kQBytes : kSBytes];
  bf16_t p[kHeads][kPPad];
  int64_t rows[2][kTile];  // element offsets of a tile's positions, -1 past the end
  float alpha[kHeads];
  float m[kHeads], l[kHeads];
  uint64_t bar[2];  // kBulk: one mbarrier per stage
};

__device__ __forceinline__ bf16_t* q_row(Smem& sm, int head) {
  return reinterpret_cast<bf16_t*>(sm.qs) + head * kRowPad;
}
__device__ __forceinline__ float* s_row(Smem& sm, int quarter, int head) {
  return reinterpret_cast<float*>(sm.qs) + (quarter * kHeads + head) * kSPad;
}

template <int kWarps, bool kLean, bool kBulk, typename OutT>
__global__ void __launch_bounds__(kWarps * 32, 1) mla_decode_mma_kernel(MlaParams p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kNGroups = kWarps / (2 * kKSplit);  // position groups in S: 1 or 2
  constexpr int kSN = 8 / kNGroups;                 // S n-tiles (8 positions) per warp
  constexpr int kCols = kRank / kWarps;             // PV: latent columns per warp
  constexpr int kPN = kCols / 8;                    // PV: n-tiles per warp
  constexpr int kRowsPerWarp = kHeads / kWarps;     // softmax rows per warp
  constexpr int kRowLanes = kGroup / kRowsPerWarp;  // kLean: lanes per softmax row ...
  constexpr int kLaneCols = kTile / kRowLanes;      // ... and columns per lane (4 or 8)
  constexpr int kRowThreads = kThreads / kTile;     // threads copying one cache row
  constexpr int kRowChunks = kChunks / kRowThreads;
  static_assert(kWarps == 8 || kWarps == 16, "8 or 16 warps");
  static_assert(kLean || !kBulk, "bulk copies come with the lean loop");
  static_assert(kChunks % kRowThreads == 0, "a row splits evenly over its threads");

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
  // Tile loads. cp.async: kRowThreads threads per row, kRowChunks 16-byte chunks each.
  // kBulk: thread j < 64 moves row j with one bulk copy (or zero-fills it past the
  // end), thread 0 announces the tile's bytes on the stage's mbarrier.
  const int ld_row = threadIdx.x / kRowThreads, ld_sub = threadIdx.x % kRowThreads;
  auto load_tile = [&](int stage, const int64_t* rows, int64_t tile) {
    if constexpr (kBulk) {
      if (threadIdx.x < kTile) {
        const int64_t off = rows[threadIdx.x];
        bf16_t* dst = &sm.kv[stage][threadIdx.x][0];
        ptx::fence_proxy_async();
        if (threadIdx.x == 0) {
          const int64_t left = seq_len - tile * kTile;
          ptx::mbar_arrive_expect_tx(&sm.bar[stage], static_cast<uint32_t>(left < kTile ? left : kTile) * kDim * 2);
        }
        if (off >= 0) {
          ptx::bulk_copy_g2s(dst, cache + off, kDim * 2, &sm.bar[stage]);
        } else {
#pragma unroll 8
          for (int c = 0; c < kDim; c += 8) *reinterpret_cast<uint4*>(dst + c) = make_uint4(0, 0, 0, 0);
        }
      }
    } else {
      const int64_t off = rows[ld_row];
      const bf16_t* src = cache + (off >= 0 ? off : 0);
      bf16_t* dst = &sm.kv[stage][ld_row][0];
#pragma unroll
      for (int i = 0; i < kRowChunks; ++i) {
        const int c = (ld_sub + i * kRowThreads) * 8;
        ptx::cp_async_16(dst + c, src + (off >= 0 ? c : 0), off >= 0);
      }
      ptx::cp_async_commit();
    }
  };

  // Prologue: offsets of the first two tiles; Q (zero rows past the last head); tile 0.
  if constexpr (kBulk) {
    if (threadIdx.x == 0) {
      ptx::mbar_init(&sm.bar[0], 1);
      ptx::mbar_init(&sm.bar[1], 1);
      ptx::fence_mbar_init();
    }
  }
  if (threadIdx.x < kTile) {
    sm.rows[0][threadIdx.x] = tile_row<kTile>(p, b, seq_len, tiles, tiles.begin, threadIdx.x);
    sm.rows[1][threadIdx.x] = tile_row<kTile>(p, b, seq_len, tiles, tiles.begin + 1, threadIdx.x);
  }
  {
    const bf16_t* ql = static_cast<const bf16_t*>(p.q_latent);
    const bf16_t* qp = static_cast<const bf16_t*>(p.q_pe);
    for (int c = threadIdx.x; c < kHeads * kChunks; c += kThreads) {
      const int hh = c / kChunks, part = c % kChunks;
      const int64_t head = b * p.heads + h0 + hh;
      const bf16_t* src = part < kRank / 8 ? ql + head * kRank + part * 8 : qp + head * kRope + (part - kRank / 8) * 8;
      ptx::cp_async_16(q_row(sm, hh) + part * 8, hh < nh ? src : ql, hh < nh);
    }
    ptx::cp_async_commit();
  }
  __syncthreads();  // rows[0], rows[1] (and the mbarriers)
  load_tile(0, sm.rows[0], tiles.begin);
  ptx::cp_async_wait<kBulk ? 0 : 1>();  // Q (this thread's part) ...
  __syncthreads();                      // ... and everyone's

  const int mt = warp & 1, kq = (warp >> 1) & (kKSplit - 1), ng = warp / (2 * kKSplit);
  uint32_t qf[kKPer][4];  // A fragments: heads 16mt.., k-steps kq*kKPer ..
#pragma unroll
  for (int i = 0; i < kKPer; ++i)
    ptx::ldmatrix_x4(qf[i], q_row(sm, mt * 16 + (lane & 15)) + (kq * kKPer + i) * 16 + (lane >> 4) * 8);
  if constexpr (kBulk) {
    ptx::mbar_wait(&sm.bar[0], 0);  // tile 0 too: the lean loop awaits tile t+1 at the end of tile t
  } else if constexpr (kLean) {
    ptx::cp_async_wait<0>();
  }
  __syncthreads();  // the Q region holds partial scores from here on

  float o[2][kPN][4];  // [m tile][n tile][fragment]: heads 16mt+g(+8), columns kCols*w+8nt+2t4(+1)
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int nt = 0; nt < kPN; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[a][nt][i] = 0.f;
  float m_run[kRowsPerWarp], l_run[kRowsPerWarp];  // softmax rows kRowsPerWarp*w + i, same in every lane
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.f;
  }
  const float scale_log2 = p.scale * kLog2e;

  for (int64_t tile = tiles.begin; tile < tiles.end; ++tile) {
    const int it = static_cast<int>(tile - tiles.begin), stage = it & 1;
    // Offsets two tiles ahead: loaded now, stored at the end, so the load's latency hides behind this tile.
    const int64_t next_row = threadIdx.x < kTile ? tile_row<kTile>(p, b, seq_len, tiles, tile + 2, threadIdx.x) : -1;
    if (tile + 1 < tiles.end) {
      load_tile(stage ^ 1, sm.rows[(it + 1) & 1], tile + 1);
    } else if constexpr (!kBulk) {
      ptx::cp_async_commit();  // an empty group keeps wait<1> below meaning "this tile"
    }
    if constexpr (!kLean) {
      ptx::cp_async_wait<1>();  // this tile landed for this thread ...
      __syncthreads();          // ... and for every thread
    }

    {  // partial S over this warp's k quarter, for positions ng * 8 * kSN ..
      const int n0 = ng * 8 * kSN;
      float acc[kSN][4];
#pragma unroll
      for (int nt = 0; nt < kSN; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
      const bf16_t* b_ptr = &sm.kv[stage][n0 + (lane & 7) + ((lane >> 4) << 3)][kq * kKPer * 16 + ((lane >> 3) & 1) * 8];
#pragma unroll
      for (int i = 0; i < kKPer; ++i) {
#pragma unroll
        for (int np = 0; np < kSN / 2; ++np) {
          uint32_t bb[4];
          ptx::ldmatrix_x4(bb, b_ptr + np * 16 * kRowPad + i * 16);
          ptx::mma_bf16_16816(acc[2 * np], qf[i], bb[0], bb[1]);
          ptx::mma_bf16_16816(acc[2 * np + 1], qf[i], bb[2], bb[3]);
        }
      }
      float* s0 = s_row(sm, kq, mt * 16 + g);
      float* s1 = s_row(sm, kq, mt * 16 + g + 8);
#pragma unroll
      for (int nt = 0; nt < kSN; ++nt) {
        const int col = n0 + nt * 8 + 2 * t4;
        *reinterpret_cast<float2*>(s0 + col) = make_float2(acc[nt][0], acc[nt][1]);
        *reinterpret_cast<float2*>(s1 + col) = make_float2(acc[nt][2], acc[nt][3]);
      }
    }
    __syncthreads();

    if constexpr (kLean) {  // online softmax: row kRowsPerWarp*w + lane / kRowLanes, kLaneCols columns per lane
      const int i = lane / kRowLanes, row = warp * kRowsPerWarp + i, c0 = (lane % kRowLanes) * kLaneCols;
      float x[kLaneCols];
#pragma unroll
      for (int c = 0; c < kLaneCols; ++c) x[c] = 0.f;
#pragma unroll
      for (int k = 0; k < kKSplit; ++k) {
#pragma unroll
        for (int c = 0; c < kLaneCols; c += 4) {
          const float4 v = *reinterpret_cast<const float4*>(s_row(sm, k, row) + c0 + c);
          x[c] += v.x;
          x[c + 1] += v.y;
          x[c + 2] += v.z;
          x[c + 3] += v.w;
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < kLaneCols; ++c) {
        x[c] = tile * kTile + c0 + c < seq_len ? x[c] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, x[c]);
      }
#pragma unroll
      for (int off = kRowLanes / 2; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off, kGroup));
      // m_run[0] holds this lane's row (every lane of a row agrees)
      const float m_new = fmaxf(m_run[0], mx);  // finite: position 0 of a tile is valid
      const float alpha = exp2f(m_run[0] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kLaneCols; c += 2) {
        const float p0 = exp2f(x[c] - m_new), p1 = exp2f(x[c + 1] - m_new);
        sum += p0 + p1;
        sm.p[row][c0 + c] = from_float<bf16_t>(p0);
        sm.p[row][c0 + c + 1] = from_float<bf16_t>(p1);
      }
#pragma unroll
      for (int off = kRowLanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off, kGroup);
      l_run[0] = l_run[0] * alpha + sum;
      m_run[0] = m_new;
      if (lane % kRowLanes == 0) sm.alpha[row] = alpha;
    } else {
  #pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {  // online softmax of row kRowsPerWarp*w + i
        const int row = warp * kRowsPerWarp + i;
        float x0 = 0.f, x1 = 0.f;
  #pragma unroll
        for (int k = 0; k < kKSplit; ++k) {
          const float2 x = *reinterpret_cast<const float2*>(s_row(sm, k, row) + 2 * lane);
          x0 += x.x;
          x1 += x.y;
        }
        const int64_t pos = tile * kTile + 2 * lane;
        x0 = pos < seq_len ? x0 * scale_log2 : -INFINITY;
        x1 = pos + 1 < seq_len ? x1 * scale_log2 : -INFINITY;
        const float m_new = fmaxf(m_run[i], group_max(fmaxf(x0, x1)));  // finite: position 0 of a tile is valid
        const float alpha = exp2f(m_run[i] - m_new);
        const float p0 = exp2f(x0 - m_new), p1 = exp2f(x1 - m_new);
        l_run[i] = l_run[i] * alpha + group_sum(p0 + p1);
        m_run[i] = m_new;
        sm.p[row][2 * lane] = from_float<bf16_t>(p0);
        sm.p[row][2 * lane + 1] = from_float<bf16_t>(p1);
        if (lane == 0) sm.alpha[row] = alpha;
      }
    }
    __syncthreads();

    {  // O = alpha * O + P C over this warp's latent columns
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        const float a0 = sm.alpha[a * 16 + g], a1 = sm.alpha[a * 16 + g + 8];
#pragma unroll
        for (int nt = 0; nt < kPN; ++nt) {
          o[a][nt][0] *= a0;
          o[a][nt][1] *= a0;
          o[a][nt][2] *= a1;
          o[a][nt][3] *= a1;
        }
      }
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
        uint32_t a[2][4];
#pragma unroll
        for (int x = 0; x < 2; ++x) ptx::ldmatrix_x4(a[x], &sm.p[x * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
#pragma unroll
        for (int np = 0; np < kPN / 2; ++np) {
          uint32_t bb[4];
          ptx::ldmatrix_x4_trans(bb, &sm.kv[stage][ks * 16 + (lane & 15)][warp * kCols + np * 16 + (lane >> 4) * 8]);
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            ptx::mma_bf16_16816(o[x][2 * np], a[x], bb[0], bb[1]);
            ptx::mma_bf16_16816(o[x][2 * np + 1], a[x], bb[2], bb[3]);
          }
        }
      }
    }
    if (threadIdx.x < kTile) sm.rows[it & 1][threadIdx.x] = next_row;
    if constexpr (kBulk) {  // the next tile landed (stage (it+1)&1, its ((it+1)>>1)-th use)
      if (tile + 1 < tiles.end) ptx::mbar_wait(&sm.bar[(it + 1) & 1], ((it + 1) >> 1) & 1);
    } else if constexpr (kLean) {
      ptx::cp_async_wait<0>();  // the next tile landed for this thread
    }
    __syncthreads();  // stage, p, alpha, rows and the partial scores are rewritten next tile
  }

  if constexpr (kLean) {
    if (lane % kRowLanes == 0) {
      sm.m[warp * kRowsPerWarp + lane / kRowLanes] = m_run[0];
      sm.l[warp * kRowsPerWarp + lane / kRowLanes] = l_run[0];
    }
  } else if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      sm.m[warp * kRowsPerWarp + i] = m_run[i];
      sm.l[warp * kRowsPerWarp + i] = l_run[i];
    }
  }
  __syncthreads();
  const int64_t part = (b * p.num_splits + split) * p.heads + h0;
#pragma unroll
  for (int a = 0; a < 2; ++a) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = a * 16 + g + half * 8;
      if (row >= nh) continue;
      const float inv = 1.f / sm.l[row];
#pragma unroll
      for (int nt = 0; nt < kPN; ++nt) {
        const int col = warp * kCols + nt * 8 + 2 * t4;
        const float v0 = o[a][nt][2 * half] * inv, v1 = o[a][nt][2 * half + 1] * inv;
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
}  // namespace
}  // namespace atom
