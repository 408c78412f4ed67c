"""KDA decode kernels: the delta-rule step and the short conv, over slot-indexed state.

Both work in place on the layer's state pools (``KimiDeltaAttention.cache_spec``)::

    conv pool      [num_slots, 3*H*K, W-1]  model dtype
    state pool     [num_slots, H, K, V]     fp32

and take the engine's slot layout (``AttentionMetadata.state_slots`` /
``state_out_slots``; see ``atom.ops.cuda.reference``): read ``state_slots[b]``,
write ``out_slots[b]``, or with ``per_token`` the state after token t to
``out_slots[b] + t``. No host sync: safe inside a captured CUDA graph as long
as the tensors stay put.
"""

from __future__ import annotations

import torch

from atom.ops.cuda._launch import C, device_guard, dtype_code, kernels_apply, stream_of
from atom.ops.cuda.norm import gated_rmsnorm
from atom.ops.cuda.reference import conv1d_prefill_ref, conv1d_update_ref, kda_decode_ref


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    out_slots: torch.Tensor | None = None,
    per_token: bool = False,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """One KDA decode step (T tokens per sequence), updating ``state_pool`` in place.

    q, k: [B, H, K] or [B, T, H, K] raw conv outputs (the kernel l2-normalises
    both and scales q by ``scale``, default K^-0.5); each token's [H, K] must be
    contiguous, the batch/token strides are free (q, k, v may be views into one
    [B, 3*H*K] conv output). v: like q with V; g: like q, fp32 log-decay;
    beta: [B, H] or [B, T, H]; state_slots / out_slots: int64 [B] on the
    device (out_slots defaults to state_slots); has_initial_state: optional
    bool [B] (False: start from zeros).
    Returns o [B, (T,) H, V] in v's dtype, written into ``out`` if given
    (contiguous; a static buffer for CUDA graphs).

    out_norm (gate, weight, eps): returns KDA's output norm of o instead,
    ``gated_rmsnorm(o, gate, weight, eps)``, gate shaped like o, weight [V].
    On a GPU the kernel applies it before storing o where it can (the fast
    kernel, V = 128), with the same bits; elsewhere it runs after.
    """
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v, g, beta = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1)
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(
            f"kda_decode: q, k, g must share [B, T, H, K] and v, beta its [B, T, H]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    check_state_pool("kda_decode", state_pool, heads, key_dim, value_dim)
    scale = key_dim**-0.5 if scale is None else scale
    if out_norm is not None:
        gate, norm_weight, norm_eps = out_norm
        gate = gate.unsqueeze(1) if squeeze else gate
        if gate.shape != v.shape or norm_weight.shape != (value_dim,):
            raise ValueError(f"kda_decode: out_norm's gate must be shaped like o {tuple(v.shape)} and its weight "
                             f"[{value_dim}]; got {tuple(gate.shape)} and {tuple(norm_weight.shape)}")  # fmt: skip
    fuse_norm = (out_norm is not None and kernels_apply(q, k, v, g, beta, state_pool, state_slots, gate, norm_weight)
                 and C().kda_decode_fuses_norm(state_pool.data_ptr(), state_pool.stride(0), key_dim, value_dim))
    if out_norm is not None and not fuse_norm:
        o = kda_decode(q, k, v, g, beta, state_pool, state_slots, out_slots=out_slots, per_token=per_token,
                       has_initial_state=has_initial_state, scale=scale, eps=eps)
        normed = gated_rmsnorm(o, gate, norm_weight, norm_eps, out=None if out is None else out.view(o.shape))
        return out if out is not None else (normed.squeeze(1) if squeeze else normed)
    if not kernels_apply(q, k, v, g, beta, state_pool, state_slots):
        ref = kda_decode_ref(q, k, v, g, beta, state_pool, state_slots, out_slots, per_token, has_initial_state,
                             scale, eps)  # fmt: skip
        return _into(ref.squeeze(1) if squeeze else ref, out)

    check_slots_contiguous("kda_decode", state_pool)
    dtype = v.dtype
    norm_args = (0, 0, 0, 0.0)
    if fuse_norm:
        norm_gate, gate_stride = token_rows(token_major(gate.to(dtype)).flatten(2))
        norm_weight = norm_weight.to(dtype).contiguous()
        norm_args = (norm_gate.data_ptr(), gate_stride, norm_weight.data_ptr(), float(norm_eps))
    q, k = token_major(q.to(dtype)), token_major(k.to(dtype))
    v = token_major(v)
    g = g.float().contiguous()
    beta = beta.float().contiguous()
    ins, outs, init = slots_and_flags(state_slots, out_slots, has_initial_state, batch, v.device)
    result = output_buffer(out, (batch, tokens, heads, value_dim), dtype, v.device)
    with device_guard(v.device):
        C().kda_decode(
            q.data_ptr(), q.stride(0), q.stride(1),
            k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1),
            g.data_ptr(), beta.data_ptr(), state_pool.data_ptr(), state_pool.stride(0),
            ins.data_ptr(), outs.data_ptr(), per_token, init.data_ptr() if init is not None else 0, result.data_ptr(),
            batch, tokens, heads, key_dim, value_dim, float(scale), float(eps), *norm_args, dtype_code(dtype),
            stream_of(v.device),
        )  # fmt: skip
    return out if out is not None else (result.squeeze(1) if squeeze else result)


def conv1d_update(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    out_slots: torch.Tensor | None = None,
    per_token: bool = False,
    has_initial_state: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU for decode, updating ``conv_pool`` [slots, C, W-1] in place.

    x: [B, C] or [B, T, C] new raw inputs (model dtype); weight: [C, W] or the
    module's [C, 1, W]; slots and has_initial_state as for ``kda_decode``.
    Returns silu(conv) shaped like x, written into ``out`` if given (contiguous).
    """
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(1)
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    batch, tokens, channels = x.shape
    width = weight.shape[-1]
    if weight.shape[0] != channels or conv_pool.shape[1:] != (channels, width - 1):
        raise ValueError(f"conv1d_update: need weight [{channels}, W] and conv_pool [slots, {channels}, W-1]; "
                         f"got {tuple(weight.shape)} and {tuple(conv_pool.shape)}")
    if not kernels_apply(x, conv_pool, weight, state_slots) or not 2 <= width <= 5:
        ref = conv1d_update_ref(x, conv_pool, weight, state_slots, out_slots, per_token, has_initial_state)
        return _into(ref.squeeze(1) if squeeze else ref, out)

    if not conv_pool[0].is_contiguous():
        raise ValueError("conv1d_update: each slot of conv_pool must be one contiguous [C, W-1] block")
    dtype = conv_pool.dtype
    x, row_stride = token_rows(x.to(dtype))  # a column slice of a wider projection's rows is read in place
    weight = weight.to(dtype).contiguous()
    ins, outs, init = slots_and_flags(state_slots, out_slots, has_initial_state, batch, x.device)
    result = output_buffer(out, tuple(x.shape), dtype, x.device)
    with device_guard(x.device):
        C().conv1d_update(
            x.data_ptr(), row_stride, conv_pool.data_ptr(), conv_pool.stride(0), weight.data_ptr(), ins.data_ptr(),
            outs.data_ptr(), per_token, init.data_ptr() if init is not None else 0, result.data_ptr(), batch, tokens,
            channels, width, dtype_code(dtype), stream_of(x.device),
        )  # fmt: skip
    return out if out is not None else (result.squeeze(1) if squeeze else result)


def conv1d_prefill(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    out_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``conv1d_update`` for prefills: x [T, C] holds packed sequences, sequence b in rows
    [cu_seqlens[b], cu_seqlens[b + 1]) (int64 [B + 1]); its inputs before its first row come
    from slot state_slots[b] and its last W-1 inputs become slot out_slots[b] (slots and
    has_initial_state as for ``kda_decode``, one slot per sequence). Returns silu(conv) [T, C],
    written into ``out`` if given. On a GPU the rows are computed in parallel, 16 to a thread.
    """
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    rows, channels = x.shape
    width, batch = weight.shape[-1], cu_seqlens.numel() - 1
    if weight.shape[0] != channels or conv_pool.shape[1:] != (channels, width - 1):
        raise ValueError(f"conv1d_prefill: need weight [{channels}, W] and conv_pool [slots, {channels}, W-1]; "
                         f"got {tuple(weight.shape)} and {tuple(conv_pool.shape)}")  # fmt: skip
    if not kernels_apply(x, conv_pool, weight, state_slots, cu_seqlens) or not 2 <= width <= 5:
        ref = conv1d_prefill_ref(x, cu_seqlens, conv_pool, weight, state_slots, out_slots, has_initial_state)
        return _into(ref, out)
    if not conv_pool[0].is_contiguous():
        raise ValueError("conv1d_prefill: each slot of conv_pool must be one contiguous [C, W-1] block")
    dtype = conv_pool.dtype
    x = x.to(dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.to(dtype).contiguous()
    ins, outs, init = slots_and_flags(state_slots, out_slots, has_initial_state, batch, x.device)
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64).contiguous()
    result = output_buffer(out, (rows, channels), dtype, x.device)
    with device_guard(x.device):
        C().conv1d_prefill(
            x.data_ptr(), max(x.stride(0), channels), cu.data_ptr(), batch, rows, conv_pool.data_ptr(),
            conv_pool.stride(0), weight.data_ptr(), ins.data_ptr(), outs.data_ptr(),
            init.data_ptr() if init is not None else 0, result.data_ptr(), channels, width, dtype_code(dtype),
            stream_of(x.device),
        )  # fmt: skip
    return out if out is not None else result


def output_buffer(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The kernel's contiguous output buffer: ``out`` viewed as ``shape``, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.dtype != dtype or out.numel() != _numel(shape) or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous {dtype} tensor of {_numel(shape)} elements on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out.view(shape)


def _into(value: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value.view(out.shape))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def check_state_pool(op: str, state_pool: torch.Tensor, heads: int, key_dim: int, value_dim: int) -> None:
    if state_pool.dtype != torch.float32 or state_pool.shape[1:] != (heads, key_dim, value_dim):
        raise ValueError(f"{op}: state_pool must be fp32 [slots, {heads}, {key_dim}, {value_dim}], "
                         f"got {state_pool.dtype} {tuple(state_pool.shape)}")


def check_slots_contiguous(op: str, state_pool: torch.Tensor) -> None:
    if not state_pool[0].is_contiguous():
        raise ValueError(f"{op}: each slot of state_pool must be one contiguous [H, K, V] block")


def token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [B, T, C] as B * T evenly spaced rows (row b * T + t), each contiguous: (x, or a contiguous copy
    where its layout is not that, and the elements between rows, at least C)."""
    batch, tokens, width = x.shape
    stride = x.stride(1) if tokens > 1 else x.stride(0)
    if x.stride(2) != 1 or (batch > 1 and x.stride(0) != tokens * stride) or (batch * tokens > 1 and stride < width):
        return x.contiguous(), width
    return x, max(stride, width)  # one row: its stride is never used


def token_major(x: torch.Tensor) -> torch.Tensor:
    """[..., H, D] whose per-token [H, D] is contiguous; copies only when it is not."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


def slots_and_flags(state_slots: torch.Tensor, out_slots: torch.Tensor | None,
                    has_initial_state: torch.Tensor | None, batch: int, device) -> tuple:  # fmt: skip
    """(in slots, out slots, initial-state flags): what every slot-pool kernel takes."""
    return (*_slots(state_slots, out_slots, batch, device), _flags(has_initial_state, device))


def _slots(state_slots: torch.Tensor, out_slots: torch.Tensor | None, batch: int, device) -> tuple:
    """(in, out) slot ids as contiguous int64 [B] device tensors (no copy when they already are)."""
    ins = state_slots.reshape(batch).to(device=device, dtype=torch.int64).contiguous()
    if out_slots is None:
        return ins, ins
    return ins, out_slots.reshape(batch).to(device=device, dtype=torch.int64).contiguous()


def _flags(has_initial_state: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if has_initial_state is None:
        return None
    flags = has_initial_state.to(device=device)
    # a bool tensor is already one byte of 0/1 per flag: read it as uint8 in place (no cast kernel)
    flags = flags.view(torch.uint8) if flags.dtype == torch.bool else flags.to(torch.uint8)
    return flags.contiguous()
