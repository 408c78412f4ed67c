"""Verification of draft tokens: greedy prefix matching and rejection sampling, all rows at once.

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

``verify_rows`` does this for a step's rows together, on the logits' device,
with no host sync: a handful of batched ops, whatever the mix of greedy and
sampled rows. Each row draws k uniforms and then one Exp(1) vector of
vocabulary size (the last token is the exponential race ``argmax(p / E)``, as
in the sampler); a seeded row draws both from its own generator, so its tokens
do not depend on the batch. The others share the default generator.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

import torch
from torch import Tensor

from atom.forward_context import upload
from atom.ops.sampling import MIN_EXP_DRAW, apply_min_p, apply_top_k_top_p, exponential_draws
from atom.worker.sampler import SamplingBatch, _top_logprobs, _trim, apply_penalties


class Verdict(NamedTuple):
    """The outcome of a step's verification, per row, on the device."""

    accepted: Tensor  # [n] int64: the leading drafts accepted
    final: Tensor  # [n] int64: the token emitted after them (the target's)
    # [n, 1 + k]: the accepted drafts, then the final token in every later column. A row's accepted count is the
    # leading run of its drafts equal to these targets, as with a greedy row's argmax (MTP drafting behind a
    # verification reads them so: atom/worker/drafters/mtp_graphs.py)
    targets: Tensor


def target_probs(logits: Tensor, batch: SamplingBatch) -> tuple[Tensor, Tensor]:
    """Per row: the processed logits (after penalties) and the sampling distribution."""
    if batch.any_penalties:
        logits = apply_penalties(logits, batch)
    return logits, _probs(logits, batch)


def _probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The sampling distribution of processed logits: temperature, top-k and top-p, min-p (stages no row uses
    are skipped, which is exact)."""
    temperature = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    scaled = logits / temperature.unsqueeze(1)
    if batch.any_top_k_top_p:
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if batch.any_min_p:
        probs = apply_min_p(probs, batch.min_p)
    return probs / probs.sum(dim=-1, keepdim=True)


def verify_rows(logits: Tensor, batch: SamplingBatch, drafts: list[list[int]], greedy: list[bool],
                generators: list[torch.Generator | None]) -> Verdict:  # fmt: skip
    """The verification of n rows: row i ran ``[t, *drafts[i]]`` and has logits rows ``1 + len(drafts[i])``,
    back to back in ``logits`` in row order. ``batch`` has one entry per logits row (row i's parameters; for its
    j-th, its output tokens followed by ``drafts[i][:j]``, which the penalties count). ``greedy[i]``: row i takes
    the argmax of its penalised logits; ``generators[i]``: its seeded generator, or None."""
    device, n = logits.device, len(drafts)
    counts = [len(d) for d in drafts]
    k = max(counts, default=0)
    firsts = list(accumulate((1 + c for c in counts), initial=0))  # each row's first logits row
    # [n, k + 1] each column's logits row (columns past a row's drafts repeat its last), [n, k] its drafts
    # (0 past them), [n] greedy flags, [n] draft counts: one upload
    packed = upload([*(f + min(j, c) for f, c in zip(firsts, counts) for j in range(k + 1)),
                     *(d[j] if j < len(d) else 0 for d in drafts for j in range(k)), *greedy, *counts],
                    torch.long, device)  # fmt: skip
    at = packed[: n * (k + 1)].view(n, k + 1)
    proposed = packed[n * (k + 1) : n * (2 * k + 1)].view(n, k)
    is_greedy, num_drafts = packed[n * (2 * k + 1) :].view(2, n)
    is_greedy = is_greedy.bool()
    own = torch.arange(k, device=device) < num_drafts.unsqueeze(1)  # [n, k]
    processed = apply_penalties(logits, batch) if batch.any_penalties else logits
    argmax = processed.argmax(dim=-1)[at]  # [n, k + 1]
    accept = proposed == argmax[:, :k]
    sampled = not all(greedy)
    if sampled:
        probs = _probs(processed, batch)
        uniforms = _uniforms(counts, k, generators, device)
        draft_probs = probs[at[:, :k], proposed]  # p_j(d_j)
        accept = torch.where(is_greedy.unsqueeze(1), accept, uniforms < draft_probs)
    accepted = (accept & own).long().cumprod(dim=1).sum(dim=1)
    final = argmax.gather(1, accepted.unsqueeze(1)).squeeze(1)
    if sampled:
        final = torch.where(is_greedy, final, _draw_final(probs, at, proposed, accepted, own, generators))
    column = torch.arange(k + 1, device=device)
    targets = torch.where(column < accepted.unsqueeze(1), torch.nn.functional.pad(proposed, (0, 1)),
                          final.unsqueeze(1))  # fmt: skip
    return Verdict(accepted, final, targets)


def _uniforms(counts: list[int], k: int, generators: list[torch.Generator | None], device) -> Tensor:
    """[n, k] U[0, 1): row i's first counts[i] from its generator (the rest are never read)."""
    u = torch.rand(len(counts), k, device=device)  # the default generator's, for the unseeded rows
    for row, (count, generator) in enumerate(zip(counts, generators)):
        if generator is not None and count:
            u[row, :count] = torch.rand(count, generator=generator, device=device)
    return u


def _draw_final(probs: Tensor, at: Tensor, proposed: Tensor, accepted: Tensor, own: Tensor,
                generators: list[torch.Generator | None]) -> Tensor:  # fmt: skip
    """Each row's token after its accepted drafts: from p at the first rejected draft with that draft removed
    (it cannot be empty: a draft is only rejected if u >= p(d), so p(d) < 1), or from the bonus row's p."""
    rows = torch.arange(len(accepted), device=probs.device)
    p = probs[at[rows, accepted]]  # [n, V]
    k = proposed.shape[1]
    rejected = accepted < own.sum(dim=1)
    if k:
        draft = proposed[rows, accepted.clamp(max=k - 1)]
        p = p.index_put((rows, draft), torch.where(rejected, 0.0, p[rows, draft]))
    draws = exponential_draws(p, generators)
    return (p / draws.clamp_min(MIN_EXP_DRAW)).argmax(dim=-1)


def emitted_logprobs(raw_logits: Tensor, rows: list[int], tokens: list[list[int]],
                     nums: list[int]) -> list[list[dict[int, float]]]:  # fmt: skip
    """For each request r: the raw logprob of each token it emitted (its i-th from ``raw_logits[rows[r] + i]``)
    plus the top-nums[r] tokens there."""
    index = [first + i for first, emitted in zip(rows, tokens) for i in range(len(emitted))]
    logprobs = torch.log_softmax(raw_logits[upload(index, torch.long, raw_logits.device)].float(), dim=-1)
    flat = [t for emitted in tokens for t in emitted]
    entries = _top_logprobs(logprobs, upload(flat, torch.long, raw_logits.device), max(nums))
    per_entry = [num for num, emitted in zip(nums, tokens) for _ in emitted]
    trimmed, out, at = _trim(entries, per_entry), [], 0
    for emitted in tokens:
        out.append(trimmed[at : at + len(emitted)])
        at += len(emitted)
    return out


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """The drafts while they equal the target's argmax ``target`` (1 + k of them), then the target's own token."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]]
