"""Whole-block copies between a paged cache and a contiguous staging buffer.

P/D transfer and offload move a request's cache blocks through one staging
buffer: ``gather_blocks`` packs the chosen blocks into it, ``scatter_blocks``
unpacks it into (possibly different) blocks of another cache.

    cache   [num_blocks, *block_shape]      block ids  [n] int64
    staging [n,          *block_shape]      staging[i] <-> cache[block_ids[i]]

The copy is byte-generic, so any dtype works. On GPU tensors the ``atom._C``
kernel runs when ``use_kernels()``; elsewhere the torch reference does, and
tests compare the two.

``gather_parts`` / ``scatter_parts`` do a whole request at once: several cache
tensors' units (blocks, or a state slot) packed one tensor's part after another
into one uint8 buffer. On a GPU that is one ``copy_runs`` launch over a list of
byte runs built on the host, instead of a launch (and its Python) per tensor.
"""

from __future__ import annotations

import functools
import math

import numpy as np
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


RUN_BYTES = 64 << 10  # copy_runs' runs are at most this long, so one long unit spreads over many blocks

Part = tuple[torch.Tensor, list[int]]  # a cache tensor and the ids of its units to move, in order


def gather_parts(parts: list[Part], packed: torch.Tensor, starts: list[int]) -> None:
    """For each part i: ``packed[starts[i]:]`` viewed as ``[len(ids), *cache.shape[1:]]`` =
    ``cache[ids]``. ``packed`` is uint8; each start must suit its cache's dtype."""
    if _parts_kernel_applies(parts, packed):
        _launch_runs(parts, packed, starts, gather=True)
        return
    for (cache, ids), start in zip(parts, starts):
        gather_blocks_ref(cache, torch.tensor(ids, dtype=torch.int64), _part_view(packed, start, cache, len(ids)))


def scatter_parts(parts: list[Part], packed: torch.Tensor, starts: list[int]) -> None:
    """The inverse of ``gather_parts``: ``cache[ids] =`` each part of ``packed``. Ids must be distinct."""
    if _parts_kernel_applies(parts, packed):
        _launch_runs(parts, packed, starts, gather=False)
        return
    for (cache, ids), start in zip(parts, starts):
        scatter_blocks_ref(cache, torch.tensor(ids, dtype=torch.int64), _part_view(packed, start, cache, len(ids)))


def _part_view(packed: torch.Tensor, start: int, cache: torch.Tensor, n: int) -> torch.Tensor:
    nbytes = n * math.prod(cache.shape[1:]) * cache.element_size()
    return packed[start : start + nbytes].view(cache.dtype).view(n, *cache.shape[1:])


def _parts_kernel_applies(parts: list[Part], packed: torch.Tensor) -> bool:
    return (
        packed.is_cuda
        and packed.dtype == torch.uint8
        and packed.is_contiguous()
        and all(cache.device == packed.device and _units_dense(cache) for cache, _ in parts)
        and use_kernels()
    )


def _units_dense(cache: torch.Tensor) -> bool:
    """Each unit (``cache[i]``) one dense run of bytes; the same as ``cache[:1].is_contiguous()``
    without making a view per call."""
    expected = 1
    for size, stride in zip(reversed(cache.shape[1:]), reversed(cache.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _launch_runs(parts: list[Part], packed: torch.Tensor, starts: list[int], gather: bool) -> None:
    """One copy_runs launch: every unit of every part as runs of at most RUN_BYTES. Parts that share
    their ids (a request's block tensors; its slot tensors) are laid out together, so the host work is a
    few array operations, not a few per tensor (26 tensors took 0.66 ms one by one on the H200's host)."""
    groups: dict[tuple[int, ...], list[tuple[int, int, int, int]]] = {}
    for (cache, ids), start in zip(parts, starts):
        unit = math.prod(cache.shape[1:]) * cache.element_size()
        if ids and unit:
            groups.setdefault(tuple(ids), []).append(
                (cache.data_ptr(), cache.stride(0) * cache.element_size(), unit, start))
    if not groups:
        return
    blocks = []
    for ids, tensors in groups.items():
        info = np.array(tensors, dtype=np.int64)  # [tensors, 4]: address, stride, unit, start
        offsets, lengths, owner = _unit_runs(tuple(t[2] for t in tensors))
        at_cache = (info[owner, 0] + offsets)[:, None] + info[owner, 1][:, None] * np.array(ids, dtype=np.int64)
        at_packed = ((packed.data_ptr() + info[owner, 3] + offsets)[:, None]
                     + info[owner, 2][:, None] * np.arange(len(ids), dtype=np.int64))
        src, dst = (at_cache, at_packed) if gather else (at_packed, at_cache)
        blocks.append(np.stack([src.ravel(), dst.ravel(), np.broadcast_to(lengths[:, None], src.shape).ravel()], 1))
    runs = torch.from_numpy(np.concatenate(blocks))
    with torch.cuda.device(packed.device):
        # A plain upload (a few KB): pinning a fresh buffer each call cost ~0.6 ms on the H200 (GPU_NOTES.md).
        on_device = runs.to(packed.device)
        get_C().copy_runs(on_device.data_ptr(), on_device.shape[0], torch.cuda.current_stream().cuda_stream)


@functools.lru_cache(maxsize=256)
def _unit_runs(units: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For units of these byte sizes (one a tensor): each run's offset in its unit, its length, and
    which tensor it belongs to."""
    pieces = [np.arange(0, unit, RUN_BYTES, dtype=np.int64) for unit in units]
    owner = np.repeat(np.arange(len(units)), [len(p) for p in pieces])
    offsets = np.concatenate(pieces)
    return offsets, np.minimum(np.array(units, dtype=np.int64)[owner] - offsets, RUN_BYTES), owner


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
