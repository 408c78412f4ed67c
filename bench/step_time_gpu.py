"""Decode step time on one GPU with the host's noise filtered out: the minimum over repeated runs.

    python bench/step_time_gpu.py                        # batches 1, 16, 64; one step at a time and async
    ROUNDS=2 bash bench/trees_ab_gpu.sh "python3 bench/step_time_gpu.py" "^step"   # a change against a base

bench/decode_gpu.py takes the median of three runs, which on a busy host
scatters by 10-20% from run to run; that hides a change to the host's share
of a step. Here a step is ``(t(1 + N new tokens) - t(1 new token)) / N``,
each time the minimum of --repeats runs of ``LLM.generate``, so what is left
is the step's own cost. The model is decode_gpu.py's 1.35B checkpoint
(written to --ckpt unless there), greedy, EOS ignored. Also printed: how much
faster async scheduling is than one step at a time.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def step_ms(path: str, prompts: list[list[int]], new_tokens: int, repeats: int, async_scheduling: bool) -> float:
    from atom import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=len(prompts),
              max_model_len=len(prompts[0]) + new_tokens + 8,
              max_num_batched_tokens=max(2048, len(prompts) * len(prompts[0])), enable_prefix_caching=False,
              async_scheduling=async_scheduling)  # fmt: skip

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(1 + new_tokens)  # warm-up
    first = min(run(1) for _ in range(repeats))
    whole = min(run(1 + new_tokens) for _ in range(repeats))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return (whole - first) / new_tokens * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256, help="N, the new tokens of the long run (default 256)")
    p.add_argument("--repeats", type=int, default=9, help="runs of each length; the minimum counts (default 9)")
    p.add_argument("--ckpt", default="/tmp/atom_kimi_1p3b", help="model folder (decode_gpu.py's; written if absent)")
    args = p.parse_args()
    from bench.decode_gpu import make_model

    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        model = make_model(args.ckpt)
        del model
        torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(3, 32000, (batch, args.input_len), generator=gen).tolist()
        one = step_ms(args.ckpt, prompts, args.output_len, args.repeats, async_scheduling=False)
        overlap = step_ms(args.ckpt, prompts, args.output_len, args.repeats, async_scheduling=True)
        print(f"step batch {batch:3d}: one step at a time {one:.4f} ms ({batch / one * 1e3:.0f} tok/s), "
              f"async {overlap:.4f} ms ({batch / overlap * 1e3:.0f} tok/s), async {one / overlap:.2f}x", flush=True)


if __name__ == "__main__":
    main()
