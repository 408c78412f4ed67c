"""The small fused kernels of ``csrc/fused.cu`` against their torch references.

GPU tests (skipped without CUDA and a built ``atom._C``): fresh random
inputs, the caching allocator's free memory filled with NaN first (the
wrappers allocate their outputs, which then start as NaN, so an unwritten
element shows), and the kernel compared with its ``*_ref`` run on the CPU in
the same dtypes: ||out - ref|| / ||ref|| < 1e-5 in fp32, < 1e-2 in bf16.
Integer outputs (expert ids, positions, group ends) must be exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.ops._C_loader import get_C
from atom.ops.cuda import fused, gated_rmsnorm, kda_decode
from atom.ops.cuda import reference as reference_ops
from tests.test_kernels_gpu import TOL, _poison, _rand, _slots, rel_err

HAS_KERNELS = torch.cuda.is_available() and get_C() is not None and hasattr(get_C(), "moe_align")
pytestmark = pytest.mark.skipif(not HAS_KERNELS, reason="needs a CUDA GPU and a built atom._C with csrc/fused.cu")
DTYPES = [torch.float32, torch.bfloat16]


def _poison_allocator() -> None:
    """Fill free cached GPU memory with NaN, so fresh torch.empty outputs start as NaN."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")  # 256 MiB
    del junk


def _cpu_and_gpu(*tensors):
    return [t.cpu() for t in tensors], [t.cuda() for t in tensors]


# dims for the vector kernel with 1, 2 and 4 16-byte vectors a thread (2304 in bf16: one; in fp32: two),
# and for the element loop: dims that are no multiple of a vector (100 in bf16, 33), or too long (20000)
RMS_SHAPES = [(1, 2304), (7, 100), (64, 2304), (300, 33), (5, 1000), (3, 2048), (4, 5000), (2, 7168), (2, 20000)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", RMS_SHAPES)
def test_rms_norm(dtype, rows, dim):
    x = (torch.randn(rows, dim) * 3).to(dtype)
    w = (torch.rand(dim) + 0.5).to(dtype)
    _poison_allocator()
    out = fused.rms_norm(x.cuda(), w.cuda(), 1e-6)
    assert rel_err(out, fused.rms_norm_ref(x, w, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", RMS_SHAPES)
def test_add_rms_norm(dtype, rows, dim):
    """The residual add fused into the norm: the sum bit-equal to torch's add, the norm within tolerance."""
    x, r = (torch.randn(rows, dim) * 3).to(dtype), torch.randn(rows, dim).to(dtype)
    w = (torch.rand(dim) + 0.5).to(dtype)
    _poison_allocator()
    out, total = fused.add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-6)
    assert torch.equal(total.cpu(), x + r)
    assert rel_err(out, fused.rms_norm_ref(x + r, w, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(dtype):
    """Rows of a wider tensor (a view with row stride > dim) are read in place."""
    wide = torch.randn(9, 160).to(dtype)
    w = torch.rand(96).to(dtype)
    _poison_allocator()
    out = fused.rms_norm(wide.cuda()[:, 10:106], w.cuda(), 1e-5)
    assert rel_err(out, fused.rms_norm_ref(wide[:, 10:106], w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,experts,dim", [(1, 16, 2304), (64, 16, 2304), (7, 5, 33), (3, 40, 1000), (5, 256, 7168), (2, 1, 20000),
                           (1, 256, 2304), (9, 256, 2304), (256, 256, 2304), (17, 7, 520), (5, 67, 520), (3, 99, 33)]
)
def test_router_logits(dtype, tokens, experts, dim):
    """x in the model dtype times the fp32 router weight, summed in fp32. The per-token kernel (fewer than 64
    experts, or more than 64 tokens): one expert split over lane groups (E = 1, 5, 7, 16) or several experts a
    group (E = 40, and 256 at 256 tokens). The spread kernel (blocks of 4 experts x 8 tokens): Kimi-Linear's
    256 x 2304 at 1 and 9 tokens, 67 and 99 experts (a partial block), dim 520 (threads without a vector).
    dim 33: the element path."""
    x, w = torch.randn(tokens, dim).to(dtype), torch.randn(experts, dim) * dim**-0.5
    _poison_allocator()
    out = fused.router_logits(x.cuda(), w.cuda())
    assert out.dtype == torch.float32
    assert rel_err(out, fused.router_logits_ref(x, w)) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1024), (5, 37), (64, 9216 // 2)])
def test_silu_mul(dtype, rows, width):
    x = (torch.randn(rows, 2 * width) * 2).to(dtype)
    _poison_allocator()
    out = fused.silu_mul(x.cuda())
    assert rel_err(out, fused.silu_mul_ref(x)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
# head dims a multiple of 8 take the 16-byte path; 7 and 20 (bf16/fp16) the element-by-element one
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 32, 128), (17, 3, 40), (64, 32, 128), (9, 5, 7), (6, 2, 20)])
def test_kda_gate(dtype, tokens, heads, head_dim):
    f = (torch.randn(tokens, heads * head_dim) * 8).to(dtype)  # some above 20: softplus's identity branch
    f[0, :5] = torch.tensor([25.0, 20.5, 19.5, -30.0, 0.0]).to(dtype)
    dt_bias = torch.randn(heads * head_dim)
    a_log = torch.empty(1, 1, heads, 1).uniform_(-3, 1).to(dtype)
    b = (torch.randn(tokens, heads + 5) * 3).to(dtype)[:, 2 : 2 + heads]  # strided rows
    _poison_allocator()
    g, beta = fused.kda_gate(f.cuda(), dt_bias.cuda(), a_log.cuda(), b.cuda(), head_dim)
    g_ref, beta_ref = fused.kda_gate_ref(f, dt_bias, a_log, b, head_dim)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == (tokens, heads, head_dim)
    # g is fp32 all the way from the same rounded inputs: fp32 tolerance in both dtypes
    assert rel_err(g, g_ref) < 1e-5
    assert rel_err(beta, beta_ref) < TOL[dtype]  # rounded to the model dtype: one ulp apart at worst


def _gate_proj_inputs(tokens: int, heads: int, head_dim: int, dim: int, dtype: torch.dtype, pad: int = 0):
    """kda_gate_proj's inputs as the layer passes them: f_a, g_a and b views into one [T, 2R + H (+ pad)] row
    (the layer's rows, 288 wide for Kimi-Linear, take 16-byte loads; pad 3 makes them too narrow for that)."""
    rows = (torch.randn(tokens, 2 * dim + heads + pad) * 2).to(dtype)
    f_a, g_a, b = rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim : 2 * dim + heads]
    # f = f_a w_f^T reaches past 20 (softplus's identity branch) for some channels
    w_f = (torch.randn(heads * head_dim, dim) * 8 * dim**-0.5).to(dtype)
    w_g = (torch.randn(heads * head_dim, dim) * dim**-0.5).to(dtype)
    dt_bias = torch.randn(heads * head_dim)
    a_log = torch.empty(1, 1, heads, 1).uniform_(-3, 1).to(dtype)
    return f_a, g_a, b, w_f, w_g, dt_bias, a_log


def _gate_proj_gpu(f_a, g_a, b, w_f, w_g, dt_bias, a_log, head_dim, rows=None):
    """kda_gate_proj on the GPU, with f_a, g_a and b views into one device tensor: the rows they were cut from
    (``rows``, or their base)."""
    rows_gpu = (f_a._base if rows is None else rows).cuda()
    dim, heads = f_a.shape[1], b.shape[1]
    f_a2, g_a2, b2 = rows_gpu[:, :dim], rows_gpu[:, dim : 2 * dim], rows_gpu[:, 2 * dim : 2 * dim + heads]
    return fused.kda_gate_proj(f_a2, g_a2, b2, w_f.cuda(), w_g.cuda(), dt_bias.cuda(), a_log.cuda(), head_dim)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
# Kimi-Linear's 32 heads of 128 from 128-wide inputs at 1-64 tokens (one to eight blocks of tokens), and at 3
# tokens in rows too narrow for 16-byte loads (the element loop); 3 x 40 channels, a partial block; inputs of 7
# and of 33 elements (the element loop) and R != K; 256-wide inputs (two vectors a lane in bf16)
@pytest.mark.parametrize("tokens,heads,head_dim,dim,pad", [(1, 32, 128, 128, 0), (2, 32, 128, 128, 0),
                                                           (3, 32, 128, 128, 3), (9, 32, 128, 128, 0),
                                                           (64, 32, 128, 128, 0), (5, 3, 40, 40, 0), (4, 5, 7, 7, 0),
                                                           (6, 2, 20, 33, 1), (17, 8, 16, 256, 0)])
def test_kda_gate_proj(dtype, tokens, heads, head_dim, dim, pad, monkeypatch):
    """The two up-projections and kda_gate in one kernel, against F.linear + kda_gate_ref on the CPU (the kernel
    forced past the token count where the engine stops using it)."""
    monkeypatch.setattr(fused, "KDA_GATE_PROJ_MAX_TOKENS", 64)
    inputs = _gate_proj_inputs(tokens, heads, head_dim, dim, dtype, pad)
    _poison_allocator()
    g, beta, gate = _gate_proj_gpu(*inputs, head_dim)
    g_ref, beta_ref, gate_ref = fused.kda_gate_proj_ref(*inputs, head_dim)
    assert g.shape == (tokens, heads, head_dim) and g.dtype == beta.dtype == torch.float32
    assert gate.shape == (tokens, heads * head_dim) and gate.dtype == dtype
    raw = F.linear(inputs[0], inputs[3]).float() + inputs[5]
    assert (raw > 20).any() and (raw < 20).any()  # both of softplus's branches
    # g comes from the projection rounded to the model dtype, whose last bit may differ with the summation order
    tol = TOL.get(dtype, 1e-2)
    assert rel_err(g, g_ref) < tol and rel_err(gate, gate_ref) < tol and rel_err(beta, beta_ref) < tol


def test_kda_gate_proj_token_does_not_depend_on_the_batch(monkeypatch):
    """A token's outputs are bit-equal alone, in a pair and among 11 others (one, two and eight tokens a block),
    in the layer's row layout."""
    monkeypatch.setattr(fused, "KDA_GATE_PROJ_MAX_TOKENS", 64)  # all three run the kernel, whatever the setting
    inputs = _gate_proj_inputs(12, 32, 128, 128, torch.bfloat16)
    rows = inputs[0]._base
    together = _gate_proj_gpu(*inputs, 128)
    for t in (0, 5, 11):
        first = min(t, 10)  # the pair starts here
        alone = _gate_proj_gpu(*inputs, 128, rows=rows[t : t + 1])
        pair = _gate_proj_gpu(*inputs, 128, rows=rows[first : first + 2])
        for a, p, full in zip(alone, pair, together):
            assert torch.equal(a[0], full[t]) and torch.equal(p[t - first], full[t])


def _kernels_run(fn) -> set[str]:
    """The names of the CUDA kernels fn() launched (by the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


def test_kda_gate_proj_runs_one_kernel_up_to_its_token_limit(monkeypatch):
    """Up to KDA_GATE_PROJ_MAX_TOKENS tokens one kernel; past it, or with the limit at 0, two linears and
    kda_gate, with the same results within tolerance."""
    limit = fused.KDA_GATE_PROJ_MAX_TOKENS
    for tokens, one_kernel in ((1, True), (limit, True), (limit + 3, False)):
        inputs = _gate_proj_inputs(tokens, 4, 128, 128, torch.bfloat16)
        outs = _gate_proj_gpu(*inputs, 128)
        names = _kernels_run(lambda inputs=inputs: _gate_proj_gpu(*inputs, 128))
        assert any("kda_gate_proj_kernel" in n for n in names) == one_kernel
        assert any("kda_gate_kernel" in n for n in names) == (not one_kernel)
        for out, ref in zip(outs, fused.kda_gate_proj_ref(*inputs, 128)):
            assert rel_err(out, ref) < TOL[torch.bfloat16]
    monkeypatch.setattr(fused, "KDA_GATE_PROJ_MAX_TOKENS", 0)
    names = _kernels_run(lambda: _gate_proj_gpu(*_gate_proj_inputs(1, 4, 128, 128, torch.bfloat16), 128))
    assert not any("kda_gate_proj_kernel" in n for n in names)


@pytest.mark.parametrize("tokens,experts,top_k,renorm", [(1, 16, 4, True), (64, 16, 4, True), (37, 256, 8, True),
                                                         (5, 40, 6, False), (3, 8, 1, True)])
def test_moe_route(tokens, experts, top_k, renorm):
    logits = torch.randn(tokens, experts) * 2
    bias = torch.randn(experts) * 0.1
    _poison_allocator()
    weights, ids = fused.moe_route(logits.cuda(), bias.cuda(), top_k, renorm, 2.5)
    w_ref, ids_ref = fused.moe_route_ref(logits, bias, top_k, renorm, 2.5)
    assert torch.equal(ids.cpu(), ids_ref)  # best first; random scores have no ties
    assert rel_err(weights, w_ref) < 1e-5


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 256, 8), (9, 256, 32), (4, 70, 20), (2, 33, 32)])
def test_moe_route_ties_go_to_the_lowest_id(tokens, experts, top_k):
    """Scores from a few values, so most picks tie: the lower expert id goes first, as in a stable sort. 32 picks
    (the kernel's most) of 256 experts take several from one lane; of 33 experts lane 0 holds two, the others one."""
    logits = torch.randint(-2, 3, (tokens, experts)).float()
    bias = torch.randint(-1, 2, (experts,)).float() * 0.25
    _poison_allocator()
    weights, ids = fused.moe_route(logits.cuda(), bias.cuda(), top_k, True, 1.0)
    scores = logits.sigmoid()
    expected = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids.cpu(), expected)
    picked = scores.gather(1, expected)
    assert rel_err(weights, picked / picked.sum(dim=-1, keepdim=True)) < 1e-5


# from 3072 pairs the tiled form (two launches, tiles of 2048 pairs): 4096 pairs and more here
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 16, 4), (64, 16, 4), (2000, 64, 6), (3, 1024, 2), (1024, 16, 4),
                                                  (8000, 256, 8), (3000, 1024, 1), (70000, 16, 4)])
def test_moe_align(tokens, experts, top_k):
    scores = torch.rand(tokens, experts)
    scores[:, : experts // 4] += 0.5  # skewed: some experts get no pair
    ids = scores.topk(top_k, dim=-1).indices
    _poison_allocator()
    src, pos, ends = fused.moe_align(ids.cuda(), experts)
    src_ref, pos_ref, ends_ref = fused.moe_align_ref(ids, experts)
    assert torch.equal(ends.cpu(), ends_ref)
    assert torch.equal(pos.cpu(), pos_ref) and torch.equal(src.cpu(), src_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,dim,with_addend", [(1, 4, 2304, True), (64, 4, 2304, False), (9, 3, 50, True)])
def test_moe_combine(dtype, tokens, top_k, dim, with_addend):
    y = torch.randn(tokens * top_k, dim).to(dtype)
    pos = torch.randperm(tokens * top_k)
    weights = torch.rand(tokens, top_k)
    addend = torch.randn(tokens, dim).to(dtype) if with_addend else None
    _poison_allocator()
    out = fused.moe_combine(y.cuda(), pos.cuda(), weights.cuda(), None if addend is None else addend.cuda())
    assert rel_err(out, fused.moe_combine_ref(y, pos, weights, addend)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,dim", [(64, 16, 4, 2304), (5, 7, 3, 50)])
def test_moe_combine_expert_major(dtype, tokens, experts, top_k, dim):
    """y holds every expert's output on every token (row e * T + t); pos holds the picked expert ids."""
    y = torch.randn(experts * tokens, dim).to(dtype)
    ids = torch.rand(tokens, experts).topk(top_k, dim=-1).indices
    weights, addend = torch.rand(tokens, top_k), torch.randn(tokens, dim).to(dtype)
    _poison_allocator()
    out = fused.moe_combine(y.cuda(), ids.cuda(), weights.cuda(), addend.cuda(), expert_major=True)
    rows = (ids * tokens + torch.arange(tokens).unsqueeze(1)).flatten()
    assert rel_err(out, fused.moe_combine_ref(y, rows, weights, addend)) < TOL[dtype]


# (tokens, experts, top_k, dim, inter): the bench model (E=16, k=4) and Kimi-Linear's k=8; tokens sharing
# experts (3 tokens of 4 experts, k=3); more picks than moe_gemv_down loads together (6, 9); one pick; an
# intermediate size that leaves a warp's second row past the end (40, 8 in fp32 / 5 in bf16 vectors);
# sizes no 16-byte vector divides (the element loops: dim 50, inter 37); more than 32 picks
MOE_GEMV_SHAPES = [(1, 16, 4, 2304, 1024), (4, 32, 8, 2304, 1024), (3, 4, 3, 256, 40), (2, 12, 9, 128, 96),
                   (5, 7, 6, 64, 48), (2, 5, 1, 64, 16), (5, 7, 3, 50, 37), (2, 40, 35, 64, 16)]


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k,dim,inter", MOE_GEMV_SHAPES)
@pytest.mark.parametrize("extra", ["none", "addend", "shared", "wider shared"])
def test_moe_gemv(dtype, tokens, experts, top_k, dim, inter, extra):
    """Routed experts alone, plus an addend, plus a shared expert of the routed experts' size or twice it."""
    gate_up = (torch.randn(experts, 2 * inter, dim) * dim**-0.5).to(dtype)
    down = (torch.randn(experts, dim, inter) * inter**-0.5).to(dtype)
    wide = torch.randn(tokens, dim + 8).to(dtype)  # x at a row stride other than its width
    x = wide[:, 8:]
    ids = torch.rand(tokens, experts).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k) + 0.1
    addend = torch.randn(tokens, dim).to(dtype) if extra == "addend" else None
    shared = None
    if "shared" in extra:
        s_inter = inter * (2 if extra == "wider shared" else 1)
        shared = ((torch.randn(2 * s_inter, dim) * dim**-0.5).to(dtype),
                  (torch.randn(dim, s_inter) * s_inter**-0.5).to(dtype))  # fmt: skip
    _, (gx, gw, gi) = _cpu_and_gpu(wide, weights, ids)
    _poison_allocator()
    out = fused.moe_gemv(gx[:, 8:], gw, gi, gate_up.cuda(), down.cuda(), None if addend is None else addend.cuda(),
                         None if shared is None else (shared[0].cuda(), shared[1].cuda()))  # fmt: skip
    ref = fused.moe_gemv_ref(x, weights, ids, gate_up, down, addend, shared)
    assert ref.abs().max() > 0 and out.shape == ref.shape
    assert rel_err(out, ref) < TOL.get(dtype, 1e-2)


def test_moe_gemv_reads_only_the_picked_experts():
    """NaN in every expert no token picked changes nothing; NaN in a picked expert reaches its token only."""
    gate_up, down = torch.randn(8, 64, 128).cuda(), torch.randn(8, 128, 32).cuda()
    ids = torch.tensor([[0, 2], [2, 5], [7, 5]]).cuda()
    weights, x = (torch.rand(3, 2) + 0.1).cuda(), torch.randn(3, 128).cuda()
    before = fused.moe_gemv(x, weights, ids, gate_up, down)
    for e in (1, 3, 4, 6):
        gate_up[e], down[e] = float("nan"), float("nan")
    assert torch.equal(fused.moe_gemv(x, weights, ids, gate_up, down), before)
    down[7] = float("nan")  # picked by token 2 only
    after = fused.moe_gemv(x, weights, ids, gate_up, down)
    assert torch.isnan(after[2]).all() and torch.equal(after[:2], before[:2])


@pytest.mark.parametrize("n,width,block_size", [(1, 4, 16), (11, 16, 4), (300, 320, 1)])
def test_advance_decode(n, width, block_size):
    """The decode buffers one step on: columns < n exactly as the reference moves them, the rest untouched."""
    gen = torch.Generator().manual_seed(n)
    tables = torch.randint(0, 5000, (width, 40), generator=gen)
    rows = torch.randint(-1, 1000, (7, width), generator=gen)
    # positions whose next one still has a block in the 40-column tables
    rows[fused.POSITIONS] = torch.randint(0, 40 * block_size - 1, (width,), generator=gen)
    next_ids = torch.randint(0, 32000, (n,), generator=gen)
    got_rows, got_tables = rows.cuda(), tables.cuda()
    fused.advance_decode(got_rows, got_tables, next_ids.cuda(), block_size)
    fused.advance_decode_ref(rows, tables, next_ids, block_size)
    assert torch.equal(got_rows.cpu(), rows) and torch.equal(got_tables.cpu(), tables)


@pytest.mark.parametrize("n,width,size", [(1, 2, 1), (7, 4, 8), (300, 4, 512), (33, 9, 40)])
def test_pack_verification(n, width, size):
    """A verification step's outcome in one tensor: each row's targets, its accepted count (rows with 0 .. k of
    their own drafts, junk past them; every accepted count) and its next drafts (columns < n of a wider tensor)."""
    gen = torch.Generator().manual_seed(n)
    k = width - 1
    rows = torch.randint(-1, 1000, (7, size * width + 5), generator=gen)
    targets = torch.randint(0, 6, (n, width), generator=gen)
    inputs = torch.randint(0, 6, (n, width), generator=gen)  # few ids: junk drafts equal the targets often too
    runs = torch.arange(n) % width  # row r's drafts equal the targets before them for at least runs[r] columns
    for r, run in enumerate(runs.tolist()):
        inputs[r, 1 : 1 + run] = targets[r, :run]
    rows[fused.INPUT_IDS, : n * width] = inputs.flatten()
    own = runs + (torch.rand(n, generator=gen) * (width - runs)).long()  # each row's drafts (>= its run)
    lens = torch.where(torch.arange(width) <= own.unsqueeze(1), torch.randint(1, 99, (n, width), generator=gen), 0)
    rows[fused.SEQ_LENS, : n * width] = lens.flatten()  # past a row's drafts seq_len 0
    drafts = torch.randint(0, 32000, (k, size), generator=gen)
    got = fused.pack_verification(rows.cuda(), targets.flatten().cuda(), drafts.cuda()[:, :n], width)
    want = fused.pack_verification_ref(rows, targets.flatten(), drafts[:, :n], width)
    assert torch.equal(got.cpu(), want)
    if n >= width:
        assert set(want[n * width : n * (width + 1)].tolist()) == set(range(width))  # 0 .. k accepted


@pytest.mark.parametrize("m,n_prev,width,block_size", [(1, 1, 2, 16), (5, 9, 4, 4), (64, 64, 4, 16), (37, 50, 7, 1)])
def test_settle_verification(m, n_prev, width, block_size):
    """Rows planned while the step before ran, made right from its outcome: inputs, positions, lengths, cache
    slots and state slots exactly as the reference moves them (rows in any order, some without a state slot),
    every other column untouched."""
    gen = torch.Generator().manual_seed(m)
    size = m + 3
    rows = torch.randint(-1, 1000, (7, size * width + 2), generator=gen)
    tables = torch.randint(0, 5000, (size, 40), generator=gen)
    # positions as planned (every draft accepted): far enough in that moving back stays >= 0, within the tables
    rows[fused.POSITIONS] = torch.randint(width, 40 * block_size - width, (rows.shape[1],), generator=gen)
    rows[fused.STATE_SLOTS, :size] = torch.where(torch.rand(size, generator=gen) < 0.2, -1,
                                                 torch.randint(width, 500, (size,), generator=gen))  # fmt: skip
    accepted = torch.randint(0, width, (n_prev,), generator=gen)
    packed = torch.cat((torch.randint(0, 32000, (n_prev * width,), generator=gen), accepted,
                        torch.randint(0, 32000, ((width - 1) * n_prev,), generator=gen)))  # fmt: skip
    here = torch.randperm(size, generator=gen)[:m]
    there = torch.randint(0, n_prev, (m,), generator=gen)
    planned = accepted[there] + torch.randint(0, width, (m,), generator=gen).clamp(max=width - 1 - accepted[there])
    index = torch.cat((here, there, planned))
    got_rows, got_tables = rows.cuda(), tables.cuda()
    fused.settle_verification(got_rows, got_tables, index.cuda(), packed.cuda(), n_prev, width, block_size)
    fused.settle_verification_ref(rows, tables, index, packed, n_prev, width, block_size)
    assert torch.equal(got_rows.cpu(), rows) and torch.equal(got_tables.cpu(), tables)



@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (64, 4), (300, 7)])
def test_accept_drafts(n, k, sampled):
    """Each row's accepted drafts, next token and targets: rows of 0 .. k own drafts (junk past them), each
    accepted count from 0 to its own drafts, drafts in a wider tensor and draws a column of one; exactly as the
    reference on the same device (the same exp)."""
    gen = torch.Generator().manual_seed(n * 10 + k)
    counts = torch.arange(n) % (k + 1)
    runs = (torch.rand(n, generator=gen) * (counts + 1)).long()  # drafts that hold before the first that fails
    firsts = torch.cat((torch.zeros(1, dtype=torch.long), (counts + 1).cumsum(0)))
    rows = int(firsts[-1])
    at = firsts[:-1].unsqueeze(1) + torch.minimum(torch.arange(k + 1), counts.unsqueeze(1))
    proposed = torch.randint(0, 6, (n, k + 2), generator=gen)  # few ids: junk drafts equal the tokens often too
    tokens = torch.randint(0, 6, (rows,), generator=gen)
    probs = torch.rand(rows, generator=gen)
    draws = torch.empty(rows, 9).exponential_(generator=gen).clamp_min(1e-3)
    for r in range(n):
        for j in range(int(runs[r])):
            tokens[at[r, j]], probs[at[r, j]] = proposed[r, j], 1.0
        if runs[r] < counts[r]:  # the check after the run fails
            row = at[r, runs[r]]
            tokens[row] = proposed[r, runs[r]] + 1
            probs[row] = 0.0
    args = [t.cuda() for t in (tokens, at, proposed[:, :k], counts)]
    extra = [probs.cuda(), draws.cuda()[:, -1]] if sampled else []
    _poison_allocator()
    got = fused.accept_drafts(*args, *extra)
    want = fused.accept_drafts_ref(*args, *extra)
    assert torch.equal(got, want)
    assert torch.equal(got[:n].cpu(), runs)  # the runs built above, so every count from 0 to k comes

def test_router_logits_token_alone_or_in_a_batch_same_bits():
    """A token's logits do not depend on the tokens launched with it (its sums' order depends on the shapes)."""
    x, w = torch.randn(11, 2304).to(torch.bfloat16).cuda(), (torch.randn(256, 2304) * 2304**-0.5).cuda()
    batch = fused.router_logits(x, w)
    for t in (0, 5, 8, 10):
        assert torch.equal(fused.router_logits(x[t : t + 1], w), batch[t : t + 1])


def test_router_logits_unaligned_rows():
    """Rows of a wider tensor, offset so no row is 16-byte aligned: the element-by-element path."""
    wide, w = torch.randn(5, 2310).to(torch.bfloat16), torch.randn(16, 2304) * 2304**-0.5
    _poison_allocator()
    out = fused.router_logits(wide.cuda()[:, 3:2307], w.cuda())
    assert rel_err(out, fused.router_logits_ref(wide[:, 3:2307], w)) < 1e-5


def test_programmatic_launch_keeps_a_long_chain_in_order():
    """300 dependent kernels (gemv, rms_norm, silu_mul and a residual add in turn, each reading the one
    before's output and writing a buffer the one before read) in a CUDA graph: bit-equal with programmatic
    dependent launch on and off, and to the same chain run eagerly without it."""
    from atom.ops.cuda.linear import linear

    C = get_C()
    gen = torch.Generator().manual_seed(0)
    w_up = (torch.randn(2048, 512, generator=gen) * 512**-0.5).to(torch.bfloat16).cuda()
    w_down = (torch.randn(512, 1024, generator=gen) * 1024**-0.5).to(torch.bfloat16).cuda()
    norm = (torch.rand(512, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    x0 = torch.randn(4, 512, generator=gen).to(torch.bfloat16).cuda()

    def chain(x):
        for _ in range(75):
            h, x = fused.add_rms_norm(x, x0, norm, 1e-6)
            x = linear(fused.silu_mul(linear(h, w_up, force=True)), w_down, force=True)
        return x

    def captured(on: bool) -> torch.Tensor:
        C.set_programmatic_launch(on)
        static = x0.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain(static)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    initial = C.programmatic_launch()
    try:
        C.set_programmatic_launch(False)
        eager = chain(x0.clone())
        torch.cuda.synchronize()
        results = [captured(True), captured(False), captured(True)]
    finally:
        C.set_programmatic_launch(initial)
    assert eager.isfinite().all() and eager.abs().max() > 0
    assert all(torch.equal(r, eager) for r in results)


# ---- kda_decode with KDA's output norm (csrc/kda.cu) -----------------------------------------------------------

# (B, T, H, K, V, slot mode, whether the kernel applies the norm)
KDA_NORM_CASES = [
    (1, 1, 32, 128, 128, "inplace", True),  # Kimi-Linear's decode at batch 1
    (6, 1, 3, 64, 128, "moved", True),  # K = 64, a padding row, states to other slots
    (4, 3, 2, 128, 128, "per_token", True),  # 1 + 2 speculative tokens, a state after each
    (3, 1, 2, 128, 200, "inplace", False),  # V != 128: kda_decode, then gated_rmsnorm
    (5, 2, 2, 48, 128, "moved", False),  # the generic kernel (K = 48)
]


def _kda_norm_inputs(B, T, H, K, V, mode, dtype):
    torch.manual_seed(B * 100 + T * 10 + K + V)
    cpu = [_rand(B, T, H, K, dtype=dtype), _rand(B, T, H, K, dtype=dtype), _rand(B, T, H, V, dtype=dtype),
           -torch.rand(B, T, H, K) * 0.5, torch.rand(B, T, H)]  # fmt: skip
    num_slots, ins, outs, per_token, read, written = _slots(B, T, mode, pad_row=B - 1 if B > 2 else None)
    pool = _rand(num_slots, H, K, V, scale=0.1)
    _poison(pool, read, written)
    has_init = torch.rand(B) > 0.3
    gate = _rand(B * T, H * V, dtype=dtype).view(B, T, H, V)  # the layer's [tokens, H * V] gate
    weight = (1 + 0.1 * _rand(V)).to(dtype)
    slots = dict(state_slots=ins, out_slots=outs, per_token=per_token, has_initial_state=has_init)
    return cpu, pool, slots, gate, weight


def _kda_decode_gpu(cpu, pool, slots, out_norm=None):
    gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in slots.items()}
    norm = None if out_norm is None else (out_norm[0].cuda(), out_norm[1].cuda(), out_norm[2])
    ins = gpu.pop("state_slots")
    return kda_decode(*(t.cuda() for t in cpu), pool, ins, **gpu, out_norm=norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, H, K, V, mode, in_kernel", KDA_NORM_CASES)
def test_kda_decode_with_the_output_norm(dtype, B, T, H, K, V, mode, in_kernel):
    """out_norm gives gated_rmsnorm(kda_decode(...)) bit for bit and the same states, whether the kernel
    applies it or it runs after; and matches the CPU reference within tolerance."""
    cpu, pool, slots, gate, weight = _kda_norm_inputs(B, T, H, K, V, mode, dtype)
    _poison_allocator()
    pool_two, pool_one = pool.cuda(), pool.cuda()
    two = gated_rmsnorm(_kda_decode_gpu(cpu, pool_two, slots), gate.cuda(), weight.cuda(), 1e-5)
    one = _kda_decode_gpu(cpu, pool_one, slots, (gate, weight, 1e-5))
    assert not one.isnan().any()
    assert torch.equal(one, two)
    assert torch.equal(pool_one.nan_to_num(7.0), pool_two.nan_to_num(7.0))
    expected_pool = pool.clone()
    o = reference_ops.kda_decode_ref(*cpu, expected_pool, slots["state_slots"], slots["out_slots"], slots["per_token"],
                           slots["has_initial_state"])  # fmt: skip
    assert rel_err(one, reference_ops.gated_rmsnorm_ref(o, gate, weight, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("B, T, H, K, V, mode, in_kernel", KDA_NORM_CASES)
def test_kda_decode_runs_one_kernel_with_the_output_norm(B, T, H, K, V, mode, in_kernel):
    """Where the kernel can apply the norm, kda_decode with out_norm is one launch; elsewhere two."""
    cpu, pool, slots, gate, weight = _kda_norm_inputs(B, T, H, K, V, mode, torch.bfloat16)
    names = _kernels_run(lambda: _kda_decode_gpu(cpu, pool.cuda(), slots, (gate, weight, 1e-5)))
    assert any("kda_decode" in n for n in names)
    assert any("gated_rmsnorm" in n for n in names) == (not in_kernel)
