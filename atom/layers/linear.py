"""The models' linears: ``Linear``, and linears that share an input run as one matmul.

Both multiply through ``atom.ops.cuda.linear``: ``F.linear``, except on a GPU
at decode batch sizes, where one kernel reads each weight row once for all the
step's tokens (``csrc/gemv.cu``).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.ops.cuda.linear import linear


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint names) whose product goes through ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class StackedLinears:
    """Several linears over the same input as one ``[sum(out), in]`` matmul.

    ``stack()`` (after loading) concatenates their weights (and biases) once
    and rebinds each linear's parameters to views into the stack, so memory
    is not doubled and the checkpoint names still load. Before ``stack()``
    the concatenation is built per call.
    """

    def __init__(self, *linears: nn.Linear) -> None:
        if len({lin.bias is None for lin in linears}) > 1:
            raise ValueError("StackedLinears: the linears must all have a bias or all have none")
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    @torch.no_grad()
    def stack(self, weight_out: torch.Tensor | None = None) -> None:
        """``weight_out``: where the stacked weight goes ([sum(out), in], e.g. a view into a larger stack
        of weights); a new tensor by default."""
        self.weight = torch.cat([lin.weight for lin in self.linears], out=weight_out)
        has_bias = self.linears[0].bias is not None
        self.bias = torch.cat([lin.bias for lin in self.linears]) if has_bias else None
        start = 0
        for lin, size in zip(self.linears, self.sizes):
            lin.weight.data = self.weight[start : start + size]
            if has_bias:
                lin.bias.data = self.bias[start : start + size]
            start += size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs side by side: [..., sum(out)]."""
        if self.weight is None:
            weight = torch.cat([lin.weight for lin in self.linears])
            bias = None if self.linears[0].bias is None else torch.cat([lin.bias for lin in self.linears])
            return linear(x, weight, bias)
        return linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each linear's output, as views into one matmul's result."""
        return self(x).split(self.sizes, dim=-1)
