"""Where a decode step's time goes on the GPU, per batch size.

    python bench/profile_decode_gpu.py --ckpt /tmp/atom_kimi_1p3b     # the checkpoint bench/decode_gpu.py writes
    python bench/profile_decode_gpu.py --shape 48b --batches 1,64     # Kimi-Linear-48B-A3B's shape, random weights

For each batch: the engine's decode step time (as bench/decode_gpu.py
measures it, with and without async scheduling), the GPU time of one
replayed decode graph (the forward, the lm_head and the argmax), the copy of
its tokens to the host, and what is left (the host: scheduling, inputs,
outputs). Then the top kernels inside one replayed graph by GPU time.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ms_per_call(fn, n: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def _step_ms(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from atom import SamplingParams

    def run(n: int) -> None:
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)
    # the median of three (1 + new_tokens) - 1 token differences: one run that stalls (a stall of the
    # host, say) moves one difference, not the figure
    diffs = sorted((timed(1 + new_tokens) - timed(1)) / new_tokens * 1e3 for _ in range(3))
    if diffs[-1] > 1.5 * diffs[0]:
        print(f"   (step times of three runs spread: {', '.join(f'{d:.3f}' for d in diffs)} ms)")
    return diffs[1]


def profile_batch(path: str, batch: int, new_tokens: int, top: int, load_format: str = "auto") -> None:
    from atom import LLM

    prompts = torch.randint(3, 32000, (batch, 64), generator=torch.Generator().manual_seed(0)).tolist()
    kwargs = dict(dtype="bfloat16", device="cuda", max_num_seqs=batch, max_model_len=64 + new_tokens + 8,
                  max_num_batched_tokens=max(2048, batch * 64), enable_prefix_caching=False,
                  load_format=load_format)  # fmt: skip
    def fresh_llm(async_scheduling: bool):
        gc.collect()  # the engine before must give its memory back first (98 GB at --shape 48b)
        torch.cuda.empty_cache()
        return LLM(path, async_scheduling=async_scheduling, **kwargs)

    llm = fresh_llm(False)
    step = _step_ms(llm, prompts, new_tokens)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    size = next(s for s in graphs.sizes if s >= batch)
    replay = _ms_per_call(lambda: graphs._launch(size))
    enqueue, device_ms = _replay_split(graphs, size)
    greedy = graphs._launch(size).greedy[:batch]
    sample = _ms_per_call(lambda: greedy.tolist())
    llm = runner = graphs = greedy = None  # the engine goes (not del: a lambda above reads greedy)
    overlapped = _step_ms(fresh_llm(True), prompts, new_tokens)
    host = step - replay - sample
    print(f"== batch {batch} (graph size {size}): step {step:.3f} ms ({batch / step * 1e3:.0f} tok/s), "
          f"async scheduling {overlapped:.3f} ms ({batch / overlapped * 1e3:.0f} tok/s); "
          f"graph replay {replay:.3f} ms, tokens to the host {sample:.3f} ms, rest (host) {host:.3f} ms",
          flush=True)  # fmt: skip
    print(f"   one replay: host enqueue {enqueue:.3f} ms, device time between events {device_ms:.3f} ms")

    llm = fresh_llm(False)
    _step_ms(llm, prompts, new_tokens)  # the static buffers now hold a real step's rows (padding rows skip KDA/MLA)
    graphs = llm.engine.runner.decode_graphs
    graphs._launch(size)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graphs._launch(size)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    print(f"   kernels in one replay: {sum(e.count for e in events) // 10}, GPU time {total / 10 / 1e3:.3f} ms")
    for e in events[:top]:
        print(f"   {e.self_device_time_total / 10:9.1f} us {e.self_device_time_total / total:6.1%} "
              f"x{e.count // 10:<4d} {e.key[:90]}")  # fmt: skip
    _print_gaps(prof, top)
    module_times(llm, batch)


def _replay_split(graphs, size: int, n: int = 50) -> tuple[float, float]:
    """Host time to enqueue one replay (no sync), and the device time of one replay between CUDA events."""
    graphs._launch(size)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        graphs._launch(size)
    enqueue = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs._launch(size)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return enqueue, sorted(times)[len(times) // 2]


def _print_gaps(prof, top: int) -> None:
    """Idle device time between consecutive kernels of the last replay, and the largest gaps by neighbours."""
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    per_replay = len(kernels) // 10
    last = kernels[-per_replay:]
    span = last[-1].time_range.end - last[0].time_range.start
    gaps = [(b.time_range.start - a.time_range.end, a.name, b.name) for a, b in zip(last, last[1:])]
    idle = sum(max(g, 0.0) for g, _, _ in gaps)
    whole = kernels[-1].time_range.end - kernels[0].time_range.start
    print(f"   last replay: span {span:.1f} us, idle between kernels {idle:.1f} us over {len(gaps)} gaps; "
          f"10 replays span {whole / 10:.1f} us each")
    for gap, before, after in sorted(gaps, reverse=True)[: max(top // 2, 3)]:
        print(f"   gap {gap:7.1f} us after {before[:60]} -> before {after[:60]}")


def module_times(llm, batch: int, depth: int = 3) -> None:
    """Device time of each module inside one replayed decode graph, from timing events recorded as
    graph nodes (external CUDA events) around every module down to ``depth`` under the layers;
    unlike a profiler, this leaves the graph's execution as it is. Replays the static buffers'
    current rows (run a real step first: padding rows skip the KDA and MLA work)."""
    graphs = llm.engine.runner.decode_graphs
    size = next(s for s in graphs.sizes if s >= batch)
    model = llm.engine.runner.model
    marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    hooks = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if "layers" not in parts or parts[-1] == "layers" or len(parts) - parts.index("layers") - 1 > depth:
            continue
        start, end = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
        marks.append((name, start, end))
        hooks.append(module.register_forward_pre_hook(lambda m, a, e=start: e.record()))
        hooks.append(module.register_forward_hook(lambda m, a, o, e=end: e.record()))
    first, last = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        graphs._forward(size)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            first.record()
            graphs._forward(size)
            last.record()
    for h in hooks:
        h.remove()
    samples: dict[str, list[float]] = {}
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        samples.setdefault("(whole forward)", []).append(first.elapsed_time(last) * 1e3)
        for name, start, end in marks:
            try:
                us = start.elapsed_time(end) * 1e3
            except (RuntimeError, ValueError):  # a module the decode forward never calls: no events
                continue
            samples.setdefault(name, []).append(us)
    median = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    print(f"   module device times (graph size {size}), median of 20 replays, us")
    by_kind: dict[str, float] = {}
    for name, us in median.items():
        parts = name.split(".")
        if "layers" in parts:
            kind = ".".join(parts[parts.index("layers") + 2 :]) + f" [{type(model.get_submodule(name)).__name__}]"
            by_kind[kind] = by_kind.get(kind, 0.0) + us
    print(f"   {median['(whole forward)']:9.1f}  (whole forward)")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"   {us:9.1f}  {kind} (summed over layers)")
    for name, us in median.items():
        if name.split(".")[-2:-1] == ["layers"]:  # each decoder layer as a whole
            print(f"   {us:9.1f}  {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["1.3b", "48b"], default="1.3b",
                   help="bench/decode_gpu.py's model shapes; 48b: Kimi-Linear-48B-A3B's, random weights")
    p.add_argument("--ckpt", help="model folder (default: /tmp/atom_kimi_1p3b, /tmp/atom_kimi_48b)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    from bench.decode_gpu import make_model, model_config

    args.ckpt = args.ckpt or {"1.3b": "/tmp/atom_kimi_1p3b", "48b": "/tmp/atom_kimi_48b"}[args.shape]
    load_format = "dummy" if args.shape == "48b" else "auto"
    if args.shape == "48b":
        model_config("48b").save_pretrained(args.ckpt)
    elif not os.path.exists(os.path.join(args.ckpt, "config.json")):
        make_model(args.ckpt)
        torch.cuda.empty_cache()
    for batch in (int(b) for b in args.batches.split(",")):
        profile_batch(args.ckpt, batch, args.output_len, args.top, load_format)


if __name__ == "__main__":
    main()
