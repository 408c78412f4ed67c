"""Torch reference ops, plus the varlen <-> padded batch layout they share.

Layers see a flat batch ``[T, ...]`` of every sequence's new tokens this step.
Recurrent and attention references are easier to write over a right-padded
``[B, L, ...]`` batch. A step is split into at most two such groups, so that
one long prefill does not pad every decode row to its length::

    flat:      | a0 a1 a2 | b0 | c0 c1 | d0 |      query_start_loc = [0, 3, 4, 6, 7]
    decode:    [[b0], [d0]]                         seqs (1, 3), L = 1
    prefill:   [[a0 a1 a2],                         seqs (0, 2), L = 3
                [c0 c1 --]]                         '--' = zeros

Right padding never changes a valid position's result in causal ops, so the
ops may compute garbage at '--' as long as it is finite; ``unpad`` drops it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from atom.forward_context import upload


@dataclass(frozen=True)
class PaddedLayout:
    """Some sequences of one step, right-padded to ``[num_seqs, max_len]``."""

    seqs: tuple[int, ...]  # which sequences of the step (host)
    seq_ids: torch.Tensor  # [B'] the same, on device
    token_ids: torch.Tensor  # [T'] their tokens' rows in the step's flat batch
    index: torch.Tensor  # [T'] b' * max_len + j for token j of the b'-th sequence here
    lengths: torch.Tensor  # [B'] query length of each sequence here
    cu_seqlens: torch.Tensor  # [B' + 1] int64: sequence b' is rows [cu[b'], cu[b'+1]) of unpad()'s output
    max_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat [T, *rest] of the whole step -> [B', L, *rest] of this group, zeros at padding."""
        rows = x[self.token_ids]
        if self.max_len == 1:
            return rows.unsqueeze(1)
        out = x.new_zeros(self.num_seqs * self.max_len, *x.shape[1:])
        out[self.index] = rows
        return out.view(self.num_seqs, self.max_len, *x.shape[1:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[B', L, *rest] -> [T', *rest], in the order of ``token_ids``."""
        if self.max_len == 1:
            return y.squeeze(1)
        return y.reshape(self.num_seqs * self.max_len, *y.shape[2:])[self.index]


def split_decode_prefill(
    query_start_loc: list[int], device: torch.device, apart: tuple[int, ...] = ()
) -> tuple[PaddedLayout, ...]:
    """The step's decode rows (one token each), its longer rows, and the rows in ``apart``
    (speculative verification, which keeps a state per token) as separate groups;
    empty groups dropped."""
    return _split(tuple(query_start_loc), torch.device(device), tuple(apart))


@functools.lru_cache(maxsize=16)  # every layer of a step asks for the same split
def _split(starts: tuple[int, ...], device: torch.device, apart: tuple[int, ...]) -> tuple[PaddedLayout, ...]:
    lens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
    rest = [b for b in range(len(lens)) if b not in apart]
    decode = tuple(b for b in rest if lens[b] == 1)
    prefill = tuple(b for b in rest if lens[b] > 1)
    return tuple(_layout(group, starts, lens, device) for group in (decode, prefill, apart) if group)


def _layout(seqs: tuple[int, ...], starts: tuple[int, ...], lens: list[int], device) -> PaddedLayout:
    max_len = max(lens[b] for b in seqs)
    tokens = [starts[b] + j for b in seqs for j in range(lens[b])]
    index = [i * max_len + j for i, b in enumerate(seqs) for j in range(lens[b])]

    def tensor(values: list[int]) -> torch.Tensor:
        return upload(values, torch.long, device)

    return PaddedLayout(
        seqs=seqs,
        seq_ids=tensor(list(seqs)),
        token_ids=tensor(tokens),
        index=tensor(index),
        lengths=tensor([lens[b] for b in seqs]),
        cu_seqlens=tensor([0] + list(itertools.accumulate(lens[b] for b in seqs))),
        max_len=max_len,
    )
