// Copies whole cache blocks between a paged cache and a contiguous staging
// buffer (P/D transfer, offload). Byte-generic: the copy unit is the widest
// word (16, 8, 4 or 1 bytes) that every address and size is aligned to, so
// any dtype and layout works and the common case moves uint4s. copy_runs does
// a whole request's blocks and state slots, of every cache tensor, in one
// launch (a list of byte runs built on the host).
#include "ops.h"
#include "portability.h"

namespace atom {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;

// grid.x: one selected block; grid.y: a slice of that block's words.
template <typename Word, bool kGather>
__global__ void copy_blocks_kernel(char* __restrict__ cache, int64_t block_stride,
                                   const int64_t* __restrict__ block_ids,
                                   char* __restrict__ staging, int64_t block_bytes) {
  const int64_t i = blockIdx.x;
  char* cache_block = cache + block_ids[i] * block_stride;
  char* staging_block = staging + i * block_bytes;
  const Word* src = reinterpret_cast<const Word*>(kGather ? cache_block : staging_block);
  Word* dst = reinterpret_cast<Word*>(kGather ? staging_block : cache_block);

  const int64_t num_words = block_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; w < num_words;
       w += step) {
    dst[w] = src[w];
  }
}

// The widest power-of-two word size, up to 16, that divides every value.
int word_bytes(uintptr_t cache, int64_t block_stride, uintptr_t staging, int64_t block_bytes) {
  const uint64_t bits = static_cast<uint64_t>(cache) | static_cast<uint64_t>(block_stride) |
                        static_cast<uint64_t>(staging) | static_cast<uint64_t>(block_bytes);
  for (int w = 16; w > 1; w /= 2) {
    if (bits % w == 0) return w;
  }
  return 1;
}

template <bool kGather>
const char* copy_blocks(uintptr_t cache, int64_t block_stride, uintptr_t block_ids,
                        int64_t num_ids, uintptr_t staging, int64_t block_bytes,
                        uintptr_t stream) {
  if (num_ids < 0 || block_bytes < 0) return "copy_blocks: negative num_ids or block_bytes";
  if (num_ids > INT32_MAX) return "copy_blocks: more than 2^31-1 block ids in one call";
  if (num_ids == 0 || block_bytes == 0) return nullptr;

  const int w = word_bytes(cache, block_stride, staging, block_bytes);
  const int64_t num_words = block_bytes / w;
  const int64_t slices = (num_words + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(num_ids),
                  static_cast<unsigned>(slices < kMaxGridY ? slices : kMaxGridY));
  auto* c = reinterpret_cast<char*>(cache);
  auto* s = reinterpret_cast<char*>(staging);
  auto* ids = reinterpret_cast<const int64_t*>(block_ids);
  cudaStream_t st = as_stream(stream);
  switch (w) {
    case 16:
      copy_blocks_kernel<uint4, kGather><<<grid, kThreads, 0, st>>>(c, block_stride, ids, s, block_bytes);
      break;
    case 8:
      copy_blocks_kernel<uint2, kGather><<<grid, kThreads, 0, st>>>(c, block_stride, ids, s, block_bytes);
      break;
    case 4:
      copy_blocks_kernel<uint32_t, kGather><<<grid, kThreads, 0, st>>>(c, block_stride, ids, s, block_bytes);
      break;
    default:
      copy_blocks_kernel<uint8_t, kGather><<<grid, kThreads, 0, st>>>(c, block_stride, ids, s, block_bytes);
      break;
  }
  return last_launch_error();
}

// One block a run: runs[3 r .. 3 r + 2] = (source address, destination address, bytes). 16-byte words
// where the run allows them (both addresses and the length multiples of 16), else single bytes.
__global__ void copy_runs_kernel(const int64_t* __restrict__ runs) {
  const int64_t* run = runs + 3 * static_cast<int64_t>(blockIdx.x);
  const char* src = reinterpret_cast<const char*>(run[0]);
  char* dst = reinterpret_cast<char*>(run[1]);
  const int64_t n = run[2];
  if (((static_cast<uint64_t>(run[0]) | static_cast<uint64_t>(run[1]) | static_cast<uint64_t>(n)) & 15) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t w = threadIdx.x; w < n / 16; w += blockDim.x) d[w] = s[w];
  } else {
    for (int64_t b = threadIdx.x; b < n; b += blockDim.x) dst[b] = src[b];
  }
}

}  // namespace

const char* copy_runs(uintptr_t runs, int64_t num_runs, uintptr_t stream) {
  if (num_runs < 0) return "copy_runs: negative num_runs";
  if (num_runs > INT32_MAX) return "copy_runs: more than 2^31-1 runs in one call";
  if (num_runs == 0) return nullptr;
  copy_runs_kernel<<<static_cast<unsigned>(num_runs), kThreads, 0, as_stream(stream)>>>(
      reinterpret_cast<const int64_t*>(runs));
  return last_launch_error();
}

const char* mapped_address(uintptr_t host, uintptr_t* device) {
  // Asked of the pointer's attributes, not of cudaHostGetDevicePointer: pageable memory is then a
  // plain answer (an unregistered type) rather than a failed call that sanitizers report.
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, reinterpret_cast<const void*>(host)) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it, so the next launch check does not report it
    return "cannot query the pointer's attributes";
  }
  if (ATOM_POINTER_TYPE(attributes) != cudaMemoryTypeHost || attributes.devicePointer == nullptr) {
    return "not pinned (page-locked), device-mapped host memory; allocate it with pin_memory=True";
  }
  *device = reinterpret_cast<uintptr_t>(attributes.devicePointer);
  return nullptr;
}

const char* gather_blocks(uintptr_t cache, int64_t block_stride, uintptr_t block_ids,
                          int64_t num_ids, uintptr_t staging, int64_t block_bytes,
                          uintptr_t stream) {
  return copy_blocks<true>(cache, block_stride, block_ids, num_ids, staging, block_bytes, stream);
}

const char* scatter_blocks(uintptr_t cache, int64_t block_stride, uintptr_t block_ids,
                           int64_t num_ids, uintptr_t staging, int64_t block_bytes,
                           uintptr_t stream) {
  return copy_blocks<false>(cache, block_stride, block_ids, num_ids, staging, block_bytes, stream);
}

}  // namespace atom
