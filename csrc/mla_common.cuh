// Shared by the MLA decode kernels (mla.cu, mla_mma.cuh): parameters, how a
// sequence's positions are split over blocks, and cache addressing.
#pragma once

#include "kernel_common.h"

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


// Element offset of position `pos` of sequence b in the cache.
__device__ __forceinline__ int64_t row_offset(const MlaParams& p, int64_t b, int64_t pos) {
  const int64_t blk = load_index(p.block_tables, b * p.bt_stride + pos / p.block_size, p.bt64);
  return blk * p.block_stride + (pos % p.block_size) * p.row_stride;
}

// Element offset of position tile * kTile + j, or -1 past the split's end.
template <int kTile>
__device__ __forceinline__ int64_t tile_row(const MlaParams& p, int64_t b, int64_t seq_len, TileRange tiles,
                                            int64_t tile, int j) {
  const int64_t pos = tile * kTile + j;
  if (tile >= tiles.end || pos >= seq_len) return -1;
  const int ipos = static_cast<int>(pos);  // 32-bit division: positions < 2^31
  const int64_t blk = load_index(p.block_tables, b * p.bt_stride + ipos / p.block_size, p.bt64);
  return blk * p.block_stride + static_cast<int64_t>(ipos % p.block_size) * p.row_stride;
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

}  // namespace
}  // namespace atom
