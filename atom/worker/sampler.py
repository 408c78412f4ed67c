"""Batched sampler: one logits row per request, each with its own parameters.

Pipeline per step (rows are independent throughout):

    raw logits ──► penalties ──┬─ greedy rows ─────────────────────────► argmax
                               └─ /temperature ► top-k ► top-p ► min-p ► sample

The second line is one fused kernel on a GPU (``atom.ops.cuda.sample_tokens``)
and torch elsewhere (``atom.ops.sampling``).

Logprobs are reported from the *raw* logits (vLLM's default "raw_logprobs").

Invariant: a seeded request's Exp(1) vector of a step is a function of its
seed and how many times it has drawn before (``SeedStream``), so its tokens do
not depend on which other requests share the batch. Every seeded row of a step
is drawn in one launch (``atom.ops.cuda.keyed_draws_``). Unseeded requests
share the default generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from atom.forward_context import upload
from atom.ops.cuda import keyed_draws_, sample_tokens
from atom.ops.sampling import seed_state
from atom.sampling_params import SamplingParams

# Largest top_k kept as is in the float32 upload (larger ones filter nothing: no vocabulary is that big)
_TOP_K_EXACT = 1 << 24


class SeedStream:
    """A seeded request's draws: its n-th draw (``take``) is keyed by its seed and n alone
    (``atom.ops.sampling.keyed_draws_ref``), so it needs no generator state, and a draw thrown away is undone by
    setting ``draws`` back (the runner does, where the scheduler discards a step that ran ahead)."""

    def __init__(self, seed: int, draws: int = 0) -> None:
        self.seed, self.state, self.draws = seed, seed_state(seed), draws

    def take(self, rows: int = 1) -> list[int]:
        """This draw's counters, one per logits row it covers (a verification's 1 + k), and move on to the next."""
        if not 0 < rows <= 1 << 16:
            raise ValueError(f"SeedStream.take: {rows} rows; a draw covers 1 to 2^16")
        first = (self.draws << 16) + 1
        self.draws += 1
        return list(range(first, first + rows))

    def __repr__(self) -> str:
        return f"SeedStream(seed={self.seed}, draws={self.draws})"


def exponential_draws(shape: tuple[int, int], device: torch.device | str, streams: Sequence[SeedStream | None],
                      firsts: Sequence[int] | None = None) -> Tensor:  # fmt: skip
    """[rows, width] fp32 Exp(1) draws: request i's logits rows ``firsts[i]:firsts[i + 1]`` (row i where
    ``firsts`` is None) from its stream, every seeded row in one launch; the other rows' from the default
    generator."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    if any(stream is None for stream in streams):
        q.exponential_()
    rows, seeds, counters = [], [], []
    for i, stream in enumerate(streams):
        if stream is not None:
            first, end = (i, i + 1) if firsts is None else (firsts[i], firsts[i + 1])
            rows.extend(range(first, end))
            seeds.extend([stream.state] * (end - first))
            counters.extend(stream.take(end - first))
    if rows:
        keyed_draws_(q, rows, seeds, counters)
    return q


@dataclass
class SamplingBatch:
    """Per-step sampling metadata, built by the model runner from request params."""

    temperature: Tensor  # [B] float32; 0 = greedy
    top_p: Tensor  # [B] float32; 1 = off
    top_k: Tensor  # [B] int64; 0 = off
    min_p: Tensor  # [B] float32; 0 = off
    presence_penalty: Tensor  # [B] float32
    frequency_penalty: Tensor  # [B] float32
    repetition_penalty: Tensor  # [B] float32
    streams: list[SeedStream | None]  # a seeded request's draws; None: the default generator
    # What the penalties count: the prompt (a repetition penalty's) and the output tokens, as lists or int64
    # arrays. Rows without such a penalty may pass them empty, as the runner does (CachedRequestState.penalty_tokens):
    # their counts change nothing.
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    num_logprobs: list[int | None]
    # Host-side summaries so fast-path checks never sync with the device.
    # The defaults take the slow path, which is always correct.
    all_greedy: bool = False
    any_penalties: bool = True
    any_top_k_top_p: bool = True  # False: no row filters by top-k or top-p (skips the sort)
    any_min_p: bool = True

    @staticmethod
    def from_params(
        params: list[SamplingParams],
        streams: list[SeedStream | None],
        prompt_token_ids: list[Sequence[int]],
        output_token_ids: list[Sequence[int]],
        device: torch.device | str = "cpu",
        repeats: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """One row per entry of ``params`` and ``streams``; with ``repeats``, entry i stands for ``repeats[i]`` rows
        back to back (a verified request's 1 + k logits rows: its parameters are read once, not once a row), and
        ``prompt_token_ids`` and ``output_token_ids`` have one entry per row."""
        # Every column in one upload (each upload costs ~25 us of host time on a GPU). top_k travels as a
        # float: exact below 2**24, and anything above the vocabulary filters nothing either way. A greedy row's
        # temperature goes up as 0, which the samplers read as greedy (SamplingParams.greedy).
        columns = [[0.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params],
                   [min(max(p.top_k, 0), _TOP_K_EXACT) for p in params], [p.min_p for p in params],
                   [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                   [p.repetition_penalty for p in params]]  # fmt: skip
        num_logprobs = [p.logprobs for p in params]
        if repeats is not None:
            columns = np.repeat(np.asarray(columns, np.float32).reshape(7, len(params)), repeats, axis=1)
            streams = [stream for stream, r in zip(streams, repeats) for _ in range(r)]
            num_logprobs = [num for num, r in zip(num_logprobs, repeats) for _ in range(r)]
        temperature, top_p, top_k, min_p, presence, frequency, repetition = upload(
            columns, torch.float32, device).view(7, len(streams))  # fmt: skip
        return SamplingBatch(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k.long(),
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            streams=list(streams),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            num_logprobs=num_logprobs,
            all_greedy=all(p.greedy for p in params),
            any_penalties=any(p.has_penalties for p in params),
            any_top_k_top_p=any(p.filters_top_k_top_p for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [B] int64
    # Per request: top-n raw logprobs plus the sampled token's; None if not requested.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw_logits = logits
        if batch.any_penalties:
            logits = apply_penalties(logits, batch)
        if batch.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            draws = exponential_draws(logits.shape, logits.device, batch.streams)
            sampled = sample_tokens(logits, draws, batch.temperature, batch.top_k, batch.top_p, batch.min_p,
                                    batch.any_top_k_top_p, batch.any_min_p)  # fmt: skip
        return SamplerOutput(sampled, _sampled_logprobs(raw_logits, sampled, batch.num_logprobs))


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens)."""
    vocab_size = logits.shape[1]
    output_counts = _token_counts(batch.output_token_ids, vocab_size, logits.device)
    prompt_counts = _token_counts(batch.prompt_token_ids, vocab_size, logits.device)
    seen = (output_counts + prompt_counts) > 0

    rep = batch.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * output_counts
    logits = logits - batch.presence_penalty.unsqueeze(1) * (output_counts > 0)
    return logits


def _token_counts(token_ids: list[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[B, V] float32 occurrence counts. The ids go up flat with their row numbers, in one upload: a batch of long
    prompts padded to the longest cost milliseconds of host time a step."""
    lengths = [len(ids) for ids in token_ids]
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    total = sum(lengths)
    if total:
        rows = np.repeat(np.arange(len(token_ids), dtype=np.int64), lengths)
        flat = np.concatenate([np.asarray(ids, np.int64) for ids in token_ids if len(ids)])
        packed = upload(rows * vocab_size + flat, torch.int64, device)
        counts.view(-1).index_add_(0, packed, torch.ones(total, dtype=torch.float32, device=device))
    return counts


def _sampled_logprobs(
    raw_logits: Tensor, sampled: Tensor, num_logprobs: list[int | None]
) -> list[dict[int, float] | None]:
    requested = [n for n in num_logprobs if n is not None]
    if not requested:
        return [None] * len(num_logprobs)
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    dicts = _trim(_top_logprobs(logprobs, sampled, max(requested)), num_logprobs)
    return [d if n is not None else None for d, n in zip(dicts, num_logprobs)]


def _top_logprobs(logprobs: Tensor, token_ids: Tensor, num: int) -> list[list[tuple[int, float]]]:
    """Per row: (token, logprob) for the given token first, then the top-num tokens."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1).long())
    top_values, top_ids = logprobs.topk(min(num, logprobs.shape[1]), dim=-1)
    ids = torch.cat([token_ids.view(-1, 1).long(), top_ids], dim=1).tolist()
    values = torch.cat([chosen, top_values], dim=1).tolist()
    return [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]


def _trim(rows: list[list[tuple[int, float]]], nums: list[int | None]) -> list[dict[int, float]]:
    """Keep the first entry (the sampled/next token) and the top-n entries after it."""
    return [_as_dict(row[0], row[1 : 1 + (n or 0)]) for row, n in zip(rows, nums)]


def _as_dict(token: tuple[int, float], top: list[tuple[int, float]]) -> dict[int, float]:
    out = dict(top)
    out.setdefault(token[0], token[1])
    return out


def compute_prompt_logprobs(logits: Tensor, next_token_ids: Tensor, num: int) -> list[dict[int, float]]:
    """Entry i: raw logprob of next_token_ids[i] under logits[i], plus the top-num tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    rows = _top_logprobs(logprobs, next_token_ids, num)
    return _trim(rows, [num] * len(rows))
