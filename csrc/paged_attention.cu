// Paged GQA decode attention for dense models (Llama, Qwen3): one query row per token over the
// first seq_lens[t] cached positions of its sequence.
//
//   K and V caches [num_blocks, block_size, kv_heads, head_dim]; query head h reads kv head
//   h / group (group = heads / kv_heads):
//
//   score_p = q . k_p * scale          out = sum_p softmax(score)_p v_p        [heads, head_dim]
//
// One block per (row, kv head, up to kMaxHeads of its query heads, split): a position's key and value
// are read once for the block's heads. Tiles of kTile positions of K and V stream through a ring of
// shared-memory stages (cp.async on NVIDIA, so the next tiles' loads are in flight while this one is
// scored; plain copies on HIP and for rows that are not 16-byte aligned). Per tile:
//   scores   warp w takes head w (and w + 4), lane j position j: a dot product over head_dim, then the
//            head's online softmax (base 2) with warp reductions; probabilities to shared memory
//   values   thread (head, 4 columns) adds the tile's probability-weighted value rows
// Registers stay few (the tiles live in shared memory), so many blocks share an SM. Long sequences are
// split over several blocks (flash-decoding) and the splits merged by their log-sum-exp
// (paged_combine_kernel). CUDA cores, any float dtype, head_dim <= 256.
#include "kernel_common.h"

#if !defined(__HIPCC__) && !defined(USE_ROCM)
#include "mma_sm80.h"
#endif

namespace atom {
namespace {

constexpr int kTile = 32;  // positions of a tile; a split takes whole tiles
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kGroup;
constexpr int kMaxHeads = 8;  // query heads a block serves
constexpr int kMaxDim = 256;
constexpr int kMaxStages = 3;
constexpr int kScoreRounds = kMaxHeads * kTile / kThreads;   // (head, position) items a thread scores
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
  float scale;
  int stages;  // shared-memory tiles in the ring: 1..kMaxStages (0 from the caller: the deepest that fits)
  bool vec;    // head rows of K and V 16-byte aligned: cp.async in 16-byte pieces
};

// Elements of a head row in shared memory: dim rounded up to 16-byte pieces, plus one piece, so that eight
// consecutive rows' pieces at one column fall on distinct banks (for 2-byte types; 4-byte ones conflict 2-way).
template <typename T>
__host__ __device__ constexpr int row_elems(int dim) {
  constexpr int per16 = 16 / sizeof(T);
  return (dim + per16 - 1) / per16 * per16 + per16;
}

// The dynamic shared memory of a block: stages x {K, V} x kTile rows, q rows, then floats and offsets.
template <typename T>
__host__ __device__ constexpr int paged_smem_bytes(int dim, int heads, int stages) {
  return (stages * 2 * kTile + heads) * row_elems<T>(dim) * static_cast<int>(sizeof(T)) +
         stages * kTile * static_cast<int>(sizeof(int64_t)) + heads * (kTile + 2) * static_cast<int>(sizeof(float));
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

// grid (kv_heads * ceil(group / kMaxHeads), rows, splits), kThreads threads, paged_smem_bytes of shared memory.
template <typename T, typename OutT>
__global__ void __launch_bounds__(kThreads, 6) paged_decode_kernel(PagedParams p) {
  pdl_enter();
  constexpr int kPer16 = 16 / sizeof(T);
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
  const int rs = row_elems<T>(p.dim), stages = p.stages;
  T* tiles = dynamic_shared<T>();               // [stages][2][kTile][rs]: K then V of each stage
  T* q_s = tiles + stages * 2 * kTile * rs;     // [nh][rs]
  int64_t* offs = reinterpret_cast<int64_t*>(q_s + nh * rs);  // [stages][kTile]: cache offsets, -1 past the end
  float* p_s = reinterpret_cast<float*>(offs + stages * kTile);  // [nh][kTile] probabilities
  float* alpha_s = p_s + nh * kTile;                              // [nh] rescale of the running output
  float* l_s = alpha_s + nh;                                      // [nh] the softmax's final sums

  const T* k_cache = static_cast<const T*>(p.k_cache) + kvh * p.head_stride;
  const T* v_cache = static_cast<const T*>(p.v_cache) + kvh * p.head_stride;
  const int len = static_cast<int>(end - begin), num_tiles = (len + kTile - 1) / kTile;
  // Thread j < kTile: the cache offset of position j of tile `tile` (-1 past the end), and its store into the
  // tile's ring slot. The loop looks a tile up at the top of an iteration and stores it at the bottom, so the
  // block table's latency hides behind the tile's math.
  const auto locate = [&](int tile) -> int64_t {
    const int pos = tile * kTile + static_cast<int>(threadIdx.x);
    if (threadIdx.x >= kTile || pos >= len) return -1;
    const int64_t at = begin + pos;
    return load_index(p.block_tables, row * p.bt_stride + at / p.block_size, p.bt64) * p.block_stride +
           (at % p.block_size) * p.token_stride;
  };
  const auto keep = [&](int tile, int64_t off) {
    if (threadIdx.x < kTile && tile < num_tiles) offs[(tile % stages) * kTile + threadIdx.x] = off;
  };
  // Every thread: its share of tile `tile`'s K and V rows (four threads a row) into the tile's stage; zeros
  // past the end, and (plain copies) past dim up to whole 16-byte pieces.
  const int ld_row = threadIdx.x / 4, ld_part = threadIdx.x % 4;
  const auto fetch = [&](int tile) {
    if (tile >= num_tiles) return;
    const int st = tile % stages;
    const int64_t off = offs[st * kTile + ld_row];
    T* k_dst = tiles + (st * 2 * kTile + ld_row) * rs;
    T* v_dst = k_dst + kTile * rs;
    if (p.vec) {
      const int64_t src = off >= 0 ? off : 0;
      for (int c = ld_part * kPer16; c < p.dim; c += 4 * kPer16) {
        copy16(k_dst + c, k_cache + src + c, off >= 0);
        copy16(v_dst + c, v_cache + src + c, off >= 0);
      }
    } else {
      const int padded = rs - kPer16;
      for (int c = ld_part; c < padded; c += 4) {
        const bool in = off >= 0 && c < p.dim;
        k_dst[c] = in ? k_cache[off + c] : from_float<T>(0.f);
        v_dst[c] = in ? v_cache[off + c] : from_float<T>(0.f);
      }
    }
  };

  // The block's query rows, zero-padded to whole 16-byte pieces; the first tiles' offsets and loads.
  const T* q_row = static_cast<const T*>(p.q) + (row * p.heads + h0) * p.dim;
  for (int c = threadIdx.x; c < nh * (rs - kPer16); c += kThreads) {
    const int g = c / (rs - kPer16), d = c % (rs - kPer16);
    q_s[g * rs + d] = d < p.dim ? q_row[g * p.dim + d] : from_float<T>(0.f);
  }
  for (int t = 0; t < stages; ++t) keep(t, locate(t));
  __syncthreads();
  for (int t = 0; t + 1 < stages; ++t) {
    fetch(t);
    commit_copies();
  }

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

  for (int t = 0; t < num_tiles; ++t) {
    // Tile t in its stage; the next tiles' loads go out as soon as their stage is free.
    if (stages == 1) {
      __syncthreads();  // the previous tile's values are summed
      fetch(t);
      commit_copies();
    }
    wait_copies(stages - 2);  // tile t's group; with 3 stages tile t + 1's may stay in flight
    __syncthreads();
    if (stages > 1) {
      fetch(t + stages - 1);
      commit_copies();
    }
    const int64_t ahead = locate(t + stages);
    const T* k_s = tiles + (t % stages) * 2 * kTile * rs;
    const T* v_s = k_s + kTile * rs;

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
      const int item = static_cast<int>(threadIdx.x) + kThreads * r;
      const int g = item / quads, c = (item % quads) * 4;
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
    keep(t + stages, ahead);
  }

  // The softmax's sums to shared memory (and each split's log-sum-exp out), then each thread's columns out.
#pragma unroll
  for (int r = 0; r < kScoreRounds; ++r) {
    const int g = warp + kWarps * r;
    if (g >= nh) continue;
    l[r] = warp_sum(l[r]);
    if (lane == 0) {
      l_s[g] = l[r];
      if (S > 1) p.lse_part[(row * S + split) * p.heads + h0 + g] = (m[r] + log2f(l[r])) / kLog2e;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kValueRounds; ++r) {
    const int item = static_cast<int>(threadIdx.x) + kThreads * r;
    const int g = item / quads, c = (item % quads) * 4;
    if (g >= nh) continue;
    const float inv = 1.f / l_s[g];
    for (int i = 0; i < 4 && c + i < p.dim; ++i) {
      const int64_t at = (row * p.heads + h0 + g) * p.dim + c + i;
      if (S == 1) {
        static_cast<OutT*>(p.out)[at] = from_float<OutT>(acc[r][i] * inv);
      } else {
        p.o_part[((row * S + split) * p.heads + h0 + g) * p.dim + c + i] = acc[r][i] * inv;
      }
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

// The most shared memory a block may use on the current device (opted in).
int max_block_smem() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 48 * 1024;
  return bytes;
}

// Lets `kernel` take `bytes` of dynamic shared memory (past the default 48 KiB). Each kernel (a template
// argument, so each has its own counter) remembers the most it was allowed, so launches after the first make no
// runtime call (one GPU per process).
template <auto kernel>
cudaError_t allow_smem(int bytes) {
  static std::atomic<int> allowed{48 * 1024};
  if (bytes <= allowed.load(std::memory_order_relaxed)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) allowed.store(bytes);
  return err;
}

// The deepest ring (kMaxStages down to 1) whose shared memory fits a block on this device; 0 if none does.
template <typename T>
int paged_stages(int dim, int heads) {
  const int limit = max_block_smem();
  for (int s = kMaxStages; s >= 1; --s)
    if (paged_smem_bytes<T>(dim, heads, s) <= limit) return s;
  return 0;
}

template <typename T, typename OutT>
const char* launch_paged(PagedParams p, int64_t rows, cudaStream_t stream) {
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  constexpr int kPer16 = 16 / sizeof(T);
  p.vec = p.dim % kPer16 == 0 && aligned(p.k_cache) && aligned(p.v_cache) && p.block_stride % kPer16 == 0 &&
          p.token_stride % kPer16 == 0 && p.head_stride % kPer16 == 0;
  const int nh_max = min(kMaxHeads, p.heads / p.kv_heads);
  const int deepest = paged_stages<T>(p.dim, nh_max);
  if (deepest == 0) return "paged_decode_attention: head_dim too large for this GPU's shared memory";
  if (p.stages > deepest) return "paged_decode_attention: that many stages do not fit this GPU's shared memory";
  if (p.stages == 0) p.stages = deepest;
  const int smem = paged_smem_bytes<T>(p.dim, nh_max, p.stages);
  constexpr auto kernel = paged_decode_kernel<T, OutT>;
  const cudaError_t allowed = allow_smem<kernel>(smem);
  if (allowed != cudaSuccess) return cudaGetErrorString(allowed);
  const int chunks = static_cast<int>(ceil_div(p.heads / p.kv_heads, kMaxHeads));
  const dim3 grid(static_cast<unsigned>(p.kv_heads * chunks), static_cast<unsigned>(rows),
                  static_cast<unsigned>(p.num_splits));
  launch_kernel(kernel, grid, kThreads, static_cast<size_t>(smem), stream, p);
  const char* err = last_launch_error();
  if (err != nullptr || p.num_splits == 1) return err;
  const dim3 merge(static_cast<unsigned>(p.heads), static_cast<unsigned>(rows));
  launch_kernel(paged_combine_kernel<OutT>, merge, kMergeThreads, merge_shared_bytes(p.num_splits), stream, p);
  return last_launch_error();
}

// Blocks of paged_decode_kernel<T, T> that one SM runs at once, for heads_per_block query heads of head_dim.
template <typename T>
int paged_blocks_per_sm(int dim, int heads) {
  const int stages = paged_stages<T>(dim, heads);
  if (stages == 0) return 0;
  const int smem = paged_smem_bytes<T>(dim, heads, stages);
  constexpr auto kernel = paged_decode_kernel<T, T>;
  if (allow_smem<kernel>(smem) != cudaSuccess) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, static_cast<size_t>(smem)) !=
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
                                   int64_t head_dim, int64_t num_splits, int64_t stages, double scale, int dtype,
                                   int out_dtype, uintptr_t stream) {
  if (rows < 0 || heads < 1 || kv_heads < 1 || block_size < 1 || head_dim < 1)
    return "paged_decode_attention: needs rows >= 0 and heads, kv_heads, head_dim, block_size >= 1";
  if (heads % kv_heads != 0) return "paged_decode_attention: heads must be a multiple of kv_heads";
  if (head_dim > kMaxDim) return "paged_decode_attention: head_dim must be <= 256";
  if (num_splits < 1 || num_splits > 1024) return "paged_decode_attention: num_splits must be in 1..1024";
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
                      static_cast<float>(scale),
                      static_cast<int>(stages),
                      false};
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "paged_decode_attention", [&]() -> const char* {
    return out_dtype == kFloat32 ? launch_paged<scalar_t, float>(p, rows, st)
                                 : launch_paged<scalar_t, scalar_t>(p, rows, st);
  });
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
