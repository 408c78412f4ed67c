"""N-gram speculation on the GPU, one step at a time against overlap (async scheduling).

    python bench/ngram_overlap_gpu.py --batches 1,16,64 --num-drafts 3
    python bench/ngram_overlap_gpu.py --batches 1,16,64 --temperature 0.8 --top-p 0.95 --seeded

bench/decode_gpu.py's random 1.3B Kimi-Linear-shaped model (bf16). Each prompt
is a random run of tokens said twice, which prompt lookup would match, were the
model to copy it. On random weights it does not, nor does it repeat itself
within these lengths: the drafter proposes next to nothing (GPU_NOTES.md,
session 46), so the figures are what n-gram drafting costs a step, not what
it gains (bench/spec_decode_gpu.py measures acceptance). One engine with n-gram speculation decodes in
two ways, in turns whose order alternates with the batch: "one step" runs a
step at a time (``--no-async-scheduling``, the default with n-gram drafting),
"overlap" plans each row's next verification while its step runs and fills it
in on the host (``ModelRunner._settle``) from that step's accepted count and
the drafts proposed after it. A second engine decodes without speculation
(decode graphs, overlap) for scale.

Per batch: decode tok/s as in decode_gpu.py (batch * N / (t(1 + N new tokens)
- t(1 new token)), median of three), the drafts proposed and the share
accepted, and "differ": the requests whose tokens differ between the two ways
(greedy, or seeded: they must not).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.mtp_drafting_gpu import engine_kwargs, request_params, sampling_label, speculation_args  # noqa: E402


def main() -> None:
    args = speculation_args(__doc__)
    if not torch.cuda.is_available():
        sys.exit("bench/ngram_overlap_gpu.py needs a CUDA GPU")

    from atom import LLM
    from bench.decode_gpu import make_model, timed

    make_model(args.ckpt)
    torch.cuda.empty_cache()
    k, n_new, half = args.num_drafts, args.output_len, args.input_len // 2
    gen = torch.Generator().manual_seed(0)
    modes = ("one step", "overlap")
    print(f"device: {torch.cuda.get_device_name()}; bf16; n-gram k = {k}; {2 * half} prompt + {n_new} new tokens; "
          f"{sampling_label(args)}")
    print(f"{'batch':>5} | {'plain':>8} {'one step':>8} {'overlap':>8} tok/s | overlap/one step | drafts (accepted) | "
          "differ")
    for i, batch in enumerate(int(b) for b in args.batches.split(",")):
        runs = torch.randint(3, 32000, (batch, half), generator=gen).tolist()
        inputs = [{"prompt_token_ids": run + run} for run in runs]
        kw = engine_kwargs(args, batch, 2 * half)
        plain = LLM(args.ckpt, **kw)
        spec = LLM(args.ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **kw)
        params = request_params(args, batch)
        outputs = {}

        def tps(llm, key=None) -> float:
            t1 = sorted(timed(lambda: llm.generate(inputs, params[0], use_tqdm=False)) for _ in range(3))[1]
            times = []
            for _ in range(3):
                times.append(timed(lambda: outputs.__setitem__(key, llm.generate(inputs, params[1], use_tqdm=False))))
            return batch * n_new / (sorted(times)[1] - t1)

        base = tps(plain)
        rate, drafted = {}, {}
        sched = spec.engine.scheduler
        for mode in modes[i % 2 :] + modes[: i % 2]:
            object.__setattr__(spec.config, "async_scheduling", mode == "overlap")  # (the engine reads it per call)
            drafts0, accepted0 = sched.num_draft_tokens, sched.num_accepted_tokens
            rate[mode] = tps(spec, mode)
            proposed = sched.num_draft_tokens - drafts0
            drafted[mode] = f"{proposed} ({(sched.num_accepted_tokens - accepted0) / max(proposed, 1):.0%})"
        differ = sum(a.outputs[0].token_ids != b.outputs[0].token_ids
                     for a, b in zip(outputs["one step"], outputs["overlap"]))  # fmt: skip
        print(f"{batch:>5} | {base:>8.0f} {rate['one step']:>8.0f} {rate['overlap']:>8.0f}       | "
              f"{rate['overlap'] / rate['one step']:>16.2f} | {drafted['one step']} / {drafted['overlap']}"
              f" | {differ}", flush=True)  # fmt: skip
        plain = spec = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
