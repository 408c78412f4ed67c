"""MTP drafting on the GPU: on CUDA graphs (right behind the verification, or after it) against eagerly.

    python bench/mtp_drafting_gpu.py --batches 1,16,64 --num-drafts 3
    python bench/mtp_drafting_gpu.py --batches 1,16,64 --temperature 0.8 --top-p 0.95 --seeded

bench/decode_gpu.py's random 1.3B Kimi-Linear-shaped model (bf16), given one
MTP layer of random weights (MLA attention and MoE, as its MLA layers). Its
drafts are random, so verification accepts next to none and a step emits one
token: what this measures is what drafting adds to a step. One engine with MTP
speculation drafts in three ways, in turns whose order rotates with the batch.
Its requests are greedy, or sample with ``--temperature`` (and ``--top-p``;
``--seeded``: each request its own seed, so its own keyed draws):

- "behind": on its graphs, the drafting graph replayed right behind the
  verification graph and drafting from its outputs, one step at a time
  (``--no-async-scheduling``);
- "overlap": as "behind", with async scheduling (the default on a GPU since
  session 45): a row's next verification is planned while its step runs, and
  filled in on the device from that step's outcome;
- "after": on its graphs, after the host has accepted the drafts
  (``draft_after_verification`` off);
- "eager": without its graphs (``drafter.graphs`` None).

A second engine decodes without speculation (decode graphs, overlap) for
scale. Per batch: decode tok/s as in decode_gpu.py (batch * N / (t(1 + N new
tokens) - t(1 new token)), median of three) and the median wall time of the
runner's ``execute_model`` a step (verification and drafting) in those runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_mtp_layer(src: str, dst: str, seed: int = 1) -> str:
    """``src``'s checkpoint (linked) plus one MTP layer of random bf16 weights, in ``dst``."""
    from safetensors.torch import save_file

    from atom.models.kimi_linear import KimiLinearForCausalLM

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "config.json" and not os.path.exists(os.path.join(dst, name)):
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with torch.device("meta"):  # the parameters' names and shapes, no memory
        model = KimiLinearForCausalLM(cfg, torch.bfloat16)
    prefix = f"model.layers.{model.args.num_hidden_layers}."
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        if not name.startswith(prefix):
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.ones(p.shape)
        elif name.endswith("e_score_correction_bias"):
            t = torch.zeros(p.shape)
        else:
            t = torch.randn(p.shape, generator=gen) * 0.02
        tensors[name] = t.to(torch.bfloat16 if p.dtype == torch.bfloat16 else p.dtype).contiguous()
    save_file(tensors, os.path.join(dst, "model-mtp.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def speculation_args(description: str) -> argparse.Namespace:
    """The options of the speculation benches (this one and bench/ngram_overlap_gpu.py)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--num-drafts", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--ckpt", default="/tmp/atom_kimi_1p3b")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seeded", action="store_true", help="each request with a seed of its own")
    return p.parse_args()


def engine_kwargs(args: argparse.Namespace, batch: int, prompt_len: int) -> dict:
    """An engine for ``batch`` requests of ``prompt_len`` + ``args.output_len`` tokens, drafting k ahead."""
    k = args.num_drafts
    return dict(dtype="bfloat16", device="cuda", max_num_seqs=batch,
                max_model_len=prompt_len + args.output_len + 2 * k + 8,
                max_num_batched_tokens=max(2048, batch * prompt_len), enable_prefix_caching=False,
                kv_cache_memory=max(2 << 30, batch * (16 << 20) * (1 + k)))  # fmt: skip


def request_params(args: argparse.Namespace, batch: int) -> list:
    """Each request's parameters for 1 new token, then for 1 + ``args.output_len`` (decode_gpu.py's timing)."""
    from atom import SamplingParams

    return [[SamplingParams(temperature=args.temperature, top_p=args.top_p, ignore_eos=True, max_tokens=n,
                            seed=1000 + j if args.seeded else None) for j in range(batch)]
            for n in (1, 1 + args.output_len)]  # fmt: skip


def sampling_label(args: argparse.Namespace) -> str:
    sampling = f"temperature {args.temperature}, top-p {args.top_p}{', seeded' if args.seeded else ''}"
    return sampling if args.temperature else "greedy"


def main() -> None:
    args = speculation_args(__doc__)
    if not torch.cuda.is_available():
        sys.exit("bench/mtp_drafting_gpu.py needs a CUDA GPU")

    from atom import LLM
    from bench.decode_gpu import make_model, timed

    make_model(args.ckpt)
    torch.cuda.empty_cache()
    mtp_ckpt = add_mtp_layer(args.ckpt, args.ckpt + "_mtp")
    k, n_new = args.num_drafts, args.output_len
    gen = torch.Generator().manual_seed(0)
    modes = ("behind", "overlap", "after", "eager")
    print(f"device: {torch.cuda.get_device_name()}; bf16; MTP k = {k}; {args.input_len} prompt + {n_new} new tokens; "
          f"{sampling_label(args)}")
    print(f"{'batch':>5} | {'plain':>7} " + " ".join(f"{m:>7}" for m in modes) + " tok/s | "
          + " ".join(f"{m:>7}" for m in modes) + " step ms | behind/overlap behind/after behind/eager behind/plain"
          " | tokens/verif")
    for i, batch in enumerate(int(b) for b in args.batches.split(",")):
        inputs = [{"prompt_token_ids": q} for q in torch.randint(3, 32000, (batch, args.input_len),
                                                                 generator=gen).tolist()]  # fmt: skip
        kw = engine_kwargs(args, batch, args.input_len)
        plain = LLM(args.ckpt, **kw)
        spec = LLM(mtp_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw)
        runner = spec.engine.runner
        drafter = runner.drafter
        graphs, steps = drafter.graphs, []
        if graphs is None or batch > graphs.sizes[-1]:
            print(f"{batch:>5}: no MTP drafting graph of {batch} rows; skipped")
            continue
        execute = runner.execute_model

        def timed_execute(sched):
            t = time.perf_counter()
            out = execute(sched)
            if sched.scheduled:  # (not the empty plans made while a step runs, with overlap)
                steps.append(time.perf_counter() - t)
            return out

        runner.execute_model = timed_execute
        params = request_params(args, batch)

        def tps(llm) -> float:
            t1 = sorted(timed(lambda: llm.generate(inputs, params[0], use_tqdm=False)) for _ in range(3))[1]
            steps.clear()
            tn = sorted(timed(lambda: llm.generate(inputs, params[1], use_tqdm=False)) for _ in range(3))[1]
            return batch * n_new / (tn - t1)

        base = tps(plain)
        rate, step_ms, emitted = {}, {}, 0.0
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            object.__setattr__(spec.config, "async_scheduling", mode == "overlap")  # (the engine reads it per call)
            drafter.graphs = None if mode == "eager" else graphs
            drafter.__dict__.pop("draft_after_verification", None)  # the class's method again
            if mode == "after":
                drafter.draft_after_verification = lambda rows, targets=None: None
            sched = spec.engine.scheduler
            drafts0, accepted0 = sched.num_draft_tokens, sched.num_accepted_tokens
            rate[mode] = tps(spec)
            step_ms[mode] = sorted(steps)[len(steps) // 2] * 1e3
            emitted = (sched.num_accepted_tokens - accepted0) / max((sched.num_draft_tokens - drafts0) / k, 1) + 1
        r = rate["behind"]
        print(f"{batch:>5} | {base:>7.0f} " + " ".join(f"{rate[m]:>7.0f}" for m in modes) + "       | "
              + " ".join(f"{step_ms[m]:>7.3f}" for m in modes) + f"         | {r / rate['overlap']:>14.2f} "
              f"{r / rate['after']:>12.2f} "
              f"{r / rate['eager']:>12.2f} {r / base:>12.2f} | {emitted:>12.2f}", flush=True)  # fmt: skip
        plain = spec = runner = drafter = graphs = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
