"""Paged GQA attention layer: rotary on q and k, this step's K/V into the cache, then attend.

The layer holds no weights; the projections live in the model, which shares
one ``RotaryEmbedding`` between its layers. The layer's cache comes from
``get_forward_context().caches[layer_idx]`` = (k_cache, v_cache).

On a GPU with the ``atom._C`` kernels:
- every step rotates q and k and writes k and v with one kernel (``rotary_write_kv``);
- steps whose sequences all bring few new tokens (decode, 1 + k speculative
  verification) attend with ``paged_decode_attention``, one query row per token
  over its own prefix: no host sync, so decode graphs can capture them;
- steps with prefills attend their one-token rows with that kernel too, and
  their longer rows with ``paged_prefill_attention``: one launch for every
  prefill chunk of the step on tensor cores (bf16/fp16, head_dim 64 or 128),
  else SDPA's fused kernels a sequence at a time.
A CPU runs the torch reference (``atom.layers.rotary``, ``atom.ops.paged_attention``).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.forward_context import AttentionMetadata, get_forward_context
from atom.layers.cache_spec import PagedKVSpec
from atom.layers.rotary import RotaryEmbedding
from atom.ops import cuda as kernels
from atom.ops import split_decode_prefill
from atom.ops.paged_attention import paged_attention, write_kv_cache

# Steps whose longest query is at most this many tokens go through paged_decode_attention:
# each token row reads its whole prefix, so this only pays for short queries.
KERNEL_MAX_QUERY_LEN = 8


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 rotary: RotaryEmbedding | None = None):  # fmt: skip
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.rotary = rotary  # None: q and k come rotated (or need no rotary)

    def kv_cache_spec(self, dtype: torch.dtype) -> PagedKVSpec:
        return PagedKVSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads(*head_dim)], k/v [T, num_kv_heads(*head_dim)] (views into one projection are fine),
        positions [T] -> [T, num_heads * head_dim]."""
        ctx = get_forward_context()
        md = ctx.attn_metadata
        k_cache, v_cache = ctx.caches[self.layer_idx]
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if kernels.kernels_apply(q):
            if self.rotary is not None:
                q = kernels.rotary_write_kv(q, k, v, positions, self.rotary.inv_freq, k_cache, v_cache,
                                            md.slot_mapping)  # fmt: skip
            else:
                kernels.write_kv_cache(k_cache, v_cache, k, v, md.slot_mapping)
            out = self._attend_kernels(q, k_cache, v_cache, md)
        else:
            if self.rotary is not None:
                q, k = self.rotary(positions, q, k)
            write_kv_cache(k_cache, v_cache, k, v, md.slot_mapping)
            out = paged_attention(q, k_cache, v_cache, md, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _attend_kernels(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        md: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        if md.max_query_len <= KERNEL_MAX_QUERY_LEN:
            # Token j of sequence b reads b's block-table row (decode: the table itself, no gather).
            tables = md.block_tables if md.is_pure_decode else md.block_tables[md.token_seq_ids]
            return kernels.paged_decode_attention(q, k_cache, v_cache, tables, md.token_seq_lens, self.scale,
                                                  max_seq_len=md.max_seq_len, out_dtype=q.dtype)  # fmt: skip
        # A step with prefills: the decoding sequences' rows through the kernel, as in a decode step (a new
        # request must not slow every running one down to the reference), the prefills' in one more launch.
        out = torch.empty_like(q)
        for layout in split_decode_prefill(md.query_start_loc, q.device):
            if layout.max_len == 1:
                rows = layout.token_ids
                out[rows] = kernels.paged_decode_attention(
                    q[rows], k_cache, v_cache, md.block_tables[layout.seq_ids], md.token_seq_lens[rows], self.scale,
                    max_seq_len=md.max_seq_len, out_dtype=q.dtype)  # fmt: skip
            else:
                kernels.paged_prefill_attention(q, k_cache, v_cache, md.block_tables, md.query_start_loc,
                                                md.seq_lens, layout.seqs, self.scale, out)  # fmt: skip
        return out
