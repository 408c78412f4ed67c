"""What every kernel wrapper needs: dtype codes, the stream, when a kernel applies."""

from __future__ import annotations

import torch

from atom.ops._C_loader import get_C, use_kernels

# Mirrors `enum DType` in csrc/ops.h.
DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.int32: 3,
    torch.int64: 4,
}


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"the kernels take float32, bfloat16, float16, int32 or int64 tensors, got {dtype}")
    return DTYPE_CODES[dtype]


def kernels_apply(*tensors: torch.Tensor | None) -> bool:
    """True when the compiled kernels should run on these tensors (all on one GPU)."""
    present = [t for t in tensors if t is not None]
    if not present or not use_kernels():
        return False
    device = present[0].device
    return device.type == "cuda" and all(t.device == device for t in present)


def stream_of(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def C():  # noqa: N802 - the module's name
    return get_C()
