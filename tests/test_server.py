"""The OpenAI server end to end: the official client, raw streams, metrics, keys, load and disconnects."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from atom.config import EngineConfig
from atom.entrypoints.openai import SERVER_KEY, build_app, serve, start_site
from tests.openai_server import ServerThread, http_json

PROMPT = "Hello world, how are you today?"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: one, two"}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def llama_server(llama_ckpt):
    with ServerThread(llama_ckpt) as server:
        yield server
        server.wait_idle_and_free()


@pytest.fixture(scope="module")
def kimi_server(kimi_ckpt):
    with ServerThread(kimi_ckpt) as server:
        yield server
        server.wait_idle_and_free()


@pytest.fixture(params=["llama_server", "kimi_server"])
def server(request) -> ServerThread:
    return request.getfixturevalue(request.param)


def client(server: ServerThread, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)


# -- the official client -------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}])
def test_completion_stream_equals_non_stream(server, sampling):
    c = client(server)
    kw = dict(model=server.model_name, prompt=PROMPT, max_tokens=12, extra_body=NO_EOS, **sampling)
    full = c.completions.create(**kw)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.model == server.model_name
    assert choice.finish_reason == "length"
    prompt_len = len(server.engine.tokenizer.encode(PROMPT))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        prompt_len, 12, prompt_len + 12)

    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    text_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in text_chunks) == choice.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.id == chunks[0].id and ch.id.startswith("cmpl-") for ch in chunks)


def test_chat_stream_equals_non_stream(server):
    c = client(server)
    kw = dict(model=server.model_name, messages=MESSAGES, max_completion_tokens=10, temperature=0.8, seed=7,
              extra_body=NO_EOS)
    full = c.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10

    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_return_token_ids(llama_server):
    c, tok = client(llama_server), llama_server.engine.tokenizer
    kw = dict(model=llama_server.model_name, prompt=PROMPT, max_tokens=8, temperature=0.0,
              extra_body={"return_token_ids": True, **NO_EOS})
    full = c.completions.create(**kw).model_dump()
    assert full["prompt_token_ids"] == tok.encode(PROMPT)
    ids = full["choices"][0]["token_ids"]
    assert len(ids) == 8
    assert tok.decode(ids).rstrip("\ufffd") == full["choices"][0]["text"].rstrip("\ufffd")

    chunks = [ch.model_dump() for ch in c.completions.create(stream=True, **kw)]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == ids

    chat = c.chat.completions.create(model=llama_server.model_name, messages=MESSAGES, max_tokens=5,
                                     temperature=0.0, extra_body={"return_token_ids": True, **NO_EOS}).model_dump()
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert len(chat["choices"][0]["token_ids"]) == 5


def test_logprobs(server):
    c = client(server)
    comp = c.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=2,
                                extra_body=NO_EOS).choices[0].logprobs
    assert len(comp.tokens) == len(comp.token_logprobs) == len(comp.top_logprobs) == len(comp.text_offset) == 6
    assert all(lp <= 0 for lp in comp.token_logprobs)
    # Keyed by token text as OpenAI does, so tokens that decode alike (partial bytes) share a key.
    assert all(token in top for token, top in zip(comp.tokens, comp.top_logprobs))

    chat = c.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=6, temperature=0.0,
                                     logprobs=True, top_logprobs=3, extra_body=NO_EOS).choices[0].logprobs
    assert len(chat.content) == 6
    for item in chat.content:  # greedy without penalties: the sampled token is the most likely one
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)


def test_stop_string_is_cut(kimi_server):
    c = client(kimi_server)
    kw = dict(model=kimi_server.model_name, prompt=PROMPT, max_tokens=30, temperature=0.0)
    text = c.completions.create(extra_body=NO_EOS, **kw).choices[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    expected = text[: text.index(stop)]
    cut = c.completions.create(stop=[stop], extra_body=NO_EOS, **kw).choices[0]
    assert cut.text == expected and cut.finish_reason == "stop"
    streamed = c.completions.create(stop=stop, stream=True, extra_body=NO_EOS, **kw)
    assert "".join(ch.choices[0].text for ch in streamed) == expected


# -- models, health, metrics, keys -------------------------------------------------------------------

def _metrics(server: ServerThread) -> dict[str, float]:
    text = urllib.request.urlopen(f"{server.url}/metrics").read().decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_models_health_metrics(llama_server):
    c = client(llama_server)
    assert [m.id for m in c.models.list().data] == [llama_server.model_name]
    assert c.models.list().data[0].owned_by == "atom"
    before = _metrics(llama_server)
    c.completions.create(model=llama_server.model_name, prompt=PROMPT, max_tokens=4, extra_body=NO_EOS)
    after = _metrics(llama_server)
    key = "atom_requests_total[('finish_reason', 'length')]"
    assert after[key] == before.get(key, 0) + 1
    assert after["atom_generation_tokens_total[]"] == before["atom_generation_tokens_total[]"] + 4
    assert after["atom_prompt_tokens_total[]"] > before["atom_prompt_tokens_total[]"]
    assert after["atom_e2e_request_latency_seconds_count[]"] == before["atom_e2e_request_latency_seconds_count[]"] + 1
    for gauge in ("atom_num_requests_running", "atom_num_requests_waiting", "atom_kv_block_usage",
                  "atom_state_slot_usage"):
        assert f"{gauge}[]" in after
    assert after["atom_deferred_decode_steps_total[]"] == 0  # on a CPU no step runs on decode graphs
    with urllib.request.urlopen(f"{llama_server.url}/health") as resp:
        assert resp.status == 200 and resp.read() == b'{"status":"ok"}'


def test_api_key(llama_server, monkeypatch):
    monkeypatch.setenv("ATOM_API_KEY", "from-env")
    for key, app in (("secret", build_app(llama_server.engine, "keyed", api_key="secret")),
                     ("from-env", build_app(llama_server.engine, "keyed"))):
        runner = asyncio.run_coroutine_threadsafe(start_site(app, "127.0.0.1", 0), llama_server.loop).result(10)
        try:
            url = f"http://127.0.0.1:{app[SERVER_KEY].port}"
            for bad in (None, "wrong"):
                status, body = http_json(f"{url}/v1/models", bad)
                assert status == 401 and body["error"]["code"] == "invalid_api_key"
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
            c = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            assert c.completions.create(model="keyed", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
            assert http_json(f"{url}/health")[0] == 200  # health and metrics stay open
            assert http_json(f"{url}/metrics")[0] == 200
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), llama_server.loop).result(10)


# -- load, disconnects, a busy loop --------------------------------------------------------------------

async def _stream_one(session: aiohttp.ClientSession, url: str, i: int, disconnect: bool) -> int:
    body = {"prompt": f"{PROMPT} {i}", "max_tokens": 8, "stream": True, "temperature": 0.8, "seed": i,
            "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        events = 0
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                return events
            events += 1
            if disconnect:
                resp.close()  # drop the connection mid-stream
                return -1
    raise AssertionError("stream ended without [DONE]")


async def test_100_concurrent_streams_with_disconnects(llama_server):
    aborted = "atom_requests_total[('finish_reason', 'abort')]"
    before = (await asyncio.to_thread(_metrics, llama_server)).get(aborted, 0)
    connector = aiohttp.TCPConnector(limit=200)
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(
            *(_stream_one(session, llama_server.url, i, disconnect=i % 5 == 0) for i in range(100)))
    assert results.count(-1) == 20
    assert all(r >= 1 for r in results if r != -1)
    await asyncio.to_thread(llama_server.wait_idle_and_free)
    # Disconnected streams were aborted (not run to the end): a few may finish before the server notices.
    assert (await asyncio.to_thread(_metrics, llama_server))[aborted] - before >= 10
    # Still serves afterwards.
    async with aiohttp.ClientSession() as session:
        assert await _stream_one(session, llama_server.url, 0, disconnect=False) >= 1


async def test_health_answers_during_a_long_forward(llama_server):
    engine = llama_server.engine
    execute = engine.core.execute

    def slow_execute(sched):  # a forward that takes 0.5 s, as a big batch on a real model would
        time.sleep(0.5)
        return execute(sched)

    engine.core.execute = slow_execute
    try:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
            gen = asyncio.ensure_future(session.post(f"{llama_server.url}/v1/completions", json=body))
            await asyncio.sleep(0.2)  # the first forward is running now
            start = time.monotonic()
            async with session.get(f"{llama_server.url}/health") as resp:
                assert resp.status == 200
            assert time.monotonic() - start < 0.3, "health waited for the forward"
            assert not gen.done()
            resp = await gen
            assert (await resp.json())["usage"]["completion_tokens"] == 2
    finally:
        engine.core.execute = execute


async def test_serve_binds_and_reports_port(llama_ckpt, monkeypatch):
    monkeypatch.delenv("ATOM_API_KEY", raising=False)
    ready, bound = asyncio.Event(), []
    config = EngineConfig(model=llama_ckpt, dtype="float32", max_num_seqs=4)
    task = asyncio.create_task(serve(config, "127.0.0.1", 0, served_model_name="served", ready=ready,
                                     on_listening=lambda host, port: bound.append(port)))
    await asyncio.wait_for(ready.wait(), 60)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{bound[0]}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "served"
            async with session.get(f"http://127.0.0.1:{bound[0]}/health") as resp:
                assert resp.status == 200
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_engine_embedded_in_an_app_with_its_own_tasks(llama_ckpt):
    from atom import AsyncEngine, SamplingParams

    ticks: list[float] = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.005)

    async def consume(params):
        async for out in engine.generate(PROMPT, params):
            last = out
        return last

    async with AsyncEngine.from_config(model=llama_ckpt, dtype="float32") as engine:
        tick_task = asyncio.create_task(ticker())
        start = time.monotonic()
        outs = await asyncio.gather(*(consume(SamplingParams(max_tokens=24, ignore_eos=True)) for _ in range(4)))
        times = [start, *ticks, time.monotonic()]
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        # the ticker ran all through the generation (however long that took): no gap of half a second
        assert ticks and max(b - a for a, b in zip(times, times[1:])) < 0.5, "the loop was blocked"

        started = asyncio.Event()

        async def long_consumer():
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(long_consumer())
        await started.wait()
        assert not engine.all_resources_free()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.all_resources_free() and engine.stats()["num_running"] == 0
        tick_task.cancel()


async def test_engine_builds_and_runs_its_model_on_the_forward_thread(llama_ckpt, monkeypatch):
    """The model is built on the thread that runs its forwards, not on the loop's thread: once two threads
    have run OpenMP regions, every small CPU op waits on a thread wake-up (CPU steps took 4x longer)."""
    import threading

    from atom import AsyncEngine, SamplingParams
    from atom.worker.model_runner import ModelRunner

    threads: dict[str, set[int]] = {"build": set(), "forward": set()}
    build, forward = ModelRunner.__init__, ModelRunner.execute_model

    def recorded_build(self, *args, **kwargs):
        threads["build"].add(threading.get_ident())
        build(self, *args, **kwargs)

    def recorded_forward(self, *args, **kwargs):
        threads["forward"].add(threading.get_ident())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "__init__", recorded_build)
    monkeypatch.setattr(ModelRunner, "execute_model", recorded_forward)
    async with AsyncEngine.from_config(model=llama_ckpt, dtype="float32") as engine:
        async for out in engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)):
            pass
        assert len(out.outputs[0].token_ids) == 4
    assert len(threads["build"]) == 1 and threads["forward"] == threads["build"]
    assert threading.get_ident() not in threads["build"]


async def test_engine_that_fails_to_build_raises_and_leaves_no_thread(tmp_path):
    import threading

    from atom import AsyncEngine

    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"], "max_position_embeddings": 64}')
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="NoSuchModel"):
        AsyncEngine.from_config(model=str(tmp_path))
    left = {t.name for t in threading.enumerate()} - before
    assert not any(name.startswith("atom-forward") for name in left), left


def test_a_slow_build_s_own_timeout_error_reaches_the_caller(monkeypatch):
    """AsyncEngine waits on its build in short slices: a TimeoutError the build itself raises after several
    slices reaches the caller as the build's error (not taken for a slice's end), and a build that takes several
    slices gives its engine core."""
    import types

    import atom.engine.async_engine as ae

    def timing_out(config):
        time.sleep(0.35)
        raise TimeoutError("the device did not answer")

    monkeypatch.setattr(ae, "EngineCore", timing_out)
    with pytest.raises(TimeoutError, match="did not answer"):
        ae.AsyncEngine(None)
    monkeypatch.setattr(ae, "EngineCore", lambda config: time.sleep(0.35) or "core")
    engine = ae.AsyncEngine(types.SimpleNamespace(device="cpu"))
    assert engine.core == "core"
    engine._executor.shutdown(wait=True)


def test_forward_thread_runs_jobs_in_order_and_cancels_the_unstarted():
    from atom.engine.async_engine import ForwardThread

    thread = ForwardThread()
    order: list[int] = []
    first = thread.submit(lambda: (time.sleep(0.2), order.append(1)))
    second = thread.submit(order.append, 2)
    failing = thread.submit(lambda: 1 / 0)
    thread.shutdown(wait=True)
    assert order == [1, 2] and first.done() and second.done()
    assert isinstance(failing.exception(), ZeroDivisionError)
    with pytest.raises(RuntimeError, match="shut down"):
        thread.submit(order.append, 3)

    import threading

    thread, started = ForwardThread(), threading.Event()
    running = thread.submit(lambda: (started.set(), time.sleep(0.2)))
    queued = thread.submit(order.append, 4)
    assert started.wait(10)
    thread.shutdown(wait=True, cancel_futures=True)
    assert running.done() and not running.cancelled() and queued.cancelled() and order == [1, 2]


@pytest.mark.parametrize("to_thread", [False, True], ids=["to-process", "to-building-thread"])
def test_interrupt_during_a_long_model_build_exits_at_once(tmp_path, to_thread):
    """Ctrl-C while AsyncEngine builds its model (on the forward thread) ends the process at once, as it did
    when the build ran on the caller's thread: exit does not wait for the build. (Inside ``asyncio.run`` the
    first Ctrl-C only cancels the main task, which a synchronous build does not see, then or now.) The kernel
    may hand a process's SIGINT to any of its threads; ``to-building-thread`` sends it to the building one,
    where a main thread waiting on the build without a timeout never saw it until the build ended."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "slow_build.py"
    interrupt = "    signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n" if to_thread else ""
    script.write_text(
        "import signal, threading, time\n"
        # Ctrl-C's handler as in a terminal, whatever this test's runner was started with (a shell starts a
        # background job with SIGINT ignored, and an ignored SIGINT stays ignored in every process it starts)
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import atom.engine.async_engine as ae\n"
        "def slow_build(config):\n"
        "    print('building', flush=True)\n"
        f"{interrupt}"
        "    time.sleep(60)\n"
        "ae.EngineCore = slow_build\n"
        "ae.AsyncEngine(None)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "building"
        if not to_thread:
            proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        proc.wait(timeout=20)
        assert time.monotonic() - start < 10
        assert "KeyboardInterrupt" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_speculative_decoding_metrics(llama_ckpt):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with ServerThread(llama_ckpt, speculative_config=spec) as server:
        c = client(server)
        repetitive = [5, 6, 7, 8, 9, 10] * 4
        out = c.completions.create(model=server.model_name, prompt=repetitive, max_tokens=16, temperature=0,
                                   extra_body=NO_EOS)
        assert out.usage.completion_tokens == 16
        m = _metrics(server)
        assert m["atom_spec_decode_draft_tokens_total[]"] > 0
        assert 0 < m["atom_spec_decode_accepted_tokens_total[]"] <= m["atom_spec_decode_draft_tokens_total[]"]
        assert m["atom_spec_decode_acceptance_length_count[]"] == 1
        assert m["atom_spec_decode_acceptance_length_sum[]"] > 1
        server.wait_idle_and_free()
