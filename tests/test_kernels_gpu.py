"""The ``atom._C`` kernels against their torch references (``atom.ops.cuda.reference``).

GPU tests (skipped without CUDA and a built ``atom._C``) draw fresh random
inputs, poison every output with NaN first, and compare the kernel with the
reference run on the CPU in the same dtypes: relative error
||out - ref|| / ||ref|| < 1e-5 in fp32 and < 1e-2 in bf16. The CPU tests at
the top tie each reference to the model's own reference path, so a kernel
that matches its reference computes what the model computes.
"""

from __future__ import annotations

import functools
import itertools
import os

import pytest
import torch

from atom.ops._C_loader import get_C
from atom.ops.cuda import (conv1d_prefill, conv1d_update, gated_rmsnorm, kda_decode, kda_prefill, mla_decode,
                           paged_decode_attention, rotary_write_kv, write_kv_cache, write_latent_cache)
from atom.ops.cuda import reference as ref
from atom.ops.cuda.kda import token_rows
from atom.ops.cuda.kda_prefill import FLA_HEAD_DIMS, fla_available, prefill_backend

HAS_KERNELS = torch.cuda.is_available() and get_C() is not None and hasattr(get_C(), "kda_decode")
gpu = pytest.mark.skipif(not HAS_KERNELS, reason="needs a CUDA GPU and a built atom._C")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.detach().cpu().double(), expected.detach().cpu().double()
    assert not out.isnan().any(), "output has NaNs (unwritten elements?)"
    err = ((out - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    print(f"REL_ERR {test} {err:.2e}")  # shown with `pytest -s`; GPU_NOTES.md quotes these
    return err


def _rand(*shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype=dtype, device=device)


# ---- references vs the model's reference path (CPU, always run) -----------------------------


def test_kda_reference_matches_model_recurrence():
    from atom.ops.kda import kda_recurrent, l2norm

    torch.manual_seed(0)
    B, T, H, K, V = 3, 4, 2, 16, 8
    q, k, v = _rand(B, T, H, K), _rand(B, T, H, K), _rand(B, T, H, V)
    g = -torch.rand(B, T, H, K)
    beta = torch.rand(B, T, H)
    pool = _rand(6, H, K, V)
    slots = torch.tensor([4, 0, 2])
    expected, final = kda_recurrent(l2norm(q) * K**-0.5, l2norm(k), v, g, beta, pool[slots].clone())
    out = ref.kda_decode_ref(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[slots], final, rtol=1e-5, atol=1e-6)


def test_kda_prefill_reference_matches_model_chunked_form():
    from atom.ops import split_decode_prefill
    from atom.ops.kda import kda_chunked, l2norm

    torch.manual_seed(0)
    lens, H, K, V = [5, 40, 17], 2, 16, 8
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]  # [0, 5, 45, 62]
    (layout,) = split_decode_prefill(starts, torch.device("cpu"))
    T = starts[-1]
    q, k, v = _rand(T, H, K), _rand(T, H, K), _rand(T, H, V)
    g, beta = -torch.rand(T, H, K), torch.rand(T, H)
    pool = _rand(5, H, K, V)
    slots = torch.tensor([3, 0, 4])
    expected, final = kda_chunked(layout.pad(l2norm(q) * K**-0.5), layout.pad(l2norm(k)), layout.pad(v),
                                  layout.pad(g), layout.pad(beta), pool[slots].clone())  # fmt: skip
    out = ref.kda_prefill_ref(q, k, v, g, beta, layout.cu_seqlens, pool, slots)
    torch.testing.assert_close(out, layout.unpad(expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots], final, rtol=1e-5, atol=1e-5)


def test_kda_prefill_backend_switch(monkeypatch):
    monkeypatch.setenv("ATOM_KDA_PREFILL", "atom")
    assert prefill_backend() == "atom"
    monkeypatch.setenv("ATOM_KDA_PREFILL", "auto")
    assert prefill_backend() == "atom"  # ours: faster than fla where both were measured
    monkeypatch.setenv("ATOM_KDA_PREFILL", "triton")
    with pytest.raises(ValueError, match="ATOM_KDA_PREFILL"):
        prefill_backend()
    monkeypatch.setenv("ATOM_KDA_PREFILL", "fla")
    if fla_available():
        assert prefill_backend() == "fla"
    else:
        with pytest.raises(RuntimeError, match="flash-linear-attention"):
            prefill_backend()


def test_kda_prefill_scan_switch(monkeypatch):
    T, H, K = 4, 1, 8
    x = {"q": torch.randn(T, H, K), "k": torch.randn(T, H, K), "v": torch.randn(T, H, K), "g": -torch.rand(T, H, K),
         "beta": torch.rand(T, H), "cu_seqlens": torch.tensor([0, T]), "state_pool": torch.zeros(1, H, K, K),
         "state_slots": torch.tensor([0])}  # fmt: skip
    with pytest.raises(ValueError, match="ATOM_KDA_SCAN"):
        kda_prefill(**x, scan="bf16")
    monkeypatch.setenv("ATOM_KDA_SCAN", "tf16")
    with pytest.raises(ValueError, match="ATOM_KDA_SCAN"):
        kda_prefill(**x)
    monkeypatch.setenv("ATOM_KDA_SCAN", "tf32")  # a CPU runs the reference whatever the scan
    assert torch.isfinite(kda_prefill(**x)).all()


def test_conv_reference_matches_model_conv():
    from atom.ops.kda import causal_conv1d

    torch.manual_seed(0)
    B, T, C, W = 3, 2, 10, 4
    x, weight = _rand(B, T, C), _rand(C, W)
    pool = _rand(5, C, W - 1)
    slots = torch.tensor([1, 4, 0])
    expected, new_state = causal_conv1d(x.transpose(1, 2), pool[slots].clone(), weight, torch.full((B,), T))
    out = ref.conv1d_update_ref(x, pool, weight, slots)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[slots], new_state, rtol=0, atol=0)


def test_conv_prefill_reference_matches_model_conv():
    """conv1d_prefill's reference (packed sequences of different lengths, one shorter than the window,
    one without an initial state) against the padded torch conv the layers ran before."""
    from atom.ops.kda import causal_conv1d_with_inputs

    torch.manual_seed(1)
    lens, C, W = [5, 2, 9], 12, 4
    x, weight = _rand(sum(lens), C), _rand(C, W)
    pool = _rand(6, C, W - 1)
    slots, keep = torch.tensor([3, 0, 5]), torch.tensor([True, False, True])
    padded = torch.zeros(len(lens), max(lens), C)
    for b, (lo, n) in enumerate(zip([0, 5, 7], lens)):
        padded[b, :n] = x[lo : lo + n]
    state = torch.where(keep[:, None, None], pool[slots], 0)
    expected, new_state, _ = causal_conv1d_with_inputs(padded.transpose(1, 2), state, weight, torch.tensor(lens))
    out = ref.conv1d_prefill_ref(x, torch.tensor([0, 5, 7, 16]), pool, weight, slots, has_initial_state=keep)
    for b, (lo, n) in enumerate(zip([0, 5, 7], lens)):
        torch.testing.assert_close(out[lo : lo + n], expected[b, :, :n].T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[slots], new_state, rtol=0, atol=0)


def test_gated_norm_reference_matches_module():
    from atom.layers.norm import GatedRMSNorm

    torch.manual_seed(0)
    norm = GatedRMSNorm(32, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    x, gate = _rand(4, 3, 32, dtype=torch.bfloat16), _rand(4, 3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(ref.gated_rmsnorm_ref(x, gate, norm.weight, 1e-5), norm(x, gate), rtol=0, atol=0)


def test_mla_reference_matches_model_attention():
    from atom.forward_context import build_attention_metadata
    from atom.ops import split_decode_prefill
    from atom.ops.mla import mla_attention

    torch.manual_seed(0)
    B, H, R, P, bs = 3, 4, 16, 8, 4
    lens = [5, 1, 9]
    cache = _rand(12, bs, R + P)
    tables = [[3, 7], [0], [11, 2, 5]]
    md = build_attention_metadata([1] * B, [n - 1 for n in lens], tables, [-1] * B, bs)
    (layout,) = split_decode_prefill(md.query_start_loc, torch.device("cpu"))  # all rows decode
    ql, qp = _rand(B, H, R), _rand(B, H, P)
    expected = mla_attention(ql, qp, cache, md, layout, 0.3)
    out = ref.mla_decode_ref(ql, qp, cache, md.block_tables, torch.tensor(lens), 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_paged_decode_reference_matches_model_attention():
    """The GQA decode reference equals the dense models' own reference (``paged_attention``) on decode rows."""
    from atom.forward_context import build_attention_metadata
    from atom.ops.paged_attention import paged_attention

    torch.manual_seed(0)
    H, Hkv, D, bs = 6, 2, 8, 4
    lens = [5, 1, 9]
    k_cache, v_cache = _rand(12, bs, Hkv, D), _rand(12, bs, Hkv, D)
    tables = [[3, 7], [0], [11, 2, 5]]
    md = build_attention_metadata([1] * len(lens), [n - 1 for n in lens], tables, [-1] * len(lens), bs)
    q = _rand(len(lens), H, D)
    expected = paged_attention(q, k_cache, v_cache, md, 0.3)
    out = ref.paged_decode_attention_ref(q, k_cache, v_cache, md.block_tables, torch.tensor(lens), 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_rotary_write_kv_reference_matches_the_layer_path():
    """The fused rotary-and-cache-write reference equals the dense layer's CPU path: ``RotaryEmbedding`` (llama3
    scaling), then ``write_kv_cache`` of the rotated k and v."""
    from atom.layers.rotary import RotaryEmbedding
    from atom.ops.paged_attention import write_kv_cache as write_kv_cache_ref

    torch.manual_seed(0)
    T, H, Hkv, D, bs = 5, 6, 2, 16, 4
    rotary = RotaryEmbedding(D, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = _rand(T, H, D, dtype=dtype), _rand(T, Hkv, D, dtype=dtype), _rand(T, Hkv, D, dtype=dtype)
        positions = torch.tensor([0, 3, 70, 1000, 123456])
        slots = torch.tensor([9, -1, 0, 17, 4])
        k_cache, v_cache = torch.zeros(6, bs, Hkv, D, dtype=dtype), torch.zeros(6, bs, Hkv, D, dtype=dtype)
        q_rot = ref.rotary_write_kv_ref(q, k, v, positions, rotary.inv_freq, k_cache, v_cache, slots)
        expected_q, expected_k = rotary(positions, q, k)
        exp_k_cache, exp_v_cache = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        keep = slots >= 0
        write_kv_cache_ref(exp_k_cache, exp_v_cache, expected_k[keep], v[keep], slots[keep])
        assert torch.equal(q_rot, expected_q) and not torch.equal(q_rot, q)
        assert torch.equal(k_cache, exp_k_cache) and torch.equal(v_cache, exp_v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention_sdpa_matches_the_reference(dtype):
    """The SDPA prefill path (SDPA's fused kernels, lower-right causal) gives the reference's values for
    chunks with and without cached context, and leaves the other sequences' rows of ``out`` alone."""
    from atom.forward_context import build_attention_metadata
    from atom.ops.paged_attention import paged_attention, paged_prefill_attention_sdpa

    torch.manual_seed(1)
    H, Hkv, D, bs = 6, 2, 16, 4
    query_lens, context_lens = [5, 1, 7, 3], [0, 9, 6, 2]  # a fresh prompt, a decode row, two later chunks
    tables = [[3, 7], [0, 1, 4], [11, 2, 5, 8], [9, 6]]
    md = build_attention_metadata(query_lens, context_lens, tables, [-1] * 4, bs)
    k_cache, v_cache = _rand(12, bs, Hkv, D, dtype=dtype), _rand(12, bs, Hkv, D, dtype=dtype)
    q = _rand(sum(query_lens), H, D, dtype=dtype)
    expected = paged_attention(q, k_cache, v_cache, md, 0.3)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention_sdpa(q, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens, (0, 2, 3),
                                 0.3, out)  # fmt: skip
    rows = torch.ones(len(q), dtype=torch.bool)
    rows[5] = False  # the decode row's
    assert out[~rows].isnan().all()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[rows], expected[rows], **tol)


def test_dispatch_uses_reference_on_cpu():
    torch.manual_seed(0)
    x, gate, w = _rand(5, 8), _rand(5, 8), _rand(8)
    torch.testing.assert_close(gated_rmsnorm(x, gate, w), ref.gated_rmsnorm_ref(x, gate, w))


# ---- kernels vs references (GPU) --------------------------------------------------------------


def _slots(B: int, T: int, mode: str, pad_row: int | None):
    """(pool size, in slots [B], out slots [B] or None, per_token, slots read, slots written).

    inplace: read and write state_slots; moved: write other slots; per_token: each
    row owns T consecutive slots from out[b]; even rows read out[b] + 1 (so token 1's
    state overwrites the slot they read), odd rows read a slot outside their block.
    """
    num_slots = B * T + B + 3
    perm = torch.randperm(B)
    ins = torch.randperm(num_slots)[:B] if mode != "per_token" else None
    outs, per_token = None, False
    if mode == "moved":
        rest = torch.tensor([i for i in torch.randperm(num_slots).tolist() if i not in set(ins.tolist())])
        outs = rest[:B]
    elif mode == "per_token":
        outs, per_token = perm * T, True
        ins = torch.where(torch.arange(B) % 2 == 0, outs + min(1, T - 1), B * T + torch.arange(B))
    if pad_row is not None:
        ins[pad_row] = -1
    valid = ins >= 0
    read = set(ins[valid].tolist())
    dst = (ins if outs is None else outs)[valid]
    written = {int(d) + t for d in dst for t in (range(T) if per_token else range(1))}
    return num_slots, ins, outs, per_token, read, written


def _poison(pool: torch.Tensor, read: set, written: set) -> None:
    """Slots the kernel writes without reading them start as NaN."""
    pool[sorted(written - read)] = float("nan")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B, T, H, K, V, mode",
    [
        (1, 1, 2, 128, 128, "inplace"),  # fast path
        (5, 1, 3, 64, 200, "moved"),  # fast path, partial column tile, state to other slots
        (7, 1, 2, 48, 40, "inplace"),  # generic kernel (odd sizes)
        (4, 3, 32, 128, 128, "per_token"),  # 1 + 2 speculative tokens, state after every token
        (3, 2, 4, 128, 132, "moved"),  # two tokens, final state only
        (2, 6, 3, 128, 128, "per_token"),  # fast path, 1 + 5 speculative tokens, state after every token
        (3, 5, 2, 64, 72, "moved"),  # fast path, K = 64, five tokens, final state only
        (6, 3, 5, 24, 36, "per_token"),  # generic kernel, per-token slots
        (5, 2, 2, 48, 40, "moved"),  # generic kernel, two tokens into another slot
    ],
)
def test_kda_decode(dtype, B, T, H, K, V, mode):
    torch.manual_seed(B * 100 + K + V)
    q, k, v = _rand(B, T, H, K, dtype=dtype), _rand(B, T, H, K, dtype=dtype), _rand(B, T, H, V, dtype=dtype)
    g = -torch.rand(B, T, H, K) * 0.5
    beta = torch.rand(B, T, H)
    num_slots, ins, outs, per_token, read, written = _slots(B, T, mode, pad_row=B - 1 if B > 2 else None)
    pool = _rand(num_slots, H, K, V, scale=0.1)
    _poison(pool, read, written)
    has_init = torch.rand(B) > 0.3
    pool_gpu = pool.cuda()
    expected_pool = pool.clone()
    expected = ref.kda_decode_ref(q, k, v, g, beta, expected_pool, ins, outs, per_token, has_init)

    out = torch.full((B, T, H, V), float("nan"), dtype=dtype, device="cuda")
    kda_decode(q.cuda(), k.cuda(), v.cuda(), g.cuda(), beta.cuda(), pool_gpu, ins.cuda(),
               out_slots=outs.cuda() if outs is not None else None, per_token=per_token,
               has_initial_state=has_init.cuda(), out=out)  # fmt: skip
    assert rel_err(out, expected) < TOL[dtype]
    touched = sorted(written)
    assert rel_err(pool_gpu[touched], expected_pool[touched]) < 1e-5
    untouched = [i for i in range(num_slots) if i not in written]
    assert torch.equal(pool_gpu.cpu()[untouched].nan_to_num(7.0), pool[untouched].nan_to_num(7.0))


@gpu
def test_kda_decode_strided_views_of_one_conv_output():
    # q | k | v as views into one [B, 3*H*K] tensor, no copies, as the layer would pass them
    torch.manual_seed(1)
    B, H, K = 9, 4, 128
    mixed = _rand(B, 3 * H * K, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.view(B, H, K) for t in mixed.split(H * K, dim=-1))
    g, beta = -torch.rand(B, H, K, device="cuda"), torch.rand(B, H, device="cuda")
    pool = _rand(B + 2, H, K, K, scale=0.1, device="cuda")
    ids = torch.randperm(B + 2)[:B].cuda()
    expected_pool = pool.cpu().clone()
    expected = ref.kda_decode_ref(*(t.cpu().unsqueeze(1) for t in (q, k, v, g, beta)), expected_pool, ids.cpu())
    out = kda_decode(q, k, v, g, beta, pool, ids)
    assert out.shape == (B, H, K)
    assert rel_err(out, expected.squeeze(1)) < 1e-2
    assert rel_err(pool, expected_pool) < 1e-5


PREFILL_LENS = [1, 15, 16, 17, 100, 300]  # around the chunk size (16) and several chunks


@gpu
@pytest.mark.parametrize("backend, scan", [("atom", "fp32"), ("atom", "tf32"), ("fla", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens, H, K, V, moved",
    [
        (PREFILL_LENS, 32, 128, 128, False),  # the model's size, state in place
        ([17, 1, 300, 16, 0, 15, 100], 3, 48, 40, True),  # odd K/V (K padded to 64), an empty sequence, other slots
        ([33, 64, 5], 2, 64, 200, False),  # four V tiles, the last partial
        ([300, 45, 1], 4, 100, 132, True),  # K padded to 128, odd V
        ([70, 200, 16, 33], 32, 128, 128, True),  # 128 (sequence, head) rows: 32-column V tiles on 132 SMs
    ],
)
def test_kda_prefill(backend, scan, dtype, lens, H, K, V, moved):
    if backend == "fla" and not fla_available():
        pytest.skip("fla (flash-linear-attention) is not installed")
    if backend == "fla" and (K, V) != FLA_HEAD_DIMS:
        pytest.skip("fla runs only at the head size auto takes it for (Triton autotunes each new shape for minutes)")
    if backend == "fla" and 0 in lens:
        lens = [n for n in lens if n]
    torch.manual_seed(sum(lens) + K + V)
    N, T = len(lens), sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    # q | k | v as views into one packed tensor, as the layer passes them
    packed = _rand(T, H * (2 * K + V), dtype=dtype)
    q, k, v = packed[:, : H * K].view(T, H, K), packed[:, H * K : 2 * H * K].view(T, H, K), packed[:, 2 * H * K :]
    v = v.view(T, H, V)
    g = -torch.rand(T, H, K)
    beta = torch.rand(T, H)
    num_slots = 2 * N + 3
    perm = torch.randperm(num_slots)
    ins, outs = perm[:N].clone(), (perm[N : 2 * N] if moved else None)
    if backend == "atom" and moved:
        ins[1] = -1  # a padding sequence: zero output, its slots untouched
    valid = ins >= 0
    read = set(ins[valid].tolist())
    written = set((ins if outs is None else outs)[valid].tolist())
    pool = _rand(num_slots, H, K, V, scale=0.1)
    _poison(pool, read, written)
    has_init = torch.rand(N) > 0.3
    pool_gpu = pool.cuda()
    expected_pool = pool.clone()
    expected = ref.kda_prefill_ref(q, k, v, g, beta, cu, expected_pool, ins, outs, has_init)

    dev = [t.cuda() for t in (packed, g, beta, cu, ins)]
    packed_gpu = dev[0]
    qd = packed_gpu[:, : H * K].view(T, H, K)
    kd = packed_gpu[:, H * K : 2 * H * K].view(T, H, K)
    vd = packed_gpu[:, 2 * H * K :].view(T, H, V)
    out = torch.full((T, H, V), float("nan"), dtype=dtype, device="cuda")
    out_slots = outs.cuda() if outs is not None else None
    kda_prefill(qd, kd, vd, dev[1], dev[2], dev[3], pool_gpu, dev[4], out_slots=out_slots,
                has_initial_state=has_init.cuda(), backend=backend, scan=scan, out=out)  # fmt: skip
    # fla's Triton matmuls and our tf32 scan round their operands to bf16/tf32: their fp32 output is held to the
    # bf16 bound, and so is the state they carry
    exact = backend == "atom" and scan == "fp32"
    assert rel_err(out, expected) < (TOL[dtype] if exact else 1e-2)
    touched = sorted(written)
    assert rel_err(pool_gpu[touched], expected_pool[touched]) < (1e-5 if exact else 1e-2)
    untouched = [i for i in range(num_slots) if i not in written]
    assert torch.equal(pool_gpu.cpu()[untouched].nan_to_num(7.0), pool[untouched].nan_to_num(7.0))


@gpu
@pytest.mark.parametrize("dtype, picked", [(torch.bfloat16, "tf32"), (torch.float16, "tf32"), (torch.float32, "fp32")])
def test_kda_prefill_auto_scan(monkeypatch, dtype, picked):
    """ATOM_KDA_SCAN=auto runs the tf32 scan for bf16/fp16 on compute capability >= 8.0 and the fp32 scan for fp32:
    its output and final states are bitwise those of the scan forced by name, and not those of the other scan."""
    if torch.cuda.get_device_capability()[0] < 8 or torch.version.hip is not None:
        pytest.skip("the tf32 scan needs an NVIDIA GPU of compute capability >= 8.0")
    monkeypatch.delenv("ATOM_KDA_SCAN", raising=False)
    torch.manual_seed(5)
    lens, H, K, V = [300, 17, 64], 4, 128, 128
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()).cuda()
    q, k = (_rand(T, H, K, dtype=dtype, device="cuda") for _ in range(2))
    v = _rand(T, H, V, dtype=dtype, device="cuda")
    g, beta = -torch.rand(T, H, K, device="cuda"), torch.rand(T, H, device="cuda")
    pool = _rand(len(lens), H, K, V, scale=0.1, device="cuda")
    slots = torch.arange(len(lens), device="cuda")

    def run(scan: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        states = pool.clone()
        o = kda_prefill(q, k, v, g, beta, cu, states, slots, backend="atom", scan=scan)
        return o, states

    auto, forced = run(None), run(picked)
    other = run("fp32" if picked == "tf32" else "tf32")
    assert torch.equal(auto[0], forced[0]) and torch.equal(auto[1], forced[1])
    assert not torch.equal(auto[1], other[1])  # the two scans are told apart by their states

@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B, T, C, W, mode",
    [(3, 1, 37, 4, "inplace"), (8, 1, 12288, 4, "moved"), (5, 3, 100, 3, "per_token"), (4, 2, 65, 2, "moved"),
     (2, 1, 7, 5, "inplace")],
)  # fmt: skip
def test_conv1d_update(dtype, B, T, C, W, mode):
    torch.manual_seed(C + W)
    x, weight = _rand(B, T, C, dtype=dtype), _rand(C, W, dtype=dtype)
    num_slots, ins, outs, per_token, read, written = _slots(B, T, mode, pad_row=0 if B > 2 else None)
    pool = _rand(num_slots, C, W - 1, dtype=dtype)
    _poison(pool, read, written)
    has_init = torch.rand(B) > 0.3
    pool_gpu = pool.cuda()
    expected_pool = pool.clone()
    expected = ref.conv1d_update_ref(x, expected_pool, weight, ins, outs, per_token, has_init)
    out = torch.full((B, T, C), float("nan"), dtype=dtype, device="cuda")
    conv1d_update(x.cuda(), pool_gpu, weight.cuda(), ins.cuda(), out_slots=outs.cuda() if outs is not None else None,
                  per_token=per_token, has_initial_state=has_init.cuda(), out=out)  # fmt: skip
    assert rel_err(out, expected) < TOL[dtype]
    # state values are copies of inputs: exact (NaN only where nothing was written)
    assert torch.equal(pool_gpu.cpu().nan_to_num(7.0), expected_pool.nan_to_num(7.0))
    assert not pool_gpu[sorted(written)].isnan().any()


def test_token_rows_keeps_evenly_spaced_rows_and_copies_the_rest():
    """token_rows (the row layout conv1d_update and kda_decode's output norm read): a column slice of a wider
    tensor's rows is kept with its row stride; rows not evenly spaced, or not contiguous, are copied."""
    wide = torch.arange(6 * 20.0).view(6, 20)
    x, stride = token_rows(wide[:, 3:13].view(3, 2, 10))
    assert stride == 20 and x.data_ptr() == wide[:, 3:].data_ptr()
    uneven = torch.zeros(3, 30)[:, :20].view(3, 2, 10)  # batches 30 apart, tokens 10 apart
    x, stride = token_rows(uneven)
    assert stride == 10 and x.is_contiguous() and x.data_ptr() != uneven.data_ptr()
    x, stride = token_rows(torch.zeros(4, 1, 20)[:, :, ::2])  # elements 2 apart
    assert stride == 10 and x.is_contiguous()
    one = wide[:1, 3:13].view(1, 1, 10)  # one row: kept, its stride never read (at least the width)
    x, stride = token_rows(one)
    assert x is one and stride >= 10


@gpu
@pytest.mark.parametrize("B, T", [(1, 1), (5, 1), (3, 2)])
def test_conv1d_update_reads_a_column_slice_in_place(B, T):
    """x as the layer passes it: a column slice of a wider projection's rows. The kernel reads it in
    place (the columns around it are NaN) and gives the bits a contiguous copy gives."""
    torch.manual_seed(B * 10 + T)
    C, W, dtype = 100, 4, torch.bfloat16
    wide = torch.full((B * T, C + 29), float("nan"), dtype=dtype)
    wide[:, 13 : 13 + C] = _rand(B * T, C, dtype=dtype)
    x = wide.cuda()[:, 13 : 13 + C].view(B, T, C)
    weight = _rand(C, W, dtype=dtype).cuda()
    pool = _rand(B, C, W - 1, dtype=dtype).cuda()
    slots = torch.arange(B, device="cuda")
    outs = []
    for inputs in (x, x.contiguous()):
        p = pool.clone()
        outs.append((conv1d_update(inputs, p, weight, slots, per_token=False), p))
    assert not outs[0][0].isnan().any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [2, 4, 5])
@pytest.mark.parametrize("lens, C, separate_out", [
    ([9], 96, False),  # one sequence
    ([1, 2, 3, 40, 5], 300, True),  # shorter than the window, odd channel count, new slots
    ([0, 7, 2], 64, False),  # an empty sequence keeps (or clears) its state
    ([130, 257], 24, True),  # channels fewer than a block
    ([4, 19, 1], 37, True),  # odd channels: one channel a thread (even counts take two)
])  # fmt: skip
def test_conv1d_prefill(dtype, W, lens, C, separate_out):
    """The packed prefill conv against the decode reference run sequence by sequence: poisoned output,
    slots shuffled, some without an initial state, each slot of the pool written only where it should be."""
    torch.manual_seed(C + W + len(lens))
    B, T = len(lens), sum(lens)
    x = _rand(T + 3, C, dtype=dtype)[2:-1]  # rows of a larger tensor
    weight = _rand(C, W, dtype=dtype)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int64)
    perm = torch.randperm(3 * B)
    ins = perm[:B]
    outs = perm[B : 2 * B] if separate_out else None
    pool = _rand(3 * B, C, W - 1, dtype=dtype)
    written = set((outs if separate_out else ins).tolist())
    _poison(pool, set(ins.tolist()), written)
    has_init = torch.rand(B) > 0.3
    expected_pool = pool.clone()
    expected = ref.conv1d_prefill_ref(x, cu, expected_pool, weight, ins, outs, has_init)
    pool_gpu = pool.cuda()
    out = torch.full((T, C), float("nan"), dtype=dtype, device="cuda")
    conv1d_prefill(x.cuda(), cu.cuda(), pool_gpu, weight.cuda(), ins.cuda(),
                   out_slots=outs.cuda() if outs is not None else None, has_initial_state=has_init.cuda(),
                   out=out)  # fmt: skip
    assert not out.isnan().any()
    assert rel_err(out, expected) < TOL[dtype]
    # state values are copies of inputs: exact (NaN only where nothing was written)
    assert torch.equal(pool_gpu.cpu().nan_to_num(7.0), expected_pool.nan_to_num(7.0))
    assert not pool_gpu[sorted(written)].isnan().any()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 3, 128), (7, 100), (2, 33, 64), (1, 1, 24), (3, 1000), (4, 2, 512)])
def test_gated_rmsnorm(dtype, shape):
    torch.manual_seed(sum(shape))
    x = _rand(*shape, dtype=dtype)
    gate_full = _rand(*shape[:-2], shape[-2] * shape[-1], dtype=dtype) if len(shape) > 2 else _rand(*shape, dtype=dtype)
    gate = gate_full.view(shape)
    weight = _rand(shape[-1], dtype=dtype)
    expected = ref.gated_rmsnorm_ref(x, gate, weight, 1e-6)
    out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    gated_rmsnorm(x.cuda(), gate_full.cuda().view(shape), weight.cuda(), 1e-6, out=out)
    assert rel_err(out, expected) < TOL[dtype]


@gpu
def test_gated_rmsnorm_strided_rows():
    torch.manual_seed(3)
    base = _rand(6, 2, 128, dtype=torch.bfloat16, device="cuda")
    x = base[:, 0]  # rows 256 elements apart
    gate = _rand(6, 128, dtype=torch.bfloat16, device="cuda")
    w = _rand(128, dtype=torch.bfloat16, device="cuda")
    assert rel_err(gated_rmsnorm(x, gate, w), ref.gated_rmsnorm_ref(x.cpu(), gate.cpu(), w.cpu())) < 1e-2


def _paged_cache(lens, block_size, row, dtype, extra_blocks=3):
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks
    cache = _rand(num_blocks, block_size, row, dtype=dtype)
    perm = torch.randperm(num_blocks)
    width = max(need + [1])
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start : start + n]
        start += n
    return cache, tables


@gpu
@pytest.mark.parametrize(
    "dtype, R, P, H, block_size, lens, splits",
    [
        (torch.bfloat16, 512, 64, 32, 16, [1, 63, 64, 65, 1000], None),  # tensor cores, auto splits
        (torch.bfloat16, 512, 64, 32, 64, [2048, 17, 300], 1),  # tensor cores, one split
        (torch.bfloat16, 512, 64, 40, 16, [500, 129, 0, 7], 3),  # two head groups, empty row, splits
        (torch.bfloat16, 512, 64, 16, 7, [333, 1, 90], 7),  # odd block size, more splits than tiles
        (torch.float32, 512, 64, 8, 16, [100, 257, 3], None),  # CUDA-core kernel
        (torch.float32, 48, 16, 3, 5, [11, 1, 40], 2),  # CUDA-core kernel, odd sizes
        (torch.bfloat16, 100, 28, 5, 16, [70, 33], None),  # CUDA-core kernel, bf16
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mla_decode(dtype, R, P, H, block_size, lens, splits, out_dtype):
    torch.manual_seed(R + H + len(lens))
    cache, tables = _paged_cache(lens, block_size, R + P, dtype)
    B = len(lens)
    ql, qp = _rand(B, H, R, dtype=dtype), _rand(B, H, P, dtype=dtype)
    scale = (128 + P) ** -0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = ref.mla_decode_ref(ql, qp, cache, tables, seq_lens, scale)
    out = torch.full((B, H, R), float("nan"), dtype=out_dtype, device="cuda")
    mla_decode(ql.cuda(), qp.cuda(), cache.cuda(), tables.cuda(), seq_lens.cuda(), scale, num_splits=splits, out=out)
    tol = TOL[torch.bfloat16] if torch.bfloat16 in (dtype, out_dtype) else TOL[torch.float32]
    assert rel_err(out, expected) < tol
    assert torch.equal(out[seq_lens.cuda() == 0].cpu(), torch.zeros_like(out[seq_lens.cuda() == 0].cpu()))


@gpu
@pytest.mark.parametrize("kernel", [2, 3, 4, 5, 6, 7, 8])  # MlaKernel: tensor-core variants, forced
@pytest.mark.parametrize(
    "H, block_size, lens, splits",
    [(32, 16, [1, 63, 64, 65, 1000], None), (40, 7, [500, 129, 0, 7], 3), (16, 64, [2048, 17], 1),
     (32, 8, [9, 300], 2), (32, 128, [200, 64, 129], None),
     (32, 16, [3000, 0, 1, 640], 8), (24, 16, [777, 65, 0], 5)],  # 8 and 5 splits: empty ones, an empty row
)
def test_mla_decode_tensor_core_variants(kernel, H, block_size, lens, splits):
    if kernel >= 7 and not get_C().mla_decode_has_warpgroup_mma():
        pytest.skip("warpgroup MMAs need an sm_90a build on a compute capability 9.0 GPU")
    torch.manual_seed(kernel + H)
    cache, tables = _paged_cache(lens, block_size, 576, torch.bfloat16)
    B = len(lens)
    ql, qp = _rand(B, H, 512, dtype=torch.bfloat16), _rand(B, H, 64, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens)
    out = torch.full((B, H, 512), float("nan"), device="cuda")
    mla_decode(ql.cuda(), qp.cuda(), cache.cuda(), tables.cuda(), seq_lens.cuda(), 0.07, num_splits=splits, out=out,
               kernel=kernel)  # fmt: skip
    assert rel_err(out, ref.mla_decode_ref(ql, qp, cache, tables, seq_lens, 0.07)) < 1e-2


@gpu
@pytest.mark.parametrize("kernel", [0, 7, 8])
@pytest.mark.parametrize("block_size", [16, 64])
def test_mla_decode_ignores_nan_rows_past_the_end(kernel, block_size):
    """Rows past each sequence's end (in its last block, and unused blocks) hold NaN: the output must not
    see them (a kernel that brought whole blocks in would have to zero them: P = 0 times NaN is NaN)."""
    if kernel >= 7 and not get_C().mla_decode_has_warpgroup_mma():
        pytest.skip("warpgroup MMAs need an sm_90a build on a compute capability 9.0 GPU")
    lens = [1, 70, 129, 1000]
    torch.manual_seed(block_size)
    cache, tables = _paged_cache(lens, block_size, 576, torch.bfloat16)
    for b, n in enumerate(lens):  # poison every row at and past the end of each sequence
        for pos in range(n, -(-n // block_size) * block_size):
            cache[tables[b, pos // block_size], pos % block_size] = float("nan")
    cache[~torch.isin(torch.arange(cache.shape[0]), tables)] = float("nan")
    ql, qp = _rand(len(lens), 32, 512, dtype=torch.bfloat16), _rand(len(lens), 32, 64, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens)
    expected = ref.mla_decode_ref(ql, qp, cache, tables, seq_lens, 0.07)
    assert not expected.isnan().any()
    out = mla_decode(ql.cuda(), qp.cuda(), cache.cuda(), tables.cuda(), seq_lens.cuda(), 0.07, kernel=kernel)
    assert rel_err(out, expected) < 1e-2


@gpu
@pytest.mark.parametrize("kernel", [0, 7, 8])
@pytest.mark.parametrize("splits", [None, 2, 5])
def test_mla_decode_scores_jump_late(kernel, splits):
    """A few late rows are scaled up (one with its sign flipped), so some heads' scores there are far above
    everything before them: the running max moves by much more than 2^8 in the middle of a split, where the
    cluster kernel's lazy max must take its exact path and rescale what it summed so far."""
    if kernel >= 7 and not get_C().mla_decode_has_warpgroup_mma():
        pytest.skip("warpgroup MMAs need an sm_90a build on a compute capability 9.0 GPU")
    lens = [1000, 2048, 70]
    torch.manual_seed(23)
    cache, tables = _paged_cache(lens, 16, 576, torch.bfloat16)
    cache.mul_(0.1)
    for b, n in enumerate(lens):  # rows scaled up: every head's score there grows by the same factor
        for pos, factor in ((n * 3 // 10, 30.0), (n * 6 // 10, 80.0), (n * 9 // 10, -120.0), (n - 1, 60.0)):
            cache[tables[b, pos // 16], pos % 16] *= factor
    ql, qp = _rand(len(lens), 32, 512, dtype=torch.bfloat16), _rand(len(lens), 32, 64, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens)
    expected = ref.mla_decode_ref(ql, qp, cache, tables, seq_lens, 0.07)
    assert not expected.isnan().any()
    out = mla_decode(ql.cuda(), qp.cuda(), cache.cuda(), tables.cuda(), seq_lens.cuda(), 0.07, num_splits=splits,
                     kernel=kernel)  # fmt: skip
    assert rel_err(out, expected) < 1e-2


@gpu
@pytest.mark.parametrize("kernel", [0, 1, 7, 8])
def test_mla_decode_block_table_view(kernel):
    """Block tables as the first columns of a wider table (row stride > width) whose other columns hold
    block ids far past the cache: rows are found at the stride, and only entries below seq_len are used."""
    if kernel >= 7 and not get_C().mla_decode_has_warpgroup_mma():
        pytest.skip("warpgroup MMAs need an sm_90a build on a compute capability 9.0 GPU")
    lens = [130, 0, 64, 1]  # 4 splits: some hold one tile, some none
    torch.manual_seed(11)
    cache, tables = _paged_cache(lens, 16, 576, torch.bfloat16)
    wide = torch.full((len(lens), tables.shape[1] + 40), 10**9, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    view = wide.cuda()[:, : tables.shape[1]]
    assert view.stride(0) != view.shape[1]
    ql, qp = _rand(len(lens), 32, 512, dtype=torch.bfloat16), _rand(len(lens), 32, 64, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens)
    out = mla_decode(ql.cuda(), qp.cuda(), cache.cuda(), view, seq_lens.cuda(), 0.07, num_splits=4, kernel=kernel)
    assert rel_err(out, ref.mla_decode_ref(ql, qp, cache, tables, seq_lens, 0.07)) < 1e-2


@gpu
def test_mla_decode_workspace_only_where_read():
    """o_part / lse_part are needed unless the splits merge in a cluster: mla_decode_needs_workspace says
    which, mla_decode runs the cluster kernel without them and refuses to run the others without them."""
    from atom.ops.cuda._launch import dtype_code

    C = get_C()
    if not C.mla_decode_has_warpgroup_mma():
        pytest.skip("the cluster kernel needs an sm_90a build on a compute capability 9.0 GPU")
    lens = [700, 1, 300]
    torch.manual_seed(2)
    cache, tables = _paged_cache(lens, 16, 576, torch.bfloat16)
    cache, tables, seq_lens = cache.cuda(), tables.cuda(), torch.tensor(lens, device="cuda")
    ql, qp = _rand(3, 32, 512, dtype=torch.bfloat16).cuda(), _rand(3, 32, 64, dtype=torch.bfloat16).cuda()
    expected = ref.mla_decode_ref(ql.cpu(), qp.cpu(), cache.cpu(), tables.cpu(), seq_lens.cpu(), 0.07)

    def call(kernel, splits, workspace):
        out = torch.full((3, 32, 512), float("nan"), device="cuda")
        o_part = torch.empty(3, splits, 32, 512, device="cuda") if workspace else None
        lse = torch.empty(3, splits, 32, device="cuda") if workspace else None
        C.mla_decode(ql.data_ptr(), qp.data_ptr(), cache.data_ptr(), cache.stride(0), cache.stride(1), 16,
                     tables.data_ptr(), tables.stride(0), dtype_code(tables.dtype), seq_lens.data_ptr(),
                     dtype_code(seq_lens.dtype), out.data_ptr(), o_part.data_ptr() if workspace else 0,
                     lse.data_ptr() if workspace else 0, 3, 32, 512, 64, splits, 0.07, dtype_code(torch.bfloat16),
                     dtype_code(torch.float32), kernel, torch.cuda.current_stream().cuda_stream)  # fmt: skip
        return out

    def needs(kernel, splits, dtype=torch.bfloat16):
        return C.mla_decode_needs_workspace(ql.data_ptr(), qp.data_ptr(), cache.data_ptr(), cache.stride(0),
                                            cache.stride(1), 3, 32, 512, 64, splits, dtype_code(dtype),
                                            kernel)  # fmt: skip

    assert not needs(0, 1) and not needs(7, 1)  # one split: nothing to merge
    assert needs(7, 2) and needs(1, 2)  # merged by mla_combine_kernel
    assert needs(0, 2, torch.float32)  # auto on fp32: the CUDA-core kernel
    assert not needs(0, 2) and not needs(8, 2)  # 3 clusters of 2 fit on the GPU at once: the cluster kernel
    assert needs(8, 9)  # more splits than a portable cluster holds: kernel 7's path
    for kernel, splits in ((0, 2), (8, 2), (8, 5), (7, 2), (8, 9)):
        if needs(kernel, splits):
            with pytest.raises(RuntimeError, match="needs o_part and lse_part"):
                call(kernel, splits, workspace=False)
            out = call(kernel, splits, workspace=True)
        else:
            out = call(kernel, splits, workspace=False)
        assert rel_err(out, expected) < 1e-2, (kernel, splits)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R, P", [(512, 64), (37, 5), (600, 70)])  # Kimi-Linear's; odd; past one load batch
def test_write_latent_cache(dtype, R, P):
    torch.manual_seed(5)
    num_blocks, block_size, T = 6, 16, 9
    cache = torch.full((num_blocks, block_size, R + P), float("nan"), dtype=dtype)
    kv = _rand(T, R + P + 3, dtype=dtype)  # latent and rope as strided views of one projection
    latent, rope = kv[:, :R], kv[:, R : R + P]
    slots = torch.randperm(num_blocks * block_size)[:T]
    slots[4] = -1
    expected = cache.clone()
    ref.write_latent_cache_ref(expected, latent, rope, slots)
    cache_gpu = cache.cuda()
    kv_gpu = kv.cuda()
    write_latent_cache(cache_gpu, kv_gpu[:, :R], kv_gpu[:, R : R + P], slots.cuda())
    assert torch.equal(cache_gpu.cpu().nan_to_num(7.0), expected.nan_to_num(7.0))


# ---- dense models' GQA decode attention and cache write --------------------------------------------


def _kv_caches(lens, block_size, kv_heads, dim, dtype):
    k_cache, tables = _paged_cache(lens, block_size, kv_heads * dim, dtype)
    v_cache = _rand(*k_cache.shape, dtype=dtype)
    shape = (k_cache.shape[0], block_size, kv_heads, dim)
    return k_cache.view(shape), v_cache.view(shape), tables


def test_split_by_pairs_leaves_sequences_of_sdpa_pairs_or_more_to_sdpa():
    """The prefill kernel's sequences are those under SDPA_PAIRS causal (query, key) pairs, in order; the count
    includes the cached context."""
    from atom.ops.cuda.paged_attention import SDPA_PAIRS, causal_pairs, split_by_pairs

    assert causal_pairs(3, 10) == 3 * 7 + 6
    # one query after 2^20 - 1 cached positions: exactly SDPA_PAIRS pairs; one fewer cached: one pair short
    starts, seq_lens = [0, 1, 2, 1502, 1504], [SDPA_PAIRS, SDPA_PAIRS - 1, 1500, 2]
    assert split_by_pairs(starts, seq_lens, [3, 0, 1, 2]) == ((3, 1), (0, 2))  # 1500 fresh: 1.13M pairs


def test_prefill_block_rows_widen_past_head_dim_128(monkeypatch):
    """128-row prefill blocks for MLA's expanded q/k rows (192), 64-row ones for dense heads; BLOCK_ROWS forces."""
    import atom.ops.cuda.paged_attention as paged

    assert [paged.prefill_block_rows(d) for d in (64, 128, 192)] == [64, 64, 128]
    monkeypatch.setattr(paged, "BLOCK_ROWS", 128)
    assert paged.prefill_block_rows(64) == 128


def test_wave_splits_fills_waves_or_keeps_rows_whole():
    """Flash-decoding's split count: none for a grid that fills enough of the GPU, else the fewest splits whose
    waves are within 5% of the fullest."""
    from atom.ops.cuda._launch import wave_splits

    assert wave_splits(512, 528, 128) == 1  # 0.97 of a wave
    assert wave_splits(512, 660, 32) == 5  # 0.78 of a wave: five splits fill 0.97
    assert wave_splits(512, 660, 32, min_fill=0.5) == 1
    assert wave_splits(8, 528, 128) == 63  # 8 x 66 fills one wave exactly; 63 is within 5%
    assert wave_splits(8, 528, 4) == 4  # no more splits than a row has tiles
    assert wave_splits(8, 528, 1) == 1
    assert wave_splits(0, 528, 128) == 1


def test_paged_splits_past_one_wave_split_only_long_rows(monkeypatch):
    """Dense decode's splits: wave_splits (any row may split) while the grid fits in one wave; past it, at head_dim
    128 and up, when its waves are under 90% full, three splits of at least 16 tiles each for long rows (32 tiles of
    32 positions or more), none for short ones, smaller heads or nearly full waves."""
    import atom.ops.cuda.paged_attention as paged

    monkeypatch.setattr(paged, "_blocks_per_sm", lambda *a: 5)  # 660 slots on 132 SMs
    choose = functools.partial(paged.choose_paged_splits, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                               sms=132)  # fmt: skip
    assert choose(64, max_seq_len=8192) == (1, 1)  # 512 blocks: over half a wave
    assert choose(8, max_seq_len=8192)[1] == 1 and choose(8, max_seq_len=8192)[0] > 1  # 64 blocks
    assert choose(96, max_seq_len=8192) == (3, 16)  # 768 blocks
    assert choose(96, max_seq_len=993) == (3, 16)  # 32 tiles
    assert choose(96, max_seq_len=992) == (1, 1)
    assert choose(96, max_seq_len=8192, head_dim=64) == (1, 1)  # smaller heads keep whole rows
    assert choose(164, max_seq_len=8192) == (1, 1)  # 1312 blocks: two waves 99% full


@gpu
@pytest.mark.parametrize(
    "dtype, H, Hkv, D, block_size, lens, splits",
    [
        (torch.float32, 8, 2, 64, 16, [1, 31, 32, 33, 300], None),  # group 4, auto splits
        (torch.bfloat16, 32, 8, 128, 16, [1000, 17, 0, 5], None),  # Llama-3-8B's heads, an empty row
        (torch.bfloat16, 16, 16, 128, 7, [333, 1, 90], 7),  # no grouping, odd block size, 7 splits
        (torch.float32, 12, 1, 40, 5, [11, 1, 40], 2),  # one kv head for 12 (two blocks of heads), odd sizes
        (torch.bfloat16, 64, 4, 256, 32, [2048, 65], None),  # group 16, head_dim 256
        (torch.float16, 4, 2, 24, 16, [70, 3000], 9),  # Qwen3's test head_dim; more splits than one row's tiles
        (torch.bfloat16, 6, 2, 36, 16, [5, 77, 200], 2),  # 72-byte head rows: copied element by element
        (torch.float16, 16, 2, 64, 16, [300, 1, 33, 17], None),  # tensor cores in fp16, eight heads a block
        (torch.bfloat16, 4, 2, 128, 16, [17, 2000, 31], 3),  # two heads a block; a split of one partial tile
    ],
)
@pytest.mark.parametrize("out_dtype", ["cache", torch.float32])
def test_paged_decode_attention(dtype, H, Hkv, D, block_size, lens, splits, out_dtype):
    torch.manual_seed(H + D + len(lens))
    k_cache, v_cache, tables = _kv_caches(lens, block_size, Hkv, D, dtype)
    q = _rand(len(lens), H, D, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, D**-0.5)
    out_dtype = dtype if out_dtype == "cache" else out_dtype
    out = torch.full((len(lens), H, D), float("nan"), dtype=out_dtype, device="cuda")
    paged_decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), tables.cuda(), seq_lens.cuda(), D**-0.5,
                           num_splits=splits, out=out)
    tol = TOL[torch.float32] if dtype == out_dtype == torch.float32 else TOL[torch.bfloat16]
    assert rel_err(out, expected) < tol
    empty = seq_lens.cuda() == 0
    assert torch.equal(out[empty].cpu(), torch.zeros_like(out[empty].cpu()))


@gpu
@pytest.mark.parametrize("D", [128, 36])  # tensor cores; CUDA cores
def test_paged_decode_attention_splits_only_rows_long_enough(D):
    """With split_min_tiles, a row takes one of the grid's splits for each that many tiles of 32 positions (at
    least one, at most num_splits): a row of one split is written whole, the others merged from only the splits
    they took. Every partial buffer starts as NaN, so a merge that read a split its row did not write would show."""
    from atom.ops.cuda._launch import dtype_code

    lens = [0, 1, 63, 64, 100, 128, 200, 1000]  # tiles 0, 1, 2, 2, 4, 4, 7, 32: splits 1, 1, 1, 1, 2, 2, 3, 4
    splits, H, Hkv, bs = 4, 8, 2, 16
    torch.manual_seed(D)
    k_cache, v_cache, tables = _kv_caches(lens, bs, Hkv, D, torch.bfloat16)
    q = _rand(len(lens), H, D, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, D**-0.5)
    q, k_cache, v_cache, tables, seq_lens = (x.cuda() for x in (q, k_cache, v_cache, tables, seq_lens))
    out = torch.full((len(lens), H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    o_part = torch.full((len(lens), splits, H, D), float("nan"), device="cuda")
    lse = torch.full((len(lens), splits, H), float("nan"), device="cuda")
    get_C().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        bs, tables.data_ptr(), tables.stride(0), dtype_code(tables.dtype), seq_lens.data_ptr(),
        dtype_code(seq_lens.dtype), out.data_ptr(), o_part.data_ptr(), lse.data_ptr(), len(lens), H, Hkv, D, splits,
        2, 0, D**-0.5, dtype_code(torch.bfloat16), dtype_code(torch.bfloat16), torch.cuda.current_stream().cuda_stream)
    assert rel_err(out, expected) < TOL[torch.bfloat16]
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
    taken = lse.isfinite().all(-1).sum(-1).tolist()  # the splits each row wrote (lse finite: a non-empty split)
    assert taken == [0, 0, 0, 0, 2, 2, 3, 4]  # rows of one split write out directly, no partial


@gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("D", [64, 36])  # 16-byte copies; element copies
def test_paged_decode_attention_ignores_nan_rows_past_the_end(splits, D):
    """Positions past each row's end (in its last block, and unused blocks) hold NaN in both caches."""
    lens, bs = [1, 70, 129, 400], 16
    torch.manual_seed(splits)
    k_cache, v_cache, tables = _kv_caches(lens, bs, 2, D, torch.bfloat16)
    for b, n in enumerate(lens):
        for pos in range(n, -(-n // bs) * bs):
            k_cache[tables[b, pos // bs], pos % bs] = float("nan")
            v_cache[tables[b, pos // bs], pos % bs] = float("nan")
    unused = ~torch.isin(torch.arange(k_cache.shape[0]), tables)
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    q = _rand(len(lens), 8, D, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.125)
    assert not expected.isnan().any()
    out = paged_decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), tables.cuda(), seq_lens.cuda(), 0.125,
                                 num_splits=splits, out_dtype=torch.float32)
    assert rel_err(out, expected) < 1e-2


@gpu
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("D, splits", [(128, 1), (128, 3), (36, 2)])
def test_paged_decode_attention_stages(stages, D, splits):
    """Every depth of the kernels' shared-memory ring (the default takes two) gives the same attention: the
    tensor-core kernel (head_dim 128, 16-byte copies) and the CUDA-core one (head_dim 36, element copies), whole
    rows and splits."""
    torch.manual_seed(D + stages)
    lens = [1000, 17, 0, 5, 64]
    k_cache, v_cache, tables = _kv_caches(lens, 16, 4, D, torch.bfloat16)
    q = _rand(len(lens), 16, D, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, D**-0.5)
    out = paged_decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), tables.cuda(), seq_lens.cuda(), D**-0.5,
                                 num_splits=splits, stages=stages, out_dtype=torch.float32)
    assert rel_err(out, expected) < TOL[torch.bfloat16]
    assert torch.equal(out[2].cpu(), torch.zeros_like(out[2].cpu()))


@gpu
def test_paged_decode_attention_rows_of_one_sequence():
    """1 + k speculative tokens: a row per token over its own prefix, the sequence's table row repeated."""
    torch.manual_seed(3)
    k_cache, v_cache, tables = _kv_caches([100], 16, 2, 32, torch.float32)
    rows = tables.repeat(4, 1)
    seq_lens = torch.tensor([97, 98, 99, 100])
    q = _rand(4, 4, 32)
    expected = torch.cat([ref.paged_decode_attention_ref(q[i : i + 1], k_cache, v_cache, tables, seq_lens[i : i + 1],
                                                         0.2) for i in range(4)])  # fmt: skip
    out = paged_decode_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), rows.cuda(), seq_lens.cuda(), 0.2)
    assert rel_err(out, expected) < TOL[torch.float32]


def _prefill_case(query_lens, context_lens, block_size, Hkv, D, dtype, poison=False):
    """Caches, metadata and q of a step whose sequence b brings query_lens[b] tokens after context_lens[b]."""
    from atom.forward_context import build_attention_metadata

    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    k_cache, v_cache, tables = _kv_caches(seq_lens, block_size, Hkv, D, dtype)
    if poison:  # NaN in every slot no sequence owns, and past each sequence's end in its last block
        owned = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
        for b, n in enumerate(seq_lens):
            for pos in range(n):
                owned[tables[b, pos // block_size], pos % block_size] = True
        k_cache[~owned] = float("nan")
        v_cache[~owned] = float("nan")
    rows = [[int(x) for x in tables[b, : -(-n // block_size)]] for b, n in enumerate(seq_lens)]
    md = build_attention_metadata(query_lens, context_lens, rows, [-1] * len(seq_lens), block_size)
    return k_cache, v_cache, md


@gpu
@pytest.mark.parametrize(
    "dtype, H, Hkv, D, block_size, query_lens, context_lens",
    [
        (torch.bfloat16, 32, 8, 128, 16, [300, 2, 1, 77, 16], [0, 40, 9, 517, 16]),  # Llama-3-8B's heads; chunks
        (torch.bfloat16, 32, 8, 64, 16, [64, 65, 17], [0, 0, 1000]),  # Llama-3.2-1B's: 16 queries an item
        (torch.float16, 8, 8, 64, 7, [130, 5], [3, 0]),  # no grouping (64 queries an item), odd block size
        (torch.bfloat16, 24, 8, 128, 32, [50, 21, 22], [7, 0, 300]),  # group 3: 21 queries, 63 of 64 rows
        (torch.bfloat16, 64, 1, 64, 16, [9, 3], [100, 0]),  # group 64: one query an item
        (torch.float16, 16, 2, 128, 16, [200, 40], [1, 2000]),  # group 8, fp16
    ],
)
@pytest.mark.parametrize("block_rows", [64, 128])
def test_paged_prefill_attention(dtype, H, Hkv, D, block_size, query_lens, context_lens, block_rows, monkeypatch):
    """One launch attends every prefill chunk of a step (causal, after its cached context) as the reference does,
    in blocks of 64 or 128 (query, head) rows, reads no cache slot past a sequence's end (NaN there), and leaves
    the other sequences' rows alone."""
    import atom.ops.cuda.paged_attention as paged
    from atom.ops.cuda.paged_attention import paged_prefill_attention, prefill_kernel_applies
    from atom.ops.paged_attention import paged_attention

    monkeypatch.setattr(paged, "BLOCK_ROWS", block_rows)
    torch.manual_seed(H + D + len(query_lens))
    k_cache, v_cache, md = _prefill_case(query_lens, context_lens, block_size, Hkv, D, dtype, poison=True)
    q = _rand(sum(query_lens), H, D, dtype=dtype)
    expected = paged_attention(q.float(), k_cache.nan_to_num(), v_cache.nan_to_num(), md, D**-0.5)
    seqs = tuple(b for b, n in enumerate(query_lens) if n > 1)
    q_gpu, k_gpu, v_gpu = q.cuda(), k_cache.cuda(), v_cache.cuda()
    assert prefill_kernel_applies(q_gpu, k_gpu)
    out = torch.full_like(q_gpu, float("nan"))
    paged_prefill_attention(q_gpu, k_gpu, v_gpu, md.block_tables.cuda(), md.query_start_loc, md.seq_lens, seqs,
                            D**-0.5, out)  # fmt: skip
    mine = torch.zeros(len(q), dtype=torch.bool)
    for b in seqs:
        mine[md.query_start_loc[b] : md.query_start_loc[b + 1]] = True
    assert out[~mine.cuda()].isnan().all()
    assert rel_err(out[mine.cuda()], expected[mine]) < TOL[torch.bfloat16]


@gpu
def test_paged_prefill_attention_leaves_long_sequences_to_sdpa(monkeypatch):
    """A step's sequences of SDPA_PAIRS causal pairs or more go through SDPA, the others through the kernel, in
    the same call; every row gets the reference's values."""
    import atom.ops.cuda.paged_attention as paged
    from atom.ops.paged_attention import paged_attention

    torch.manual_seed(5)
    query_lens, context_lens = [300, 40, 1449, 2], [3500, 10, 0, 0]  # 1.09M, 0.4k + 0.8k, 1.05M, 3 pairs
    assert [paged.causal_pairs(n, c + n) >= paged.SDPA_PAIRS for n, c in zip(query_lens, context_lens)] == [
        True, False, True, False]  # fmt: skip
    sent = []
    sdpa = paged.paged_prefill_attention_sdpa
    monkeypatch.setattr(paged, "paged_prefill_attention_sdpa", lambda *a: (sent.append(a[6]), sdpa(*a))[1])
    k_cache, v_cache, md = _prefill_case(query_lens, context_lens, 16, 2, 64, torch.bfloat16)
    q = _rand(sum(query_lens), 8, 64, dtype=torch.bfloat16)
    expected = paged_attention(q.float(), k_cache, v_cache, md, 0.125)
    out = torch.full_like(q, float("nan"), device="cuda")
    paged.paged_prefill_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), md.block_tables.cuda(),
                                  md.query_start_loc, md.seq_lens, (0, 1, 2, 3), 0.125, out)  # fmt: skip
    assert sent == [(0, 2)]
    assert rel_err(out, expected) < TOL[torch.bfloat16]


@gpu
def test_paged_prefill_attention_takes_sdpa_where_the_kernel_does_not_apply():
    """fp32, or a head_dim the kernel lacks: the same call gives the SDPA path's values exactly."""
    from atom.ops.cuda.paged_attention import paged_prefill_attention, prefill_kernel_applies
    from atom.ops.paged_attention import paged_prefill_attention_sdpa

    for dtype, D in ((torch.float32, 128), (torch.bfloat16, 96)):
        torch.manual_seed(D)
        k_cache, v_cache, md = _prefill_case([40, 7], [0, 30], 16, 2, D, dtype)
        q = _rand(47, 4, D, dtype=dtype, device="cuda")
        k_cache, v_cache, tables = k_cache.cuda(), v_cache.cuda(), md.block_tables.cuda()
        assert not prefill_kernel_applies(q, k_cache)
        out, expected = torch.zeros_like(q), torch.zeros_like(q)
        paged_prefill_attention(q, k_cache, v_cache, tables, md.query_start_loc, md.seq_lens, (0, 1), 0.1, out)
        paged_prefill_attention_sdpa(q, k_cache, v_cache, tables, md.query_start_loc, md.seq_lens, (0, 1), 0.1,
                                     expected)  # fmt: skip
        assert torch.equal(out, expected)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("Hkv, D", [(8, 128), (2, 24), (3, 40)])
def test_write_kv_cache(dtype, Hkv, D):
    from atom.ops.paged_attention import write_kv_cache as write_kv_cache_ref

    torch.manual_seed(Hkv + D)
    num_blocks, block_size, T = 6, 16, 9
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    qkv = _rand(T, (4 + 2 * Hkv) * D, dtype=dtype)  # k and v as strided views of one projection
    k, v = qkv[:, 4 * D : (4 + Hkv) * D].view(T, Hkv, D), qkv[:, (4 + Hkv) * D :].view(T, Hkv, D)
    slots = torch.randperm(num_blocks * block_size)[:T]
    slots[4] = -1  # a padding row: writes nothing
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv_cache_ref(expected_k, expected_v, k[keep], v[keep], slots[keep])
    k_gpu, v_gpu, qkv_gpu = k_cache.cuda(), v_cache.cuda(), qkv.cuda()
    write_kv_cache(k_gpu, v_gpu, qkv_gpu[:, 4 * D : (4 + Hkv) * D].view(T, Hkv, D),
                   qkv_gpu[:, (4 + Hkv) * D :].view(T, Hkv, D), slots.cuda())
    assert torch.equal(k_gpu.cpu().nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(v_gpu.cpu().nan_to_num(7.0), expected_v.nan_to_num(7.0))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H, Hkv, D, block_size", [(32, 8, 64, 16), (16, 16, 128, 7), (12, 1, 40, 5), (4, 2, 256, 32)])
def test_rotary_write_kv(dtype, H, Hkv, D, block_size):
    """q, k and v as strided views of one projection; positions up to 131071; a padding row (slot -1) writes
    nothing. The rotated q and the caches equal the torch reference run on the GPU bit for bit (the same cosf and
    sinf, the same roundings), and the reference on the CPU within the tolerance (the CPU's cos and sin)."""
    from atom.layers.rotary import compute_inv_freq

    torch.manual_seed(H + D + block_size)
    T, num_blocks = 37, 9
    inv_freq = compute_inv_freq({"rope_type": "default", "rope_theta": 1000000.0}, D)
    qkv = _rand(T, (H + 2 * Hkv) * D + 3, dtype=dtype)
    views = lambda x: (x[:, : H * D].view(T, H, D), x[:, H * D : (H + Hkv) * D].view(T, Hkv, D),  # noqa: E731
                       x[:, (H + Hkv) * D : (H + 2 * Hkv) * D].view(T, Hkv, D))
    positions = torch.randint(0, 1 << 17, (T,))
    positions[:3] = torch.tensor([0, 1, 2])
    slots = torch.randperm(num_blocks * block_size)[:T]
    slots[5] = -1
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]  # CPU reference, GPU reference, kernel
    q_cpu = ref.rotary_write_kv_ref(*views(qkv), positions, inv_freq, *caches[0], slots)
    qkv_gpu, args = qkv.cuda(), (positions.cuda(), inv_freq.cuda())
    gpu_caches = [tuple(c.cuda() for c in pair) for pair in caches[1:]]
    q_ref = ref.rotary_write_kv_ref(*views(qkv_gpu), *args, *gpu_caches[0], slots.cuda())
    q_out = rotary_write_kv(*views(qkv_gpu), *args, *gpu_caches[1], slots.cuda())
    assert torch.equal(q_out.cpu(), q_ref.cpu())
    for out, expected in zip(gpu_caches[1], gpu_caches[0]):
        assert torch.equal(out.cpu().nan_to_num(7.0), expected.cpu().nan_to_num(7.0))
    tol = TOL[torch.float32] if dtype == torch.float32 else TOL[torch.bfloat16]
    assert rel_err(q_out, q_cpu) < tol
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for out, expected in zip(gpu_caches[1], caches[0]):
        out, expected = out.cpu().flatten(0, 1), expected.flatten(0, 1)
        assert out[~written].isnan().all()  # nothing else written
        assert rel_err(out[written], expected[written]) < tol
