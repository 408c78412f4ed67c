# Scratch (session 11, reverted): a Triton kernel that only reads B=64 x ctx x 576 bf16 (the MLA cache bytes),
# timed like bench/kernels_gpu.py (L2 flushed; event and CUDA graph). python3 scripts/read_bound.py
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import kernels_gpu as K
K.GRAPH = True

@triton.jit
def read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(v.to(tl.float32), axis=0))

ceil, _ = K.copy_ceiling(); print(f"ceiling {ceil:.0f}")
for rnd in range(2):
    for ctx in (1024, 1536, 2048, 4096):
        n = 64 * ctx * 576
        best = None
        for BLOCK, warps in ((4096, 4), (8192, 8), (16384, 8), (16384, 16)):
            def make(BLOCK=BLOCK, warps=warps):
                x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
                grid = triton.cdiv(n, BLOCK)
                out = torch.empty(grid, dtype=torch.float32, device="cuda")
                return lambda: read_sum[(grid,)](x, out, n, BLOCK=BLOCK, num_warps=warps)
            r = K.timings(make, 2 * n)
            print(f"r{rnd} triton read B=64 x {ctx} ({2*n/1e6:.1f} MB) BLOCK {BLOCK} warps {warps}: ev {r['us']:.1f} us {100*2*n/r['us']/1e3/ceil:.1f}%  graph {r['graph_us']:.1f} us {100*2*n/r['graph_us']/1e3/ceil:.1f}%", flush=True)
