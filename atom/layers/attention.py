"""Paged GQA attention layer: write this step's K/V into the cache, then attend.

The layer holds no weights; projections and rotary live in the model. Its cache
comes from ``get_forward_context().caches[layer_idx]`` = (k_cache, v_cache).

On a GPU with the ``atom._C`` kernels, steps whose sequences all bring few new
tokens (decode, 1 + k speculative verification) write the caches with a kernel
that skips negative slots and attend with ``paged_decode_attention``, one query
row per token over its own prefix: no host sync, so decode graphs can capture
them. Longer steps, and a CPU, run the torch reference (``atom.ops.paged_attention``).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.forward_context import get_forward_context
from atom.layers.cache_spec import PagedKVSpec
from atom.ops import cuda as kernels
from atom.ops.paged_attention import paged_attention, write_kv_cache

# Steps whose longest query is at most this many tokens go through paged_decode_attention:
# each token row reads its whole prefix, so this only pays for short queries.
KERNEL_MAX_QUERY_LEN = 8


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def kv_cache_spec(self, dtype: torch.dtype) -> PagedKVSpec:
        return PagedKVSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads(*head_dim)], k/v [T, num_kv_heads(*head_dim)] -> [T, num_heads * head_dim]."""
        ctx = get_forward_context()
        md = ctx.attn_metadata
        k_cache, v_cache = ctx.caches[self.layer_idx]
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if kernels.kernels_apply(q) and md.max_query_len <= KERNEL_MAX_QUERY_LEN:
            kernels.write_kv_cache(k_cache, v_cache, k, v, md.slot_mapping)
            # Token j of sequence b reads b's block-table row (decode: the table itself, no gather).
            tables = md.block_tables if md.is_pure_decode else md.block_tables[md.token_seq_ids]
            out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, md.token_seq_lens, self.scale,
                                                 max_seq_len=md.max_seq_len, out_dtype=q.dtype)
        else:
            write_kv_cache(k_cache, v_cache, k, v, md.slot_mapping)
            out = paged_attention(q, k_cache, v_cache, md, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
