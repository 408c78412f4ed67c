"""KDA prefill over varlen packed sequences, updating the slot-indexed fp32 state pool.

Two implementations of the same contract (``kda_prefill``):

    atom   csrc/kda_prefill.cu: chunked (WY) form; its chunk scan on tensor cores (tf32 operands, fp32
           accumulation and state) or on CUDA cores (fp32 throughout), ``ATOM_KDA_SCAN``
    fla    flash-linear-attention's Triton ``chunk_kda``, where ``fla`` is importable

``ATOM_KDA_PREFILL=auto|atom|fla`` picks one (default ``auto``: ours). On an
H200, bf16, H = 32, K = V = 128, ours with the tf32 scan took 1.76, 1.56 and
1.79 ms for 8 x 2048, 1 x 8192 and 32 x 512 tokens against fla 0.6.0's 3.03,
1.78 and 2.51 ms in the same run, and was closer to the fp32 result (output
1.3e-3 from the fp32 scan, fla 4.4e-3; GPU_NOTES.md, session 18).
``ATOM_KDA_SCAN=auto|tf32|fp32`` picks our scan: ``auto`` takes tf32 for
bf16/fp16 inputs on NVIDIA GPUs of compute capability >= 8.0 and fp32
otherwise, so fp32 inputs meet the 1e-5 fp32 tolerance. fla's definitions match ours (g: per-channel log-decay; beta: after
the sigmoid; q, k l2-normalised with eps 1e-6 inside the sqrt, q scaled by
K^-0.5; state [K, V] fp32), so only the slot gather/scatter is ours on that
path; it does not take padding sequences (slot < 0).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from atom.ops.cuda._launch import C, device_guard, dtype_code, kernels_apply, stream_of
from atom.ops.cuda.kda import (check_slots_contiguous, check_state_pool, output_buffer, slots_and_flags,
                               token_major)
from atom.ops.cuda.reference import kda_prefill_ref

BACKENDS = ("auto", "atom", "fla")
# The atom path's chunk scan (csrc/ops.h, KdaScan): fp32 on CUDA cores, or tf32 operands on tensor cores with
# fp32 accumulation and state (NVIDIA, compute capability >= 8.0). 'auto' takes tf32 for bf16/fp16 inputs where
# it runs, fp32 otherwise. ``ATOM_KDA_SCAN`` sets the default.
SCANS = {"auto": 0, "fp32": 1, "tf32": 2}
FLA_HEAD_DIMS = (128, 128)  # (K, V) where fla was measured (Triton autotunes its kernels afresh per head size)


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


def prefill_backend() -> str:
    """'atom' or 'fla': which implementation ``kda_prefill`` runs (``ATOM_KDA_PREFILL``; 'auto' is ours)."""
    choice = os.environ.get("ATOM_KDA_PREFILL", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"ATOM_KDA_PREFILL must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "fla" and not fla_available():
        raise RuntimeError("ATOM_KDA_PREFILL=fla needs flash-linear-attention (`pip install flash-linear-attention`); "
                           "or set ATOM_KDA_PREFILL=atom")
    return "atom" if choice == "auto" else choice


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
    scan: str | None = None,
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
    ``ATOM_KDA_PREFILL``; ``scan`` (a ``SCANS`` name) overrides ``ATOM_KDA_SCAN``
    on the atom path. Returns o [T, H, V] in v's dtype, written into ``out``
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
    scan = scan or os.environ.get("ATOM_KDA_SCAN", "auto")
    if scan not in SCANS:
        raise ValueError(f"kda_prefill: scan (ATOM_KDA_SCAN) must be one of {', '.join(SCANS)}, got {scan!r}")
    scale = key_dim**-0.5 if scale is None else scale
    if not kernels_apply(q, k, v, g, beta, cu_seqlens, state_pool, state_slots) or key_dim > 128:
        ref = kda_prefill_ref(q, k, v, g, beta, cu_seqlens, state_pool, state_slots, out_slots, has_initial_state,
                              scale, eps)  # fmt: skip
        return ref if out is None else out.copy_(ref)
    ins, outs, init = slots_and_flags(state_slots, out_slots, has_initial_state, num_seqs, v.device)
    if (backend or prefill_backend()) == "fla" and eps == 1e-6:
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
    with device_guard(v.device):
        C().kda_prefill(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), g.data_ptr(),
            beta.data_ptr(), cu.data_ptr(), dtype_code(cu.dtype), state_pool.data_ptr(), state_pool.stride(0),
            ins.data_ptr(), outs.data_ptr(), init.data_ptr() if init is not None else 0, result.data_ptr(),
            workspace.data_ptr(), tokens, num_seqs, heads, key_dim, value_dim, float(scale), float(eps),
            dtype_code(dtype), SCANS[scan], stream_of(v.device),
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
