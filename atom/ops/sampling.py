"""Token sampling over a batch of logits rows, each row with its own parameters (torch).

    logits ──► /temperature ► top-k ► top-p ► min-p ► exponential race ──► token
       └─────► argmax (rows with temperature 0 or top_k 1) ───────────────► token

The race draws q ~ Exp(1) per token and takes argmax(probs / q), which
samples from probs. The draws come from the caller (the sampler's
``exponential_draws``; a seeded request's from ``keyed_draws_ref``), so
this reference and the fused kernel (``atom.ops.cuda.sample_tokens``) pick the
same token from the same draws. ``sample_residual_ref`` (kernel:
``atom.ops.cuda.sample_residual``) serves the verification of speculative
drafts: a draft's probability, and a token drawn with the draft left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# Smallest Exp(1) draw we divide by; avoids 0/0 for filtered-out tokens.
MIN_EXP_DRAW = 1e-10


# Keyed draws (seeded requests). Row j's key is mix64(seeds[j] + counters[j] * GAMMA) and its draw i is
# -log(1 - v), v the top 53 bits of mix64(key + (i + 1) * GAMMA) over 2^53: SplitMix64's i-th output from that key
# (mod 2^64 throughout). The same bits on the CPU and in the kernel (``atom.ops.cuda.keyed_draws_``), and no
# generator state: a seeded request passes a state made from its seed once (``seed_state``) and a counter of its
# draws and rows (``sampler.SeedStream``).
GAMMA = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def mix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int in [0, 2^64)."""
    z = ((z ^ (z >> 30)) * _MIX[0]) & MASK64
    z = ((z ^ (z >> 27)) * _MIX[1]) & MASK64
    return z ^ (z >> 31)


def seed_state(seed: int) -> int:
    """A seeded request's state for its keys (a 64-bit seed, negative ones too)."""
    return mix64(seed & MASK64)


def keyed_draws_ref(draws: Tensor, rows: Sequence[int], seeds: Sequence[int], counters: Sequence[int]) -> Tensor:
    """Write row ``rows[j]`` of ``draws`` ([R, width] fp32) with the Exp(1) draws of the key of ``seeds[j]`` and
    ``counters[j]`` (ints in [0, 2^64)), in place; the other rows are left as they are. Returns ``draws``."""
    if not rows:
        return draws
    keys = [_signed(mix64((seed + counter * GAMMA) & MASK64)) for seed, counter in zip(seeds, counters)]
    z = torch.arange(1, draws.shape[1] + 1, dtype=torch.int64, device=draws.device) * _signed(GAMMA)
    z = z + torch.tensor(keys, dtype=torch.int64, device=draws.device).unsqueeze(1)
    _mix64_(z)
    z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)  # the top 53 bits (torch's shift is arithmetic)
    index = torch.tensor(rows, dtype=torch.int64, device=draws.device)
    draws[index] = z.double().mul_(-(2.0**-53)).log1p_().neg_().float()  # -log(1 - v)
    return draws


def _mix64_(z: Tensor) -> Tensor:
    """``mix64`` on an int64 tensor, in place (the products wrap mod 2^64, as the uint64 ones do; in place: the
    CPU reference runs over [rows, vocabulary] every step a seeded request samples)."""
    shifted = torch.empty_like(z)
    for shift, multiplier in ((30, _MIX[0]), (27, _MIX[1]), (31, None)):
        torch.bitwise_right_shift(z, shift, out=shifted).bitwise_and_((1 << (64 - shift)) - 1)  # a logical shift
        z.bitwise_xor_(shifted)
        if multiplier is not None:
            z.mul_(_signed(multiplier))
    return z


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def sample_ref(
    logits: Tensor,
    draws: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    filter_top_k_top_p: bool = True,
    filter_min_p: bool = True,
) -> Tensor:
    """[rows] int64: each row's token. ``filter_top_k_top_p`` / ``filter_min_p`` False promise that no row
    filters that way (top_k 0, top_p 1 / min_p 0 everywhere); the stage is then skipped, which is exact."""
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p, filter_top_k_top_p, filter_min_p)
    sampled = (probs / draws.clamp_min(MIN_EXP_DRAW)).argmax(dim=-1)
    return torch.where(_greedy(temperature, top_k), logits.argmax(dim=-1), sampled)


def sample_residual_ref(
    logits: Tensor,
    draws: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    drafts: Tensor,
    filter_top_k_top_p: bool = True,
    filter_min_p: bool = True,
) -> tuple[Tensor, Tensor]:
    """Per row with a draft token (int64 [rows], -1: none), for the verification of speculative drafts: [rows]
    int64 a token drawn with the draft left out (the residual distribution, where the draft was rejected; the
    draft itself where nothing else is kept), and [rows] fp32 the draft's probability. A greedy row: its argmax,
    and 1 if the draft is that argmax, else 0. Otherwise as ``sample_ref``."""
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p, filter_top_k_top_p, filter_min_p)
    has_draft = drafts >= 0
    draft = drafts.clamp_min(0).unsqueeze(1)
    draft_probs = torch.where(has_draft, probs.gather(1, draft).squeeze(1) / probs.sum(dim=-1), 0.0)
    residual = probs.scatter(1, draft, torch.where(has_draft.unsqueeze(1), 0.0, probs.gather(1, draft)))
    sampled = (residual / draws.clamp_min(MIN_EXP_DRAW)).argmax(dim=-1)
    sampled = torch.where(residual.amax(dim=-1) > 0, sampled, drafts)
    greedy, argmax = _greedy(temperature, top_k), logits.argmax(dim=-1)
    return (torch.where(greedy, argmax, sampled),
            torch.where(greedy, (argmax == drafts).float(), draft_probs))  # fmt: skip


def filtered_probs(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    filter_top_k_top_p: bool = True,
    filter_min_p: bool = True,
) -> Tensor:
    """[rows, vocab] each row's sampling weights, unnormalised (past min-p): /temperature (0 read as 1), top-k
    and top-p, softmax, min-p. Stages a flag says no row uses are skipped."""
    logits = logits / torch.where(temperature == 0, 1.0, temperature).unsqueeze(1)
    if filter_top_k_top_p:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if filter_min_p:
        probs = apply_min_p(probs, min_p)
    return probs


def _greedy(temperature: Tensor, top_k: Tensor) -> Tensor:
    return (temperature == 0) | (top_k == 1)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask to -inf everything outside each row's top-k, then outside its top-p nucleus.

    Top-p keeps the smallest prefix (by descending probability) whose cumulative
    probability reaches top_p; the top token is always kept. Equal logits keep
    their index order (a stable sort).
    """
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)

    k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size)).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(positions >= k, float("-inf"))

    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    p = top_p.unsqueeze(1)
    # top_p == 1 skips the test so float rounding in the cumsum never drops the tail; position 0 (the top token)
    # is kept even where a tiny top_p became 0 in float32.
    outside_nucleus = (mass_before >= p) & (p < 1) & (positions > 0)
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Zero tokens whose probability is below min_p times the row's top probability."""
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)
