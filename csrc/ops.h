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

// Element types of the tensors a launcher is given, as plain int codes
// (atom/ops/cuda/_launch.py maps torch dtypes to these).
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt32 = 3, kInt64 = 4 };

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

// ---- kda.cu: KDA decode step over the slot-indexed recurrent state, in place.
//
// q, k: [batch, tokens, heads, key_dim] and v, out: [batch, tokens, heads,
// value_dim], all `dtype`. q, k, v: token (b, t) at b * x_sb + t * x_st
// elements, its [heads, dim] contiguous (so the q | k | v thirds of one conv
// output need no copy); out contiguous. g: [batch, tokens, heads, key_dim]
// fp32 log-decay, contiguous;
// beta: [batch, tokens, heads] fp32. q and k arrive raw: the kernel
// l2-normalises both (x / sqrt(sum x^2 + eps)) and scales q by `scale`.
// state: fp32 pool, slot s at state + s * slot_stride floats, each [heads,
// key_dim, value_dim] contiguous. state_slots, out_slots: int64 [batch]
// (AttentionMetadata.state_slots / state_out_slots; may be the same array):
// read state_slots[b], write the state after the last token to out_slots[b]
// or, per_token, the state after token t to out_slots[b] + t. A sequence's
// reads precede its writes (out may alias its own in slot); slots of
// different sequences must not overlap. state_slots[b] < 0: padding row, out
// zero, no state touched (then out_slots[b] is not read; otherwise >= 0).
// has_initial_state: 0, or a uint8 [batch] device array; 0 entries start
// from a zero state instead of reading the slot.
const char* kda_decode(uintptr_t q, int64_t q_sb, int64_t q_st, uintptr_t k, int64_t k_sb, int64_t k_st, uintptr_t v,
                       int64_t v_sb, int64_t v_st, uintptr_t g, uintptr_t beta, uintptr_t state,
                       int64_t slot_stride, uintptr_t state_slots, uintptr_t out_slots, bool per_token,
                       uintptr_t has_initial_state, uintptr_t out, int64_t batch, int64_t tokens, int64_t heads, int64_t key_dim,
                       int64_t value_dim, double scale, double eps, int dtype, uintptr_t stream);

// ---- conv1d.cu: depthwise causal conv1d (width 2..5) + SiLU for decode.
//
// x, out: [batch, tokens, channels] `dtype` contiguous; weight [channels,
// width]; conv_state pool, slot s at conv_state + s * slot_stride elements,
// each [channels, width - 1] (oldest input first), `dtype`. Slots and
// has_initial_state as for kda_decode.
const char* conv1d_update(uintptr_t x, uintptr_t conv_state, int64_t slot_stride, uintptr_t weight,
                          uintptr_t state_slots, uintptr_t out_slots, bool per_token, uintptr_t has_initial_state,
                          uintptr_t out,
                          int64_t batch, int64_t tokens, int64_t channels, int64_t width, int dtype,
                          uintptr_t stream);

// ---- norm.cu: out = weight * rmsnorm(x) * sigmoid(gate), fp32 inside.
//
// x, gate, out: [rows, dim] with row strides in elements (last dim
// contiguous); weight [dim]; all `dtype`.
const char* gated_rmsnorm(uintptr_t x, int64_t x_stride, uintptr_t gate, int64_t gate_stride, uintptr_t weight,
                          uintptr_t out, int64_t out_stride, int64_t rows, int64_t dim, double eps, int dtype,
                          uintptr_t stream);

// ---- mla.cu: MLA decode attention over the paged latent cache (absorbed form).
//
// q_latent [batch, heads, rank] and q_pe [batch, heads, rope_dim], `dtype`,
// contiguous. cache (`dtype`): row i of block n at cache + n * block_stride +
// i * row_stride elements, [latent (rank) | k_rot (rope_dim)]. block_tables:
// [batch, *] at row stride block_table_stride; seq_lens [batch]: int32 or
// int64 (kInt32 / kInt64). out [batch, heads, rank] `out_dtype`.
// num_splits > 1 splits each sequence's positions over that many blocks and
// needs fp32 workspaces o_part [batch, num_splits, heads, rank] and lse_part
// [batch, num_splits, heads]. `kernel` (MlaKernel): kMlaAuto takes the
// tensor cores for bf16 with rank 512 / rope 64 (CUDA: kMlaWarpgroup where
// mla_decode_has_warpgroup_mma(), else kMlaTensorCores16Lean) and the
// CUDA-core kernel otherwise; the other values force one (benchmarks, tests).
enum MlaKernel : int {
  kMlaAuto = 0,
  kMlaCudaCores = 1,
  kMlaTensorCores8 = 2,       // 8 warps (csrc/mla_mma.cuh)
  kMlaTensorCores16 = 3,      // 16 warps
  kMlaTensorCores8Lean = 4,   // 8 warps, grouped softmax, 3 barriers per tile
  kMlaTensorCores16Lean = 5,  // 16 warps, grouped softmax, 3 barriers per tile
  kMlaTensorCores16Bulk = 6,  // as 5, rows moved by sm_90 bulk copies (cp.async.bulk + mbarrier)
  kMlaWarpgroup = 7,          // sm_90a warpgroup MMAs, operands from shared memory (csrc/mla_wgmma.cuh)
};
const char* mla_decode(uintptr_t q_latent, uintptr_t q_pe, uintptr_t cache, int64_t block_stride,
                       int64_t row_stride, int64_t block_size, uintptr_t block_tables, int64_t block_table_stride,
                       int block_table_dtype, uintptr_t seq_lens, int seq_lens_dtype, uintptr_t out,
                       uintptr_t o_part, uintptr_t lse_part, int64_t batch, int64_t heads, int64_t rank,
                       int64_t rope_dim, int64_t num_splits, double scale, int dtype, int out_dtype, int kernel,
                       uintptr_t stream);

// Whether this build has mla_decode's tensor-core kernel (CUDA, not HIP).
bool mla_decode_has_tensor_cores();

// Whether kMlaWarpgroup runs here: an sm_90a build on a compute capability 9.0 GPU.
bool mla_decode_has_warpgroup_mma();

// ---- latent_cache.cu: cache row of token t = [latent[t] | rope[t]] at slot_mapping[t].
//
// Layout as for mla_decode; latent / rope rows at their row strides
// (elements); slot_mapping int32/int64 [num_tokens], negative = skip.
const char* write_latent_cache(uintptr_t cache, int64_t block_stride, int64_t row_stride, int64_t block_size,
                               uintptr_t latent, int64_t latent_stride, uintptr_t rope, int64_t rope_stride,
                               uintptr_t slot_mapping, int slot_dtype, int64_t num_tokens, int64_t rank,
                               int64_t rope_dim, int dtype, uintptr_t stream);

}  // namespace atom
