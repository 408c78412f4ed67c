"""Feed-forward layers: the dense gated MLP and a DeepSeek-V3-style MoE.

Checkpoints store routed experts one by one (``experts.{e}.w1/w2/w3.weight``,
w1 = gate, w3 = up, w2 = down), which is what the loader fills. After loading,
``RoutedExperts.fuse()`` re-homes them into two stacked tensors without
copying memory twice::

    gate_up_proj [E, 2I, D] = cat(w1, w3)      down_proj [E, D, I] = w2

and the per-expert parameters become views into those stacks. ``SparseMoE.fuse()``
puts a shared expert of an expert's size after the routed ones in the same
stacks ([E + 1, ...], the routed views ``[:E]``), so the every-expert path
computes it in the same batched matmuls.

Five ways to run the routed experts, all computing the same sums and rounding at the same points
(choose_path picks one):

- the expert loop (the reference): one matmul pair per picked expert; it
  syncs with the host once per expert, fine on a CPU;
- gemv (GPU, any dtype, a few tokens a step): two kernels that multiply each
  (token, pick) pair's expert rows with the token (``fused.moe_gemv``);
- every expert (GPU, bf16 on Hopper): one batched matmul per projection over
  all experts, then each token's picks combined; for batches that pick nearly
  every expert anyway;
- grouped (GPU, bf16 on Hopper): the (token, pick) pairs sorted by expert, two
  ``torch._grouped_mm`` calls that read only the picked experts' weights;
- dense (GPU, other dtypes, up to ``DENSE_MAX_TOKENS`` tokens): every expert
  on every token, zero weight for the unpicked ones.

None but the loop syncs with the host, so they also run inside CUDA graphs.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from atom.layers.linear import Linear, StackedLinears
from atom.ops.cuda import kernels_apply
from atom.ops.cuda.fused import moe_align, moe_combine, moe_gemv, moe_route, router_logits, silu_mul

# Which GPU path a batch of T tokens with k picks each over E experts takes (choose_path), from
# bench/kernels_gpu.py --only moe_paths: each path forced, bf16, a shared expert, at E=256 k=8 (Kimi-Linear),
# E=64 k=6 and E=16 k=4, 1-256 tokens (GPU_NOTES.md, session 17).
# - gemv (forward_gemv) reads an expert's rows once per (token, pick) pair, a repeat mostly from L2. It was
#   the fastest path up to 1.5 pairs per expert on average (T * k <= 1.5 E) in all three, and as fast as
#   every expert at 1.5 (T=48 at E=256, T=16 at E=64); from 2 pairs per expert every expert was faster
#   (1.15x at E=16 and T=8, 1.17x at E=256 and T=64). ATOM_MOE_GEMV_MAX_TOKENS overrides the token limit
#   (read at import; 0 turns the path off).
GEMV_MAX_TOKENS = int(os.environ.get("ATOM_MOE_GEMV_MAX_TOKENS", 48))
GEMV_MAX_PAIRS_PER_EXPERT = 1.5
# - every expert (forward_all_experts, bf16 on Hopper; _forward_dense otherwise) reads every expert's
#   weights in one batched matmul per projection, faster per byte than the grouped matmuls over the picked
#   experts (67-81% of the copy ceiling where nearly every expert is picked, grouped 43-67%). It was faster
#   than grouped wherever the batch was expected to pick at least 2/3 of the experts (1 - (1 - k/E)^T, picks
#   spread evenly), up to 128 tokens at E=256, 192 at E=64 and 256 at E=16 (where its extra arithmetic, T * E
#   expert rows, starts to count): 1.59x at E=16 and 16 tokens, 1.32x at E=64 and 24.
#   ATOM_MOE_ALL_EXPERTS_MIN_SHARE overrides the share (read at import).
ALL_EXPERTS_MIN_SHARE = float(os.environ.get("ATOM_MOE_ALL_EXPERTS_MIN_SHARE", 2 / 3))
DENSE_MAX_TOKENS = 128
# The every-expert path runs a shared expert stacked after the routed ones (SparseMoE.fuse) in its batched
# matmuls, where it was two more linears a layer (GPU_NOTES.md, session 30). ATOM_MOE_FOLD_SHARED=0 turns
# that off (read at import; the weights stay stacked).
FOLD_SHARED = os.environ.get("ATOM_MOE_FOLD_SHARED", "1") != "0"
# - grouped (forward_grouped, bf16 on Hopper): the rest, and every batch of more than DENSE_MAX_TOKENS.


def expected_share_picked(tokens: int, top_k: int, num_experts: int) -> float:
    """The share of the experts that a batch picks at least once, if each token's k picks were
    spread evenly over the experts."""
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def routed_path(x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> str:
    """Which way RoutedExperts.forward runs x [T, D] with picks ids [T, k] (see choose_path)."""
    on_gpu = kernels_apply(x)
    return choose_path(*ids.shape, num_experts, on_gpu=on_gpu, grouped_mm=on_gpu and grouped_mm_applies(x))


def choose_path(tokens: int, top_k: int, num_experts: int, on_gpu: bool, grouped_mm: bool) -> str:
    """"gemv", "all" (every expert in batched matmuls) or "grouped" on a GPU with bf16 grouped
    matmuls; "gemv" or "dense" on other GPUs and dtypes up to DENSE_MAX_TOKENS tokens; else "loop"
    (the reference). Only the shapes, dtype and device decide, so a CUDA graph captured for a batch
    size keeps its path."""
    if not on_gpu:
        return "loop"
    if tokens <= GEMV_MAX_TOKENS and tokens * top_k <= GEMV_MAX_PAIRS_PER_EXPERT * num_experts:
        return "gemv"
    if not grouped_mm:
        return "dense" if tokens <= DENSE_MAX_TOKENS else "loop"
    every = tokens <= DENSE_MAX_TOKENS and expected_share_picked(tokens, top_k, num_experts) >= ALL_EXPERTS_MIN_SHARE
    return "all" if every else "grouped"


def grouped_mm_applies(x: torch.Tensor) -> bool:
    """torch's grouped matmul runs on CUDA for bf16 (Hopper and newer, and torch >= 2.8)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and _is_hopper_or_newer(x.device.index))  # fmt: skip


@functools.cache
def _is_hopper_or_newer(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
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
        self.holds_shared = False  # fuse(shared): the stacks end with a shared expert (gate_up_with_shared, ...)

    @torch.no_grad()
    def fuse(self, shared: GatedMLP | None = None) -> None:
        """Stack loaded per-expert weights; afterwards each expert's params are views into the stacks.
        ``shared``: an expert-sized MLP without biases, stacked after the routed experts (its params
        views into the stacks too), for forward_all_experts(with_shared=True)."""
        size, count = self.intermediate_size, len(self) + (shared is not None)
        first = self[0].w1.weight
        gate_up = torch.empty(count, 2 * size, first.shape[1], dtype=first.dtype, device=first.device)
        down = torch.empty(count, first.shape[1], size, dtype=first.dtype, device=first.device)
        for i, e in enumerate(self):
            gate_up[i, :size], gate_up[i, size:], down[i] = e.w1.weight, e.w3.weight, e.w2.weight
            e.w1.weight.data, e.w3.weight.data = gate_up[i, :size], gate_up[i, size:]
            e.w2.weight.data = down[i]
        if shared is not None:
            shared.gate_up.stack(weight_out=gate_up[-1])
            down[-1] = shared.down_proj.weight
            shared.down_proj.weight.data = down[-1]
            self.register_buffer("gate_up_with_shared", gate_up, persistent=False)
            self.register_buffer("down_with_shared", down, persistent=False)
            self.holds_shared = True
        self.register_buffer("gate_up_proj", gate_up[: len(self)], persistent=False)
        self.register_buffer("down_proj", down[: len(self)], persistent=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                addend: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:  # fmt: skip
        """x [T, D]; weights, ids [T, k]; plus ``addend`` [T, D] if given (a separate, rounded add).
        ``path``: routed_path(x, ids, E) when the caller has already asked it."""
        path = path or routed_path(x, ids, len(self))
        if path == "gemv":
            return self.forward_gemv(x, weights, ids, addend)
        if path == "grouped":
            return self.forward_grouped(x, weights, ids, addend)
        if path == "all":
            return self.forward_all_experts(x, weights, ids, addend)
        out = self._forward_dense(x, weights, ids) if path == "dense" else self._forward_loop(x, weights, ids)
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

    def forward_gemv(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     addend: torch.Tensor | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """Each (token, pick) pair's expert rows times the token: two kernels on a GPU, reading
        only the picked experts, rounding where forward_grouped rounds. For a few tokens, where
        the grouped matmuls' tiles are mostly empty. ``shared`` (GatedMLP.stacked_weights()):
        a shared expert run in the same two kernels, its output the addend."""
        return moe_gemv(x, weights, ids, self.gate_up_proj, self.down_proj, addend, shared)

    def forward_all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                            addend: torch.Tensor | None = None, with_shared: bool = False) -> torch.Tensor:  # fmt: skip
        """Every expert on every token through one batched matmul per projection, then each token's
        picks combined exactly as forward_grouped combines them.

        Once a batch is large enough that nearly every expert is picked, the weights are read
        once either way; the batched matmuls read them faster than grouped ones over a few rows
        per expert, and need no regrouping of the tokens. ``with_shared`` (after fuse(shared)):
        the shared expert stacked after the routed ones runs in the same matmuls, its output the
        addend, rounded where its own MLP rounds.
        """
        if with_shared and addend is not None:
            raise ValueError("forward_all_experts: an addend or the shared expert, not both")
        gate_up_w, down_w = ((self.gate_up_with_shared, self.down_with_shared) if with_shared
                             else (self.gate_up_proj, self.down_proj))  # fmt: skip
        gate_up = torch.matmul(x, gate_up_w.transpose(1, 2))  # [E (+ 1), T, 2I]
        y = torch.matmul(silu_mul(gate_up), down_w.transpose(1, 2))  # [E (+ 1), T, D]
        if with_shared:
            y, addend = y[: len(self)], y[len(self)]
        # pick j of token t: y[ids[t, j], t]
        return moe_combine(y.reshape(-1, y.shape[-1]), ids, weights, addend, expert_major=True)

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

    @torch.no_grad()
    def fuse(self) -> None:
        """After loading: the routed experts stacked, the shared expert's gate and up stacked; a shared
        expert of an expert's size without biases goes into the routed experts' stacks after them."""
        shared = self.shared_experts
        fits = (shared.gate_proj.weight.shape == self.experts[0].w1.weight.shape and shared.gate_proj.bias is None
                and shared.up_proj.bias is None and shared.down_proj.bias is None)  # fmt: skip
        self.experts.fuse(shared if fits else None)
        if not fits:
            shared.gate_up.stack()

    def capturable(self, tokens: int) -> bool:
        """Whether its GPU path for this many tokens makes no host sync (every path but the expert loop),
        so that a CUDA graph can hold it. An expert's weight stands for the input: same dtype and device."""
        weight = self.experts[0].w1.weight
        path = choose_path(tokens, self.gate.top_k, len(self.experts), on_gpu=True,
                           grouped_mm=grouped_mm_applies(weight))  # fmt: skip
        return path != "loop"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        path = routed_path(x, ids, len(self.experts))
        if path == "gemv" and (shared := self.shared_experts.stacked_weights()) is not None:
            return self.experts.forward_gemv(x, weights, ids, shared=shared)  # one pair of kernels for both
        if path == "all" and FOLD_SHARED and self.experts.holds_shared:
            return self.experts.forward_all_experts(x, weights, ids, with_shared=True)  # one matmul pair for both
        return self.experts(x, weights, ids, addend=self.shared_experts(x), path=path)
