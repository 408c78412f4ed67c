"""Feed-forward layers: the dense gated MLP and a DeepSeek-V3-style MoE.

Checkpoints store routed experts one by one (``experts.{e}.w1/w2/w3.weight``,
w1 = gate, w3 = up, w2 = down), which is what the loader fills. After loading,
``RoutedExperts.fuse()`` re-homes them into two stacked tensors without
copying memory twice::

    gate_up_proj [E, 2I, D] = cat(w1, w3)      down_proj [E, D, I] = w2

and the per-expert parameters become views into those stacks.

Four ways to run the routed experts, all giving the same sums:

- the expert loop (the reference): one matmul pair per picked expert; it
  syncs with the host once per expert, fine on a CPU;
- gemv (GPU, any dtype, a few tokens: see ``GEMV_MAX_TOKENS``): two kernels
  that multiply each (token, pick) pair's expert rows with the token, the
  decode step of a few sequences (``fused.moe_gemv``);
- grouped (GPU, bf16): the (token, pick) pairs sorted by expert, two
  ``torch._grouped_mm`` calls that read only the picked experts' weights, no
  host sync, so it also runs inside CUDA graphs;
- dense (GPU, other dtypes, up to ``DENSE_MAX_TOKENS`` tokens): every expert
  on every token, zero weight for the unpicked ones (no sync either, but it
  reads every expert).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from atom.layers.linear import StackedLinears
from atom.ops.cuda import kernels_apply
from atom.ops.cuda.fused import moe_align, moe_combine, moe_gemv, moe_route, router_logits, silu_mul

# Batches up to this many tokens run the picked experts as matrix-vector products on a GPU (forward_gemv),
# as long as they hold at most two (token, pick) pairs per expert: the kernels read an expert's rows once
# per pair (a repeat mostly from L2), the grouped matmuls once per expert. bench/kernels_gpu.py --only
# moe_gemv (GPU_NOTES.md, session 16), with a shared expert: 1.3-2.6x the other paths up to 2 pairs per
# expert at E=16, k=4 and up to 32 tokens at E=256, k=8; 0.77x at 4 pairs per expert.
# ATOM_MOE_GEMV_MAX_TOKENS overrides the token limit (read at import; 0 turns the path off).
GEMV_MAX_TOKENS = int(os.environ.get("ATOM_MOE_GEMV_MAX_TOKENS", 32))
GEMV_MAX_PAIRS_PER_EXPERT = 2
# Batches up to this many tokens run every expert densely on a GPU (see _forward_dense).
DENSE_MAX_TOKENS = 128
# bf16 on Hopper: batches of at least this many tokens (and at most DENSE_MAX_TOKENS) run every
# expert through one batched matmul per projection (forward_all_experts), fewer tokens through the
# grouped matmuls over the picked experts only. ATOM_MOE_ALL_EXPERTS_MIN_TOKENS overrides it (read at import).
ALL_EXPERTS_MIN_TOKENS = int(os.environ.get("ATOM_MOE_ALL_EXPERTS_MIN_TOKENS", 32))


def grouped_mm_applies(x: torch.Tensor) -> bool:
    """torch's grouped matmul runs on CUDA for bf16 (Hopper and newer, and torch >= 2.8)."""
    return x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and _is_hopper_or_newer(x.device.index)


@functools.cache
def _is_hopper_or_newer(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.gate_up = StackedLinears(self.gate_proj, self.up_proj)  # one matmul; stack() after loading

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up(x)))

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [2I, D], down [D, I]) once the gate and up weights are stacked, for kernels that
        run this MLP inside another op (RoutedExperts.forward_gemv); None with biases or before."""
        if (self.gate_up.weight is None or self.gate_up.weight.shape[0] == 0 or self.down_proj.bias is not None
                or self.gate_up.bias is not None):  # fmt: skip
            return None
        return self.gate_up.weight, self.down_proj.weight


class TopkRouter(nn.Module):
    """Sigmoid scores; group-limited top-k chosen on score + bias; weights from the unbiased scores.

    Returns (weights [T, k] fp32, expert ids [T, k]). Weights are renormalised
    to sum 1 when ``norm_topk_prob`` and then scaled by ``routed_scaling_factor``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_groups: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        if num_experts % num_groups or num_experts // num_groups < 2:
            raise ValueError(
                f"n_group={num_groups} must divide num_experts={num_experts} into groups of at least 2 experts"
            )
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        # Kept in fp32 like transformers (_keep_in_fp32_modules_strict); the bias only steers the choice.
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x, self.weight)  # [T, E] fp32
        if self.topk_groups == self.num_groups:  # no group limit
            return moe_route(logits, self.e_score_correction_bias, self.top_k, self.norm_topk_prob,
                             self.routed_scaling_factor)  # fmt: skip
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias
        grouped = biased.view(x.shape[0], self.num_groups, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # best two experts per group
        top_groups = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        biased = biased.masked_fill(~group_mask.unsqueeze(-1).expand_as(grouped).reshape_as(biased), float("-inf"))
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class ExpertWeights(nn.Module):
    """One routed expert as the checkpoint stores it: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)


class RoutedExperts(nn.ModuleList):
    """Routed experts; run on the stacked ``gate_up_proj`` / ``down_proj`` made by ``fuse()``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None) -> None:
        super().__init__(ExpertWeights(hidden_size, intermediate_size, dtype) for _ in range(num_experts))
        self.intermediate_size = intermediate_size

    @torch.no_grad()
    def fuse(self) -> None:
        """Stack loaded per-expert weights; afterwards each expert's params are views into the stacks."""
        size = self.intermediate_size
        gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in self])
        down = torch.stack([e.w2.weight for e in self])
        self.register_buffer("gate_up_proj", gate_up, persistent=False)
        self.register_buffer("down_proj", down, persistent=False)
        for i, e in enumerate(self):
            e.w1.weight.data, e.w3.weight.data = gate_up[i, :size], gate_up[i, size:]
            e.w2.weight.data = down[i]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                addend: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x [T, D]; weights, ids [T, k]; plus ``addend`` [T, D] if given (a separate, rounded add)."""
        on_gpu = kernels_apply(x)
        if self.gemv_applies(x, ids):
            return self.forward_gemv(x, weights, ids, addend)
        if on_gpu and grouped_mm_applies(x):
            if ALL_EXPERTS_MIN_TOKENS <= x.shape[0] <= DENSE_MAX_TOKENS:
                return self.forward_all_experts(x, weights, ids, addend)
            return self.forward_grouped(x, weights, ids, addend)
        if on_gpu and x.shape[0] <= DENSE_MAX_TOKENS:
            out = self._forward_dense(x, weights, ids)
        else:
            out = self._forward_loop(x, weights, ids)
        return out if addend is None else out + addend

    def _forward_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Loops over the experts some token picked, in id order."""
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=len(self))
        for expert in counts.nonzero().flatten().tolist():  # host sync: fine for a reference
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            # index_put_(accumulate) rather than index_add_: same sums (a token picks an expert
            # once), but index_add_ on CPU is pathologically slow for small tensors under load.
            out.index_put_((token,), (y * weights[token, slot, None]).to(x.dtype), accumulate=True)
        return out

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        addend: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The (token, pick) pairs grouped by expert: two grouped matmuls over only the picked experts.

        No host sync and no data-dependent shapes (CUDA-graph safe). The k picks of
        a token are summed in fp32 in pick order, rounding once, as the dense path.
        """
        src_token, pos, ends = moe_align(ids, len(self))  # expert e's rows: [ends[e-1], ends[e])
        gate_up = torch._grouped_mm(x[src_token], self.gate_up_proj.transpose(1, 2), offs=ends)
        y = torch._grouped_mm(silu_mul(gate_up), self.down_proj.transpose(1, 2), offs=ends)  # [T*k, D]
        return moe_combine(y, pos, weights, addend)

    def gemv_applies(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether forward() runs forward_gemv: on a GPU, for few tokens (GEMV_MAX_TOKENS)."""
        tokens, top_k = ids.shape
        return (kernels_apply(x) and tokens <= GEMV_MAX_TOKENS
                and tokens * top_k <= GEMV_MAX_PAIRS_PER_EXPERT * len(self))  # fmt: skip

    def forward_gemv(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     addend: torch.Tensor | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """Each (token, pick) pair's expert rows times the token: two kernels on a GPU, reading
        only the picked experts, rounding where forward_grouped rounds. For a few tokens, where
        the grouped matmuls' tiles are mostly empty. ``shared`` (GatedMLP.stacked_weights()):
        a shared expert run in the same two kernels, its output the addend."""
        return moe_gemv(x, weights, ids, self.gate_up_proj, self.down_proj, addend, shared)

    def forward_all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                            addend: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Every expert on every token through one batched matmul per projection, then each token's
        picks combined exactly as forward_grouped combines them.

        Once a batch is large enough that nearly every expert is picked, the weights are read
        once either way; the batched matmuls read them faster than grouped ones over a few rows
        per expert, and need no regrouping of the tokens.
        """
        gate_up = torch.matmul(x, self.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
        y = torch.matmul(silu_mul(gate_up), self.down_proj.transpose(1, 2))  # [E, T, D]
        return moe_combine(y.view(-1, y.shape[-1]), ids, weights, addend, expert_major=True)  # pick j of t: y[ids, t]

    def _forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, combined with zero weight for the unpicked: no host sync.

        For decode-sized batches on a GPU, where the loop above stalls the host on
        each expert's token list. Reads every expert (at batch >= 16 with top-4 of
        16 nearly all are picked anyway); sums the k picks in fp32, rounding once.
        """
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
        y = torch.matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, D]
        dense = torch.zeros(x.shape[0], len(self), dtype=torch.float32, device=x.device).scatter_(1, ids, weights)
        return torch.einsum("etd,te->td", y.float(), dense).to(x.dtype)


class SparseMoE(nn.Module):
    """Routed experts plus always-on shared experts: experts(x) + shared_experts(x)."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        num_shared_experts: int,
        router: TopkRouter,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.gate = router
        self.experts = RoutedExperts(num_experts, hidden_size, moe_intermediate_size, dtype)
        self.shared_experts = GatedMLP(hidden_size, moe_intermediate_size * num_shared_experts, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.experts.gemv_applies(x, ids) and (shared := self.shared_experts.stacked_weights()) is not None:
            return self.experts.forward_gemv(x, weights, ids, shared=shared)  # one pair of kernels for both
        return self.experts(x, weights, ids, addend=self.shared_experts(x))
