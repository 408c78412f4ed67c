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

// runs: int64 device array [num_runs, 3] of (source address, destination address, bytes), device
// (or device-mapped) memory; the runs must not overlap one another's destinations.
const char* copy_runs(uintptr_t runs, int64_t num_runs, uintptr_t stream);

// The address at which kernels reach pinned (page-locked) host memory at `host`, into *device; an
// error for memory that is not pinned, mapped host memory. On every 64-bit system with unified
// addressing it equals `host`; asking keeps that assumption out of the callers.
const char* mapped_address(uintptr_t host, uintptr_t* device);

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
// norm_gate: 0, or KDA's output norm done in the kernel where kda_decode_fuses_norm says it can: out =
// gated_rmsnorm(o, gate, norm_weight, norm_eps) (csrc/norm.cu), bit for bit. gate: `dtype`, token row
// b * tokens + t at norm_gate_stride elements, its [heads, value_dim] contiguous; norm_weight [value_dim] `dtype`.
const char* kda_decode(uintptr_t q, int64_t q_sb, int64_t q_st, uintptr_t k, int64_t k_sb, int64_t k_st, uintptr_t v,
                       int64_t v_sb, int64_t v_st, uintptr_t g, uintptr_t beta, uintptr_t state,
                       int64_t slot_stride, uintptr_t state_slots, uintptr_t out_slots, bool per_token,
                       uintptr_t has_initial_state, uintptr_t out, int64_t batch, int64_t tokens, int64_t heads,
                       int64_t key_dim, int64_t value_dim, double scale, double eps, uintptr_t norm_gate,
                       int64_t norm_gate_stride, uintptr_t norm_weight, double norm_eps, int dtype,
                       uintptr_t stream);
// Whether kda_decode can take norm_gate for this state pool and shape (its fast kernel, value_dim 128).
bool kda_decode_fuses_norm(uintptr_t state, int64_t slot_stride, int64_t key_dim, int64_t value_dim);

// ---- kda_prefill.cu: KDA prefill (chunked form) over varlen packed sequences, state in the slot pool.
//
// Tokens of N sequences packed back to back: sequence n is tokens
// [cu_seqlens[n], cu_seqlens[n + 1]) (cu_seqlens: [N + 1] `cu_seqlens_dtype`
// kInt32 or kInt64 on the device). q, k: [T, heads, key_dim] and v:
// [T, heads, value_dim], `dtype`, token t at t * x_st elements with its
// [heads, dim] contiguous (views into one conv output need no copy); out
// [T, heads, value_dim] `dtype` contiguous. g [T, heads, key_dim] fp32
// log-decay and beta [T, heads] fp32, contiguous. q and k arrive raw, as for
// kda_decode (l2norm with eps inside the sqrt, q scaled by `scale`). state,
// slot_stride, has_initial_state as for kda_decode: sequence n reads slot
// state_slots[n] (int64) and writes its final state to out_slots[n] (may be
// the same array); state_slots[n] < 0: zero output, no state touched.
// workspace: kda_prefill_workspace_floats(T, N, heads) fp32 scratch.
// key_dim <= 128; any value_dim. `scan` picks the chunk scan: kScanFp32 (CUDA
// cores, fp32 throughout), kScanTf32 (tensor cores, tf32 operands, fp32
// accumulation and state; NVIDIA, compute capability >= 8.0), or kScanAuto
// (tf32 for bf16/fp16 inputs where it runs, else fp32).
enum KdaScan : int { kScanAuto = 0, kScanFp32 = 1, kScanTf32 = 2 };
const char* kda_prefill(uintptr_t q, int64_t q_st, uintptr_t k, int64_t k_st, uintptr_t v, int64_t v_st, uintptr_t g,
                        uintptr_t beta, uintptr_t cu_seqlens, int cu_seqlens_dtype, uintptr_t state,
                        int64_t slot_stride, uintptr_t state_slots, uintptr_t out_slots, uintptr_t has_initial_state,
                        uintptr_t out, uintptr_t workspace, int64_t total_tokens, int64_t num_seqs, int64_t heads,
                        int64_t key_dim, int64_t value_dim, double scale, double eps, int dtype, int scan,
                        uintptr_t stream);

// Chunks the scratch has room for (chunk i of sequence n is number cu_seqlens[n] / 16 + n + i).
int64_t kda_prefill_num_chunk_ids(int64_t total_tokens, int64_t num_seqs);
int64_t kda_prefill_workspace_floats(int64_t total_tokens, int64_t num_seqs, int64_t heads);

// ---- conv1d.cu: depthwise causal conv1d (width 2..5) + SiLU for decode.
//
// x: [batch, tokens, channels] `dtype`, its token rows (b * tokens + t) x_stride >= channels elements apart,
// each contiguous; out: the same shape, contiguous; weight [channels, width]; conv_state pool, slot s at
// conv_state + s * slot_stride elements, each [channels, width - 1] (oldest input first), `dtype`. Slots and
// has_initial_state as for kda_decode.
const char* conv1d_update(uintptr_t x, int64_t x_stride, uintptr_t conv_state, int64_t slot_stride,
                          uintptr_t weight, uintptr_t state_slots, uintptr_t out_slots, bool per_token,
                          uintptr_t has_initial_state, uintptr_t out, int64_t batch, int64_t tokens,
                          int64_t channels, int64_t width, int dtype, uintptr_t stream);

// conv1d_prefill: the same conv over packed sequences: sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1])
// of x (row stride x_stride elements) and out ([rows, channels] contiguous); cu_seqlens int64 [num_seqs + 1].
// Its inputs before row cu_seqlens[b] come from slot state_slots[b] (zeros where has_initial_state[b] == 0);
// its last width - 1 inputs become slot out_slots[b] (< 0: not written). state_slots[b] < 0: zero output.
const char* conv1d_prefill(uintptr_t x, int64_t x_stride, uintptr_t cu_seqlens, int64_t num_seqs, int64_t rows,
                           uintptr_t conv_state, int64_t slot_stride, uintptr_t weight, uintptr_t state_slots,
                           uintptr_t out_slots, uintptr_t has_initial_state, uintptr_t out, int64_t channels,
                           int64_t width, int dtype, uintptr_t stream);

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
// [batch, num_splits, heads], unless the kernel merges the splits itself
// (mla_decode_needs_workspace says which; 0 may then be passed). `kernel` (MlaKernel): kMlaAuto takes the
// tensor cores for bf16 with rank 512 / rope 64 (CUDA: kMlaWarpgroupCluster for 2-8 splits that fit on the GPU
// at once, else kMlaWarpgroup, where mla_decode_has_warpgroup_mma(); else kMlaTensorCores16Lean) and the
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
  kMlaWarpgroupCluster = 8,   // as 7, 2-8 splits of a sequence merged inside a thread-block cluster (more: as 7)
};
const char* mla_decode(uintptr_t q_latent, uintptr_t q_pe, uintptr_t cache, int64_t block_stride,
                       int64_t row_stride, int64_t block_size, uintptr_t block_tables, int64_t block_table_stride,
                       int block_table_dtype, uintptr_t seq_lens, int seq_lens_dtype, uintptr_t out,
                       uintptr_t o_part, uintptr_t lse_part, int64_t batch, int64_t heads, int64_t rank,
                       int64_t rope_dim, int64_t num_splits, double scale, int dtype, int out_dtype, int kernel,
                       uintptr_t stream);

// Whether mla_decode with these arguments (as passed to it) reads o_part / lse_part: num_splits > 1 and
// the kernel it runs (kMlaAuto resolved) does not merge the splits inside a thread-block cluster.
bool mla_decode_needs_workspace(uintptr_t q_latent, uintptr_t q_pe, uintptr_t cache, int64_t block_stride,
                                int64_t row_stride, int64_t batch, int64_t heads, int64_t rank, int64_t rope_dim,
                                int64_t num_splits, int dtype, int kernel);

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

// ---- paged_attention.cu: GQA decode attention of dense models over paged K and V caches.
//
// q [rows, heads, head_dim] contiguous, one query token a row; K and V caches [num_blocks, block_size,
// kv_heads, head_dim] at the given element strides (the same for both; head_dim contiguous); row t reads
// its first seq_lens[t] positions through block_tables row t (int32/int64, row stride in elements). out
// [rows, heads, head_dim] in out_dtype (float32 or the cache's dtype); num_splits > 1 needs o_part [rows,
// splits, heads, head_dim] and lse_part [rows, splits, heads] (float32). A row of length 0 gives zeros.
// A row takes only as many of the num_splits as give each split_min_tiles tiles of 32 positions (at least one).
// stages: how many tiles of K and V the kernel's shared-memory ring holds (1..3; 0: two up to head_dim 128, else
// one, or one where two do not fit).
const char* paged_decode_attention(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, int64_t block_stride,
                                   int64_t token_stride, int64_t head_stride, int64_t block_size,
                                   uintptr_t block_tables, int64_t block_table_stride, int block_table_dtype,
                                   uintptr_t seq_lens, int seq_lens_dtype, uintptr_t out, uintptr_t o_part,
                                   uintptr_t lse_part, int64_t rows, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, int64_t num_splits, int64_t split_min_tiles, int64_t stages,
                                   double scale, int dtype, int out_dtype, uintptr_t stream);

// How many blocks of paged_decode_attention's kernel one SM of the current GPU runs at once, for blocks of
// heads_per_block (1..8) query heads of head_dim in dtype; 0 for sizes it does not take. Sizes its splits.
int paged_decode_blocks_per_sm(int64_t head_dim, int64_t heads_per_block, int dtype);

// paged_prefill_attention: causal attention of prefill chunks over the same caches (tensor cores; see
// paged_prefill_supported). q [tokens, heads, head_dim] and out [tokens, heads, v_head_dim] contiguous; K rows of
// head_dim and V rows of v_head_dim at the same offsets from k_cache and v_cache, each V row readable for head_dim
// elements (MLA's expanded form lays a row out as [v | k_nope | k_rope], v_cache at v, k_cache at k_nope). work
// [num_work, 4] int32 items (block-table row, first token row, queries <= queries_per_item, first query's
// position): query i of an item is token row + i and attends positions 0 .. position + i of its sequence.
// queries_per_item * (heads / kv_heads) <= 64. Rows no item names are left alone.
const char* paged_prefill_attention(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, int64_t block_stride,
                                    int64_t token_stride, int64_t head_stride, int64_t block_size,
                                    uintptr_t block_tables, int64_t block_table_stride, int block_table_dtype,
                                    uintptr_t work, int64_t num_work, int64_t queries_per_item, uintptr_t out,
                                    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t v_head_dim,
                                    double scale, int dtype, uintptr_t stream);

// Whether this build's paged_prefill_attention takes these sizes and dtype: bf16/fp16 q/k and v rows of 64/64,
// 128/128 (dense models) or 192/128 (MLA's expanded form), on NVIDIA.
bool paged_prefill_supported(int64_t head_dim, int64_t v_head_dim, int dtype);

// rotary_write_kv: neox rotary embedding of q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] (rows
// at the given strides, heads contiguous within a row) by positions [tokens] (int32/int64) and inv_freq
// [head_dim / 2] (float32); the rotated q to q_out [tokens, heads, head_dim] contiguous, the rotated k and v
// [tokens, kv_heads, head_dim] into the caches at slot_mapping (negative: not written). Rounds as the torch
// reference does (atom/ops/rotary.py).
const char* rotary_write_kv(uintptr_t q, int64_t q_stride, uintptr_t k, int64_t k_stride, uintptr_t v,
                            int64_t v_stride, uintptr_t positions, int positions_dtype, uintptr_t inv_freq,
                            uintptr_t q_out, uintptr_t k_cache, uintptr_t v_cache, int64_t block_stride,
                            int64_t token_stride, int64_t head_stride, int64_t block_size, uintptr_t slot_mapping,
                            int slot_dtype, int64_t num_tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int dtype, uintptr_t stream);

// ---- fused.cu: small fused ops of the decode step (each replaces a chain of
// torch kernels and rounds where its reference does; atom/ops/cuda/fused.py).
//
// rms_norm: out = weight * round(x * rsqrt(mean(x^2) + eps)); x, out [rows,
// dim] at row strides (elements), weight [dim], all `dtype`. With a residual
// (0: none), x is first sum = round(x + residual), written to sum [rows, dim].
const char* rms_norm(uintptr_t x, int64_t x_stride, uintptr_t residual, int64_t residual_stride, uintptr_t sum,
                     int64_t sum_stride, uintptr_t weight, uintptr_t out, int64_t out_stride, int64_t rows, int64_t dim,
                     double eps, int dtype, uintptr_t stream);

// silu_mul: x [rows, 2 * width] = gate | up at row stride x_stride; out
// [rows, width] = round(silu(gate)) * up at out_stride; `dtype`.
const char* silu_mul(uintptr_t x, int64_t x_stride, uintptr_t out, int64_t out_stride, int64_t rows, int64_t width,
                     int dtype, uintptr_t stream);

// kda_gate: f [tokens, heads * head_dim] and b [tokens, heads] (`dtype`, row
// strides), dt_bias fp32 [heads * head_dim], a_log `dtype` [heads]. Writes fp32
// g [tokens, heads * head_dim] = -exp(a_log[h]) * softplus(f + dt_bias)
// (softplus(x) = x above 20) and fp32 beta [tokens, heads] = round(sigmoid(b)).
const char* kda_gate(uintptr_t f, int64_t f_stride, uintptr_t dt_bias, uintptr_t a_log, uintptr_t b, int64_t b_stride,
                     uintptr_t g, uintptr_t beta, int64_t tokens, int64_t heads, int64_t head_dim, int dtype,
                     uintptr_t stream);

// kda_gate_proj: kda_gate with its two up-projections, at decode sizes. f_a and g_a [tokens, dim] at row
// stride x_stride, b [tokens, heads] at b_stride, w_f and w_g [channels, dim] (all `dtype`, weights
// contiguous), dt_bias fp32 [channels], a_log `dtype` [heads]. Writes kda_gate's fp32 g [tokens, channels]
// and beta [tokens, heads] from f = round(f_a w_f^T), and gate [tokens, channels] = round(g_a w_g^T).
const char* kda_gate_proj(uintptr_t f_a, uintptr_t g_a, int64_t x_stride, uintptr_t b, int64_t b_stride,
                          int64_t tokens, uintptr_t w_f, uintptr_t w_g, int64_t channels, int64_t dim,
                          uintptr_t dt_bias, uintptr_t a_log, int64_t heads, uintptr_t g, uintptr_t beta,
                          uintptr_t gate, int dtype, uintptr_t stream);

// router_logits: logits fp32 [tokens, experts] = x [tokens, dim] (row stride,
// `dtype`) times weight fp32 [experts, dim]^T, summed in fp32.
const char* router_logits(uintptr_t x, int64_t x_stride, uintptr_t weight, uintptr_t logits, int64_t tokens,
                          int64_t experts, int64_t dim, int dtype, uintptr_t stream);

// moe_route: fp32 router logits [tokens, experts] (row stride), optional fp32
// correction bias [experts] (0 = none). Scores sigmoid(logits); the top_k
// experts by score + bias (ties: lower id), in that order, to ids int64
// [tokens, top_k]; their scores, renormalised to sum 1 if asked, times
// scale, to weights fp32 [tokens, top_k]. At most 256 experts, top_k <= 32.
const char* moe_route(uintptr_t logits, int64_t logits_stride, uintptr_t bias, int64_t tokens, int64_t experts,
                      int64_t top_k, bool renormalize, double scale, uintptr_t ids, uintptr_t weights,
                      uintptr_t stream);

// moe_align: ids int64 [pairs] (= [tokens, top_k] flattened, each in [0,
// experts)). Groups the pairs by expert, in pair order within an expert:
// pos int64 [pairs] = each pair's row in the grouped order, src_token int64
// [pairs] = the token of each grouped row, ends int32 [experts] = where each
// expert's rows end (cumulative counts). At most 1024 experts. workspace:
// moe_align_workspace_ints(pairs, experts) int32 of scratch (0: none needed).
const char* moe_align(uintptr_t ids, int64_t pairs, int64_t experts, int64_t top_k, uintptr_t src_token, uintptr_t pos,
                      uintptr_t ends, uintptr_t workspace, uintptr_t stream);
int64_t moe_align_workspace_ints(int64_t pairs, int64_t experts);

// advance_decode: multi-step decoding's per-step update of the decode buffers.
// rows int64 [7, row_stride]: input_ids | positions | slot_mapping |
// state_slots | state_out_slots | has_initial_state | seq_lens; tables int64
// [n, table_stride] block tables; next_ids int64 [n]. For each column c < n:
// input_ids = next_ids, positions and seq_lens + 1, has_initial_state = 1,
// state_slots = state_out_slots, slot_mapping = the new position's cache slot.
const char* advance_decode(uintptr_t rows, int64_t row_stride, uintptr_t tables, int64_t table_stride,
                           uintptr_t next_ids, int64_t n, int64_t block_size, uintptr_t stream);

// pack_verification: speculation with overlap; a verification step's outcome in
// one int64 tensor out [n * (width + 1) + k * n] = targets [n, width] | accepted
// [n] | drafts [k, n]. rows: the step's decode buffers (as advance_decode's,
// row r's tokens in columns r * width ..); targets int64 [n * width] (the argmax,
// or a sampled row's targets); drafts int64 [k, drafts_stride] (columns < n).
// A row's accepted count: the leading run of its drafts (its columns past the
// first with seq_len > 0) equal to the targets of the columns before them.
const char* pack_verification(uintptr_t rows, int64_t row_stride, uintptr_t targets, uintptr_t drafts,
                              int64_t drafts_stride, int64_t n, int64_t width, int64_t k, uintptr_t out,
                              uintptr_t stream);

// settle_verification: m verification rows of width tokens, written into the
// decode buffers as if the step before (packed by pack_verification, n_prev
// rows) had accepted every draft, made right from its outcome. index int64
// [3 * m]: this step's row, its row in the step before, the drafts planned
// for it there. Token j of the row: input the step before's last emitted token
// (j = 0) or its (j-1)-th next draft; positions, seq_lens and slot_mapping moved
// back by the drafts rejected (planned - accepted), and so is its state slot.
const char* settle_verification(uintptr_t rows, int64_t row_stride, uintptr_t tables, int64_t table_stride,
                                uintptr_t index, int64_t m, uintptr_t packed, int64_t n_prev, int64_t width,
                                int64_t block_size, uintptr_t stream);

// accept_drafts: speculative verification of n rows of at most k drafts. Row
// r's draft j (j < num_drafts[r], proposed int64 [n, proposed_stride]) checks
// logits row at[r, j] (at int64 [n, k + 1]; at[r, a] for a = the accepted
// count is the row whose token comes next): it holds if tokens[row] equals it
// (probs == 0: greedy), else if exp(-draws[row * draws_stride]) < probs[row]
// (fp32 probabilities of each row's draft, and each row's last Exp(1) draw).
// out int64 [2n + n (k + 1)]: accepted [n] | final [n] | targets [n, k + 1]
// (the accepted drafts, then final repeated).
const char* accept_drafts(uintptr_t tokens, uintptr_t probs, uintptr_t draws, int64_t draws_stride, uintptr_t at,
                          uintptr_t proposed, int64_t proposed_stride, uintptr_t num_drafts, int64_t n, int64_t k,
                          uintptr_t out, uintptr_t stream);


// moe_combine: out [tokens, dim] = round(sum_j weights[t, j] * y[pos[t * top_k
// + j]]) summed in fp32 in pick order, plus addend [tokens, dim] (0 = none)
// rounded as a separate add; y [pairs, dim], out and addend `dtype`,
// contiguous; weights fp32 [tokens, top_k]. With pick_stride > 0, pos holds
// expert ids and the row of pick j of token t is pos[t * top_k + j] *
// pick_stride + t (y expert-major: every expert's output on every token).
const char* moe_combine(uintptr_t y, uintptr_t pos, uintptr_t weights, uintptr_t addend, uintptr_t out, int64_t tokens,
                        int64_t top_k, int64_t dim, int64_t pick_stride, int dtype, uintptr_t stream);

// ---- moe_gemv.cu: routed experts at decode batch sizes, over the picked experts' weights only.
//
// moe_gemv_up: x [tokens, dim] (row stride x_stride), ids int64 [tokens,
// top_k], w [experts, 2 * inter, dim] (gate rows, then up rows; expert e at
// w + e * expert_stride elements, rows contiguous). Writes act [tokens *
// top_k, inter] (contiguous) = round(silu(round(x . gate))) * round(x . up)
// for each (token, pick) pair, the grouped path's gate_up matmul and silu_mul.
// With shared_w [2 * shared_inter, dim] (0: none), also the shared expert's
// activation of every token, [tokens, shared_inter] right after the pairs'.
const char* moe_gemv_up(uintptr_t x, int64_t x_stride, uintptr_t ids, int64_t tokens, int64_t top_k, uintptr_t w,
                        int64_t expert_stride, int64_t inter, uintptr_t shared_w, int64_t shared_inter, uintptr_t act,
                        int64_t dim, int dtype, uintptr_t stream);

// moe_gemv_down: act [tokens * top_k, inter] from moe_gemv_up, ids int64 and
// weights fp32 [tokens, top_k], w [experts, dim, inter] (expert e at w + e *
// expert_stride). Writes out [tokens, dim] = round(sum_j weights[t, j] *
// round(act[t * top_k + j] . w[ids[t, j]])), summed in fp32 in pick order,
// plus an addend rounded as a separate add: addend [tokens, dim] (0 = none),
// or, with shared_w [dim, shared_inter], the shared expert's output
// round(shared_act[t] . shared_w) from its activations shared_act [tokens,
// shared_inter]. All contiguous, `dtype` but ids and weights.
const char* moe_gemv_down(uintptr_t act, uintptr_t ids, uintptr_t weights, int64_t tokens, int64_t top_k, uintptr_t w,
                          int64_t expert_stride, int64_t inter, uintptr_t shared_act, uintptr_t shared_w,
                          int64_t shared_inter, uintptr_t addend, uintptr_t out, int64_t dim, int dtype,
                          uintptr_t stream);

// ---- sampling.cu: one token per logits row (temperature, top-k, top-p, min-p, exponential race).
//
// logits and draws fp32 [rows, vocab] (row strides given, last dim
// contiguous); draws are Exp(1) variates, one per token. temperature, top_p,
// min_p fp32 [rows] and top_k int64 [rows], as in SamplingBatch (top_k 0 or
// -1 off, top_p 1 off, min_p 0 off; temperature 0 or top_k 1: argmax of the
// logits). Writes out int64 [rows]. drafts int64 [rows] (-1: none) and
// draft_probs fp32 [rows], both or neither (0): each row's draft is left out
// of the race, and its probability written to draft_probs.
const char* sample_tokens(uintptr_t logits, int64_t logits_stride, uintptr_t draws, int64_t draws_stride,
                          uintptr_t temperature, uintptr_t top_p, uintptr_t top_k, uintptr_t min_p, uintptr_t out,
                          uintptr_t drafts, uintptr_t draft_probs, int64_t rows, int64_t vocab, uintptr_t stream);

// Keyed Exp(1) draws for seeded requests (atom.ops.sampling.keyed_draws_ref): for j < n, row rows[j] of draws
// (fp32, row stride given, width columns contiguous) gets the draws of the key of seeds[j] and counters[j] (host
// arrays, passed to the kernel by value, kMaxKeyedRows a launch). Other rows untouched.
constexpr int kMaxKeyedRows = 128;
const char* keyed_draws(uintptr_t draws, int64_t stride, int64_t width, const int64_t* rows, const uint64_t* seeds,
                        const uint64_t* counters, int64_t n, uintptr_t stream);

// ---- launch.cu: programmatic dependent launch of the kernels (portability.h's launch_kernel), on by
// default on sm_90+ unless ATOM_PDL=0. Turning it on elsewhere leaves it off. Kernels already captured in a
// CUDA graph keep the setting they were captured with.
void set_programmatic_launch(bool on);
bool programmatic_launch();

// ---- gemv.cu: dense linears at decode batch sizes.
//
// gemv: x [tokens, dim] (row stride x_stride, rows contiguous), w [rows, dim]
// contiguous, bias [rows] (0: none). Writes out [tokens, rows] (row stride
// out_stride) = round(x . w^T + bias), each dot product summed in fp32 and
// rounded once. All `dtype`. k_split: warps that split a row's dot product
// (1, 2, 4 or 8; 0 picks one from the shape and the GPU's SM count).
const char* gemv(uintptr_t x, int64_t x_stride, int64_t tokens, uintptr_t w, int64_t rows, int64_t dim, uintptr_t bias,
                 uintptr_t out, int64_t out_stride, int64_t k_split, int dtype, uintptr_t stream);

}  // namespace atom
