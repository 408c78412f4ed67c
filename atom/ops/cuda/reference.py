"""Torch references of the ``atom._C`` kernels, with the kernels' exact signatures.

They run anywhere (CPU or GPU), compute in fp32 and round where the model's
own reference path rounds, and are what ``tests/test_kernels_gpu.py``
compares each kernel with. They are written for clarity, not speed (host
loops, host syncs).

Slot layout shared by ``kda_decode_ref`` and ``conv1d_update_ref``, the same
as ``AttentionMetadata.state_slots`` / ``state_out_slots``::

    state_slots[b]           the slot read (the state before this step)
    out_slots[b]             where the state after the last token goes (default: state_slots)
    per_token=True           the state after token t goes to out_slots[b] + t instead
                             (1 + k speculative tokens: whichever prefix is accepted,
                             its state is already stored)
    state_slots[b] < 0       padding row: output zeros, no state read or written
    has_initial_state[b]     False: start from zeros instead of the slot's contents

A sequence's reads happen before its writes (its out slots may include its
in slot); different sequences' slots must not overlap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.ops.cuda.fused import rms_normalize
from atom.ops.kda import kda_recurrent, kda_recurrent_states, l2norm
from atom.ops.rotary import apply_rotary, rotary_cos_sin


def _slot_rows(
    state_slots: torch.Tensor, out_slots: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(in slots [B], out slots [B], indices of non-padding rows), int64."""
    ids = state_slots.reshape(-1).long()
    outs = ids if out_slots is None else out_slots.reshape(-1).long()
    return ids, outs, (ids >= 0).nonzero().flatten()


def _initial(pool: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, has_initial_state) -> torch.Tensor:
    state = pool[ids[rows]].float()
    if has_initial_state is not None:
        keep = has_initial_state.to(device=pool.device, dtype=torch.bool)[rows]
        state = torch.where(keep.view(-1, *([1] * (state.dim() - 1))), state, torch.zeros_like(state))
    return state


def kda_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    out_slots: torch.Tensor | None = None,
    per_token: bool = False,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """KDA decode step in place on ``state_pool`` [slots, H, K, V] fp32; returns o [B, T, H, V] in v's dtype.

    q, k: [B, T, H, K] raw (normalised here: l2norm, q also * scale, K^-0.5 by
    default); v: [B, T, H, V]; g: [B, T, H, K] fp32 log-decay; beta: [B, T, H].
    Per token: S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q.
    """
    batch, tokens, heads, key_dim = q.shape
    scale = key_dim**-0.5 if scale is None else scale
    ids, outs, rows = _slot_rows(state_slots, out_slots)
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if rows.numel() == 0:
        return out
    state = _initial(state_pool, ids, rows, has_initial_state)  # [R, H, K, V]
    qn = l2norm(q[rows].float(), eps) * scale
    kn = l2norm(k[rows].float(), eps)
    o, states = kda_recurrent_states(qn, kn, v[rows].float(), g[rows].float(), beta[rows].float(), state)
    out[rows] = o.to(v.dtype)
    if per_token:
        for t in range(tokens):
            state_pool[outs[rows] + t] = states[:, t].to(state_pool.dtype)
    else:
        state_pool[outs[rows]] = states[:, -1].to(state_pool.dtype)
    return out


def kda_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    out_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """KDA prefill of packed sequences, in place on ``state_pool``; returns o [T, H, V] in v's dtype.

    q, k: [T, H, K] raw; v: [T, H, V]; g: [T, H, K] fp32 log-decay; beta:
    [T, H]; sequence n is tokens [cu_seqlens[n], cu_seqlens[n + 1]). Slots as
    for ``kda_decode_ref`` (final state only). Token by token, like the model.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ids, outs, rows = _slot_rows(state_slots, out_slots)
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    finals = {}
    for n in rows.tolist():
        lo, hi = bounds[n], bounds[n + 1]
        state = _initial(state_pool, ids, torch.tensor([n], device=ids.device), has_initial_state)  # [1, H, K, V]
        qn = l2norm(q[lo:hi].float(), eps) * scale
        seq = (t[lo:hi].float().unsqueeze(0) for t in (k, v, g, beta))
        kn, vs, gs, bs = seq
        o, finals[n] = kda_recurrent(qn.unsqueeze(0), l2norm(kn, eps), vs, gs, bs, state)
        out[lo:hi] = o[0].to(v.dtype)
    for n, state in finals.items():  # every read before any write
        state_pool[outs[n]] = state[0].to(state_pool.dtype)
    return out


def conv1d_update_ref(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    state_slots: torch.Tensor,
    out_slots: torch.Tensor | None = None,
    per_token: bool = False,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU for decode, in place on ``conv_pool`` [slots, C, W-1].

    x: [B, T, C] new raw inputs; weight: [C, W]. Per token: window = [state, x_t];
    y = silu(round(sum(weight * window))) (fp32 sum, rounded to x's dtype as
    torch's conv1d output is); state = window[1:]. Returns y [B, T, C].
    """
    tokens = x.shape[1]
    ids, outs, rows = _slot_rows(state_slots, out_slots)
    out = torch.zeros_like(x)
    if rows.numel() == 0:
        return out
    state = _initial(conv_pool, ids, rows, has_initial_state)  # [R, C, W-1] fp32 (values exact)
    w = weight.float()
    for t in range(tokens):
        window = torch.cat([state, x[rows, t].float().unsqueeze(-1)], dim=-1)  # [R, C, W]
        y = (window * w).sum(-1).to(x.dtype)
        out[rows, t] = F.silu(y.float()).to(x.dtype)
        state = window[..., 1:]
        if per_token:
            conv_pool[outs[rows] + t] = state.to(conv_pool.dtype)
    if not per_token:
        conv_pool[outs[rows]] = state.to(conv_pool.dtype)
    return out


def conv1d_prefill_ref(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    state_slots: torch.Tensor,
    out_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """``conv1d_update_ref`` over packed sequences: sequence b is rows [cu_seqlens[b], cu_seqlens[b+1])
    of x [T, C], its state in slot state_slots[b], written to out_slots[b]. Returns y [T, C].
    Sequence by sequence, so slots must not be shared between sequences (the kernel reads every
    old state before it writes any)."""
    bounds = cu_seqlens.tolist()
    ins = state_slots.reshape(-1)
    outs = ins if out_slots is None else out_slots.reshape(-1)
    flags = None if has_initial_state is None else has_initial_state.reshape(-1)
    out = torch.zeros_like(x)
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        flag = None if flags is None else flags[b : b + 1]
        out[lo:hi] = conv1d_update_ref(x[None, lo:hi], conv_pool, weight, ins[b : b + 1], outs[b : b + 1], False,
                                       flag)[0]  # fmt: skip
    return out


def gated_rmsnorm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(weight * (x * rsqrt(mean(x^2) + eps))) * sigmoid(gate), fp32 inside, in x's dtype."""
    return (weight.float() * rms_normalize(x, eps) * torch.sigmoid(gate.float())).to(x.dtype)


def mla_decode_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode query per sequence over its first seq_lens[b] cached rows; fp32 [B, H, rank].

    q_latent [B, H, rank], q_pe [B, H, rope]; latent_cache [num_blocks,
    block_size, rank + rope]; block_tables [B, max_blocks]; seq_lens [B].
    """
    batch, _, rank = q_latent.shape
    block_size = latent_cache.shape[1]
    out = torch.zeros(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[b, : -(-length // block_size)].long()
        kv = latent_cache[blocks].flatten(0, 1)[:length].float()  # [L, rank + rope]
        q = torch.cat([q_latent[b], q_pe[b]], dim=-1).float()  # [H, rank + rope]
        probs = torch.softmax(q @ kv.T * scale, dim=-1)
        out[b] = probs @ kv[:, :rank]
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode query per row over its first seq_lens[t] cached positions (GQA); fp32 [T, H, D].

    q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [T, max_blocks];
    query head h reads kv head h // (H // Hkv). A row of length 0 gives zeros.
    """
    rows, heads, _ = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for t, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[t, : -(-length // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        v = v_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(heads // kv_heads, dim=1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[t].float(), k) * scale, dim=-1)
        out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out


def write_latent_cache_ref(
    latent_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """latent_cache row at slot_mapping[t] = [latent[t] | rope[t]]; negative slots skipped."""
    rows = latent_cache.view(-1, latent_cache.shape[-1])
    keep = slot_mapping >= 0
    values = torch.cat([latent, rope], dim=-1)[keep].to(latent_cache.dtype)
    rows.index_copy_(0, slot_mapping[keep].long(), values)


def rotary_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotated q [T, H, D]; the rotated k and v [T, Hkv, D] written into the caches [num_blocks, block_size, Hkv,
    D] at slot_mapping (a negative slot: not written). Rounds as the layer's torch path."""
    cos, sin = rotary_cos_sin(positions, inv_freq, q.dtype)
    q_rot, k_rot = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.flatten(0, 1)[slots] = k_rot[keep].to(k_cache.dtype)
    v_cache.flatten(0, 1)[slots] = v[keep].to(v_cache.dtype)
    return q_rot
