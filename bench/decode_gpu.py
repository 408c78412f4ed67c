"""Decode throughput on one GPU: ATOM's engine vs transformers' generate, same model, same run.

    python bench/decode_gpu.py                       # batch 1, 16, 64; 64 prompt + 64 new tokens
    python bench/decode_gpu.py --batches 1,16 --output-len 32 --skip-hf
    python bench/decode_gpu.py --eager-too           # also ATOM with --enforce-eager (no CUDA graphs)
    python bench/decode_gpu.py --async-too           # also ATOM with async scheduling (overlap)
    python bench/decode_gpu.py --multi-step 8        # also ATOM with --num-scheduler-steps 8
    python bench/decode_gpu.py --temperature 0.8 --top-p 0.95 --async-too   # sampled, not greedy
    python bench/decode_gpu.py --input-len 2048 --repetition-penalty 1.1 --skip-hf   # penalties over long prompts
    python bench/decode_gpu.py --shape 48b --async-too   # Kimi-Linear-48B-A3B's shape, random weights
    ROUNDS=2 bash bench/trees_ab_gpu.sh "python3 bench/decode_gpu.py --skip-hf --async-too --output-len 256 \
        --repeats 9" "^ *[0-9]+ +[0-9]"         # a change to the host's share against a base tree

The model is a random ~1.3B-parameter Kimi-Linear-shaped checkpoint (hidden
2304, 8 layers of which 2 MLA, 32 heads, 16 experts top-4, vocab 32000,
bf16), written once to --ckpt. Decode tokens/s is measured as
batch * N / (t(prefill + N + 1 tokens) - t(prefill + 1 token)), so prefill
cost cancels; prefix caching is off so both runs prefill fully. Each time is
the fastest of --repeats runs (5), for both engines (up to session 28: ATOM's
the median of 3, transformers' one run). The roofline
is the bytes one decode step must read and write (weights, with the experts a
batch is expected to touch, plus each sequence's KV rows and KDA state) over
the copy bandwidth measured here; its fraction is measured / roofline tok/s.

``--shape 48b`` runs Kimi-Linear-48B-A3B's published shape (~49B parameters,
98 GB in bf16) from a config.json alone, ATOM drawing random weights on the
GPU (load_format="dummy"); transformers does not run beside it (two copies
would not fit one H200).

The "atom" column runs one step at a time (--no-async-scheduling), and
"ratio" is it over transformers; the engine's default on a GPU is the "async"
column (--async-too), over transformers in "async/hf". Until session 29 every
async run paid tens of ms for a fresh forward thread: async figures from before
then are not to be trusted (GPU_NOTES.md, session 29).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The model shapes: the issue's ~1.3B bench model, and Kimi-Linear-48B-A3B's published shape (27 layers, MLA at
# 1-based layers 4, 8, ..., 24 and 27, 256 experts top-8, vocab 163840; transformers' KimiLinearConfig defaults
# but for the layer types).
SHAPES = {
    "1.3b": dict(vocab_size=32000, num_hidden_layers=8, mla_layers=(3, 7), num_local_experts=16, num_experts_per_tok=4,
                 max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "48b": dict(vocab_size=163840, num_hidden_layers=27, mla_layers=(3, 7, 11, 15, 19, 23, 26), num_local_experts=256,
                num_experts_per_tok=8, routed_scaling_factor=2.446),
}


def model_config(shape: str):
    """transformers' KimiLinearConfig of a shape (hidden 2304, 32 heads of 128, MLA latent 512 + 64)."""
    from transformers import KimiLinearConfig

    spec = dict(SHAPES[shape])
    mla = spec.pop("mla_layers")
    layers = spec["num_hidden_layers"]
    return KimiLinearConfig(
        hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
        layer_types=["full_attention" if i in mla else "linear_attention" for i in range(layers)],
        num_attention_heads=32, linear_num_heads=32, linear_head_dim=128,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_group=1, topk_group=1, first_k_dense_replace=1, tie_word_embeddings=False, dtype="bfloat16",
        architectures=["KimiLinearForCausalLM"], **spec,
    )  # fmt: skip


def make_model(path: str, config=None, seed: int = 0):
    """The random checkpoint (default: the 1.3b shape) on the GPU in bf16, saved to ``path`` (reused when
    present)."""
    from transformers import KimiLinearForCausalLM

    config = config or model_config("1.3b")
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = KimiLinearForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # slower decay than HF's init, as tests/checkpoints.py
                p.uniform_(-3.0, 0.0)
    if not os.path.exists(os.path.join(path, "config.json")):
        model.save_pretrained(path)
    return model


def step_bytes(config, batch: int, context: int) -> int:
    """Bytes one decode step must move: weights (touched experts only, no embedding table) + caches."""
    from transformers import KimiLinearForCausalLM

    with torch.device("meta"):  # the parameters' shapes, no memory
        model = KimiLinearForCausalLM(config)
    experts, top_k = config.num_experts, config.num_experts_per_token
    touched = experts * (1 - (1 - top_k / experts) ** batch)
    weights = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        frac = touched / experts if ("experts" in name and "shared" not in name) else 1.0
        weights += int(p.numel() * 2 * frac)  # bf16
    mla_layers = config.layer_types.count("full_attention")
    kda_layers = config.num_hidden_layers - mla_layers
    state = config.linear_num_heads * config.linear_head_dim**2 * 4 * 2  # fp32, read + write
    conv = 3 * config.linear_num_heads * config.linear_head_dim * 3 * 2 * 2
    kv = context * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    return weights + batch * (kda_layers * (state + conv) + mla_layers * kv)


def copy_gbps() -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * n * 10 / (time.perf_counter() - t) / 1e9


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def atom_decode_tps(path: str, prompts: list[list[int]], new_tokens: int, enforce_eager: bool = False,
                    async_scheduling: bool = False, num_scheduler_steps: int = 1, temperature: float = 0.0,
                    top_p: float = 1.0, load_format: str = "auto", repeats: int = 5, span: bool = False,
                    repetition_penalty: float = 1.0) -> float:
    """Decode tokens/s of a batch of ``prompts``. The decode time: ``decode_seconds`` (a run with new_tokens more
    tokens minus a prefill-only run), or with ``span`` the fastest ``decode_span`` of the longer run (no prefill in
    it; for engines whose prefill run takes longer than the decode it would be subtracted from)."""
    from atom import LLM, SamplingParams

    batch = len(prompts)
    max_len = len(prompts[0]) + new_tokens + 8
    llm = LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=batch, max_model_len=max_len,
              max_num_batched_tokens=max(2048, batch * len(prompts[0])), enable_prefix_caching=False,
              enforce_eager=enforce_eager, async_scheduling=async_scheduling,
              num_scheduler_steps=num_scheduler_steps, load_format=load_format)  # fmt: skip

    def run(n):
        params = SamplingParams(temperature=temperature, top_p=top_p, repetition_penalty=repetition_penalty,
                                ignore_eos=True, max_tokens=n)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    run(1 + new_tokens)  # warm-up, multi-step rounds included
    if span:
        seconds = min(decode_span(run(1 + new_tokens)) for _ in range(repeats))
    else:
        seconds = decode_seconds(run, new_tokens, repeats)
    llm = None  # the engine goes (not del: run() reads the name)
    gc.collect()  # the next engine's weights need this one's memory back (98 GB at --shape 48b)
    torch.cuda.empty_cache()
    return batch * new_tokens / seconds


def decode_span(outputs) -> float:
    """Seconds from the batch's last first token to its last finish, from the requests' metrics: the decode steps
    after the prefill, for a batch whose prompts prefill in one step (each time is taken as its step's outputs are
    processed, so an overlapped step's lag is in both ends)."""
    first = max(o.metrics["arrival_time"] + o.metrics["ttft"] for o in outputs)
    last = max(o.metrics["arrival_time"] + o.metrics["e2e"] for o in outputs)
    return last - first


def decode_seconds(run, new_tokens: int, repeats: int = 5) -> float:
    """Decode time of new_tokens: the run with that many more tokens minus the prefill-only run, each
    the fastest of ``repeats`` (the same for both engines). The host's noise only ever adds time, so the
    minimum is the steadier figure: a difference of two medians of three once came out faster than the
    GPU could run the steps (GPU_NOTES.md, session 28)."""
    t1 = min(timed(lambda: run(1)) for _ in range(repeats))
    tn = min(timed(lambda: run(1 + new_tokens)) for _ in range(repeats))
    return tn - t1


def hf_decode_tps(model, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0, repeats: int = 5, repetition_penalty: float = 1.0) -> float:
    ids = torch.tensor(prompts, device="cuda")
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}
    if repetition_penalty != 1:
        sampling["repetition_penalty"] = repetition_penalty

    def run(n):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None,
                           **({"do_sample": False} | sampling))  # fmt: skip

    run(2)
    return len(prompts) * new_tokens / decode_seconds(run, new_tokens, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.3b",
                   help="1.3b: the bench model, a checkpoint written to --ckpt; 48b: Kimi-Linear-48B-A3B's shape, "
                        "config.json only, random weights on the GPU (load_format='dummy'), no transformers run")
    p.add_argument("--ckpt", help="model folder (default: /tmp/atom_kimi_1p3b, /tmp/atom_kimi_48b)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-atom", action="store_true")
    p.add_argument("--eager-too", action="store_true", help="also run ATOM with enforce_eager (no CUDA graphs)")
    p.add_argument("--async-too", action="store_true",
                   help="also run ATOM with async scheduling (and, with --multi-step, multi-step + async)")
    p.add_argument("--multi-step", type=int, default=0, metavar="K",
                   help="also run ATOM with num_scheduler_steps=K (multi-step decoding)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (both engines; default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling (default 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="both engines (default 1: off); the penalties count each request's prompt every step")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of each length, both engines; the fastest counts (default 5; more for A/Bs of the "
                        "host's share of a step on a noisy host)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("atom.worker.cuda_graph").setLevel(logging.INFO)  # says whether graphs were captured

    args.ckpt = args.ckpt or {"1.3b": "/tmp/atom_kimi_1p3b", "48b": "/tmp/atom_kimi_48b"}[args.shape]
    config = model_config(args.shape)
    ceiling = copy_gbps()
    if args.shape == "1.3b":
        model = make_model(args.ckpt, config)
        args.load_format = "auto"
    else:  # two copies of ~98 GB do not fit one GPU: no transformers model, ATOM draws its own weights
        config.save_pretrained(args.ckpt)
        model, args.skip_hf, args.load_format = None, True, "dummy"
    with torch.device("meta"):
        from transformers import KimiLinearForCausalLM

        n_params = sum(x.numel() for x in KimiLinearForCausalLM(config).parameters())
    from atom.ops._C_loader import use_kernels

    import importlib.util

    import transformers

    fla = importlib.util.find_spec("fla") is not None
    print(f"device {torch.cuda.get_device_name()}, copy ceiling {ceiling:.0f} GB/s, "
          f"model {n_params / 1e9:.2f}B params, atom._C kernels {'on' if use_kernels() else 'off'}, "
          f"torch {torch.__version__}, transformers {transformers.__version__} "
          f"({'with' if fla else 'without'} fla's kernels)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(3, 32000, (batch, args.input_len), generator=gen).tolist()  # any vocabulary
        # ATOM first, printed at once: a stall in transformers (e.g. Triton autotuning) loses nothing
        atom = _try_atom(args, prompts, batch, enforce_eager=False) if not args.skip_atom else None
        eager = _try_atom(args, prompts, batch, enforce_eager=True) if args.eager_too else None
        overlap = _try_atom(args, prompts, batch, async_scheduling=True) if args.async_too else None
        multi = _try_atom(args, prompts, batch, num_scheduler_steps=args.multi_step) if args.multi_step > 1 else None
        multi_overlap = None
        if args.multi_step > 1 and args.async_too:  # rounds planned while the round before runs
            multi_overlap = _try_atom(args, prompts, batch, num_scheduler_steps=args.multi_step, async_scheduling=True)
        context = args.input_len + args.output_len // 2
        roof = batch / (step_bytes(config, batch, context) / (ceiling * 1e9))
        print(f"batch {batch}: atom {atom}, atom multi-step {multi}, multi-step + async {multi_overlap}, "
              f"roofline {roof:.0f} tok/s; transformers next", flush=True)  # fmt: skip
        hf = None if args.skip_hf else hf_decode_tps(model, prompts, args.output_len, args.temperature, args.top_p,
                                                     args.repeats, args.repetition_penalty)
        rows.append((batch, atom, eager, overlap, multi, multi_overlap, hf, roof))
        print(f"batch {batch}: atom eager {eager}, atom async {overlap}, transformers {hf}", flush=True)

    print(f"\n{'batch':>5} {'atom tok/s':>11} {'eager tok/s':>11} {'async tok/s':>11} {'multi tok/s':>11} "
          f"{'multi+async':>11} {'hf tok/s':>9} {'ratio':>6} {'async/hf':>8} {'roofline':>9} {'atom/roof':>9} "
          f"{'best/roof':>9}")
    for batch, atom, eager, overlap, multi, multi_overlap, hf, roof in rows:
        fmt = lambda x, w: f"{x:{w}.0f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
        ratio = f"{atom / hf:6.2f}" if atom and hf else f"{'-':>6}"
        async_ratio = f"{overlap / hf:8.2f}" if overlap and hf else f"{'-':>8}"  # the engine's default on a GPU
        frac = f"{atom / roof:9.1%}" if atom else f"{'-':>9}"
        best = max((x for x in (atom, overlap, multi, multi_overlap) if x), default=None)
        frac_best = f"{best / roof:9.1%}" if best else f"{'-':>9}"
        print(f"{batch:>5} {fmt(atom, 11)} {fmt(eager, 11)} {fmt(overlap, 11)} {fmt(multi, 11)} "
              f"{fmt(multi_overlap, 11)} {fmt(hf, 9)} {ratio} {async_ratio} {roof:9.0f} {frac} {frac_best}")


def _try_atom(args, prompts: list[list[int]], batch: int, enforce_eager: bool = False,
              async_scheduling: bool = False, num_scheduler_steps: int = 1) -> float | None:
    try:
        return atom_decode_tps(args.ckpt, prompts, args.output_len, enforce_eager, async_scheduling,
                               num_scheduler_steps, args.temperature, args.top_p, args.load_format,
                               args.repeats, repetition_penalty=args.repetition_penalty)  # fmt: skip
    except Exception as e:  # report and keep the other numbers
        print(f"atom (enforce_eager={enforce_eager}, async_scheduling={async_scheduling}, num_scheduler_steps="
              f"{num_scheduler_steps}) failed at batch {batch}: {type(e).__name__}: {e}")
        return None


if __name__ == "__main__":
    main()
