"""Rotary position embedding, neox style (``rotate_half``) as in HF Llama: the torch math.

Angles ``position * inv_freq`` in fp32, cos and sin cast to the activation
dtype, then ``x * cos + rotate_half(x) * sin`` with each op rounding to that
dtype, as transformers computes it. ``atom.layers.rotary`` runs this on a CPU;
``csrc/paged_attention.cu``'s ``rotary_write_kv`` rounds the same way.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos and sin [T, head_dim] of the tokens' angles, in ``dtype``."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_dim] rotated by cos, sin [T, head_dim] (broadcast over the heads)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin
