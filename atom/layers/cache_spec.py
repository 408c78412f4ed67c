"""What cache memory each layer needs; the model runner allocates from these.

Attention-type layers (paged KV, MLA latent) are sized per block of
``block_size`` tokens; recurrent layers (KDA) are sized per state slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PagedKVSpec:
    """GQA attention: K and V, each [num_blocks, block_size, num_kv_heads, head_dim]."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * _nbytes((block_size, self.num_kv_heads, self.head_dim), self.dtype)

    def allocate(self, num_blocks: int, block_size: int, device) -> tuple[torch.Tensor, ...]:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))


@dataclass(frozen=True)
class MLASpec:
    """MLA: one latent row per token, [num_blocks, block_size, kv_lora_rank + rope_dim]."""

    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return _nbytes((block_size, self.kv_lora_rank + self.rope_dim), self.dtype)

    def allocate(self, num_blocks: int, block_size: int, device) -> tuple[torch.Tensor, ...]:
        shape = (num_blocks, block_size, self.kv_lora_rank + self.rope_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=device),)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Slot-indexed state pool: one tensor per entry, each [num_slots, *shape]."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def bytes_per_slot(self) -> int:
        return sum(_nbytes(s, d) for s, d in zip(self.shapes, self.dtypes))

    def allocate(self, num_slots: int, device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros((num_slots, *s), dtype=d, device=device) for s, d in zip(self.shapes, self.dtypes))


CacheSpec = PagedKVSpec | MLASpec | RecurrentStateSpec
