"""Decode throughput of a dense model (Llama) on one GPU: ATOM vs transformers' generate, same model, same run.

    python bench/dense_decode_gpu.py                          # batch 1, 16, 64; 64 prompt + 64 new tokens
    python bench/dense_decode_gpu.py --reference-too --batches 1,16 --output-len 16

The model is a random Llama-3.2-1B-shaped checkpoint (hidden 2048, 16 layers, 32 query heads and 8 KV
heads of 64, MLP 8192, vocab 32000, bf16), written once to --ckpt; ``--shape 8b`` takes Llama-3.1-8B's shape
(hidden 4096, 32 layers, 32 query heads and 8 KV heads of 128, MLP 14336, vocab 128256), and with ``--skip-hf``
writes its config only and ATOM draws random weights on the GPU (load_format="dummy"). Tokens/s as in
bench/decode_gpu.py (whose helpers this uses): batch * N over the time of N new tokens after the first, the
fastest of --repeats runs, ATOM with its GPU defaults (CUDA graphs, async scheduling). transformers' time is a
run with N more tokens minus a one-token run; ATOM's is the batch's decode span from its requests' metrics (last
first token to last finish), because its prefill-only run (64 prompts, one SDPA call each) takes longer than the
decode it would be subtracted from at batch 64 (GPU_NOTES.md, session 36). The roofline is the bytes one decode step
must read and write (the weights but the embedding table, and each sequence's K and V) over the copy
ceiling measured here.

``--mixed`` also times steps that mix decode rows with prefill chunks: their decode rows through
``paged_decode_attention`` and their chunks through ``paged_prefill_attention`` (as now) against every row
through the torch reference (before session 35), in the same process.

``--prefill`` also times prefill-only runs (every prompt with one new token, in one step): the step's prefill
chunks through ``paged_prefill_attention``'s kernel (as now) against SDPA a sequence at a time (before session 37),
in the same process.

``--long-splits-ab`` also times ATOM's decode with the past-one-wave split of long rows turned off
(``choose_paged_splits`` in ``atom/ops/cuda/paged_attention.py``; head_dim 128 and up, so ``--shape 8b``): two
engines, each capturing its graphs with its own rule, the ratio printed per batch.

``--reference-too`` also runs ATOM the way a dense model ran before ``paged_decode_attention``
(session 34): its attention through the torch reference (a loop over the sequences) and no CUDA
graphs. It is slow: use few tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_gpu import atom_decode_tps, copy_gbps, hf_decode_tps, timed  # noqa: E402

_TOKENS = dict(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SHAPES = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, **_TOKENS),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
               rope_theta=500000.0, **_TOKENS),
}
SHAPE = SHAPES["1b"]  # the shape in use (main sets it from --shape)


def make_model(path: str, on_gpu: bool = True):
    """The random checkpoint on the GPU in bf16, saved to ``path`` (reused when present). With ``on_gpu`` False:
    only its config is written (ATOM loads it with load_format="dummy") and the model is returned on the meta
    device, for its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"])
    if not on_gpu:
        config.save_pretrained(path)
        with torch.device("meta"):
            return LlamaForCausalLM(config).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    if not glob.glob(os.path.join(path, "*.safetensors")):  # a config alone (a --skip-hf run) is no checkpoint
        model.save_pretrained(path)
    return model


def step_bytes(model, batch: int, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    kv = context * SHAPE["num_hidden_layers"] * 2 * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 2  # bf16
    return weights + batch * kv


@contextlib.contextmanager
def reference_attention():
    """The dense path before paged_decode_attention: the attention layer's torch path (rotary, cache write and
    attention), no decode graphs."""
    import types

    import atom.layers.attention as attention
    from atom.models.llama import LlamaForCausalLM

    saved = attention.kernels, LlamaForCausalLM.supports_cuda_graphs
    attention.kernels = types.SimpleNamespace(kernels_apply=lambda *tensors: False)
    LlamaForCausalLM.supports_cuda_graphs = False
    try:
        yield
    finally:
        attention.kernels, LlamaForCausalLM.supports_cuda_graphs = saved


@contextlib.contextmanager
def no_long_splits():
    """Decode grids past one wave keep every row whole, as before session 38 (the engines built inside capture
    their graphs with it)."""
    import atom.ops.cuda.paged_attention as paged

    saved = paged._FULL_WAVES
    paged._FULL_WAVES = 0.0  # no grid fills under 0% of its waves' slots
    try:
        yield
    finally:
        paged._FULL_WAVES = saved


@contextlib.contextmanager
def mixed_steps_on_reference():
    """Steps with prefills as they attended before session 35: every row, decode rows too, through the torch
    reference attention (the rotary kernel, decode-only steps' kernel and the graphs stay)."""
    from atom.layers.attention import KERNEL_MAX_QUERY_LEN, Attention
    from atom.ops.paged_attention import paged_attention

    saved = Attention._attend_kernels

    def attend(self, q, k_cache, v_cache, md):
        if md.max_query_len <= KERNEL_MAX_QUERY_LEN:
            return saved(self, q, k_cache, v_cache, md)
        return paged_attention(q, k_cache, v_cache, md, self.scale)

    Attention._attend_kernels = attend
    try:
        yield
    finally:
        Attention._attend_kernels = saved


@contextlib.contextmanager
def prefill_on_sdpa():
    """Prefill chunks through SDPA one sequence at a time, as before ``paged_prefill_attention``'s kernel."""
    import atom.ops.cuda.paged_attention as paged

    saved = paged.prefill_kernel_applies
    paged.prefill_kernel_applies = lambda q, k_cache: False
    try:
        yield
    finally:
        paged.prefill_kernel_applies = saved


def prefill_seconds(path: str, batch: int, prompt_len: int, repeats: int) -> float:
    """Wall time of one generate of ``batch`` prompts of ``prompt_len`` tokens, one new token each, all prompts
    in one step: the batch's time to first token."""
    from atom import SamplingParams

    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, SHAPE["vocab_size"], (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    return fastest_generate(path, [{"prompt_token_ids": p} for p in prompts], params, repeats, max_num_seqs=batch,
                            max_model_len=prompt_len + 16, max_num_batched_tokens=batch * prompt_len)  # fmt: skip


def fastest_generate(path: str, requests: list, params, repeats: int, **engine_args) -> float:
    """The fastest of ``repeats`` timed ``generate(requests, params)`` on a new bf16 engine (prefix caching off,
    overlap on) after one warm-up; the engine's memory is given back before returning."""
    from atom import LLM

    def time_engine() -> float:
        llm = LLM(path, dtype="bfloat16", device="cuda", enable_prefix_caching=False, async_scheduling=True,
                  **engine_args)  # fmt: skip
        run = lambda: llm.generate(requests, params, use_tqdm=False)  # noqa: E731
        run()
        return min(timed(run) for _ in range(repeats))

    seconds = time_engine()
    gc.collect()  # the engine has no reference left once time_engine returns
    torch.cuda.empty_cache()
    return seconds


def mixed_seconds(path: str, decoders: int, prefills: int, prompt_len: int, chunk: int, new_tokens: int,
                  repeats: int) -> float:  # fmt: skip
    """Wall time of one generate: ``decoders`` 16-token prompts decode ``new_tokens`` each while ``prefills``
    prompts of ``prompt_len`` (one new token each) prefill in ``chunk``-token steps beside them."""
    from atom import SamplingParams

    gen = torch.Generator().manual_seed(1)
    short = torch.randint(3, SHAPE["vocab_size"], (decoders, 16), generator=gen).tolist()
    long = torch.randint(3, SHAPE["vocab_size"], (prefills, prompt_len), generator=gen).tolist()
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)] * decoders
    params += [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)] * prefills
    return fastest_generate(path, [{"prompt_token_ids": p} for p in short + long], params, repeats,
                            max_num_seqs=decoders + prefills, max_model_len=prompt_len + new_tokens + 16,
                            max_num_batched_tokens=chunk)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--ckpt", help="model folder (default: /tmp/atom_llama_1b, /tmp/atom_llama_8b)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers run; with --shape 8b, no checkpoint on disk")
    p.add_argument("--long-splits-ab", action="store_true",
                   help="also ATOM with the past-one-wave split of long rows off (head_dim >= 128: --shape 8b)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each length, both engines; the fastest counts")
    p.add_argument("--reference-too", action="store_true", help="also ATOM's former dense path (one run each)")
    p.add_argument("--mixed", action="store_true",
                   help="also steps mixing decode rows with prefill chunks: the kernels vs all rows on the reference")
    p.add_argument("--prefill", action="store_true",
                   help="also prefill-only runs: the prefill kernel vs SDPA a sequence at a time")
    args = p.parse_args()
    global SHAPE
    SHAPE = SHAPES[args.shape]
    args.ckpt = args.ckpt or f"/tmp/atom_llama_{args.shape}"
    dummy = args.skip_hf and args.shape != "1b"  # the 1b checkpoint is small enough to write
    ceiling = copy_gbps()
    model = make_model(args.ckpt, on_gpu=not dummy)
    load_format = "dummy" if dummy else "auto"
    params = sum(x.numel() for x in model.parameters())
    print(f"device {torch.cuda.get_device_name()}, copy ceiling {ceiling:.0f} GB/s, Llama {params / 1e9:.2f}B "
          f"params, bf16, {args.input_len} prompt + {args.output_len} new tokens", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(3, SHAPE["vocab_size"], (batch, args.input_len), generator=gen).tolist()
        atom = atom_decode_tps(args.ckpt, prompts, args.output_len, async_scheduling=True, repeats=args.repeats,
                               span=True, load_format=load_format)  # fmt: skip
        if args.long_splits_ab:
            with no_long_splits():
                whole = atom_decode_tps(args.ckpt, prompts, args.output_len, async_scheduling=True,
                                        repeats=args.repeats, span=True, load_format=load_format)  # fmt: skip
            print(f"batch {batch}: long rows split past one wave {atom:.0f} tok/s, kept whole {whole:.0f} tok/s: "
                  f"{atom / whole:.3f}x", flush=True)
        before = None
        if args.reference_too:
            with reference_attention():
                before = atom_decode_tps(args.ckpt, prompts, args.output_len, async_scheduling=True, repeats=1,
                                         span=True)
        hf = None if args.skip_hf else hf_decode_tps(model, prompts, args.output_len, repeats=args.repeats)
        roof = batch / (step_bytes(model, batch, args.input_len + args.output_len // 2) / (ceiling * 1e9))
        rows.append((batch, atom, before, hf, roof))
        print(f"batch {batch}: atom {atom:.0f}, former path {before}, transformers {hf} tok/s", flush=True)
    if args.mixed:
        shape = dict(decoders=16, prefills=16, prompt_len=1024, chunk=512, new_tokens=64, repeats=args.repeats)
        now = mixed_seconds(args.ckpt, **shape)
        with mixed_steps_on_reference():
            before = mixed_seconds(args.ckpt, **shape)
        print(f"mixed steps ({shape}): decode rows and prefill chunks on the kernels {now:.3f} s, all rows on the "
              f"reference {before:.3f} s: {before / now:.2f}x", flush=True)
    if args.prefill:
        for batch, prompt_len in ((64, 64), (64, 256), (16, 512), (4, 2048)):
            now = prefill_seconds(args.ckpt, batch, prompt_len, args.repeats)
            with prefill_on_sdpa():
                before = prefill_seconds(args.ckpt, batch, prompt_len, args.repeats)
            print(f"prefill {batch} x {prompt_len} tokens: {1e3 * now:.1f} ms, SDPA a sequence at a time "
                  f"{1e3 * before:.1f} ms: {before / now:.2f}x", flush=True)
    print(f"\n{'batch':>5} {'atom tok/s':>11} {'former':>9} {'hf tok/s':>9} {'atom/hf':>8} {'atom/former':>11} "
          f"{'roofline':>9} {'atom/roof':>9}")
    for batch, atom, before, hf, roof in rows:
        former = f"{before:>9.0f}" if before else f"{'-':>9}"
        gain = f"{atom / before:>10.1f}x" if before else f"{'-':>11}"
        versus = f"{hf:>9.0f} {atom / hf:>7.2f}x" if hf else f"{'-':>9} {'-':>8}"
        print(f"{batch:>5} {atom:>11.0f} {former} {versus} {gain} {roof:>9.0f} {atom / roof:>8.1%}")


if __name__ == "__main__":
    main()
