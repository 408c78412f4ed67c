// Writes new tokens' MLA cache rows [latent (rank) | k_rot (rope)] at their
// slots (block_id * block_size + offset), taking the two halves from separate
// tensors so the layer needs no concatenation. One 32-thread group per token;
// a negative slot (padding token) writes nothing.
#include "kernel_common.h"

namespace atom {
namespace {

struct WriteParams {
  void* cache;
  int64_t block_stride, row_stride, block_size;
  const void* latent;
  int64_t latent_stride;
  const void* rope;
  int64_t rope_stride;
  const void* slot_mapping;
  bool slots64;
  int64_t num_tokens;
  int rank, rope_dim;
};

constexpr int kTokensPerBlock = 8;
constexpr int kCopyBatch = 16;  // elements a lane loads before it stores the first: a 576-wide row in 2 round trips

template <typename T>
__global__ void __launch_bounds__(kTokensPerBlock * 32) write_latent_cache_kernel(WriteParams p) {
  pdl_enter();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + threadIdx.x / kGroup;
  if (t >= p.num_tokens) return;
  const int lane = threadIdx.x % kGroup;
  const int64_t slot = load_index(p.slot_mapping, t, p.slots64);
  if (slot < 0) return;
  T* dst = static_cast<T*>(p.cache) + (slot / p.block_size) * p.block_stride + (slot % p.block_size) * p.row_stride;
  const T* latent = static_cast<const T*>(p.latent) + t * p.latent_stride;
  const T* rope = static_cast<const T*>(p.rope) + t * p.rope_stride;
  // The row's element d is latent[d] below rank, else rope[d - rank]. A lane's loads of a batch are all issued
  // before its first store (loaded and stored one by one, each waited for its own round trip: 4.3 us a token
  // at Kimi-Linear's 576, session 26).
  const int total = p.rank + p.rope_dim;
  for (int d0 = lane; d0 < total; d0 += kGroup * kCopyBatch) {
    T v[kCopyBatch];
#pragma unroll
    for (int k = 0; k < kCopyBatch; ++k) {
      const int d = min(d0 + k * kGroup, total - 1);  // past the row: a repeat, not stored
      v[k] = d < p.rank ? latent[d] : rope[d - p.rank];
    }
#pragma unroll
    for (int k = 0; k < kCopyBatch; ++k)
      if (d0 + k * kGroup < total) dst[d0 + k * kGroup] = v[k];
  }
}

}  // namespace

const char* write_latent_cache(uintptr_t cache, int64_t block_stride, int64_t row_stride, int64_t block_size,
                               uintptr_t latent, int64_t latent_stride, uintptr_t rope, int64_t rope_stride,
                               uintptr_t slot_mapping, int slot_dtype, int64_t num_tokens, int64_t rank,
                               int64_t rope_dim, int dtype, uintptr_t stream) {
  if (num_tokens < 0 || rank < 0 || rope_dim < 0 || block_size < 1)
    return "write_latent_cache: needs num_tokens, rank, rope_dim >= 0 and block_size >= 1";
  if (slot_dtype != kInt32 && slot_dtype != kInt64) return "write_latent_cache: slot_mapping must be int32 or int64";
  if (num_tokens == 0) return nullptr;
  if (ceil_div(num_tokens, kTokensPerBlock) > INT32_MAX) return "write_latent_cache: too many tokens";
  WriteParams p{reinterpret_cast<void*>(cache), block_stride, row_stride, block_size,
                reinterpret_cast<const void*>(latent), latent_stride, reinterpret_cast<const void*>(rope),
                rope_stride, reinterpret_cast<const void*>(slot_mapping), slot_dtype == kInt64, num_tokens,
                static_cast<int>(rank), static_cast<int>(rope_dim)};
  const dim3 grid(static_cast<unsigned>(ceil_div(num_tokens, kTokensPerBlock)));
  cudaStream_t st = as_stream(stream);
  return ATOM_DISPATCH_FLOAT_TYPES(dtype, "write_latent_cache", [&]() -> const char* {
    launch_kernel(write_latent_cache_kernel<scalar_t>, grid, kTokensPerBlock * 32, 0, st, p);
    return last_launch_error();
  });
}

}  // namespace atom
