// Hopper (sm_90a) MLA decode for rank 512 + rope 64 split by cache columns: a cluster of two blocks
// per (sequence, 32 heads), included by mla.cu on CUDA builds only. Where the batch alone about fills
// the GPU (batch 64 and 32 heads: 128 blocks), kernel 8 splits each sequence's positions in two and
// merges the halves at the end; that merge, and the full-width first tile every block waits for, are
// a fixed cost that short sequences cannot hide (GPU_NOTES.md, session 10). Here block r of the pair
// holds columns [256 r, 256 r + 256) of the latent and [32 r, 32 r + 32) of the rope of every position:
//
//   S^T partial  = K_r Q_r^T              this block's 288 columns (18 k-steps)
//   S^T          = partial_0 + partial_1  the partials cross through distributed shared memory;
//                                         a + b == b + a, so both blocks hold the same scores
//   online softmax over S^T (the same in both blocks)
//   O^T_r        = alpha O^T_r + V_r^T P^T  this block's 256 output columns
//
// so the blocks write disjoint columns of the output and nothing is merged across them. Each block's
// two warpgroups work independently, on alternate 64-position tiles (w, w + 2, ...), with their own
// double-buffered tile stages, running softmax state and partner (warpgroup w of the other block);
// the only block-wide steps are the prologue and the merge of the two warpgroups' states at the end.
//
// A tile stage is five 64-column blocks of the 128-byte swizzle layout (wgmma_sm90.h), 64 rows each:
// four of latent, one of rope whose first 32 columns are used. The softmax works on the S^T fragments
// in registers (thread t: positions 16 (t / 32) + g (+8), heads 8 j + 2 (t % 4) + c, kernel 8's
// layout); a head's max crosses the warpgroup's four warps through shared memory.
#pragma once

#include "bulk_copy_sm90.h"
#include "cluster_sm90.h"
#include "mla_common.cuh"
#include "mla_wgmma.cuh"
#include "wgmma_sm90.h"

namespace atom {
namespace {
namespace pair {

constexpr int kHeads = 32, kTile = 64, kWarpGroups = 2, kThreads = kWarpGroups * 128;
constexpr int kLatentHalf = 256, kRopeHalf = 32;  // columns per block
constexpr int kStageBlocks = 5;                   // 64-column blocks of a stage: 4 latent, 1 rope
constexpr int kBlockKv = kTile * 128, kBlockQ = kHeads * 128, kRowGroup = 8 * 128;
constexpr int kStageBytes = kStageBlocks * kBlockKv;
constexpr int kChains = kLatentHalf / 64;  // O^T accumulators of 64 columns per warpgroup
constexpr float kLazyMax = 8.f;            // as kernel 8: the running max moves only past 2^8

struct Smem {  // at a 1024-byte aligned shared address
  unsigned char kv[kWarpGroups][2][kStageBytes];
  unsigned char q[kStageBlocks * kBlockQ];
  unsigned char p[kWarpGroups][kHeads * kTile * 2];
  float4 recv[kWarpGroups][2][4][128];  // the partner's partial S^T of even / odd tiles, fragment order
  float red[kWarpGroups][4][kHeads];  // per warp: a head's tile max, then its sum
  float m[kWarpGroups][kHeads], l[kWarpGroups][kHeads];
  uint64_t full[kWarpGroups][2];  // recv[w][i & 1] holds tile i's partial (the partner's st.async bytes)
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
// At the end each warpgroup hands the other the two chains it merges, in its own (idle) stages.
static_assert(2 * 4 * 128 * sizeof(float4) <= sizeof(Smem::kv[0]), "the hand-over fits in a warpgroup's stages");

// Local index u = 2 j + c of fragment value i's head 8 j + 2 t4 + c (a thread holds 8 heads).
__device__ __forceinline__ int head_slot(int i) { return 2 * (i / 4) + (i & 1); }

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_pair_kernel(MlaParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x, w = tid / 128, t = tid % 128, wq = t / 32, lane = tid % 32;
  const int g = lane >> 2, t4 = lane & 3;
  const int r = blockIdx.x, partner = r ^ 1, bar_id = 1 + w;  // named barrier 0 is __syncthreads
  const int h0 = blockIdx.y * kHeads;
  const int64_t b = blockIdx.z;
  const int nh = min(kHeads, p.heads - h0);
  const int64_t seq_len = load_index(p.seq_lens, b, p.sl64);
  const int n = static_cast<int>((ceil_div(seq_len, kTile) - w + 1) / 2);  // this warpgroup's tiles
  const bf16_t* cache = static_cast<const bf16_t*>(p.cache);

  // Tile loads: warp wq copies rows 16 wq + lane % 8 (+ 8), chunks 4 k + lane / 8 of the 36 (32 latent,
  // 4 rope) of this block's columns: 8 lanes write one chunk of 8 rows (distinct banks under the
  // swizzle) and read 64 contiguous bytes of each row.
  const int ld_row = 16 * wq + lane % 8, ld_chunk = lane / 8;
  // A row's cache offset takes two steps, a tile apart, so the block-table read's latency is never waited
  // for: its block (read from the table, -1 past the end), then its element offset.
  auto blocks = [&](int i, int64_t (&blk)[2]) {  // the blocks of this thread's two rows of tile i
    const int64_t tile = w + 2 * static_cast<int64_t>(i);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t pos = tile * kTile + ld_row + 8 * k;
      blk[k] = pos < seq_len ? load_index(p.block_tables, b * p.bt_stride + static_cast<int>(pos) / p.block_size, p.bt64)
                             : -1;
    }
  };
  auto offsets = [&](int i, const int64_t (&blk)[2], int64_t (&off)[2]) {  // tile i's rows, -1 past the end
    const int64_t tile = w + 2 * static_cast<int64_t>(i);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int pos = static_cast<int>(tile * kTile) + ld_row + 8 * k;
      off[k] = blk[k] < 0 ? -1 : blk[k] * p.block_stride + static_cast<int64_t>(pos % p.block_size) * p.row_stride;
    }
  };
  auto load_tile = [&](unsigned char* stage, const int64_t (&off)[2]) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const bf16_t* src = cache + (off[k] >= 0 ? off[k] : 0);  // past the end: a valid address, nothing read
      const int row = ld_row + 8 * k;
#pragma unroll
      for (int c = 0; c < 8; ++c)  // latent chunk 4 c + ld_chunk: block c / 2, chunk 4 (c % 2) + ld_chunk
        ptx::cp_async_16<true>(stage + (c / 2) * kBlockKv + ptx::swizzle_128b(row, 4 * (c % 2) + ld_chunk),
                               src + kLatentHalf * r + 8 * (4 * c + ld_chunk), off[k] >= 0);
      ptx::cp_async_16<true>(stage + 4 * kBlockKv + ptx::swizzle_128b(row, ld_chunk),
                             src + wg::kRank + kRopeHalf * r + 8 * ld_chunk, off[k] >= 0);
    }
    ptx::cp_async_commit();
  };

  int64_t off_next[2], blk_later[2];  // tile i + 1's offsets and tile i + 2's blocks at the top of tile i
  {
    int64_t blk0[2], blk1[2], off0[2];
    blocks(0, blk0);
    blocks(1, blk1);
    blocks(2, blk_later);
    offsets(0, blk0, off0);
    offsets(1, blk1, off_next);
    const bf16_t* ql = static_cast<const bf16_t*>(p.q_latent);
    const bf16_t* qp = static_cast<const bf16_t*>(p.q_pe);
    for (int i = tid; i < kHeads * 36; i += kThreads) {  // Q's 36 chunks of this block's columns, per head
      const int head = i % kHeads, c = i / kHeads;
      const int64_t row = b * p.heads + h0 + head;
      const bf16_t* src = c < 32 ? ql + row * wg::kRank + kLatentHalf * r + 8 * c
                                   : qp + row * wg::kRope + kRopeHalf * r + 8 * (c - 32);
      ptx::cp_async_16(sm.q + (c / 8) * kBlockQ + ptx::swizzle_128b(head, c % 8), head < nh ? src : ql, head < nh);
    }
    ptx::cp_async_commit();
    if (n > 0) load_tile(sm.kv[w][0], off0);
    else ptx::cp_async_commit();
  }
  if (tid == 0) {
    for (int k = 0; k < kWarpGroups; ++k) {
      ptx::mbar_init(&sm.full[k][0], 1);
      ptx::mbar_init(&sm.full[k][1], 1);
    }
    ptx::fence_mbar_init();
  }
  ptx::cp_async_wait<1>();  // Q
  ptx::fence_proxy_async();
  __syncthreads();
  ptx::cluster_sync_relaxed();  // the mbarriers' initialisation, before the partner's first send

  float o[kChains][16];
#pragma unroll
  for (int c = 0; c < kChains; ++c)
#pragma unroll
    for (int i = 0; i < 16; ++i) o[c][i] = 0.f;
  float m_run[8], l_run[8];  // of the thread's heads (head_slot), log2 units; l_run this thread's part
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    m_run[u] = -INFINITY;
    l_run[u] = 0.f;
  }
  const float scale_log2 = p.scale * kLog2e;
  const uint32_t partner_full = ptx::cluster_map(&sm.full[w][0], partner);
  const uint32_t partner_recv = ptx::cluster_map(&sm.recv[w][0][0][t], partner);
  unsigned char* pw = sm.p[w];

  for (int i = 0; i < n; ++i) {
    const int stage = i & 1;
    const int64_t tile = w + 2 * static_cast<int64_t>(i);
    int64_t blk_after[2];  // tile i + 3's blocks: read now, used two tiles on
    blocks(i + 3, blk_after);
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async();
    ptx::bar_sync(bar_id, 128);  // tile i landed; the warpgroup is done with tile i - 1 (its stage, P)
    if (i + 1 < n) load_tile(sm.kv[w][stage ^ 1], off_next);
    const unsigned char* kv = sm.kv[w][stage];

    float s[16], s_odd[16];  // two accumulator chains of 9 k-steps each (even, odd), summed after
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      s[k] = s_odd[k] = 0.f;
      ptx::fence_operand(s[k]);
      ptx::fence_operand(s_odd[k]);
    }
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 18; ++k) {  // 16 k-steps of latent (4 blocks), 2 of rope
      const int blk = k / 4, at = (k % 4) * 32;
      const uint64_t ka = ptx::smem_desc_sw128(kv + blk * kBlockKv + at, 16, kRowGroup);
      const uint64_t qb = ptx::smem_desc_sw128(sm.q + blk * kBlockQ + at, 16, kRowGroup);
      if (k % 2)
        ptx::wgmma_m64n32k16_bf16<0>(s_odd, ka, qb);
      else
        ptx::wgmma_m64n32k16_bf16<0>(s, ka, qb);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      ptx::fence_operand(s[k]);
      ptx::fence_operand(s_odd[k]);
      s[k] += s_odd[k];
    }

    // The partials cross: the partner's recv[w] must be free (it has read tile i - 1's).
    // Tile i goes to the partner's recv[w][i & 1], completing on its full[w][i & 1]. That buffer is free:
    // the partner read tile i - 2's partial in it before it finished tile i - 2, and this warpgroup
    // started tile i - 1 (whose partial the partner needed to finish tile i - 1) only after receiving it.
    const int buf = i & 1;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      ptx::cluster_store4_async(partner_recv + (buf * 4 + q) * 128 * sizeof(float4),
                                make_float4(s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3]),
                                partner_full + buf * sizeof(uint64_t));
    if (t == 0) ptx::mbar_arrive_expect_tx(&sm.full[w][buf], 128 * 4 * sizeof(float4));
    ptx::mbar_wait(&sm.full[w][buf], (i >> 1) & 1);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 x = sm.recv[w][buf][q][t];
      s[4 * q] += x.x;
      s[4 * q + 1] += x.y;
      s[4 * q + 2] += x.z;
      s[4 * q + 3] += x.w;
    }

    // Online softmax on the fragments. The max moves only when a score passes it by kLazyMax.
    bool over = false;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int64_t pos = tile * kTile + 16 * wq + g + 8 * ((k >> 1) & 1);
      s[k] = pos < seq_len ? s[k] * scale_log2 : -INFINITY;
      over |= s[k] > m_run[head_slot(k)] + kLazyMax;
    }
    if (ptx::bar_any(bar_id, 128, over)) {
      float mx[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int k = 4 * (u / 2) + (u & 1);
        mx[u] = fmaxf(s[k], s[k + 2]);
#pragma unroll
        for (int off = 4; off < 32; off *= 2) mx[u] = fmaxf(mx[u], __shfl_xor_sync(0xffffffffu, mx[u], off));
      }
      if (g == 0)
#pragma unroll
        for (int u = 0; u < 8; ++u) sm.red[w][wq][8 * (u / 2) + 2 * t4 + (u & 1)] = mx[u];
      ptx::bar_sync(bar_id, 128);
      float alpha[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int head = 8 * (u / 2) + 2 * t4 + (u & 1);
        const float tmax = fmaxf(fmaxf(sm.red[w][0][head], sm.red[w][1][head]),
                                 fmaxf(sm.red[w][2][head], sm.red[w][3][head]));
        const float m_new = fmaxf(m_run[u], tmax);  // finite: a tile's first position is valid
        alpha[u] = wg::exp2_ftz(m_run[u] - m_new);
        m_run[u] = m_new;
        l_run[u] *= alpha[u];
      }
#pragma unroll
      for (int c = 0; c < kChains; ++c)
#pragma unroll
        for (int k = 0; k < 16; ++k) o[c][k] *= alpha[head_slot(k)];
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const float pr = wg::exp2_ftz(s[k] - m_run[head_slot(k)]);
      l_run[head_slot(k)] += pr;
      const int head = 8 * (k / 4) + 2 * t4 + (k & 1);
      *reinterpret_cast<__nv_bfloat16*>(pw + ptx::swizzle_128b(head, 2 * wq + ((k >> 1) & 1)) + 2 * g) =
          __float2bfloat16_rn(pr);
    }
    ptx::fence_proxy_async();  // P
    ptx::bar_sync(bar_id, 128);  // P written

    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kTile / 16; ++k)
#pragma unroll
      for (int c = 0; c < kChains; ++c)
        ptx::wgmma_m64n32k16_bf16<1>(o[c], ptx::smem_desc_sw128(kv + c * kBlockKv + 2 * k * kRowGroup, kBlockKv, kRowGroup),
                                     ptx::smem_desc_sw128(pw + k * 32, 16, kRowGroup));
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int k = 0; k < 16; ++k) ptx::fence_operand(o[c][k]);
    offsets(i + 2, blk_later, off_next);
    blk_later[0] = blk_after[0];
    blk_later[1] = blk_after[1];
  }

  // The warpgroups' states meet. A head's sum over the warpgroup; warpgroup w merges chains 2w, 2w + 1
  // and hands the other two to the other warpgroup through its own stages (idle now).
#pragma unroll
  for (int u = 0; u < 8; ++u)
#pragma unroll
    for (int off = 4; off < 32; off *= 2) l_run[u] += __shfl_xor_sync(0xffffffffu, l_run[u], off);
  if (g == 0)
#pragma unroll
    for (int u = 0; u < 8; ++u) sm.red[w][wq][8 * (u / 2) + 2 * t4 + (u & 1)] = l_run[u];
  if (t < 4)
#pragma unroll
    for (int u = 0; u < 8; ++u) sm.m[w][8 * (u / 2) + 2 * t4 + (u & 1)] = m_run[u];
  float4* handed = reinterpret_cast<float4*>(sm.kv[w][0]);  // [chain a][quarter][thread]
#pragma unroll
  for (int a = 0; a < 2; ++a) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // chain 2 (1 - w) + a (selected, not indexed: o stays in registers)
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = w == 0 ? o[2 + a][4 * q + j] : o[a][4 * q + j];
      handed[(a * 4 + q) * 128 + t] = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
  ptx::bar_sync(bar_id, 128);
  if (t < kHeads) sm.l[w][t] = sm.red[w][0][t] + sm.red[w][1][t] + sm.red[w][2][t] + sm.red[w][3][t];
  __syncthreads();

  float mine[8], theirs[8];  // each warpgroup's weight in the output, per head
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int head = 8 * (u / 2) + 2 * t4 + (u & 1);
    const float m0 = sm.m[w][head], m1 = sm.m[1 - w][head], mx = fmaxf(m0, m1);
    const float e0 = mx == -INFINITY ? 0.f : wg::exp2_ftz(m0 - mx);
    const float e1 = mx == -INFINITY ? 0.f : wg::exp2_ftz(m1 - mx);
    const float total = e0 * sm.l[w][head] + e1 * sm.l[1 - w][head];
    const float inv = total > 0.f ? 1.f / total : 0.f;
    mine[u] = e0 * inv;
    theirs[u] = e1 * inv;
  }
  const float4* received = reinterpret_cast<const float4*>(sm.kv[1 - w][0]);
  OutT* row = static_cast<OutT*>(p.out) + (b * p.heads + h0) * wg::kRank + kLatentHalf * r;  // head h0's columns
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const int c = 2 * w + a;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 x = received[(a * 4 + q) * 128 + t];
      const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = 4 * q + j, head = 8 * (k / 4) + 2 * t4 + (k & 1);
        const int col = 64 * c + 16 * wq + g + 8 * ((k >> 1) & 1);
        const float own = w == 0 ? o[a][k] : o[2 + a][k];  // chain c
        const float v = mine[head_slot(k)] * own + theirs[head_slot(k)] * xs[j];
        if (head < nh) row[head * wg::kRank + col] = from_float<OutT>(v);
      }
    }
  }
#else
  __trap();
#endif
}

}  // namespace pair
}  // namespace
}  // namespace atom
