"""Prefill throughput through the engine on one GPU, two settings of one switch side by side in one run:
by default MLA prefills in the expanded form (the default) against the torch reference
(``ATOM_MLA_PREFILL=reference``).

    python bench/prefill_gpu.py                      # the cases below, bench/decode_gpu.py's model
    python bench/prefill_gpu.py --ckpt /tmp/atom_kimi_1p3b
    python bench/prefill_gpu.py --compare ATOM_KDA_SCAN=tf32,fp32   # KDA's chunk scan on tensor cores or not

Each case times ``LLM.generate`` of one new token for its prompts (prefill, then one decode step) on one
engine, the two settings' runs alternating, median of three each after a warm-up, with prefix caching
off; a token budget below the prompt length splits it into chunks, whose later ones attend to the
earlier ones' cached rows. The model is bench/decode_gpu.py's random Kimi-Linear-shaped checkpoint
(bf16, 2 MLA layers of 8); KDA prefills run our kernels unless ATOM_KDA_PREFILL says otherwise
(printed).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (prompts, tokens each, token budget of a step)
CASES = [(1, 4000, 4096), (1, 4000, 1024), (8, 1000, 8192), (32, 250, 8192)]


def prefill_seconds(path: str, prompts: list[list[int]], budget: int, var: str, forms: tuple[str, ...]) -> dict:
    """Seconds of one ``generate`` of ``prompts`` per setting of ``var``: one engine, warmed up in every
    setting, then timed runs that alternate the settings (A B A B A B), median of three each. The switches
    compared here are read at each forward, so one engine serves both, and the order of engines or runs
    does not favour either setting."""
    from atom import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=len(prompts), max_model_len=len(prompts[0]) + 8,
              max_num_batched_tokens=budget, enable_prefix_caching=False,
              async_scheduling=False)  # fmt: skip  (one step at a time, as in the notes' earlier figures)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)

    def run(form: str) -> float:
        os.environ[var] = form
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    before = os.environ.get(var)
    times = {form: [] for form in forms}
    try:
        for form in forms:
            run(form)
        for _ in range(3):
            for form in forms:
                times[form].append(run(form))
    finally:
        if before is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = before
    assert llm.engine.all_resources_free()
    llm = None  # the engine goes (not del: run() reads the name)
    torch.cuda.empty_cache()
    return {form: sorted(t)[1] for form, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="/tmp/atom_kimi_1p3b")
    p.add_argument("--compare", default="ATOM_MLA_PREFILL=expanded,reference",
                   help="VAR=A,B: the environment variable to set and its two values (ratio: B's time over A's)")
    args = p.parse_args()
    var, _, values = args.compare.partition("=")
    forms = tuple(values.split(","))
    if not var or len(forms) != 2 or not all(forms):
        sys.exit(f"--compare takes VAR=A,B (e.g. ATOM_KDA_SCAN=tf32,fp32), got {args.compare!r}")
    if not torch.cuda.is_available():
        sys.exit("bench/prefill_gpu.py needs a CUDA GPU")
    logging.getLogger("atom").setLevel(logging.WARNING)
    from decode_gpu import make_model

    from atom.ops.cuda.kda_prefill import prefill_backend

    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        make_model(args.ckpt)
        torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}, KDA prefill: {prefill_backend()}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, length, budget in CASES:
        prompts = torch.randint(3, 32000, (n, length), generator=gen).tolist()
        times = prefill_seconds(args.ckpt, prompts, budget, var, forms)
        rows.append((f"{n} x {length}, budget {budget}", n * length, times))
        print(f"{rows[-1][0]}: " + ", ".join(f"{var}={f} {times[f] * 1e3:.1f} ms" for f in forms), flush=True)
    a, b = forms
    print(f"\n{'prompts':<28} {a + ' tok/s':>15} {b + ' tok/s':>15} {'ratio':>6}")
    for name, tokens, t in rows:
        print(f"{name:<28} {tokens / t[a]:15.0f} {tokens / t[b]:15.0f} {t[b] / t[a]:6.2f}")


if __name__ == "__main__":
    main()
