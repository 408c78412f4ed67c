"""P/D faults, each ending in bounded time with everything freed on both sides.

Real servers in separate processes over the real Mooncake transfer engine:
a producer with a short lease, a consumer that fails a lost load, and one
that recomputes it. (Side-channel garbage, a producer killed mid-transfer and
out-of-region writes are covered at the connector level in
test_mooncake_connector.py, also between processes.)
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from atom import LLM, SamplingParams
from tests import checkpoints
from tests.pd_cluster import ServeProcess, kv_config, metrics, stop_all, wait_all_free

pytest.importorskip("mooncake.engine", reason="needs the Mooncake transfer engine (pip install '.[mooncake]')")
pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(40, 77))
LEASE = 2.0


def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _prefill(producer_url: str) -> dict:
    status, body = _post(producer_url, {"model": "m", "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    params = body["kv_transfer_params"]
    assert params["num_tokens"] == len(PROMPT) and params["block_ids"]
    return params


def _decode_body(params: dict, stream: bool = False) -> dict:
    return {"model": "m", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": stream,
            "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": params}


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers(kimi_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_fault_logs")
    common = ["--model", kimi_ckpt, "--dtype", "float32", "--served-model-name", "m",
              "--max-num-batched-tokens", "16"]
    procs = {
        "producer": ServeProcess(common + ["--kv-transfer-config", kv_config("kv_producer", lease_seconds=LEASE)],
                                 str(logs / "producer.log")),
        "consumer": ServeProcess(common + ["--kv-transfer-config", kv_config("kv_consumer", transfer_timeout=3.0)],
                                 str(logs / "consumer.log")),
        "recompute": ServeProcess(common + ["--kv-transfer-config", kv_config(
            "kv_consumer", transfer_timeout=3.0, kv_load_failure_policy="recompute")], str(logs / "recompute.log")),
    }
    try:
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.wait_listening(180), procs.values()))
        yield {name: p.url for name, p in procs.items()}
    finally:
        stop_all(list(procs.values()))


@pytest.fixture(scope="module")
def colocated_tokens(kimi_ckpt) -> list[int]:
    llm = LLM(kimi_ckpt, dtype="float32")
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_consumer_never_pulls_producer_frees_on_lease(servers):
    _prefill(servers["producer"])
    assert metrics(servers["producer"])["atom_kv_block_usage"] > 0  # held for a consumer
    assert metrics(servers["producer"])["atom_state_slot_usage"] > 0
    start = time.monotonic()
    wait_all_free(servers["producer"], timeout=LEASE + 10)
    assert time.monotonic() - start >= LEASE / 2  # freed by the lease, not at once


def test_producer_gone_before_pull_fails_clearly(servers):
    params = dict(_prefill(servers["producer"]), remote_port=_dead_port())
    start = time.monotonic()
    status, body = _post(servers["consumer"], _decode_body(params))
    assert time.monotonic() - start < 15
    assert status == 502 and "remote KV load failed" in body["error"]["message"]
    wait_all_free(servers["consumer"])
    wait_all_free(servers["producer"], timeout=LEASE + 10)
    # the consumer still serves a good handoff afterwards
    status, body = _post(servers["consumer"], _decode_body(_prefill(servers["producer"])))
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 10
    wait_all_free(servers["consumer"])
    wait_all_free(servers["producer"])


def test_producer_gone_with_recompute_policy_computes_locally(servers, colocated_tokens):
    params = dict(_prefill(servers["producer"]), remote_port=_dead_port())
    status, body = _post(servers["recompute"], _decode_body(params))
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == colocated_tokens
    wait_all_free(servers["recompute"])
    wait_all_free(servers["producer"], timeout=LEASE + 10)


def test_client_abort_during_transfer_frees_both_sides(servers):
    for _ in range(3):
        params = _prefill(servers["producer"])
        body = json.dumps(_decode_body(params, stream=True)).encode()
        host, port = servers["consumer"].removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:  # send, then hang up at once
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_all_free(servers["consumer"], timeout=20)
    wait_all_free(servers["producer"], timeout=LEASE + 10)
    aborted = metrics(servers["consumer"])
    assert aborted["atom_num_requests_running"] == 0


def test_bad_handoff_params_are_rejected(servers):
    for bad in ({"transfer_id": 5}, {"do_remote_decode": "yes"}, "not an object"):
        status, body = _post(servers["consumer"], _decode_body(bad))
        assert status == 400 and body["error"]["param"] == "kv_transfer_params", body
    wait_all_free(servers["consumer"])


def test_handoff_token_ids_outside_the_vocabulary_are_rejected_and_the_consumer_serves_on(servers, colocated_tokens):
    """A first token or draft past the vocabulary is the client's mistake: 400, before it reaches a forward (where
    it once failed the step, and so every request of the consumer). Drafts from a producer that speculates are
    not verified by a consumer that does not (its state slots hold no per-draft states): its tokens are plain
    decoding's."""
    consumer = servers["consumer"]
    for bad in ({"first_token": checkpoints.VOCAB}, {"draft_token_ids": [3, checkpoints.VOCAB + 7]}):
        params = {**_prefill(servers["producer"]), **bad}
        status, body = _post(consumer, _decode_body(params))
        assert status == 400 and body["error"]["param"] == "kv_transfer_params", body
        assert f"[0, {checkpoints.VOCAB})" in body["error"]["message"]
        wait_all_free(servers["producer"], timeout=LEASE + 10)  # the hold nobody pulled ends with its lease
    params = dict(_prefill(servers["producer"]), draft_token_ids=colocated_tokens[1:3])  # both right
    status, body = _post(consumer, _decode_body(params))
    assert status == 200 and body["choices"][0]["token_ids"] == colocated_tokens, body
    assert metrics(consumer).get("atom_spec_decode_draft_tokens_total", 0) == 0  # none verified
    wait_all_free(consumer)
    wait_all_free(servers["producer"])


@pytest.mark.parametrize("max_tokens", [4, None])
def test_a_handoff_past_the_first_token_is_refused_and_the_producer_serves_on(servers, max_tokens):
    """The producer hands a request off at its prompt's end: one that would decode on (and move its
    recurrent state past the prompt) is a client's mistake, refused before it runs. It once ran, then
    failed the producer's hand-off check and stopped that engine for every request."""
    producer = servers["producer"]
    status, body = _post(producer, {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                    "ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 400 and body["error"]["param"] == "kv_transfer_params", body
    assert f"set max_tokens to 1 (got {max_tokens})" in body["error"]["message"]
    status, body = _post(producer, {"model": "m", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                    "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    assert _prefill(producer)["num_tokens"] == len(PROMPT)  # hand-offs still work
    wait_all_free(producer, timeout=LEASE + 10)  # the hold nobody pulls ends with its lease
