"""MLA decode kernels over the paged latent cache [num_blocks, block_size, rank + rope].

``mla_decode`` is the absorbed-form decode attention (one query token per
row; for 1 + k speculative tokens pass one row per token with its own
seq_len and the sequence's block-table row repeated). ``write_latent_cache``
stores this step's rows at ``slot_mapping``.
"""

from __future__ import annotations

import torch

from atom.forward_context import upload
from atom.ops.cuda._launch import C, device_guard, dtype_code, kernels_apply, num_sms, stream_of, wave_splits
from atom.ops.cuda.reference import mla_decode_ref, write_latent_cache_ref

# The tensor-core kernels: one block of 16 warps per (sequence, 32 heads, split),
# 64 positions per tile, 200-225 KB of shared memory (one block per SM).
_TC_HEADS, _TC_TILE = 32, 64
# The CUDA-core kernel: one block per (sequence, head, split), 32-position tiles.
_CC_TILE, _CC_BLOCKS_PER_SM = 32, 8


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | list[int],
    scale: float,
    *,
    max_seq_len: int | None = None,
    out_dtype: torch.dtype = torch.float32,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    kernel: int = 0,
) -> torch.Tensor:
    """softmax((q_latent . c + q_pe . k_rot) * scale) @ c over each row's first seq_lens[b] positions.

    q_latent [B, H, rank], q_pe [B, H, rope] (cache dtype); block_tables
    [B, max_blocks] and seq_lens [B] int32/int64 on the device (a host list
    is uploaded here). max_seq_len
    (host int, an upper bound is fine) sizes the split of long sequences over
    SMs without a host sync; by default the block table's capacity. Returns
    [B, H, rank] in out_dtype, or writes ``out`` (contiguous, its dtype wins).
    ``kernel`` forces one implementation (``MlaKernel`` in csrc/ops.h: 1 CUDA
    cores, 2-6 tensor-core variants, 7 warpgroup MMAs on sm_90a, 8 the same
    with 2-8 splits merged in a thread-block cluster) for tests and
    benchmarks; 0 picks.
    """
    batch, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    if not isinstance(seq_lens, torch.Tensor):  # host list (AttentionMetadata.seq_lens): one upload
        max_seq_len = max(seq_lens, default=0) if max_seq_len is None else max_seq_len
        seq_lens = upload(seq_lens, torch.int32, q_latent.device)
    _, block_size, row = latent_cache.shape
    if row != rank + rope or q_pe.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"mla_decode: cache rows hold {row} values but q_latent/q_pe give {rank} + {rope}")
    if out is not None:
        out_dtype = out.dtype
    if not kernels_apply(q_latent, q_pe, latent_cache, block_tables, seq_lens):
        ref = mla_decode_ref(q_latent, q_pe, latent_cache, block_tables, seq_lens, scale).to(out_dtype)
        return ref if out is None else out.copy_(ref)

    if latent_cache.stride(2) != 1:
        raise ValueError("mla_decode: cache rows must be contiguous")
    dtype = latent_cache.dtype
    q_latent = q_latent.to(dtype).contiguous()
    q_pe = q_pe.to(dtype).contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    tensor_cores = kernel >= 2 or (kernel == 0 and _tensor_core_case(dtype, rank, rope))
    if num_splits is None:
        num_splits = choose_num_splits(batch, heads, max_seq_len, num_sms(q_latent.device), tensor_cores)
    if out is None:
        out = torch.empty(batch, heads, rank, dtype=out_dtype, device=q_latent.device)
    elif tuple(out.shape) != (batch, heads, rank) or not out.is_contiguous():
        raise ValueError(f"mla_decode: out must be contiguous [{batch}, {heads}, {rank}], got {tuple(out.shape)}")
    o_part = lse_part = None
    with device_guard(q_latent.device):  # (the cluster kernel's occupancy is the current device's)
        if num_splits > 1 and C().mla_decode_needs_workspace(
            q_latent.data_ptr(), q_pe.data_ptr(), latent_cache.data_ptr(), latent_cache.stride(0),
            latent_cache.stride(1), batch, heads, rank, rope, num_splits, dtype_code(dtype), kernel,
        ):  # a kernel that merges the splits inside a thread-block cluster needs none
            o_part = torch.empty(batch, num_splits, heads, rank, dtype=torch.float32, device=q_latent.device)
            lse_part = torch.empty(batch, num_splits, heads, dtype=torch.float32, device=q_latent.device)
        C().mla_decode(
            q_latent.data_ptr(), q_pe.data_ptr(), latent_cache.data_ptr(), latent_cache.stride(0),
            latent_cache.stride(1), block_size, block_tables.data_ptr(), block_tables.stride(0),
            dtype_code(block_tables.dtype), seq_lens.data_ptr(), dtype_code(seq_lens.dtype), out.data_ptr(),
            o_part.data_ptr() if o_part is not None else 0, lse_part.data_ptr() if lse_part is not None else 0,
            batch, heads, rank, rope, num_splits, float(scale), dtype_code(dtype), dtype_code(out_dtype),
            kernel, stream_of(q_latent.device),
        )  # fmt: skip
    return out


def write_latent_cache(
    latent_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Cache row at slot_mapping[t] (block * block_size + offset) = [latent[t] | rope[t]]; slot < 0 skips.

    latent [T, rank] and rope [T, rope_dim] may be strided views (e.g. the two
    parts of kv_a_proj's output); the last dim must be contiguous.
    """
    num_tokens, rank = latent.shape
    rope_dim = rope.shape[-1]
    if latent_cache.shape[-1] != rank + rope_dim:
        raise ValueError(f"write_latent_cache: cache rows hold {latent_cache.shape[-1]}, got {rank} + {rope_dim}")
    if not kernels_apply(latent_cache, latent, rope, slot_mapping):
        write_latent_cache_ref(latent_cache, latent, rope, slot_mapping)
        return
    dtype = latent_cache.dtype
    latent = latent.to(dtype)
    rope = rope.to(dtype)
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    if rope.stride(-1) != 1:
        rope = rope.contiguous()
    if latent_cache.stride(2) != 1:
        raise ValueError("write_latent_cache: cache rows must be contiguous")
    with device_guard(latent_cache.device):
        C().write_latent_cache(
            latent_cache.data_ptr(), latent_cache.stride(0), latent_cache.stride(1), latent_cache.shape[1],
            latent.data_ptr(), latent.stride(0), rope.data_ptr(), rope.stride(0), slot_mapping.data_ptr(),
            dtype_code(slot_mapping.dtype), num_tokens, rank, rope_dim, dtype_code(dtype),
            stream_of(latent_cache.device),
        )  # fmt: skip


def choose_num_splits(batch: int, heads: int, max_seq_len: int, sms: int, tensor_cores: bool) -> int:
    """How many blocks share one sequence's positions (``wave_splits``): batch 64 x 32 heads on 132 SMs
    -> 2 splits (128 blocks, one wave), not 3 (192 blocks, 1.45 waves)."""
    if tensor_cores:
        blocks, slots, tile = batch * -(-heads // _TC_HEADS), sms, _TC_TILE
    else:
        blocks, slots, tile = batch * heads, sms * _CC_BLOCKS_PER_SM, _CC_TILE
    return wave_splits(blocks, slots, max(1, -(-max_seq_len // tile)))


def _tensor_core_case(dtype: torch.dtype, rank: int, rope: int) -> bool:
    return dtype == torch.bfloat16 and rank == 512 and rope == 64 and bool(C().mla_decode_has_tensor_cores())
