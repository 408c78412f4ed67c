"""Torch reference for MLA attention over the paged latent cache (absorbed form).

Cache row of a token:  [ c = kv_a_layernorm(latent) (r) | k_rot (rope) ].
Keys and values are never expanded per head: queries are absorbed into the
latent space (q_nope W_UK), so a head's score against token p is

    score = (q_latent . c_p + q_rope . k_rot_p) * scale

and its output in latent space is sum_p softmax(score)_p c_p, which the layer
maps to per-head values with W_UV.
"""

from __future__ import annotations

import torch

from atom.forward_context import AttentionMetadata
from atom.ops import PaddedLayout


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
