"""P/D pieces for tests and bench/pd.py: `atom-engine serve` subprocesses, an in-process router, /metrics.

A producer and a consumer run as separate processes (each its own Mooncake
transfer engine), started with ``--port 0``; the bound address is parsed from
the server's "listening on http://HOST:PORT" line. Mooncake is kept on
loopback and quiet (MC_TCP_BIND_ADDRESS, MC_LOG_LEVEL).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import IO

from aiohttp import web

from atom.entrypoints.router import Router, build_app

MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}
_LISTENING = re.compile(r"^listening on (http://\S+)$")


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "mooncake", "kv_role": role, "protocol": "tcp", "handshake_port": 0, **extra})


class ServeProcess:
    """`python -m atom serve ARGS --port 0` (or ``command`` ARGS) in a subprocess; stderr goes to ``log_path``."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> None:
        self.log_path = log_path
        self._log: IO = open(log_path, "w")
        env = {**os.environ, **MOONCAKE_ENV, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        command = command or [sys.executable, "-m", "atom", "serve"]
        self.proc = subprocess.Popen([*command, *args, "--host", "127.0.0.1", "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.url: str | None = None

    def wait_listening(self, timeout: float = 120.0) -> str:
        """Block until the server prints its address (a reader thread, so a silent server times out);
        a server that exits first fails at once."""
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                match = _LISTENING.match(line.strip())
                if match and self.url is None:
                    self.url = match.group(1)
                    found.set()
            found.set()  # stdout closed: the server has exited

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(timeout) or self.url is None:
            closed = found.is_set()
            self.stop()
            why = f"exited with {self.proc.returncode}" if closed else f"did not start within {timeout} s"
            raise RuntimeError(f"the server {why}; log:\n{self.log_tail()}")
        return self.url

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-lines:])

    def interrupt(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the server aborts what runs and shuts down cleanly

    def stop(self, timeout: float = 15.0) -> None:
        self.interrupt()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def stop_all(procs: list[ServeProcess]) -> None:
    for proc in procs:  # all at once: their shutdowns overlap
        proc.interrupt()
    for proc in procs:
        proc.stop()


class RouterThread:
    """The P/D router on its own event loop in a daemon thread; ``url`` once entered."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str]) -> None:
        self.router = Router(prefill_urls, decode_urls, timeout=60.0)
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    def __enter__(self) -> "RouterThread":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(build_app(self.router), handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of a server's /metrics, by name."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            out[parts[0]] = float(parts[1])
    return out


def wait_all_free(url: str, timeout: float = 20.0) -> None:
    """Poll until the server holds no KV blocks and no state slots (a producer frees once the
    consumer reports its transfer done), or fail naming what is still held."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        held = {k: m[k] for k in ("atom_kv_block_usage", "atom_state_slot_usage", "atom_num_requests_running",
                                  "atom_num_requests_waiting", "atom_kv_transfer_buffer_bytes_lent") if m.get(k)}
        if not held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} still holds resources {timeout} s after the last request: {held}")
        time.sleep(0.05)
