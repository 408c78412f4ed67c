"""Paged KV cache write and causal GQA attention over it (torch reference).

Cache layout, per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim].
A token's flat slot is ``block_id * block_size + offset``; sequence i's blocks are
listed in ``block_tables[i]``.

One sequence in a step (chunked prefill or decode)::

    positions:  0 ............ ctx-1 | ctx ........ seq_len-1
                already in the cache | new tokens (query_len = seq_len - ctx)

New token j sits at position ctx + j and attends to positions 0 .. ctx + j,
read back from the cache after this step's K/V were written.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from atom.forward_context import AttentionMetadata, upload


def write_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' k, v [T, num_kv_heads, head_dim] into their slots."""
    k_cache.flatten(0, 1).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.flatten(0, 1).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_seq(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len tokens from the cache -> [seq_len, num_kv_heads, head_dim]."""
    num_blocks = -(-seq_len // cache.shape[1])
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


def gather_seqs(cache: torch.Tensor, block_tables: torch.Tensor, seqs: Sequence[int],
                seq_lens: Sequence[int]) -> torch.Tensor:  # fmt: skip
    """Sequences seqs[i]'s first seq_lens[i] tokens from the cache, one after another -> [sum, ...]: one gather
    whatever the count (the rows' block-table entries looked up on the device), where a gather a sequence would
    cost a step of many short sequences several launches each. Nothing here waits for the device."""
    if len(seqs) == 1:
        return gather_seq(cache, block_tables[seqs[0]], seq_lens[0])
    where = _row_lookup(tuple(seqs), tuple(seq_lens), cache.shape[1], cache.device)
    slots = block_tables[where[0], where[1]] * cache.shape[1] + where[2]
    return cache.flatten(0, 1)[slots]


@functools.lru_cache(maxsize=16)  # every layer of a step asks for the same rows
def _row_lookup(seqs: tuple[int, ...], seq_lens: tuple[int, ...], block_size: int,
                device: torch.device) -> torch.Tensor:  # fmt: skip
    """[3, sum(seq_lens)] int64 on ``device``: each row's sequence, block-table column and offset in its block."""
    seq = np.repeat(np.asarray(seqs, np.int64), seq_lens)
    pos = np.arange(len(seq)) - np.repeat(np.cumsum([0, *seq_lens[:-1]]), seq_lens)
    return upload(np.stack([seq, pos // block_size, pos % block_size]), torch.int64, device)


def _causal_mask(context_len: int, query_len: int, seq_len: int, device) -> torch.Tensor:
    q_pos = torch.arange(context_len, context_len + query_len, device=device)
    k_pos = torch.arange(seq_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]  # [query_len, seq_len], True = attend


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, num_heads, head_dim] -> out [T, num_heads, head_dim], one sequence at a time."""
    out = torch.empty_like(q)
    starts = metadata.query_start_loc
    for i, (ctx_len, seq_len) in enumerate(zip(metadata.context_lens, metadata.seq_lens)):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        table = metadata.block_tables[i]
        k = gather_seq(k_cache, table, seq_len).transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
        v = gather_seq(v_cache, table, seq_len).transpose(0, 1).to(q.dtype)
        mask = _causal_mask(ctx_len, end - start, seq_len, q.device)
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[start:end] = attn.transpose(0, 1)
    return out


def paged_prefill_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, query_start_loc: Sequence[int], seq_lens: Sequence[int],
                                 seqs: Sequence[int], scale: float, out: torch.Tensor) -> None:  # fmt: skip
    """Causal attention of the sequences ``seqs`` into their rows of ``out``, through SDPA's fused kernels (flash
    attention in bf16/fp16 on a GPU), one sequence at a time: k and v expanded to the query heads, the causal mask
    aligned to the last position (a chunk after its cached context) instead of built, so no [query_len, seq_len]
    mask is read. Sequence b's queries are q's rows query_start_loc[b] .. query_start_loc[b + 1] - 1 (host lists,
    as in a step's metadata). ``atom.ops.cuda.paged_prefill_attention`` takes the same arguments."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    for i in seqs:
        seq_len, start, end = seq_lens[i], query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        table = block_tables[i]
        k, v = (gather_seq(cache, table, seq_len).to(q.dtype).repeat_interleave(heads // kv_heads, dim=1)
                for cache in (k_cache, v_cache))  # fmt: skip
        mask = causal_lower_right(end - start, seq_len)  # query j sits at position seq_len - (end - start) + j
        attn = F.scaled_dot_product_attention(
            q[None, start:end].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), attn_mask=mask,
            scale=scale)  # fmt: skip
        out[start:end] = attn[0].transpose(0, 1)
