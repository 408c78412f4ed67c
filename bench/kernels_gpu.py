"""Achieved bandwidth of the atom._C kernels against a copy ceiling measured in the same run.

    python bench/kernels_gpu.py                 # every kernel, default sizes
    python bench/kernels_gpu.py --json out.json
    python bench/kernels_gpu.py --only kda_prefill   # prefill: our scans (tf32, fp32) vs fla vs torch chunked
    python bench/kernels_gpu.py --only moe_gemv      # routed experts at decode sizes: gemv vs grouped
    python bench/kernels_gpu.py --only moe_paths     # each MoE path forced, 1-256 tokens, three routings
    python bench/kernels_gpu.py --only mla_prefill   # MLA prefill: expanded form vs the absorbed reference
    python bench/kernels_gpu.py --only conv1d_prefill  # KDA's prefill conv: kernel vs the torch path
    python bench/kernels_gpu.py --only linear        # dense linears at decode sizes: gemv vs cuBLAS
    python bench/kernels_gpu.py --only ksplit        # the gemv kernel with each k_split forced
    python bench/kernels_gpu.py --only kda_gate_proj # KDA's gate projections: one kernel vs three
    python bench/kernels_gpu.py --only paged_decode  # dense models' GQA decode attention
    python bench/kernels_gpu.py --only paged_prefill  # their prefill: one launch vs SDPA a sequence at a time

Each row: the fewest bytes the op must move through device memory (every
input read once, every output written once) over its median time, and that
as a fraction of the ceiling: a large device-to-device copy, counting bytes
read plus bytes written. Kernels are launched through ``atom._C`` directly
with precomputed pointers, so Python wrapper overhead is not in the times;
L2 is flushed before every timed launch by reading 256 MiB (``--flush
read``, the default), which leaves L2 holding clean lines. ``--flush write``
zeroes 256 MiB instead, as ``triton.testing.do_bench`` does: that leaves up
to L2's 50 MB of dirty lines, whose write-back to HBM then runs inside the
timed kernel and is charged to it (ceiling included). ``--graph`` adds, for KDA and
MLA decode, the time per launch of the same kernel back to back in one CUDA
graph, as the engine's decode steps run it, over enough copies of its inputs
that none is still in L2 when it comes round again (the event-timed figure
also holds one launch's fixed cost plus the ~2.7 us more that an event-timed
launch costs than one inside a graph). Next to the MLA rows, a Triton kernel that does
nothing but read the bytes of the B=64 cache (where Triton imports) shows how much of
the ceiling any kernel moving that many bytes reaches here. Realistic Kimi-Linear sizes: KDA H=32,
K=V=128 (fp32 state, bf16 activations); MLA H=32, rank 512 + rope 64, bf16
cache, block size 16.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:  # the read-only reference row (CUDA builds of torch come with Triton)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

from atom.ops._C_loader import get_C  # noqa: E402
from atom.ops.cuda._launch import dtype_code  # noqa: E402
from atom.ops.cuda._launch import num_sms as _num_sms  # noqa: E402
from atom.ops.cuda.mla import choose_num_splits  # noqa: E402
from atom.ops.cuda.paged_attention import choose_paged_splits  # noqa: E402

_FLUSH = None
FLUSH_MODE = "read"  # --flush
GRAPH = False  # --graph


def time_us(fn, reps: int = 40, warmup: int = 5) -> float:
    """Median microseconds of fn() on the current stream, L2 flushed before each launch (FLUSH_MODE)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if FLUSH_MODE == "read":
            _FLUSH.max()
        else:
            _FLUSH.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def graph_us(runs: list, rounds: int = 2) -> float:
    """Microseconds per launch of `runs` back to back in one CUDA graph (`rounds` passes over the list)."""
    torch.cuda.synchronize()  # the inputs were just made on the default stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for run in runs:  # warm-up outside the capture
            run()
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(rounds):
                for run in runs:
                    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        _FLUSH.max()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times) / (rounds * len(runs))


def timings(make, moved: int, graph: bool = False) -> dict:
    """{"us": event-timed median of one launch of make()'s kernel} and, with --graph (or ``graph``),
    "graph_us": per launch back to back in a CUDA graph over copies of the inputs (make() builds a fresh
    set) that together hold at least 4x L2, so no launch finds its inputs in L2."""
    run = make()
    out = {"us": time_us(run)}
    if GRAPH or graph:
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        copies = min(64, max(2, -(-4 * l2 // moved)))
        runs = [run] + [make() for _ in range(copies - 1)]
        out["graph_us"] = graph_us(runs)
        del runs
        torch.cuda.empty_cache()
    return out


def copy_ceiling() -> tuple[float, float]:
    """(GB/s read + write, microseconds) of a 1 GiB device-to-device copy."""
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), reps=20)
    return 2 * n / us / 1e3, us  # src and dst go with this frame


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def bench_kda(C, batch: int, tokens: int = 1, heads: int = 32, dim: int = 128, per_token: bool = False) -> dict:
    bf16 = torch.bfloat16
    cols = tokens if per_token else 1

    def make():
        q = torch.randn(batch, tokens, heads, dim, dtype=bf16, device="cuda")
        k, v = torch.randn_like(q), torch.randn_like(q)
        g = -torch.rand(batch, tokens, heads, dim, device="cuda")
        beta = torch.rand(batch, tokens, heads, device="cuda")
        pool = torch.randn(batch * cols + 8, heads, dim, dim, device="cuda") * 0.1
        # each sequence owns `cols` consecutive slots, in a random order; it reads the first
        slots = (torch.randperm(batch, device="cuda") * cols).contiguous()
        out = torch.empty(batch, tokens, heads, dim, dtype=bf16, device="cuda")
        sb, st = q.stride(0), q.stride(1)

        def run():
            C.kda_decode(q.data_ptr(), sb, st, k.data_ptr(), sb, st, v.data_ptr(), sb, st, g.data_ptr(),
                         beta.data_ptr(), pool.data_ptr(), pool.stride(0), slots.data_ptr(), slots.data_ptr(),
                         per_token, 0, out.data_ptr(), batch, tokens, heads, dim, dim, dim**-0.5, 1e-6, 0, 0, 0,
                         0.0, dtype_code(bf16), stream())  # fmt: skip

        return run

    state_bytes = heads * dim * dim * 4
    moved = batch * state_bytes * (1 + cols)  # read once, write after each kept token
    # q, k, v, out in bf16; g fp32 per element; beta fp32 per head
    moved += batch * tokens * heads * (4 * dim * 2 + dim * 4 + 4)
    name = f"kda_decode B={batch} T={tokens}{' per-token slots' if per_token else ''}"
    return {"op": name, "bytes": moved, **timings(make, moved)}


def kda_prefill_inputs(seqs: int, length: int, heads: int = 32, dim: int = 128) -> dict:
    bf16, tokens = torch.bfloat16, seqs * length
    q = torch.randn(tokens, heads, dim, dtype=bf16, device="cuda")
    return {
        "q": q, "k": torch.randn_like(q), "v": torch.randn_like(q),
        "g": -torch.rand(tokens, heads, dim, device="cuda"), "beta": torch.rand(tokens, heads, device="cuda"),
        "cu_seqlens": torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * length,
        "state_pool": torch.randn(seqs, heads, dim, dim, device="cuda") * 0.1,
        "state_slots": torch.arange(seqs, device="cuda"),
    }  # fmt: skip


# name: kda_prefill's (backend, scan)
PREFILL_IMPLS = {"tf32": ("atom", "tf32"), "fp32": ("atom", "fp32"), "fla": ("fla", None)}


def bench_kda_prefill(seqs: int, length: int, impl: str) -> float:
    """Microseconds of one KDA prefill (H=32, K=V=128, bf16 q/k/v, fp32 state) through ``impl``: a
    ``PREFILL_IMPLS`` name (ours with the tf32 or the fp32 scan; fla), or
    'torch' (the chunked reference on the padded batch, what the layer ran before fused kernels)."""
    from atom.ops.cuda.kda_prefill import kda_prefill
    from atom.ops.kda import kda_chunked, l2norm

    x = kda_prefill_inputs(seqs, length)
    if impl in PREFILL_IMPLS:
        backend, scan = PREFILL_IMPLS[impl]
        if impl != "fp32":  # also how far it is from the fp32 scan on these inputs (output and final state)
            pools = [x["state_pool"].clone() for _ in range(2)]
            outs = [kda_prefill(**{**x, "state_pool": pool}, backend=b, scan=s)
                    for pool, (b, s) in zip(pools, (PREFILL_IMPLS["fp32"], PREFILL_IMPLS[impl]))]  # fmt: skip
            errs = [((b.float() - a.float()).norm() / a.float().norm()).item() for a, b in (outs, pools)]
            print(f"{impl} vs fp32 {seqs}x{length}: output rel err {errs[0]:.2e}, final state rel err {errs[1]:.2e}")
        return time_us(lambda: kda_prefill(**x, backend=backend, scan=scan), reps=10 if impl == "fla" else 20)

    def torch_ref():
        shape = (seqs, length, *x["q"].shape[1:])
        qn = l2norm(x["q"].float()).view(shape) * shape[-1] ** -0.5
        kn = l2norm(x["k"].float()).view(shape)
        kda_chunked(qn, kn, x["v"].float().view(shape), x["g"].view(shape), x["beta"].view(seqs, length, -1),
                    x["state_pool"].clone())  # fmt: skip

    return time_us(torch_ref, reps=3, warmup=1)


def run_prefill(sizes: list[tuple[int, int]]) -> list[dict]:
    """Ours and the torch reference for every size, then fla (its first calls autotune), printed as measured."""
    from atom.ops.cuda.kda_prefill import fla_available

    rows = [{"op": f"kda_prefill {n}x{t} H=32 K=V=128 bf16", "tokens": n * t} for n, t in sizes]
    impls = ["tf32", "fp32", "torch"] + (["fla"] if fla_available() else [])
    for impl in impls:
        for row, (n, t) in zip(rows, sizes):
            row[f"{impl}_us"] = us = bench_kda_prefill(n, t, impl)
            print(f"{row['op']:<40} {impl:>5}: {us:10.0f} us {row['tokens'] / us:8.2f} Mtok/s", flush=True)
    print(f"\n{'op':<40} " + " ".join(f"{name + ' us':>10} {name + ' Mtok/s':>12}" for name in impls))
    for row in rows:
        cells = " ".join(f"{row[f'{name}_us']:10.0f} {row['tokens'] / row[f'{name}_us']:12.2f}" for name in impls)
        print(f"{row['op']:<40} {cells}")
    return rows


def bench_mla_prefill(seqs: int, new: int, context: int = 0, heads: int = 32, rank: int = 512, rope: int = 64,
                      nope: int = 128, v_dim: int = 128) -> dict:
    """One MLA layer's attention for a prefill step on the GPU (Kimi-Linear's sizes, bf16, block size 16):
    the expanded form the layer runs now (``mla_prefill``: keys and values per head, the step's shorter sequences
    in one kernel launch, the others through torch's fused attention), the same form with every sequence through
    torch's fused attention one at a time (before session 37), and the absorbed torch reference (``mla_attention``
    with W_UK and W_UV, fp32 scores), side by side. ``seqs`` sequences of ``new`` tokens each, after ``context``
    cached ones."""
    import atom.ops.mla as mla_ops
    from atom.forward_context import AttentionMetadata
    from atom.ops import split_decode_prefill
    from atom.ops.mla import mla_attention, mla_prefill

    bf16, block = torch.bfloat16, 16
    seq_len = context + new
    per_seq = -(-seq_len // block)
    tables = torch.randperm(seqs * per_seq, device="cuda").view(seqs, per_seq)
    starts = [i * new for i in range(seqs + 1)]
    md = AttentionMetadata(query_start_loc=starts, context_lens=[context] * seqs, seq_lens=[seq_len] * seqs,
                           block_tables=tables, slot_mapping=torch.zeros(seqs * new, dtype=torch.long, device="cuda"),
                           state_slots=torch.zeros(seqs, dtype=torch.long, device="cuda"),
                           block_size=block)  # fmt: skip
    cache = torch.randn(seqs * per_seq, block, rank + rope, dtype=bf16, device="cuda")
    q = torch.randn(seqs * new, heads, nope + rope, dtype=bf16, device="cuda")
    kv_b = torch.randn(heads * (nope + v_dim), rank, dtype=bf16, device="cuda") * rank**-0.5
    scale = (nope + rope) ** -0.5
    (layout,) = split_decode_prefill(starts, torch.device("cuda"))
    w_uk, w_uv = kv_b.view(heads, nope + v_dim, rank).split([nope, v_dim], dim=1)
    out = torch.empty(seqs * new, heads, v_dim, dtype=bf16, device="cuda")

    def expanded():
        mla_prefill(q, cache, kv_b, md, layout.seqs, scale, out)
        return out

    def expanded_sdpa():
        saved, mla_ops.expanded_kernel_applies = mla_ops.expanded_kernel_applies, lambda q, v_dim: False
        try:
            return expanded()
        finally:
            mla_ops.expanded_kernel_applies = saved

    def absorbed():
        q_latent = torch.einsum("thn,hnr->thr", q[..., :nope], w_uk)
        latent = mla_attention(q_latent, q[..., nope:], cache, md, layout, scale)
        return torch.einsum("thr,hvr->thv", latent.to(bf16), w_uv)

    def on_the_kernel(rows):  # every sequence through the kernel, in blocks of `rows`
        with prefill_forced(rows, float("inf")):
            return expanded()

    reference = absorbed().float()
    err = ((expanded().float() - reference).norm() / reference.norm()).item()
    sdpa_err = ((expanded_sdpa().float() - reference).norm() / reference.norm()).item()
    err128 = ((on_the_kernel(128).float() - reference).norm() / reference.norm()).item()
    new_us, sdpa_us = time_us(expanded, reps=10, warmup=2), time_us(expanded_sdpa, reps=10, warmup=2)
    us64 = time_us(lambda: on_the_kernel(64), reps=10, warmup=2)
    us128 = time_us(lambda: on_the_kernel(128), reps=10, warmup=2)
    old_us = time_us(absorbed, reps=3, warmup=1)
    # causal (query, key) pairs, each nope + rope + v multiply-adds a head in the expanded form
    pairs = seqs * (new * context + new * (new + 1) // 2)
    tflops = 2 * pairs * heads * (nope + rope + v_dim) / new_us / 1e6
    name = f"mla_prefill {seqs}x{new} ctx={context} H={heads}"
    print(f"{name}: expanded {new_us:.0f} us ({tflops:.0f} TFLOP/s), expanded through SDPA a sequence at a time "
          f"{sdpa_us:.0f} us ({sdpa_us / new_us:.2f}x), absorbed reference {old_us:.0f} us ({old_us / new_us:.1f}x); "
          f"outputs differ from the reference by {err:.1e} ({sdpa_err:.1e} through SDPA, {err128:.1e} in 128-row "
          f"blocks); every sequence on the kernel: 64-row blocks {us64:.0f} us, 128-row {us128:.0f} us "
          f"({us64 / us128:.2f}x)", flush=True)  # fmt: skip
    return {"op": name, "bytes": cache.numel() * 2 + (q.numel() + out.numel()) * 2, "us": new_us, "tflops": tflops,
            "sdpa_us": sdpa_us, "baseline_us": old_us, "us64": us64, "us128": us128}


def bench_paged_prefill(seqs: int, new: int, context: int = 0, heads: int = 32, kv_heads: int = 8,
                        dim: int = 128) -> dict:  # fmt: skip
    """A dense model's attention for a prefill step (bf16, block size 16): ``paged_prefill_attention``'s kernel,
    one launch for every sequence (forced: no sequence left to SDPA), and the wrapper as the layer calls it
    (long sequences left to SDPA), against the SDPA path (one sequence at a time: gather, expand to the query
    heads, flash attention), side by side. ``seqs`` sequences of ``new`` tokens each, after ``context`` cached
    ones."""
    import atom.ops.cuda.paged_attention as paged

    bf16, block = torch.bfloat16, 16
    seq_len = context + new
    per_seq = -(-seq_len // block)
    tables = torch.randperm(seqs * per_seq, device="cuda").view(seqs, per_seq).to(torch.int32)
    k_cache = torch.randn(seqs * per_seq, block, kv_heads, dim, dtype=bf16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(seqs * new, heads, dim, dtype=bf16, device="cuda")
    starts, lens, order = [i * new for i in range(seqs + 1)], [seq_len] * seqs, tuple(range(seqs))
    out, sdpa_out = torch.empty_like(q), torch.empty_like(q)

    def layer():
        paged.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, order, dim**-0.5, out)

    def kernel(rows=None):
        with prefill_forced(rows, float("inf")):
            layer()

    def sdpa():
        paged.paged_prefill_attention_sdpa(q, k_cache, v_cache, tables, starts, lens, order, dim**-0.5, sdpa_out)

    kernel()
    sdpa()
    err = ((out.float() - sdpa_out.float()).norm() / sdpa_out.float().norm()).item()
    kernel(128)
    err128 = ((out.float() - sdpa_out.float()).norm() / sdpa_out.float().norm()).item()
    new_us, old_us = time_us(kernel, reps=10, warmup=2), time_us(sdpa, reps=10, warmup=2)
    us64, us128 = time_us(lambda: kernel(64), reps=10, warmup=2), time_us(lambda: kernel(128), reps=10, warmup=2)
    layer_us = time_us(layer, reps=10, warmup=2)
    pairs = seqs * (new * context + new * (new + 1) // 2)  # causal (query, key) pairs
    tflops = 4 * pairs * heads * dim / new_us / 1e6  # q.k and p.v, dim multiply-adds each
    name = f"paged_prefill {seqs}x{new} ctx={context} H={heads}/{kv_heads} D={dim}"
    print(f"{name}: kernel {new_us:.0f} us ({tflops:.0f} TFLOP/s; 64-row blocks {us64:.0f}, 128-row "
          f"{us128:.0f} us: {us64 / us128:.2f}x), SDPA a sequence at a time {old_us:.0f} us "
          f"({4 * pairs * heads * dim / old_us / 1e6:.0f} TFLOP/s): {old_us / new_us:.2f}x (outputs differ by "
          f"{err:.1e}, {err128:.1e} in 128-row blocks); as the layer calls it {layer_us:.0f} us: "
          f"{old_us / layer_us:.2f}x", flush=True)  # fmt: skip
    moved = (k_cache.numel() + v_cache.numel() + q.numel() + out.numel()) * 2
    return {"op": name, "bytes": moved, "us": new_us, "tflops": tflops, "baseline_us": old_us, "layer_us": layer_us,
            "us64": us64, "us128": us128}


@contextlib.contextmanager
def prefill_forced(rows: int | None = None, sdpa_pairs: float | None = None):
    """The prefill kernel's block rows (64 or 128) and SDPA threshold forced for a while (None: the engine's)."""
    import atom.ops.cuda.paged_attention as paged

    saved = paged.BLOCK_ROWS, paged.SDPA_PAIRS
    paged.BLOCK_ROWS = rows
    paged.SDPA_PAIRS = saved[1] if sdpa_pairs is None else sdpa_pairs
    try:
        yield
    finally:
        paged.BLOCK_ROWS, paged.SDPA_PAIRS = saved


def bench_conv(C, batch: int, channels: int = 3 * 32 * 128, width: int = 4) -> dict:
    bf16 = torch.bfloat16
    x = torch.randn(batch, 1, channels, dtype=bf16, device="cuda")
    w = torch.randn(channels, width, dtype=bf16, device="cuda")
    pool = torch.randn(batch + 8, channels, width - 1, dtype=bf16, device="cuda")
    ids = torch.randperm(batch + 8, device="cuda")[:batch].contiguous()
    out = torch.empty_like(x)

    def run():
        C.conv1d_update(x.data_ptr(), channels, pool.data_ptr(), pool.stride(0), w.data_ptr(), ids.data_ptr(),
                        ids.data_ptr(), False, 0, out.data_ptr(), batch, 1, channels, width, dtype_code(bf16),
                        stream())  # fmt: skip

    moved = 2 * batch * channels * (width - 1) * 2 + (x.numel() + out.numel() + w.numel()) * 2
    return {"op": f"conv1d_update B={batch} C={channels} W={width}", "bytes": moved, "us": time_us(run)}


def bench_conv_prefill(seqs: int, length: int, channels: int = 3 * 32 * 128, width: int = 4) -> dict:
    """KDA's short conv over a prefill step's packed sequences (bf16, Kimi-Linear's q|k|v channels):
    ``conv1d_prefill`` against the torch path the layer ran before (pad, torch's depthwise conv1d with
    the slots' states in front, SiLU, the new states gathered and written back, unpad), side by side."""
    from atom.ops import split_decode_prefill
    from atom.ops.cuda import conv1d_prefill
    from atom.ops.kda import causal_conv1d_with_inputs

    bf16 = torch.bfloat16
    rows = seqs * length
    x = torch.randn(rows, channels, dtype=bf16, device="cuda")
    weight = torch.randn(channels, width, dtype=bf16, device="cuda")
    pool = torch.randn(2 * seqs, channels, width - 1, dtype=bf16, device="cuda")
    slots = torch.randperm(2 * seqs, device="cuda")[:seqs].contiguous()
    keep = torch.ones(seqs, dtype=torch.bool, device="cuda")
    (layout,) = split_decode_prefill([i * length for i in range(seqs + 1)], torch.device("cuda"))

    def kernel():
        return conv1d_prefill(x, layout.cu_seqlens, pool, weight, slots, has_initial_state=keep)

    def torch_path():
        state = torch.where(keep[:, None, None], pool[slots], 0)
        out, new_state, _ = causal_conv1d_with_inputs(layout.pad(x).transpose(1, 2), state, weight, layout.lengths)
        pool[slots] = new_state
        return layout.unpad(out.transpose(1, 2))

    new_us, old_us = time_us(kernel), time_us(torch_path)
    moved = 2 * rows * channels * 2 + 2 * seqs * channels * (width - 1) * 2  # x, out, states read and written
    name = f"conv1d_prefill {seqs}x{length} C={channels} W={width}"
    print(f"{name}: kernel {new_us:.1f} us, torch path {old_us:.1f} us: {old_us / new_us:.1f}x", flush=True)
    return {"op": name, "bytes": moved, "us": new_us, "baseline_us": old_us}


def bench_kda_gate(C, tokens: int, heads: int = 32, dim: int = 128) -> dict:
    """KDA's decay and beta from their projections (bf16 in, fp32 out), at prefill sizes."""
    bf16 = torch.bfloat16
    f = torch.randn(tokens, heads * dim, dtype=bf16, device="cuda")
    dt_bias = torch.randn(heads * dim, device="cuda")
    a_log = torch.randn(heads, dtype=bf16, device="cuda")
    b = torch.randn(tokens, heads, dtype=bf16, device="cuda")
    g = torch.empty(tokens, heads, dim, device="cuda")
    beta = torch.empty(tokens, heads, device="cuda")

    def run():
        C.kda_gate(f.data_ptr(), f.stride(0), dt_bias.data_ptr(), a_log.data_ptr(), b.data_ptr(), b.stride(0),
                   g.data_ptr(), beta.data_ptr(), tokens, heads, dim, dtype_code(bf16), stream())  # fmt: skip

    moved = tokens * heads * (dim + 1) * (2 + 4)  # f and b read in bf16, g and beta written in fp32
    return {"op": f"kda_gate T={tokens} H={heads} K={dim}", "bytes": moved, "us": time_us(run)}


def bench_kda_gate_proj(tokens: int, heads: int = 32, dim: int = 128, rank: int = 128) -> list[dict]:
    """KDA's two low-rank up-projections and its gate at decode sizes (bf16): ``fused.kda_gate_proj``'s one
    kernel against what it replaces (two linears and ``kda_gate``, as ``atom.ops`` runs them), side by side,
    event-timed and back to back in a CUDA graph over copies of the weights that hold 4x L2."""
    from atom.ops.cuda import fused
    from atom.ops.cuda.linear import linear

    bf16, channels = torch.bfloat16, heads * dim
    moved = 2 * channels * rank * 2 + tokens * (2 * rank + heads) * 2 + tokens * (channels * 6 + heads * 4)

    def make_with(one_kernel: bool):
        def make():
            rows = torch.randn(tokens, 2 * rank + heads, dtype=bf16, device="cuda")
            f_a, g_a, b = rows[:, :rank], rows[:, rank : 2 * rank], rows[:, 2 * rank :]
            w_f, w_g = (torch.randn(channels, rank, dtype=bf16, device="cuda") * rank**-0.5 for _ in range(2))
            dt_bias, a_log = torch.randn(channels, device="cuda"), torch.randn(heads, dtype=bf16, device="cuda")
            if one_kernel:
                return lambda: fused.kda_gate_proj(f_a, g_a, b, w_f, w_g, dt_bias, a_log, dim)
            return lambda: (fused.kda_gate(linear(f_a, w_f), dt_bias, a_log, b, dim), linear(g_a, w_g))

        return make

    name = f"kda_gate_proj T={tokens} H={heads} K={dim} R={rank}"
    one, three = timings(make_with(True), moved, graph=True), timings(make_with(False), moved, graph=True)
    print(f"{name}: one kernel {one['graph_us']:.1f} us in a graph, two linears + kda_gate {three['graph_us']:.1f} us:"
          f" {three['graph_us'] / one['graph_us']:.2f}x (event-timed {one['us']:.1f} / {three['us']:.1f} us)",
          flush=True)  # fmt: skip
    return [{"op": name, "bytes": moved, **one}, {"op": f"{name} separate", "bytes": moved, **three}]


def bench_moe_combine(C, tokens: int, top_k: int = 4, dim: int = 2304) -> dict:
    """Each token's picks summed, plus the shared experts' output (bf16), at prefill sizes."""
    bf16 = torch.bfloat16
    y = torch.randn(tokens * top_k, dim, dtype=bf16, device="cuda")
    pos = torch.randperm(tokens * top_k, device="cuda")
    weights = torch.rand(tokens, top_k, device="cuda")
    addend = torch.randn(tokens, dim, dtype=bf16, device="cuda")
    out = torch.empty_like(addend)

    def run():
        C.moe_combine(y.data_ptr(), pos.data_ptr(), weights.data_ptr(), addend.data_ptr(), out.data_ptr(), tokens,
                      top_k, dim, 0, dtype_code(bf16), stream())  # fmt: skip

    moved = (y.numel() + addend.numel() + out.numel()) * 2 + pos.numel() * 8 + weights.numel() * 4
    return {"op": f"moe_combine T={tokens} k={top_k} D={dim}", "bytes": moved, "us": time_us(run)}


def bench_moe_align(C, tokens: int, experts: int, top_k: int) -> dict:
    """(token, pick) pairs grouped by expert: the pairs read, three int arrays written."""
    ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices.contiguous()
    src, pos = torch.empty(tokens * top_k, dtype=torch.int64, device="cuda"), torch.empty_like(ids).view(-1)
    ends = torch.empty(experts, dtype=torch.int32, device="cuda")
    workspace = torch.empty(max(C.moe_align_workspace_ints(ids.numel(), experts), 1), dtype=torch.int32,
                            device="cuda")  # fmt: skip

    def run():
        C.moe_align(ids.data_ptr(), ids.numel(), experts, top_k, src.data_ptr(), pos.data_ptr(), ends.data_ptr(),
                    workspace.data_ptr(), stream())  # fmt: skip

    moved = 3 * ids.numel() * 8 + experts * 4
    return {"op": f"moe_align T={tokens} E={experts} k={top_k}", "bytes": moved, "us": time_us(run)}


def bench_norm(C, rows: int, dim: int = 128) -> dict:
    bf16 = torch.bfloat16
    x = torch.randn(rows, dim, dtype=bf16, device="cuda")
    gate, out = torch.randn_like(x), torch.empty_like(x)
    w = torch.randn(dim, dtype=bf16, device="cuda")

    def run():
        C.gated_rmsnorm(x.data_ptr(), dim, gate.data_ptr(), dim, w.data_ptr(), out.data_ptr(), dim, rows, dim,
                        1e-6, dtype_code(bf16), stream())  # fmt: skip

    return {"op": f"gated_rmsnorm rows={rows} D={dim}", "bytes": 3 * rows * dim * 2, "us": time_us(run)}


def bench_rms_norm(C, rows: int, dim: int = 2304, residual: bool = False) -> dict:
    bf16 = torch.bfloat16
    x, r = torch.randn(rows, dim, dtype=bf16, device="cuda"), torch.randn(rows, dim, dtype=bf16, device="cuda")
    out, total = torch.empty_like(x), torch.empty_like(x)
    w = torch.randn(dim, dtype=bf16, device="cuda")

    def run():
        C.rms_norm(x.data_ptr(), dim, r.data_ptr() if residual else 0, dim, total.data_ptr() if residual else 0, dim,
                   w.data_ptr(), out.data_ptr(), dim, rows, dim, 1e-6, dtype_code(bf16), stream())  # fmt: skip

    moved = (4 if residual else 2) * rows * dim * 2 + dim * 2
    name = "add_rms_norm" if residual else "rms_norm"
    return {"op": f"{name} rows={rows} D={dim}", "bytes": moved, "us": time_us(run)}


def bench_router(C, tokens: int, experts: int = 16, dim: int = 2304) -> dict:
    """The router's fp32 logits from bf16 activations; graph-timed too (``timings``), like ``bench_moe_route``."""

    def make():
        x = torch.randn(tokens, dim, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(experts, dim, device="cuda")
        logits = torch.empty(tokens, experts, device="cuda")
        return lambda: C.router_logits(x.data_ptr(), dim, w.data_ptr(), logits.data_ptr(), tokens, experts, dim,
                                       dtype_code(torch.bfloat16), stream())  # fmt: skip

    moved = tokens * dim * 2 + experts * dim * 4 + tokens * experts * 4
    return {"op": f"router_logits T={tokens} E={experts} D={dim}", "bytes": moved, **timings(make, moved, graph=True)}


def bench_moe_route(C, tokens: int, experts: int, top_k: int) -> dict:
    """Top-k experts per token from the fp32 logits (sigmoid, bias, renormalised): Kimi-Linear's router after its
    logits. Graph-timed too (``timings``): at one token it is a latency, not a bandwidth."""

    def make():
        logits = torch.randn(tokens, experts, device="cuda")
        bias = torch.randn(experts, device="cuda") * 0.1
        ids = torch.empty(tokens, top_k, dtype=torch.int64, device="cuda")
        weights = torch.empty(tokens, top_k, device="cuda")
        return lambda: C.moe_route(logits.data_ptr(), experts, bias.data_ptr(), tokens, experts, top_k, True, 2.5,
                                   ids.data_ptr(), weights.data_ptr(), stream())  # fmt: skip

    moved = tokens * experts * 4 + experts * 4 + tokens * top_k * 12
    return {"op": f"moe_route T={tokens} E={experts} k={top_k}", "bytes": moved, **timings(make, moved, graph=True)}


def bench_mla(
    C, batch: int, context: int, heads: int = 32, block_size: int = 16, splits: int | None = None, kernel: int = 0,
    graph: bool = False,
) -> dict:
    bf16 = torch.bfloat16
    rank, rope = 512, 64
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    if splits is None:
        splits = choose_num_splits(batch, heads, context, _num_sms(torch.device("cuda")), True)

    def make():
        cache = torch.randn(num_blocks, block_size, rank + rope, dtype=bf16, device="cuda")
        tables = torch.randperm(num_blocks, device="cuda").view(batch, per_seq).to(torch.int32).contiguous()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        ql = torch.randn(batch, heads, rank, dtype=bf16, device="cuda")
        qp = torch.randn(batch, heads, rope, dtype=bf16, device="cuda")
        out = torch.empty(batch, heads, rank, dtype=bf16, device="cuda")
        o_part = torch.empty(batch, splits, heads, rank, device="cuda")
        lse = torch.empty(batch, splits, heads, device="cuda")

        def run():
            C.mla_decode(ql.data_ptr(), qp.data_ptr(), cache.data_ptr(), cache.stride(0), cache.stride(1),
                         block_size, tables.data_ptr(), tables.stride(0), dtype_code(torch.int32),
                         seq_lens.data_ptr(), dtype_code(torch.int32), out.data_ptr(), o_part.data_ptr(),
                         lse.data_ptr(), batch, heads, rank, rope, splits, (128 + rope) ** -0.5, dtype_code(bf16),
                         dtype_code(bf16), kernel, stream())  # fmt: skip

        return run

    moved = batch * context * (rank + rope) * 2 + batch * heads * (rank + rope + rank) * 2  # cache, q, out
    flops = batch * heads * context * 2 * (rank + rope + rank)
    times = timings(make, moved, graph)
    name = f"mla_decode B={batch} ctx={context} bs={block_size} splits={splits} k={kernel}"
    return {"op": name, "bytes": moved, **times, "tflops": flops / times["us"] / 1e6}


def bench_paged(C, batch: int, context: int, heads: int = 32, kv_heads: int = 8, dim: int = 128,
                block_size: int = 16, splits: int | None = None, min_tiles: int = 1, graph: bool = False,
                max_seq_len: int | None = None) -> dict:  # fmt: skip
    """Dense models' GQA decode attention (Llama-3-8B's heads by default), bf16 K and V caches; ``splits`` (and
    ``min_tiles``, a split's fewest tiles) forced, else the engine's choice for rows of up to ``max_seq_len``
    (default: this context; a CUDA graph's is max_model_len)."""
    bf16 = torch.bfloat16
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    if splits is None:
        splits, min_tiles = choose_paged_splits(batch, heads, kv_heads, dim, bf16, max_seq_len or context,
                                                _num_sms(torch.device("cuda")))  # fmt: skip

    def make():
        k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, dtype=bf16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(num_blocks, device="cuda").view(batch, per_seq).to(torch.int32).contiguous()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, dim, dtype=bf16, device="cuda")
        out = torch.empty_like(q)
        o_part = torch.empty(batch, splits, heads, dim, device="cuda")
        lse = torch.empty(batch, splits, heads, device="cuda")

        def run():
            C.paged_decode_attention(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                k_cache.stride(2), block_size, tables.data_ptr(), tables.stride(0), dtype_code(torch.int32),
                seq_lens.data_ptr(), dtype_code(torch.int32), out.data_ptr(), o_part.data_ptr(), lse.data_ptr(),
                batch, heads, kv_heads, dim, splits, min_tiles, 0, dim**-0.5, dtype_code(bf16), dtype_code(bf16),
                stream())  # fmt: skip

        return run

    moved = batch * context * kv_heads * dim * 2 * 2 + 2 * batch * heads * dim * 2  # K and V, q and out
    times = timings(make, moved, graph)
    name = f"paged_decode B={batch} ctx={context} H={heads}/{kv_heads} D={dim} splits={splits}/{min_tiles}"
    return {"op": name, "bytes": moved, **times}


if triton is not None:

    @triton.jit
    def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), axis=0))


def bench_read(nbytes: int, label: str) -> dict:
    """A kernel that does nothing but read `nbytes`, timed like the others: about the most any kernel moving
    that many bytes reaches here. At a few hundred MB reads alone run at the copy ceiling (read + write) or a
    little above it; at tens of MB the launch and the ramp up and down weigh in."""
    n, block = nbytes // 2, 4096
    programs = triton.cdiv(n, block)

    def make():
        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(programs, device="cuda")
        return lambda: _read_kernel[(programs,)](x, out, n, BLOCK=block, num_warps=4)

    return {"op": f"read-only reference, {label}", "bytes": nbytes, **timings(make, nbytes)}


@functools.cache
def _moe_layers(experts: int, dim: int, inter: int) -> list:
    """(routed experts, shared MLP) pairs of random bf16 weights, enough copies that together they hold
    8x L2, so a call finds few of its experts in L2 when the copies are used in turn."""
    from atom.layers import moe

    bf16 = torch.bfloat16

    def weight(*shape):
        return torch.randn(*shape, dtype=bf16, device="cuda") * 0.02

    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    copies = -(-8 * l2 // (experts * 3 * inter * dim * 2))  # 1 at E=256 (3.6 GB), 4 at E=16
    layers = []
    for _ in range(copies):
        with torch.device("meta"):
            layer, mlp = moe.RoutedExperts(experts, dim, inter, bf16), moe.GatedMLP(dim, inter, bf16)
        layer.register_buffer("gate_up_proj", weight(experts, 2 * inter, dim))
        layer.register_buffer("down_proj", weight(experts, dim, inter))
        mlp.gate_up.weight, mlp.down_proj.weight = weight(2 * inter, dim), torch.nn.Parameter(weight(dim, inter))
        layers.append((layer, mlp))
    return layers


def _moe_calls(tokens: int, experts: int, top_k: int, dim: int, inter: int) -> tuple[list, int]:
    """16 calls of one MoE layer, each with its own routing and inputs, over the copies of
    _moe_layers in turn; and the bytes a call must move on average: the picked experts' weights,
    each expert read once, the shared expert's, x and the output."""
    layers = _moe_layers(experts, dim, inter)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    calls, moved = [], 0
    for i in range(16):
        x = torch.randn(tokens, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
        ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
        calls.append((*layers[i % len(layers)], x, weights, ids))
        moved += (ids.unique().numel() + 1) * 3 * inter * dim * 2 + 2 * tokens * dim * 2
    return calls, moved // 16


def bench_moe(tokens: int, experts: int, top_k: int, dim: int = 2304, inter: int = 1024) -> dict:
    """One MoE layer at decode sizes, bf16, routed experts plus one shared expert of their size (as in
    Kimi-Linear): ``SparseMoE``'s gemv path (``csrc/moe_gemv.cu``, the shared expert in the same two
    kernels) against what it runs with that path off (the shared expert's own MLP, then the grouped
    matmuls or every expert, as ``moe.routed_path`` picks). Both timed as ``graph_us`` times: 16 calls
    back to back in one CUDA graph, as the engine's decode step runs them (see _moe_calls)."""
    from atom.layers import moe

    calls, moved = _moe_calls(tokens, experts, top_k, dim, inter)

    def gemv(layer, mlp, x, weights, ids):
        return layer.forward_gemv(x, weights, ids, shared=mlp.stacked_weights())

    def baseline(layer, mlp, x, weights, ids):
        saved, moe.GEMV_MAX_TOKENS = moe.GEMV_MAX_TOKENS, 0
        try:
            return layer(x, weights, ids, addend=mlp(x))
        finally:
            moe.GEMV_MAX_TOKENS = saved

    ref, out = baseline(*calls[0]).float(), gemv(*calls[0]).float()
    err = ((out - ref).norm() / ref.norm()).item()
    gemv_us = graph_us([lambda c=c: gemv(*c) for c in calls])
    base_us = graph_us([lambda c=c: baseline(*c) for c in calls])
    saved, moe.GEMV_MAX_TOKENS = moe.GEMV_MAX_TOKENS, 0
    try:
        name = "shared MLP + " + moe.routed_path(calls[0][2], calls[0][4], len(calls[0][0]))
    finally:
        moe.GEMV_MAX_TOKENS = saved
    print(f"moe T={tokens} E={experts} k={top_k} + shared: gemv {gemv_us:.1f} us, {name} {base_us:.1f} us: "
          f"{base_us / gemv_us:.2f}x (outputs differ by {err:.1e})", flush=True)  # fmt: skip
    return {"op": f"moe_gemv T={tokens} E={experts} k={top_k} +shared D={dim} I={inter}", "bytes": moved,
            "us": gemv_us, "baseline": name, "baseline_us": base_us}


def bench_moe_paths(tokens: int, experts: int, top_k: int, dim: int = 2304, inter: int = 1024) -> list[dict]:
    """One MoE layer (routed experts plus a shared expert of their size, bf16) through each of the GPU
    paths forced in turn, side by side in one run: gemv (the shared expert inside its kernels), and the
    shared MLP followed by the grouped matmuls or by every expert. Timed as in bench_moe; the bytes are
    the fewest any path must move (the picked experts once each), so the shares compare the paths. What
    ``moe.routed_path``'s limits are set from."""
    calls, moved = _moe_calls(tokens, experts, top_k, dim, inter)
    paths = {
        "gemv": lambda layer, mlp, x, w, ids: layer.forward_gemv(x, w, ids, shared=mlp.stacked_weights()),
        "grouped": lambda layer, mlp, x, w, ids: layer.forward_grouped(x, w, ids, addend=mlp(x)),
        "all": lambda layer, mlp, x, w, ids: layer.forward_all_experts(x, w, ids, addend=mlp(x)),
    }
    rows, times = [], {}
    for name, fn in paths.items():
        times[name] = graph_us([lambda c=c, fn=fn: fn(*c) for c in calls])
        rows.append({"op": f"moe {name} T={tokens} E={experts} k={top_k}", "bytes": moved, "us": times[name]})
    best = min(times, key=times.get)
    print(f"moe T={tokens} E={experts} k={top_k}: " + ", ".join(f"{n} {t:.1f} us" for n, t in times.items())
          + f"; best {best}", flush=True)  # fmt: skip
    return rows


# (name, rows, dim): bench/decode_gpu.py's dense linears at decode (hidden 2304, 32 heads of 128, MLA rank
# 512 + rope 64, a dense MLP of 9216), its lm_head, and a Kimi-Linear vocabulary's
GEMV_SHAPES = [("kda qkv", 12288, 2304), ("kda f_a+g_a+b", 288, 2304), ("kda f_b", 4096, 128),
               ("o_proj", 2304, 4096), ("mla q", 6144, 2304), ("mla kv_a", 576, 2304),
               ("mlp gate_up", 18432, 2304), ("mlp down", 2304, 9216), ("lm_head", 32000, 2304),
               ("lm_head 163840", 163840, 2304)]  # fmt: skip


def bench_gemv(name: str, rows: int, dim: int, tokens: int, k_splits: tuple[int, ...] = ()) -> list[dict]:
    """A dense bf16 linear for a few tokens: what ``atom.ops.cuda.linear`` runs (the kernel of
    ``csrc/gemv.cu`` or cuBLAS, as ``use_kernel`` picks), the kernel forced with each of ``k_splits`` (0 =
    its own choice), and cuBLAS (``torch.matmul``), side by side. Event-timed and back to back in a CUDA
    graph over copies of the weights that together hold 4x L2 (as the engine's decode graphs run them)."""
    from atom.ops.cuda.linear import linear

    moved = (rows * dim + tokens * dim + tokens * rows) * 2
    out_rows = []

    def make_with(variant):
        def make():
            w = torch.randn(rows, dim, dtype=torch.bfloat16, device="cuda") * dim**-0.5
            x = torch.randn(tokens, dim, dtype=torch.bfloat16, device="cuda")
            if variant == "cublas":
                out = torch.empty(tokens, rows, dtype=torch.bfloat16, device="cuda")
                return lambda: torch.matmul(x, w.t(), out=out)
            if variant == "engine":
                return lambda: linear(x, w)
            return lambda: linear(x, w, k_split=variant, force=True)

        return make

    base = timings(make_with("cublas"), moved, graph=True)  # always graph-timed: what the engine sees
    out_rows.append({"op": f"cublas {name} N={rows} K={dim} T={tokens}", "bytes": moved, **base})
    for variant in ("engine", *k_splits):
        r = timings(make_with(variant), moved, graph=True)
        label = f"linear {name} N={rows} K={dim} T={tokens} " + (
            "engine" if variant == "engine" else f"gemv ks={variant}")
        out_rows.append({"op": label, "bytes": moved, **r})
        print(f"{label}: {r['graph_us']:.1f} us in a graph, cuBLAS {base['graph_us']:.1f} us: "
              f"{base['graph_us'] / r['graph_us']:.2f}x (event-timed {base['us'] / r['us']:.2f}x)",
              flush=True)  # fmt: skip
    return out_rows


def bench_blocks(C, num: int, block_bytes: int, gather: bool) -> dict:
    cache = torch.randint(0, 255, (num * 2, block_bytes), dtype=torch.uint8, device="cuda")
    staging = torch.empty(num, block_bytes, dtype=torch.uint8, device="cuda")
    ids = torch.randperm(num * 2, device="cuda")[:num].contiguous()
    fn = C.gather_blocks if gather else C.scatter_blocks

    def run():
        fn(cache.data_ptr(), block_bytes, ids.data_ptr(), num, staging.data_ptr(), block_bytes, stream())

    kind = "gather_blocks" if gather else "scatter_blocks"
    return {"op": f"{kind} n={num} x {block_bytes} B", "bytes": 2 * num * block_bytes, "us": time_us(run)}


def bench_copy_runs(C, tokens: int, gather: bool) -> dict:
    """One request's units of the decode bench model's 26 cache tensors (2 MLA latent caches of 16-token
    blocks, 6 KDA layers' recurrent and short-conv state slots) to or from one packed device buffer:
    the run list P/D's host buffer uses, launched through ``atom._C`` with a precomputed list."""
    from atom.ops import cache_ops

    num_blocks = tokens // 16
    tensors = [torch.randn(2 * num_blocks, 16, 576, device="cuda").to(torch.bfloat16) for _ in range(2)]
    for _ in range(6):
        tensors.append(torch.randn(2, 32, 128, 128, device="cuda"))
        tensors += [torch.randn(2, 4096, 3, device="cuda").to(torch.bfloat16) for _ in range(3)]
    blocks = torch.randperm(2 * num_blocks)[:num_blocks].tolist()
    parts = [(t, blocks if t.dim() == 3 and t.shape[1] == 16 else [1]) for t in tensors]
    starts, at = [], 0
    for t, ids in parts:
        starts.append(at)
        at += -(-len(ids) * t[0].numel() * t.element_size() // 16) * 16
    packed = torch.empty(at, dtype=torch.uint8, device="cuda")
    plan, ids = cache_ops.RunPlan.of_parts(parts)
    runs = torch.from_numpy(plan.run_list(ids, packed.data_ptr(), starts, gather)).cuda()

    def run():
        C.copy_runs(runs.data_ptr(), runs.shape[0], stream())

    kind = "gather" if gather else "scatter"
    return {"op": f"copy_runs {kind} {tokens} tokens, 26 tensors", "bytes": 2 * at, "us": time_us(run)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--only", help="run only ops whose name contains one of these, comma-separated (e.g. 'kda,conv')")
    p.add_argument("--flush", choices=("read", "write"), default="read",
                   help="how L2 is emptied before each timed launch (see above)")
    p.add_argument("--graph", action="store_true",
                   help="KDA and MLA decode also back to back in a CUDA graph, cold inputs (see above)")
    args = p.parse_args()
    C = get_C()
    if C is None or not torch.cuda.is_available():
        sys.exit("bench/kernels_gpu.py needs a CUDA GPU and a built atom._C")
    global FLUSH_MODE, GRAPH
    FLUSH_MODE, GRAPH = args.flush, args.graph

    ceiling, copy_us = copy_ceiling()
    print(f"device: {torch.cuda.get_device_name()}  SMs: {_num_sms(torch.device('cuda'))}")
    print(f"copy ceiling: {ceiling:.0f} GB/s read+write (1 GiB copy, {copy_us:.0f} us); L2 flushed by a {FLUSH_MODE}")
    batches = [1, 16, 64, 128] if not args.quick else [1, 64]
    mla_block, slot_bytes = 16 * 576 * 2, 32 * 128 * 128 * 4
    cases = [(f"kda_decode B={b} T=1", lambda b=b: bench_kda(C, b)) for b in batches]
    cases += [
        ("kda_decode B=64 T=3 per-token", lambda: bench_kda(C, 64, tokens=3, per_token=True)),
        ("kda_decode B=64 T=3", lambda: bench_kda(C, 64, tokens=3, per_token=False)),
    ]
    for ctx in (1024, 2048, 4096):
        cases += [(f"mla_decode B={b} ctx={ctx} bs=16", lambda b=b, c=ctx: bench_mla(C, b, c)) for b in batches]
        if triton is not None:  # the same bytes as the cache of B=64, read by a kernel that does nothing else
            cases.append((f"read B=64 ctx={ctx}", lambda c=ctx: bench_read(64 * c * 576 * 2, f"B=64 ctx={c} cache")))
    for k in (3, 5, 6, 7, 8):  # MlaKernel variants, forced
        for b in (16, 64, 128):
            cases.append((f"mla_decode B={b} ctx=4096 bs=16 k={k}", lambda b=b, k=k: bench_mla(C, b, 4096, kernel=k)))
    for ctx in (64, 256, 1024, 16384):  # the merge of splits in a cluster (8) against mla_combine_kernel (7)
        for k in (7, 8):
            cases.append((f"mla_decode B=64 ctx={ctx} bs=16 k={k}", lambda c=ctx, k=k: bench_mla(C, 64, c, kernel=k)))
    cases += [
        ("mla_decode B=64 ctx=4096 bs=64", lambda: bench_mla(C, 64, 4096, block_size=64)),
        ("mla_decode B=64 ctx=4096 bs=16 splits=1", lambda: bench_mla(C, 64, 4096, splits=1)),
        ("mla_decode B=64 ctx=4096 bs=16 splits=4", lambda: bench_mla(C, 64, 4096, splits=4)),
    ]
    # MLA decode as a decode graph runs it: splits sized for max_model_len (32768 here), against those for the
    # rows' own length (a row's tiles go to its first splits; the others are empty blocks and empty partials).
    sms = _num_sms(torch.device("cuda"))
    cases += [(f"mla_max_len B={b} ctx={c} {w}", lambda b=b, c=c, n=n: bench_mla(
        C, b, c, splits=choose_num_splits(b, 32, n, sms, True), graph=True))
        for b in (1, 4, 16, 64) for c in (256, 1024, 4096) for w, n in (("own", c), ("32768", 32768))]  # fmt: skip
    for dim, kv_heads in ((128, 8), (64, 8)):  # Llama-3-8B's attention; Llama-3.2-1B's
        cases += [(f"paged_decode B={b} ctx={c} D={dim}", lambda b=b, c=c, d=dim, k=kv_heads: bench_paged(
            C, b, c, kv_heads=k, dim=d)) for c in (256, 1024, 4096) for b in batches]  # fmt: skip
    # Splits forced past one wave (8 kv heads: 8 blocks a row), in a graph too: graphs choose splits by
    # max_model_len, so splits that help long rows must not cost short ones much (a row takes only the splits
    # that give each min_tiles tiles). "auto": the engine's choice for max_model_len 8192.
    forced = ((1, 1), (2, 16), (3, 16), (3, 8), (4, 16))
    cases += [(f"paged_splits D=128 B={b} ctx={c} s={s}/{t}", lambda b=b, c=c, s=s, t=t: bench_paged(
        C, b, c, splits=s, min_tiles=t, graph=True)) for b in (64, 96, 128, 192) for c in (128, 512, 1024, 2048, 8192)
        for s, t in forced]  # fmt: skip
    cases += [(f"paged_splits D={d} B={b} ctx={c} auto", lambda b=b, c=c, d=d: bench_paged(
        C, b, c, dim=d, graph=True, max_seq_len=8192)) for d in (128, 64) for b in (64, 128, 256)
        for c in (128, 1024, 4096)]  # fmt: skip
    cases += [(f"paged_splits D=64 B={b} ctx={c} s={s}/{t}", lambda b=b, c=c, s=s, t=t: bench_paged(
        C, b, c, dim=64, splits=s, min_tiles=t, graph=True)) for b in (128, 256) for c in (128, 1024, 4096)
        for s, t in forced[:3]]  # fmt: skip
    cases += [(f"paged_splits D=256 B={b} ctx={c} s={s}/{t}", lambda b=b, c=c, s=s, t=t: bench_paged(
        C, b, c, dim=256, splits=s, min_tiles=t, graph=True)) for b in (64, 96, 128) for c in (128, 512, 1024, 4096)
        for s, t in forced[:3]]  # fmt: skip
    for dim in (128, 64):  # Llama-3-8B's and Llama-3.2-1B's heads (32 and 8 kv)
        cases += [(f"paged_prefill {n}x{t} ctx={c} D={dim}", lambda n=n, t=t, c=c, d=dim: bench_paged_prefill(
            n, t, c, dim=d)) for n, t, c in ((64, 64, 0), (16, 512, 0), (4, 2048, 0), (1, 8192, 0), (1, 512, 3584),
                                             (16, 32, 1000), (2, 512, 0), (8, 256, 0), (4, 1024, 0), (1, 2048, 0),
                                             (32, 128, 0), (1, 128, 2000))]  # fmt: skip
    cases += [(f"mla_prefill {n}x{t} ctx={c}", lambda n=n, t=t, c=c: bench_mla_prefill(n, t, c))
              for n, t, c in ((1, 8192, 0), (8, 2048, 0), (32, 512, 0), (1, 2048, 6144), (64, 64, 0),
                              (16, 32, 1000))]  # fmt: skip
    cases += [(f"conv1d_update B={b}", lambda b=b: bench_conv(C, b)) for b in (1, 64)]
    cases += [(f"conv1d_prefill {n}x{t}", lambda n=n, t=t: bench_conv_prefill(n, t)) for n, t in ((1, 4000), (32, 250))]
    cases += [(f"kda_gate T={t}", lambda t=t: bench_kda_gate(C, t)) for t in (64, 1024, 8000)]
    cases += [(f"kda_gate_proj T={t}", lambda t=t: bench_kda_gate_proj(t)) for t in (1, 2, 4, 8, 16, 32, 64)]
    cases += [(f"moe_combine T={t}", lambda t=t: bench_moe_combine(C, t)) for t in (64, 1024, 8000)]
    cases += [(f"moe_align T={t} E={e}", lambda t=t, e=e, k=k: bench_moe_align(C, t, e, k))
              for t in (64, 1024, 8000) for e, k in ((16, 4), (256, 8))]  # fmt: skip
    cases += [(f"gated_rmsnorm rows={r}", lambda r=r: bench_norm(C, r)) for r in (64 * 32, 1 << 20)]
    cases += [(f"rms_norm rows={r} residual={a}", lambda r=r, a=a: bench_rms_norm(C, r, residual=a))
              for r in (64, 16384) for a in (False, True)]  # fmt: skip
    cases += [(f"router_logits T={t} E={e}", lambda t=t, e=e: bench_router(C, t, e))
              for e in (16, 256) for t in (1, 8, 64, 256)]  # the bench model's router; Kimi-Linear's
    cases += [(f"moe_route T={t} E={e} k={k}", lambda t=t, e=e, k=k: bench_moe_route(C, t, e, k))
              for e, k in ((16, 4), (256, 8)) for t in (1, 8, 64, 256)]  # fmt: skip
    for experts, top_k in ((256, 8), (16, 4)):  # Kimi-Linear's routing; bench/decode_gpu.py's model
        cases += [(f"moe_gemv T={t} E={experts}", lambda t=t, e=experts, k=top_k: bench_moe(t, e, k))
                  for t in (1, 2, 4, 8, 16, 32)]  # fmt: skip
    for experts, top_k in ((256, 8), (64, 6), (16, 4)):  # and DeepSeek-V2-Lite / Moonlight's routing
        cases += [(f"moe_paths T={t} E={experts}", lambda t=t, e=experts, k=top_k: bench_moe_paths(t, e, k))
                  for t in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)]  # fmt: skip
    cases += [(f"linear {n} T={t}", lambda n=n, r=r, d=d, t=t: bench_gemv(n, r, d, t))
              for n, r, d in GEMV_SHAPES for t in (1, 2, 4, 8)]  # fmt: skip
    cases += [(f"ksplit {n} T={t}", lambda n=n, r=r, d=d, t=t: bench_gemv(n, r, d, t, (0, 1, 2, 4, 8)))
              for n, r, d in GEMV_SHAPES[:8] for t in (1, 4)]  # fmt: skip
    for gather in (True, False):
        name = "gather_blocks" if gather else "scatter_blocks"
        cases.append((f"{name} mla", lambda g=gather: bench_blocks(C, 4096, mla_block, g)))
        cases.append((f"{name} state", lambda g=gather: bench_blocks(C, 64, slot_bytes, g)))
    for tokens in (4096, 65536):  # 21 and 162 MB: a P/D transfer's gather and scatter inside the GPU
        cases += [(f"copy_runs {tokens} gather={g}", lambda t=tokens, g=g: bench_copy_runs(C, t, g))
                  for g in (True, False)]  # fmt: skip
    wanted = args.only.split(",") if args.only else None
    rows = []
    for name, run in cases:
        if wanted is None or any(w in name for w in wanted):
            row = run()
            rows += row if isinstance(row, list) else [row]
    prefill = run_prefill([(8, 2048), (1, 8192), (32, 512)]) if wanted is None or "kda_prefill" in wanted else []

    graph_cols = f" {'graph us':>9} {'graph%':>6}" if GRAPH else ""
    print(f"\n{'op':<52} {'us':>9} {'MB':>9} {'GB/s':>7} {'ceil%':>6} {'TFLOP/s':>8}{graph_cols}")
    for r in rows:
        r["gbps"] = r["bytes"] / r["us"] / 1e3
        r["frac"] = r["gbps"] / ceiling
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'':8}"
        line = f"{r['op']:<52} {r['us']:9.1f} {r['bytes'] / 1e6:9.2f} {r['gbps']:7.0f} {100 * r['frac']:5.1f}% {tf}"
        if "graph_us" in r:
            r["graph_frac"] = r["bytes"] / r["graph_us"] / 1e3 / ceiling
            line += f" {r['graph_us']:9.1f} {100 * r['graph_frac']:5.1f}%"
        print(line.rstrip())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "ceiling_gbps": ceiling, "rows": rows,
                       "kda_prefill": prefill}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
