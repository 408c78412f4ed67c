"""What every kernel wrapper needs: dtype codes, the stream, when a kernel applies."""

from __future__ import annotations

import contextlib
import functools

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
    device = None
    for t in tensors:
        if t is None:
            continue
        if device is None:
            device = t.device
            if device.type != "cuda":
                return False
        elif t.device != device:
            return False
    return device is not None and use_kernels()


# The current stream's raw handle without building a torch.cuda.Stream (torch built for CUDA or ROCm):
# 0.1 us a call against 3 us on an H200's host (GPU_NOTES.md, session 19), and each step makes hundreds.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(device: torch.device) -> int:
    """The raw handle of the current stream on ``device`` (a tensor's device: its index is set)."""
    if _RAW_STREAM is not None and device.index is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(device)`` around a launch whose C++ side asks the current device, entered only
    where ``device`` is not current already (entering it costs 2 us, asking 0.3 us)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def C():  # noqa: N802 - the module's name
    return get_C()


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def wave_splits(blocks: int, slots: int, max_tiles: int, min_fill: float = 0.8) -> int:
    """How many blocks share one row's positions (flash-decoding), so that the grid fills whole waves.

    ``blocks``: the grid without splits; ``slots``: how many blocks the GPU runs at once; ``max_tiles``:
    the longest row's tiles (a split takes whole tiles). One split when the grid fills at least ``min_fill``
    of the slots; else the fewest splits whose wave efficiency (blocks / (waves * slots)) is within 5% of
    the best. More splits than needed only add partial outputs to merge.
    """
    if blocks == 0 or blocks >= min_fill * slots or max_tiles <= 1:
        return 1
    candidates = range(1, min(max_tiles, 256) + 1)
    eff = {s: blocks * s / (-(-blocks * s // slots) * slots) for s in candidates}
    best = max(eff.values())
    return min(s for s in candidates if eff[s] >= 0.95 * best)
