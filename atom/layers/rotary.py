"""Rotary position embedding, neox style (``rotate_half``) as in HF Llama.

Numerics follow transformers exactly: inverse frequencies in fp32 (here), then
the rotation of ``atom.ops.rotary``. Supported ``rope_type`` values: default,
linear, llama3.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from atom.ops.rotary import apply_rotary, rotary_cos_sin

_SUPPORTED = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """One flat rope dict from a raw config.json, resolved with HF's precedence.

    transformers 5 writes ``rope_parameters``; older checkpoints hold a top-level
    ``rope_theta`` and an optional ``rope_scaling`` (which wins when both exist).
    """
    params = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] == "llama3":
        if "original_max_position_embeddings" in hf_config:
            params["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", hf_config["max_position_embeddings"])
    partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if params["rope_type"] not in _SUPPORTED or partial != 1.0:
        raise ValueError(
            f"rope_type={params['rope_type']!r} with partial_rotary_factor={partial} is not supported; "
            f"ATOM's rotary embedding handles rope_type in {_SUPPORTED} over the full head_dim"
        )
    return params


def compute_inv_freq(params: dict[str, Any], head_dim: int, device=None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, bit-equal to transformers' rope init."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if params["rope_type"] == "linear":
        return inv_freq / params["factor"]
    if params["rope_type"] == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths (low frequencies) are stretched by ``factor``, short ones
    # kept, and the band in between interpolated smoothly (Llama 3.1 recipe).
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q [T, H, D] and k [T, Hkv, D] by their tokens' positions [T].

    ``inv_freq`` is a non-persistent buffer: the loader builds models on the
    meta device, so the owner calls ``post_load()`` to fill it on the real one.
    """

    def __init__(self, head_dim: int, params: dict[str, Any]):
        super().__init__()
        self.head_dim = head_dim
        self.params = params
        self.register_buffer("inv_freq", compute_inv_freq(params, head_dim), persistent=False)

    def post_load(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(compute_inv_freq(self.params, self.head_dim, device=self.inv_freq.device))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary_cos_sin(positions, self.inv_freq, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
