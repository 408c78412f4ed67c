"""Verification of draft tokens: greedy prefix matching and rejection sampling.

A request verified this step ran ``1 + k`` tokens ``[t, d1 .. dk]``; logits row
j is the target's distribution for the token after ``d1 .. dj``::

    row:      0     1     ...   k
    checks:   d1    d2          (bonus)

Greedy: accept drafts while they equal the target's argmax, then emit the
target's own token at the first mismatch (or the bonus row).

Sampling: drafts are deterministic proposals (the draft distribution q is
one-hot), so draft d at row j is accepted with probability p_j(d); on
rejection the token is drawn from p_j with d removed, renormalised. Each
emitted token is then distributed exactly as plain sampling from p would be.
All randomness comes from the request's own generator when it has a seed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom.ops.sampling import apply_min_p, apply_top_k_top_p
from atom.worker.sampler import SamplingBatch, _top_logprobs, _trim, apply_penalties


def target_probs(logits: Tensor, batch: SamplingBatch) -> tuple[Tensor, Tensor]:
    """Per row: the processed logits (after penalties) and the sampling distribution."""
    if batch.any_penalties:
        logits = apply_penalties(logits, batch)
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    scaled = apply_top_k_top_p(logits / temperature.unsqueeze(1), batch.top_k, batch.top_p)
    probs = apply_min_p(torch.softmax(scaled, dim=-1), batch.min_p)
    return logits, probs / probs.sum(dim=-1, keepdim=True)


def verify(
    logits: Tensor, batch: SamplingBatch, drafts: list[int], greedy: bool, generator: torch.Generator | None
) -> list[int]:
    """Tokens emitted for one request: accepted drafts plus one target token."""
    if greedy:  # only the penalised argmax matters, as in plain greedy sampling
        processed = apply_penalties(logits, batch) if batch.any_penalties else logits
        return accept_greedy(drafts, processed.argmax(dim=-1).tolist())
    _, probs = target_probs(logits, batch)
    uniforms = torch.rand(len(drafts), generator=generator, device=probs.device).tolist()
    for j, d in enumerate(drafts):
        if uniforms[j] < probs[j, d].item():
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        if residual.sum() <= 0:  # p_j was one-hot at d yet u >= 1 cannot happen; guard rounding
            residual = probs[j]
        return drafts[:j] + [_draw(residual, generator)]
    return list(drafts) + [_draw(probs[len(drafts)], generator)]


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """The drafts while they equal the target's argmax ``target`` (1 + k of them), then the target's own token."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]]


def _draw(p: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p / p.sum(), 1, generator=generator).item())


def emitted_logprobs(raw_logits: Tensor, tokens: list[int], num: int) -> list[dict[int, float]]:
    """Raw logprobs of each emitted token (row i for token i) plus the top-num."""
    logprobs = torch.log_softmax(raw_logits[: len(tokens)].float(), dim=-1)
    ids = torch.tensor(tokens, device=raw_logits.device)
    rows = _top_logprobs(logprobs, ids, num)
    return _trim(rows, [num] * len(rows))
