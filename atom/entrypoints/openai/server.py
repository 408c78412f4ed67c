"""OpenAI-compatible HTTP server on aiohttp, sharing one event loop with the engine.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models
(behind the API key when one is set), GET /health and GET /metrics (open).
Every error is an OpenAI error body ``{"error": {message, type, param,
code}}``; unexpected exceptions become a 500 without a stack trace.

A request's outputs come from ``AsyncEngine.generate`` inside
``contextlib.aclosing``: when the client goes away (a failed write, or the
handler cancelled by aiohttp's ``handler_cancellation``) the generator is
closed, which aborts the request and frees its blocks and slots at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
from typing import Any, AsyncIterator, Callable

import msgspec
from aiohttp import web

from atom.config import EngineConfig
from atom.engine.async_engine import AsyncEngine, EngineDeadError
from atom.entrypoints.chat import render_chat_prompt
from atom.entrypoints.openai import protocol
from atom.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from atom.entrypoints.openai.protocol import APIError
from atom.entrypoints.openai.responses import ChatFormatter, CompletionFormatter, Formatter
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

API_KEY_ENV = "ATOM_API_KEY"  # like vLLM's VLLM_API_KEY
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _json(body: Any, status: int = 200) -> web.Response:
    # msgspec writes non-finite floats (a -inf logprob) as null, keeping the JSON valid.
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


class OpenAIServer:
    """The route handlers; one per app, holding the engine, the served name and the metrics."""

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.port: int | None = None  # the bound port, once a site listens

    # -- generation endpoints -------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = protocol.decode(await request.read(), protocol.CompletionRequest)
        protocol.check_model(req.model, self.model_name)
        params = protocol.completion_sampling_params(req)
        prompt = protocol.completion_prompt(req)
        fmt = CompletionFormatter(self.model_name, params, self.engine.tokenizer, req.return_token_ids)
        return await self._generate(request, prompt, params, fmt, req, "prompt")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = protocol.decode(await request.read(), protocol.ChatCompletionRequest)
        protocol.check_model(req.model, self.model_name)
        params = protocol.chat_sampling_params(req)
        try:
            prompt = render_chat_prompt(self.engine.tokenizer, msgspec.to_builtins(req.messages))
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        fmt = ChatFormatter(self.model_name, params, self.engine.tokenizer, req.return_token_ids)
        return await self._generate(request, prompt, params, fmt, req, "messages")

    async def _generate(self, request: web.Request, prompt, params: SamplingParams, fmt: Formatter,
                        req: protocol.SamplingFields, prompt_param: str) -> web.StreamResponse:
        if req.kv_transfer_params is not None and self.engine.config.kv_transfer_config is None:
            raise APIError(400, "kv_transfer_params needs a server started with --kv-transfer-config "
                           "(as a kv_producer or kv_consumer); drop the field here", param="kv_transfer_params")
        raw = self.engine.generate(prompt, params, request_id=fmt.request_id,
                                   kv_transfer_params=req.kv_transfer_params)
        async with contextlib.aclosing(raw), contextlib.aclosing(self._observed(raw)) as outputs:
            try:
                first = await anext(outputs)
            except ValueError as exc:  # the engine rejected the prompt (empty, too long, bad ids) or P/D params
                param = "kv_transfer_params" if "kv_transfer_params" in str(exc) else prompt_param
                raise APIError(400, str(exc), param=param) from None
            if req.stream:
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                return await self._stream(request, first, outputs, fmt, include_usage)
            last = first
            async for out in outputs:
                last = out
            _raise_if_failed(last)
            return _json(fmt.response(last))

    async def _observed(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass outputs through; record the request in the metrics when it ends, however it ends."""
        last = None
        try:
            async for out in outputs:
                last = out
                yield out
        finally:
            if last is not None:
                self.metrics.observe_finished(last, None if last.finished else "abort")

    async def _stream(self, request: web.Request, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                      fmt: Formatter, include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        try:
            out = first
            while True:
                _raise_if_failed(out)
                for chunk in fmt.chunks(out):
                    await _send(response, chunk)
                if out.finished:
                    break
                out = await anext(outputs)
            if include_usage:
                await _send(response, fmt.usage_chunk(out))
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            logger.debug("client of %s went away; aborting it", fmt.request_id)
        except Exception as exc:  # headers are sent: report in-band, as OpenAI's streams do
            if not isinstance(exc, (APIError, EngineDeadError)):
                logger.exception("stream %s failed", fmt.request_id)
            with contextlib.suppress(ConnectionResetError):
                await _send(response, _error_for(exc).body())
                await response.write(b"data: [DONE]\n\n")
        return response

    # -- other endpoints -----------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "atom",
                "root": self.engine.config.model, "max_model_len": self.engine.config.max_model_len}
        return _json({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.dead_error is not None:
            raise APIError(503, f"the engine stopped after an error: {self.engine.dead_error!r}")
        if not self.engine.is_running:
            raise APIError(503, "the engine loop is not running")
        return _json({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        body = self.metrics.render(self.engine.stats())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")


def _raise_if_failed(out: RequestOutput) -> None:
    reason = out.outputs[0].finish_reason
    if reason == "abort":
        raise APIError(503, "the request was aborted before it finished (is the server shutting down?)")
    if reason == "error":
        # e.g. a P/D consumer whose producer died: the engine says what failed
        raise APIError(502 if out.error and "remote KV" in out.error else 500,
                       out.error or "the request failed inside the engine")


def _error_for(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    return APIError(500, "internal server error; see the server log")


# -- middlewares --------------------------------------------------------------------------------

def _error_middleware(max_body_bytes: int):
    @web.middleware
    async def errors(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return _json(exc.body(), exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _json(_http_error(request, exc, max_body_bytes).body(), exc.status)
        except ConnectionResetError:
            raise  # nobody is listening for an error body
        except EngineDeadError as exc:
            return _json(_error_for(exc).body(), 503)
        except Exception:
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return _json(_error_for(RuntimeError()).body(), 500)

    return errors


def _http_error(request: web.Request, exc: web.HTTPException, max_body_bytes: int) -> APIError:
    if exc.status == 404:
        return APIError(404, f"no route for {request.method} {request.path}; this server serves /v1/completions, "
                        "/v1/chat/completions, /v1/models, /health and /metrics", code="not_found")
    if exc.status == 405:
        return APIError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed")
    if exc.status == 413:
        return APIError(413, f"the request body is larger than the server's limit of {max_body_bytes} bytes",
                        code="request_too_large")
    return APIError(exc.status, exc.reason)


def _auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path == "/v1":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise APIError(401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        return await handler(request)

    return auth


# -- public entry points ----------------------------------------------------------------------------

SERVER_KEY = web.AppKey("openai_server", OpenAIServer)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20) -> web.Application:
    """The aiohttp app; ``api_key=None`` falls back to $ATOM_API_KEY, and no key at all leaves /v1 open."""
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    middlewares = [_error_middleware(max_body_bytes)]
    if api_key:
        middlewares.append(_auth_middleware(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    server = OpenAIServer(engine, served_model_name)
    app[SERVER_KEY] = server
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.prometheus)

    async def start_engine(_: web.Application) -> None:
        await engine.start()

    app.on_startup.append(start_engine)
    return app


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Listen on host:port (0: the kernel picks); the bound port is ``app[SERVER_KEY].port``."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    app[SERVER_KEY].port = runner.addresses[0][1]
    return runner


async def serve(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                served_model_name: str | None = None, ready: asyncio.Event | None = None, *,
                on_listening: Callable[[str, int], None] | None = None) -> None:
    """Build the engine, listen, set ``ready`` (after binding), and serve until cancelled."""
    async with AsyncEngine(engine_config) as engine:
        app = build_app(engine, served_model_name or engine_config.model, api_key)
        runner = await start_site(app, host, port)
        try:
            bound = app[SERVER_KEY].port
            logger.info("listening on http://%s:%d", host, bound)
            print(f"listening on http://{host}:{bound}", flush=True)
            if on_listening is not None:
                on_listening(host, bound)
            if ready is not None:
                ready.set()
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def _new_event_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            logger.info("uvloop is not installed; using the default asyncio loop")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_server(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, use_uvloop: bool = True) -> None:
    """Serve until SIGINT/SIGTERM, then shut down cleanly (in-flight requests are aborted)."""
    loop = _new_event_loop(use_uvloop)
    asyncio.set_event_loop(loop)
    task = loop.create_task(serve(engine_config, host, port, api_key, served_model_name))
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, task.cancel)
    try:
        loop.run_until_complete(task)
    except (asyncio.CancelledError, KeyboardInterrupt):
        pass
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
