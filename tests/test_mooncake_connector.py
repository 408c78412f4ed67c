"""The Mooncake P/D connector with real parts: a real Mooncake TransferEngine over TCP
on 127.0.0.1 and the real asyncio side channel, producer and consumer in separate
processes (spawned peers driven over a pipe, each with its own event loop).

The peers drive both connector halves the way the engine does: the producer
finishes a request (``request_finished`` -> ``build_metadata`` -> ``handle``), the
consumer admits one (``num_remote_tokens`` -> ``after_alloc`` -> ``build_metadata``
-> ``handle``) and polls ``take_output`` -> ``update`` until the load ends.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback

import msgspec
import pytest
import torch

from atom.engine.request import Request, RequestStatus
from atom.kv_transfer.base import ConnectorOutput, KVTransferConfig
from atom.kv_transfer.factory import make_connector
from atom.kv_transfer.mooncake.scheduler_side import MooncakeConnectorScheduler
from atom.kv_transfer.mooncake.side_channel import (
    MAX_FRAME_BYTES, Done, Pull, TensorLayout, decode_reply, encode_frame, read_frame,
)
from atom.kv_transfer.mooncake.transfer import merge_runs
from atom.kv_transfer.mooncake.worker_side import OUTSIDE_REGIONS
from atom.sampling_params import SamplingParams

if importlib.util.find_spec("mooncake") is None:
    pytest.skip("needs mooncake-transfer-engine(-non-cuda)", allow_module_level=True)

BLOCK_SIZE = 4
PRODUCER = dict(num_blocks=16, num_slots=6, seed=1)
CONSUMER = dict(num_blocks=12, num_slots=8, seed=2)
TRANSFER_TIMEOUT = 3.0
SLOW_WRITE_S = 4.0  # > TRANSFER_TIMEOUT: the slow producer answers too late


def make_caches(num_blocks: int, num_slots: int, seed: int):
    """Two paged layers (one MLA-like tensor; K and V in bf16) and a state pool layer
    (conv state in bf16, recurrent state in fp32), all random."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    caches = {
        0: (r(num_blocks, BLOCK_SIZE, 40),),
        1: (r(num_blocks, BLOCK_SIZE, 40, dtype=torch.bfloat16), r(num_blocks, BLOCK_SIZE, 40, dtype=torch.bfloat16)),
        2: (r(num_slots, 3, 5, dtype=torch.bfloat16), r(num_slots, 2, 4, 4)),
    }
    return caches, {0: "block", 1: "block", 2: "slot"}


# -- a peer process -------------------------------------------------------------------
def _peer_main(conn, role, seed, num_blocks, num_slots, write_delay_s, write_entered, lease_seconds,
               buffer) -> None:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    torch.set_num_threads(1)
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("atom")
    log.setLevel(logging.WARNING)
    log.addHandler(Collect())
    if write_delay_s:  # a producer that stalls right before it writes
        from atom.kv_transfer.mooncake import transfer

        real_write = transfer.MooncakeTransfer.write

        def slow_write(self, *args):
            write_entered.set()
            time.sleep(write_delay_s)
            return real_write(self, *args)

        transfer.MooncakeTransfer.write = slow_write
    asyncio.run(_Peer(conn, role, seed, num_blocks, num_slots, records, lease_seconds, buffer).run())


class _Peer:
    def __init__(self, conn, role, seed, num_blocks, num_slots, records, lease_seconds, buffer):
        self.conn, self.records = conn, records
        self.caches, kinds = make_caches(num_blocks, num_slots, seed)
        buffer_device, buffer_size = buffer  # ("cpu", bytes): through a host buffer (staging.py)
        cfg = KVTransferConfig("mooncake", role, host="127.0.0.1", lease_seconds=lease_seconds,
                               transfer_timeout=TRANSFER_TIMEOUT, kv_buffer_device=buffer_device,
                               kv_buffer_size=buffer_size)
        self.sched, self.worker = make_connector(cfg, block_size=BLOCK_SIZE, caches=self.caches,
                                                 cache_kinds=kinds, engine_id=role)
        self.num_finished = 0
        self.notified = 0  # the worker's on_output calls: each ended load and each released hold
        self.worker.on_output = lambda: setattr(self, "notified", self.notified + 1)

    async def run(self) -> None:
        try:
            await self.worker.start()
        except Exception as e:
            self.conn.send(("exc", f"{type(e).__name__}: {e}"))
            return
        layout = [(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0])
                  for layer in sorted(self.caches) for t in self.caches[layer]]
        self.conn.send(("ok", (self.sched.side_channel_port, self.worker.session_id, layout)))
        loop = asyncio.get_running_loop()
        while True:
            cmd, args = await loop.run_in_executor(None, self.conn.recv)
            if cmd == "stop":
                await self.worker.shutdown()
                self.conn.send(("ok", None))
                return
            try:
                self.conn.send(("ok", await getattr(self, cmd)(*args)))
            except Exception:
                self.conn.send(("exc", traceback.format_exc()))

    async def finish(self, prompt_len, block_ids, state_slot, state_offset, lease_s=None):
        """Producer: a do_remote_decode request ends after its prefill; hold it."""
        self.num_finished += 1
        req = Request(f"p{self.num_finished}", list(range(prompt_len)), SamplingParams(max_tokens=1))
        req.kv_transfer_params = {"do_remote_decode": True}
        req.block_ids, req.state_slot, req.state_offset = list(block_ids), state_slot, state_offset
        req.num_computed_tokens = prompt_len
        req.output_token_ids, req.spec_token_ids = [7], [8, 9]
        req.status = RequestStatus.FINISHED_LENGTH
        delay_free, params = self.sched.request_finished(req)
        assert delay_free and params is not None
        meta = self.sched.build_metadata()
        if lease_s is not None:
            for hold in meta.holds:
                hold.deadline = time.monotonic() + lease_s
        self.worker.handle(meta)
        return params

    async def wait_released(self, transfer_id, timeout):
        start = time.monotonic()
        while transfer_id in self.sched.held_requests and time.monotonic() - start < timeout:
            self.sched.update(self.worker.take_output())
            await asyncio.sleep(0.02)
        return transfer_id not in self.sched.held_requests, time.monotonic() - start

    async def held(self):
        self.sched.update(self.worker.take_output())
        return sorted(self.sched.held_requests)

    async def load(self, request_id, params, block_ids, state_slot, cancel=False):
        """Consumer: admit a request with the producer's params and wait for its load."""
        req = Request(request_id, list(range(params["num_tokens"])), SamplingParams(max_tokens=4))
        req.kv_transfer_params = params
        assert self.sched.num_remote_tokens(req) == req.num_prompt_tokens
        req.block_ids, req.state_slot = list(block_ids), state_slot
        start = time.monotonic()
        self.sched.after_alloc(req)
        self.worker.handle(self.sched.build_metadata())
        if cancel:
            self.sched.cancel_load(request_id)
            self.worker.handle(self.sched.build_metadata())
        while time.monotonic() - start < 30:
            loaded, failed, _ = self.sched.update(self.worker.take_output())
            if request_id in loaded:
                return "loaded", None, time.monotonic() - start
            if request_id in failed:
                return "failed", failed[request_id], time.monotonic() - start
            await asyncio.sleep(0.01)
        return "stuck", None, time.monotonic() - start

    async def load_many(self, loads):
        """Consumer: several loads at once, [(request_id, params, block_ids, state_slot)] -> their ends."""
        for request_id, params, block_ids, state_slot in loads:
            req = Request(request_id, list(range(params["num_tokens"])), SamplingParams(max_tokens=4))
            req.kv_transfer_params = params
            assert self.sched.num_remote_tokens(req) == req.num_prompt_tokens
            req.block_ids, req.state_slot = list(block_ids), state_slot
            self.sched.after_alloc(req)
        self.worker.handle(self.sched.build_metadata())
        ends, start = {}, time.monotonic()
        while len(ends) < len(loads) and time.monotonic() - start < 30:
            loaded, failed, _ = self.sched.update(self.worker.take_output())
            ends |= {r: ("loaded", None) for r in loaded} | {r: ("failed", e) for r, e in failed.items()}
            await asyncio.sleep(0.01)
        return [ends.get(request_id, ("stuck", None)) for request_id, *_ in loads]

    async def notifications(self):
        return self.notified

    async def buffer(self):
        """(bytes of the host buffer lent now, bytes staged through it so far)."""
        return self.worker.host_buffer_bytes_lent, self.worker.staged_bytes

    async def snapshot(self):
        buf = io.BytesIO()
        torch.save(self.caches, buf)
        return buf.getvalue()

    async def logs(self):
        return list(self.records)


class PeerHandle:
    def __init__(self, role, num_blocks, num_slots, seed, write_delay_s=0.0, lease_seconds=60.0,
                 buffer=("cache", 1 << 30)):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.write_entered = ctx.Event()
        self.proc = ctx.Process(target=_peer_main, daemon=True, args=(
            child, role, seed, num_blocks, num_slots, write_delay_s, self.write_entered, lease_seconds, buffer))
        self.proc.start()

    def ready(self):
        self.port, self.session, layout = self._recv(60)
        self.layout = [TensorLayout(*entry) for entry in layout]
        return self

    def _recv(self, timeout):
        assert self.conn.poll(timeout), "the peer did not answer in time"
        status, value = self.conn.recv()
        if status == "exc":
            pytest.fail(f"peer failed:\n{value}")
        return value

    def send(self, cmd, *args):
        self.conn.send((cmd, args))

    def call(self, cmd, *args, timeout=30):
        self.send(cmd, *args)
        return self._recv(timeout)

    def caches(self):
        return torch.load(io.BytesIO(self.call("snapshot")))

    def stop(self):
        """Ask the peer to shut down (no wait; ``join`` waits)."""
        if self.proc.is_alive():
            try:
                self.send("stop")
            except OSError:
                pass

    def join(self):
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def peers():
    producer = PeerHandle("kv_producer", **PRODUCER)
    consumer = PeerHandle("kv_consumer", **CONSUMER)
    slow = PeerHandle("kv_producer", **PRODUCER, write_delay_s=SLOW_WRITE_S)
    try:
        yield producer.ready(), consumer.ready(), slow.ready()
    finally:
        for peer in (producer, consumer, slow):
            peer.stop()
        for peer in (producer, consumer, slow):
            peer.join()


STAGED_BUFFER = ("cpu", 8192)  # one 5-block transfer at a time (6560 bytes packed), or two of 2 blocks


@pytest.fixture(scope="module")
def staged():
    """A producer and a consumer that move everything through a small host buffer (staging.py)."""
    producer = PeerHandle("kv_producer", **PRODUCER, buffer=STAGED_BUFFER)
    consumer = PeerHandle("kv_consumer", **CONSUMER, buffer=STAGED_BUFFER)
    try:
        yield producer.ready(), consumer.ready()
    finally:
        for peer in (producer, consumer):
            peer.stop()
        for peer in (producer, consumer):
            peer.join()


# -- helpers --------------------------------------------------------------------------
def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def raw_exchange(port: int, data: bytes):
    """Send raw bytes to a side channel; (the Reply, whether the server then hung up)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        body = await read_frame(reader, 5)
        reply = decode_reply(body) if body else None
        rest = await asyncio.wait_for(reader.read(), 5)
        return reply, rest == b""
    finally:
        writer.close()


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def pull_for(consumer, transfer_id, dst_block_ids, dst_state_slot, layout=None) -> bytes:
    return encode_frame(Pull(transfer_id, consumer.session, layout or consumer.layout, dst_block_ids,
                             dst_state_slot, budget_s=1.0))


def expected_after(before, producer, src_blocks, dst_blocks, src_slot, dst_slot):
    kinds = {0: "block", 1: "block", 2: "slot"}
    want = {}
    for layer, tensors in before.items():
        want[layer] = []
        for t, p in zip(tensors, producer[layer]):
            t = t.clone()
            if kinds[layer] == "block":
                t[dst_blocks] = p[src_blocks]
            else:
                t[dst_slot] = p[src_slot]
            want[layer].append(t)
    return want


def assert_caches_equal(got, want):
    for layer in want:
        for a, b in zip(got[layer], want[layer]):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {layer}"


# -- the scheduler half, in process -------------------------------------------------------
def _finished_request(prompt_len=10, status=RequestStatus.FINISHED_LENGTH, params=None):
    req = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=1))
    req.kv_transfer_params = {"do_remote_decode": True} if params is None else params
    req.block_ids, req.state_slot, req.state_offset = [4, 5, 6, 9], 2, 1
    req.num_computed_tokens, req.output_token_ids, req.spec_token_ids = prompt_len, [42], [1, 2]
    req.status = status
    return req


def test_scheduler_half_producer_params_and_holds():
    sched = MooncakeConnectorScheduler(KVTransferConfig("mooncake", "kv_producer", lease_seconds=5), "e1", 4)
    sched.side_channel_port = 4321
    req = _finished_request()
    delay, params = sched.request_finished(req)
    assert delay
    assert params == {"transfer_id": params["transfer_id"], "engine_id": "e1", "remote_host": "127.0.0.1",
                      "remote_port": 4321, "num_tokens": 10, "block_ids": [4, 5, 6], "state_slot": 3,
                      "first_token": 42, "draft_token_ids": [1, 2]}
    meta = sched.build_metadata()
    (hold,) = meta.holds
    assert hold.block_ids == [4, 5, 6, 9] and hold.state_slot == 3 and hold.num_tokens == 10
    assert 4 < hold.deadline - time.monotonic() <= 5
    assert sched.held_requests == {params["transfer_id"]: req} and sched.build_metadata().holds == []
    _, _, released = sched.update(ConnectorOutput(released={params["transfer_id"]}))
    assert released == [req] and sched.held_requests == {}
    # Not asked for, aborted, or no output: nothing held.
    for r in (_finished_request(params={}), _finished_request(status=RequestStatus.FINISHED_ABORTED)):
        assert sched.request_finished(r) == (False, None)
    # The state must be at the prompt boundary.
    bad = _finished_request()
    bad.num_computed_tokens = 11
    with pytest.raises(RuntimeError, match="num_computed_tokens=11 != num_prompt_tokens=10"):
        sched.request_finished(bad)


def test_scheduler_half_consumer_validates_params():
    sched = MooncakeConnectorScheduler(KVTransferConfig("mooncake", "kv_consumer"), "e2", 4)
    good = {"transfer_id": "t", "engine_id": "e1", "remote_host": "127.0.0.1", "remote_port": 4321,
            "num_tokens": 10, "block_ids": [4, 5, 6], "state_slot": 3, "first_token": 42, "draft_token_ids": []}
    req = Request("c", list(range(10)), SamplingParams())
    req.kv_transfer_params = good
    assert sched.num_remote_tokens(req) == 10
    for bad, match in [({"remote_port": "4321"}, r"remote_port"), ({"num_tokens": 9}, "9-token prompt"),
                       ({"block_ids": [4, 5]}, "same block size"), ({"block_ids": [-1, 5, 6]}, "block_ids"),
                       ({"first_token": True}, "first_token")]:
        req.kv_transfer_params = {**good, **bad}
        with pytest.raises(ValueError, match=match):
            sched.num_remote_tokens(req)
    req.kv_transfer_params = None
    assert sched.num_remote_tokens(req) == 0
    req.kv_transfer_params, req.block_ids, req.state_slot = good, [1, 2, 3], 6
    sched.after_alloc(req)
    sched.cancel_load("c")
    # Held back (a step that may write into its blocks still runs): neither the load nor its cancellation
    # goes out, but the cancellation of a load already handed over does.
    sched.cancel_load("handed-earlier")
    meta = sched.build_metadata(hold_loads=True)
    assert meta.loads == [] and meta.cancelled_loads == ["handed-earlier"]
    meta = sched.build_metadata()
    assert [(s.request_id, s.block_ids, s.state_slot) for s in meta.loads] == [("c", [1, 2, 3], 6)]
    assert meta.cancelled_loads == ["c"]


def test_only_a_consumer_through_the_host_buffer_defers_tokens(kimi_ckpt):
    """A step on the decode graphs returns before its tokens reach the host (async scheduling) on a consumer whose
    transfers go through the host buffer, and never where transfers read the caches outside the stream's order."""
    from atom.config import EngineConfig
    from atom.worker.model_runner import defers_tokens

    def defers(role=None, where="cpu", async_scheduling=True, drafter=False):
        kv = None if role is None else {"kv_connector": "mooncake", "kv_role": role, "kv_buffer_device": where}
        config = EngineConfig(model=kimi_ckpt, async_scheduling=async_scheduling, kv_transfer_config=kv)
        return defers_tokens(config, drafter)

    assert defers() and defers("kv_consumer", "cpu")
    assert not defers("kv_consumer", "cache") and not defers("kv_consumer", "auto")  # auto on the CPU: the caches
    assert not defers("kv_producer", "cpu") and not defers("kv_producer", "cache")
    assert not defers(async_scheduling=False) and not defers("kv_consumer", "cpu", async_scheduling=False)
    assert not defers(drafter=True) and not defers("kv_consumer", "cpu", drafter=True)


def test_host_buffer_settings_are_checked(kimi_ckpt, monkeypatch):
    from atom.config import EngineConfig
    from atom.engine.engine_core import EngineCore
    from atom.kv_transfer.mooncake import worker_side

    for bad, match in [({"kv_buffer_device": "gpu"}, "kv_buffer_device 'gpu' must be 'auto', 'cpu' or 'cache'"),
                       ({"kv_buffer_size": 0}, "kv_buffer_size must be a positive number of bytes"),
                       ({"kv_buffer_size": 1.5}, "kv_buffer_size must be a positive number of bytes"),
                       ({"kv_buffer_size": True}, "kv_buffer_size must be a positive number of bytes")]:
        with pytest.raises(ValueError, match=match):
            KVTransferConfig.from_dict({"kv_connector": "mooncake", "kv_role": "kv_consumer", **bad})
    on = lambda device, where: KVTransferConfig("mooncake", "kv_consumer", kv_buffer_device=where).uses_host_buffer(
        torch.device(device))  # noqa: E731
    assert on("cuda", "auto") and not on("cpu", "auto") and on("cpu", "cpu") and not on("cuda", "cache")
    # A buffer that cannot hold one request of max_model_len is refused before anything starts.
    config = EngineConfig(model=kimi_ckpt, dtype="float32", kv_transfer_config={
        "kv_connector": "mooncake", "kv_role": "kv_consumer", "kv_buffer_device": "cpu", "kv_buffer_size": 4096})
    with pytest.raises(ValueError, match=r"kv_buffer_size=4096 bytes cannot hold one \d+-token request's KV and "
                                         r"state \(\d+ bytes\); raise kv_buffer_size to at least \d+"):
        EngineCore(config)
    # Left out, the buffer is 1 GiB, or one request of max_model_len where that is more (here, with a
    # default shrunk to 1 KiB).
    unsized = {"kv_connector": "mooncake", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    core = EngineCore(EngineConfig(model=kimi_ckpt, dtype="float32", kv_transfer_config=unsized))
    assert core.connector_worker.host_buffer_size == 1 << 30
    monkeypatch.setattr(worker_side, "DEFAULT_KV_BUFFER_SIZE", 1024)
    core = EngineCore(EngineConfig(model=kimi_ckpt, dtype="float32", kv_transfer_config=unsized))
    need = core.connector_worker.packed_bytes(core.config.max_model_len)
    assert need > 1024 and core.connector_worker.host_buffer_size == need


async def test_remote_loads_wait_for_the_step_in_flight_when_their_blocks_were_planned(kimi_ckpt):
    """With overlapped scheduling, step N+1 is planned while step N runs, and blocks that plan frees (a
    preemption, an abort) may still be written by step N. A remote load must not land in them before
    step N ends: every step started before a load's blocks were allocated has ended when its load is
    handed to the worker half. (The producer here is a closed port: the loads fail at once and the
    requests compute their prompts locally.)"""
    from atom import AsyncEngine

    steps = {"started": 0, "ended": 0}
    allocated_at, handed_at = {}, {}
    config = {"kv_connector": "mooncake", "kv_role": "kv_consumer", "host": "127.0.0.1",
              "kv_load_failure_policy": "recompute", "transfer_timeout": 5.0}
    async with AsyncEngine.from_config(model=kimi_ckpt, dtype="float32", async_scheduling=True,
                                       kv_transfer_config=config) as engine:
        core, block_size = engine.core, engine.config.block_size
        execute, after_alloc, handle = core.execute, core.scheduler.connector.after_alloc, core.connector_worker.handle

        def counting_execute(sched):  # on the forward thread
            steps["started"] += 1
            try:
                return execute(sched)
            finally:
                steps["ended"] += 1

        def noting_after_alloc(request):
            allocated_at[request.request_id] = steps["started"]
            after_alloc(request)

        def noting_handle(meta):
            handed_at.update({load.request_id: steps["ended"] for load in meta.loads})
            handle(meta)

        core.execute, core.scheduler.connector.after_alloc = counting_execute, noting_after_alloc
        core.connector_worker.handle = noting_handle

        async def run(prompt, max_tokens, params=None, request_id=None):
            params_kw = {"kv_transfer_params": params} if params else {}
            last = None
            async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True), request_id, **params_kw):
                last = out
            return last

        async def remote(i):
            await asyncio.sleep(0.05 + 0.03 * i)  # while the local ones decode: a step is always in flight
            prompt = list(range(30 + i, 50 + i))
            params = {"transfer_id": f"t{i}", "engine_id": "gone", "remote_host": "127.0.0.1",
                      "remote_port": closed_port(), "num_tokens": len(prompt),
                      "block_ids": list(range(-(-len(prompt) // block_size))), "state_slot": 0, "first_token": 5}
            return await run(prompt, 8, params, f"remote-{i}")

        outs = await asyncio.gather(*[run([3, 4, 5 + i] * 4, 60) for i in range(4)], *[remote(i) for i in range(4)])
        assert all(out.finished and out.outputs[0].finish_reason == "length" for out in outs)
        assert sorted(handed_at) == sorted(allocated_at) == [f"remote-{i}" for i in range(4)]
        early = {r: (allocated_at[r], handed_at[r]) for r in handed_at if handed_at[r] < allocated_at[r]}
        assert not early, f"loads handed over before the step running at their allocation ended: {early}"
        assert core.all_resources_free()


def test_merge_runs():
    assert merge_runs([(0, 100, 8), (8, 108, 8), (16, 200, 8), (40, 208, 8)]) == [
        (0, 100, 16), (16, 200, 8), (40, 208, 8)]


async def test_bind_failure_is_a_clear_error():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        caches, kinds = make_caches(4, 2, 0)
        cfg = KVTransferConfig("mooncake", "kv_producer", host="127.0.0.1", handshake_port=port)
        sched, worker = make_connector(cfg, block_size=BLOCK_SIZE, caches=caches, cache_kinds=kinds)
        with pytest.raises(RuntimeError, match=f"cannot bind 127.0.0.1:{port}.*handshake_port"):
            await worker.start()
        assert sched.side_channel_port is None
    finally:
        taken.close()


# -- real transfers between processes -----------------------------------------------------
def test_transfer_copies_exactly_the_held_blocks_and_slot(peers):
    producer, consumer, _ = peers
    p_before, c_before = producer.caches(), consumer.caches()
    p_told, c_told = producer.call("notifications"), consumer.call("notifications")
    # 18 tokens: 5 blocks of 4. The 6th held block (the sampled token's) is not sent.
    params = producer.call("finish", 18, [5, 6, 7, 2, 9, 13], 2, 1)
    assert params["block_ids"] == [5, 6, 7, 2, 9] and params["state_slot"] == 3
    assert params["remote_port"] == producer.port and params["first_token"] == 7
    dst = [3, 4, 0, 10, 11, 1]  # one more than needed: truncated to the remote's 5
    status, error, _ = consumer.call("load", "c1", params, dst, 5)
    assert (status, error) == ("loaded", None)
    want = expected_after(c_before, p_before, [5, 6, 7, 2, 9], dst[:5], 3, 5)
    assert_caches_equal(consumer.caches(), want)
    assert_caches_equal(producer.caches(), p_before)
    released, _ = producer.call("wait_released", params["transfer_id"], 5)
    assert released, "the consumer's Done did not release the hold"
    # Each side told its engine once: the consumer when the load ended, the producer when the hold went.
    assert (producer.call("notifications"), consumer.call("notifications")) == (p_told + 1, c_told + 1)


def test_aborted_load_is_reported_and_frees_the_producer(peers):
    producer, consumer, _ = peers
    params = producer.call("finish", 8, [0, 1], 0, 0)
    status, error, _ = consumer.call("load", "c2", params, [6, 7], 1, True)
    assert (status, error) == ("failed", "aborted")
    released, _ = producer.call("wait_released", params["transfer_id"], 5)
    assert released


async def test_side_channel_garbage_is_rejected_without_side_effects(peers):
    producer, consumer, _ = peers
    params = producer.call("finish", 8, [10, 11], 4, 0)
    tid = params["transfer_id"]
    c_before = consumer.caches()
    enc = msgspec.msgpack.encode
    garbage = {
        "random bytes": (13).to_bytes(4, "big") + os.urandom(13),
        "oversize frame": (MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"x" * 64,
        "wrong schema": _frame(enc({"type": "pull", "transfer_id": 5})),
        "unknown field": _frame(enc({"type": "done", "transfer_id": tid, "evil": 1})),
        "unknown type": _frame(enc({"type": "free_everything", "transfer_id": tid})),
        "a reply": _frame(enc({"type": "reply", "transfer_id": tid, "ok": True})),
        "unknown transfer id": pull_for(consumer, "0" * 32, [0, 1], 0),
        "unknown Done": encode_frame(Done("1" * 32)),
    }
    for what, data in garbage.items():
        reply, hung_up = await raw_exchange(producer.port, data)
        assert reply is not None and not reply.ok and reply.error, what
        assert hung_up, f"{what}: the connection stayed open"
    # A frame cut short, then EOF: no reply to give, the server just moves on.
    _, writer = await asyncio.open_connection("127.0.0.1", producer.port)
    writer.write((100).to_bytes(4, "big") + b"abc")
    writer.write_eof()
    writer.close()
    # Nothing changed: the hold is there, the consumer's memory untouched, and the
    # server still serves the real pull.
    assert tid in producer.call("held")
    assert_caches_equal(consumer.caches(), c_before)
    status, error, _ = consumer.call("load", "c3", params, [8, 9], 2)
    assert (status, error) == ("loaded", None)
    assert producer.call("wait_released", tid, 5)[0]
    # Replaying the finished transfer's Pull: refused, nothing written.
    c_before = consumer.caches()
    reply, hung_up = await raw_exchange(producer.port, pull_for(consumer, tid, [0, 1], 0))
    assert not reply.ok and "unknown transfer id" in reply.error and hung_up
    assert_caches_equal(consumer.caches(), c_before)


async def test_pull_outside_the_consumer_regions_is_refused_and_logged(peers):
    producer, consumer, _ = peers
    params = producer.call("finish", 8, [12, 14], 1, 0)
    tid = params["transfer_id"]
    c_before = consumer.caches()
    # Block 12 and slot 8 are one past the consumer's 12 blocks and 8 slots.
    for dst_blocks, dst_slot in [([0, 12], 0), ([0, 1], 8), ([0, 1], -1)]:
        reply, hung_up = await raw_exchange(producer.port, pull_for(consumer, tid, dst_blocks, dst_slot))
        assert not reply.ok and reply.error == OUTSIDE_REGIONS and hung_up
    # The same model is required: a layout that differs is refused too.
    wrong = consumer.layout[:-1]
    reply, _ = await raw_exchange(producer.port, pull_for(consumer, tid, [0, 1], 0, layout=wrong))
    assert not reply.ok and "layout mismatch" in reply.error
    assert_caches_equal(consumer.caches(), c_before)
    assert sum(OUTSIDE_REGIONS in line for line in producer.call("logs")) >= 3
    # Refusals have no side effects: the hold still serves a well-formed pull.
    status, error, _ = consumer.call("load", "c4", params, [2, 3], 3)
    assert (status, error) == ("loaded", None)


async def test_lease_expiry_releases_the_hold(peers):
    producer, consumer, _ = peers
    params = producer.call("finish", 8, [3, 4], 5, 0, 0.3)
    released, waited = producer.call("wait_released", params["transfer_id"], 5)
    assert released and 0.2 < waited < 2
    # A consumer that comes after the lease gets a clear refusal.
    status, error, _ = consumer.call("load", "c5", params, [0, 1], 0)
    assert status == "failed" and "unknown transfer id" in error


def test_producer_gone_before_the_pull_fails_fast(peers):
    _, consumer, _ = peers
    params = {"transfer_id": "f" * 32, "engine_id": "gone", "remote_host": "127.0.0.1", "remote_port": closed_port(),
              "num_tokens": 8, "block_ids": [0, 1], "state_slot": 0, "first_token": 1, "draft_token_ids": []}
    status, error, elapsed = consumer.call("load", "c6", params, [0, 1], 0)
    assert status == "failed" and f"lost producer 127.0.0.1:{params['remote_port']}" in error, error
    assert elapsed < 2


def packed_size(num_blocks: int) -> int:
    """make_caches' bytes for that many blocks and one slot: 640 + 2 x 320 a block, 30 + 128 the slot,
    each tensor's part starting on 16 bytes."""
    return num_blocks * 1280 + 160


@pytest.mark.parametrize("sides", ["staged->cache", "cache->staged", "staged->staged"])
def test_transfer_through_host_buffers_moves_the_same_bytes(peers, staged, sides):
    producer = staged[0] if sides.startswith("staged") else peers[0]
    consumer = staged[1] if sides.endswith("staged") else peers[1]
    p_before, c_before = producer.caches(), consumer.caches()
    p_staged, c_staged = producer.call("buffer")[1], consumer.call("buffer")[1]
    params = producer.call("finish", 18, [5, 6, 7, 2, 9, 13], 2, 1)
    dst = [3, 4, 0, 10, 11]
    status, error, _ = consumer.call("load", f"h-{sides}", params, dst, 5)
    assert (status, error) == ("loaded", None)
    assert_caches_equal(consumer.caches(), expected_after(c_before, p_before, [5, 6, 7, 2, 9], dst, 3, 5))
    assert_caches_equal(producer.caches(), p_before)
    assert producer.call("wait_released", params["transfer_id"], 5)[0]
    # What went through a host buffer was counted, and every region went back.
    assert producer.call("buffer") == (0, p_staged + (packed_size(5) if producer in staged else 0))
    assert consumer.call("buffer") == (0, c_staged + (packed_size(5) if consumer in staged else 0))


def test_loads_wait_for_room_in_the_host_buffer(staged):
    producer, consumer = staged
    p_before, c_before = producer.caches(), consumer.caches()
    # Two 5-block transfers and one of 2 blocks; each buffer holds one 5-block transfer at a time,
    # so on both sides the later ones wait for a region.
    src = [([0, 1, 2, 3, 4], 0), ([5, 6, 7, 8, 9], 1), ([10, 11], 2)]
    dst = [([0, 1, 2, 3, 4], 0), ([5, 6, 7, 8, 9], 3), ([10, 11], 6)]
    params = [producer.call("finish", 4 * len(blocks), blocks, slot, 0) for blocks, slot in src]
    loads = [(f"w{i}", p, blocks, slot) for i, (p, (blocks, slot)) in enumerate(zip(params, dst))]
    ends = consumer.call("load_many", loads)
    assert ends == [("loaded", None)] * 3
    want = c_before
    for (s_blocks, s_slot), (d_blocks, d_slot) in zip(src, dst):
        want = expected_after(want, p_before, s_blocks, d_blocks, s_slot, d_slot)
    assert_caches_equal(consumer.caches(), want)
    for p in params:
        assert producer.call("wait_released", p["transfer_id"], 5)[0]
    assert producer.call("buffer")[0] == 0 and consumer.call("buffer")[0] == 0
    # A transfer larger than the whole buffer fails at once, naming the setting.
    big = producer.call("finish", 28, [0, 1, 2, 3, 4, 5, 6], 0, 0, 0.5)  # 7 blocks: 9120 bytes
    status, error, elapsed = consumer.call("load", "w-big", big, list(range(7)), 0)
    assert status == "failed" and "kv_buffer_size" in error and elapsed < 1, error
    assert producer.call("wait_released", big["transfer_id"], 5)[0]  # its lease
    assert consumer.call("buffer")[0] == 0


def test_an_unanswered_pull_keeps_its_host_region_until_no_write_can_land(peers, staged):
    _, _, slow = peers
    consumer = staged[1]
    c_before = consumer.caches()
    params = slow.call("finish", 8, [6, 7], 3, 0)
    status, error, _ = consumer.call("load", "u1", params, [0, 1], 0)
    assert status == "failed" and "transfer_timeout" in error, error
    # The stalled producer could still write until its budget (half the consumer's patience) runs out.
    assert consumer.call("buffer")[0] == packed_size(2) + 96  # regions are lent in 256-byte units
    deadline = time.monotonic() + TRANSFER_TIMEOUT
    while consumer.call("buffer")[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert consumer.call("buffer")[0] == 0
    assert slow.call("wait_released", params["transfer_id"], SLOW_WRITE_S + 2)[0]
    assert_caches_equal(consumer.caches(), c_before)


def test_producer_stalled_or_killed_mid_transfer_fails_in_bounded_time(peers):
    _, consumer, slow = peers
    c_before = consumer.caches()
    # Stalled: the consumer gives up at transfer_timeout; the producer, past the
    # consumer's budget when it wakes, writes nothing and drops the hold.
    params = slow.call("finish", 8, [0, 1], 0, 0)
    status, error, elapsed = consumer.call("load", "c7", params, [4, 5], 6)
    assert status == "failed" and "transfer_timeout" in error, error
    assert TRANSFER_TIMEOUT - 0.1 < elapsed < TRANSFER_TIMEOUT + 1
    released, _ = slow.call("wait_released", params["transfer_id"], SLOW_WRITE_S + 2)
    assert_caches_equal(consumer.caches(), c_before)
    assert released
    # Killed while it handles the pull: the consumer learns at once.
    params = slow.call("finish", 8, [2, 3], 1, 0)
    slow.write_entered.clear()
    consumer.send("load", "c8", params, [4, 5], 6)
    assert slow.write_entered.wait(10)
    os.kill(slow.proc.pid, signal.SIGKILL)
    status, error, elapsed = consumer._recv(TRANSFER_TIMEOUT + 5)
    assert status == "failed" and "lost producer" in error, error
    assert elapsed < TRANSFER_TIMEOUT
    assert_caches_equal(consumer.caches(), c_before)
