"""Paged GQA attention layer: write this step's K/V into the cache, then attend.

The layer holds no weights; projections and rotary live in the model. Its cache
comes from ``get_forward_context().caches[layer_idx]`` = (k_cache, v_cache).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.forward_context import get_forward_context
from atom.layers.cache_spec import PagedKVSpec
from atom.ops.paged_attention import paged_attention, write_kv_cache


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
        k_cache, v_cache = ctx.caches[self.layer_idx]
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        write_kv_cache(k_cache, v_cache, k, v, ctx.attn_metadata.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, ctx.attn_metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
