"""``atom.ops.cuda.linear`` (``csrc/gemv.cu``) against ``F.linear``.

GPU tests (skipped without CUDA and a built ``atom._C`` with the kernel): fresh
random inputs, the allocator's free memory filled with NaN first (an unwritten
output element shows), and the kernel compared with ``linear_ref`` run on the
CPU in the same dtype: ||out - ref|| / ||ref|| < 1e-5 in fp32, < 1e-2 in bf16
and fp16. The CPU test checks the fallback.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.ops._C_loader import get_C
from atom.ops.cuda import linear as linear_mod
from atom.ops.cuda.linear import linear, linear_ref
from tests.test_fused_kernels_gpu import _kernels_run, _poison_allocator
from tests.test_kernels_gpu import rel_err

HAS_KERNEL = torch.cuda.is_available() and get_C() is not None and hasattr(get_C(), "gemv")
gpu = pytest.mark.skipif(not HAS_KERNEL, reason="needs a CUDA GPU and a built atom._C with csrc/gemv.cu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _inputs(tokens: int, rows: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    w = (torch.randn(rows, dim, generator=gen) * dim**-0.5).to(dtype)
    b = torch.randn(rows, generator=gen).to(dtype)
    return x, w, b


# (rows, dim): the bench model's shapes (KDA's qkv and gate inputs, the low-rank f_b at dim 128, o_proj);
# one row; rows that leave a warp's second row past the end (7, 33); dims no 16-byte vector divides (100 in
# bf16, 33, 1); a dim shorter than one vector a lane (8)
SHAPES = [(12288, 2304), (288, 2304), (4096, 128), (2304, 4096), (1, 512), (7, 96), (33, 100), (65, 33),
          (40, 1), (300, 8)]  # fmt: skip


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,dim", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_kernel_matches_reference(dtype, rows, dim, tokens):
    x, w, b = _inputs(tokens, rows, dim, dtype)
    for bias in (None, b):
        _poison_allocator()
        out = linear(x.cuda(), w.cuda(), None if bias is None else bias.cuda(), force=True)
        assert out.shape == (tokens, rows) and out.dtype == dtype
        assert rel_err(out, linear_ref(x, w, bias)) < TOL[dtype]


@gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 5, 7, 9, 17])
@pytest.mark.parametrize("k_split", [0, 1, 2, 4, 8])
def test_every_token_count_and_k_split(tokens, k_split):
    """Every launch width (1, 2, 4, 8 tokens), several launches past eight, and each k_split forced."""
    x, w, b = _inputs(tokens, 600, 1032, torch.bfloat16, seed=tokens)  # 129 vectors a row: a ragged last pass
    _poison_allocator()
    out = linear(x.cuda(), w.cuda(), b.cuda(), k_split=k_split, force=True)
    assert rel_err(out, linear_ref(x, w, b)) < 1e-2


@gpu
def test_a_token_gets_the_same_bits_in_any_launch():
    """A token's sums run in the same order whatever else is in the launch: its output row is bit-equal
    alone, in a batch of 2 and in a batch of 11 (a launch of 8 and one of 3); runs repeat bit for bit."""
    x, w, b = (t.cuda() for t in _inputs(11, 2304, 4096, torch.bfloat16))
    batch = linear(x, w, b, force=True)
    assert torch.equal(linear(x, w, b, force=True), batch)
    for t in range(11):
        assert torch.equal(linear(x[t], w, b), batch[t])
        assert torch.equal(linear(x[[t, (t + 5) % 11]], w, b, force=True)[0], batch[t])
    assert torch.equal(linear(x[8:], w, b, force=True), batch[8:])


def _runs_kernel(fn) -> bool:
    """Whether fn() launched csrc/gemv.cu's kernel (by the CUDA kernels the profiler saw)."""
    return any("gemv_kernel" in name for name in _kernels_run(fn))


@gpu
def test_which_linears_run_the_kernel(monkeypatch):
    """One token: the kernel for any matrix. 2 to GEMV_MAX_TOKENS tokens: the kernel for a matrix of at
    most GEMV_SMALL_WEIGHT elements, F.linear for a larger one. More tokens, or the limit at 0: F.linear."""
    big = torch.randn(linear_mod.GEMV_SMALL_WEIGHT // 256 + 1, 256, dtype=torch.bfloat16).cuda()
    small = big[:300]
    x = torch.randn(linear_mod.GEMV_MAX_TOKENS + 1, 256, dtype=torch.bfloat16).cuda()
    few = x[: linear_mod.GEMV_MAX_TOKENS]
    assert _runs_kernel(lambda: linear(x[:1], big))
    assert _runs_kernel(lambda: linear(few, small))
    assert not _runs_kernel(lambda: linear(few, big))
    assert not _runs_kernel(lambda: linear(x, small))
    assert torch.equal(linear(few, big), F.linear(few, big))
    monkeypatch.setattr(linear_mod, "GEMV_MAX_TOKENS", 0)
    assert not _runs_kernel(lambda: linear(x[:1], big))


@gpu
def test_shapes_strides_and_fallbacks():
    """x as [..., dim] (the leading dims kept), a row-strided x (aligned and not), a 1-d x; a transposed
    weight and mixed dtypes take F.linear."""
    x, w, b = _inputs(6, 300, 256, torch.float32)
    gx, gw, gb = x.cuda(), w.cuda(), b.cuda()
    out = linear(gx.view(2, 3, 256), gw, gb, force=True)
    assert out.shape == (2, 3, 300) and rel_err(out.view(6, 300), linear_ref(x, w, b)) < 1e-5
    wide = torch.randn(6, 300).cuda()
    for start in (20, 21):  # rows 16-byte aligned (vector loads), and not (element loads)
        wide[:, start : start + 256] = gx
        assert rel_err(linear(wide[:, start : start + 256], gw, gb, force=True), linear_ref(x, w, b)) < 1e-5
    assert rel_err(linear(gx[2], gw), linear_ref(x[2], w)) < 1e-5
    wt = torch.randn(256, 300).cuda().t()  # [300, 256], not row-contiguous
    assert torch.equal(linear(gx[:1], wt), F.linear(gx[:1], wt))
    with pytest.raises(RuntimeError):  # mixed dtypes: F.linear's own error
        linear(gx[:1], gw.to(torch.bfloat16))


@gpu
def test_gemv_rejects_bad_arguments():
    C = get_C()
    x, w = torch.randn(2, 64).cuda(), torch.randn(10, 64).cuda()
    out = torch.empty(2, 10).cuda()
    args = dict(x=x.data_ptr(), x_stride=64, tokens=2, w=w.data_ptr(), rows=10, dim=64, bias=0,
                out=out.data_ptr(), out_stride=10, k_split=0, dtype=0, stream=0)  # fmt: skip
    for bad, message in [({"k_split": 3}, "k_split"), ({"x_stride": 32}, "x_stride"), ({"rows": 0}, "rows"),
                         ({"dtype": 4}, "unsupported dtype")]:  # fmt: skip
        with pytest.raises(RuntimeError, match=message):
            C.gemv(**{**args, **bad})


def test_cpu_is_f_linear():
    """On the CPU ``linear`` is F.linear, bit for bit, forced or not."""
    x, w, b = _inputs(3, 50, 64, torch.float32)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x[0], w, force=True), F.linear(x[0], w))
