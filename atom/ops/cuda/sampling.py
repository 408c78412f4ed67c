"""Fused token sampling: temperature, top-k, top-p, min-p and the exponential race in one launch."""

from __future__ import annotations

import torch

from atom.ops.cuda._launch import C, device_guard, kernels_apply, stream_of
from atom.ops.sampling import sample_ref

_MAX_VOCAB = 1 << 24  # the kernel's sort keys hold a token index in at most 24 bits


def sample_tokens(
    logits: torch.Tensor,
    draws: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    filter_top_k_top_p: bool = True,
    filter_min_p: bool = True,
) -> torch.Tensor:
    """[rows] int64: one token per fp32 logits row [rows, vocab], as ``atom.ops.sampling.sample_ref``.

    ``draws`` [rows, vocab] fp32 Exp(1) variates; temperature, top_p, min_p fp32 and top_k int64, all [rows].
    The filter flags only let the reference skip stages no row uses; the kernel checks each row itself.
    """
    rows, vocab = logits.shape
    if draws.shape != logits.shape or any(t.shape != (rows,) for t in (temperature, top_k, top_p, min_p)):
        raise ValueError(f"sample_tokens: draws must be {tuple(logits.shape)} and the parameters [{rows}]")
    if (not kernels_apply(logits, draws, temperature, top_k, top_p, min_p) or logits.dtype != torch.float32
            or vocab > _MAX_VOCAB):  # fmt: skip
        return sample_ref(logits, draws, temperature, top_k, top_p, min_p, filter_top_k_top_p, filter_min_p)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    draws = draws.float()
    if draws.stride(1) != 1:
        draws = draws.contiguous()
    temperature, top_p, min_p = (t.float().contiguous() for t in (temperature, top_p, min_p))
    top_k = top_k.long().contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    with device_guard(logits.device):
        C().sample_tokens(
            logits.data_ptr(), logits.stride(0), draws.data_ptr(), draws.stride(0), temperature.data_ptr(),
            top_p.data_ptr(), top_k.data_ptr(), min_p.data_ptr(), out.data_ptr(), rows, vocab, stream_of(logits.device),
        )  # fmt: skip
    return out
