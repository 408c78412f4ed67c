"""The P/D host buffer's gather and scatter on a GPU, against plain copies of the same bytes.

A request's blocks of a paged cache (and one state slot) go to pinned host memory through
``BlockMover.gather`` (the gather kernel into a device buffer, one copy to the host) and back
through ``BlockMover.scatter``. The baselines, timed in the same process and interleaved, are one
``copy_`` of the same number of contiguous bytes device -> pinned host and back: what the PCIe
link gives one copy. Each figure is the best of three interleaved rounds, a round's figure the
median of ``--repeats`` calls (wall time: each call waits for its copies, as the connector's
worker thread does).

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

from atom.kv_transfer.mooncake.staging import BlockMover, packed_bytes  # noqa: E402

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
    print(f"{'tokens':>7} {'MiB':>8} {'gather GB/s':>12} {'D2H copy GB/s':>14} {'ratio':>6} "
          f"{'scatter GB/s':>13} {'H2D copy GB/s':>14} {'ratio':>6}")
    for n in lens:
        blocks = torch.randperm(num_blocks)[: n // BLOCK].tolist()
        nbytes = packed_bytes(kinds, mover.unit_bytes, len(blocks))
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        device = torch.empty(nbytes, dtype=torch.uint8, device=args.device)

        def d2h():
            host.copy_(device, non_blocking=True)
            if cuda:
                torch.cuda.current_stream().synchronize()

        def h2d():
            device.copy_(host, non_blocking=True)
            if cuda:
                torch.cuda.current_stream().synchronize()

        for fn in (lambda: mover.gather(blocks, 1, host), d2h, lambda: mover.scatter(host, blocks, 0), h2d):
            fn()  # warm-up: allocations, first launches
        rows = {name: [] for name in ("gather", "d2h", "scatter", "h2d")}
        for _ in range(3):  # interleaved rounds
            rows["gather"].append(median_seconds(lambda: mover.gather(blocks, 1, host), args.repeats))
            rows["d2h"].append(median_seconds(d2h, args.repeats))
            rows["scatter"].append(median_seconds(lambda: mover.scatter(host, blocks, 0), args.repeats))
            rows["h2d"].append(median_seconds(h2d, args.repeats))
        rate = {name: nbytes / min(times) / 1e9 for name, times in rows.items()}
        print(f"{n:>7} {nbytes / 2**20:>8.1f} {rate['gather']:>12.2f} {rate['d2h']:>14.2f} "
              f"{rate['gather'] / rate['d2h']:>6.2f} {rate['scatter']:>13.2f} {rate['h2d']:>14.2f} "
              f"{rate['scatter'] / rate['h2d']:>6.2f}")


if __name__ == "__main__":
    main()
