"""Where a decode step's time goes on the GPU: torch profiler over prefill + 16 decode steps.

    python bench/profile_decode_gpu.py /tmp/atom_kimi_1p3b     # the checkpoint bench/decode_gpu.py writes

Prints, for batch 1 and 64, the wall time, the GPU's busy share, the number
of kernel launches, and the top ops by GPU and by host time.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(path: str) -> None:
    from atom import LLM, SamplingParams

    for batch in (1, 64):
        prompts = torch.randint(3, 32000, (batch, 64), generator=torch.Generator().manual_seed(0)).tolist()
        llm = LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=batch, max_model_len=160,
                  max_num_batched_tokens=max(2048, batch * 64), enable_prefix_caching=False)  # fmt: skip

        def run(n: int, llm=llm) -> None:
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

        run(4)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            run(17)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
        launches = sum(e.count for e in events if e.device_type.name == "CUDA")
        print(f"== batch {batch}: wall {wall * 1e3:.1f} ms for prefill + 16 decode steps, GPU busy {gpu_ms:.1f} ms "
              f"({gpu_ms / (wall * 1e3):.0%}), kernel launches {launches}")  # fmt: skip
        print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=48))
        print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=48))
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/atom_kimi_1p3b")
