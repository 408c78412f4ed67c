"""Fused gated RMSNorm: KDA's output norm, ``weight * rmsnorm(o) * sigmoid(gate)``."""

from __future__ import annotations

import torch

from atom.ops.cuda._launch import C, device_guard, dtype_code, kernels_apply, stream_of
from atom.ops.cuda.reference import gated_rmsnorm_ref


def gated_rmsnorm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Normalises x over its last dim in fp32, times weight and sigmoid(gate); x's dtype and shape.

    x and gate: [..., D] with the same leading shape (e.g. [T, H, D] and a
    [T, H*D] gate viewed as [T, H, D]); weight [D] shared by all rows.
    Matches ``atom.layers.norm.GatedRMSNorm``. Written into ``out`` (contiguous,
    x's shape and dtype) if given.
    """
    dim = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (dim,):
        raise ValueError(f"gated_rmsnorm: gate must match x {tuple(x.shape)} and weight be [{dim}]; "
                         f"got {tuple(gate.shape)} and {tuple(weight.shape)}")
    if not kernels_apply(x, gate, weight):
        ref = gated_rmsnorm_ref(x, gate, weight, eps)
        return ref if out is None else out.copy_(ref)
    dtype = x.dtype
    x2 = x.reshape(-1, dim)
    g2 = gate.to(dtype).reshape(-1, dim)
    w = weight.to(dtype).contiguous()
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if g2.stride(1) != 1:
        g2 = g2.contiguous()
    result = torch.empty(x2.shape, dtype=dtype, device=x.device) if out is None else out.view(x2.shape)
    if result.dtype != dtype or result.stride(1) != 1:
        raise ValueError(f"gated_rmsnorm: out must be {dtype} and contiguous")
    with device_guard(x.device):
        C().gated_rmsnorm(
            x2.data_ptr(), x2.stride(0), g2.data_ptr(), g2.stride(0), w.data_ptr(), result.data_ptr(), result.stride(0),
            x2.shape[0], dim, float(eps), dtype_code(dtype), stream_of(x.device),
        )  # fmt: skip
    return result.view(x.shape) if out is None else out
