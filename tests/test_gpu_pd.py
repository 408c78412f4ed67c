"""P/D on a GPU: the caches live on the device, and the bytes go through each side's host buffer.

A producer and a consumer ``atom-engine serve --device cuda`` (fp32, the ``atom._C`` kernels on)
run as separate processes with a real Mooncake transfer engine over TCP on 127.0.0.1, behind the
router. For caches on a GPU the connector's default (``kv_buffer_device="auto"``) gathers a
request's prompt blocks and state slot with the gather kernel into pinned host memory, Mooncake
writes them into the consumer's host buffer, and the consumer scatters them into its blocks and
slot with the scatter kernel. Greedy tokens through the router must equal the CPU reference path's,
one request at a time and several at once; afterwards neither server holds a block, a slot or a
region of its host buffer. With Mooncake's CUDA build installed, the same runs with
``kv_buffer_device="cache"``: Mooncake reads and writes the GPU caches themselves.

A consumer through the host buffer decodes with deferred tokens, as a colocated engine does (its
steps return before their tokens reach the host; ``defers_tokens``); with ``"cache"`` it does not.
One run makes the consumer's blocks and state slots scarce, so loads land in blocks and slots that
requests still decoding on the graphs have just given up.

Skipped without CUDA, a built ``atom._C``, Mooncake or aiohttp.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import urllib.request

import pytest
import torch

from atom import SamplingParams
from atom.ops._C_loader import get_C, use_kernels
from tests import checkpoints

HAS_KERNELS = torch.cuda.is_available() and get_C() is not None and use_kernels()
HAS_PARTS = all(importlib.util.find_spec(name) is not None for name in ("mooncake", "aiohttp"))
pytestmark = [
    pytest.mark.skipif(not HAS_KERNELS, reason="needs a CUDA GPU and a built atom._C"),
    pytest.mark.skipif(not HAS_PARTS, reason="needs the Mooncake transfer engine and aiohttp"),
    pytest.mark.timeout(300),
]

# 37 tokens (a partial last block), 48 (whole blocks), a repetitive one; 16-token prefill chunks.
PROMPTS = [list(range(40, 77)), [(7 * i) % 300 + 3 for i in range(48)], [11, 12, 13, 14, 15, 16] * 7]
MAX_TOKENS = 12


def _complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["token_ids"]


def run_pd(tmp_path, device: str, kv_extra: dict, requests: list[tuple[list[int], int]] | None = None,
           consumer_args: tuple[str, ...] = ()) -> None:
    """Serve a random Kimi-Linear checkpoint as 1P1D on ``device``; check tokens and that all is freed.

    ``requests`` (prompt, max_tokens) all go at once; by default PROMPTS go one at a time, then at once."""
    from atom import LLM
    from atom.kv_transfer.base import KVTransferConfig
    from tests.pd_cluster import RouterThread, ServeProcess, kv_config, metrics, stop_all, wait_all_free

    through_host = KVTransferConfig("mooncake", "kv_consumer", **kv_extra).uses_host_buffer(device)
    path = checkpoints.make_kimi_checkpoint(str(tmp_path / "kimi"), "kda_mla")
    common = ["--model", path, "--dtype", "float32", "--device", device, "--served-model-name", "m",
              "--max-num-batched-tokens", "16"]
    roles = {"kv_producer": (), "kv_consumer": consumer_args}
    procs = [ServeProcess(common + [*extra, "--kv-transfer-config", kv_config(role, **kv_extra)],
                          str(tmp_path / f"{role}.log")) for role, extra in roles.items()]
    one_by_one = requests is None
    requests = requests or [(p, MAX_TOKENS) for p in PROMPTS]
    try:
        llm = LLM(path, dtype="float32")  # the CPU reference path, while the servers start
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        expected = [o.outputs[0].token_ids
                    for o in llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)]
        for proc in procs:
            proc.wait_listening(180)
        with RouterThread([procs[0].url], [procs[1].url]) as router:
            if one_by_one:
                assert [_complete(router.url, p, n) for p, n in requests] == expected
            with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
                together = list(pool.map(lambda r: _complete(router.url, *r), requests))
        assert together == expected
        for proc in procs:
            wait_all_free(proc.url)  # blocks, slots and host-buffer regions
            staged = metrics(proc.url).get("atom_kv_transfer_staged_bytes_total", 0)
            assert (staged > 0) == through_host, f"{staged} bytes went through the host buffer"
        deferred = metrics(procs[1].url)["atom_deferred_decode_steps_total"]
        assert (deferred > 0) == through_host, f"the consumer deferred {deferred} steps' tokens"
    except BaseException:
        for proc in procs:
            print(f"--- {proc.log_path}\n{proc.log_tail()}")
        raise
    finally:
        stop_all(procs)


@pytest.mark.parametrize("window", [None, 4096])
def test_gpu_block_mover_packs_and_unpacks_what_the_cpu_path_does(monkeypatch, window):
    """Gathers into pinned memory and scatters from it with the kernel, byte for byte as on the CPU:
    through the default device buffer in one window, and through a 4 KiB one in five windows that
    cut the parts (the device memory a transfer takes is bounded by the buffer)."""
    from atom.kv_transfer.mooncake import staging
    from atom.kv_transfer.mooncake.staging import BlockMover, HostBuffer, packed_bytes
    from atom.ops import cache_ops

    if window is not None:
        monkeypatch.setattr(staging, "STAGING_BYTES", window)
    launches = []
    inner = cache_ops.launch_runs
    monkeypatch.setattr(cache_ops, "launch_runs", lambda *a, **kw: (launches.append(kw["gather"]), inner(*a, **kw)))
    g = torch.Generator().manual_seed(0)
    cpu = [torch.randn(9, 16, 72, generator=g), torch.randn(9, 16, 36, generator=g).to(torch.bfloat16),
           torch.randn(5, 3, 7, generator=g).to(torch.bfloat16), torch.randn(5, 4, 8, 8, generator=g)]
    kinds = ["block", "block", "slot", "slot"]  # an odd-sized slot part: 6 bytes of padding (zeroed) follow it
    gpu = [t.cuda() for t in cpu]
    blocks, slot = [7, 2, 5], 3
    n = packed_bytes(kinds, BlockMover(cpu, kinds).unit_bytes, len(blocks))
    windows = 1 if window is None else -(-n // window)
    want = torch.full((n,), 0xAB, dtype=torch.uint8)
    host = HostBuffer(2 * n + 4096, pin=True)  # a region inside a pinned buffer, as the connector lends
    host.tensor.fill_(0xAB)
    host.take(n)  # a first region, so ours starts inside the buffer
    got = host.region(host.take(n), n)
    BlockMover(cpu, kinds).gather(blocks, slot, want)
    torch.cuda.synchronize()
    made = torch.cuda.memory_allocated()
    mover = BlockMover(gpu, kinds)
    assert torch.cuda.memory_allocated() - made >= staging.STAGING_BYTES  # the device buffer, made with the mover
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mover.gather(blocks, slot, got)
    if window is not None:  # the run list, not the transfer
        assert torch.cuda.max_memory_allocated() - before < n // 2
    assert torch.equal(got, want) and not want[17322:17328].any()
    assert launches == [True] * windows  # one copy_runs launch a window for the four tensors
    # Back into other blocks and another slot of poisoned caches.
    fresh_cpu = [torch.full_like(t, float("nan")) for t in cpu]
    fresh_gpu = [t.cuda() for t in fresh_cpu]
    BlockMover(fresh_cpu, kinds).scatter(want, [0, 8, 4], 1)
    BlockMover(fresh_gpu, kinds).scatter(got, [0, 8, 4], 1)
    assert launches == [True] * windows + [False] * windows
    for a, b in zip(fresh_gpu, fresh_cpu):
        assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


def test_gpu_block_mover_that_does_not_fit_fails_when_made_naming_the_fix(monkeypatch):
    from atom.kv_transfer.mooncake import staging

    monkeypatch.setattr(staging, "STAGING_BYTES", 1 << 50)  # a PiB: more than any GPU has
    with pytest.raises(ValueError, match="lower --kv-cache-memory by that much"):
        staging.BlockMover([torch.zeros(4, 16, 8, device="cuda")], ["block"])


def test_gpu_caches_registered_directly_need_mooncakes_cuda_build():
    from atom.kv_transfer.base import KVTransferConfig
    from atom.kv_transfer.factory import make_connector
    from atom.kv_transfer.mooncake.transfer import installed_without_cuda

    if not installed_without_cuda():
        pytest.skip("Mooncake's CUDA build is installed: registering GPU caches is allowed")
    caches, kinds = {0: (torch.zeros(4, 8, device="cuda"),)}, {0: "block"}
    with pytest.raises(ValueError, match="reads host memory only; use kv_buffer_device 'cpu'"):
        make_connector(KVTransferConfig("mooncake", "kv_consumer", kv_buffer_device="cache"), block_size=4,
                       caches=caches, cache_kinds=kinds)
    make_connector(KVTransferConfig("mooncake", "kv_consumer"), block_size=4, caches=caches, cache_kinds=kinds)


def test_gpu_pd_through_host_buffers_matches_cpu_reference(tmp_path):
    run_pd(tmp_path, "cuda", {})  # kv_buffer_device "auto": the host buffer, for caches on a GPU


def test_gpu_pd_consumer_with_scarce_blocks_and_slots_matches_cpu_reference(tmp_path):
    """Ten requests at once of 20 to 65 prompt tokens and 3 to 21 new ones, on a consumer with 4 state
    slots and 24 blocks of 16 tokens (4 requests of the longest): requests end at different steps
    while others decode on the graphs with their tokens deferred, and the next loads scatter into
    the blocks and slots just given up (slots are reused newest first, blocks oldest first)."""
    requests = [([(13 * i + 5 * k) % 290 + 5 for i in range(20 + 5 * k)], 3 + (7 * k) % 19) for k in range(10)]
    run_pd(tmp_path, "cuda", {}, requests, ("--max-num-seqs", "4", "--num-gpu-blocks-override", "24",
                                                        "--max-model-len", "96"))


def test_gpu_pd_with_the_caches_registered_directly_matches_cpu_reference(tmp_path):
    """kv_buffer_device "cache": Mooncake's CUDA build registers the GPU caches themselves and reads and
    writes the blocks and slots there (its TCP transport copies them through host memory itself)."""
    from atom.kv_transfer.mooncake.transfer import installed_without_cuda

    if installed_without_cuda():
        pytest.skip("needs Mooncake's CUDA build (mooncake-transfer-engine): this one reads host memory only")
    run_pd(tmp_path, "cuda", {"kv_buffer_device": "cache"})
