"""A real OpenAI server for tests: engine + aiohttp app on their own loop in a daemon thread.

The synchronous ``openai`` client and the test's own asyncio loop can both
talk to it. ``on_loop`` runs a function on the server's loop, so engine
state is read without racing the step loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from atom.engine.async_engine import AsyncEngine
from atom.entrypoints.openai import SERVER_KEY, build_app, start_site


class ServerThread:
    def __init__(self, model: str, served_model_name: str = "test-model", api_key: str | None = None,
                 **engine_kwargs: Any) -> None:
        engine_kwargs.setdefault("dtype", "float32")
        self.engine = AsyncEngine.from_config(model=model, **engine_kwargs)
        self.app = build_app(self.engine, served_model_name, api_key=api_key, max_body_bytes=64 * 1024)
        self.model_name = served_model_name
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: self.loop.run_until_complete(self._main()), daemon=True)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        runner = await start_site(self.app, "127.0.0.1", 0)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await self.engine.shutdown()

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        assert self._ready.wait(60), "the test server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.app[SERVER_KEY].port}"

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def idle(self) -> bool:
        stats = self.on_loop(self.engine.stats)
        return stats["num_running"] == 0 and stats["num_waiting"] == 0

    def wait_idle_and_free(self, timeout: float = 10.0) -> None:
        """Poll until no request is alive, then check every block and slot came back."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            assert time.monotonic() < deadline, f"requests still alive: {self.on_loop(self.engine.stats)}"
            time.sleep(0.02)
        assert self.on_loop(self.engine.all_resources_free), "KV blocks or state slots leaked"


def http_json(url: str, key: str | None = None, body: bytes | None = None, method: str | None = None
              ) -> tuple[int, dict]:
    """Status and decoded JSON body (empty for non-JSON) of one raw HTTP request."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request) as resp:
            return resp.status, json.loads(resp.read()) if "json" in resp.headers["Content-Type"] else {}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
