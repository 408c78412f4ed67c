"""The host buffer a P/D transfer goes through when the caches live on a GPU.

Mooncake's TCP transport, and its build without CUDA, read and write host memory only. With
``kv_buffer_device="cpu"`` (the default for caches on a GPU) a transfer goes

    producer cache --gather--> producer's host buffer --Mooncake--> consumer's host buffer --scatter--> consumer cache

The gather and the scatter are a ``cache_ops.RunPlan``'s: on a GPU one ``copy_runs`` launch that
writes or reads the pinned buffer itself, the torch references elsewhere. Either side may go
through its buffer or not; the bytes are the same.

Packed order (both sides compute it from the same layout): the cache tensors in the connector's
canonical order, each part starting on 16 bytes; a block tensor's part is the request's blocks in
prompt order, a slot tensor's its one state slot.
"""

from __future__ import annotations

import asyncio
import contextlib

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


class BlockMover:
    """Gathers a request's blocks and slot into packed host bytes, and scatters them back.

    On a GPU one ``copy_runs`` launch moves every tensor's units, and it reads or writes the pinned
    host bytes itself (zero-copy): no device buffer of the transfer's size, which the cache's memory
    budget never counted, and no second copy. Blocking (each call waits for its kernel): run it in a
    worker thread. The kernels run on a stream of their own:
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

    def _gaps(self, starts: list[int], num_blocks: int) -> list[tuple[int, int]]:
        """The padding between the packed parts (``starts``: packed_offsets)."""
        ends = [start + unit * (num_blocks if kind == "block" else 1)
                for start, unit, kind in zip(starts, self.unit_bytes, self.kinds)]
        return [(end, start) for end, start in zip(ends, starts[1:]) if start > end]

    def gather(self, block_ids: list[int], state_slot: int, host: torch.Tensor) -> None:
        """Packs the blocks and the slot into ``host`` (a uint8 region of packed_bytes; pinned when
        the caches are on a GPU)."""
        starts = packed_offsets(self.kinds, self.unit_bytes, len(block_ids))
        for start, end in self._gaps(starts, len(block_ids)):  # no stale bytes go out between the parts
            host[start:end].zero_()
        with self._on_stream(after_queued_work=False):
            self.plan.gather([block_ids, [state_slot]], host, starts)
            self._wait()

    def scatter(self, host: torch.Tensor, block_ids: list[int], state_slot: int) -> None:
        """Unpacks ``host`` (as ``gather`` packed it) into the blocks and the slot."""
        starts = packed_offsets(self.kinds, self.unit_bytes, len(block_ids))
        with self._on_stream(after_queued_work=True):
            self.plan.scatter([block_ids, [state_slot]], host, starts)
            self._wait()

    def _on_stream(self, after_queued_work: bool):
        if self._stream is None:
            return contextlib.nullcontext()
        if after_queued_work:
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
        return torch.cuda.stream(self._stream)

    def _wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
