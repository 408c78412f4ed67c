"""Whole-block copies between a paged cache and a contiguous staging buffer.

P/D transfer and offload move a request's cache blocks through one staging
buffer: ``gather_blocks`` packs the chosen blocks into it, ``scatter_blocks``
unpacks it into (possibly different) blocks of another cache.

    cache   [num_blocks, *block_shape]      block ids  [n] int64
    staging [n,          *block_shape]      staging[i] <-> cache[block_ids[i]]

The copy is byte-generic, so any dtype works. On GPU tensors the ``atom._C``
kernel runs when ``use_kernels()``; elsewhere the torch reference does, and
tests compare the two.
"""

from __future__ import annotations

import math

import torch

from atom.ops._C_loader import get_C, use_kernels


# ---- torch references ----------------------------------------------------------


def gather_blocks_ref(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    ids = block_ids.to(device=cache.device, dtype=torch.int64)
    out.copy_(cache.index_select(0, ids))
    return out


def scatter_blocks_ref(cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    ids = block_ids.to(device=cache.device, dtype=torch.int64)
    cache.index_copy_(0, ids, staging.to(cache.device))


# ---- dispatch --------------------------------------------------------------------


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns ``cache[block_ids]`` packed contiguously, written into ``out`` if given."""
    n = block_ids.numel()
    if out is None:
        out = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    _check_staging(cache, block_ids, out, "out")
    if _kernel_applies(cache, out):
        _launch(get_C().gather_blocks, cache, block_ids, out)
    else:
        gather_blocks_ref(cache, block_ids, out)
    return out


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """``cache[block_ids[i]] = staging[i]`` in place. Block ids must be distinct."""
    _check_staging(cache, block_ids, staging, "staging")
    if _kernel_applies(cache, staging):
        _launch(get_C().scatter_blocks, cache, block_ids, staging)
    else:
        scatter_blocks_ref(cache, block_ids, staging)


def _check_staging(cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, name: str) -> None:
    if block_ids.dim() != 1 or block_ids.is_floating_point() or block_ids.is_complex():
        raise ValueError(f"block_ids must be a 1-D integer tensor, got {block_ids.dtype} {tuple(block_ids.shape)}")
    expected = (block_ids.numel(), *cache.shape[1:])
    if tuple(staging.shape) != expected or staging.dtype != cache.dtype:
        raise ValueError(
            f"{name} must be {cache.dtype} of shape {expected} (one row per block id), "
            f"got {staging.dtype} {tuple(staging.shape)}; view a byte buffer with "
            f"`.view(cache.dtype).view({expected})`"
        )


def _kernel_applies(cache: torch.Tensor, staging: torch.Tensor) -> bool:
    """The kernel handles same-device GPU tensors whose blocks are each one dense run
    of bytes (dim 0 may be strided, e.g. the K half of a [2, num_blocks, ...] cache)."""
    return (
        cache.is_cuda
        and staging.device == cache.device
        and staging.is_contiguous()
        and cache[:1].is_contiguous()
        and use_kernels()
    )


def _launch(kernel, cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    with torch.cuda.device(cache.device):
        # Host ids are uploaded here; pass device ids to keep the step free of
        # a synchronous upload.
        ids = block_ids.to(device=cache.device, dtype=torch.int64).contiguous()
        kernel(
            cache.data_ptr(),
            cache.stride(0) * cache.element_size(),
            ids.data_ptr(),
            ids.numel(),
            staging.data_ptr(),
            math.prod(cache.shape[1:]) * cache.element_size(),
            torch.cuda.current_stream().cuda_stream,
        )
