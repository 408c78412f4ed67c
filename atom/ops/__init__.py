"""Torch reference ops, plus the varlen <-> padded batch layout they share.

Layers see a flat batch ``[T, ...]`` of every sequence's new tokens this step.
Recurrent and attention references are easier to write over a right-padded
``[B, L, ...]`` batch (``L`` = longest query this step)::

    flat:    | a0 a1 a2 | b0 | c0 c1 |          query_start_loc = [0, 3, 4, 6]
    padded:  [[a0 a1 a2],
              [b0 -- --],                         '--' = fill value (zeros)
              [c0 c1 --]]

Right padding never changes a valid position's result in causal ops, so the
ops may compute garbage at '--' as long as it is finite; ``unpad`` drops it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PaddedLayout:
    """Where each flat token sits in a right-padded ``[num_seqs, max_len]`` batch."""

    num_seqs: int
    max_len: int
    index: torch.Tensor  # [T] int64: b * max_len + j for token j of sequence b
    lengths: torch.Tensor  # [B] int64 query length of each sequence

    @classmethod
    def from_query_start_loc(cls, query_start_loc: list[int], device: torch.device) -> PaddedLayout:
        starts = query_start_loc
        lens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
        max_len = max(lens, default=0) or 1
        index = [b * max_len + j for b, n in enumerate(lens) for j in range(n)]
        return cls(
            num_seqs=len(lens),
            max_len=max_len,
            index=torch.tensor(index, dtype=torch.long, device=device),
            lengths=torch.tensor(lens, dtype=torch.long, device=device),
        )

    @property
    def is_decode(self) -> bool:
        """One token per sequence: the flat batch already is the padded batch."""
        return self.max_len == 1 and self.index.numel() == self.num_seqs

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, *rest] -> [B, L, *rest], zeros at padded positions."""
        if self.is_decode:
            return x.unsqueeze(1)
        out = x.new_zeros(self.num_seqs * self.max_len, *x.shape[1:])
        out[self.index] = x
        return out.view(self.num_seqs, self.max_len, *x.shape[1:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[B, L, *rest] -> [T, *rest]."""
        if self.is_decode:
            return y.squeeze(1)
        return y.reshape(self.num_seqs * self.max_len, *y.shape[2:])[self.index]
