"""asyncio front end: the step loop runs on the caller's event loop.

Scheduling and bookkeeping happen on the loop; each forward pass runs in one
worker thread (``ForwardThread``, through ``run_in_executor``), which also
built the model, so the loop keeps answering health checks and accepting
requests while a step runs. Each request has its own
queue of outputs; leaving ``async for`` early (break, cancel, disconnect)
aborts the request and frees its blocks and slots at once.

Aborting during a forward is safe: freed blocks and slots are handed out only
by the next ``schedule()``, which runs after the in-flight step returns, and a
reused state slot is zeroed because its new owner starts at context 0.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, AsyncIterator

from atom.config import EngineConfig, SpeculativeConfig
from atom.engine.engine_core import EngineCore, shorten_gil_switch_interval
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class ForwardThread(Executor):
    """One thread that runs its jobs in submission order: the engine's build, then its forwards.

    A daemon thread: an interrupt while the model is being built ends the process at once, instead of
    waiting at exit for the build (a ThreadPoolExecutor's threads are joined at exit)."""

    def __init__(self, name: str = "atom-forward") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._closed:
            raise RuntimeError("the engine's forward thread has been shut down")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:  # jobs not started yet never run
            pending = []
            while True:
                try:
                    pending.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            for job in pending:
                if job is not None:
                    job[0].cancel()
            if self._closed:
                self._jobs.put(None)  # the stop mark drained above
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


def _result_interruptibly(future: Future, poll_s: float = 0.1) -> Any:
    """``future.result()``, waking every ``poll_s``. Python raises a Ctrl-C in the main thread, but the kernel may
    hand the signal to another thread (the one building the model): then a wait without a timeout holds the main
    thread until the build ends, and only then raises the KeyboardInterrupt."""
    while True:
        try:
            return future.result(timeout=poll_s)
        except TimeoutError:
            if future.done():  # the job's own TimeoutError, or it ended just after the wait's timeout
                return future.result()


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._executor = ForwardThread()
        # Built on the forward thread, so that the model's CPU work (loading, warm-up, forwards) runs on one
        # thread: once two threads have each run OpenMP regions, libgomp counts more threads than cores and
        # stops spinning between regions, and every small op waits on a thread wake-up (a CPU decode step
        # took 4x longer with the model built on the loop's thread; GPU steps are not affected).
        build = self._executor.submit(EngineCore, config)
        try:
            self.core = _result_interruptibly(build)
        except BaseException:
            # A failed build has ended: join its thread. An interrupt leaves the build running; the thread is a
            # daemon, so the exit does not wait for it.
            self._executor.shutdown(wait=build.done())
            raise
        self._queues: dict[str, asyncio.Queue] = {}
        if str(self.config.device).startswith("cuda"):  # a GPU step is shorter than the default 5 ms
            shorten_gil_switch_interval()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._next_id = 0
        self.dead_error: BaseException | None = None
        self.num_steps = 0

    @classmethod
    def from_config(cls, config: EngineConfig | None = None, **kwargs: Any) -> "AsyncEngine":
        if config is None:
            spec = kwargs.pop("speculative_config", None)
            if isinstance(spec, dict):
                spec = SpeculativeConfig.from_dict(spec)
            config = EngineConfig(speculative_config=spec, **kwargs)
        return cls(config)

    @property
    def tokenizer(self):
        return self.core.tokenizer

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Start the step loop (and, for P/D, bind the connector's side channel first:
        the engine is ready only once its listener is bound)."""
        if self._loop_task is None:
            self._wake = asyncio.Event()
            if self.core.connector_worker is not None:
                self.core.connector_worker.on_output = self._wake.set  # a finished load wakes the loop
                await self.core.connector_worker.start()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="atom-step-loop")

    @property
    def kv_connector_port(self) -> int | None:
        """P/D: the side-channel port this engine bound (None without a connector)."""
        connector = self.core.scheduler.connector
        return getattr(connector, "side_channel_port", None) if connector is not None else None

    async def shutdown(self) -> None:
        for request_id in list(self._queues):
            self.abort(request_id)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        if self.core.connector_worker is not None:
            await self.core.connector_worker.shutdown()
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> "AsyncEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # -- requests ------------------------------------------------------------------
    async def generate(
        self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None,
        request_id: str | None = None, kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield incremental outputs (``new_token_ids``, ``new_text``) until the request finishes."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error}")
        await self.start()
        if request_id is None:
            request_id = f"atom-{self._next_id}"
            self._next_id += 1
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.core.make_request(prompt, sampling_params or SamplingParams(), request_id,
                                         kv_transfer_params=kv_transfer_params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.core.add_request(request)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.core.abort_request(request_id)

    async def _idle(self, poll: bool = False) -> None:
        """Sleep until a request arrives or a transfer ends; with transfers pending, also wake every
        10 ms (leases expire without a wake-up)."""
        self._wake.clear()
        if not poll and not self.core.scheduler.has_connector_work:
            await self._wake.wait()
            return
        self.core.start_connector_work()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=0.01)
        except asyncio.TimeoutError:
            pass

    def _publish(self, outputs) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def abort(self, request_id: str) -> None:
        out = self.core.abort_request(request_id)
        queue = self._queues.get(request_id)
        if out is not None and queue is not None:
            queue.put_nowait(out)

    # -- the step loop -------------------------------------------------------------
    async def _run(self) -> None:
        """Schedule, run, update. With overlap, step N+1 is planned and queued on the
        forward thread before step N's results are applied; its not-yet-known tokens
        are placeholders the runner fills in (see Scheduler)."""
        loop = asyncio.get_running_loop()
        overlap = self.config.async_scheduling
        inflight = None  # (SchedulerOutput, Future) of the step running now
        try:
            while True:
                self._publish(self.core.poll_connector())
                if inflight is None and not self.core.has_unfinished_requests():
                    await self._idle()
                    continue
                nxt = None
                if (overlap or inflight is None) and self.core.has_unfinished_requests():
                    sched = self.core.schedule()
                    self.core.loads_wait_for_step = inflight is not None  # until that step's update
                    self.core.start_connector_work()
                    if sched.is_empty and inflight is None:  # e.g. only remote loads in flight
                        self.core.execute(sched)  # hands finished ids to the runner; no forward
                        await self._idle(poll=True)
                        continue
                    nxt = (sched, loop.run_in_executor(self._executor, self.core.execute, sched))
                if inflight is not None:
                    sched, future = inflight
                    self._publish(self.core.update(sched, await future))
                    self.num_steps += 1
                inflight = nxt
                await asyncio.sleep(0)  # let consumers and new requests in between steps
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in a step: fail every request, loudly
            logger.exception("engine step failed; failing all requests")
            self.dead_error = exc
            for request_id, outputs in list(self._queues.items()):
                self.core.abort_request(request_id)
                outputs.put_nowait(EngineDeadError(f"engine step failed: {exc!r}"))

    # -- introspection for /health and /metrics --------------------------------------
    def stats(self) -> dict[str, float]:
        sched, kv = self.core.scheduler, self.core.kv
        out = {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_block_usage": kv.block_usage,
            "state_slot_usage": kv.state_usage,
            "num_preemptions": sched.num_preemptions,
            "deferred_steps": self.core.runner.num_deferred_steps,
        }
        worker = self.core.connector_worker
        if worker is not None:
            out["kv_transfer_buffer_bytes_lent"] = worker.host_buffer_bytes_lent
            out["kv_transfer_staged_bytes"] = worker.staged_bytes
        return out

    def all_resources_free(self) -> bool:
        return self.core.all_resources_free()
