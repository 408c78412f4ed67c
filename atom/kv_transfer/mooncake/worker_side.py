"""The Mooncake connector's worker half: registered memory, the side channel, the bytes.

Producer: serves Pulls for the holds the scheduler half queued. A Pull is checked
(known, unused transfer id; the same cache layout; every destination block and slot
inside the regions the consumer declared) before anything is written; then the held
prompt blocks go block for block, and the one state slot (the state at exactly the
prompt boundary), into the consumer's memory. A hold ends when the consumer says
Done, its transfer fails, or its lease runs out, never while a write reads it.

Consumer: one task per load: Pull, wait for the reply (bounded by transfer_timeout),
report, then Done. A load cancelled midway is still awaited and reported (as failed
"aborted"), so its blocks are freed only when no write can land in them.

Canonical layout: cache layers in id order, each layer's tensors in order; one entry
per tensor: (addr, unit_bytes, num_units), a unit being a block ("block" layers) or a
slot ("slot" layers).

Host buffer (``kv_buffer_device="cpu"``, the default for caches on a GPU; staging.py):
Mooncake then touches only a registered host buffer. The producer gathers the held blocks
and slot into a region of its buffer when a Pull comes and writes from there; the consumer
names a region of its buffer in the Pull and scatters it into its blocks and slot once the
reply says the bytes landed. Either side may do this without the other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.kv_transfer.base import (
    DEFAULT_KV_BUFFER_SIZE, ConnectorMetadata, ConnectorOutput, HoldSpec, KVTransferConfig, LoadSpec,
)
from atom.kv_transfer.mooncake.scheduler_side import MooncakeConnectorScheduler, cdiv
from atom.kv_transfer.mooncake.side_channel import (
    ClientMessage, Done, FrameError, HostRegion, Pull, Reply, SideChannelClient, SideChannelServer, TensorLayout,
    bind_listener,
)
from atom.kv_transfer.mooncake.staging import BlockMover, HostBuffer, packed_bytes, packed_offsets
from atom.kv_transfer.mooncake.transfer import MooncakeTransfer, installed_without_cuda

logger = logging.getLogger(__name__)

OUTSIDE_REGIONS = "request names blocks outside the registered regions"
DONE_TIMEOUT_S = 5.0


@dataclass
class _Hold:
    spec: HoldSpec
    src_block_ids: list[int]  # the prompt's blocks, in order
    pulling: bool = False  # a write is reading the blocks now
    pulled: bool = False
    release_after_write: bool = False  # Done or lease expiry came while pulling


class MooncakeConnectorWorker:
    def __init__(
        self,
        kv_config: KVTransferConfig,
        engine_id: str,
        caches: dict[int, tuple[torch.Tensor, ...]],
        cache_kinds: dict[int, str],
        scheduler_half: MooncakeConnectorScheduler,
    ) -> None:
        self.kv_config = kv_config
        self.engine_id = engine_id
        self.scheduler_half = scheduler_half
        self.is_producer = kv_config.is_producer
        self._block_size = scheduler_half.block_size
        self._kinds: list[str] = []
        self._layout: list[TensorLayout] = []
        for layer in sorted(caches):
            kind = cache_kinds[layer]
            if kind not in ("block", "slot"):
                raise ValueError(f"cache kind of layer {layer} is {kind!r}; expected 'block' or 'slot'")
            for t in caches[layer]:
                if not t.is_contiguous():
                    raise ValueError(f"layer {layer}'s cache tensor must be contiguous to be registered")
                self._kinds.append(kind)
                self._layout.append(TensorLayout(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0]))
        self._nbytes = [t.nbytes for layer in sorted(caches) for t in caches[layer]]
        self._unit_bytes = [e.unit_bytes for e in self._layout]
        self._num_blocks = min((e.num_units for k, e in zip(self._kinds, self._layout) if k == "block"), default=0)
        self._num_slots = min((e.num_units for k, e in zip(self._kinds, self._layout) if k == "slot"), default=0)
        self._has_slots = "slot" in self._kinds
        tensors = [t for layer in sorted(caches) for t in caches[layer]]
        self._cache_device = tensors[0].device if tensors else torch.device("cpu")
        # Through a host buffer: its regions are lent per transfer; the buffer is made in start().
        self._mover = BlockMover(tensors, self._kinds) if kv_config.uses_host_buffer(self._cache_device) else None
        if self._mover is None and self._cache_device.type != "cpu" and installed_without_cuda():
            raise ValueError(
                f"kv_buffer_device 'cache' registers the caches on {self._cache_device} with Mooncake, but the "
                "installed mooncake-transfer-engine-non-cuda reads host memory only; use kv_buffer_device 'cpu' "
                "(or 'auto'), or install Mooncake's CUDA build (mooncake-transfer-engine) instead")
        self._host: HostBuffer | None = None
        self.host_buffer_size = kv_config.kv_buffer_size or DEFAULT_KV_BUFFER_SIZE  # the engine may size it to fit
        self.staged_bytes = 0  # gathered into or scattered from the host buffer, in all
        # Called on the loop when there is something for take_output (a load ended, a hold was released),
        # so that an engine waiting on transfers need not wait for its next poll.
        self.on_output: Callable[[], None] | None = None

        self._transfer = MooncakeTransfer(kv_config.host, kv_config.protocol, kv_config.device_name)
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake-write")
        self._server: SideChannelServer | None = None
        # Producer.
        self._holds: dict[str, _Hold] = {}
        self._released: set[str] = set()
        # Consumer.
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()
        self._loaded: set[str] = set()
        self._failed: dict[str, str] = {}

    @property
    def session_id(self) -> str:
        """This rank's Mooncake session (``host:rpc_port``); valid after ``start()``."""
        return self._transfer.session_id

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the side channel (a clear error if the port is taken), start Mooncake,
        register every cache tensor, then serve. Done before the engine reports ready."""
        host, port = self.kv_config.host, self.kv_config.handshake_port
        sock = bind_listener(host, port)
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._start_transfer)
            self._server = SideChannelServer(sock, self._on_message)
            await self._server.start()
        except BaseException:
            sock.close()
            raise
        self.scheduler_half.side_channel_port = self._server.port
        logger.info("P/D %s %s: side channel on %s:%d, Mooncake session %s", self.kv_config.kv_role,
                    self.engine_id, host, self._server.port, self._transfer.session_id)

    def _start_transfer(self) -> None:
        self._transfer.start()
        if self._mover is None:
            for entry, nbytes in zip(self._layout, self._nbytes):
                self._transfer.register(entry.addr, nbytes)
        else:  # only the host buffer: Mooncake never sees the caches
            self._host = HostBuffer(self.host_buffer_size, pin=self._cache_device.type == "cuda")
            self._transfer.register(self._host.addr, self._host.nbytes)

    @property
    def uses_host_buffer(self) -> bool:
        return self._mover is not None

    def packed_bytes(self, num_tokens: int) -> int:
        """Bytes of one request's blocks and slot for a prompt of ``num_tokens``."""
        return self._packed_size(cdiv(num_tokens, self._block_size))

    @property
    def host_buffer_bytes_lent(self) -> int:
        return self._host.bytes_lent if self._host is not None else 0

    async def shutdown(self) -> None:
        if self._server is not None:
            await self._server.close()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Writes in flight read our memory: let them end before it is unregistered.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._executor.shutdown)
        await loop.run_in_executor(None, self._transfer.close)  # Mooncake's teardown takes ~1 s

    # -- the engine's per-step calls --------------------------------------------------
    def handle(self, meta: ConnectorMetadata) -> None:
        for hold in meta.holds:
            self._add_hold(hold)
        for load in meta.loads:
            if load.request_id in self._tasks:
                raise RuntimeError(f"P/D consumer invariant broken: a second load for request {load.request_id}")
            self._tasks[load.request_id] = asyncio.get_running_loop().create_task(self._load(load))
        for request_id in meta.cancelled_loads:
            self._cancel(request_id)

    def take_output(self) -> ConnectorOutput:
        if self.is_producer:
            self._expire_leases()
        out = ConnectorOutput(loaded=self._loaded, failed=self._failed, released=self._released)
        self._loaded, self._failed, self._released = set(), {}, set()
        return out

    # -- producer ----------------------------------------------------------------------
    def _add_hold(self, spec: HoldSpec) -> None:
        src = spec.block_ids[: cdiv(spec.num_tokens, self._block_size)]
        broken = (
            spec.transfer_id in self._holds
            or len(src) != cdiv(spec.num_tokens, self._block_size)
            or any(not 0 <= b < self._num_blocks for b in src)
            or (self._has_slots and not 0 <= spec.state_slot < self._num_slots)
            or (not self._has_slots and spec.state_slot != -1)
        )
        if broken:
            raise RuntimeError(f"P/D producer invariant broken: bad hold {spec} for {self._num_blocks} blocks, "
                               f"{self._num_slots} slots, block_size {self._block_size}")
        self._holds[spec.transfer_id] = _Hold(spec, src)

    def _release(self, transfer_id: str, why: str) -> None:
        del self._holds[transfer_id]
        self._released.add(transfer_id)
        logger.debug("P/D transfer %s released: %s", transfer_id, why)
        self._notify()

    def _notify(self) -> None:
        if self.on_output is not None:
            self.on_output()

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for transfer_id, hold in list(self._holds.items()):
            if hold.spec.deadline > now:
                continue
            if hold.pulling:
                hold.release_after_write = True
            else:
                logger.warning("P/D transfer %s: lease expired before the consumer finished; freeing", transfer_id)
                self._release(transfer_id, "lease expired")

    async def _on_message(self, msg: ClientMessage) -> Reply:
        if isinstance(msg, Done):
            return self._on_done(msg)
        return await self._on_pull(msg)

    def _on_done(self, done: Done) -> Reply:
        hold = self._holds.get(done.transfer_id)
        if hold is None:
            return _refuse(done.transfer_id, "Done for an unknown or already released transfer id")
        if hold.pulling:
            hold.release_after_write = True
        else:
            self._release(done.transfer_id, "consumer done")
        return Reply(done.transfer_id, ok=True)

    async def _on_pull(self, pull: Pull) -> Reply:
        hold = self._holds.get(pull.transfer_id)
        if hold is None:
            return _refuse(pull.transfer_id, "unknown transfer id (never held here, already released, or expired)")
        if hold.pulling or hold.pulled:
            return _refuse(pull.transfer_id, "transfer already pulled; a transfer id is used once")
        error = self._check_pull(pull, hold)
        if error is not None:
            return _refuse(pull.transfer_id, error)
        hold.pulling = True
        deadline = time.monotonic() + pull.budget_s
        loop = asyncio.get_running_loop()
        region = None
        try:
            if self._host is not None:  # gather into a region of the host buffer and write from there
                nbytes = self._packed_size(len(hold.src_block_ids))
                region = await self._host.acquire(nbytes, pull.budget_s)
                await loop.run_in_executor(self._executor, self._mover.gather, hold.src_block_ids,
                                           hold.spec.state_slot, self._host.region(region, nbytes))
                self.staged_bytes += nbytes
            entries = self._write_entries(pull, hold, region)
            await loop.run_in_executor(self._executor, self._transfer.write, pull.consumer_session, entries, deadline)
        except Exception as e:
            why = str(e) or ("no room in the host buffer within the budget" if isinstance(e, asyncio.TimeoutError)
                             else type(e).__name__)
            logger.warning("P/D transfer %s to %s failed: %s", pull.transfer_id, pull.consumer_session, why)
            self._release(pull.transfer_id, "write failed")  # the id is spent; the consumer fails or recomputes
            return Reply(pull.transfer_id, ok=False, error=f"write failed: {why}")
        finally:
            if region is not None:  # every write from it has returned (the awaits above)
                self._host.give_back(region)
        hold.pulling, hold.pulled = False, True
        if hold.release_after_write:
            self._release(pull.transfer_id, "released while writing")
        return Reply(pull.transfer_id, ok=True)

    def _check_pull(self, pull: Pull, hold: _Hold) -> str | None:
        if len(pull.layout) != len(self._layout) or any(
                a.unit_bytes != b.unit_bytes for a, b in zip(pull.layout, self._layout)):
            return ("cache layout mismatch: producer and consumer must run the same model with the same "
                    "block size, dtype and parallelism")
        if len(pull.dst_block_ids) != len(hold.src_block_ids):
            return f"{len(pull.dst_block_ids)} destination blocks for {len(hold.src_block_ids)} source blocks"
        if not self._has_slots and pull.dst_state_slot != -1:
            return "a destination state slot was named, but this model has no recurrent state"
        top_block = max(pull.dst_block_ids, default=-1)
        for kind, entry in zip(self._kinds, pull.layout):
            if kind == "block" and top_block >= entry.num_units:
                return OUTSIDE_REGIONS
            if kind == "slot" and not 0 <= pull.dst_state_slot < entry.num_units:
                return OUTSIDE_REGIONS
        need = self._packed_size(len(hold.src_block_ids))
        if pull.dst_packed is not None and pull.dst_packed.nbytes < need:
            return f"the destination region of {pull.dst_packed.nbytes} bytes is smaller than the {need} bytes to write"
        return None

    def _packed_size(self, num_blocks: int) -> int:
        return packed_bytes(self._kinds, self._unit_bytes, num_blocks)

    def _write_entries(self, pull: Pull, hold: _Hold, region: int | None) -> list[tuple[int, int, int]]:
        """(src, dst, bytes) per unit, in the canonical order: source block i -> destination block i
        in every block tensor, the held slot -> the consumer's slot in every slot tensor. A side
        that goes through its host buffer has its units packed there instead (staging.py)."""
        num_blocks = len(hold.src_block_ids)
        if region is None:
            src = self._unit_addrs(self._layout, hold.src_block_ids, hold.spec.state_slot)
        else:
            src = self._packed_addrs(self._host.addr + region, num_blocks)
        if pull.dst_packed is None:
            dst = self._unit_addrs(pull.layout, pull.dst_block_ids, pull.dst_state_slot)
        else:
            dst = self._packed_addrs(pull.dst_packed.addr, num_blocks)
        return [(s, d, unit) for (s, unit), (d, _) in zip(src, dst)]

    def _unit_addrs(self, layout: list[TensorLayout], block_ids: list[int], slot: int) -> list[tuple[int, int]]:
        out = []
        for kind, entry in zip(self._kinds, layout):
            ids = block_ids if kind == "block" else [slot]
            out += [(entry.addr + i * entry.unit_bytes, entry.unit_bytes) for i in ids]
        return out

    def _packed_addrs(self, base: int, num_blocks: int) -> list[tuple[int, int]]:
        units = self._unit_bytes
        out = []
        for kind, unit, start in zip(self._kinds, units, packed_offsets(self._kinds, units, num_blocks)):
            out += [(base + start + i * unit, unit) for i in range(num_blocks if kind == "block" else 1)]
        return out

    # -- consumer ----------------------------------------------------------------------
    def _cancel(self, request_id: str) -> None:
        if request_id in self._tasks:
            self._cancelled.add(request_id)  # reported as aborted when its load ends
        elif request_id in self._loaded:  # finished, not yet reported: nothing writes into it now
            self._loaded.discard(request_id)
            self._failed[request_id] = "aborted"
        elif request_id not in self._failed:
            logger.warning("P/D: cancel for request %s, which has no load here", request_id)

    async def _load(self, spec: LoadSpec) -> None:
        params = spec.remote
        host, port, transfer_id = params["remote_host"], params["remote_port"], params["transfer_id"]
        where = f"producer {host}:{port}"
        timeout = self.kv_config.transfer_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        client: SideChannelClient | None = None
        error: str | None = None
        region: tuple[int, int] | None = None  # (offset, bytes) in the host buffer
        pulled = False  # a Pull went out: until its reply, a write may land in the destination
        try:
            pull, region = await self._make_pull(spec, timeout)
            client = await asyncio.wait_for(SideChannelClient.connect(host, port), max(deadline - loop.time(), 0.0))
            if spec.request_id in self._cancelled:
                error = "aborted"  # before anything was asked for; Done below frees the producer
            else:
                pulled = True
                reply = await asyncio.wait_for(client.call(pull), max(deadline - loop.time(), 0.0))
                pulled = False
                if not reply.ok or reply.transfer_id != transfer_id:
                    error = f"{where} refused transfer {transfer_id}: {reply.error}"
                elif region is not None and spec.request_id not in self._cancelled:
                    await loop.run_in_executor(self._executor, self._mover.scatter, self._host.region(*region),
                                               pull.dst_block_ids, spec.state_slot)
                    self.staged_bytes += region[1]
        except ValueError as e:
            error = str(e)
        except asyncio.TimeoutError:
            if region is None and self._host is not None:  # still waiting for a region
                error = (f"no room in the host buffer (kv_buffer_size={self._host.nbytes}) within "
                         f"transfer_timeout={timeout}s")
            else:
                error = f"no answer from {where} within transfer_timeout={timeout}s"
        except (OSError, FrameError) as e:
            error = f"lost {where}: {e or type(e).__name__}"
        except Exception as e:  # a bug here must still end the load, or the request waits forever
            logger.exception("P/D load of request %s", spec.request_id)
            error = f"internal error: {e!r}"
        if region is not None:
            if pulled:  # unanswered: the producer's budget (half our patience) bounds a late write
                loop.call_later(self.kv_config.transfer_timeout / 2, self._host.give_back, region[0])
            else:
                self._host.give_back(region[0])
        self._finish_load(spec.request_id, error)
        if client is not None:
            if error is None or error == "aborted":
                await self._say_done(client, transfer_id, where)
            await client.close()

    async def _make_pull(self, spec: LoadSpec, timeout: float) -> tuple[Pull, tuple[int, int] | None]:
        """The Pull, and the region of the host buffer it names (taken here), if any."""
        params = spec.remote
        num_blocks = len(params["block_ids"])
        if len(spec.block_ids) < num_blocks:
            raise ValueError(f"{num_blocks} blocks to load but only {len(spec.block_ids)} allocated")
        if self._has_slots != (spec.state_slot >= 0):
            raise ValueError(f"P/D consumer invariant broken: state slot {spec.state_slot} for a model "
                             f"{'with' if self._has_slots else 'without'} recurrent state")
        region, packed = None, None
        if self._host is not None:
            nbytes = self._packed_size(num_blocks)
            region = (await self._host.acquire(nbytes, timeout), nbytes)
            packed = HostRegion(self._host.addr + region[0], nbytes)
        pull = Pull(
            transfer_id=params["transfer_id"],
            consumer_session=self._transfer.session_id,
            layout=self._layout,
            dst_block_ids=spec.block_ids[:num_blocks],
            dst_state_slot=spec.state_slot,
            # Half the consumer's patience: a write still in flight when it gives up has the
            # other half to land or fail, before the blocks go back to the pool.
            budget_s=self.kv_config.transfer_timeout / 2,
            dst_packed=packed,
        )
        return pull, region

    def _finish_load(self, request_id: str, error: str | None) -> None:
        del self._tasks[request_id]
        if request_id in self._cancelled:
            self._cancelled.discard(request_id)
            self._failed[request_id] = "aborted"
        elif error is not None:
            logger.warning("P/D load of request %s failed: %s", request_id, error)
            self._failed[request_id] = error
        else:
            self._loaded.add(request_id)
        self._notify()

    async def _say_done(self, client: SideChannelClient, transfer_id: str, where: str) -> None:
        """Tell the producer to free its hold; if this fails, its lease frees it."""
        try:
            await asyncio.wait_for(client.call(Done(transfer_id)), DONE_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError, FrameError) as e:
            logger.debug("P/D: Done for %s to %s not acknowledged: %s", transfer_id, where, e)


def _refuse(transfer_id: str, error: str) -> Reply:
    logger.warning("P/D side channel: refused transfer %s: %s", transfer_id, error)
    return Reply(transfer_id, ok=False, error=error)
