"""Decode throughput of a dense model (Llama) on one GPU: ATOM vs transformers' generate, same model, same run.

    python bench/dense_decode_gpu.py                          # batch 1, 16, 64; 64 prompt + 64 new tokens
    python bench/dense_decode_gpu.py --reference-too --batches 1,16 --output-len 16

The model is a random Llama-3.2-1B-shaped checkpoint (hidden 2048, 16 layers, 32 query heads and 8 KV
heads of 64, MLP 8192, vocab 32000, bf16), written once to --ckpt. Tokens/s as in bench/decode_gpu.py
(whose helpers this uses): batch * N over the time of N new tokens after the first, the fastest of --repeats
runs, ATOM with its GPU defaults (CUDA graphs, async scheduling). transformers' time is a run with N more
tokens minus a one-token run; ATOM's is the batch's decode span from its requests' metrics (last first token
to last finish), because its prefill-only run (64 prompts, one SDPA call each) takes longer than the decode it
would be subtracted from at batch 64 (GPU_NOTES.md, session 36). The roofline is the bytes one decode step
must read and write (the weights but the embedding table, and each sequence's K and V) over the copy
ceiling measured here.

``--mixed`` also times steps that mix decode rows with prefill chunks: their decode rows through
``paged_decode_attention`` and their chunks through ``paged_prefill_attention`` (as now) against every row
through the torch reference (before session 35), in the same process.

``--prefill`` also times prefill-only runs (every prompt with one new token, in one step): the step's prefill
chunks through ``paged_prefill_attention``'s kernel (as now) against SDPA a sequence at a time (before session 37),
in the same process.

``--reference-too`` also runs ATOM the way a dense model ran before ``paged_decode_attention``
(session 34): its attention through the torch reference (a loop over the sequences) and no CUDA
graphs. It is slow: use few tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_gpu import atom_decode_tps, copy_gbps, hf_decode_tps, timed  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def make_model(path: str):
    """The random checkpoint on the GPU in bf16, saved to ``path`` (reused when present)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16).eval()
    if not os.path.exists(os.path.join(path, "config.json")):
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
    p.add_argument("--ckpt", default="/tmp/atom_llama_1b")
    p.add_argument("--repeats", type=int, default=5, help="runs of each length, both engines; the fastest counts")
    p.add_argument("--reference-too", action="store_true", help="also ATOM's former dense path (one run each)")
    p.add_argument("--mixed", action="store_true",
                   help="also steps mixing decode rows with prefill chunks: the kernels vs all rows on the reference")
    p.add_argument("--prefill", action="store_true",
                   help="also prefill-only runs: the prefill kernel vs SDPA a sequence at a time")
    args = p.parse_args()
    ceiling = copy_gbps()
    model = make_model(args.ckpt)
    params = sum(x.numel() for x in model.parameters())
    print(f"device {torch.cuda.get_device_name()}, copy ceiling {ceiling:.0f} GB/s, Llama {params / 1e9:.2f}B "
          f"params, bf16, {args.input_len} prompt + {args.output_len} new tokens", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(3, SHAPE["vocab_size"], (batch, args.input_len), generator=gen).tolist()
        atom = atom_decode_tps(args.ckpt, prompts, args.output_len, async_scheduling=True, repeats=args.repeats,
                               span=True)
        before = None
        if args.reference_too:
            with reference_attention():
                before = atom_decode_tps(args.ckpt, prompts, args.output_len, async_scheduling=True, repeats=1,
                                         span=True)
        hf = hf_decode_tps(model, prompts, args.output_len, repeats=args.repeats)
        roof = batch / (step_bytes(model, batch, args.input_len + args.output_len // 2) / (ceiling * 1e9))
        rows.append((batch, atom, before, hf, roof))
        print(f"batch {batch}: atom {atom:.0f}, former path {before}, transformers {hf:.0f} tok/s", flush=True)
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
        print(f"{batch:>5} {atom:>11.0f} {former} {hf:>9.0f} {atom / hf:>7.2f}x {gain} {roof:>9.0f} "
              f"{atom / roof:>8.1%}")


if __name__ == "__main__":
    main()
