"""The P/D host buffer's gather and scatter on a GPU, against plain copies of the same bytes.

A request's blocks of a paged cache (and one state slot) go to pinned host memory through
``BlockMover.gather`` (``copy_runs`` launches into a bounded device buffer, each window copied to
the host) and back through ``BlockMover.scatter``. Baselines, timed in the same process and
interleaved:
- one ``copy_`` of the same number of contiguous bytes device -> pinned host and back: what the
  PCIe link gives one copy;
- "zero-copy": one ``copy_runs`` launch that writes (reads) the pinned bytes itself over the bus.
Each figure is the best of three interleaved rounds, a round's figure the median of ``--repeats``
calls (wall time: each call waits for its copies, as the connector's worker thread does).

    python bench/pd_staging_gpu.py [--tokens 1024,4096,16384] [--repeats 20] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from atom.kv_transfer.mooncake.staging import BlockMover, packed_bytes, packed_offsets  # noqa: E402

BLOCK = 16


def caches(num_blocks: int, device: str) -> tuple[list[torch.Tensor], list[str]]:
    """The bench model's shape (bench/decode_gpu.py): 2 MLA layers' latent caches (576 bf16 a token)
    and 6 KDA layers' states (32 heads of 128 x 128 fp32, and three short-conv states)."""
    tensors, kinds = [], []
    for _ in range(2):
        tensors.append(torch.randn(num_blocks, BLOCK, 576, device=device).to(torch.bfloat16))
        kinds.append("block")
    for _ in range(6):
        tensors.append(torch.randn(2, 32, 128, 128, device=device))
        kinds.append("slot")
        for _ in range(3):
            tensors.append(torch.randn(2, 4096, 3, device=device).to(torch.bfloat16))
            kinds.append("slot")
    return tensors, kinds


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no copies cross a link)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    lens = [int(n) for n in args.tokens.split(",")]
    num_blocks = max(lens) // BLOCK * 2
    tensors, kinds = caches(num_blocks, args.device)
    mover = BlockMover(tensors, kinds)
    print(f"{'tokens':>7} {'MiB':>8} {'gather GB/s':>12} {'zero-copy':>9} {'D2H copy':>9} {'ratio':>6} "
          f"{'scatter GB/s':>13} {'zero-copy':>9} {'H2D copy':>9} {'ratio':>6}")
    for n in lens:
        blocks = torch.randperm(num_blocks)[: n // BLOCK].tolist()
        nbytes = packed_bytes(kinds, mover.unit_bytes, len(blocks))
        starts = packed_offsets(kinds, mover.unit_bytes, len(blocks))
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        device = torch.empty(nbytes, dtype=torch.uint8, device=args.device)

        def sync():
            if cuda:
                torch.cuda.current_stream().synchronize()

        def d2h():
            host.copy_(device, non_blocking=True)
            sync()

        def h2d():
            device.copy_(host, non_blocking=True)
            sync()

        def zero_copy_gather():
            mover.plan.gather([blocks, [1]], host, starts)
            sync()

        def zero_copy_scatter():
            mover.plan.scatter([blocks, [0]], host, starts)
            sync()

        calls = {"gather": lambda: mover.gather(blocks, 1, host), "zero_copy_gather": zero_copy_gather, "d2h": d2h,
                 "scatter": lambda: mover.scatter(host, blocks, 0), "zero_copy_scatter": zero_copy_scatter, "h2d": h2d}
        for fn in calls.values():
            fn()  # warm-up: allocations, first launches
        rows = {name: [] for name in calls}
        for _ in range(3):  # interleaved rounds
            for name, fn in calls.items():
                rows[name].append(median_seconds(fn, args.repeats))
        rate = {name: nbytes / min(times) / 1e9 for name, times in rows.items()}
        print(f"{n:>7} {nbytes / 2**20:>8.1f} {rate['gather']:>12.2f} {rate['zero_copy_gather']:>9.2f} "
              f"{rate['d2h']:>9.2f} {rate['gather'] / rate['d2h']:>6.2f} {rate['scatter']:>13.2f} "
              f"{rate['zero_copy_scatter']:>9.2f} {rate['h2d']:>9.2f} {rate['scatter'] / rate['h2d']:>6.2f}")

if __name__ == "__main__":
    main()
