"""Multi-head latent attention (MLA), NoPE as in Kimi-Linear: no rotary anywhere.

Per token the cache keeps one row [kv_a_layernorm(c) (r) | k_rot (rope)]
(``MLASpec``). kv_b_proj's weight, viewed per head as [H, nope + v, r], is
split into W_UK [H, nope, r] and W_UV [H, v, r]; attention runs in latent
space (absorbed form, see ``atom.ops.mla``):

    q_latent = q_nope @ W_UK      out = (softmax(...) @ c) @ W_UV^T

On a GPU with the ``atom._C`` kernels, steps whose sequences all bring few
new tokens (decode, 1 + k speculative verification) write the cache with
``write_latent_cache`` and attend with ``mla_decode``, one query row per
token over its own prefix. In longer steps, a GPU runs the prefills in the
expanded form (``mla_prefill``: keys and values per head, torch's fused
attention) and the rest through the torch reference, as a CPU runs all of it.
``ATOM_MLA_PREFILL=reference`` sends a GPU's prefills through the reference too.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from atom.forward_context import get_forward_context
from atom.layers.cache_spec import MLASpec
from atom.layers.linear import Linear, StackedLinears
from atom.layers.norm import RMSNorm
from atom.ops import cuda as kernels
from atom.ops import split_decode_prefill
from atom.ops.mla import mla_attention, mla_prefill, write_latent_cache

# Steps whose longest query is at most this many tokens go through mla_decode
# (decode, speculative verification, MTP drafting): each token row reads its
# whole prefix, so this only pays for short queries.
KERNEL_MAX_QUERY_LEN = 8
PREFILL_FORMS = ("expanded", "reference")


def prefill_form() -> str:
    """How a GPU runs MLA prefills: ``ATOM_MLA_PREFILL``, "expanded" (the default) or "reference"."""
    form = os.environ.get("ATOM_MLA_PREFILL", "expanded")
    if form not in PREFILL_FORMS:
        raise ValueError(f"ATOM_MLA_PREFILL must be one of {', '.join(PREFILL_FORMS)}, got {form!r}")
    return form


class MultiHeadLatentAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        attention_bias: bool,
        layer_idx: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.num_heads, self.layer_idx, self.dtype = num_heads, layer_idx, dtype
        self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = (
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        )
        q_dim = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, q_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=attention_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, dtype=dtype)  # eps 1e-6, as transformers
            self.q_b_proj = Linear(q_lora_rank, q_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, dtype=dtype)  # eps 1e-6, as transformers
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False, dtype=dtype)
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias, dtype=dtype)
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        # the query's (or q_a's) and kv_a's projections of x as one matmul (stacked by stack_projections()),
        # where both or neither have a bias
        q_in = self._q_in_proj
        same_bias = (q_in.bias is None) == (self.kv_a_proj_with_mqa.bias is None)
        self.x_proj = StackedLinears(q_in, self.kv_a_proj_with_mqa) if same_bias else None

    @property
    def _q_in_proj(self) -> Linear:
        return self.q_proj if self.q_lora_rank is None else self.q_a_proj

    @torch.no_grad()
    def stack_projections(self) -> None:
        """Stack the loaded projections of x once; their parameters become views into the stack."""
        if self.x_proj is not None:
            self.x_proj.stack()

    def cache_spec(self) -> MLASpec:
        return MLASpec(kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim, dtype=self.dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        md = ctx.attn_metadata
        (latent_cache,) = ctx.caches[self.layer_idx]

        fused = kernels.kernels_apply(hidden_states) and md.max_query_len <= KERNEL_MAX_QUERY_LEN
        if self.x_proj is not None:
            q_in, kv_a = self.x_proj.split(hidden_states)
        else:
            q_in, kv_a = self._q_in_proj(hidden_states), self.kv_a_proj_with_mqa(hidden_states)
        latent, k_rot = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if fused:
            kernels.write_latent_cache(latent_cache, self.kv_a_layernorm(latent), k_rot, md.slot_mapping)
        else:
            write_latent_cache(latent_cache, torch.cat([self.kv_a_layernorm(latent), k_rot], dim=-1), md.slot_mapping)

        q = self._query(q_in)  # [T, H, nope + rope]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)
        if fused:
            out_latent = self._decode_kernel(torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope, latent_cache, md)
        elif kernels.kernels_apply(hidden_states) and prefill_form() == "expanded":  # a GPU, a step with prefills
            out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
            for layout in split_decode_prefill(md.query_start_loc, hidden_states.device):
                if layout.max_len > 1:  # the expanded form, straight to the heads' values
                    mla_prefill(q, latent_cache, self.kv_b_proj.weight, md, layout.seqs, self.scale, out)
                else:  # the step's decode rows: the reference
                    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
                    latent = mla_attention(q_latent, q_rope, latent_cache, md, layout, self.scale)
                    out[layout.token_ids] = torch.einsum("thr,hvr->thv", latent.to(hidden_states.dtype), w_uv)
            return self.o_proj(out.flatten(1))
        else:  # the reference
            q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
            out_latent = q_latent.new_empty(q_latent.shape, dtype=torch.float32)
            for layout in split_decode_prefill(md.query_start_loc, hidden_states.device):
                out_latent[layout.token_ids] = mla_attention(q_latent, q_rope, latent_cache, md, layout, self.scale)
        out = torch.einsum("thr,hvr->thv", out_latent.to(hidden_states.dtype), w_uv)
        return self.o_proj(out.flatten(1))

    def _decode_kernel(self, q_latent, q_rope, latent_cache, md) -> torch.Tensor:
        """Latent output [T, H, r] fp32 from ``mla_decode``, one row per token.

        Token j of sequence b attends to its first context_lens[b] + j + 1 cache
        rows through b's block-table row (decode: the table itself, no gather).
        """
        tables = md.block_tables if md.is_pure_decode else md.block_tables[md.token_seq_ids]
        return kernels.mla_decode(q_latent, q_rope, latent_cache, tables, md.token_seq_lens, self.scale,
                                  max_seq_len=md.max_seq_len, out_dtype=torch.float32)  # fmt: skip

    def _query(self, q_in: torch.Tensor) -> torch.Tensor:
        """[T, H, nope + rope], nope part first, from q_proj's output (or q_a_proj's)."""
        q = q_in if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_in))
        return q.unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))
