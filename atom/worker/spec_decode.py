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
with no host sync and a handful of launches, whatever the mix of greedy and
sampled rows. One sampling kernel (``atom.ops.cuda.sample_residual``) goes over
every logits row at once: the draft's probability there, and a token drawn with
the draft left out (the residual, emitted where the draft is rejected; at the
bonus row there is no draft). Each logits row has one Exp(1) vector of
vocabulary size + 1: the race's draws, and the draft's acceptance uniform
exp(-E). A seeded request's rows are keyed by its seed and its draw count
(``sampler.SeedStream``), so its tokens do not depend on the batch; the others
share the default generator.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

import torch
from torch import Tensor

from atom.forward_context import upload
from atom.ops.cuda import sample_residual
from atom.ops.cuda.fused import accept_drafts
from atom.ops.sampling import filtered_probs
from atom.worker.sampler import SamplingBatch, SeedStream, _top_logprobs, _trim, apply_penalties, exponential_draws


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
    probs = filtered_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p,
                           batch.any_top_k_top_p, batch.any_min_p)  # fmt: skip
    return logits, probs / probs.sum(dim=-1, keepdim=True)


def verify_rows(logits: Tensor, batch: SamplingBatch, drafts: list[list[int]],
                streams: list[SeedStream | None], proposed: Tensor | None = None) -> Verdict:  # fmt: skip
    """The verification of n rows: row i ran ``[t, *drafts[i]]`` and has logits rows ``1 + len(drafts[i])``,
    back to back in ``logits`` in row order. ``batch`` has one entry per logits row (row i's parameters; for its
    j-th, its output tokens followed by ``drafts[i][:j]``, which the penalties count). ``streams[i]``: row i's
    draws where it is seeded (one draw over its logits rows), or None. ``proposed``: the drafts on the device,
    [n, >= k] (row i's first len(drafts[i]) columns), where the host has only their number (a row filled in on the
    device: the runner's overlap)."""
    device, n = logits.device, len(drafts)
    counts = [len(d) for d in drafts]
    k = max(counts, default=0)
    firsts = list(accumulate((1 + c for c in counts), initial=0))  # each row's first logits row
    # One upload: [n, k + 1] each column's logits row (columns past a row's drafts repeat its last), [n] draft
    # counts, then [n, k] the drafts (0 past them) and [logits rows] the draft each checks (-1 at the bonus
    # rows); or, where ``proposed`` brings the drafts, [logits rows] where each one's check sits in them padded
    # with a -1 column
    at_rows = (f + min(j, c) for f, c in zip(firsts, counts) for j in range(k + 1))
    checked = None
    if proposed is None:
        packed = upload([*at_rows, *counts, *(d[j] if j < len(d) else 0 for d in drafts for j in range(k)),
                         *(t for d in drafts for t in (*d, -1))], torch.long, device)  # fmt: skip
        proposed = packed[n * (k + 2) : n * (2 * k + 2)].view(n, k)
        checked = packed[n * (2 * k + 2) :]
    else:
        packed = upload([*at_rows, *counts, *(i * (k + 1) + (j if j < c else k) for i, c in enumerate(counts)
                                              for j in range(c + 1))], torch.long, device)  # fmt: skip
        proposed = proposed[:, :k]
    at = packed[: n * (k + 1)].view(n, k + 1)
    num_drafts = packed[n * (k + 1) : n * (k + 2)]
    processed = apply_penalties(logits, batch) if batch.any_penalties else logits
    if batch.all_greedy:  # each logits row's token is its argmax, and a draft is accepted where it is that
        outcome = accept_drafts(processed.argmax(dim=-1), at, proposed, num_drafts)
    else:
        if checked is None:  # row i's own drafts, then -1 (its bonus row), its logits rows back to back
            checked = torch.nn.functional.pad(proposed, (0, 1), value=-1).flatten()[packed[n * (k + 2) :]]
        draws = exponential_draws((logits.shape[0], logits.shape[1] + 1), device, streams, firsts)
        tokens, draft_probs = sample_residual(processed, draws[:, :-1], batch.temperature, batch.top_k, batch.top_p,
                                              batch.min_p, checked, batch.any_top_k_top_p, batch.any_min_p)
        outcome = accept_drafts(tokens, at, proposed, num_drafts, draft_probs, draws[:, -1])  # u = exp(-E) ~ U(0, 1]
    accepted, final = outcome[:n], outcome[n : 2 * n]
    targets = outcome[2 * n :].view(n, k + 1)
    return Verdict(accepted, final, targets)


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
