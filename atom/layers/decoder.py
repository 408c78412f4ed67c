"""The pre-norm decoder layer both model families share: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

from __future__ import annotations

import torch
from torch import nn


class PreNormDecoderLayer(nn.Module):
    """A subclass sets ``input_layernorm``, ``self_attn`` (called as ``self_attn(positions, x)``),
    ``post_attention_layernorm`` (an ``RMSNorm``) and ``mlp``."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states, delta = self.forward_residual(positions, hidden_states)
        return hidden_states + delta

    def forward_residual(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                         delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The layer on the residual stream ``hidden_states + delta`` (no delta: hidden_states), returned the
        same way, its last add left to the next norm (``RMSNorm.forward_add``: the add and the norm in one
        kernel). The adds round exactly as in forward, in the model dtype as transformers' do."""
        if delta is None:
            normed = self.input_layernorm(hidden_states)
        else:
            normed, hidden_states = self.input_layernorm.forward_add(hidden_states, delta)
        attn = self.self_attn(positions, normed)
        normed, hidden_states = self.post_attention_layernorm.forward_add(hidden_states, attn)
        return hidden_states, self.mlp(normed)
