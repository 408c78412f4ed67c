"""Speculative decoding on the GPU: verification steps on CUDA graphs against eager ones, and plain decoding.

    python bench/spec_decode_gpu.py --dtype float32 --batches 1,16,32 --num-drafts 3 --wrong none,1,0

On bench/decode_gpu.py's random 1.3B Kimi-Linear-shaped model a drafter that
knows the model's greedy continuation (from a plain run of the same prompts)
proposes its next k tokens, draft ``--wrong`` (0-based; ``none``: none) made
wrong, so each verification step accepts a known number of drafts as long as
the engine's tokens stay those of the plain run. In fp32 they did; in bf16
(the default) the verification's batches of other shapes round differently,
and the random model's near-ties part its tokens from the plain run's within a
few steps, after which the drafts are rejected. (A real drafter on random
weights drafts almost nothing: GPU_NOTES.md, session 40, call 4.)

One engine with speculation runs each setting twice, its verification steps on
the graphs and eagerly (``DecodeGraphs.verify_sizes`` emptied: every step with
drafts runs the forward and the lm_head outside the graphs), in turns whose
order alternates with the batch; a second engine decodes without speculation,
on its decode graphs with overlap (the default). Decode tok/s as in
decode_gpu.py: batch * N / (t(1 + N new tokens) - t(1 new token)), the median
of three. Each line also gives the mean tokens a verification step emits, and
"mismatch": the requests whose tokens differ from plain decoding's, with the
verification steps on the graphs / eager.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from atom.worker.drafters import Drafter  # noqa: E402 - after the path above


class ContinuationDrafter(Drafter):
    """Proposes the next k tokens of each request's known greedy run, draft ``wrong`` made wrong."""

    def __init__(self, k: int, runs: list[list[int]], wrong: int | None) -> None:
        self.k, self.runs, self.wrong = k, runs, wrong
        self.of: dict[str, list[int] | None] = {}  # request id -> its run (found once, by its prompt)

    def propose(self, ctx) -> dict[str, list[int]]:
        out = {}
        for rid in ctx.emitted:
            history = ctx.token_history[rid]
            if rid not in self.of:
                self.of[rid] = next((r for r in self.runs if r[: len(history)] == history), None)
            run = self.of[rid] or []
            drafts = list(run[len(history) : len(history) + self.k])  # (rejected where the run and it part)
            if self.wrong is not None and self.wrong < len(drafts):
                drafts[self.wrong] = (drafts[self.wrong] + 1) % 32000
            out[rid] = drafts
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--num-drafts", type=int, default=3)
    p.add_argument("--wrong", default="none,1", help="comma-separated draft indices made wrong, or none")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--ckpt", default="/tmp/atom_kimi_1p3b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="float32: the known runs hold (bf16 rounds batches of other shapes differently, and a "
                        "random model's near-ties then part its tokens from the plain run's within a few steps)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/spec_decode_gpu.py needs a CUDA GPU")

    from atom import LLM, SamplingParams
    from bench.decode_gpu import make_model, timed

    make_model(args.ckpt)
    torch.cuda.empty_cache()
    k, n_new = args.num_drafts, args.output_len
    max_len = args.input_len + n_new + 2 * k + 8
    greedy = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in (1, 1 + n_new)]
    gen = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; {args.dtype}; k = {k} drafts; {args.input_len} prompt + {n_new} "
          "new tokens")
    print(f"{'batch':>5} {'wrong':>5} | {'plain tok/s':>11} {'graphs tok/s':>12} {'eager tok/s':>11} | "
          f"{'graphs/eager':>12} {'graphs/plain':>12} | {'tokens/verif':>12} {'mismatch':>9}")  # fmt: skip
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [q for q in torch.randint(3, 32000, (batch, args.input_len), generator=gen).tolist()]
        inputs = [{"prompt_token_ids": q} for q in prompts]
        kw = dict(dtype=args.dtype, device="cuda", max_num_seqs=batch, max_model_len=max_len,
                  max_num_batched_tokens=max(2048, batch * args.input_len), enable_prefix_caching=False,
                  kv_cache_memory=max(2 << 30, batch * (16 << 20) * (1 + k)))  # fmt: skip
        plain = LLM(args.ckpt, **kw)
        want = [o.outputs[0].token_ids for o in plain.generate(inputs, greedy[1], use_tqdm=False)]
        runs = [q + w for q, w in zip(prompts, want)]
        spec = LLM(args.ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **kw)
        graphs = spec.engine.runner.decode_graphs
        sizes = graphs.verify_sizes
        if not sizes or batch > sizes[-1]:
            print(f"{batch:>5}: no verification graph of {batch} rows (sizes {sizes}); skipped")
            continue

        def tps(llm) -> tuple[float, list[list[int]]]:
            def go(params):
                return llm.generate(inputs, params, use_tqdm=False)

            t1 = sorted(timed(lambda: go(greedy[0])) for _ in range(3))[1]
            outs = []
            tn = sorted(timed(lambda: outs.append(go(greedy[1]))) for _ in range(3))[1]
            return batch * n_new / (tn - t1), [o.outputs[0].token_ids for o in outs[-1]]

        base, _ = tps(plain)
        for wrong in args.wrong.split(","):
            wrong_at = None if wrong == "none" else int(wrong)
            got = {}
            for mode in ("graphs", "eager") if batch % 2 == 0 else ("eager", "graphs"):
                graphs.verify_sizes = sizes if mode == "graphs" else ()
                spec.engine.runner.drafter = ContinuationDrafter(k, runs, wrong_at)
                sched = spec.engine.scheduler
                drafts0, accepted0 = sched.num_draft_tokens, sched.num_accepted_tokens
                rate, tokens = tps(spec)
                steps = (sched.num_draft_tokens - drafts0) / k  # verification steps (k drafts each, but near the end)
                got[mode] = rate, tokens, (sched.num_accepted_tokens - accepted0) / max(steps, 1) + 1
            graphs.verify_sizes = sizes
            mismatch = "/".join(str(sum(a != b for a, b in zip(got[mode][1], want))) for mode in ("graphs", "eager"))
            (g, _, emitted), (e, _, _) = got["graphs"], got["eager"]
            print(f"{batch:>5} {wrong:>5} | {base:>11.0f} {g:>12.0f} {e:>11.0f} | {g / e:>12.2f} {g / base:>12.2f} | "
                  f"{emitted:>12.2f} {mismatch:>9}", flush=True)  # fmt: skip
        plain = spec = graphs = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
