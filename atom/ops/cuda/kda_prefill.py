"""KDA prefill over varlen packed sequences, updating the slot-indexed fp32 state pool.

Two implementations of the same contract (``kda_prefill``):

    atom   csrc/kda_prefill.cu: chunked (WY) form, CUDA cores, fp32 inside
    fla    flash-linear-attention's Triton ``chunk_kda``, where ``fla`` is importable

``ATOM_KDA_PREFILL=auto|atom|fla`` picks one (default ``auto``). fla's
definitions match ours (g: per-channel log-decay; beta: after the sigmoid;
q, k l2-normalised with eps 1e-6 inside the sqrt, q scaled by K^-0.5; state
[K, V] fp32), so only the slot gather/scatter is ours on that path. ``auto``
takes fla for bf16/fp16 inputs at the head size it was measured at (K = V =
128, Kimi-Linear's) where it is importable (``AUTO_PICKS_FLA``: it measured
1.7-2.1x faster than ours on an H200) and ours otherwise (Triton autotunes
fla's kernels afresh for every head size, which took minutes per shape); fp32
inputs always take ours, which meets the 1e-5 fp32 tolerance (fla's Triton
matmuls round to bf16/tf32: 4.4e-3 from ours on bf16 inputs). The fla path
gathers/scatters the slots around ``chunk_kda`` and does not take padding
sequences (slot < 0).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from atom.ops.cuda._launch import C, dtype_code, kernels_apply, stream_of
from atom.ops.cuda.kda import (check_slots_contiguous, check_state_pool, output_buffer, slots_and_flags,
                               token_major)
from atom.ops.cuda.reference import kda_prefill_ref

BACKENDS = ("auto", "atom", "fla")
# H200, bf16, H=32, K=V=128 (GPU_NOTES.md, session 10, bench/kernels_gpu.py --only kda_prefill): fla 2.4 / 3.2 /
# 2.7 ms vs ours 5.0 / 5.3 / 5.1 ms for 8 x 2048, 1 x 8192 and 32 x 512 tokens: fla is 1.7-2.1x faster.
AUTO_PICKS_FLA = True
FLA_HEAD_DIMS = (128, 128)  # (K, V) where that was measured


@functools.cache
def fla_available() -> bool:
    """Whether fla's ``chunk_kda`` imports here (fla installed with its dependencies, e.g. einops)."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        importlib.import_module("fla.ops.kda")
    except ImportError:
        return False
    return True


def prefill_backend(dtype: torch.dtype, key_dim: int = 128, value_dim: int = 128) -> str:
    """'atom' or 'fla': which implementation ``kda_prefill`` runs for inputs of ``dtype`` and head size K x V."""
    choice = os.environ.get("ATOM_KDA_PREFILL", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"ATOM_KDA_PREFILL must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "fla" and not fla_available():
        raise RuntimeError("ATOM_KDA_PREFILL=fla needs flash-linear-attention (`pip install flash-linear-attention`); "
                           "or set ATOM_KDA_PREFILL=atom")
    if choice == "auto":
        takes_fla = dtype != torch.float32 and (key_dim, value_dim) == FLA_HEAD_DIMS
        return "fla" if AUTO_PICKS_FLA and takes_fla and fla_available() else "atom"
    return choice


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    out_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-6,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """KDA over the packed tokens of N sequences, each from its slot's state; writes each final state back.

    q, k: [T, H, K] raw conv outputs (l2-normalised here, q also scaled by
    ``scale``, default K^-0.5); each token's [H, K] contiguous, the token stride
    free (q, k, v may be views into one [T, 3*H*K] tensor). v: [T, H, V];
    g: [T, H, K] fp32 log-decay (<= 0); beta: [T, H]; cu_seqlens: [N + 1]
    int32/int64 on the device, sequence n = tokens [cu[n], cu[n + 1]).
    state_pool [slots, H, K, V] fp32; state_slots / out_slots int64 [N] (out
    defaults to in); has_initial_state bool [N] (False: start from zeros).
    state_slots[n] < 0 (a padding sequence: zero output, no state touched)
    only on the atom path. ``backend``: 'atom' or 'fla' overrides
    ``ATOM_KDA_PREFILL``. Returns o [T, H, V] in v's dtype, written into ``out``
    if given (contiguous).
    """
    tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    if k.shape != q.shape or g.shape != q.shape or v.shape[:2] != q.shape[:2] or beta.shape != q.shape[:2]:
        raise ValueError(
            f"kda_prefill: q, k, g must share [T, H, K] and v, beta its [T, H]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    check_state_pool("kda_prefill", state_pool, heads, key_dim, value_dim)
    scale = key_dim**-0.5 if scale is None else scale
    if not kernels_apply(q, k, v, g, beta, cu_seqlens, state_pool, state_slots) or key_dim > 128:
        ref = kda_prefill_ref(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, out_slots, has_initial_state,
                              scale, eps)  # fmt: skip
        return ref if out is None else out.copy_(ref)
    ins, outs, init = slots_and_flags(state_slots, out_slots, has_initial_state, num_seqs, v.device)
    if (backend or prefill_backend(v.dtype, key_dim, value_dim)) == "fla" and eps == 1e-6:
        o = _fla_prefill(q, k, v, g, beta, cu_seqlens, state_pool, ins, outs, has_initial_state, scale)
        return o if out is None else out.copy_(o)

    check_slots_contiguous("kda_prefill", state_pool)
    dtype = v.dtype
    q, k, v = (token_major(t.to(dtype)) for t in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    cu = cu_seqlens if cu_seqlens.dtype in (torch.int32, torch.int64) else cu_seqlens.long()
    cu = cu.contiguous()
    result = output_buffer(out, (tokens, heads, value_dim), dtype, v.device)
    workspace = torch.empty(C().kda_prefill_workspace_floats(tokens, num_seqs, heads), dtype=torch.float32,
                            device=v.device)  # fmt: skip
    with torch.cuda.device(v.device):
        C().kda_prefill(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), g.data_ptr(),
            beta.data_ptr(), cu.data_ptr(), dtype_code(cu.dtype), state_pool.data_ptr(), state_pool.stride(0),
            ins.data_ptr(), outs.data_ptr(), init.data_ptr() if init is not None else 0, result.data_ptr(),
            workspace.data_ptr(), tokens, num_seqs, heads, key_dim, value_dim, float(scale), float(eps),
            dtype_code(dtype), stream_of(v.device),
        )  # fmt: skip
    return out if out is not None else result


def _fla_prefill(q, k, v, g, beta, cu_seqlens, state_pool, ins, outs, has_initial_state, scale) -> torch.Tensor:
    """The same through fla's ``chunk_kda`` (varlen, normalisation in its kernel); slots gathered/scattered here."""
    from fla.ops.kda import chunk_kda

    initial = state_pool[ins]  # [N, H, K, V] fp32 copy: every read before the write below
    if has_initial_state is not None:
        initial = torch.where(has_initial_state.to(device=initial.device, dtype=torch.bool)[:, None, None, None],
                              initial, 0)  # fmt: skip
    dtype = v.dtype
    o, final = chunk_kda(
        q.to(dtype).contiguous().unsqueeze(0), k.to(dtype).contiguous().unsqueeze(0), v.contiguous().unsqueeze(0),
        g.float().contiguous().unsqueeze(0), beta.float().contiguous().unsqueeze(0), scale=scale,
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens.long(),
    )  # fmt: skip
    state_pool[outs] = final.float()
    return o[0].to(dtype)
