"""Speculative decoding and overlap, side by side on the same prompts in one run.

For each checkpoint: output tokens/s of plain decoding, of speculation (n-gram
on a Llama checkpoint, on a mix of repetitive and plain prompts and on the
repetitive ones alone; MTP and n-gram on a Kimi-Linear
checkpoint with MTP layers), and mean acceptance length (tokens emitted per
verification step); then plain decoding with overlap (async scheduling) off vs
on. Every configuration's greedy tokens are checked against plain decoding.

    python bench/spec_decode.py [--num-requests 16] [--output-len 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from atom import LLM, SamplingParams  # noqa: E402
from tests import checkpoints  # noqa: E402


def prompts(n: int) -> list[dict]:
    """Half repetitive (n-gram friendly), half plain ranges."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append({"prompt_token_ids": [5 + i % 7, 6, 7, 8, 9, 10, 11] * 6})
        else:
            out.append({"prompt_token_ids": list(range(20 + i, 60 + i))})
    return out


def run(path: str, reqs, params, **engine_kw):
    llm = LLM(path, dtype="float32", **engine_kw)
    llm.generate(reqs[:2], params)  # warm-up
    sched = llm.engine.scheduler
    d0, a0 = sched.num_draft_tokens, sched.num_accepted_tokens
    t = time.perf_counter()
    outs = llm.generate(reqs, params)
    elapsed = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    steps = sum(o.metrics.get("num_verify_steps", 0) for o in outs)
    accepted = sched.num_accepted_tokens - a0
    accept_len = (accepted + steps) / steps if steps else float("nan")
    return tokens, sum(map(len, tokens)) / elapsed, accept_len, sched.num_draft_tokens - d0, accepted


def table(title: str, path: str, reqs, params, configs) -> None:
    print(f"\n{title}")
    print(f"{'config':<34}{'tok/s':>9}{'ratio':>8}{'accept len':>12}{'drafted':>9}{'accepted':>9}  same tokens")
    base_tokens, base_tps = None, None
    for name, kw in configs:
        tokens, tps, alen, drafted, accepted = run(path, reqs, params, **kw)
        if base_tokens is None:
            base_tokens, base_tps = tokens, tps
        print(f"{name:<34}{tps:>9.1f}{tps / base_tps:>8.2f}{alen:>12.2f}{drafted:>9}{accepted:>9}  "
              f"{tokens == base_tokens}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is steadiest on 2 cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reqs = prompts(args.num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        llama = checkpoints.make_llama_checkpoint(os.path.join(tmp, "llama"), "llama", tokenizer=False)
        kimi = checkpoints.add_mtp_weights(
            checkpoints.make_kimi_checkpoint(os.path.join(tmp, "kimi"), "kda_mla", tokenizer=False))
        ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        table("Llama (GQA), n-gram drafts", llama, reqs, params, [
            ("plain", {}),
            ("ngram k=3", {"speculative_config": ngram}),
            ("ngram k=3 + overlap", {"speculative_config": ngram, "async_scheduling": True}),
        ])
        repetitive = reqs[::2]  # the half n-gram drafting latches onto: no slow row holds the batch back
        table("Llama, repetitive prompts only, n-gram drafts", llama, repetitive, params, [
            ("plain", {}),
            ("ngram k=3", {"speculative_config": ngram}),
        ])
        table("Kimi-Linear (KDA+MLA+MoE) with random MTP weights", kimi, reqs, params, [
            ("plain", {}),
            ("mtp k=1", {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}),
            ("mtp k=3", {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}),
            ("ngram k=3", {"speculative_config": ngram}),
        ])
        for name, path in (("Llama", llama), ("Kimi-Linear", kimi)):
            table(f"{name}: overlap (async scheduling) off vs on", path, reqs, params, [
                ("overlap off", {"async_scheduling": False}),
                ("overlap on", {"async_scheduling": True}),
            ])


if __name__ == "__main__":
    main()
