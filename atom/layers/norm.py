"""RMS norms computing in fp32, rounding exactly where transformers rounds."""

from __future__ import annotations

import torch
from torch import nn

from atom.ops.cuda.fused import add_rms_norm, rms_norm, rms_normalize


class RMSNorm(nn.Module):
    """``weight * normalize(x).to(x.dtype)``: the weight multiplies in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # one kernel on a GPU

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s), s)`` for ``s = x + residual`` (the add rounds as a separate add would): one kernel on a GPU."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """``normalize(x) * weight * sigmoid(gate)``, all in fp32, rounded once at the end."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = self.weight.float() * rms_normalize(x, self.eps)
        return (out * torch.sigmoid(gate.float())).to(x.dtype)
