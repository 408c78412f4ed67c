"""A thin wrapper over Mooncake's ``TransferEngine``: start, register memory, write.

Facts it relies on (see shared/reference/mooncake.md): ``initialize`` with
``"P2PHANDSHAKE"`` needs no metadata server and a peer is named
``f"{host}:{rpc_port}"``; a write target must have registered its memory; the
sync writes return 0 or -1 and never raise; a batch of more than 2048 entries to
one peer fails at once, so batches are cut at ``MAX_BATCH``.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Iterable

MAX_BATCH = 1024


class TransferError(RuntimeError):
    pass


def installed_without_cuda() -> bool:
    """Whether the installed Mooncake is the build that reads and writes host memory only."""
    try:
        importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def merge_runs(entries: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Coalesce (src, dst, length) entries whose source and destination both continue the
    previous entry's, so consecutive blocks go as one write."""
    merged: list[list[int]] = []
    for src, dst, length in entries:
        if merged:
            last = merged[-1]
            if last[0] + last[2] == src and last[1] + last[2] == dst:
                last[2] += length
                continue
        merged.append([src, dst, length])
    return [(s, d, n) for s, d, n in merged]


class MooncakeTransfer:
    def __init__(self, host: str, protocol: str = "tcp", device_name: str = "") -> None:
        self.host = host
        self.protocol = protocol
        self.device_name = device_name
        self._engine = None
        self._registered: list[int] = []

    def start(self) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "P/D needs the Mooncake transfer engine: pip install mooncake-transfer-engine-non-cuda "
                "(CPU hosts; also apt-get install libibverbs1) or mooncake-transfer-engine (CUDA hosts)"
            ) from e
        # Without it Mooncake advertises the machine's first external interface, not `host`.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.host)
        engine = TransferEngine()
        rc = engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, self.device_name)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({self.host!r}, 'P2PHANDSHAKE', {self.protocol!r}, "
                f"{self.device_name!r}) returned {rc}; check the host address and, for rdma, device_name"
            )
        self._engine = engine

    @property
    def session_id(self) -> str:
        return f"{self.host}:{self._engine.get_rpc_port()}"

    def register(self, addr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(addr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({addr:#x}, {nbytes}) returned {rc}")
        self._registered.append(addr)

    def write(self, peer: str, entries: list[tuple[int, int, int]], deadline: float) -> None:
        """Write (src, dst, length) entries into ``peer``'s registered memory, in batches.
        Starts no batch after ``deadline`` (time.monotonic()). Blocking: run it off the loop."""
        runs = merge_runs(entries)
        for start in range(0, len(runs), MAX_BATCH):
            if time.monotonic() > deadline:
                raise TransferError(f"gave up before batch {start // MAX_BATCH}: the consumer's time budget ran out")
            batch = runs[start : start + MAX_BATCH]
            rc = self._engine.batch_transfer_sync_write(
                peer, [s for s, _, _ in batch], [d for _, d, _ in batch], [n for _, _, n in batch]
            )
            if rc != 0:
                raise TransferError(f"Mooncake batch write of {len(batch)} entries to {peer} returned {rc}")

    def close(self) -> None:
        if self._engine is not None and self._registered:
            self._engine.batch_unregister_memory(self._registered)
        self._registered.clear()
        self._engine = None
