"""Dense linears at decode batch sizes (``csrc/gemv.cu``), with ``F.linear`` as the reference.

With a few tokens a linear only reads its weight matrix. cuBLAS reads the
decode step's short matrices (a few hundred rows, or rows of 128 elements)
at 5-10% of the copy ceiling on an H200 and its o_proj at 45%; the kernel
splits short rows over more warps (GPU_NOTES.md, session 22). It runs on
CUDA cores, which from two tokens on run out of instruction issue before
bandwidth on larger matrices while cuBLAS's tensor-core tiles keep the speed
of one token. So: one token always takes the kernel; two to
GEMV_MAX_TOKENS take it for matrices of at most GEMV_SMALL_WEIGHT elements;
the rest stay on ``F.linear``.

Results are fp32 sums rounded once (after the bias), like cuBLAS's, in
another summation order. For a given weight matrix the kernel's order does
not depend on the other tokens of the launch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from atom.ops.cuda._launch import C, device_guard, dtype_code, kernels_apply, stream_of

# Tokens up to which a small matrix's linear runs the kernel (one token runs it for any matrix);
# ATOM_GEMV_MAX_TOKENS overrides, 0 turns the kernel off.
GEMV_MAX_TOKENS = int(os.environ.get("ATOM_GEMV_MAX_TOKENS", 4))
GEMV_SMALL_WEIGHT = 1 << 21  # elements; the decode step's low-rank projections (KDA's f_b and g_b, MLA's LoRA)


def use_kernel(tokens: int, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs the kernel for this many tokens over this weight (on a GPU)."""
    if tokens == 1:
        return GEMV_MAX_TOKENS >= 1
    return tokens <= GEMV_MAX_TOKENS and weight.numel() <= GEMV_SMALL_WEIGHT


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k_split: int = 0,
           force: bool = False) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)``; on a GPU, where ``use_kernel`` says so (or ``force``: any number of
    tokens), one kernel that reads each row of ``weight`` once. ``k_split`` (1, 2, 4, 8; 0 = chosen from
    the shape) and ``force`` are for tests and benchmarks."""
    rows, dim = weight.shape
    tokens = x.numel() // dim if rows and dim and x.shape[-1] == dim else 0
    if (tokens == 0 or not kernels_apply(x, weight, bias) or not (force or use_kernel(tokens, weight))
            or weight.dtype != x.dtype or weight.stride(1) != 1 or weight.stride(0) != dim
            or (bias is not None and (bias.dtype != x.dtype or bias.stride(0) != 1))):  # fmt: skip
        return F.linear(x, weight, bias)
    x2 = x if x.dim() == 2 else x.reshape(tokens, dim)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    with device_guard(x.device):
        C().gemv(x2.data_ptr(), x2.stride(0) if tokens > 1 else dim, tokens, weight.data_ptr(), rows, dim,
                 0 if bias is None else bias.data_ptr(), out.data_ptr(), rows, k_split, dtype_code(x.dtype),
                 stream_of(x.device))  # fmt: skip
    return out
