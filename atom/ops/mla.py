"""MLA attention over the paged latent cache: the torch reference (absorbed form), and the
expanded form that GPUs run for prefills (``mla_prefill``).

Cache row of a token:  [ c = kv_a_layernorm(latent) (r) | k_rot (rope) ].
Keys and values are never expanded per head: queries are absorbed into the
latent space (q_nope W_UK), so a head's score against token p is

    score = (q_latent . c_p + q_rope . k_rot_p) * scale

and its output in latent space is sum_p softmax(score)_p c_p, which the layer
maps to per-head values with W_UV.

A prefill's tokens each read the same keys, so expanding the cache rows once
per head is cheaper there: ``mla_prefill`` computes k_nope and v from the rows
with kv_b_proj (as transformers does), appends k_rot to every head's key, and
attends over them: per (query, key) pair that is nope + rope + v multiply-adds
a head instead of 2 r + rope. On a GPU in bf16/fp16 with Kimi-Linear's sizes
(nope + rope = 192, v = 128) one kernel launch attends the step's shorter
sequences (``atom.ops.cuda.expanded_prefill_attention``); torch's fused
attention takes the others, one sequence at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from atom.forward_context import AttentionMetadata
from atom.ops import PaddedLayout
from atom.ops.cuda.paged_attention import expanded_kernel_applies, expanded_prefill_attention, split_by_pairs
from atom.ops.paged_attention import gather_seqs


def write_latent_cache(latent_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' rows [T, r + rope] at their flat slots (block * block_size + offset)."""
    latent_cache.view(-1, latent_cache.shape[-1]).index_copy_(0, slot_mapping, rows.to(latent_cache.dtype))


# Queries per score block: bounds the [B, H, chunk, P] fp32 scores of a long prefill.
QUERY_CHUNK = 512


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    md: AttentionMetadata,
    layout: PaddedLayout,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one group's new tokens over their sequences' cached rows.

    q_latent: [T, H, r] and q_rope: [T, H, rope] for the whole step;
    latent_cache: [num_blocks, block_size, r + rope], already holding this
    step's rows. Query j of sequence b sits at position context_lens[b] + j and
    sees cache positions 0..context_lens[b] + j. Returns the latent output
    [T', H, r] fp32 for ``layout.token_ids``. Scores and softmax run in fp32.
    """
    rank = q_latent.shape[-1]
    # Only the blocks the group's longest sequence reaches; the table's tail is padding.
    num_blocks = -(-max(md.seq_lens[b] for b in layout.seqs) // md.block_size)
    tables = md.block_tables[layout.seq_ids, :num_blocks]
    kv = latent_cache[tables].flatten(1, 2).float()  # [B', P, r + rope]
    q = layout.pad(torch.cat([q_latent, q_rope], dim=-1).float())  # [B', L, H, r + rope]
    context = torch.tensor([md.context_lens[b] for b in layout.seqs], dtype=torch.long, device=q.device)
    key_pos = torch.arange(kv.shape[1], device=q.device)
    out = q.new_empty(*q.shape[:-1], rank)
    for start in range(0, layout.max_len, QUERY_CHUNK):
        stop = min(start + QUERY_CHUNK, layout.max_len)
        query_pos = context[:, None] + torch.arange(start, stop, device=q.device)[None, :]  # [B', l]
        visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B', l, P]
        scores = torch.einsum("blhd,bpd->bhlp", q[:, start:stop], kv) * scale
        probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
        out[:, start:stop] = torch.einsum("bhlp,bpr->blhr", probs, kv[..., :rank])
    return layout.unpad(out)


# cuDNN's fused attention first where it applies (bf16 on a GPU), then torch's usual order. On an H200 a
# chunk after a context, given as a boolean mask with this order, ran 1.9x faster than with torch's
# causal_lower_right bias, which always took the memory-efficient kernel (GPU_NOTES.md, session 17).
_PREFILL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]  # fmt: skip


def mla_prefill(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    md: AttentionMetadata,
    seqs: Iterable[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """The expanded form for the new tokens of ``seqs``: writes out[t] = the heads' values [H, v]
    for each of their tokens t (what mla_attention's latent output times W_UV^T is).

    q: [T, H, nope + rope] (nope part first) for the whole step; kv_b_weight: kv_b_proj's
    weight [H * (nope + v), r]; latent_cache already holds this step's rows. The sequences'
    rows are expanded together into keys [P, H, nope + rope] and values [P, H, v] in the
    cache's dtype; then each sequence's queries attend causally, its last query to all its rows.
    Nothing here waits for the device.
    """
    heads, v_dim = out.shape[1], out.shape[2]
    rank = kv_b_weight.shape[1]
    nope = kv_b_weight.shape[0] // heads - v_dim
    seqs = list(seqs)
    lens = [md.seq_lens[b] for b in seqs]
    rows = gather_seqs(latent_cache, md.block_tables, seqs, lens)  # [sum of lens, r + rope]
    kv = F.linear(rows[:, :rank], kv_b_weight).view(-1, heads, nope + v_dim)
    k_rot = rows[:, None, rank:].expand(-1, heads, rows.shape[-1] - rank)
    firsts = [0] * md.num_seqs  # sequence b's first row in rows
    for b, first in zip(seqs, itertools.accumulate([0] + lens)):
        firsts[b] = first
    starts = md.query_start_loc
    if expanded_kernel_applies(q, v_dim):  # the shorter sequences through the kernel, the others through SDPA
        short, seqs = split_by_pairs(starts, md.seq_lens, seqs)
        if short:
            expanded = torch.cat([kv[..., nope:], kv[..., :nope], k_rot], dim=-1)  # a head: [v | k_nope | k_rot]
            expanded_prefill_attention(q, expanded, firsts, starts, md.seq_lens, short, scale, out)
    if not seqs:
        return
    # SDPA's keys contiguous: on strided views of the kernel's rows it ran up to 1.27x slower (session 37)
    k, v = torch.cat([kv[..., :nope], k_rot], dim=-1), kv[..., nope:]
    with sdpa_kernel(_PREFILL_BACKENDS, set_priority=True):
        for b in seqs:
            start, stop, keys = starts[b], starts[b + 1], slice(firsts[b], firsts[b] + md.seq_lens[b])
            mask = None  # a fresh prompt: plain causal
            if md.context_lens[b]:  # query i sits at context + i and sees rows 0 .. context + i
                mask = torch.ones(stop - start, md.seq_lens[b], dtype=torch.bool, device=q.device).tril(
                    md.context_lens[b])  # fmt: skip
            attn = F.scaled_dot_product_attention(
                q[start:stop].transpose(0, 1).unsqueeze(0),
                k[keys].transpose(0, 1).unsqueeze(0),
                v[keys].transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
            )
            out[start:stop] = attn[0].transpose(0, 1)
