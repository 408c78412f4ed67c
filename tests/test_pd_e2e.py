"""1P1D end to end: a producer and a consumer `atom-engine serve` in separate processes, moving KV and
recurrent state over a real Mooncake transfer engine (TCP on 127.0.0.1), behind the router.

Greedy output through the router (streamed, via the openai client) must equal a colocated server's
token for token, and so must seeded sampling (the consumer's draws go on from the producer's), for a Kimi-Linear checkpoint (KDA + MLA: blocks and a state slot move) and a Llama
one (blocks only), with prompts several prefill chunks long, with and without n-gram speculation
(the producer's draft tokens move too). Afterwards both servers hold no blocks and no slots.

Every server of the module starts at once (their start-ups overlap), and each test reuses them.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from tests.openai_server import ServerThread
from tests.pd_cluster import RouterThread, ServeProcess, kv_config, metrics, stop_all, wait_all_free

pytest.importorskip("mooncake.engine", reason="needs the Mooncake transfer engine (pip install '.[mooncake]')")
pytestmark = pytest.mark.timeout(300)

CHUNK = 16  # --max-num-batched-tokens: every prompt below takes several prefill steps
SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'
CONFIGS = {  # name -> (checkpoint fixture, speculative config or None)
    "kimi": ("kimi_ckpt", None),
    "kimi-ngram": ("kimi_ckpt", SPEC),
    "llama": ("llama_ckpt", None),
    "llama-ngram": ("llama_ckpt", SPEC),
    "kimi-overlap": ("kimi_ckpt", None),  # producer and consumer with deferred output (async scheduling)
    "kimi-host-buffer": ("kimi_ckpt", None),  # both sides move the bytes through a host buffer (staging.py)
}
OVERLAP = {"kimi-overlap"}
HOST_BUFFER = {"kimi-host-buffer": {"kv_buffer_device": "cpu", "kv_buffer_size": 1 << 20}}
# 37 tokens (a partial last block), 48 (whole blocks), and a repetitive one n-gram drafting latches onto.
PROMPTS = [list(range(40, 77)), [(7 * i) % 300 + 3 for i in range(48)], [11, 12, 13, 14, 15, 16] * 7]
MAX_TOKENS = 12


class Cluster:
    def __init__(self, producer: ServeProcess, consumer: ServeProcess, colocated: ServerThread) -> None:
        self.producer, self.consumer, self.colocated = producer, consumer, colocated
        self.router: RouterThread | None = None


@pytest.fixture(scope="module")
def clusters(request, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_logs")
    started: dict[str, Cluster] = {}
    procs: list[ServeProcess] = []
    try:
        for name, (ckpt_fixture, spec) in CONFIGS.items():
            common = ["--model", request.getfixturevalue(ckpt_fixture), "--dtype", "float32",
                      "--served-model-name", "m", "--max-num-batched-tokens", str(CHUNK)]
            if spec:
                common += ["--speculative-config", spec]
            if name in OVERLAP:
                common += ["--async-scheduling"]
            extra = HOST_BUFFER.get(name, {})
            producer = ServeProcess(common + ["--kv-transfer-config", kv_config("kv_producer", **extra)],
                                    str(logs / f"{name}-producer.log"))
            consumer = ServeProcess(common + ["--kv-transfer-config", kv_config("kv_consumer", **extra)],
                                    str(logs / f"{name}-consumer.log"))
            procs += [producer, consumer]
            started[name] = Cluster(producer, consumer, None)
        # While the subprocesses start, build the colocated references in this process.
        for name, (ckpt_fixture, spec) in CONFIGS.items():
            kw = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}} if spec else {}
            started[name].colocated = ServerThread(request.getfixturevalue(ckpt_fixture), served_model_name="m",
                                                   max_num_batched_tokens=CHUNK, **kw).__enter__()
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.wait_listening(180), procs))
        for cluster in started.values():
            cluster.router = RouterThread([cluster.producer.url], [cluster.consumer.url]).__enter__()
        yield started
    finally:
        for cluster in started.values():
            if cluster.router is not None:
                cluster.router.__exit__(None, None, None)
            if cluster.colocated is not None:
                cluster.colocated.__exit__(None, None, None)
        stop_all(procs)


def _stream_token_ids(url: str, prompt: list[int], seed: int | None = None) -> tuple[list[int], str]:
    """Greedy, or with a seed temperature 1."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ids, reason = [], None
    for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                           temperature=0 if seed is None else 1.0,
                                           **({} if seed is None else {"seed": seed}),
                                           extra_body={"return_token_ids": True, "ignore_eos": True}):
        if chunk.choices:
            ids += chunk.choices[0].token_ids or []
            reason = chunk.choices[0].finish_reason or reason
    return ids, reason


@pytest.mark.parametrize("name", list(CONFIGS))
def test_1p1d_through_the_router_equals_colocated(clusters, name):
    cluster = clusters[name]
    try:
        for prompt in PROMPTS:
            expected = _stream_token_ids(cluster.colocated.url, prompt)
            assert expected == (expected[0], "length") and len(expected[0]) == MAX_TOKENS
            assert _stream_token_ids(cluster.router.url, prompt) == expected, f"prompt of {len(prompt)} tokens"
        # Several at once: the producer holds several requests' blocks while the consumer pulls them.
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: _stream_token_ids(cluster.router.url, p), PROMPTS))
        assert together == [_stream_token_ids(cluster.colocated.url, p) for p in PROMPTS]
        # Seeded sampling: the consumer's first draw is the colocated server's second (the producer drew the first)
        for seed, prompt in enumerate(PROMPTS[:2]):
            expected = _stream_token_ids(cluster.colocated.url, prompt, seed)
            assert _stream_token_ids(cluster.router.url, prompt, seed) == expected, f"seed {seed}"
            assert len(set(expected[0])) > 3  # sampled, not collapsed to one token
        for server in (cluster.producer, cluster.consumer):
            wait_all_free(server.url)
        for server in (cluster.producer, cluster.consumer):  # the host buffer carried the bytes, or was never made
            assert (metrics(server.url).get("atom_kv_transfer_staged_bytes_total", 0) > 0) == (name in HOST_BUFFER)
        if CONFIGS[name][1]:  # the consumer decoded with speculation, starting from the producer's drafts
            assert metrics(cluster.consumer.url)["atom_spec_decode_draft_tokens_total"] > 0
        cluster.colocated.wait_idle_and_free()
    except BaseException:
        for server in (cluster.producer, cluster.consumer):
            print(f"--- {server.log_path}\n{server.log_tail()}")
        raise
