"""Prefill/decode router: one OpenAI endpoint in front of producer (prefill) and consumer (decode) servers.

Each request takes two legs, picking servers round-robin:

  client --body--> router --body + max_tokens=1, stream=false,
                             kv_transfer_params={"do_remote_decode": true}--> prefill server
                   router <--{..., "kv_transfer_params": {engine id, host, port, blocks, first token...}}--
                   router --original body + kv_transfer_params--> decode server
  client <---------- the decode server's response, byte for byte (SSE or JSON) ----------

Every request field passes through (extensions like ``return_token_ids`` too),
and so does the Authorization header. An error answer from a leg passes through
with its status and body; an unreachable leg is a 502, a slow one a 504, both
with OpenAI error bodies. A client that goes away mid-stream closes the decode
connection, so the decode server aborts the request and frees its blocks.
The router loads no model and imports no torch: it starts in a moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
from typing import Any, AsyncIterator

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")


class UpstreamError(Exception):
    """A leg we could not complete: shown to the client as an OpenAI error body with this status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill leg: the same request, cut to its first token and asking the producer to keep the KV."""
    leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    leg.pop("stream_options", None)
    if chat:
        leg["max_completion_tokens"] = 1
    if isinstance(body.get("min_tokens"), int):  # the producer samples the first token: min_tokens >= 1 binds it
        leg["min_tokens"] = min(body["min_tokens"], 1)
    return leg


class Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout: float = 300.0,
                 connect_timeout: float = 10.0) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one --prefill URL and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._next_prefill = itertools.cycle(self.prefill_urls)
        self._next_decode = itertools.cycle(self.decode_urls)
        self.timeout = aiohttp.ClientTimeout(total=timeout, connect=connect_timeout)
        self.session: aiohttp.ClientSession | None = None

    async def open(self, _: web.Application) -> None:
        # limit=0: no cap on connections per backend; the backends queue requests themselves.
        self.session = aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0))

    async def close(self, _: web.Application) -> None:
        await self.session.close()

    @contextlib.asynccontextmanager
    async def _call(self, method: str, url: str, **kwargs) -> AsyncIterator[aiohttp.ClientResponse]:
        try:
            async with self.session.request(method, url, **kwargs) as resp:
                yield resp
        except asyncio.TimeoutError:
            raise UpstreamError(504, f"{url} did not answer within the router's timeout") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(502, f"cannot reach {url}: {exc!r}") from None

    # -- generation ---------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        headers = _auth(request)
        chat = request.path == "/v1/chat/completions"

        url = next(self._next_prefill) + request.path
        async with self._call("POST", url, json=prefill_body(body, chat), headers=headers) as resp:
            if resp.status != 200:  # the prefill server's own error (a bad field, a wrong model): pass it on
                return await _copy(resp)
            try:
                params = (await resp.json(content_type=None)).get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
        if not isinstance(params, dict):
            raise UpstreamError(502, f"the prefill server {url} returned no kv_transfer_params; start it with "
                                "--kv-transfer-config '{\"kv_connector\": \"mooncake\", \"kv_role\": \"kv_producer\"}'")

        url = next(self._next_decode) + request.path
        async with self._call("POST", url, json={**body, "kv_transfer_params": params}, headers=headers) as resp:
            if resp.content_type != "text/event-stream":
                return await _copy(resp)
            return await _relay_stream(request, resp)

    # -- other endpoints ------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        async with self._call("GET", self.decode_urls[0] + "/v1/models", headers=_auth(request)) as resp:
            return await _copy(resp)

    async def health(self, request: web.Request) -> web.Response:
        """200 while the router runs; each backend's own /health status (or why it failed) alongside."""
        async def check(url: str) -> str:
            try:
                async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    return "ok" if resp.status == 200 else f"status {resp.status}"
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                return f"unreachable: {exc!r}"

        urls = self.prefill_urls + self.decode_urls
        states = dict(zip(urls, await asyncio.gather(*(check(u) for u in urls))))
        return web.json_response({"status": "ok", "prefill": {u: states[u] for u in self.prefill_urls},
                                  "decode": {u: states[u] for u in self.decode_urls}})


def _auth(request: web.Request) -> dict[str, str]:
    """The client's credentials, for the backends to check (the router itself checks none)."""
    return {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}


async def _copy(resp: aiohttp.ClientResponse) -> web.Response:
    """A backend's complete answer, same status, content type and body."""
    body = await resp.read()
    return web.Response(body=body, status=resp.status, headers={"Content-Type": resp.headers.get(
        "Content-Type", "application/json")})


async def _relay_stream(request: web.Request, resp: aiohttp.ClientResponse) -> web.StreamResponse:
    out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.headers["Content-Type"],
                                                          "Cache-Control": "no-cache"})
    await out.prepare(request)
    try:
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        # Headers are sent: report in-band, as the servers do. The decode server sees the connection close.
        resp.close()
        message = f"the decode server's stream broke off: {exc!r}"
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
        with contextlib.suppress(ConnectionResetError):
            await out.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
    except BaseException:
        # The client went away (a failed write, or this handler cancelled): drop the decode connection
        # rather than return it to the pool, so the decode server sees the disconnect and aborts.
        resp.close()
        raise
    return out


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except UpstreamError as exc:
        logger.warning("%s %s: %s", request.method, request.path, exc)
        return error_response(exc.status, str(exc), code="bad_gateway" if exc.status == 502 else "gateway_timeout")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, f"{request.method} {request.path}: {exc.reason}; the router serves "
                              "POST /v1/completions, POST /v1/chat/completions, GET /v1/models and GET /health")
    except ConnectionResetError:
        raise  # nobody is listening for an error body
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal router error; see the router's log")


def build_app(router: Router, max_body_bytes: int = 1 << 20) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=max_body_bytes)
    for path in ROUTES:
        app.router.add_post(path, router.generate)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.on_startup.append(router.open)
    app.on_cleanup.append(router.close)
    return app


async def serve(router: Router, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Listen (port 0: the kernel picks), print the address, and route until cancelled."""
    # handler_cancellation: a client that disconnects cancels its handler, which closes the decode leg.
    runner = web.AppRunner(build_app(router), handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        logger.info("routing prefill %s -> decode %s", router.prefill_urls, router.decode_urls)
        print(f"listening on http://{host}:{bound}", flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_router(router: Router, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Route until SIGINT/SIGTERM."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(serve(router, host, port))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass
    finally:
        loop.close()
