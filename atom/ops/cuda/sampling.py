"""Fused token sampling: temperature, top-k, top-p, min-p and the exponential race in one launch; seeded
requests' draws, every row in one launch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atom.ops.cuda._launch import C, device_guard, kernels_apply, stream_of
from atom.ops.sampling import keyed_draws_ref, sample_ref, sample_residual_ref

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
    params = (temperature, top_k, top_p, min_p)
    _check(logits, draws, params)
    if not _on_kernel(logits, draws, params):
        return sample_ref(logits, draws, *params, filter_top_k_top_p, filter_min_p)
    return _launch(logits, draws, params, None)[0]


def sample_residual(
    logits: torch.Tensor,
    draws: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    drafts: torch.Tensor,
    filter_top_k_top_p: bool = True,
    filter_min_p: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, its draft token's probability and a token drawn with the draft left out, as
    ``atom.ops.sampling.sample_residual_ref``: ([rows] int64 tokens, [rows] fp32 probabilities). ``drafts``
    [rows] int64, -1 for none; the rest as ``sample_tokens``."""
    params = (temperature, top_k, top_p, min_p)
    _check(logits, draws, (*params, drafts))
    if not _on_kernel(logits, draws, (*params, drafts)):
        return sample_residual_ref(logits, draws, *params, drafts, filter_top_k_top_p, filter_min_p)
    return _launch(logits, draws, params, drafts)


def keyed_draws_(draws: torch.Tensor, rows: Sequence[int], seeds: Sequence[int],
                 counters: Sequence[int]) -> torch.Tensor:  # fmt: skip
    """Row ``rows[j]`` of ``draws`` (fp32 [R, width]) gets the Exp(1) draws of the key of ``seeds[j]`` and
    ``counters[j]``, in place, as ``atom.ops.sampling.keyed_draws_ref``. The lists go to the kernel by value
    (nothing to upload): 128 rows a launch. Returns ``draws``."""
    if draws.dim() != 2 or draws.dtype != torch.float32 or not len(rows) == len(seeds) == len(counters):
        raise ValueError("keyed_draws_: draws must be fp32 [R, width], and rows, seeds and counters alike")
    if len(rows) and not (0 <= min(rows) and max(rows) < draws.shape[0]):
        raise ValueError(f"keyed_draws_: rows must be in [0, {draws.shape[0]})")
    if not (kernels_apply(draws) and draws.stride(1) == 1):
        return keyed_draws_ref(draws, rows, seeds, counters)
    with device_guard(draws.device):
        C().keyed_draws(draws.data_ptr(), draws.stride(0), draws.shape[1], list(rows), list(seeds), list(counters),
                        stream_of(draws.device))  # fmt: skip
    return draws


def _check(logits: torch.Tensor, draws: torch.Tensor, per_row) -> None:
    rows = logits.shape[0]
    if draws.shape != logits.shape or any(t.shape != (rows,) for t in per_row):
        raise ValueError(f"sample_tokens: draws must be {tuple(logits.shape)} and the parameters [{rows}]")


def _on_kernel(logits: torch.Tensor, draws: torch.Tensor, per_row) -> bool:
    return (kernels_apply(logits, draws, *per_row) and logits.dtype == torch.float32
            and logits.shape[1] <= _MAX_VOCAB)  # fmt: skip


def _launch(logits, draws, params, drafts) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    draws = draws.float()
    if draws.stride(1) != 1:
        draws = draws.contiguous()
    temperature, top_k, top_p, min_p = params
    temperature, top_p, min_p = (t.float().contiguous() for t in (temperature, top_p, min_p))
    top_k = top_k.long().contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    draft_probs = None
    if drafts is not None:
        drafts = drafts.long().contiguous()
        draft_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    with device_guard(logits.device):
        C().sample_tokens(
            logits.data_ptr(), logits.stride(0), draws.data_ptr(), draws.stride(0), temperature.data_ptr(),
            top_p.data_ptr(), top_k.data_ptr(), min_p.data_ptr(), out.data_ptr(),
            0 if drafts is None else drafts.data_ptr(), 0 if draft_probs is None else draft_probs.data_ptr(),
            rows, vocab, stream_of(logits.device),
        )  # fmt: skip
    return out, draft_probs
