"""The P/D router against small aiohttp backends standing in for prefill and decode servers.

The backends are test doubles of remote servers (they record what reached
them and answer like a producer or a consumer would); the router under test
is the real one, on a real socket, talked to over HTTP. The last tests put
the router and the server's ``kv_transfer_params`` field in front of a real
ATOM server.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import urllib.request

import aiohttp
import openai
import pytest
from aiohttp import web

from atom import cli
from atom.entrypoints.router import Router, build_app
from tests.openai_server import ServerThread

pytestmark = pytest.mark.timeout(60)

# What a decode server streams back: the router must relay these bytes exactly, however they are split.
SSE = [b'data: {"choices": [{"index": 0, "text": "Hel", "token_ids": [1]}]}\n\n',
       b'data: {"choices": [{"index": 0, "text": "lo\\u00e9", "token_ids": [2, 3]}]}\n\ndata: {"cho',
       b'ices": [{"index": 0, "text": "", "finish_reason": "length"}], "kv_transfer_params": null}\n\n',
       b"data: [DONE]\n\n"]


class Backend:
    """A fake prefill or decode server: records each request, answers like ATOM's server."""

    def __init__(self, role: str, name: str) -> None:
        self.role, self.name = role, name
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.delay = 0.0  # seconds before answering
        self.endless = False  # decode: stream until the client goes away
        self.cancelled = asyncio.Event()  # decode: the handler was cancelled by a disconnect
        self.no_params = False  # prefill: answer without kv_transfer_params, like a server without P/D
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> "Backend":
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.delay)
        if body.get("model") == "wrong":
            error = {"message": "the model 'wrong' is not served here", "type": "invalid_request_error",
                     "param": "model", "code": "model_not_found"}
            return web.json_response({"error": error}, status=400)
        if self.role == "prefill":
            params = None if self.no_params else {"remote_engine_id": self.name, "remote_block_ids": [4, 5],
                                                  "first_token": 7}
            return web.json_response({"object": "text_completion", "choices": [{"text": "x"}],
                                      "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"object": "text_completion", "served_by": self.name,
                                      "choices": [{"index": 0, "text": "Helloé"}], "kv_transfer_params": None})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for part in SSE[:-1] if self.endless else SSE:
                await response.write(part)
                await asyncio.sleep(0.01)
            while self.endless:
                await response.write(b": keep-alive\n\n")
                await asyncio.sleep(0.02)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise
        return response


class Setup:
    def __init__(self, prefill: list[Backend], decode: list[Backend], router_url: str) -> None:
        self.prefill, self.decode, self.url = prefill, decode, router_url


async def _start_router(router: Router) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(build_app(router), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def setup():
    prefill = [await Backend("prefill", f"p{i}").start() for i in range(2)]
    decode = [await Backend("decode", f"d{i}").start() for i in range(2)]
    runner, url = await _start_router(Router([b.url for b in prefill], [b.url + "/" for b in decode]))
    yield Setup(prefill, decode, url)
    await runner.cleanup()
    for backend in prefill + decode:
        await backend.stop()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _post(url: str, body, headers: dict | None = None) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with session.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
                                ) as resp:
            return resp.status, resp.content_type, await resp.read()


COMPLETION = {"model": "m", "prompt": "Hello there", "max_tokens": 9, "temperature": 0, "top_k": 3, "seed": 5,
              "return_token_ids": True, "stop": ["\n"], "ignore_eos": True, "stream": True, "min_tokens": 4,
              "stream_options": {"include_usage": True}, "some_future_field": {"x": [1, 2]}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "logprobs": True,
        "top_logprobs": 2, "repetition_penalty": 1.1}


# -- the two legs ---------------------------------------------------------------------------------

async def test_streaming_completion_passes_every_field_and_relays_bytes_exactly(setup):
    status, ctype, data = await _post(setup.url + "/v1/completions", COMPLETION, {"Authorization": "Bearer k1"})
    assert (status, ctype, data) == (200, "text/event-stream", b"".join(SSE))

    [prefill_body] = setup.prefill[0].bodies
    expect = {**COMPLETION, "max_tokens": 1, "stream": False, "min_tokens": 1,
              "kv_transfer_params": {"do_remote_decode": True}}
    del expect["stream_options"]
    assert prefill_body == expect

    [decode_body] = setup.decode[0].bodies
    assert decode_body == {**COMPLETION, "kv_transfer_params": {"remote_engine_id": "p0", "remote_block_ids": [4, 5],
                                                                "first_token": 7}}
    assert setup.prefill[0].auth == setup.decode[0].auth == ["Bearer k1"]


async def test_chat_caps_both_token_limits_and_returns_decode_json(setup):
    status, ctype, data = await _post(setup.url + "/v1/chat/completions", CHAT)
    assert (status, ctype) == (200, "application/json")
    assert json.loads(data)["served_by"] == "d0"
    [prefill_body] = setup.prefill[0].bodies
    assert prefill_body == {**CHAT, "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                            "kv_transfer_params": {"do_remote_decode": True}}
    assert setup.decode[0].bodies[0] == {**CHAT, "kv_transfer_params": setup.decode[0].bodies[0]["kv_transfer_params"]}
    assert setup.prefill[0].auth == [None]  # no header given, none invented


async def test_round_robin_over_prefill_and_decode_servers(setup):
    for _ in range(4):
        status, _, _ = await _post(setup.url + "/v1/completions", {"prompt": "x", "stream": False})
        assert status == 200
    assert [len(b.bodies) for b in setup.prefill + setup.decode] == [2, 2, 2, 2]
    # Each decode leg carries the params of the prefill leg just before it.
    engines = [b["kv_transfer_params"]["remote_engine_id"] for d in setup.decode for b in d.bodies]
    assert sorted(engines) == ["p0", "p0", "p1", "p1"]


async def test_openai_client_streams_through_the_router(setup):
    client = openai.AsyncOpenAI(base_url=setup.url + "/v1", api_key="k2", max_retries=0)
    stream = await client.completions.create(model="m", prompt="hi", max_tokens=3, stream=True,
                                             extra_body={"return_token_ids": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == "Helloé"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert setup.decode[0].auth == ["Bearer k2"]
    await client.close()


# -- errors -------------------------------------------------------------------------------------

async def test_a_legs_own_error_passes_through_and_stops_there(setup):
    status, _, data = await _post(setup.url + "/v1/completions", {"model": "wrong", "prompt": "x"})
    assert status == 400 and json.loads(data)["error"]["code"] == "model_not_found"
    assert not setup.decode[0].bodies and not setup.decode[1].bodies


async def test_bad_bodies_are_400(setup):
    for body in (b"{not json", b"[1, 2]"):
        status, _, data = await _post(setup.url + "/v1/completions", body)
        assert status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"
    async with aiohttp.ClientSession() as session, session.get(setup.url + "/v2/nothing") as resp:
        assert resp.status == 404 and "/v1/completions" in (await resp.json())["error"]["message"]


async def test_prefill_without_kv_transfer_params_is_502_naming_the_fix(setup):
    setup.prefill[0].no_params = True
    status, _, data = await _post(setup.url + "/v1/completions", {"prompt": "x"})
    error = json.loads(data)["error"]
    assert status == 502 and "kv_producer" in error["message"] and error["type"] == "server_error"
    assert not setup.decode[0].bodies


@pytest.mark.parametrize("dead", ["prefill", "decode"])
async def test_a_dead_backend_is_502(dead):
    live = await Backend("decode" if dead == "prefill" else "prefill", "live").start()
    urls = {dead: [_dead_url()], "live": [live.url]}
    router = Router(urls["prefill"] if dead == "prefill" else urls["live"],
                    urls["decode"] if dead == "decode" else urls["live"])
    runner, url = await _start_router(router)
    try:
        status, _, data = await _post(url + "/v1/completions", {"prompt": "x", "stream": True})
        error = json.loads(data)["error"]
        assert status == 502 and error["code"] == "bad_gateway" and "cannot reach" in error["message"]
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
            health = await resp.json()
        assert resp.status == 200 and health[dead][urls[dead][0]].startswith("unreachable")
    finally:
        await runner.cleanup()
        await live.stop()


async def test_a_slow_leg_is_504_within_the_timeout():
    prefill, decode = await Backend("prefill", "p").start(), await Backend("decode", "d").start()
    prefill.delay = 5.0
    runner, url = await _start_router(Router([prefill.url], [decode.url], timeout=0.3))
    try:
        status, _, data = await asyncio.wait_for(_post(url + "/v1/completions", {"prompt": "x"}), 3)
        assert status == 504 and json.loads(data)["error"]["code"] == "gateway_timeout"
    finally:
        await runner.cleanup()
        await prefill.stop()
        await decode.stop()


async def test_client_disconnect_mid_stream_closes_the_decode_leg(setup):
    setup.decode[0].endless = True
    async with aiohttp.ClientSession() as session:
        resp = await session.post(setup.url + "/v1/completions", json={"prompt": "x", "stream": True})
        assert await resp.content.readuntil(b"\n\n") == SSE[0]
        resp.close()  # drop the connection, as a client that gives up does
    await asyncio.wait_for(setup.decode[0].cancelled.wait(), 5)


# -- other endpoints and the CLI -----------------------------------------------------------------

async def test_health_and_models(setup):
    async with aiohttp.ClientSession() as session:
        async with session.get(setup.url + "/health") as resp:
            health = await resp.json()
        assert resp.status == 200 and health["status"] == "ok"
        assert list(health["prefill"].values()) == ["ok", "ok"] and list(health["decode"].values()) == ["ok", "ok"]
        async with session.get(setup.url + "/v1/models") as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "d0"


def test_router_cli(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["router", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--prefill", "--decode", "--host", "--port", "--timeout"))
    assert cli.main(["router", "--prefill", "localhost:1", "--decode", "http://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "atom-engine: error: 'localhost:1' is not a server URL; use one like http://127.0.0.1:8100"]


def test_router_cli_serves_until_sigint():
    proc = subprocess.Popen([sys.executable, "-m", "atom", "router", "--prefill", "http://127.0.0.1:1",
                             "--decode", "http://127.0.0.1:2", "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        with urllib.request.urlopen(line.split()[-1] + "/health", timeout=10) as resp:
            assert json.loads(resp.read())["decode"]["http://127.0.0.1:2"].startswith("unreachable")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        proc.kill()


# -- a real ATOM server behind the router -----------------------------------------------------------

@pytest.fixture(scope="module")
def atom_server(llama_ckpt):
    with ServerThread(llama_ckpt) as server:
        yield server
        server.wait_idle_and_free()


def test_server_returns_kv_transfer_params_field(atom_server):
    client = openai.OpenAI(base_url=atom_server.url + "/v1", api_key="x", max_retries=0)
    full = client.completions.create(model=atom_server.model_name, prompt="Hi there", max_tokens=3)
    assert full.model_extra["kv_transfer_params"] is None
    chunks = list(client.chat.completions.create(model=atom_server.model_name, max_tokens=3, stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].choices[0].finish_reason is not None and chunks[-1].model_extra["kv_transfer_params"] is None
    assert all("kv_transfer_params" not in c.model_extra for c in chunks[:-1])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=atom_server.model_name, prompt="Hi", extra_body={"kv_transfer_params": 3})
    assert err.value.body["param"] == "kv_transfer_params"


async def test_router_in_front_of_a_server_without_pd(atom_server):
    runner, url = await _start_router(Router([atom_server.url], [atom_server.url]))
    try:
        status, _, data = await _post(url + "/v1/completions", {"model": "wrong", "prompt": "x"})
        assert status == 400 and json.loads(data)["error"]["param"] == "model"
        # Not a producer: the server refuses the prefill leg's kv_transfer_params, naming the flag.
        status, _, data = await _post(url + "/v1/completions", {"model": atom_server.model_name, "prompt": "x"})
        error = json.loads(data)["error"]
        assert status == 400 and error["param"] == "kv_transfer_params" and "--kv-transfer-config" in error["message"]
        async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == atom_server.model_name
    finally:
        await runner.cleanup()
