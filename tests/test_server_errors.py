"""Bad input to the OpenAI server: the right status and an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.openai_server import ServerThread, http_json

GOOD_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(llama_ckpt):
    with ServerThread(llama_ckpt, max_model_len=128) as server:
        yield server
        server.wait_idle_and_free()


def _completion(**fields) -> bytes:
    return json.dumps(fields).encode()


def _chat(**fields) -> bytes:
    return json.dumps({"messages": GOOD_MESSAGES, **fields}).encode()


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# (path, body, param named in the error); every case is a 400 invalid_request_error.
BAD_REQUESTS = {
    "malformed json": (COMPLETIONS, b'{"prompt": "x",', None),
    "json not an object": (COMPLETIONS, b'["x"]', None),
    "json a string": (CHAT, b'"hello"', None),
    "max_tokens a string": (COMPLETIONS, _completion(prompt="x", max_tokens="ten"), "max_tokens"),
    "temperature a string": (COMPLETIONS, _completion(prompt="x", temperature="hot"), "temperature"),
    "stream a string": (COMPLETIONS, _completion(prompt="x", stream="yes"), "stream"),
    "stop not strings": (COMPLETIONS, _completion(prompt="x", stop=[1]), "stop"),
    "empty stop string": (COMPLETIONS, _completion(prompt="x", stop=""), "stop"),
    "missing prompt": (COMPLETIONS, _completion(max_tokens=3), "prompt"),
    "empty prompt": (COMPLETIONS, _completion(prompt=""), "prompt"),
    "empty token list": (COMPLETIONS, _completion(prompt=[]), "prompt"),
    "batch of prompts": (COMPLETIONS, _completion(prompt=["a", "b"]), "prompt"),
    "mixed prompt list": (COMPLETIONS, _completion(prompt=[1, "a"]), "prompt"),
    "token id out of vocab": (COMPLETIONS, _completion(prompt=[5, 999_999]), "prompt"),
    "prompt too long": (COMPLETIONS, _completion(prompt=[5] * 200), "prompt"),
    "max_tokens zero": (COMPLETIONS, _completion(prompt="x", max_tokens=0), "max_tokens"),
    "top_p zero": (COMPLETIONS, _completion(prompt="x", top_p=0), "top_p"),
    "negative temperature": (COMPLETIONS, _completion(prompt="x", temperature=-0.5), "temperature"),
    # Past float32: the sampler saw inf or 0 and its probabilities became NaN
    "temperature past float32": (COMPLETIONS, _completion(prompt="x", temperature=1e308), "temperature"),
    "temperature Infinity (not JSON)": (COMPLETIONS, b'{"prompt": "x", "temperature": Infinity}', None),
    "repetition_penalty to 0": (CHAT, _chat(repetition_penalty=1e-300), "repetition_penalty"),
    # Once passed to the engine, where it failed the step and stopped the engine for every request.
    "seed beyond 64 bits": (COMPLETIONS, _completion(prompt="x", seed=2**70), "seed"),
    "presence_penalty range": (COMPLETIONS, _completion(prompt="x", presence_penalty=5), "presence_penalty"),
    "min_tokens over max": (COMPLETIONS, _completion(prompt="x", min_tokens=9, max_tokens=4), "min_tokens"),
    "n above one": (COMPLETIONS, _completion(prompt="x", n=2), "n"),
    "echo": (COMPLETIONS, _completion(prompt="x", echo=True), "echo"),
    "logprobs too many": (COMPLETIONS, _completion(prompt="x", logprobs=50), "logprobs"),
    "messages not a list": (CHAT, json.dumps({"messages": "hi"}).encode(), "messages"),
    "missing messages": (CHAT, b"{}", "messages"),
    "empty messages": (CHAT, json.dumps({"messages": []}).encode(), "messages"),
    "unknown role": (CHAT, json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages"),
    "message without role": (CHAT, json.dumps({"messages": [{"content": "x"}]}).encode(), "messages"),
    "image part": (CHAT, json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
                   "messages"),
    "top_logprobs without logprobs": (CHAT, _chat(top_logprobs=2), "top_logprobs"),
    "chat n above one": (CHAT, _chat(n=3), "n"),
    "chat max_tokens a string": (CHAT, _chat(max_completion_tokens="many"), "max_completion_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_400(server, case):
    path, body, param = BAD_REQUESTS[case]
    status, reply = http_json(server.url + path, body=body)
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"] and set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_model_is_400_model_not_found(server, path):
    body = _completion(prompt="x", model="gpt-4") if path == COMPLETIONS else _chat(model="gpt-4")
    status, reply = http_json(server.url + path, body=body)
    assert status == 400 and reply["error"]["code"] == "model_not_found" and reply["error"]["param"] == "model"
    assert "test-model" in reply["error"]["message"]  # names the fix


def test_official_client_sees_bad_request(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="test-model", prompt="x", max_tokens=3, temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_unknown_route_and_wrong_method(server):
    status, reply = http_json(f"{server.url}/v2/nothing")
    assert status == 404 and reply["error"]["code"] == "not_found"
    status, reply = http_json(f"{server.url}{COMPLETIONS}", method="GET")
    assert status == 405 and "error" in reply


def test_body_over_limit_is_413(server):
    status, reply = http_json(server.url + COMPLETIONS, body=_completion(prompt="x" * 100_000))
    assert status == 413 and reply["error"]["code"] == "request_too_large"


def test_unexpected_exception_is_500_without_a_stack(server):
    engine = server.engine

    def broken_stats():
        raise RuntimeError("secret internals")

    server.on_loop(lambda: setattr(engine, "stats", broken_stats))
    try:
        status, reply = http_json(f"{server.url}/metrics")
    finally:
        server.on_loop(lambda: delattr(engine, "stats"))
    assert status == 500 and reply["error"]["type"] == "server_error"
    assert "secret" not in reply["error"]["message"] and "Traceback" not in json.dumps(reply)


def test_dead_engine_is_503(server):
    engine = server.engine
    server.on_loop(lambda: setattr(engine, "dead_error", RuntimeError("step failed")))
    try:
        assert http_json(f"{server.url}/health")[0] == 503
        status, reply = http_json(server.url + COMPLETIONS, body=_completion(prompt="x", max_tokens=2))
        assert status == 503 and reply["error"]["type"] == "server_error"
    finally:
        server.on_loop(lambda: setattr(engine, "dead_error", None))


def test_still_serves_after_bad_requests(server):
    for path, body, _ in BAD_REQUESTS.values():
        http_json(server.url + path, body=body)
    status, reply = http_json(server.url + COMPLETIONS, body=_completion(prompt="Hello", max_tokens=3,
                                                                          ignore_eos=True))
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    status, reply = http_json(server.url + CHAT, body=_chat(max_tokens=2, ignore_eos=True, stream=False))
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
    assert http_json(f"{server.url}/health") == (200, {"status": "ok"})


async def test_stream_aborted_by_the_server_ends_with_an_error_event(server):
    import aiohttp

    body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + COMPLETIONS, json=body) as resp:
            events = [json.loads((await resp.content.readline())[6:])]
            server.on_loop(lambda: server.engine.abort(events[0]["id"]))
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "aborted" in error["message"]


def test_a_step_that_raises_fails_every_request_with_503_and_nothing_hangs(llama_ckpt):
    """A bug inside a step (injected: the model's forward raises) fails the request in it, a stream whose first
    chunk never came too, with a 503 naming the error. /health then answers 503, and new requests (plain or
    streamed) get a 503 at once instead of waiting on a dead loop."""
    with ServerThread(llama_ckpt, max_model_len=128) as server:
        assert http_json(server.url + "/health")[0] == 200

        def broken(*args, **kwargs):
            raise RuntimeError("injected fault")

        server.on_loop(lambda: setattr(server.engine.core.runner.model, "forward", broken))
        status, reply = http_json(server.url + COMPLETIONS, body=_completion(prompt="x", max_tokens=4, stream=True))
        assert status == 503 and "engine step failed" in reply["error"]["message"], reply
        assert "injected fault" in reply["error"]["message"]
        status, reply = http_json(server.url + "/health")
        assert status == 503 and "injected fault" in reply["error"]["message"], reply
        started = time.monotonic()
        for path, body in ((COMPLETIONS, _completion(prompt="y", max_tokens=4)),
                           (CHAT, _chat(max_completion_tokens=4, stream=True))):  # fmt: skip
            status, reply = http_json(server.url + path, body=body)
            assert status == 503 and "the engine stopped after an error" in reply["error"]["message"], reply
        assert time.monotonic() - started < 5
        server.wait_idle_and_free()  # the failed request's blocks and state slot came back
