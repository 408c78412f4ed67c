"""1P1D through the router vs colocated, on the same prompts in one run; and the KV transfer's GB/s
next to a raw Mooncake write of the same bytes.

Three `atom-engine serve` processes (producer, consumer, colocated) and the router (in this
process). For each prompt, streamed and greedy: time to first token (TTFT) and time per output
token after the first (TPOT), colocated and 1P1D; the two must produce the same tokens.

Transfer figures: the producer and the consumer run under a wrapper that times each
``MooncakeTransfer.write`` (one per request: every block of every layer, and the state slot) and,
where the bytes go through a host buffer (``--kv-buffer-device cpu``, the default on a GPU), each
gather into it and scatter out of it; each logs its bytes, seconds and (writes) run lengths. Then
this process replays the writes' run lengths as a raw ``batch_transfer_sync_write`` from its own
Mooncake engine into a separate target process, so both figures share the machine and the moment.

    python bench/pd.py [--model llama|kimi|PATH] [--prompt-lens 256,512,1024] [--output-len 32]
                       [--repeats 3] [--speculative-config JSON] [--device cpu|cuda]
                       [--kv-buffer-device auto|cpu|cache] [--batches 16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from tests.pd_cluster import MOONCAKE_ENV, RouterThread, ServeProcess, kv_config, stop_all  # noqa: E402

TRANSFER_TAG = "pd_transfer "
MAX_BATCH = 1024  # Mooncake refuses more than 2048 entries per batch to one peer


# -- the producer, with its writes timed ------------------------------------------------------------

def serve_timed(argv: list[str]) -> int:
    """`atom-engine serve ARGV` whose Mooncake writes, gathers and scatters each log one
    `pd_transfer {json}` line to stderr."""
    from atom import cli
    from atom.kv_transfer.mooncake import staging, transfer

    lock = threading.Lock()  # gathers and scatters log from several threads: one whole line at a time

    def log(kind: str, nbytes: int, start: float, **extra) -> None:
        line = {"kind": kind, "bytes": nbytes, "seconds": time.perf_counter() - start, **extra}
        with lock:
            sys.stderr.write(TRANSFER_TAG + json.dumps(line) + "\n")
            sys.stderr.flush()

    write = transfer.MooncakeTransfer.write
    gather, scatter = staging.BlockMover.gather, staging.BlockMover.scatter

    def timed_write(self, peer, entries, deadline):
        runs = [n for _, _, n in transfer.merge_runs(entries)]
        start = time.perf_counter()
        write(self, peer, entries, deadline)
        log("write", sum(runs), start, runs=runs)

    def timed_gather(self, block_ids, state_slot, host):
        start = time.perf_counter()
        gather(self, block_ids, state_slot, host)
        log("gather", host.numel(), start)

    def timed_scatter(self, host, block_ids, state_slot):
        start = time.perf_counter()
        scatter(self, host, block_ids, state_slot)
        log("scatter", host.numel(), start)

    transfer.MooncakeTransfer.write = timed_write
    staging.BlockMover.gather, staging.BlockMover.scatter = timed_gather, timed_scatter
    return cli.main(["serve", *argv])


def read_transfers(log_path: str, kind: str) -> list[dict]:
    with open(log_path) as f:
        lines = [json.loads(line[len(TRANSFER_TAG):]) for line in f if line.startswith(TRANSFER_TAG)]
    return [line for line in lines if line["kind"] == kind]


# -- a raw Mooncake write of the same bytes -------------------------------------------------------------

RAW_TARGET = """
import ctypes, sys
from mooncake.engine import TransferEngine
n = int(sys.argv[1])
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = ctypes.create_string_buffer(n)
assert engine.register_memory(ctypes.addressof(buf), n) == 0
print(f"127.0.0.1:{engine.get_rpc_port()} {ctypes.addressof(buf)}", flush=True)
sys.stdin.read()
"""


def write_runs(engine, peer: str, src: int, dst: int, runs: list[int]) -> None:
    """The runs back to back at both ends, in batches as the connector sends them."""
    offsets = [sum(runs[:i]) for i in range(len(runs))]
    for b in range(0, len(runs), MAX_BATCH):
        lens, offs = runs[b:b + MAX_BATCH], offsets[b:b + MAX_BATCH]
        rc = engine.batch_transfer_sync_write(peer, [src + o for o in offs], [dst + o for o in offs], lens)
        assert rc == 0, f"raw Mooncake write returned {rc}"


def raw_write_seconds(transfers: list[dict]) -> list[float]:
    """Replay each transfer's runs (same lengths, same batching) into a fresh target process."""
    from mooncake.engine import TransferEngine

    size = max(t["bytes"] for t in transfers)
    target = subprocess.Popen([sys.executable, "-c", RAW_TARGET, str(size)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, **MOONCAKE_ENV})
    try:
        peer, dst = target.stdout.readline().split()
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src_buf = ctypes.create_string_buffer(size)
        src = ctypes.addressof(src_buf)
        assert engine.register_memory(src, size) == 0
        write_runs(engine, peer, src, int(dst), transfers[0]["runs"])  # warm-up: the first write connects
        seconds = []
        for t in transfers:
            start = time.perf_counter()
            write_runs(engine, peer, src, int(dst), t["runs"])
            seconds.append(time.perf_counter() - start)
        engine.unregister_memory(src)
        return seconds
    finally:
        target.stdin.close()
        target.wait(10)


# -- the clients' view ----------------------------------------------------------------------------------

async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int,
                      arrivals: list[float] | None = None):
    """(TTFT s, TPOT s, token ids) of one streamed greedy completion; ``arrivals`` gets each chunk's time."""
    body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start, ids = time.perf_counter(), []
    arrivals = [] if arrivals is None else arrivals
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            new = chunk["choices"][0].get("token_ids") or [] if chunk["choices"] else []
            if new:
                arrivals.append(time.perf_counter())
                ids += new
    return arrivals[0] - start, (arrivals[-1] - arrivals[0]) / max(len(ids) - 1, 1), ids


async def measure(urls: dict[str, str], prompts: list[list[int]], output_len: int, repeats: int):
    """Per prompt and mode: median TTFT and TPOT over the repeats, modes interleaved."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in urls.values():  # warm-up: first-call costs stay out of the figures
            await one_request(session, url, prompts[0][:32], 4)
        rows = []
        for prompt in prompts:
            samples = {mode: [] for mode in urls}
            tokens = {}
            for _ in range(repeats):
                for mode, url in urls.items():
                    ttft, tpot, ids = await one_request(session, url, prompt, output_len)
                    samples[mode].append((ttft, tpot))
                    tokens.setdefault(mode, ids)
            same = tokens["1P1D"] == tokens["colocated"]
            for mode in urls:
                rows.append((len(prompt), mode, statistics.median(s[0] for s in samples[mode]),
                             statistics.median(s[1] for s in samples[mode]), same))
        return rows


async def measure_batches(urls: dict[str, str], prompt_len: int, output_len: int, repeats: int,
                          batches: list[int]):
    """Per batch size N and mode: N distinct prompts at once; the median TPOT over the requests, and the
    tokens after each request's first over the time from the first first token to the last token (median of
    the repeats, modes interleaved). In 1P1D the decode runs on the consumer."""
    timeout = aiohttp.ClientTimeout(total=600)
    rows = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for n in batches:
            prompts = [[(7 * i + 11 * k + 1) % 300 + 3 for i in range(prompt_len)] for k in range(n)]
            samples = {mode: [] for mode in urls}
            tokens = {}
            for _ in range(repeats):
                for mode, url in urls.items():
                    arrivals = [[] for _ in prompts]
                    results = await asyncio.gather(*(one_request(session, url, p, output_len, a)
                                                     for p, a in zip(prompts, arrivals)))
                    decoded = sum(len(ids) - 1 for _, _, ids in results)
                    window = max(a[-1] for a in arrivals) - min(a[0] for a in arrivals)
                    samples[mode].append((statistics.median(tpot for _, tpot, _ in results), decoded / window))
                    tokens.setdefault(mode, [ids for _, _, ids in results])
            same = tokens["1P1D"] == tokens["colocated"]
            for mode in urls:
                rows.append((n, mode, statistics.median(s[0] for s in samples[mode]),
                             statistics.median(s[1] for s in samples[mode]), same))
    return rows


# -- the run ------------------------------------------------------------------------------------------------

def bench_llama(path: str) -> str:
    """A random Llama big enough that a prompt's KV is megabytes: 8 layers, 4 KV heads of 64 -> 16 KiB/token."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from atom.tokenizer_builder import build_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    build_tokenizer(path, 320)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", help="llama (a random 8-layer Llama), kimi (the tests' random "
                        "Kimi-Linear) or a checkpoint folder")
    parser.add_argument("--prompt-lens", default="256,512,1024")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculative-config", help="passed to every server")
    parser.add_argument("--keep-logs", action="store_true", help="print where the server logs are")
    parser.add_argument("--device", default="cpu", help="passed to every server")
    parser.add_argument("--kv-buffer-device", default="auto", choices=["auto", "cpu", "cache"],
                        help="the connector's kv_buffer_device on both P/D sides")
    parser.add_argument("--batches", default="", help="also N requests at once for each N listed (e.g. 16,64), "
                        "of the first prompt length: decode TPOT and tokens/s, colocated and on the consumer")
    args = parser.parse_args()

    os.environ.update(MOONCAKE_ENV)  # this process's own Mooncake engine too (the raw write)
    work = tempfile.mkdtemp(prefix="atom-pd-bench-")
    if args.model == "llama":
        model = bench_llama(os.path.join(work, "llama"))
    elif args.model == "kimi":
        from tests import checkpoints

        model = checkpoints.make_kimi_checkpoint(os.path.join(work, "kimi"), "kda_mla")
    else:
        model = args.model
    lens = [int(n) for n in args.prompt_lens.split(",")]
    prompts = [[(7 * i + n) % 300 + 3 for i in range(n)] for n in lens]
    # No prefix caching: the repeats would otherwise skip their prefill.
    common = ["--model", model, "--dtype", "float32", "--served-model-name", "m", "--no-enable-prefix-caching",
              "--max-model-len", str(max(lens) + args.output_len + 8), "--device", args.device]
    if args.speculative_config:
        common += ["--speculative-config", args.speculative_config]

    timed = [sys.executable, os.path.abspath(__file__), "--serve-timed"]
    buffer = {"kv_buffer_device": args.kv_buffer_device}
    procs = {"producer": ServeProcess(common + ["--kv-transfer-config", kv_config("kv_producer", **buffer)],
                                      os.path.join(work, "producer.log"), command=timed),
             "consumer": ServeProcess(common + ["--kv-transfer-config", kv_config("kv_consumer", **buffer)],
                                      os.path.join(work, "consumer.log"), command=timed),
             "colocated": ServeProcess(common, os.path.join(work, "colocated.log"))}
    try:
        for proc in procs.values():
            proc.wait_listening(300)
        with RouterThread([procs["producer"].url], [procs["consumer"].url]) as router:
            urls = {"colocated": procs["colocated"].url, "1P1D": router.url}
            rows = asyncio.run(measure(urls, prompts, args.output_len, args.repeats))
            batches = [int(n) for n in args.batches.split(",") if n]
            batch_rows = asyncio.run(measure_batches(urls, lens[0], args.output_len, args.repeats, batches))
    finally:
        stop_all(list(procs.values()))

    print(f"model {args.model} on {args.device}, output {args.output_len} tokens, median of {args.repeats}, "
          f"spec {args.speculative_config or 'off'}, kv_buffer_device {args.kv_buffer_device}")
    print(f"{'prompt':>7} {'mode':>10} {'TTFT ms':>9} {'TPOT ms':>9}  same tokens")
    for n, mode, ttft, tpot, same in rows:
        print(f"{n:>7} {mode:>10} {ttft * 1e3:>9.1f} {tpot * 1e3:>9.2f}  {same}")
    if batch_rows:
        print(f"requests at once, prompts of {lens[0]} tokens:")
        print(f"{'batch':>7} {'mode':>10} {'TPOT ms':>9} {'tok/s':>9}  same tokens")
        for n, mode, tpot, rate, same in batch_rows:
            print(f"{n:>7} {mode:>10} {tpot * 1e3:>9.2f} {rate:>9.0f}  {same}")

    # [1:]: leave out the warm-up request's.
    for what, proc, kind in [("producer gathers", "producer", "gather"), ("consumer scatters", "consumer", "scatter")]:
        moves = read_transfers(procs[proc].log_path, kind)[1:]
        if moves:
            nbytes, seconds = sum(m["bytes"] for m in moves), sum(m["seconds"] for m in moves)
            print(f"host buffer: {what} {nbytes / 2**20:.1f} MiB in {len(moves)} calls, {seconds * 1e3:.1f} ms "
                  f"({nbytes / seconds / 1e9:.2f} GB/s)")
    transfers = read_transfers(procs["producer"].log_path, "write")[1:]
    if not transfers:
        print("no transfers were logged by the producer")
        return
    raw = raw_write_seconds(transfers)
    total = sum(t["bytes"] for t in transfers)
    pd_s, raw_s = sum(t["seconds"] for t in transfers), sum(raw)
    print(f"KV transfer (measured requests): {len(transfers)} transfers, {total / 2**20:.1f} MiB in "
          f"{sum(len(t['runs']) for t in transfers)} runs; ATOM producer writes {total / pd_s / 1e9:.2f} GB/s, "
          f"raw Mooncake write of the same runs {total / raw_s / 1e9:.2f} GB/s")
    largest = max(range(len(transfers)), key=lambda i: transfers[i]["bytes"])
    t = transfers[largest]
    print(f"  largest: {t['bytes'] / 2**20:.2f} MiB in {len(t['runs'])} runs: ATOM {t['seconds'] * 1e3:.1f} ms "
          f"({t['bytes'] / t['seconds'] / 1e9:.2f} GB/s), raw {raw[largest] * 1e3:.1f} ms "
          f"({t['bytes'] / raw[largest] / 1e9:.2f} GB/s)")
    if args.keep_logs:
        print(f"server logs in {work}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-timed":
        sys.exit(serve_timed(sys.argv[2:]))
    main()
