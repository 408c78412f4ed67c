"""The host buffer a P/D transfer goes through when the caches live on a GPU.

Mooncake's TCP transport, and its build without CUDA, read and write host memory only. With
``kv_buffer_device="cpu"`` (the default for caches on a GPU) a transfer goes

    producer cache --gather--> producer's host buffer --Mooncake--> consumer's host buffer --scatter--> consumer cache

The gather and the scatter are a ``cache_ops.RunPlan``'s run list: on a GPU ``copy_runs`` launches
through a bounded device buffer and copies to and from the pinned buffer (``BlockMover``), the torch
references elsewhere. Either side may go through its buffer or not; the bytes are the same.

Packed order (both sides compute it from the same layout): the cache tensors in the connector's
canonical order, each part starting on 16 bytes; a block tensor's part is the request's blocks in
prompt order, a slot tensor's its one state slot.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from atom.ops import cache_ops

ALIGN = 256  # regions of the host buffer start on this many bytes
PART_ALIGN = 16  # each tensor's part of the packed bytes starts on this many bytes, so it views as its dtype


def packed_offsets(kinds: list[str], unit_bytes: list[int], num_blocks: int) -> list[int]:
    """Where each tensor's part of one request's packed bytes starts, and (last) where they end."""
    offsets, at = [], 0
    for kind, unit in zip(kinds, unit_bytes):
        at = -(-at // PART_ALIGN) * PART_ALIGN
        offsets.append(at)
        at += unit * (num_blocks if kind == "block" else 1)
    return offsets + [at]


def packed_bytes(kinds: list[str], unit_bytes: list[int], num_blocks: int) -> int:
    """Bytes of one request's blocks and state slot, packed."""
    return packed_offsets(kinds, unit_bytes, num_blocks)[-1]


class HostBuffer:
    """``nbytes`` of host memory (pinned when ``pin``), lent out as regions, first fit.

    Used from one event loop; the bytes of a lent region are read and written by worker threads."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.addr = self.tensor.data_ptr()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), by offset, never adjacent
        self._lent: dict[int, int] = {}  # offset -> length
        self._returned: asyncio.Event | None = None

    @property
    def bytes_lent(self) -> int:
        return sum(self._lent.values())

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes]

    def take(self, nbytes: int) -> int | None:
        """A region's offset, or None if no free run is long enough now."""
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self._lent[offset] = need
                return offset
        return None

    def give_back(self, offset: int) -> None:
        length = self._lent.pop(offset)
        runs = sorted([*self._free, (offset, length)])
        merged: list[tuple[int, int]] = []
        for start, n in runs:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free = merged
        if self._returned is not None:
            self._returned.set()

    async def acquire(self, nbytes: int, timeout: float) -> int:
        """Wait (at most ``timeout`` seconds) until a region of ``nbytes`` is free, and take it."""
        if nbytes > self.nbytes:
            raise ValueError(f"a transfer of {nbytes} bytes does not fit in kv_buffer_size={self.nbytes}; "
                             f"raise kv_buffer_size in kv_transfer_config")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (offset := self.take(nbytes)) is None:
            if self._returned is None:
                self._returned = asyncio.Event()
            self._returned.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(self._returned.wait(), left)
        return offset


STAGING_BYTES = 64 << 20  # a GPU mover's device buffer: a larger transfer goes through it a window at a time


class BlockMover:
    """Gathers a request's blocks and slot into packed host bytes, and scatters them back.

    On a GPU a ``copy_runs`` launch packs every tensor's units into a device buffer of
    ``STAGING_BYTES`` (allocated with the mover, at the engine's start) and one copy takes them to
    the host, a window at a time (the reverse for a scatter). Not straight into the pinned region: a
    kernel that crosses the bus itself holds its SMs for the whole transfer, and beside a
    memory-bound kernel that cost the H200 ~80% of that kernel's speed (GPU_NOTES.md, session 32);
    the copy engine costs it nothing. Blocking (each call waits for its copies): run it in a worker
    thread. The work runs on a stream of its own:
    - a gather does not wait for the engine's forward passes (the default stream): the blocks and slot
      of a hold were last written by the step that finished the request, whose tokens reached the
      host before the hold existed, and nothing writes them until the hold is released. So a busy
      producer's next prefill chunk does not delay a transfer;
    - a scatter first waits for the work already queued there: its blocks were just allocated, and a
      step queued before (overlapped scheduling) may still write into them for their former owner."""

    def __init__(self, tensors: list[torch.Tensor], kinds: list[str]) -> None:
        self.tensors, self.kinds = tensors, kinds
        self.device = tensors[0].device
        self.unit_bytes = [t.stride(0) * t.element_size() for t in tensors]
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.plan = cache_ops.RunPlan(tensors, [0 if kind == "block" else 1 for kind in kinds])
        self._enqueue = threading.Lock()  # one transfer's windows go on the stream together
        self._staging: torch.Tensor | None = None
        if self.plan.uses_kernel:  # at start-up: a buffer that does not fit fails there, not on a request
            self._staging_buffer()

    def _gaps(self, starts: list[int], num_blocks: int) -> list[tuple[int, int]]:
        """The padding between the packed parts (``starts``: packed_offsets)."""
        ends = [start + unit * (num_blocks if kind == "block" else 1)
                for start, unit, kind in zip(starts, self.unit_bytes, self.kinds)]
        return [(end, start) for end, start in zip(ends, starts[1:]) if start > end]

    def gather(self, block_ids: list[int], state_slot: int, host: torch.Tensor) -> None:
        """Packs the blocks and the slot into ``host`` (a uint8 region of packed_bytes)."""
        starts = packed_offsets(self.kinds, self.unit_bytes, len(block_ids))
        self._move([block_ids, [state_slot]], host, starts, gather=True)
        for start, end in self._gaps(starts, len(block_ids)):  # no stale bytes go out between the parts
            host[start:end].zero_()

    def scatter(self, host: torch.Tensor, block_ids: list[int], state_slot: int) -> None:
        """Unpacks ``host`` (as ``gather`` packed it) into the blocks and the slot."""
        starts = packed_offsets(self.kinds, self.unit_bytes, len(block_ids))
        self._move([block_ids, [state_slot]], host, starts, gather=False)

    def _move(self, ids: list[list[int]], host: torch.Tensor, starts: list[int], gather: bool) -> None:
        if not self.plan.uses_kernel:
            (self.plan.gather if gather else self.plan.scatter)(ids, host, starts)  # the torch reference
            return
        if not gather:
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
        runs = self.plan.run_list(ids, 0, starts, gather)  # the packed side as offsets
        column = 1 if gather else 0
        with self._enqueue, torch.cuda.stream(self._stream):
            staging = self._staging_buffer()
            for start in range(0, starts[-1], staging.numel()):  # starts[-1]: where the packed bytes end
                end = min(start + staging.numel(), starts[-1])
                window = cache_ops.runs_within(runs, column, start, end, staging.data_ptr())
                if gather:
                    cache_ops.launch_runs(window, self.device, gather=True)
                    host[start:end].copy_(staging[: end - start], non_blocking=True)
                else:
                    staging[: end - start].copy_(host[start:end], non_blocking=True)
                    cache_ops.launch_runs(window, self.device, gather=False)
        self._stream.synchronize()

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            try:
                self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=self.device)
            except torch.cuda.OutOfMemoryError as e:
                raise ValueError(
                    f"no room on {self.device} for the P/D transfers' {STAGING_BYTES / 2**20:.0f} MiB device buffer "
                    "beside the model and the KV cache; lower --kv-cache-memory by that much (or --max-num-seqs "
                    "or --max-model-len)") from e
        return self._staging

