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
byte runs built on the host, instead of a launch (and its Python) per tensor. The
buffer may be in the caches' device memory or in pinned host memory: the kernel
then reads or writes the host bytes over the bus itself (zero-copy). That needs no
device buffer, but the kernel holds its SMs for the whole transfer, so the P/D
mover goes through a device buffer and the copy engine instead (``runs_within``).
"""

from __future__ import annotations

import functools
import math
from typing import Union

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
Ids = Union[dict[int, list[int]], list[list[int]]]  # a RunPlan call's unit ids, by group


def gather_parts(parts: list[Part], packed: torch.Tensor, starts: list[int]) -> None:
    """For each part i: ``packed[starts[i]:]`` viewed as ``[len(ids), *cache.shape[1:]]`` =
    ``cache[ids]``. ``packed`` is uint8; each start must suit its cache's dtype. Like a
    ``non_blocking`` copy, the kernel is queued on the current stream: synchronize it before
    reading a pinned host ``packed``."""
    plan, ids = RunPlan.of_parts(parts)
    plan.gather(ids, packed, starts)


def scatter_parts(parts: list[Part], packed: torch.Tensor, starts: list[int]) -> None:
    """The inverse of ``gather_parts``: ``cache[ids] =`` each part of ``packed``. Ids must be distinct."""
    plan, ids = RunPlan.of_parts(parts)
    plan.scatter(ids, packed, starts)


class RunPlan:
    """``gather_parts`` / ``scatter_parts`` for a fixed list of cache tensors (which must not move),
    prepared once.

    ``groups[i]`` says which tensors share their unit ids (a request's block tensors; its slot
    tensors): a call passes one id list a group. All a call computes is the run list's addresses,
    a few array operations a group; looking at every tensor again on each call cost ~0.25 ms on
    the H200's host for the 26 tensors of the decode bench model (GPU_NOTES.md, session 32)."""

    def __init__(self, caches: list[torch.Tensor], groups: list[int]) -> None:
        self.caches, self.groups = caches, groups
        device = caches[0].device if caches else torch.device("cpu")
        self.device = device
        self._on_gpu = device.type == "cuda" and all(c.device == device and _units_dense(c) for c in caches)
        # Per group, one entry a run of one unit: which tensor, its offset in the unit, its address in unit 0,
        # the tensor's unit stride and unit bytes, its length.
        self._plans: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for group in sorted(set(groups)):
            members = [i for i, g in enumerate(groups) if g == group]
            units = tuple(math.prod(caches[i].shape[1:]) * caches[i].element_size() for i in members)
            offsets, lengths, owner = _unit_runs(units)
            tensor = np.array(members, dtype=np.int64)[owner]
            address = np.array([caches[i].data_ptr() for i in members], dtype=np.int64)[owner]
            stride = np.array([caches[i].stride(0) * caches[i].element_size() for i in members], dtype=np.int64)
            self._plans.append((group, tensor, offsets, address + offsets, stride[owner],
                                np.array(units, dtype=np.int64)[owner], lengths))

    @property
    def uses_kernel(self) -> bool:
        """Whether ``copy_runs`` can move these caches' units (into packed bytes on their GPU)."""
        return self._on_gpu and use_kernels()

    @classmethod
    def of_parts(cls, parts: list[Part]) -> tuple[RunPlan, Ids]:
        """A plan for one call: parts with equal id lists form a group."""
        group_of: dict[tuple[int, ...], int] = {}
        groups = [group_of.setdefault(tuple(ids), len(group_of)) for _, ids in parts]
        return cls([cache for cache, _ in parts], groups), {g: list(ids) for ids, g in group_of.items()}

    def gather(self, ids: Ids, packed: torch.Tensor, starts: list[int]) -> None:
        """Each tensor's units ``ids[its group]`` into ``packed`` from ``starts[tensor]`` on."""
        self._move(ids, packed, starts, gather=True)

    def scatter(self, ids: Ids, packed: torch.Tensor, starts: list[int]) -> None:
        """The inverse of ``gather``. Ids must be distinct."""
        self._move(ids, packed, starts, gather=False)

    def run_list(self, ids: Ids, packed_address: int, starts: list[int], gather: bool) -> np.ndarray:
        """copy_runs' int64 [runs, 3] (source, destination, bytes), the packed bytes at ``packed_address``."""
        at = np.asarray(starts, dtype=np.int64)
        blocks = [np.empty((0, 3), dtype=np.int64)]
        for group, tensor, offsets, cache_at, stride, unit, lengths in self._plans:
            unit_ids = np.asarray(ids[group], dtype=np.int64)
            if not unit_ids.size or not lengths.size:
                continue
            at_cache = cache_at[:, None] + stride[:, None] * unit_ids
            at_packed = (packed_address + at[tensor] + offsets)[:, None] + unit[:, None] * np.arange(unit_ids.size)
            src, dst = (at_cache, at_packed) if gather else (at_packed, at_cache)
            blocks.append(np.stack([src.ravel(), dst.ravel(), np.repeat(lengths, unit_ids.size)], 1))
        return np.concatenate(blocks)

    def _move(self, ids: Ids, packed: torch.Tensor, starts: list[int], gather: bool) -> None:
        address = self._kernel_address(packed)
        if address is not None:
            launch_runs(self.run_list(ids, address, starts, gather), self.device, gather=gather)
            return
        ref = gather_blocks_ref if gather else scatter_blocks_ref
        for cache, group, start in zip(self.caches, self.groups, starts):
            unit_ids = ids[group]
            ref(cache, torch.tensor(unit_ids, dtype=torch.int64), _part_view(packed, start, cache, len(unit_ids)))

    def _kernel_address(self, packed: torch.Tensor) -> int | None:
        """Where the kernel reaches ``packed``, or None where the torch reference runs: the kernel needs the
        caches on one GPU with dense units, and ``packed`` on that GPU or in host memory mapped for it."""
        if not (self.uses_kernel and packed.dtype == torch.uint8 and packed.is_contiguous()):
            return None
        if packed.device == self.device:
            return packed.data_ptr()
        if packed.device.type != "cpu":
            return None
        try:
            return get_C().mapped_address(packed.data_ptr())
        except RuntimeError:  # pageable memory, or pinned without a device mapping
            return None


def runs_within(runs: np.ndarray, packed_column: int, start: int, end: int, address: int) -> np.ndarray:
    """The parts of ``runs`` whose packed side (column 0 or 1, an offset into the packed bytes) falls
    in ``[start, end)``, cut at those bounds, with that side moved to ``address + offset - start``.
    Moving a request through a device buffer smaller than it, a window at a time."""
    other = 1 - packed_column
    lo = np.maximum(runs[:, packed_column], start)
    hi = np.minimum(runs[:, packed_column] + runs[:, 2], end)
    keep = hi > lo
    out = np.empty((int(keep.sum()), 3), dtype=np.int64)
    out[:, packed_column] = address + lo[keep] - start
    out[:, other] = runs[keep, other] + (lo[keep] - runs[keep, packed_column])
    out[:, 2] = hi[keep] - lo[keep]
    return out


def _part_view(packed: torch.Tensor, start: int, cache: torch.Tensor, n: int) -> torch.Tensor:
    nbytes = n * math.prod(cache.shape[1:]) * cache.element_size()
    return packed[start : start + nbytes].view(cache.dtype).view(n, *cache.shape[1:])


def _units_dense(cache: torch.Tensor) -> bool:
    """Each unit (``cache[i]``) one dense run of bytes; the same as ``cache[:1].is_contiguous()``
    without making a view per call."""
    expected = 1
    for size, stride in zip(reversed(cache.shape[1:]), reversed(cache.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def launch_runs(runs: np.ndarray, device: torch.device, gather: bool) -> None:
    """One copy_runs launch (``gather`` only names the direction, for callers that count launches)."""
    if not len(runs):
        return
    with torch.cuda.device(device):
        # A plain upload (a few KB): pinning a fresh buffer each call cost ~0.6 ms on the H200 (GPU_NOTES.md).
        on_device = torch.from_numpy(runs).to(device)
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
