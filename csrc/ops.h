// Host-side launchers of every kernel in csrc/, one section per op family
// (one .cu file each). Plain C++ with no CUDA/HIP types, so bindings.cpp
// compiles with the host compiler alone.
//
// Conventions: pointers are device addresses as integers (torch's
// `tensor.data_ptr()`), sizes are in bytes unless named otherwise, `stream`
// is the raw cudaStream_t/hipStream_t (`torch.cuda.current_stream().cuda_stream`).
// Each launcher returns nullptr on success or the runtime's error message.
// Launchers do not change the current device: the caller sets it.
#pragma once

#include <cstdint>

namespace atom {

// ---- cache_ops.cu: moving whole cache blocks to and from a staging buffer.
//
// cache:   block b lives at cache + b * block_stride, block_bytes long.
// staging: contiguous [num_ids, block_bytes].
// block_ids: int64 device array of num_ids cache block indices, each in
//   [0, num_blocks) (not checked on the device). For scatter they must be
//   distinct, or the surviving copy is unspecified.
const char* gather_blocks(uintptr_t cache, int64_t block_stride, uintptr_t block_ids,
                          int64_t num_ids, uintptr_t staging, int64_t block_bytes,
                          uintptr_t stream);

const char* scatter_blocks(uintptr_t cache, int64_t block_stride, uintptr_t block_ids,
                           int64_t num_ids, uintptr_t staging, int64_t block_bytes,
                           uintptr_t stream);

}  // namespace atom
