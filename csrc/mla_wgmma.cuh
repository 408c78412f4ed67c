// Hopper (sm_90a) MLA decode for rank 512 + rope 64 on warpgroup MMAs,
// included by mla.cu on CUDA builds only. Same work split as mla_mma.cuh (a
// block owns one sequence, 32 heads and one split of the positions; 64-row
// tiles of the cache through a two-stage cp.async ring), but the tensor cores
// read K, V, Q and P straight from shared memory, so no operand passes
// through registers (no ldmatrix) and each warpgroup issues a handful of
// instructions per product. Four warpgroups; per tile:
//
//   S^T[64 x 32]  = K[64 x 576] Q^T       warpgroup w sums k-steps 9w .. 9w+8
//                                         (partials through shared memory)
//   online softmax over S, 16 lanes per head, P rounded to bf16
//   O^T[512 x 32] = alpha O^T + V^T P^T   warpgroup w owns latent columns 128w ..
//
// The tile loop is bound by its own compute, not by memory: at B=64 a tile cost
// 2.5 us a block with everything, 2.1 us with only the loads, 2.0 us with only
// the compute (GPU_NOTES.md, session 8; 2.34 us with everything after the
// changes below). So each step's latency counts: the two O^T accumulator chains
// are issued in turn, each lane keeps its own part of the softmax sum (one
// reduction after the loop, not one per tile), and the cluster kernel keeps a
// running max that moves only when a score passes it by more than 2^8 (else
// alpha = 1 and O^T is not rescaled).
//
// S is computed transposed (positions as M = 64, heads as N = 32) because a
// warpgroup MMA has M = 64 and there are only 32 heads; likewise O^T. The
// cache tile is stored once, in the 128-byte swizzle layout (wgmma_sm90.h):
// 9 blocks of 64 columns, each 64 rows (positions) of 128 bytes. Read with
// rows along K it is K for S^T; with rows along M it is V^T (a transposed A
// operand) for O^T. (Without the swizzle, in plain 8 x 16-byte core matrices,
// the same kernel ran 1.7x slower: GPU_NOTES.md.) Byte offsets:
//
//   tile (pos, col):  col / 64 * kBlockKv + swizzle_128b(pos, col % 64 / 8) + col % 8 * 2
//   Q    (head, col): col / 64 * kBlockQ + swizzle_128b(head, col % 64 / 8) + col % 8 * 2
//   P    (head, pos): swizzle_128b(head, pos / 8) + pos % 8 * 2
#pragma once

#include <type_traits>

#include "bulk_copy_sm90.h"  // fence_proxy_async
#include "cluster_sm90.h"
#include "mla_common.cuh"
#include "wgmma_sm90.h"

namespace atom {
namespace {
namespace wg {

constexpr int kRank = 512, kRope = 64, kDim = kRank + kRope;
constexpr int kHeads = 32, kTile = 64;
constexpr int kWarpGroups = 4, kThreads = kWarpGroups * 128;
constexpr int kChunks = kDim / 8;                // 16-byte chunks per cache row
constexpr int kKPer = kDim / 16 / kWarpGroups;   // 9 k-steps of S per warpgroup
constexpr int kColsPer = kRank / kWarpGroups;    // 128 latent columns of O per warpgroup
constexpr int kBlockKv = kTile * 128;            // tile bytes per 64 columns
constexpr int kBlockQ = kHeads * 128;            // Q bytes per 64 columns
constexpr int kRowGroup = 8 * 128;               // bytes per 8 swizzled rows
constexpr int kSPad = kTile + 4;                 // partial-score rows: stores of a fragment hit distinct banks
constexpr int kStageBytes = kTile * kDim * 2;
constexpr int kMaxClusterSplits = 8;  // the portable cluster size

// 2^x by the hardware approximation alone, results below 2^-126 flushed to zero. exp2f keeps those
// subnormals at the cost of a rescale around the same instruction, which P and alpha do not need: a
// weight below 2^-126 of the running max is nothing next to it. Kernel 8 got 0.3-0.7 us faster (GPU_NOTES.md).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

struct Smem {  // placed at a 1024-byte aligned shared address (the swizzle works on address bits 4-9)
  unsigned char kv[2][kStageBytes];
  unsigned char q[kHeads * kDim * 2];
  unsigned char p[kHeads * kTile * 2];
  float s[kWarpGroups][kHeads][kSPad];  // warpgroup w's partial S (head-major)
  int64_t rows[2][kTile];               // element offsets of a tile's positions, -1 past the end
  float alpha[kHeads], m[kHeads], l[kHeads];
  uint64_t merge_bar;                   // kernel 8: completes when everything sent to this block landed
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // + alignment slack

// The end of a cluster's blocks (one per split), with nothing read across the cluster. The output's
// 512 columns are 8 groups of 64, group G = 2 wg + a being fragment set o[a] of warpgroup wg; block
// merge_owner(G) merges group G. After one cluster barrier (every block is done with its tile ring),
// every block sends each owner its softmax state (m, l in log2 units) and its unnormalised O
// fragments of the owner's groups, in fragment order (thread t's 16 values as four float4s), into the
// owner's idle tile ring; the owner keeps its own fragments in registers. The sends are st.async
// stores that complete on the owner's merge_bar, which expects their bytes: each owner waits only for
// what it receives (no second cluster barrier), then merges per fragment, from its registers and its
// own shared memory:
//   out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s
// A split with no positions has m = -inf, l = 0, O = 0; a sequence with none at all gets zeros.
// Every block waits for all it receives before it exits, so no send lands in an exited block.
constexpr int kGroups = 2 * kWarpGroups;
__device__ __forceinline__ int merge_owner(int group, int splits) { return group * splits / kGroups; }
__device__ __forceinline__ int merge_first(int r, int splits) {  // the first group block r owns
  return (r * kGroups + splits - 1) / splits;
}
__host__ __device__ constexpr int most_owned(int splits) { return (kGroups + splits - 1) / splits; }
struct MergeBuf {  // at the start of Smem::kv
  float m[kMaxClusterSplits][kHeads], l[kMaxClusterSplits][kHeads];
  float coef[kMaxClusterSplits][kHeads];  // each split's weight in the output, per head
  float4 o[1];  // [sender][owned group < most_owned(splits)][quarter of the 16 values][thread of the warpgroup]
  __device__ float4* slot(int sender, int owned, int splits, int thread) {
    return o + (sender * most_owned(splits) + owned) * 4 * 128 + thread;  // quarter q at + 128 q
  }
};
constexpr int most_slots() {  // senders times owned groups, over 2 .. kMaxClusterSplits splits
  int most = 0;
  for (int s = 2; s <= kMaxClusterSplits; ++s) most = s * most_owned(s) > most ? s * most_owned(s) : most;
  return most;
}
static_assert(offsetof(MergeBuf, o) + most_slots() * 4 * 128 * sizeof(float4) <= sizeof(Smem::kv),
              "the merge buffer lives in the tile ring");  // 115 KB at 7 splits, of 144 KB

// Head of fragment value i of a thread with lane % 4 == t4 (the wgmma accumulator layout, N = heads).
__device__ __forceinline__ int fragment_head(int i, int t4) { return 8 * (i / 4) + 2 * t4 + (i & 1); }

// The sending half: this block's m, l to every block and its fragments of other blocks' groups to them;
// returns when everything sent to this block has landed.
__device__ void cluster_send(const MlaParams& p, MergeBuf& buf, uint64_t* bar, const float (&o)[2][16], float m_run,
                             float l_run, int split) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4, S = p.num_splits;
  // Every block is done with its tile ring, which now receives. What it did with the ring (the MMAs'
  // reads, the tile loads' writes) has completed, so the barrier needs no release: relaxed, it skips a
  // GPU-wide memory fence.
  ptx::cluster_sync_relaxed();
  if (tid == 0) {  // bytes coming in: m, l from every block (itself too), S - 1 senders' fragments of each owned group
    const int owned = merge_first(split + 1, S) - merge_first(split, S);
    ptx::mbar_arrive_expect_tx(bar, static_cast<uint32_t>(S * 2 * kHeads * sizeof(float) +
                                                          (S - 1) * owned * 4 * 128 * sizeof(float4)));
  }
  const int srow = 2 * warp + lane / 16;  // the head whose m_run, l_run this lane holds
  if (lane % 16 < S) {                    // lane r of the head's 16 sends them to block r
    const uint32_t to_bar = ptx::cluster_map(bar, lane % 16);
    ptx::cluster_store_async(ptx::cluster_map(&buf.m[split][srow], lane % 16), m_run, to_bar);
    ptx::cluster_store_async(ptx::cluster_map(&buf.l[split][srow], lane % 16), l_run, to_bar);
  }
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const int group = 2 * wg + a, r = merge_owner(group, S);
    if (r == split) continue;
    float4* slot = buf.slot(split, group - merge_first(r, S), S, tid % 128);
    const uint32_t to_bar = ptx::cluster_map(bar, r);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      ptx::cluster_store4_async(ptx::cluster_map(slot + q * 128, r),
                                make_float4(o[a][4 * q], o[a][4 * q + 1], o[a][4 * q + 2], o[a][4 * q + 3]), to_bar);
  }
  ptx::mbar_wait(bar, 0);  // the barrier's only phase
}

// The merging half: this block's groups, from its own fragments and what the others sent.
template <typename OutT>
__device__ void cluster_merge(const MlaParams& p, Smem& sm, const float (&o)[2][16], float m_run, float l_run,
                              int64_t b, int split, int h0, int nh) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4, g = lane >> 2, t4 = lane & 3;
  const int S = p.num_splits;
  MergeBuf& buf = *reinterpret_cast<MergeBuf*>(sm.kv[0]);
  cluster_send(p, buf, &sm.merge_bar, o, m_run, l_run, split);
  // The end of the kernel runs once a block with nothing to overlap it, so its instruction count shows in
  // the kernel's time (GPU_NOTES.md, session 9): the first two loops over splits stay rolled (S is mostly
  // 2; as ptxas unrolled them they were ~180 instructions more), and the output is addressed from one row
  // pointer (64-bit index arithmetic per store was ~500 more). Rolling the third loop made ptxas lay out
  // the tile loop 1-3% slower.
  if (tid < kHeads) {  // split s's weight for head tid
    float mx = -INFINITY, total = 0.f;
#pragma unroll 1
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, buf.m[s][tid]);
#pragma unroll 1
    for (int s = 0; s < S; ++s) total += mx == -INFINITY ? 0.f : exp2_ftz(buf.m[s][tid] - mx) * buf.l[s][tid];
    for (int s = 0; s < S; ++s) buf.coef[s][tid] = total > 0.f ? exp2_ftz(buf.m[s][tid] - mx) / total : 0.f;
  }
  __syncthreads();
  OutT* out = static_cast<OutT*>(p.out);
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const int group = 2 * wg + a;
    if (merge_owner(group, S) != split) continue;
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = buf.coef[split][fragment_head(i, t4)] * o[a][i];
    for (int s = 0; s < S; ++s) {
      if (s == split) continue;
      const float4* slot = buf.slot(s, group - merge_first(split, S), S, tid % 128);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 x = slot[q * 128];
        const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) v[4 * q + j] = fmaf(buf.coef[s][fragment_head(4 * q + j, t4)], xs[j], v[4 * q + j]);
      }
    }
    OutT* row = out + (b * p.heads + h0) * kRank;  // head h0's row
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int head = fragment_head(i, t4), col = kColsPer * wg + 64 * a + 16 * wq + g + 8 * ((i >> 1) & 1);
      if (head < nh) row[head * kRank + col] = from_float<OutT>(v[i]);
    }
  }
}

// kClusterMerge: the grid's num_splits blocks of one (sequence, head group) form a cluster and
// merge their partial outputs through distributed shared memory (no o_part / lse_part, no
// mla_combine_kernel): see cluster_merge.
template <typename OutT, bool kClusterMerge>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_wgmma_kernel(MlaParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4;  // warpgroup, and warp within it (accumulator rows 16 wq ..)
  const int g = lane >> 2, t4 = lane & 3;
  const int split = blockIdx.x, h0 = blockIdx.y * kHeads;
  const int64_t b = blockIdx.z;
  const int nh = min(kHeads, p.heads - h0);
  const int64_t seq_len = load_index(p.seq_lens, b, p.sl64);
  const TileRange tiles = split_tiles(seq_len, kTile, split, p.num_splits);
  if (!kClusterMerge && tiles.begin >= tiles.end) {  // (a cluster's block takes part in the merge regardless)
    write_empty<OutT>(p, b, split, h0, nh);
    return;
  }
  const bf16_t* cache = static_cast<const bf16_t*>(p.cache);

  // Tile loads: warp w copies position 8 (w % 8) + lane % 8, chunks
  // 4 (w / 8 + 2 i) + lane / 8 (the i-th in column block i, at fixed offsets
  // from one address each side): 8 lanes write one chunk of 8 rows (distinct
  // banks under the swizzle) and read 64 contiguous bytes of each row. Warps w
  // and w + 8 read the two halves of the same 128-byte lines, and L2 fetches
  // each whole line at the first (cp_async_16<true>: 1-1.5% faster, GPU_NOTES.md).
  const int ld_pos = 8 * (warp % 8) + lane % 8;
  auto load_tile = [&](int stage, const int64_t* rows) {
    const int64_t off = rows[ld_pos];
    const int c0 = 4 * (warp / 8) + lane / 8;  // this thread's chunks: c0 + 8 i, in column block i
    const bf16_t* src = cache + (off >= 0 ? off : 0) + c0 * 8;  // past the end: a valid address, nothing read
    unsigned char* dst = sm.kv[stage] + ptx::swizzle_128b(ld_pos, c0);
#pragma unroll
    for (int i = 0; i < kChunks / 8; ++i) ptx::cp_async_16<true>(dst + i * kBlockKv, src + i * 64, off >= 0);
    ptx::cp_async_commit();
  };

  // Prologue: offsets of the first two tiles; Q (zero rows past the last head); tile 0.
  if (kClusterMerge && tid == 0) {  // one arrival (cluster_send's expect_tx) and the bytes sent to this block
    ptx::mbar_init(&sm.merge_bar, 1);
    ptx::fence_mbar_init();  // published to the cluster by cluster_send's barrier
  }
  if (tid < kTile) {
    sm.rows[0][tid] = tile_row<kTile>(p, b, seq_len, tiles, tiles.begin, tid);
    sm.rows[1][tid] = tile_row<kTile>(p, b, seq_len, tiles, tiles.begin + 1, tid);
  }
  {
    const bf16_t* ql = static_cast<const bf16_t*>(p.q_latent);
    const bf16_t* qp = static_cast<const bf16_t*>(p.q_pe);
    for (int i = tid; i < kHeads * kChunks; i += kThreads) {
      const int head = i % kHeads, c = i / kHeads;
      const int64_t row = b * p.heads + h0 + head;
      const bf16_t* src = c < kRank / 8 ? ql + row * kRank + c * 8 : qp + row * kRope + (c - kRank / 8) * 8;
      ptx::cp_async_16(sm.q + c / 8 * kBlockQ + ptx::swizzle_128b(head, c % 8), head < nh ? src : ql, head < nh);
    }
    ptx::cp_async_commit();
  }
  __syncthreads();  // rows
  load_tile(0, sm.rows[0]);
  ptx::cp_async_wait<0>();
  ptx::fence_proxy_async();
  __syncthreads();  // Q and tile 0 visible to every warpgroup's MMAs

  float o[2][16];  // O^T: [m64 tile a][fragment]: column kColsPer wg + 64 a + row, head = fragment column
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int i = 0; i < 16; ++i) o[a][i] = 0.f;
  // Softmax: warp w owns heads 2w, 2w+1; 16 lanes per head, 4 positions per lane.
  const int srow = 2 * warp + lane / 16, c0 = (lane % 16) * 4;
  // Of head srow: m_run (log2 units) the same in its 16 lanes, l_run this lane's part of the sum.
  float m_run = -INFINITY, l_run = 0.f;
  // The cluster kernel's running max moves only when a score passes it by kLazyMax (log2 units), so
  // most tiles skip the max's shuffles and O^T's rescale; P <= 2^kLazyMax stays well inside bf16 and
  // fp32. Kernel 7 keeps the exact max: the lazy one made it slower (B=128 2048 positions 98-100 us
  // against 95, GPU_NOTES.md).
  constexpr bool kLazy = kClusterMerge;
  constexpr float kLazyMax = 8.f;
  const float scale_log2 = p.scale * kLog2e;

  // The tile index: 32 bits in kernel 7 (2-3% faster there), 64 in kernel 8, whose loop ptxas lays out
  // worse with 32 (2.5% slower). Register allocation decides this kernel's speed (GPU_NOTES.md, session 8).
  using TileIndex = std::conditional_t<kClusterMerge, int64_t, int>;
  for (TileIndex tile = static_cast<TileIndex>(tiles.begin); tile < tiles.end; ++tile) {
    const int it = static_cast<int>(tile - tiles.begin), stage = it & 1;
    // Offsets two tiles ahead: loaded now, stored at the end, so the load's latency hides behind this tile.
    const int64_t next_row = tid < kTile ? tile_row<kTile>(p, b, seq_len, tiles, tile + 2, tid) : -1;
    if (tile + 1 < tiles.end) load_tile(stage ^ 1, sm.rows[(it + 1) & 1]);
    const unsigned char* kv = sm.kv[stage];

    {  // partial S^T over this warpgroup's k-steps
      float s[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i] = 0.f;
      ptx::wgmma_fence();
#pragma unroll
      for (int i = 0; i < kKPer; ++i) {
        const int k = wg * kKPer + i, blk = k / 4, at = (k % 4) * 32;  // 16 columns = 32 bytes of a row
        ptx::wgmma_m64n32k16_bf16<0>(s, ptx::smem_desc_sw128(kv + blk * kBlockKv + at, 16, kRowGroup),
                                     ptx::smem_desc_sw128(sm.q + blk * kBlockQ + at, 16, kRowGroup));
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 16; ++i) ptx::fence_operand(s[i]);
      // s[i]: position 16 wq + g (+8 if i & 2), head 8 (i / 4) + 2 t4 + (i & 1)
#pragma unroll
      for (int i = 0; i < 16; ++i) sm.s[wg][fragment_head(i, t4)][16 * wq + g + 8 * ((i >> 1) & 1)] = s[i];
    }
    __syncthreads();

    bool moved = false;  // this lane's running max moved
    {  // online softmax of head srow over positions c0 .. c0 + 3
      float x[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int k = 0; k < kWarpGroups; ++k) {
        const float4 v = *reinterpret_cast<const float4*>(&sm.s[k][srow][c0]);
        x[0] += v.x;
        x[1] += v.y;
        x[2] += v.z;
        x[3] += v.w;
      }
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        x[c] = tile * kTile + c0 + c < seq_len ? x[c] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, x[c]);
      }
      float m_new = m_run, alpha = 1.f;
      if (!kLazy || __any_sync(0xffffffffu, mx > m_run + kLazyMax)) {  // both heads of the warp
#pragma unroll
        for (int off = 8; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        m_new = fmaxf(m_run, mx);  // finite: position 0 of a tile is valid
        alpha = exp2_ftz(m_run - m_new);
        moved = true;
      }
      float pr[4], sum = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        pr[c] = exp2_ftz(x[c] - m_new);
        sum += pr[c];
      }
      uint2 packed;
      packed.x = pack_bf16x2(pr[0], pr[1]);
      packed.y = pack_bf16x2(pr[2], pr[3]);
      *reinterpret_cast<uint2*>(sm.p + ptx::swizzle_128b(srow, c0 / 8) + (c0 % 8) * 2) = packed;
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if (lane % 16 == 0) sm.alpha[srow] = alpha;
    }
    ptx::fence_proxy_async();  // P
    bool rescale = true;  // some head's alpha is not 1
    if constexpr (kLazy) rescale = __syncthreads_or(moved);
    else __syncthreads();

    {  // O^T = alpha O^T + V^T P^T over this warpgroup's columns
      if (rescale)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 al = *reinterpret_cast<const float2*>(&sm.alpha[8 * j + 2 * t4]);
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          o[a][4 * j] *= al.x;
          o[a][4 * j + 1] *= al.y;
          o[a][4 * j + 2] *= al.x;
          o[a][4 * j + 3] *= al.y;
        }
      }
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kTile / 16; ++k) {  // positions 16k .. : rows 16k .. of V^T, 32 bytes of P's rows
#pragma unroll
        for (int a = 0; a < 2; ++a) {  // the two accumulator chains in turn
          const unsigned char* v = kv + (kColsPer * wg + 64 * a) / 64 * kBlockKv;
          ptx::wgmma_m64n32k16_bf16<1>(o[a], ptx::smem_desc_sw128(v + 2 * k * kRowGroup, kBlockKv, kRowGroup),
                                       ptx::smem_desc_sw128(sm.p + k * 32, 16, kRowGroup));
        }
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int i = 0; i < 16; ++i) ptx::fence_operand(o[a][i]);
    }
    if (tid < kTile) sm.rows[it & 1][tid] = next_row;
    ptx::cp_async_wait<0>();  // the next tile landed for this thread
    ptx::fence_proxy_async();
    __syncthreads();  // stage, P, alpha, rows and the partial scores are rewritten next tile
  }

#pragma unroll
  for (int off = 8; off > 0; off /= 2) l_run += __shfl_xor_sync(0xffffffffu, l_run, off);  // the head's sum
  if constexpr (kClusterMerge) {
    cluster_merge<OutT>(p, sm, o, m_run, l_run, b, split, h0, nh);
    return;
  }
  if (lane % 16 == 0) {
    sm.m[srow] = m_run;
    sm.l[srow] = l_run;
  }
  __syncthreads();
  const int64_t part = (b * p.num_splits + split) * p.heads + h0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int head = fragment_head(i, t4);
    if (head >= nh) continue;
    const float inv = 1.f / sm.l[head];
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const int col = kColsPer * wg + 64 * a + 16 * wq + g + 8 * ((i >> 1) & 1);
      const float v = o[a][i] * inv;
      if (p.num_splits == 1) {
        static_cast<OutT*>(p.out)[(b * p.heads + h0 + head) * kRank + col] = from_float<OutT>(v);
      } else {
        p.o_part[(part + head) * kRank + col] = v;
      }
    }
  }
  if (p.num_splits > 1 && tid < nh) p.lse_part[part + tid] = (sm.m[tid] + log2f(sm.l[tid])) * kLn2;
#else
  __trap();
#endif
}

}  // namespace wg
}  // namespace
}  // namespace atom
