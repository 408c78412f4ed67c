"""The P/D host buffer's pieces (atom/kv_transfer/mooncake/staging.py), on the CPU: the packed layout,
lending regions of the buffer, and the block mover's bytes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from atom.kv_transfer.mooncake.staging import ALIGN, BlockMover, HostBuffer, packed_bytes, packed_offsets


def test_packed_parts_start_on_16_bytes():
    kinds, units = ["block", "slot", "block", "slot"], [100, 30, 64, 8]
    # 3 blocks: 300 bytes, then 30 (at 304), then 192 (at 336), then 8 (at 528).
    assert packed_offsets(kinds, units, 3) == [0, 304, 336, 528, 536]
    assert packed_bytes(kinds, units, 3) == 536
    assert packed_bytes(kinds, units, 0) == 40  # the slots only: 30 bytes at 0, 8 at 32


def test_regions_are_lent_first_fit_and_coalesce_when_given_back():
    buf = HostBuffer(8 * ALIGN, pin=False)
    a, b, c = buf.take(ALIGN), buf.take(2 * ALIGN - 5), buf.take(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and buf.bytes_lent == 4 * ALIGN
    assert buf.take(5 * ALIGN) is None  # 4 units are free
    buf.give_back(b)
    assert buf.take(3 * ALIGN) == 4 * ALIGN  # b's 2 units are too few; the tail fits
    buf.give_back(a)
    assert buf.take(2 * ALIGN) == 0  # a and b's runs merged
    for offset in (0, 3 * ALIGN, 4 * ALIGN):
        buf.give_back(offset)
    assert buf.bytes_lent == 0 and buf.take(8 * ALIGN) == 0  # one run again


def test_acquire_waits_for_a_region_and_gives_up_in_time():
    asyncio.run(_acquire_waits_and_gives_up())  # no pytest-asyncio needed (the GPU machine has none)


async def _acquire_waits_and_gives_up() -> None:
    buf = HostBuffer(4 * ALIGN, pin=False)
    first = await buf.acquire(3 * ALIGN, timeout=1)
    waiter = asyncio.ensure_future(buf.acquire(2 * ALIGN, timeout=5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    buf.give_back(first)
    assert await asyncio.wait_for(waiter, 1) == 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(asyncio.TimeoutError):
        await buf.acquire(3 * ALIGN, timeout=0.1)
    assert 0.09 < loop.time() - start < 1
    with pytest.raises(ValueError, match="does not fit in kv_buffer_size=1024; raise kv_buffer_size"):
        await buf.acquire(4 * ALIGN + 1, timeout=1)


def test_mover_packs_blocks_then_slots_and_unpacks_them_elsewhere():
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(9, 16, 3, generator=g), torch.randn(5, 7, generator=g).to(torch.bfloat16),
              torch.randn(9, 2, 4, generator=g).to(torch.bfloat16), torch.randn(5, 4, 4, generator=g)]
    kinds = ["block", "slot", "block", "slot"]
    mover = BlockMover(caches, kinds)
    assert mover.unit_bytes == [192, 14, 16, 64]
    blocks, slot = [7, 2, 5], 3
    starts = packed_offsets(kinds, mover.unit_bytes, 3)
    assert starts == [0, 576, 592, 640, 704]
    host = torch.full((starts[-1],), 0xAB, dtype=torch.uint8)
    mover.gather(blocks, slot, host)
    assert torch.equal(host[0:576].view(torch.float32).view(3, 16, 3), caches[0][blocks])
    assert torch.equal(host[576:590].view(torch.bfloat16), caches[1][slot])
    assert not host[590:592].any()  # the padding goes out as zeros, not stale bytes
    assert torch.equal(host[592:640].view(torch.bfloat16).view(3, 2, 4), caches[2][blocks])
    assert torch.equal(host[640:704].view(torch.float32).view(4, 4), caches[3][slot])
    fresh = [torch.full_like(t, float("nan")) for t in caches]
    BlockMover(fresh, kinds).scatter(host, [0, 8, 4], 1)
    for got, want, kind in zip(fresh, caches, kinds):
        if kind == "block":
            assert torch.equal(got[[0, 8, 4]], want[blocks])
            assert got[[1, 2, 3, 5, 6, 7]].isnan().all()  # nothing else written
        else:
            assert torch.equal(got[1], want[slot]) and got[[0, 2, 3, 4]].isnan().all()
