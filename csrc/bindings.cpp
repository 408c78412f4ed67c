// The `atom._C` module. Every function takes device addresses as integers,
// sizes and a raw stream handle, so this module never links against torch's
// C++ ABI; atom/ops/*.py derives those arguments from tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops.h"

namespace py = pybind11;

namespace {

void check(const char* error) {
  if (error != nullptr) throw std::runtime_error(error);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ATOM's compiled CUDA/HIP kernels (raw-pointer bindings)";
#ifdef ATOM_BACKEND_HIP
  m.attr("backend") = "hip";
#else
  m.attr("backend") = "cuda";
#endif

  m.def(
      "gather_blocks",
      [](uintptr_t cache, int64_t block_stride, uintptr_t block_ids, int64_t num_ids,
         uintptr_t staging, int64_t block_bytes, uintptr_t stream) {
        check(atom::gather_blocks(cache, block_stride, block_ids, num_ids, staging, block_bytes,
                                  stream));
      },
      "staging[i] = cache block block_ids[i], for i < num_ids", py::arg("cache"),
      py::arg("block_stride"), py::arg("block_ids"), py::arg("num_ids"), py::arg("staging"),
      py::arg("block_bytes"), py::arg("stream"));

  m.def(
      "scatter_blocks",
      [](uintptr_t cache, int64_t block_stride, uintptr_t block_ids, int64_t num_ids,
         uintptr_t staging, int64_t block_bytes, uintptr_t stream) {
        check(atom::scatter_blocks(cache, block_stride, block_ids, num_ids, staging, block_bytes,
                                   stream));
      },
      "cache block block_ids[i] = staging[i], for i < num_ids", py::arg("cache"),
      py::arg("block_stride"), py::arg("block_ids"), py::arg("num_ids"), py::arg("staging"),
      py::arg("block_bytes"), py::arg("stream"));

  m.def(
      "copy_runs",
      [](uintptr_t runs, int64_t num_runs, uintptr_t stream) { check(atom::copy_runs(runs, num_runs, stream)); },
      "copies runs[r] = (src, dst, bytes) for r < num_runs, one launch", py::arg("runs"), py::arg("num_runs"),
      py::arg("stream"));

  m.def(
      "mapped_address",
      [](uintptr_t host) {
        uintptr_t device = 0;
        const char* error = atom::mapped_address(host, &device);
        if (error != nullptr) throw std::runtime_error(std::string("mapped_address: ") + error);
        return device;
      },
      "the device address of pinned, mapped host memory at `host`", py::arg("host"));

  m.def(
      "kda_decode",
      [](uintptr_t q, int64_t q_sb, int64_t q_st, uintptr_t k, int64_t k_sb, int64_t k_st, uintptr_t v, int64_t v_sb,
         int64_t v_st, uintptr_t g, uintptr_t beta, uintptr_t state, int64_t slot_stride, uintptr_t state_slots,
         uintptr_t out_slots, bool per_token, uintptr_t has_initial_state, uintptr_t out, int64_t batch,
         int64_t tokens, int64_t heads, int64_t key_dim, int64_t value_dim, double scale, double eps,
         uintptr_t norm_gate, int64_t norm_gate_stride, uintptr_t norm_weight, double norm_eps, int dtype,
         uintptr_t stream) {
        check(atom::kda_decode(q, q_sb, q_st, k, k_sb, k_st, v, v_sb, v_st, g, beta, state, slot_stride, state_slots,
                               out_slots, per_token, has_initial_state, out, batch, tokens, heads, key_dim,
                               value_dim, scale, eps, norm_gate, norm_gate_stride, norm_weight, norm_eps, dtype,
                               stream));
      },
      "KDA decode step over the slot-indexed fp32 state, in place (see csrc/ops.h)", py::arg("q"), py::arg("q_sb"),
      py::arg("q_st"), py::arg("k"), py::arg("k_sb"), py::arg("k_st"), py::arg("v"), py::arg("v_sb"), py::arg("v_st"),
      py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("slot_stride"), py::arg("state_slots"),
      py::arg("out_slots"), py::arg("per_token"), py::arg("has_initial_state"), py::arg("out"), py::arg("batch"),
      py::arg("tokens"), py::arg("heads"), py::arg("key_dim"), py::arg("value_dim"), py::arg("scale"), py::arg("eps"),
      py::arg("norm_gate"), py::arg("norm_gate_stride"), py::arg("norm_weight"), py::arg("norm_eps"),
      py::arg("dtype"), py::arg("stream"));
  m.def("kda_decode_fuses_norm", &atom::kda_decode_fuses_norm,
        "whether kda_decode can fuse KDA's output norm for this state pool and shape", py::arg("state"),
        py::arg("slot_stride"), py::arg("key_dim"), py::arg("value_dim"));

  m.def(
      "kda_prefill",
      [](uintptr_t q, int64_t q_st, uintptr_t k, int64_t k_st, uintptr_t v, int64_t v_st, uintptr_t g, uintptr_t beta,
         uintptr_t cu_seqlens, int cu_seqlens_dtype, uintptr_t state, int64_t slot_stride, uintptr_t state_slots,
         uintptr_t out_slots, uintptr_t has_initial_state, uintptr_t out, uintptr_t workspace, int64_t total_tokens,
         int64_t num_seqs, int64_t heads, int64_t key_dim, int64_t value_dim, double scale, double eps, int dtype,
         int scan, uintptr_t stream) {
        check(atom::kda_prefill(q, q_st, k, k_st, v, v_st, g, beta, cu_seqlens, cu_seqlens_dtype, state, slot_stride,
                                state_slots, out_slots, has_initial_state, out, workspace, total_tokens, num_seqs,
                                heads, key_dim, value_dim, scale, eps, dtype, scan, stream));
      },
      "KDA prefill (chunked) over varlen packed sequences, state in the fp32 slot pool (see csrc/ops.h)",
      py::arg("q"), py::arg("q_st"), py::arg("k"), py::arg("k_st"), py::arg("v"), py::arg("v_st"), py::arg("g"),
      py::arg("beta"), py::arg("cu_seqlens"), py::arg("cu_seqlens_dtype"), py::arg("state"), py::arg("slot_stride"),
      py::arg("state_slots"), py::arg("out_slots"), py::arg("has_initial_state"), py::arg("out"),
      py::arg("workspace"), py::arg("total_tokens"), py::arg("num_seqs"), py::arg("heads"), py::arg("key_dim"),
      py::arg("value_dim"), py::arg("scale"), py::arg("eps"), py::arg("dtype"), py::arg("scan"), py::arg("stream"));

  m.def("kda_prefill_workspace_floats", &atom::kda_prefill_workspace_floats,
        "fp32 elements of kda_prefill's workspace for (total_tokens, num_seqs, heads)", py::arg("total_tokens"),
        py::arg("num_seqs"), py::arg("heads"));

  m.def(
      "conv1d_update",
      [](uintptr_t x, int64_t x_stride, uintptr_t conv_state, int64_t slot_stride, uintptr_t weight,
         uintptr_t state_slots, uintptr_t out_slots, bool per_token, uintptr_t has_initial_state, uintptr_t out,
         int64_t batch, int64_t tokens, int64_t channels, int64_t width, int dtype, uintptr_t stream) {
        check(atom::conv1d_update(x, x_stride, conv_state, slot_stride, weight, state_slots, out_slots, per_token,
                                  has_initial_state, out, batch, tokens, channels, width, dtype, stream));
      },
      "depthwise causal conv1d + SiLU decode update over the slot-indexed conv state", py::arg("x"),
      py::arg("x_stride"), py::arg("conv_state"), py::arg("slot_stride"), py::arg("weight"), py::arg("state_slots"),
      py::arg("out_slots"), py::arg("per_token"), py::arg("has_initial_state"), py::arg("out"), py::arg("batch"),
      py::arg("tokens"), py::arg("channels"), py::arg("width"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "conv1d_prefill",
      [](uintptr_t x, int64_t x_stride, uintptr_t cu_seqlens, int64_t num_seqs, int64_t rows, uintptr_t conv_state,
         int64_t slot_stride, uintptr_t weight, uintptr_t state_slots, uintptr_t out_slots,
         uintptr_t has_initial_state, uintptr_t out, int64_t channels, int64_t width, int dtype, uintptr_t stream) {
        check(atom::conv1d_prefill(x, x_stride, cu_seqlens, num_seqs, rows, conv_state, slot_stride, weight,
                                   state_slots, out_slots, has_initial_state, out, channels, width, dtype, stream));
      },
      "depthwise causal conv1d + SiLU over packed prefill sequences and the slot-indexed conv state", py::arg("x"),
      py::arg("x_stride"), py::arg("cu_seqlens"), py::arg("num_seqs"), py::arg("rows"), py::arg("conv_state"),
      py::arg("slot_stride"), py::arg("weight"), py::arg("state_slots"), py::arg("out_slots"),
      py::arg("has_initial_state"), py::arg("out"), py::arg("channels"), py::arg("width"), py::arg("dtype"),
      py::arg("stream"));

  m.def(
      "gated_rmsnorm",
      [](uintptr_t x, int64_t x_stride, uintptr_t gate, int64_t gate_stride, uintptr_t weight, uintptr_t out,
         int64_t out_stride, int64_t rows, int64_t dim, double eps, int dtype, uintptr_t stream) {
        check(atom::gated_rmsnorm(x, x_stride, gate, gate_stride, weight, out, out_stride, rows, dim, eps, dtype,
                                  stream));
      },
      "out = weight * rmsnorm(x) * sigmoid(gate), fp32 inside", py::arg("x"), py::arg("x_stride"), py::arg("gate"),
      py::arg("gate_stride"), py::arg("weight"), py::arg("out"), py::arg("out_stride"), py::arg("rows"),
      py::arg("dim"), py::arg("eps"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "mla_decode",
      [](uintptr_t q_latent, uintptr_t q_pe, uintptr_t cache, int64_t block_stride, int64_t row_stride,
         int64_t block_size, uintptr_t block_tables, int64_t block_table_stride, int block_table_dtype,
         uintptr_t seq_lens, int seq_lens_dtype, uintptr_t out, uintptr_t o_part, uintptr_t lse_part,
         int64_t batch, int64_t heads, int64_t rank, int64_t rope_dim, int64_t num_splits, double scale,
         int dtype, int out_dtype, int kernel, uintptr_t stream) {
        check(atom::mla_decode(q_latent, q_pe, cache, block_stride, row_stride, block_size, block_tables,
                               block_table_stride, block_table_dtype, seq_lens, seq_lens_dtype, out, o_part,
                               lse_part, batch, heads, rank, rope_dim, num_splits, scale, dtype, out_dtype,
                               kernel, stream));
      },
      "MLA decode attention over the paged latent cache (absorbed form)", py::arg("q_latent"), py::arg("q_pe"),
      py::arg("cache"), py::arg("block_stride"), py::arg("row_stride"), py::arg("block_size"),
      py::arg("block_tables"), py::arg("block_table_stride"), py::arg("block_table_dtype"), py::arg("seq_lens"),
      py::arg("seq_lens_dtype"), py::arg("out"), py::arg("o_part"), py::arg("lse_part"), py::arg("batch"),
      py::arg("heads"), py::arg("rank"), py::arg("rope_dim"), py::arg("num_splits"), py::arg("scale"),
      py::arg("dtype"), py::arg("out_dtype"), py::arg("kernel"), py::arg("stream"));

  m.def("mla_decode_needs_workspace", &atom::mla_decode_needs_workspace,
        "whether mla_decode with these arguments reads o_part / lse_part (no cluster merge)", py::arg("q_latent"),
        py::arg("q_pe"), py::arg("cache"), py::arg("block_stride"), py::arg("row_stride"), py::arg("batch"),
        py::arg("heads"), py::arg("rank"), py::arg("rope_dim"), py::arg("num_splits"), py::arg("dtype"),
        py::arg("kernel"));
  m.def("mla_decode_has_tensor_cores", &atom::mla_decode_has_tensor_cores,
        "whether mla_decode has its tensor-core kernel in this build");
  m.def("mla_decode_has_warpgroup_mma", &atom::mla_decode_has_warpgroup_mma,
        "whether mla_decode's warpgroup-MMA kernel (kernel=7) runs on this build and GPU");

  m.def(
      "write_latent_cache",
      [](uintptr_t cache, int64_t block_stride, int64_t row_stride, int64_t block_size, uintptr_t latent,
         int64_t latent_stride, uintptr_t rope, int64_t rope_stride, uintptr_t slot_mapping, int slot_dtype,
         int64_t num_tokens, int64_t rank, int64_t rope_dim, int dtype, uintptr_t stream) {
        check(atom::write_latent_cache(cache, block_stride, row_stride, block_size, latent, latent_stride, rope,
                                       rope_stride, slot_mapping, slot_dtype, num_tokens, rank, rope_dim, dtype,
                                       stream));
      },
      "MLA cache rows [latent | rope] written at slot_mapping", py::arg("cache"), py::arg("block_stride"),
      py::arg("row_stride"), py::arg("block_size"), py::arg("latent"), py::arg("latent_stride"), py::arg("rope"),
      py::arg("rope_stride"), py::arg("slot_mapping"), py::arg("slot_dtype"), py::arg("num_tokens"),
      py::arg("rank"), py::arg("rope_dim"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "paged_decode_attention",
      [](uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, int64_t block_stride, int64_t token_stride,
         int64_t head_stride, int64_t block_size, uintptr_t block_tables, int64_t block_table_stride,
         int block_table_dtype, uintptr_t seq_lens, int seq_lens_dtype, uintptr_t out, uintptr_t o_part,
         uintptr_t lse_part, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t num_splits,
         int64_t split_min_tiles, int64_t stages, double scale, int dtype, int out_dtype, uintptr_t stream) {
        check(atom::paged_decode_attention(q, k_cache, v_cache, block_stride, token_stride, head_stride, block_size,
                                           block_tables, block_table_stride, block_table_dtype, seq_lens,
                                           seq_lens_dtype, out, o_part, lse_part, rows, heads, kv_heads, head_dim,
                                           num_splits, split_min_tiles, stages, scale, dtype, out_dtype, stream));
      },
      "GQA decode attention over paged K and V caches", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("block_stride"), py::arg("token_stride"), py::arg("head_stride"), py::arg("block_size"),
      py::arg("block_tables"), py::arg("block_table_stride"), py::arg("block_table_dtype"), py::arg("seq_lens"),
      py::arg("seq_lens_dtype"), py::arg("out"), py::arg("o_part"), py::arg("lse_part"), py::arg("rows"),
      py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("num_splits"), py::arg("split_min_tiles"),
      py::arg("stages"), py::arg("scale"), py::arg("dtype"), py::arg("out_dtype"), py::arg("stream"));

  m.def(
      "paged_prefill_attention",
      [](uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, int64_t block_stride, int64_t token_stride,
         int64_t head_stride, int64_t block_size, uintptr_t block_tables, int64_t block_table_stride,
         int block_table_dtype, uintptr_t work, int64_t num_work, int64_t queries_per_item, uintptr_t out,
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t v_head_dim, double scale, int dtype,
         uintptr_t stream) {
        check(atom::paged_prefill_attention(q, k_cache, v_cache, block_stride, token_stride, head_stride, block_size,
                                            block_tables, block_table_stride, block_table_dtype, work, num_work,
                                            queries_per_item, out, heads, kv_heads, head_dim, v_head_dim, scale,
                                            dtype, stream));
      },
      "Causal attention of prefill chunks over paged K and V caches (tensor cores)", py::arg("q"),
      py::arg("k_cache"), py::arg("v_cache"), py::arg("block_stride"), py::arg("token_stride"),
      py::arg("head_stride"), py::arg("block_size"), py::arg("block_tables"), py::arg("block_table_stride"),
      py::arg("block_table_dtype"), py::arg("work"), py::arg("num_work"), py::arg("queries_per_item"),
      py::arg("out"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("v_head_dim"),
      py::arg("scale"), py::arg("dtype"), py::arg("stream"));

  m.def("paged_prefill_supported", &atom::paged_prefill_supported,
        "Whether paged_prefill_attention takes these row sizes and dtype in this build", py::arg("head_dim"),
        py::arg("v_head_dim"), py::arg("dtype"));

  m.def("paged_decode_blocks_per_sm", &atom::paged_decode_blocks_per_sm,
        "Blocks of paged_decode_attention's kernel an SM runs at once (0: sizes it does not take)",
        py::arg("head_dim"), py::arg("heads_per_block"), py::arg("dtype"));

  m.def(
      "rotary_write_kv",
      [](uintptr_t q, int64_t q_stride, uintptr_t k, int64_t k_stride, uintptr_t v, int64_t v_stride,
         uintptr_t positions, int positions_dtype, uintptr_t inv_freq, uintptr_t q_out, uintptr_t k_cache,
         uintptr_t v_cache, int64_t block_stride, int64_t token_stride, int64_t head_stride, int64_t block_size,
         uintptr_t slot_mapping, int slot_dtype, int64_t num_tokens, int64_t heads, int64_t kv_heads,
         int64_t head_dim, int dtype, uintptr_t stream) {
        check(atom::rotary_write_kv(q, q_stride, k, k_stride, v, v_stride, positions, positions_dtype, inv_freq,
                                    q_out, k_cache, v_cache, block_stride, token_stride, head_stride, block_size,
                                    slot_mapping, slot_dtype, num_tokens, heads, kv_heads, head_dim, dtype,
                                    stream));
      },
      "neox rotary on q and k; rotated k and v written into the paged caches", py::arg("q"), py::arg("q_stride"),
      py::arg("k"), py::arg("k_stride"), py::arg("v"), py::arg("v_stride"), py::arg("positions"),
      py::arg("positions_dtype"), py::arg("inv_freq"), py::arg("q_out"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("block_stride"), py::arg("token_stride"), py::arg("head_stride"), py::arg("block_size"),
      py::arg("slot_mapping"), py::arg("slot_dtype"), py::arg("num_tokens"), py::arg("heads"), py::arg("kv_heads"),
      py::arg("head_dim"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "rms_norm",
      [](uintptr_t x, int64_t x_stride, uintptr_t residual, int64_t residual_stride, uintptr_t sum, int64_t sum_stride,
         uintptr_t weight, uintptr_t out, int64_t out_stride, int64_t rows, int64_t dim, double eps, int dtype,
         uintptr_t stream) {
        check(atom::rms_norm(x, x_stride, residual, residual_stride, sum, sum_stride, weight, out, out_stride, rows,
                             dim, eps, dtype, stream));
      },
      "out = weight * round(rmsnorm(x)), x first sum = round(x + residual) if a residual is given", py::arg("x"),
      py::arg("x_stride"), py::arg("residual"), py::arg("residual_stride"), py::arg("sum"), py::arg("sum_stride"),
      py::arg("weight"), py::arg("out"), py::arg("out_stride"), py::arg("rows"), py::arg("dim"), py::arg("eps"),
      py::arg("dtype"), py::arg("stream"));

  m.def(
      "silu_mul",
      [](uintptr_t x, int64_t x_stride, uintptr_t out, int64_t out_stride, int64_t rows, int64_t width, int dtype,
         uintptr_t stream) { check(atom::silu_mul(x, x_stride, out, out_stride, rows, width, dtype, stream)); },
      "out = round(silu(gate)) * up over [gate | up] rows", py::arg("x"), py::arg("x_stride"), py::arg("out"),
      py::arg("out_stride"), py::arg("rows"), py::arg("width"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "kda_gate",
      [](uintptr_t f, int64_t f_stride, uintptr_t dt_bias, uintptr_t a_log, uintptr_t b, int64_t b_stride, uintptr_t g,
         uintptr_t beta, int64_t tokens, int64_t heads, int64_t head_dim, int dtype, uintptr_t stream) {
        check(atom::kda_gate(f, f_stride, dt_bias, a_log, b, b_stride, g, beta, tokens, heads, head_dim, dtype,
                             stream));
      },
      "KDA log-decay g and beta from the gate projections", py::arg("f"), py::arg("f_stride"), py::arg("dt_bias"),
      py::arg("a_log"), py::arg("b"), py::arg("b_stride"), py::arg("g"), py::arg("beta"), py::arg("tokens"),
      py::arg("heads"), py::arg("head_dim"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "kda_gate_proj",
      [](uintptr_t f_a, uintptr_t g_a, int64_t x_stride, uintptr_t b, int64_t b_stride, int64_t tokens, uintptr_t w_f,
         uintptr_t w_g, int64_t channels, int64_t dim, uintptr_t dt_bias, uintptr_t a_log, int64_t heads, uintptr_t g,
         uintptr_t beta, uintptr_t gate, int dtype, uintptr_t stream) {
        check(atom::kda_gate_proj(f_a, g_a, x_stride, b, b_stride, tokens, w_f, w_g, channels, dim, dt_bias, a_log,
                                  heads, g, beta, gate, dtype, stream));
      },
      "kda_gate with its two low-rank up-projections, at decode sizes", py::arg("f_a"), py::arg("g_a"),
      py::arg("x_stride"), py::arg("b"), py::arg("b_stride"), py::arg("tokens"), py::arg("w_f"), py::arg("w_g"),
      py::arg("channels"), py::arg("dim"), py::arg("dt_bias"), py::arg("a_log"), py::arg("heads"), py::arg("g"),
      py::arg("beta"), py::arg("gate"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "router_logits",
      [](uintptr_t x, int64_t x_stride, uintptr_t weight, uintptr_t logits, int64_t tokens, int64_t experts,
         int64_t dim, int dtype, uintptr_t stream) {
        check(atom::router_logits(x, x_stride, weight, logits, tokens, experts, dim, dtype, stream));
      },
      "fp32 router logits = x W^T", py::arg("x"), py::arg("x_stride"), py::arg("weight"), py::arg("logits"),
      py::arg("tokens"), py::arg("experts"), py::arg("dim"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "advance_decode",
      [](uintptr_t rows, int64_t row_stride, uintptr_t tables, int64_t table_stride, uintptr_t next_ids, int64_t n,
         int64_t block_size, uintptr_t stream) {
        check(atom::advance_decode(rows, row_stride, tables, table_stride, next_ids, n, block_size, stream));
      },
      "the CUDA-graph decode buffers moved one decode step on", py::arg("rows"), py::arg("row_stride"),
      py::arg("tables"), py::arg("table_stride"), py::arg("next_ids"), py::arg("n"), py::arg("block_size"),
      py::arg("stream"));

  m.def(
      "pack_verification",
      [](uintptr_t rows, int64_t row_stride, uintptr_t targets, uintptr_t drafts, int64_t drafts_stride, int64_t n,
         int64_t width, int64_t k, uintptr_t out, uintptr_t stream) {
        check(atom::pack_verification(rows, row_stride, targets, drafts, drafts_stride, n, width, k, out, stream));
      },
      "a verification step's targets, accepted counts and next drafts in one tensor", py::arg("rows"),
      py::arg("row_stride"), py::arg("targets"), py::arg("drafts"), py::arg("drafts_stride"), py::arg("n"),
      py::arg("width"), py::arg("k"), py::arg("out"), py::arg("stream"));

  m.def(
      "settle_verification",
      [](uintptr_t rows, int64_t row_stride, uintptr_t tables, int64_t table_stride, uintptr_t index, int64_t count,
         uintptr_t packed, int64_t n_prev, int64_t width, int64_t block_size, uintptr_t stream) {
        check(atom::settle_verification(rows, row_stride, tables, table_stride, index, count, packed, n_prev, width,
                                        block_size, stream));
      },
      "verification rows planned while the step before ran, made right from its outcome", py::arg("rows"),
      py::arg("row_stride"), py::arg("tables"), py::arg("table_stride"), py::arg("index"), py::arg("m"),
      py::arg("packed"), py::arg("n_prev"), py::arg("width"), py::arg("block_size"), py::arg("stream"));

  m.def(
      "accept_drafts",
      [](uintptr_t tokens, uintptr_t probs, uintptr_t draws, int64_t draws_stride, uintptr_t at, uintptr_t proposed,
         int64_t proposed_stride, uintptr_t num_drafts, int64_t n, int64_t k, uintptr_t out, uintptr_t stream) {
        check(atom::accept_drafts(tokens, probs, draws, draws_stride, at, proposed, proposed_stride, num_drafts, n, k,
                                  out, stream));
      },
      "each verified row's accepted drafts, next token and targets", py::arg("tokens"), py::arg("probs"),
      py::arg("draws"), py::arg("draws_stride"), py::arg("at"), py::arg("proposed"), py::arg("proposed_stride"),
      py::arg("num_drafts"), py::arg("n"), py::arg("k"), py::arg("out"), py::arg("stream"));

  m.def(
      "moe_route",
      [](uintptr_t logits, int64_t logits_stride, uintptr_t bias, int64_t tokens, int64_t experts, int64_t top_k,
         bool renormalize, double scale, uintptr_t ids, uintptr_t weights, uintptr_t stream) {
        check(atom::moe_route(logits, logits_stride, bias, tokens, experts, top_k, renormalize, scale, ids, weights,
                              stream));
      },
      "sigmoid router: top-k experts on score + bias, weights", py::arg("logits"), py::arg("logits_stride"),
      py::arg("bias"), py::arg("tokens"), py::arg("experts"), py::arg("top_k"), py::arg("renormalize"),
      py::arg("scale"), py::arg("ids"), py::arg("weights"), py::arg("stream"));

  m.def(
      "moe_align",
      [](uintptr_t ids, int64_t pairs, int64_t experts, int64_t top_k, uintptr_t src_token, uintptr_t pos,
         uintptr_t ends, uintptr_t workspace, uintptr_t stream) {
        check(atom::moe_align(ids, pairs, experts, top_k, src_token, pos, ends, workspace, stream));
      },
      "(token, pick) pairs grouped by expert: rows, tokens and group ends", py::arg("ids"), py::arg("pairs"),
      py::arg("experts"), py::arg("top_k"), py::arg("src_token"), py::arg("pos"), py::arg("ends"),
      py::arg("workspace"), py::arg("stream"));
  m.def("moe_align_workspace_ints", &atom::moe_align_workspace_ints,
        "int32 scratch moe_align needs for this many pairs (0: none)", py::arg("pairs"), py::arg("experts"));

  m.def(
      "moe_combine",
      [](uintptr_t y, uintptr_t pos, uintptr_t weights, uintptr_t addend, uintptr_t out, int64_t tokens, int64_t top_k,
         int64_t dim, int64_t pick_stride, int dtype, uintptr_t stream) {
        check(atom::moe_combine(y, pos, weights, addend, out, tokens, top_k, dim, pick_stride, dtype, stream));
      },
      "weighted sum of each token's expert outputs (+ addend)", py::arg("y"), py::arg("pos"), py::arg("weights"),
      py::arg("addend"), py::arg("out"), py::arg("tokens"), py::arg("top_k"), py::arg("dim"), py::arg("pick_stride"),
      py::arg("dtype"), py::arg("stream"));
  m.def(
      "moe_gemv_up",
      [](uintptr_t x, int64_t x_stride, uintptr_t ids, int64_t tokens, int64_t top_k, uintptr_t w,
         int64_t expert_stride, int64_t inter, uintptr_t shared_w, int64_t shared_inter, uintptr_t act, int64_t dim,
         int dtype, uintptr_t stream) {
        check(atom::moe_gemv_up(x, x_stride, ids, tokens, top_k, w, expert_stride, inter, shared_w, shared_inter, act,
                                dim, dtype, stream));
      },
      "picked (and shared) experts' gate_up rows times each token, then silu_mul", py::arg("x"), py::arg("x_stride"),
      py::arg("ids"), py::arg("tokens"), py::arg("top_k"), py::arg("w"), py::arg("expert_stride"), py::arg("inter"),
      py::arg("shared_w"), py::arg("shared_inter"), py::arg("act"), py::arg("dim"), py::arg("dtype"),
      py::arg("stream"));

  m.def(
      "moe_gemv_down",
      [](uintptr_t act, uintptr_t ids, uintptr_t weights, int64_t tokens, int64_t top_k, uintptr_t w,
         int64_t expert_stride, int64_t inter, uintptr_t shared_act, uintptr_t shared_w, int64_t shared_inter,
         uintptr_t addend, uintptr_t out, int64_t dim, int dtype, uintptr_t stream) {
        check(atom::moe_gemv_down(act, ids, weights, tokens, top_k, w, expert_stride, inter, shared_act, shared_w,
                                  shared_inter, addend, out, dim, dtype, stream));
      },
      "picked experts' down rows times their activations, summed per token (+ addend or shared expert)",
      py::arg("act"), py::arg("ids"), py::arg("weights"), py::arg("tokens"), py::arg("top_k"), py::arg("w"),
      py::arg("expert_stride"), py::arg("inter"), py::arg("shared_act"), py::arg("shared_w"),
      py::arg("shared_inter"), py::arg("addend"), py::arg("out"), py::arg("dim"), py::arg("dtype"),
      py::arg("stream"));

  m.def("set_programmatic_launch", &atom::set_programmatic_launch,
        "launch the kernels with programmatic dependent launch (sm_90+; elsewhere it stays off)", py::arg("on"));
  m.def("programmatic_launch", &atom::programmatic_launch, "whether kernels launch with programmatic dependent launch");

  m.def(
      "gemv",
      [](uintptr_t x, int64_t x_stride, int64_t tokens, uintptr_t w, int64_t rows, int64_t dim, uintptr_t bias,
         uintptr_t out, int64_t out_stride, int64_t k_split, int dtype, uintptr_t stream) {
        check(atom::gemv(x, x_stride, tokens, w, rows, dim, bias, out, out_stride, k_split, dtype, stream));
      },
      "a dense linear for a few tokens: out = x . w^T + bias, every row of w read once", py::arg("x"),
      py::arg("x_stride"), py::arg("tokens"), py::arg("w"), py::arg("rows"), py::arg("dim"), py::arg("bias"),
      py::arg("out"), py::arg("out_stride"), py::arg("k_split"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "sample_tokens",
      [](uintptr_t logits, int64_t logits_stride, uintptr_t draws, int64_t draws_stride, uintptr_t temperature,
         uintptr_t top_p, uintptr_t top_k, uintptr_t min_p, uintptr_t out, uintptr_t drafts, uintptr_t draft_probs,
         int64_t rows, int64_t vocab, uintptr_t stream) {
        check(atom::sample_tokens(logits, logits_stride, draws, draws_stride, temperature, top_p, top_k, min_p, out,
                                  drafts, draft_probs, rows, vocab, stream));
      },
      "one token per fp32 logits row: temperature, top-k, top-p, min-p and the exponential race over given draws; "
      "with drafts (0: none), each row's draft's probability, and the race without it",
      py::arg("logits"), py::arg("logits_stride"), py::arg("draws"), py::arg("draws_stride"), py::arg("temperature"),
      py::arg("top_p"), py::arg("top_k"), py::arg("min_p"), py::arg("out"), py::arg("drafts"), py::arg("draft_probs"),
      py::arg("rows"), py::arg("vocab"), py::arg("stream"));

  m.def(
      "keyed_draws",
      [](uintptr_t draws, int64_t stride, int64_t width, const std::vector<int64_t>& rows,
         const std::vector<uint64_t>& seeds, const std::vector<uint64_t>& counters, uintptr_t stream) {
        if (seeds.size() != rows.size() || counters.size() != rows.size())
          throw std::invalid_argument("keyed_draws: rows, seeds and counters must be alike");
        check(atom::keyed_draws(draws, stride, width, rows.data(), seeds.data(), counters.data(),
                                static_cast<int64_t>(rows.size()), stream));
      },
      "seeded requests' Exp(1) draws: row rows[j] of draws from its seed state and counter alone (SplitMix64), "
      "128 rows a launch",
      py::arg("draws"), py::arg("stride"), py::arg("width"), py::arg("rows"), py::arg("seeds"), py::arg("counters"),
      py::arg("stream"));
}
