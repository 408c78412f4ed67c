"""Offline throughput: ATOM's LLM.generate vs transformers' batched generate, plus scheduler cost.

One run, one checkpoint (the bundled default Kimi-Linear model unless
--model is given), the same random prompts for both engines, greedy and
with EOS ignored so every request produces exactly --output-len tokens:

    python bench/offline_throughput.py                      # 64 x (128 in, 64 out), fp32
    python bench/offline_throughput.py --num-requests 8 --input-len 32 --output-len 16

The AsyncEngine row runs the same prompts through the server's engine (its
forwards on a worker thread, all requests streamed at once); its ratio to
LLM.generate shows what serving costs over offline runs. It runs in a process
of its own, as the server does: once two threads of a process have run
torch's OpenMP regions, every small CPU op waits on a thread wake-up.

The scheduler row times ``Scheduler.schedule()`` + ``Scheduler.update()``
alone, with --sched-requests decoding requests and a runner that answers a
fixed token instead of running a model: the CPU cost the engine adds to
every step, whatever the model.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from atom import LLM, SamplingParams  # noqa: E402
from atom.config import EngineConfig  # noqa: E402
from atom.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from atom.engine.request import Request  # noqa: E402
from atom.engine.scheduler import Scheduler  # noqa: E402
from atom.engine.scheduler_output import RunnerOutput  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: the bundled default Kimi-Linear model)")
    p.add_argument("--num-requests", type=int, default=64, help="prompts per run (default: 64)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (default: 64)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="ATOM's running-request cap (default: --num-requests)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--sched-requests", type=int, default=256, help="decoding requests in the scheduler bench")
    p.add_argument("--sched-steps", type=int, default=200, help="timed scheduler steps (default: 200)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()  # ids 0-2 are pad/bos/eos


def bench_atom(model: str, prompts: list[list[int]], output_len: int, max_num_seqs: int):
    """Seconds for one LLM.generate call over all prompts, and the generated ids."""
    max_len = len(prompts[0]) + output_len + 1
    llm = LLM(model, dtype="float32", max_num_seqs=max_num_seqs, max_model_len=max_len,
              max_num_batched_tokens=max(2048, max_len))
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return elapsed, [o.outputs[0].token_ids for o in outs]


def bench_async_engine(model: str, prompts: list[list[int]], output_len: int, max_num_seqs: int,
                       threads: int | None):
    """Seconds for the same prompts streamed at once through AsyncEngine, and the generated ids."""
    import asyncio

    from atom import AsyncEngine

    if threads:
        torch.set_num_threads(threads)

    max_len = len(prompts[0]) + output_len + 1
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)

    async def run():
        async with AsyncEngine.from_config(model=model, dtype="float32", max_num_seqs=max_num_seqs,
                                           max_model_len=max_len, max_num_batched_tokens=max(2048, max_len)) as engine:

            async def one(request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
                async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
                    pass
                return out.outputs[0].token_ids

            await one("warm-up", prompts[0][:8], SamplingParams(temperature=0, max_tokens=2))
            start = time.perf_counter()
            ids = await asyncio.gather(*(one(f"r{i}", p, params) for i, p in enumerate(prompts)))
            return time.perf_counter() - start, ids

    elapsed, ids = asyncio.run(run())
    assert all(len(i) == output_len for i in ids)
    return elapsed, ids


def bench_hf(model: str, prompts: list[list[int]], output_len: int):
    """Seconds for one batched greedy generate over all prompts, and the generated ids."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run every request to output_len, like ignore_eos
    pad = 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        hf.generate(ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, **kwargs)  # warm-up
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == width + output_len
    return elapsed, out[:, width:].tolist()


def bench_scheduler(model: str, num_requests: int, steps: int, prefix_caching: bool,
                    prompt_len: int = 16) -> tuple[float, float]:  # fmt: skip
    """Microseconds per step for schedule() and update() with num_requests decoding requests."""
    block_size, warmup = 16, 4
    max_len = prompt_len + warmup + steps + 2
    config = EngineConfig(model=model, max_num_seqs=num_requests, max_model_len=max_len,
                          max_num_batched_tokens=num_requests * prompt_len, block_size=block_size)
    blocks_per_request = -(-max_len // block_size)
    kv = KVCacheManager(num_blocks=num_requests * blocks_per_request, block_size=block_size,
                        num_state_groups=num_requests, slots_per_group=1, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(config, kv)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_len - prompt_len)
    for i in range(num_requests):
        prompt = [3 + (i * 7 + j) % 500 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, (2,)))

    t_schedule = t_update = 0.0
    for step in range(warmup + steps):  # the first step prefills every prompt; then all decode
        t0 = time.perf_counter()
        sched = scheduler.schedule()
        t1 = time.perf_counter()
        result = RunnerOutput(sampled={s.request_id: [7] for s in sched.scheduled if s.sample})
        t2 = time.perf_counter()
        scheduler.update(sched, result)
        t3 = time.perf_counter()
        if step >= warmup:
            assert len(sched.scheduled) == num_requests and sched.num_scheduled_tokens == num_requests
            t_schedule += t1 - t0
            t_update += t3 - t2
    return t_schedule / steps * 1e6, t_update / steps * 1e6


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from atom.default_model import default_model_path

        args.model = default_model_path()
    vocab = EngineConfig(model=args.model).hf_config["vocab_size"]
    prompts = make_prompts(vocab, args.num_requests, args.input_len, args.seed)
    n, out_len = args.num_requests, args.output_len
    print(f"model {args.model}\n{n} requests x ({args.input_len} in, {out_len} out), greedy, fp32, CPU, "
          f"{torch.get_num_threads()} torch threads\n")

    atom_s, atom_ids = bench_atom(args.model, prompts, out_len, args.max_num_seqs or n)
    rows = [("ATOM LLM.generate", atom_s)]
    # in a process of its own, as `atom-engine serve` runs it: this process's threads have run torch ops
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        async_s, async_ids = pool.apply(bench_async_engine, (args.model, prompts, out_len, args.max_num_seqs or n,
                                                            args.threads))
    same_async = sum(a == b for a, b in zip(atom_ids, async_ids))
    if not args.skip_hf:
        hf_s, hf_ids = bench_hf(args.model, prompts, out_len)
        rows.append(("transformers generate (batched)", hf_s))
    print(f"{'engine':<34}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}")
    for name, seconds in rows:
        total = n * (args.input_len + out_len)
        print(f"{name:<34}{seconds:>10.2f}{n * out_len / seconds:>12.1f}{total / seconds:>13.1f}")
    print(f"{'ATOM AsyncEngine (all streamed)':<34}{async_s:>10.2f}{n * out_len / async_s:>12.1f}"
          f"{n * (args.input_len + out_len) / async_s:>13.1f}")
    print(f"{'AsyncEngine / LLM.generate':<34}{'':>10}{atom_s / async_s:>11.2f}x   "
          f"(same greedy outputs for {same_async}/{n} requests)")
    if len(rows) == 2:
        print(f"{'ATOM / transformers':<34}{'':>10}{rows[1][1] / rows[0][1]:>11.2f}x")
        same = sum(a == b for a, b in zip(atom_ids, hf_ids))
        print(f"greedy outputs identical for {same}/{n} requests")

    print(f"\nscheduler, {args.sched_requests} decoding requests, {args.sched_steps} steps (fixed-token runner)")
    print(f"{'prompt tokens, prefix caching':<34}{'schedule us':>12}{'update us':>12}{'step us':>12}")
    for prompt_len in (16, 1024):
        for caching in (False, True):
            sched_us, update_us = bench_scheduler(args.model, args.sched_requests, args.sched_steps, caching,
                                                  prompt_len)  # fmt: skip
            label = f"{prompt_len}, {'on' if caching else 'off'}"
            print(f"{label:<34}{sched_us:>12.0f}{update_us:>12.0f}{sched_us + update_us:>12.0f}")


if __name__ == "__main__":
    main()
