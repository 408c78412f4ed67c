// Paged GQA attention for dense models (Llama, Qwen3). Decode: one query row per token over the
// first seq_lens[t] cached positions of its sequence.
//
//   K and V caches [num_blocks, block_size, kv_heads, head_dim]; query head h reads kv head
//   h / group (group = heads / kv_heads):
//
//   score_p = q . k_p * scale          out = sum_p softmax(score)_p v_p        [heads, head_dim]
//
// One block per (row, kv head, up to kMaxHeads of its query heads, split): a position's key and value
// are read once for the block's heads. Tiles of kTile positions of K and V stream through a ring of
// shared-memory stages (KvRing: cp.async on NVIDIA, so the next tiles' loads are in flight while this
// one is used; plain copies on HIP and for rows that are not 16-byte aligned). Two kernels use the ring:
//   paged_decode_mma_kernel  bf16/fp16 rows of 64, 128 or 256 on NVIDIA: tensor cores (mma.sync), the
//                            block's heads as the rows of a 16-row tile, in the manner of flash attention.
//                            Warps 0/1 take positions 0-15/16-31 of each tile for the left half of the
//                            output columns, warps 2/3 the same positions for the right half; each warp
//                            keeps its own online softmax in registers, and the two warps of a half merge
//                            once, at the end. One barrier a tile (the ring's).
//   paged_decode_kernel      any other dtype or size, and HIP: CUDA cores. Warp w scores head w (and
//                            w + 4), a position a lane; thread (head, 4 columns) then sums the values.
// Long sequences are split over several blocks (flash-decoding) and the splits merged by their
// log-sum-exp (paged_combine_kernel). head_dim <= 256.
//
// Prefill chunks (paged_prefill_mma_kernel, below): a block attends 64 or 128 (query, head) rows of a chunk, causal
// after its cached context, on the same ring and tensor cores; bf16/fp16 q/k rows of 64, 128 or 192 on NVIDIA.
#include <mutex>
#include <utility>
#include <vector>

#include "kernel_common.h"

#if !defined(__HIPCC__) && !defined(USE_ROCM)
#include <type_traits>

#include "mma_sm80.h"
#define ATOM_PAGED_MMA 1
#endif

namespace atom {
namespace {

constexpr int kTile = 32;  // positions of a tile; a split takes whole tiles
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kGroup;
constexpr int kMaxHeads = 8;  // query heads a block serves
constexpr int kMaxDim = 256;
constexpr int kMaxStages = 3;
// Two stages unless the caller asks (one past head_dim 128): on the H200 a third never helped by more than noise,
// and it costs blocks an SM (at head_dim 128, batch 64: 50.5% of the copy ceiling in three stages, 74.3% in two;
// GPU_NOTES, session 36). At head_dim 256 two stages leave room for 2 blocks an SM, one stage for 4: one stage was
// faster at every measured shape (77.3% against 72.3% at batch 64 and 1024 positions; session 37).
constexpr int kDefaultStages = 2;
constexpr int kMmaRows = 16;  // the tensor-core kernel's query rows: the block's heads, then zeros
constexpr int kPrefillRows = kWarps * kMmaRows;  // (query, head) rows of a prefill block: 16 a warp
constexpr int kScoreRounds = kMaxHeads * kTile / kThreads;        // (head, position) items a thread scores
constexpr int kValueRounds = kMaxHeads * kMaxDim / 4 / kThreads;  // (head, 4 columns) items a thread sums
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kTile == kGroup, "a warp scores one head's tile, a position a lane");

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
  int split_min_tiles;  // a row takes only as many of the splits as give each this many tiles (at least one)
  float scale;
  int stages;  // shared-memory tiles in the ring: 1..kMaxStages (0 from the caller: the default, if it fits)
  bool vec;    // head rows of K and V 16-byte aligned: cp.async in 16-byte pieces
};

// Elements of a head row in shared memory: dim rounded up to 16-byte pieces, plus one piece, so that eight
// consecutive rows' pieces at one column fall on distinct banks (for 2-byte types; 4-byte ones conflict 2-way).
template <typename T>
__host__ __device__ constexpr int row_elems(int dim) {
  constexpr int per16 = 16 / sizeof(T);
  return (dim + per16 - 1) / per16 * per16 + per16;
}

// A block's dynamic shared memory: the ring (stages x {K, V} x kTile rows), q rows (heads, or kMmaRows for the
// tensor-core kernel), the ring's offsets, then floats: [heads][kTile + 2] (CUDA cores: probabilities, rescales,
// sums) or [2][kWarps][kMmaRows] (tensor cores: each warp's maxima and sums, merged at the end).
template <typename T>
__host__ __device__ constexpr int paged_smem_bytes(int dim, int heads, int stages, bool mma) {
  const int q_rows = mma ? kMmaRows : heads;
  const int floats = mma ? 2 * kWarps * kMmaRows : heads * (kTile + 2);
  return (stages * 2 * kTile + q_rows) * row_elems<T>(dim) * static_cast<int>(sizeof(T)) +
         stages * kTile * static_cast<int>(sizeof(int64_t)) + floats * static_cast<int>(sizeof(float));
}

// 16 bytes global -> shared (zeros when !valid), in flight until wait_copies; a plain copy where cp.async is
// missing (HIP, before sm_80).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ptx::cp_async_16(dst, src, valid);
#else
  *static_cast<uint4*>(dst) = valid ? *static_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}

__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ptx::cp_async_commit();
#endif
}

// Waits until at most `pending` (at most 1; below 0 means 0) committed groups of this thread's copies are in
// flight.
__device__ __forceinline__ void wait_copies(int pending) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (pending > 0) {
    ptx::cp_async_wait<1>();
  } else {
    ptx::cp_async_wait<0>();
  }
#else
  (void)pending;
#endif
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = kGroup / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off, kGroup));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = kGroup / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off, kGroup);
  return x;
}

// What a block computes: query heads h0 .. h0 + nh - 1 (one kv head, kvh) of one row, over its split's
// positions [begin, end) of the row's seq_len; the row takes `splits` of the grid's splits (see row_splits).
struct BlockWork {
  int kvh, h0, nh, split, splits;
  int64_t row, begin, end;
};

// How many of the grid's splits a row of seq_len positions takes: one for each split_min_tiles of its tiles, at
// least one, at most num_splits. A row of one split is written whole by its block (and the merge leaves it
// alone), so a grid sized for long rows (CUDA graphs size it by the longest row a model allows) costs short rows
// only the launch of the blocks they leave idle.
__device__ __forceinline__ int row_splits(const PagedParams& p, int64_t seq_len) {
  const int64_t most = ceil_div(seq_len, kTile) / p.split_min_tiles;
  return most < 1 ? 1 : most < p.num_splits ? static_cast<int>(most) : p.num_splits;
}

__device__ __forceinline__ BlockWork block_work(const PagedParams& p) {
  const int group = p.heads / p.kv_heads;
  const int chunks = (group + kMaxHeads - 1) / kMaxHeads;
  BlockWork w;
  w.kvh = blockIdx.x / chunks;
  w.h0 = w.kvh * group + (blockIdx.x % chunks) * kMaxHeads;
  w.nh = min(kMaxHeads, (w.kvh + 1) * group - w.h0);
  w.row = blockIdx.y;
  w.split = blockIdx.z;
  const int64_t seq_len = load_index(p.seq_lens, w.row, p.sl64);
  w.splits = row_splits(p, seq_len);
  const TileRange tiles = split_tiles(seq_len, kTile, w.split, w.splits);
  w.begin = tiles.begin * kTile;
  w.end = tiles.end * kTile < seq_len ? tiles.end * kTile : seq_len;
  return w;
}

// A block with nothing to attend to: zeros (the row's one split), an empty partial (lse -inf), or nothing (a split
// the row does not take).
template <typename OutT>
__device__ void write_empty(const PagedParams& p, const BlockWork& w) {
  if (w.split >= w.splits) return;
  if (w.splits == 1) {
    OutT* out = static_cast<OutT*>(p.out) + (w.row * p.heads + w.h0) * p.dim;
    for (int c = threadIdx.x; c < w.nh * p.dim; c += kThreads) out[c] = from_float<OutT>(0.f);
  } else if (threadIdx.x < w.nh) {
    p.lse_part[(w.row * p.num_splits + w.split) * p.heads + w.h0 + threadIdx.x] = -INFINITY;
  }
}

// The ring of K and V tiles in shared memory, and how tiles get there. Tile x sits in stage x % stages; its
// positions' cache offsets, in ring slot x % stages of `offs`. A kernel's loop over tiles t:
//   prologue  keep(x, locate(x)) for x < stages; barrier; fetch(x) + commit for x < stages - 1
//   tile t    (stages == 1: barrier; fetch(t) + commit) wait_copies(stages - 2); barrier;
//             (stages > 1: fetch(t + stages - 1) + commit); ahead = locate(t + stages);
//             ... use stage t % stages ...; keep(t + stages, ahead)
// so a stage is refilled only after every warp has passed the barrier that follows its last use, and a tile's
// block-table lookup (locate, a global load) is stored only at the end of the tile before, its latency hidden.
template <typename T>
struct KvRing {
  static constexpr int kPer16 = 16 / sizeof(T);
  T* tiles;       // [stages][2][kTile][rs]: K then V of each stage
  int64_t* offs;  // [stages][kTile]: cache offsets of the tiles' positions, -1 past the end
  int rs, stages, len, num_tiles;
  const PagedParams* p;
  const BlockWork* w;
  const T* k_cache;  // the block's kv head
  const T* v_cache;

  __device__ const T* k_tile(int tile) const { return tiles + (tile % stages) * 2 * kTile * rs; }
  __device__ const T* v_tile(int tile) const { return k_tile(tile) + kTile * rs; }

  // Thread j < kTile: the cache offset of position j of `tile` (-1 past the end).
  __device__ int64_t locate(int tile) const {
    const int pos = tile * kTile + static_cast<int>(threadIdx.x);
    if (threadIdx.x >= kTile || pos >= len) return -1;
    const int64_t at = w->begin + pos;
    return load_index(p->block_tables, w->row * p->bt_stride + at / p->block_size, p->bt64) * p->block_stride +
           (at % p->block_size) * p->token_stride;
  }

  __device__ void keep(int tile, int64_t off) const {
    if (threadIdx.x < kTile && tile < num_tiles) offs[(tile % stages) * kTile + threadIdx.x] = off;
  }

  // Every thread: its share of `tile`'s K and V rows (four threads a row) into the tile's stage; zeros past the
  // end, and (plain copies) past dim up to whole 16-byte pieces.
  __device__ void fetch(int tile) const {
    if (tile >= num_tiles) return;
    const int st = tile % stages, r = threadIdx.x / 4, part = threadIdx.x % 4;
    const int64_t off = offs[st * kTile + r];
    T* k_dst = tiles + (st * 2 * kTile + r) * rs;
    T* v_dst = k_dst + kTile * rs;
    if (p->vec) {
      const int64_t src = off >= 0 ? off : 0;
      for (int c = part * kPer16; c < p->dim; c += 4 * kPer16) {
        copy16(k_dst + c, k_cache + src + c, off >= 0);
        copy16(v_dst + c, v_cache + src + c, off >= 0);
      }
    } else {
      const int padded = rs - kPer16;
      for (int c = part; c < padded; c += 4) {
        const bool in = off >= 0 && c < p->dim;
        k_dst[c] = in ? k_cache[off + c] : from_float<T>(0.f);
        v_dst[c] = in ? v_cache[off + c] : from_float<T>(0.f);
      }
    }
  }

  // The prologue, and the top of tile t up to its use (see above); returns locate(t + stages).
  __device__ void start() const {
    for (int t = 0; t < stages; ++t) keep(t, locate(t));
    __syncthreads();
    for (int t = 0; t + 1 < stages; ++t) {
      fetch(t);
      commit_copies();
    }
  }

  __device__ int64_t arrive(int t) const {
    if (stages == 1) {
      __syncthreads();  // every warp is done with the previous tile
      fetch(t);
      commit_copies();
    }
    wait_copies(stages - 2);  // tile t's group; with 3 stages tile t + 1's may stay in flight
    __syncthreads();
    if (stages > 1) {
      fetch(t + stages - 1);
      commit_copies();
    }
    return locate(t + stages);
  }
};

// The ring of a block whose shared memory starts at smem, with q_rows rows of q after the ring's tiles; the
// offsets follow the q rows. The caller's floats follow offs + stages * kTile.
template <typename T>
__device__ __forceinline__ KvRing<T> make_ring(const PagedParams& p, const BlockWork& w, int q_rows) {
  KvRing<T> ring;
  ring.rs = row_elems<T>(p.dim);
  ring.stages = p.stages;
  ring.tiles = dynamic_shared<T>();
  ring.offs = reinterpret_cast<int64_t*>(ring.tiles + (ring.stages * 2 * kTile + q_rows) * ring.rs);
  ring.len = static_cast<int>(w.end - w.begin);
  ring.num_tiles = (ring.len + kTile - 1) / kTile;
  ring.p = &p;
  ring.w = &w;
  ring.k_cache = static_cast<const T*>(p.k_cache) + w.kvh * p.head_stride;
  ring.v_cache = static_cast<const T*>(p.v_cache) + w.kvh * p.head_stride;
  return ring;
}

// The q rows of the block (after the ring's tiles), zero past dim up to whole 16-byte pieces and in rows
// nh .. q_rows - 1.
template <typename T>
__device__ T* load_q(const PagedParams& p, const BlockWork& w, const KvRing<T>& ring, int q_rows) {
  T* q_s = ring.tiles + ring.stages * 2 * kTile * ring.rs;
  const int width = ring.rs - KvRing<T>::kPer16;
  const T* q_row = static_cast<const T*>(p.q) + (w.row * p.heads + w.h0) * p.dim;
  for (int c = threadIdx.x; c < q_rows * width; c += kThreads) {
    const int g = c / width, d = c % width;
    q_s[g * ring.rs + d] = g < w.nh && d < p.dim ? q_row[g * p.dim + d] : from_float<T>(0.f);
  }
  return q_s;
}

// The CUDA-core kernel's value item of this thread in round r: its head g and first of 4 columns c (quads: a
// head row's groups of 4 columns).
struct ValueItem {
  int g, c;
};
__device__ __forceinline__ ValueItem value_item(int r, int quads) {
  const int item = static_cast<int>(threadIdx.x) + kThreads * r;
  return {item / quads, (item % quads) * 4};
}

// CUDA cores. grid (kv_heads * ceil(group / kMaxHeads), rows, splits), kThreads threads,
// paged_smem_bytes(..., mma = false) of shared memory.
template <typename T, typename OutT>
__global__ void __launch_bounds__(kThreads, 6) paged_decode_kernel(PagedParams p) {
  pdl_enter();
  constexpr int kPer16 = KvRing<T>::kPer16;
  const BlockWork w = block_work(p);
  if (w.begin >= w.end) {
    write_empty<OutT>(p, w);
    return;
  }
  const int nh = w.nh, S = p.num_splits;
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  const KvRing<T> ring = make_ring<T>(p, w, nh);
  const int len = ring.len, rs = ring.rs;
  const T* q_s = load_q(p, w, ring, nh);                                // [nh][rs]
  float* p_s = reinterpret_cast<float*>(ring.offs + ring.stages * kTile);  // [nh][kTile] probabilities
  float* alpha_s = p_s + nh * kTile;                                       // [nh] rescale of the running output
  float* l_s = alpha_s + nh;                                               // [nh] the softmax's final sums
  ring.start();

  const float scale = p.scale * kLog2e;
  float m[kScoreRounds], l[kScoreRounds], acc[kValueRounds][4];
#pragma unroll
  for (int r = 0; r < kScoreRounds; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
#pragma unroll
  for (int r = 0; r < kValueRounds; ++r) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[r][i] = 0.f;
  }
  const int pieces = (p.dim + kPer16 - 1) / kPer16, quads = (p.dim + 3) / 4;

  for (int t = 0; t < ring.num_tiles; ++t) {
    const int64_t ahead = ring.arrive(t);
    const T* k_s = ring.k_tile(t);
    const T* v_s = ring.v_tile(t);

    // Scores and the online softmax: warp w, head w + kWarps r; lane = position.
#pragma unroll
    for (int r = 0; r < kScoreRounds; ++r) {
      const int g = warp + kWarps * r;
      if (g >= nh) continue;  // the same for the whole warp
      const T* k_row = k_s + lane * rs;
      const T* q_g = q_s + g * rs;
      float s2[2] = {0.f, 0.f};  // two chains of fused multiply-adds, half as long
#pragma unroll 4
      for (int c = 0; c < pieces; ++c) {
        const Pack<T, kPer16> kk = *reinterpret_cast<const Pack<T, kPer16>*>(k_row + c * kPer16);
        const Pack<T, kPer16> qq = *reinterpret_cast<const Pack<T, kPer16>*>(q_g + c * kPer16);
#pragma unroll
        for (int i = 0; i < kPer16; ++i) s2[i & 1] = fmaf(to_float(qq.v[i]), to_float(kk.v[i]), s2[i & 1]);
      }
      const float s = t * kTile + lane < len ? (s2[0] + s2[1]) * scale : -INFINITY;
      const float mx = fmaxf(m[r], warp_max(s));  // finite: a tile's first position is valid
      const float e = exp2f(s - mx), alpha = exp2f(m[r] - mx);
      l[r] = l[r] * alpha + e;  // over this lane's positions; the warp's sum is taken at the end
      m[r] = mx;
      p_s[g * kTile + lane] = e;
      if (lane == 0) alpha_s[g] = alpha;
    }
    __syncthreads();

    // Values: thread item (head, 4 columns) of kValueRounds rounds.
#pragma unroll
    for (int r = 0; r < kValueRounds; ++r) {
      const auto [g, c] = value_item(r, quads);
      if (g >= nh) continue;
      const float alpha = alpha_s[g];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][i] *= alpha;
      const float4* pg = reinterpret_cast<const float4*>(p_s + g * kTile);
#pragma unroll 2
      for (int j4 = 0; j4 < kTile / 4; ++j4) {
        const float4 e4 = pg[j4];
        const float e[4] = {e4.x, e4.y, e4.z, e4.w};
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const Pack<T, 4> vv = *reinterpret_cast<const Pack<T, 4>*>(v_s + (j4 * 4 + jj) * rs + c);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][i] = fmaf(e[jj], to_float(vv.v[i]), acc[r][i]);
        }
      }
    }
    ring.keep(t + ring.stages, ahead);
  }

  // The softmax's sums to shared memory (and each split's log-sum-exp out), then each thread's columns out.
#pragma unroll
  for (int r = 0; r < kScoreRounds; ++r) {
    const int g = warp + kWarps * r;
    if (g >= nh) continue;
    l[r] = warp_sum(l[r]);
    if (lane == 0) {
      l_s[g] = l[r];
      if (w.splits > 1) p.lse_part[(w.row * S + w.split) * p.heads + w.h0 + g] = (m[r] + log2f(l[r])) / kLog2e;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kValueRounds; ++r) {
    const auto [g, c] = value_item(r, quads);
    if (g >= nh) continue;
    const float inv = 1.f / l_s[g];
    for (int i = 0; i < 4 && c + i < p.dim; ++i) {
      if (w.splits == 1) {
        static_cast<OutT*>(p.out)[(w.row * p.heads + w.h0 + g) * p.dim + c + i] = from_float<OutT>(acc[r][i] * inv);
      } else {
        p.o_part[((w.row * S + w.split) * p.heads + w.h0 + g) * p.dim + c + i] = acc[r][i] * inv;
      }
    }
  }
}

#ifdef ATOM_PAGED_MMA
// Two floats as the packed pair of 16-bit values an mma operand register holds (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(lo))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(hi))) << 16);
  } else {
    return static_cast<uint32_t>(__half_as_ushort(__float2half(lo))) |
           (static_cast<uint32_t>(__half_as_ushort(__float2half(hi))) << 16);
  }
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    ptx::mma_bf16_16816(c, a, b0, b1);
  } else {
    ptx::mma_f16_16816(c, a, b0, b1);
  }
}

// o[n-tile] += P V over 16 positions for kNTiles n-tiles of 8 columns: P as the A fragment pa, V's 16 rows from
// v_ptr (this lane's row and 8 columns, as ldmatrix.trans takes them), 16 columns an ldmatrix.
template <typename T, int kNTiles>
__device__ __forceinline__ void add_pv(float (&o)[kNTiles][4], const uint32_t (&pa)[4], const T* v_ptr) {
#pragma unroll
  for (int np = 0; np < kNTiles / 2; ++np) {
    uint32_t b[4];
    ptx::ldmatrix_x4_trans(b, v_ptr + np * 16);
    mma16816<T>(o[2 * np], pa, b[0], b[1]);
    mma16816<T>(o[2 * np + 1], pa, b[2], b[3]);
  }
}

// Tensor cores, bf16 or fp16, head_dim kDim (64, 128 or 256), 16-byte aligned rows. Grid as paged_decode_kernel,
// paged_smem_bytes(..., mma = true) of shared memory. mma.sync m16n8k16 fragments (g = lane / 4, t4 = lane % 4):
// A rows g, g + 8 and columns 2 t4 (+1), 2 t4 + 8 (+9); B column g, rows 2 t4 (+1), 2 t4 + 8 (+9); C rows g, g + 8,
// columns 2 t4 (+1). Query rows are the block's heads (nh <= 8), so rows g + 8 are zeros and never computed on.
template <typename T, typename OutT, int kDim>
__global__ void __launch_bounds__(kThreads, kDim > 128 ? 4 : 5) paged_decode_mma_kernel(PagedParams p) {
  static_assert(kDim % 64 == 0 && kDim <= kMaxDim, "a multiple of 64 up to kMaxDim");
  constexpr int kKSteps = kDim / 16;   // of the scores' product
  constexpr int kCols = kDim / 2;      // output columns of a warp
  constexpr int kNTiles = kCols / 8;   // their n-tiles in the values' product
  pdl_enter();
  const BlockWork w = block_work(p);
  if (w.begin >= w.end) {
    write_empty<OutT>(p, w);
    return;
  }
  const int nh = w.nh, S = p.num_splits;
  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup, g = lane >> 2, t4 = lane & 3;
  const KvRing<T> ring = make_ring<T>(p, w, kMmaRows);
  const int len = ring.len, rs = ring.rs;
  const T* q_s = load_q(p, w, ring, kMmaRows);                                // [kMmaRows][rs]
  float* m_s = reinterpret_cast<float*>(ring.offs + ring.stages * kTile);  // [kWarps][kMmaRows] maxima
  float* l_s = m_s + kWarps * kMmaRows;                                    // [kWarps][kMmaRows] sums
  ring.start();

  const int n0 = (warp & 1) * 16;      // the warp's positions in a tile
  const int c0 = (warp >> 1) * kCols;  // and its output columns
  const float scale = p.scale * kLog2e;
  float o[kNTiles][4];  // rows g (0, 1) and g + 8 (2, 3: stay zero) of O, n-tile columns c0 + 8 nt + 2 t4 (+1)
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[nt][i] = 0.f;
  float m = -INFINITY, l = 0.f;  // row g's running maximum (base 2) and this lane's share of its sum

  for (int t = 0; t < ring.num_tiles; ++t) {
    const int64_t ahead = ring.arrive(t);
    const T* k_s = ring.k_tile(t);
    const T* v_s = ring.v_tile(t);

    // S[16 x 16] = Q K^T over the warp's 16 positions (two n-tiles), k-step by k-step.
    float s[2][4] = {};
    const T* b_ptr = k_s + (n0 + (lane & 7) + ((lane >> 4) << 3)) * rs + ((lane >> 3) & 1) * 8;
    const T* a_ptr = q_s + (lane & 15) * rs + (lane >> 4) * 8;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a[4], b[4];
      ptx::ldmatrix_x4(a, a_ptr + ks * 16);
      ptx::ldmatrix_x4(b, b_ptr + ks * 16);
      mma16816<T>(s[0], a, b[0], b[1]);
      mma16816<T>(s[1], a, b[2], b[3]);
    }

    // Online softmax of row g over the warp's positions of this tile; the row's four lanes (t4) agree on max.
    float x[2][2], mx = m;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const bool in = t * kTile + n0 + nt * 8 + 2 * t4 + i < len;
        x[nt][i] = in ? s[nt][i] * scale : -INFINITY;
        mx = fmaxf(mx, x[nt][i]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1, kGroup));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2, kGroup));
    const float base = mx == -INFINITY ? 0.f : mx;  // no position of this warp's yet: every weight 0
    const float alpha = exp2f(m - base);
    m = mx;
    float e[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 2; ++i) e[nt][i] = exp2f(x[nt][i] - base);
    l = l * alpha + (e[0][0] + e[0][1]) + (e[1][0] + e[1][1]);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      o[nt][0] *= alpha;
      o[nt][1] *= alpha;
    }

    // O += P V: P (rows g; rows g + 8 zero) straight from the scores' registers, V's rows by ldmatrix.trans.
    const uint32_t pa[4] = {pack2<T>(e[0][0], e[0][1]), 0u, pack2<T>(e[1][0], e[1][1]), 0u};
    add_pv<T>(o, pa, v_s + (n0 + (lane & 15)) * rs + c0 + (lane >> 4) * 8);
    ring.keep(t + ring.stages, ahead);
  }

  // Merge warp pairs (w, w ^ 1): the same columns over different positions. Row g's sum over its four lanes,
  // then each warp's maximum and sum to shared memory; the odd warp's rescaled rows of O go through the ring's
  // memory (every copy into it has landed and been used) to the even warp, which writes the output.
  l += __shfl_xor_sync(0xffffffffu, l, 1, kGroup);
  l += __shfl_xor_sync(0xffffffffu, l, 2, kGroup);
  if (t4 == 0) {
    m_s[warp * kMmaRows + g] = m;
    l_s[warp * kMmaRows + g] = l;
  }
  __syncthreads();  // also: every warp is done with the ring
  const int other = warp ^ 1;
  const float mo = m_s[other * kMmaRows + g], lo = l_s[other * kMmaRows + g];
  const float top = fmaxf(m, mo);  // finite: warps 0 and 2 see position 0 of the split
  const float f = exp2f(m - top), total = l * f + lo * exp2f(mo - top);
  float* shared_o = reinterpret_cast<float*>(ring.tiles);  // [2 column halves][kMaxHeads][kCols]
  float* mine = shared_o + ((warp >> 1) * kMaxHeads + g) * kCols;
  if (warp & 1) {
    if (g < nh) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
        *reinterpret_cast<float2*>(mine + nt * 8 + 2 * t4) = make_float2(o[nt][0] * f, o[nt][1] * f);
    }
  }
  __syncthreads();
  if (warp & 1 || g >= nh) return;
  const float inv = 1.f / total;
  const int64_t head = w.h0 + g;
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const int col = nt * 8 + 2 * t4;
    const float2 add = *reinterpret_cast<const float2*>(mine + col);
    const float v0 = (o[nt][0] * f + add.x) * inv, v1 = (o[nt][1] * f + add.y) * inv;
    if (w.splits == 1) {
      OutT* out = static_cast<OutT*>(p.out) + (w.row * p.heads + head) * p.dim + c0 + col;
      out[0] = from_float<OutT>(v0);
      out[1] = from_float<OutT>(v1);
    } else {
      *reinterpret_cast<float2*>(p.o_part + ((w.row * S + w.split) * p.heads + head) * p.dim + c0 + col) =
          make_float2(v0, v1);
    }
  }
  if (w.splits > 1 && warp == 0 && t4 == 0)
    p.lse_part[(w.row * S + w.split) * p.heads + head] = (top + log2f(total)) / kLog2e;
}

// ---- paged_prefill_attention: the causal attention of prefill chunks over the paged caches, on tensor cores.
//
// A block serves 64 kM (query, head) rows of one kv head (kM = 1 or 2): row r is query r / group of its work item
// and query head kvh * group + r % group, so a K or V tile read from the cache serves every head of the group.
// Warp w takes rows 16 kM w .. 16 kM (w + 1) - 1, kM m-tiles of 16 (rows g and g + 8 of each tile's fragments),
// over every position up to its last query's own, in tiles through the same ring as the decode kernels; with two
// m-tiles each K and V fragment read from shared memory serves both (half the shared-memory reads a product,
// which bound the one-tile form on long sequences). Each warp keeps its rows' online softmax in registers and
// writes its rows itself. A work item (int4): the sequence's block-table row, the token row of its first query in
// q and out, how many queries (<= 64 kM / group), and the first query's position (its cached context plus its
// index in the chunk); query i attends positions 0 .. position + i.

template <typename T>
__host__ __device__ constexpr int prefill_smem_bytes(int dim, int stages, int rows) {
  return (stages * 2 * kTile + rows) * row_elems<T>(dim) * static_cast<int>(sizeof(T)) +
         stages * kTile * static_cast<int>(sizeof(int64_t));
}

// grid (work items, kv_heads), kThreads threads, prefill_smem_bytes(dim, stages, kM * kPrefillRows) of shared
// memory; q [tokens, heads, kDim] and out [tokens, heads, kDimV] contiguous and 16-byte aligned. K rows of kDim;
// V rows of kDimV (MLA's expanded form: 192 and 128; dense models: equal), each read as kDim elements from its
// start (the ring copies K and V alike), of which the first kDimV are used.
template <typename T, int kDim, int kDimV, int kM>
__global__ void __launch_bounds__(kThreads, kM == 1 ? 4 : 2) paged_prefill_mma_kernel(PagedParams p, const int4* work) {
  static_assert(kDim % 16 == 0 && kDimV % 16 == 0 && kDimV <= 128, "o's accumulators: kDimV / 2 registers a tile");
  static_assert(kM == 1 || kM == 2, "one or two m-tiles a warp");
  constexpr int kKSteps = kDim / 16, kNTiles = kDimV / 8, kPer16 = KvRing<T>::kPer16, kPieces = kDim / kPer16;
  constexpr int kRows = kM * kPrefillRows, kWarpRows = kM * kMmaRows;
  pdl_enter();
  const int4 job = work[blockIdx.x];  // x: block-table row, y: first token row, z: queries, w: first position
  const int group = p.heads / p.kv_heads;
  BlockWork w;
  w.kvh = static_cast<int>(blockIdx.y);
  w.h0 = w.kvh * group;
  w.nh = group;
  w.split = 0;
  w.splits = 1;
  w.row = job.x;
  w.begin = 0;
  w.end = static_cast<int64_t>(job.w) + job.z;  // through the last query's own position
  const KvRing<T> ring = make_ring<T>(p, w, kRows);
  const int rs = ring.rs;
  T* q_s = ring.tiles + ring.stages * 2 * kTile * rs;  // [kRows][rs]: zeros in rows past the queries
  for (int c = threadIdx.x; c < kRows * kPieces; c += kThreads) {
    const int r = c / kPieces, piece = c % kPieces, qi = r / group;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (qi < job.z)
      v = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) +
                                          ((static_cast<int64_t>(job.y) + qi) * p.heads + w.h0 + r % group) * kDim +
                                          piece * kPer16);
    *reinterpret_cast<uint4*>(q_s + r * rs + piece * kPer16) = v;
  }
  ring.start();  // its barrier also publishes q_s

  const int warp = threadIdx.x / kGroup, lane = threadIdx.x % kGroup, g = lane >> 2, t4 = lane & 3;
  int last[kM][2];  // the last position rows g and g + 8 of each m-tile attend to; -1 for rows past the queries
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int qi = (warp * kWarpRows + mt * kMmaRows + g + 8 * h) / group;
      last[mt][h] = qi < job.z ? job.w + qi : -1;
    }
  const int first_q = warp * kWarpRows / group;  // the warp's rows' queries: first_q .. its last valid one
  const int warp_last = first_q < job.z ? job.w + min(job.z - 1, (warp * kWarpRows + kWarpRows - 1) / group) : -1;
  const float scale = p.scale * kLog2e;
  float o[kM][kNTiles][4];  // per m-tile: rows g (0, 1) and g + 8 (2, 3), columns 8 nt + 2 t4 (+1)
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.f;
  float m[kM][2], l[kM][2];  // rows' running maxima (base 2), this lane's sums
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[mt][h] = -INFINITY;
      l[mt][h] = 0.f;
    }
  const T* a_ptr = q_s + (warp * kWarpRows + (lane & 15)) * rs + (lane >> 4) * 8;  // m-tile mt: + 16 mt rows

  for (int t = 0; t < ring.num_tiles; ++t) {
    const int64_t ahead = ring.arrive(t);
    if (t * kTile <= warp_last) {  // else every position of the tile lies past the warp's rows (uniform)
      const T* k_s = ring.k_tile(t);
      const T* v_s = ring.v_tile(t);
      // S[16 kM x 32] = Q K^T: four n-tiles of 8 positions; each K fragment serves every m-tile.
      float s[kM][4][4] = {};
      const T* b_ptr = k_s + ((lane & 7) + ((lane >> 4) << 3)) * rs + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t a[kM][4];
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) ptx::ldmatrix_x4(a[mt], a_ptr + mt * kMmaRows * rs + ks * 16);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t b[4];
          ptx::ldmatrix_x4(b, b_ptr + half * 16 * rs + ks * 16);
#pragma unroll
          for (int mt = 0; mt < kM; ++mt) {
            mma16816<T>(s[mt][2 * half], a[mt], b[0], b[1]);
            mma16816<T>(s[mt][2 * half + 1], a[mt], b[2], b[3]);
          }
        }
      }
      // The causal mask and the online softmax of rows g (h = 0) and g + 8 (h = 1); a row's four lanes agree.
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int h = i >> 1, pos = t * kTile + nt * 8 + 2 * t4 + (i & 1);
            s[mt][nt][i] = pos <= last[mt][h] ? s[mt][nt][i] * scale : -INFINITY;
            mx[h] = fmaxf(mx[h], s[mt][nt][i]);
          }
        float alpha[2], base[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1, kGroup));
          mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2, kGroup));
          base[h] = mx[h] == -INFINITY ? 0.f : mx[h];  // a row past the queries: every weight 0
          alpha[h] = exp2f(m[mt][h] - base[h]);
          m[mt][h] = mx[h];
          l[mt][h] *= alpha[h];
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            s[mt][nt][i] = exp2f(s[mt][nt][i] - base[i >> 1]);
            l[mt][i >> 1] += s[mt][nt][i];
          }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          o[mt][nt][0] *= alpha[0];
          o[mt][nt][1] *= alpha[0];
          o[mt][nt][2] *= alpha[1];
          o[mt][nt][3] *= alpha[1];
        }
      }
      // O += P V, 16 positions a k-step: P from the scores' registers, V's rows by ldmatrix.trans (each fragment
      // serves every m-tile).
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t pa[kM][4];
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          pa[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pa[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pa[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pa[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
        const T* v_ptr = v_s + (kk * 16 + (lane & 15)) * rs + (lane >> 4) * 8;
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t b[4];
          ptx::ldmatrix_x4_trans(b, v_ptr + np * 16);
#pragma unroll
          for (int mt = 0; mt < kM; ++mt) {
            mma16816<T>(o[mt][2 * np], pa[mt], b[0], b[1]);
            mma16816<T>(o[mt][2 * np + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }
    ring.keep(t + ring.stages, ahead);
  }

  // Each row's sum over its four lanes, then the warp's rows out.
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[mt][h] += __shfl_xor_sync(0xffffffffu, l[mt][h], 1, kGroup);
      l[mt][h] += __shfl_xor_sync(0xffffffffu, l[mt][h], 2, kGroup);
      if (last[mt][h] < 0) continue;
      const int r = warp * kWarpRows + mt * kMmaRows + g + 8 * h;
      const float inv = 1.f / l[mt][h];
      T* out = static_cast<T*>(p.out) +
               ((static_cast<int64_t>(job.y) + r / group) * p.heads + w.h0 + r % group) * kDimV;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int col = nt * 8 + 2 * t4;
        out[col] = from_float<T>(o[mt][nt][2 * h] * inv);
        out[col + 1] = from_float<T>(o[mt][nt][2 * h + 1] * inv);
      }
    }
}
#endif  // ATOM_PAGED_MMA

// Merges the splits of one (head, row) (merge_splits, kernel_common.h), if the row took more than one.
// grid (heads, rows), block kMergeThreads.
template <typename OutT>
__global__ void __launch_bounds__(kMergeThreads) paged_combine_kernel(PagedParams p) {
  pdl_enter();
  const int h = blockIdx.x, S = p.num_splits;
  const int64_t row = blockIdx.y;
  const int splits = row_splits(p, load_index(p.seq_lens, row, p.sl64));
  if (splits == 1) return;
  merge_splits(p.lse_part + row * S * p.heads + h, p.heads, p.o_part + (row * S * p.heads + h) * p.dim,
               static_cast<int64_t>(p.heads) * p.dim, splits, p.dim,
               static_cast<OutT*>(p.out) + (row * p.heads + h) * p.dim);
}

// The most shared memory a block may use on the current device (opted in).
int max_block_smem() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 48 * 1024;
  return bytes;
}

using PagedKernelFn = void (*)(PagedParams);

// Lets `kernel` take `bytes` of dynamic shared memory (past the default 48 KiB). Remembers the most each kernel
// was allowed, so launches after the first make no runtime call (one GPU per process).
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  static std::mutex mutex;
  static std::vector<std::pair<const void*, int>> allowed;
  const void* key = reinterpret_cast<const void*>(kernel);
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [fn, most] : allowed)
    if (fn == key && bytes <= most) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) allowed.emplace_back(key, bytes);
  return err;
}

// The kernel for p: tensor cores for bf16/fp16 rows of 64, 128 or 256 elements, 16-byte aligned, on NVIDIA;
// CUDA cores otherwise.
struct PagedKernel {
  PagedKernelFn fn;
  bool mma;
};

template <typename T, typename OutT>
PagedKernel paged_kernel(const PagedParams& p) {
#ifdef ATOM_PAGED_MMA
  if constexpr (!std::is_same_v<T, float>) {
    if (p.vec && p.dim == 64) return {paged_decode_mma_kernel<T, OutT, 64>, true};
    if (p.vec && p.dim == 128) return {paged_decode_mma_kernel<T, OutT, 128>, true};
    if (p.vec && p.dim == 256) return {paged_decode_mma_kernel<T, OutT, 256>, true};
  }
#endif
  return {paged_decode_kernel<T, OutT>, false};
}

// p.vec, p.stages (the deepest ring that fits, unless the caller chose) and the kernel with its shared memory;
// an error message when nothing fits.
template <typename T, typename OutT>
const char* prepare_paged(PagedParams& p, PagedKernel& kernel, int& smem) {
  constexpr int kPer16 = 16 / sizeof(T);
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  p.vec = p.dim % kPer16 == 0 && aligned(p.k_cache) && aligned(p.v_cache) && p.block_stride % kPer16 == 0 &&
          p.token_stride % kPer16 == 0 && p.head_stride % kPer16 == 0;
  kernel = paged_kernel<T, OutT>(p);
  const int heads = min(kMaxHeads, p.heads / p.kv_heads), limit = max_block_smem();
  int deepest = kMaxStages;
  while (deepest > 0 && paged_smem_bytes<T>(p.dim, heads, deepest, kernel.mma) > limit) --deepest;
  if (deepest == 0) return "paged_decode_attention: head_dim too large for this GPU's shared memory";
  if (p.stages > deepest) return "paged_decode_attention: that many stages do not fit this GPU's shared memory";
  if (p.stages == 0) p.stages = min(p.dim > 128 ? 1 : kDefaultStages, deepest);
  smem = paged_smem_bytes<T>(p.dim, heads, p.stages, kernel.mma);
  const cudaError_t err = allow_smem(kernel.fn, smem);
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T, typename OutT>
const char* launch_paged(PagedParams p, int64_t rows, cudaStream_t stream) {
  PagedKernel kernel{};
  int smem = 0;
  if (const char* err = prepare_paged<T, OutT>(p, kernel, smem)) return err;
  const int chunks = static_cast<int>(ceil_div(p.heads / p.kv_heads, kMaxHeads));
  const dim3 grid(static_cast<unsigned>(p.kv_heads * chunks), static_cast<unsigned>(rows),
                  static_cast<unsigned>(p.num_splits));
  launch_kernel(kernel.fn, grid, kThreads, static_cast<size_t>(smem), stream, p);
  const char* err = last_launch_error();
  if (err != nullptr || p.num_splits == 1) return err;
  const dim3 merge(static_cast<unsigned>(p.heads), static_cast<unsigned>(rows));
  launch_kernel(paged_combine_kernel<OutT>, merge, kMergeThreads, merge_shared_bytes(p.num_splits), stream, p);
  return last_launch_error();
}

#ifdef ATOM_PAGED_MMA
template <typename T, int kM>
const char* launch_prefill(PagedParams p, const int4* work, int64_t num_work, cudaStream_t stream) {
  p.stages = kDefaultStages;
  const int smem = prefill_smem_bytes<T>(p.dim, p.stages, kM * kPrefillRows);
  void (*kernel)(PagedParams, const int4*) = p.dim == 64    ? paged_prefill_mma_kernel<T, 64, 64, kM>
                                               : p.dim == 128 ? paged_prefill_mma_kernel<T, 128, 128, kM>
                                                              : paged_prefill_mma_kernel<T, 192, 128, kM>;  // v: 128
  if (const cudaError_t err = allow_smem(kernel, smem); err != cudaSuccess) return cudaGetErrorString(err);
  const dim3 grid(static_cast<unsigned>(num_work), static_cast<unsigned>(p.kv_heads));
  launch_kernel(kernel, grid, kThreads, static_cast<size_t>(smem), stream, p, work);
  return last_launch_error();
}
#endif

// Blocks of the kernel for aligned caches of T (output T) that one SM runs at once, for `heads` query heads
// of head_dim; 0 if none fits.
template <typename T>
int paged_blocks_per_sm(int dim, int heads) {
  PagedParams p{};
  p.dim = dim;
  p.heads = heads;
  p.kv_heads = 1;
  p.k_cache = p.v_cache = nullptr;  // aligned
  PagedKernel kernel{};
  int smem = 0, blocks = 0;
  if (prepare_paged<T, T>(p, kernel, smem) != nullptr) return 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel.fn, kThreads, static_cast<size_t>(smem)) !=
      cudaSuccess)
    return 0;
  return blocks;
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
                                   int64_t head_dim, int64_t num_splits, int64_t split_min_tiles, int64_t stages,
                                   double scale, int dtype, int out_dtype, uintptr_t stream) {
  if (rows < 0 || heads < 1 || kv_heads < 1 || block_size < 1 || head_dim < 1)
    return "paged_decode_attention: needs rows >= 0 and heads, kv_heads, head_dim, block_size >= 1";
  if (heads % kv_heads != 0) return "paged_decode_attention: heads must be a multiple of kv_heads";
  if (head_dim > kMaxDim) return "paged_decode_attention: head_dim must be <= 256";
  if (num_splits < 1 || num_splits > 1024) return "paged_decode_attention: num_splits must be in 1..1024";
  if (split_min_tiles < 1 || split_min_tiles > INT32_MAX)
    return "paged_decode_attention: split_min_tiles must be >= 1";
  if (stages < 0 || stages > kMaxStages) return "paged_decode_attention: stages must be 0 (automatic) or 1..3";
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
                      static_cast<int>(split_min_tiles),
                      static_cast<float>(scale),
                      static_cast<int>(stages),
                      false};
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "paged_decode_attention", [&]() -> const char* {
    return out_dtype == kFloat32 ? launch_paged<scalar_t, float>(p, rows, st)
                                 : launch_paged<scalar_t, scalar_t>(p, rows, st);
  });
}

const char* paged_prefill_attention(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, int64_t block_stride,
                                    int64_t token_stride, int64_t head_stride, int64_t block_size,
                                    uintptr_t block_tables, int64_t block_table_stride, int block_table_dtype,
                                    uintptr_t work, int64_t num_work, int64_t queries_per_item, uintptr_t out,
                                    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t v_head_dim,
                                    double scale, int dtype, uintptr_t stream) {
  if (num_work < 0 || heads < 1 || kv_heads < 1 || block_size < 1 || heads % kv_heads != 0)
    return "paged_prefill_attention: needs num_work >= 0, block_size >= 1 and heads a multiple of kv_heads >= 1";
  if (queries_per_item < 1 || queries_per_item * (heads / kv_heads) > 2 * kPrefillRows)
    return "paged_prefill_attention: a work item's queries times the group must be 1..128 rows";
  if (block_table_dtype != kInt32 && block_table_dtype != kInt64)
    return "paged_prefill_attention: block_tables must be int32 or int64";
  if (num_work > INT32_MAX || kv_heads > 65535) return "paged_prefill_attention: too many work items or kv heads";
  if (!paged_prefill_supported(head_dim, v_head_dim, dtype))
    return "paged_prefill_attention: takes bf16/fp16 q/k and v rows of 64/64, 128/128 or 192/128 on NVIDIA GPUs";
  const auto aligned = [](uintptr_t ptr) { return ptr % 16 == 0; };
  if (!aligned(q) || !aligned(out) || !aligned(k_cache) || !aligned(v_cache) || block_stride % 8 != 0 ||
      token_stride % 8 != 0 || head_stride % 8 != 0)
    return "paged_prefill_attention: q, out and the caches' head rows must be 16-byte aligned";
  if (num_work == 0) return nullptr;
#ifdef ATOM_PAGED_MMA
  PagedParams p{};
  p.q = reinterpret_cast<const void*>(q);
  p.k_cache = reinterpret_cast<const void*>(k_cache);
  p.v_cache = reinterpret_cast<const void*>(v_cache);
  p.block_stride = block_stride;
  p.token_stride = token_stride;
  p.head_stride = head_stride;
  p.block_size = static_cast<int>(block_size);
  p.block_tables = reinterpret_cast<const void*>(block_tables);
  p.bt_stride = block_table_stride;
  p.bt64 = block_table_dtype == kInt64;
  p.out = reinterpret_cast<void*>(out);
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.dim = static_cast<int>(head_dim);
  p.num_splits = 1;
  p.split_min_tiles = 1;
  p.scale = static_cast<float>(scale);
  p.vec = true;
  const int4* items = reinterpret_cast<const int4*>(work);
  cudaStream_t st = as_stream(stream);
  if (queries_per_item * (heads / kv_heads) > kPrefillRows)  // 128-row blocks
    return dtype == kBFloat16 ? launch_prefill<bf16_t, 2>(p, items, num_work, st)
                              : launch_prefill<fp16_t, 2>(p, items, num_work, st);
  return dtype == kBFloat16 ? launch_prefill<bf16_t, 1>(p, items, num_work, st)
                            : launch_prefill<fp16_t, 1>(p, items, num_work, st);
#else
  (void)stream;
  return "paged_prefill_attention: needs an NVIDIA GPU";
#endif
}

bool paged_prefill_supported(int64_t head_dim, int64_t v_head_dim, int dtype) {
#ifdef ATOM_PAGED_MMA
  const bool sizes = (head_dim == v_head_dim && (head_dim == 64 || head_dim == 128)) ||
                     (head_dim == 192 && v_head_dim == 128);
  return sizes && (dtype == kBFloat16 || dtype == kFloat16);
#else
  (void)head_dim;
  (void)v_head_dim;
  (void)dtype;
  return false;
#endif
}

int paged_decode_blocks_per_sm(int64_t head_dim, int64_t heads_per_block, int dtype) {
  if (head_dim < 1 || head_dim > kMaxDim || heads_per_block < 1 || heads_per_block > kMaxHeads) return 0;
  const int dim = static_cast<int>(head_dim), heads = static_cast<int>(heads_per_block);
  if (dtype == kFloat32) return paged_blocks_per_sm<float>(dim, heads);
  if (dtype == kBFloat16) return paged_blocks_per_sm<bf16_t>(dim, heads);
  if (dtype == kFloat16) return paged_blocks_per_sm<fp16_t>(dim, heads);
  return 0;
}

}  // namespace atom
