"""Decode with one GPU setting on against off, two engines side by side in one process.

    python bench/decode_ab_gpu.py --switch gemv      # the dense-linear kernel (csrc/gemv.cu) against cuBLAS
    python bench/decode_ab_gpu.py --switch pdl       # kernels with programmatic dependent launch, or without
    python bench/decode_ab_gpu.py --switch kda_gate_proj  # KDA's gate projections in one kernel, or three
    python bench/decode_ab_gpu.py --switch fold_shared  # the shared expert in the every-expert matmuls, or not
    python bench/decode_ab_gpu.py --switch short_graphs --max-model-len 32768  # decode graphs for short rows too
    python bench/decode_ab_gpu.py --switch graphs_past_128 --batches 160,256,512  # graphs of 256 and 512 rows, or eager
    python bench/decode_ab_gpu.py --batches 1 --rounds 5 --eager

Two engines over bench/decode_gpu.py's random 1.3B Kimi-Linear-shaped model
(bf16) live in one process: one captured its CUDA graphs with the setting on
(``gemv``: ``atom.ops.cuda.linear.GEMV_MAX_TOKENS`` at its default; ``pdl``:
``atom._C.set_programmatic_launch(True)``; ``kda_gate_proj``:
``atom.ops.cuda.fused.KDA_GATE_PROJ_MAX_TOKENS`` at its default;
``fold_shared``: ``atom.layers.moe.FOLD_SHARED``; ``short_graphs``:
``atom.worker.cuda_graph.SHORT_CONTEXT`` at its default, so that steps of short
rows replay graphs whose attention splits are sized for them; ``graphs_past_128``:
``atom.worker.cuda_graph.CAPTURE_SIZES`` up to 512), one with it off
(the limit at 0: every linear on ``F.linear``; launches without the attribute;
two linears and ``kda_gate``; the shared expert as its own MLP; one set of
graphs sized for max_model_len; graphs up to 128 rows, larger steps eager). ``--max-model-len`` (default: the prompt and
new tokens) sizes the engines, and the checkpoint takes that many positions. Each round
times both, in turn, the order alternating; the setting is switched with the
engine, so the steps outside the graphs (prefill) follow it too. Decode tok/s as in
decode_gpu.py: batch * N / (t(1 + N new tokens) - t(1 new token)); and the
device time of one replay of the engine's decode graph for that batch (the
forward with the lm_head and argmax, between CUDA events, median of 10; as
bench/profile_decode_gpu.py), which the host's noise does not reach.

Per-shape kernel times against cuBLAS: ``python bench/kernels_gpu.py --only linear``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from atom.ops._C_loader import get_C  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch", choices=("gemv", "pdl", "kda_gate_proj", "fold_shared", "short_graphs",
                                        "graphs_past_128"), default="gemv")  # fmt: skip
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="both engines with enforce_eager (no CUDA graphs)")
    p.add_argument("--max-model-len", type=int, help="the engines' (default: input + output + 8)")
    p.add_argument("--ckpt", help="model folder (default: /tmp/atom_kimi_1p3b, or with --max-model-len over the "
                                  "model's 4096 positions /tmp/atom_kimi_1p3b_<positions>)")
    args = p.parse_args()
    if not torch.cuda.is_available() or get_C() is None or not hasattr(get_C(), "gemv"):
        sys.exit("bench/decode_ab_gpu.py needs a CUDA GPU and atom._C built with gemv "
                 "(python setup.py build_ext --inplace)")  # fmt: skip

    from atom import LLM, SamplingParams
    from atom.ops.cuda import fused as fused_mod
    from atom.ops.cuda import linear as linear_mod
    from atom.worker import cuda_graph
    from bench.decode_gpu import make_model, model_config, timed
    from bench.profile_decode_gpu import _replay_split

    max_len = args.max_model_len or args.input_len + args.output_len + 8
    config = model_config("1.3b")
    if max_len > config.max_position_embeddings:
        config.max_position_embeddings = max_len
        args.ckpt = args.ckpt or f"/tmp/atom_kimi_1p3b_{max_len}"
    args.ckpt = args.ckpt or "/tmp/atom_kimi_1p3b"
    make_model(args.ckpt, config)
    torch.cuda.empty_cache()
    C, limit = get_C(), linear_mod.GEMV_MAX_TOKENS
    if args.switch == "gemv":
        settings = {"on": lambda: setattr(linear_mod, "GEMV_MAX_TOKENS", limit),
                    "off": lambda: setattr(linear_mod, "GEMV_MAX_TOKENS", 0)}  # fmt: skip
    elif args.switch == "fold_shared":
        from atom.layers import moe as moe_mod

        settings = {"on": lambda: setattr(moe_mod, "FOLD_SHARED", True),
                    "off": lambda: setattr(moe_mod, "FOLD_SHARED", False)}  # fmt: skip
    elif args.switch == "short_graphs":
        short = cuda_graph.SHORT_CONTEXT
        settings = {"on": lambda: setattr(cuda_graph, "SHORT_CONTEXT", short),
                    "off": lambda: setattr(cuda_graph, "SHORT_CONTEXT", 1 << 62)}  # fmt: skip
    elif args.switch == "graphs_past_128":
        sizes = cuda_graph.CAPTURE_SIZES
        up_to_128 = tuple(s for s in sizes if s <= 128)
        settings = {"on": lambda: setattr(cuda_graph, "CAPTURE_SIZES", sizes),
                    "off": lambda: setattr(cuda_graph, "CAPTURE_SIZES", up_to_128)}  # fmt: skip
    elif args.switch == "kda_gate_proj":
        proj_limit = fused_mod.KDA_GATE_PROJ_MAX_TOKENS
        settings = {"on": lambda: setattr(fused_mod, "KDA_GATE_PROJ_MAX_TOKENS", proj_limit),
                    "off": lambda: setattr(fused_mod, "KDA_GATE_PROJ_MAX_TOKENS", 0)}  # fmt: skip
    else:
        C.set_programmatic_launch(True)
        if not C.programmatic_launch():
            sys.exit("programmatic dependent launch needs an NVIDIA GPU of compute capability >= 9")
        settings = {"on": lambda: C.set_programmatic_launch(True), "off": lambda: C.set_programmatic_launch(False)}
    gen = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; {args.switch} on against off; gemv limit {limit} tokens (one "
          f"for any matrix); eager {args.eager}")
    print(f"{'batch':>5} {'round':>5} | {'on tok/s':>10} {'off tok/s':>10} {'x':>5} | "
          f"{'on replay ms':>12} {'off replay ms':>13} {'x':>5}")  # fmt: skip
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [{"prompt_token_ids": q}
                   for q in torch.randint(3, 32000, (batch, args.input_len), generator=gen).tolist()]  # fmt: skip
        engines = {}
        cache = max(2 << 30, batch * (16 << 20))  # room for every request's ~12.6 MiB of KDA state
        for name, apply in settings.items():  # each engine captures its graphs with its own setting
            apply()
            engines[name] = LLM(args.ckpt, dtype="bfloat16", device="cuda", max_num_seqs=batch,
                                max_model_len=max_len,
                                max_num_batched_tokens=max(2048, batch * args.input_len), enable_prefix_caching=False,
                                enforce_eager=args.eager, kv_cache_memory=cache)  # fmt: skip

        def measure(name: str) -> tuple[float, float]:
            """(decode tok/s, ms of one decode-graph replay; nan where the batch runs eagerly)"""
            llm, n_new = engines[name], args.output_len
            settings[name]()

            def run(n):
                llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n), use_tqdm=False)

            run(1 + n_new)
            t1 = sorted(timed(lambda: run(1)) for _ in range(3))[1]
            tn = sorted(timed(lambda: run(1 + n_new)) for _ in range(3))[1]
            graphs = llm.engine.runner.decode_graphs  # its buffers hold the last real step's rows
            replay = float("nan")
            if graphs is not None and batch <= graphs.sizes[-1]:
                replay = _replay_split(graphs, next(s for s in graphs.sizes if s >= batch))[1]
            return batch * n_new / (tn - t1), replay

        for r in range(args.rounds):
            got = {name: measure(name) for name in (("on", "off") if r % 2 == 0 else ("off", "on"))}
            (a_tps, a_ms), (b_tps, b_ms) = got["on"], got["off"]
            print(f"{batch:>5} {r + 1:>5} | {a_tps:>10.0f} {b_tps:>10.0f} {a_tps / b_tps:>5.2f} | "
                  f"{a_ms:>12.3f} {b_ms:>13.3f} {b_ms / a_ms:>5.2f}", flush=True)  # fmt: skip
        settings["on"]()
        engines = None  # the engines go (not del: closures above read the name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
