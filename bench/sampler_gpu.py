"""The sampler on one GPU: the fused sampling kernel against the torch reference, side by side.

    python bench/sampler_gpu.py                           # batch 1, 16, 64; vocab 32000 and 163840
    python bench/sampler_gpu.py --batches 1,64 --vocabs 32000 --calls 200
    python bench/sampler_gpu.py --decode --batches 1,16,64   # the engine's decode, kernel vs torch sampler
    python bench/sampler_gpu.py --seeded                  # seeded rows' draws: keyed (one launch) vs a generator a row
    python bench/sampler_gpu.py --decode --seeded         # the engine's decode with seeded requests, the same two

For each sampling setting, a step's sampling work as the model runner does it
(``SamplingBatch.from_params`` then ``Sampler()``, fp32 logits already on the
GPU) runs ``--calls`` times back to back with the kernel, then with
``ATOM_FORCE_REFERENCE=1`` (the torch ops). Printed per call: host
microseconds (until the call returns: what a chained decode step pays on the
CPU) and wall microseconds (the calls' total with the GPU finished), and the
reference over the kernel for each. "GPU" is the kernel alone (``sample_tokens``
on fixed draws), event-timed over the same number of launches.

``--decode`` instead runs bench/decode_gpu.py's model through the engine (one
``LLM`` per batch size, the GPU default: overlap on) and times decode with
the fused kernel and with the torch sampler in place of it, alternating over
``--rounds`` rounds in the same process, for temperature 0.8 with and without
top-p 0.95.

``--seeded`` compares seeded requests' draws: keyed draws, every seeded row in
one launch (``sampler.exponential_draws``, what the sampler does), against the
baseline of a ``torch.Generator`` per request and one ``exponential_`` a row
(``generator_draws``, how the sampler drew them before). Alone it times the
draws of a step (host and wall microseconds per call); with ``--decode`` the
engine decodes requests that each have a seed, with the one and with the other
in the sampler, alternating in the same process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from atom.ops._C_loader import get_C  # noqa: E402
from atom.ops.cuda import sample_tokens  # noqa: E402
from atom.sampling_params import SamplingParams  # noqa: E402
from atom.worker.sampler import Sampler, SamplingBatch, SeedStream, exponential_draws  # noqa: E402

SETTINGS = {
    "temperature 0.8": dict(temperature=0.8),
    "+ top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "+ top-k 50, top-p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
    "+ min-p 0.05": dict(temperature=0.8, min_p=0.05),
}


def time_calls(logits: torch.Tensor, params: list[SamplingParams], calls: int) -> tuple[float, float]:
    """(host us, wall us) per sampling call."""
    sampler, rows = Sampler(), len(params)

    def one() -> torch.Tensor:
        batch = SamplingBatch.from_params(params, [None] * rows, [[]] * rows, [[]] * rows, device=logits.device)
        return sampler(logits, batch).sampled_token_ids

    for _ in range(10):
        one()
    torch.cuda.synchronize()
    host = 0.0
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        one()
        host += time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / calls * 1e6, wall / calls * 1e6


def kernel_us(logits: torch.Tensor, params: list[SamplingParams], calls: int) -> float:
    """GPU microseconds per sample_tokens launch (event-timed, back to back)."""
    rows = len(params)
    batch = SamplingBatch.from_params(params, [None] * rows, [[]] * rows, [[]] * rows, device=logits.device)
    draws = exponential_draws(logits.shape, logits.device, [None] * rows)
    args = (logits, draws, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    for _ in range(5):
        sample_tokens(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        sample_tokens(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


_GENERATORS: dict[int, torch.Generator] = {}  # the baseline's: seed -> its generator


def generator_draws(shape, device, streams, firsts=None) -> torch.Tensor:
    """The baseline for seeded rows: ``exponential_draws`` as the sampler did it before keyed draws, each seeded
    request with a ``torch.Generator`` of its own and one ``exponential_`` launch over its rows."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    if any(stream is None for stream in streams):
        q.exponential_()
    for i, stream in enumerate(streams):
        if stream is not None:
            generator = _GENERATORS.get(stream.seed)
            if generator is None:
                generator = _GENERATORS[stream.seed] = torch.Generator(device).manual_seed(stream.seed)
            stream.draws += 1
            first, end = (i, i + 1) if firsts is None else (firsts[i], firsts[i + 1])
            q[first:end].exponential_(generator=generator)
    return q


def seeded_draws(batches: list[int], vocabs: list[int], calls: int) -> None:
    """Host and wall microseconds per step's draws, every row seeded: keyed against a generator a row."""
    print(f"{'draws, every row seeded':<24} {'batch':>5} {'vocab':>6} | {'keyed host':>10} {'wall':>7} | "
          f"{'per-row host':>12} {'wall':>7} | {'host x':>6} {'wall x':>6}")  # fmt: skip
    for vocab in vocabs:
        for batch in batches:
            got = {}
            for name, draw in (("keyed", exponential_draws), ("per-row", generator_draws)):
                streams = [SeedStream(1000 + j) for j in range(batch)]
                for _ in range(10):
                    draw((batch, vocab), "cuda", streams)
                torch.cuda.synchronize()
                host, start = 0.0, time.perf_counter()
                for _ in range(calls):
                    t0 = time.perf_counter()
                    draw((batch, vocab), "cuda", streams)
                    host += time.perf_counter() - t0
                torch.cuda.synchronize()
                got[name] = (host / calls * 1e6, (time.perf_counter() - start) / calls * 1e6)
            (k_host, k_wall), (b_host, b_wall) = got["keyed"], got["per-row"]
            print(f"{'':<24} {batch:>5} {vocab:>6} | {k_host:>10.1f} {k_wall:>7.1f} | {b_host:>12.1f} "
                  f"{b_wall:>7.1f} | {b_host / k_host:>6.2f} {b_wall / k_wall:>6.2f}")  # fmt: skip


def decode_ab(batches: list[int], rounds: int, seeded: bool, new_tokens: int = 128, input_len: int = 64) -> None:
    """Decode tok/s through the engine with two samplers alternating: the fused kernel and the torch reference,
    or (``seeded``) keyed draws and a generator a row."""
    import atom.worker.sampler as sampler_module
    from atom import LLM
    from atom.ops.sampling import sample_ref
    from bench.decode_gpu import make_model, timed

    path = "/tmp/atom_kimi_1p3b"
    make_model(path)
    torch.cuda.empty_cache()
    if seeded:
        attr, arms = "exponential_draws", {"keyed": sampler_module.exponential_draws, "per-row": generator_draws}
    else:
        attr, arms = "sample_tokens", {"kernel": sampler_module.sample_tokens, "torch": sample_ref}
    new, base = arms
    gen = torch.Generator().manual_seed(0)
    print(f"{'setting':<18} {'batch':>5} {'round':>5} | {new + ' tok/s':>12} {base + ' tok/s':>13} | {'x':>5}")
    for batch in batches:
        prompts = [{"prompt_token_ids": p} for p in torch.randint(3, 32000, (batch, input_len), generator=gen).tolist()]
        llm = LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=batch, max_model_len=input_len + new_tokens + 8,
                  max_num_batched_tokens=max(2048, batch * input_len), enable_prefix_caching=False)  # fmt: skip
        for name, setting in (("temperature 0.8", {}), ("+ top-p 0.95", {"top_p": 0.95})):

            def tps(n_new: int) -> float:
                def run(n):
                    params = [SamplingParams(temperature=0.8, ignore_eos=True, max_tokens=n,
                                             seed=1000 + j if seeded else None, **setting) for j in range(batch)]
                    llm.generate(prompts, params, use_tqdm=False)

                run(1 + n_new)
                t1 = sorted(timed(lambda: run(1)) for _ in range(3))[1]
                tn = sorted(timed(lambda: run(1 + n_new)) for _ in range(3))[1]
                return batch * n_new / (tn - t1)

            for r in range(rounds):
                got = {}
                for which in ((new, base) if r % 2 == 0 else (base, new)):
                    setattr(sampler_module, attr, arms[which])
                    got[which] = tps(new_tokens)
                setattr(sampler_module, attr, arms[new])
                print(f"{name:<18} {batch:>5} {r + 1:>5} | {got[new]:>12.0f} {got[base]:>13.0f} | "
                      f"{got[new] / got[base]:>5.2f}", flush=True)  # fmt: skip
        llm = None  # the engine goes (not del: run() reads the name)
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--vocabs", default="32000,163840")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--decode", action="store_true", help="the engine's decode tok/s, kernel against torch sampler")
    p.add_argument("--rounds", type=int, default=3, help="with --decode: alternating rounds per setting")
    p.add_argument("--seeded", action="store_true", help="seeded rows: keyed draws against a generator a row")
    args = p.parse_args()
    if not torch.cuda.is_available() or get_C() is None or not hasattr(get_C(), "sample_tokens"):
        sys.exit("bench/sampler_gpu.py needs a CUDA GPU and atom._C built with sample_tokens "
                 "(python setup.py build_ext --inplace)")  # fmt: skip
    print(f"device: {torch.cuda.get_device_name()}")
    batches, vocabs = [int(b) for b in args.batches.split(",")], [int(v) for v in args.vocabs.split(",")]
    if args.decode:
        decode_ab(batches, args.rounds, args.seeded)
        return
    if args.seeded:
        seeded_draws(batches, vocabs, args.calls)
        return
    print(f"{'setting':<24} {'batch':>5} {'vocab':>6} | {'kernel host':>11} {'wall':>7} | {'torch host':>10} "
          f"{'wall':>7} | {'host x':>6} {'wall x':>6} | {'GPU':>6}")  # fmt: skip
    for vocab in vocabs:
        for batch in batches:
            logits = (torch.randn(batch, vocab, device="cuda") * 4).bfloat16().float()
            for name, setting in SETTINGS.items():
                params = [SamplingParams(**setting)] * batch
                os.environ.pop("ATOM_FORCE_REFERENCE", None)
                k_host, k_wall = time_calls(logits, params, args.calls)
                os.environ["ATOM_FORCE_REFERENCE"] = "1"
                r_host, r_wall = time_calls(logits, params, args.calls)
                os.environ.pop("ATOM_FORCE_REFERENCE")
                print(f"{name:<24} {batch:>5} {vocab:>6} | {k_host:>11.1f} {k_wall:>7.1f} | {r_host:>10.1f} "
                      f"{r_wall:>7.1f} | {r_host / k_host:>6.2f} {r_wall / k_wall:>6.2f} | "
                      f"{kernel_us(logits, params, args.calls):>6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
