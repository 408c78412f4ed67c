"""Per-step metadata that layers read, set for exactly one forward pass.

Layer signatures stay ``forward(positions, hidden_states)``; anything about the
batch (where each sequence's tokens sit in the flat batch, where their KV goes,
which recurrent-state slot they own) comes from ``get_forward_context()``.

Flat batch layout for one step with three sequences::

    tokens:          | a a a a | b | c c |        (T = 7 new tokens)
    query_start_loc:  0         4   5     7
    context_lens:     [12, 30, 0]   tokens already in the cache (num_computed_tokens)
    seq_lens:         [16, 31, 2]   context + new

A sequence with context_len == 0 starts from an empty recurrent state: layers
zero its slot before use, so a freed slot's stale contents never leak.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator

import numpy as np
import torch


# numpy converts a list of Python numbers about 4x as fast as torch.tensor does (~10 against ~40 ns an element)
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.float32: np.float32}


def upload(values: list | np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list (or array) as a tensor on ``device``. To a GPU it goes through pinned memory without waiting:
    a copy from pageable memory first waits for every kernel queued before it, which would keep the host from
    preparing a step while the one before runs. torch's caching host allocator keeps the pinned buffer until
    the copy has run."""
    device = torch.device(device)
    np_dtype = _NUMPY_DTYPES.get(dtype)
    host = torch.tensor(values, dtype=dtype) if np_dtype is None else torch.from_numpy(np.asarray(values, np_dtype))
    if device.type != "cuda":
        return host.to(device)
    if torch.cuda.is_current_stream_capturing():  # a graph would replay the copy from a freed host buffer
        raise RuntimeError("upload() inside a CUDA graph capture: captured steps read their inputs from static "
                           "buffers (atom/worker/cuda_graph.py)")
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # [B + 1] host offsets into the flat batch
    context_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    state_slots: torch.Tensor  # [B] int64 slot holding each sequence's state before this step (-1: none)
    block_size: int
    # Where the state goes after the step: the final state to state_out_slots[b]; for the
    # sequences in per_token_state_seqs (speculative verification) the state after their
    # token j goes to state_out_slots[b] + j, so the next step can resume from any accepted one.
    state_out_slots: torch.Tensor | None = None
    per_token_state_seqs: tuple[int, ...] = ()
    positions: torch.Tensor | None = None  # [T] int64: each token's position (context_lens[b] + j)

    def __post_init__(self) -> None:
        if self.state_out_slots is None:
            self.state_out_slots = self.state_slots

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    # Derived once per step (every layer asks): host values from the host lists, device
    # tensors uploaded once on the step's device, so no layer syncs or re-uploads.
    @cached_property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]

    @cached_property
    def is_pure_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @cached_property
    def uniform_query_len(self) -> int:
        """The query length every sequence shares; 0 when they differ (or there are none)."""
        lens = set(self.query_lens)
        return lens.pop() if len(lens) == 1 else 0

    @cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    @property
    def device(self) -> torch.device:
        return self.state_slots.device

    @cached_property
    def has_initial_state(self) -> torch.Tensor:
        """[B] bool: False for a sequence starting from an empty recurrent state (context_len == 0)."""
        return upload([c > 0 for c in self.context_lens], torch.bool, self.device)

    @cached_property
    def token_seq_ids(self) -> torch.Tensor:
        """[T] int64: the sequence each token of the flat batch belongs to."""
        ids = np.repeat(np.arange(self.num_seqs), np.asarray(self.query_lens, np.int64))
        return upload(ids, torch.long, self.device)

    @cached_property
    def token_seq_lens(self) -> torch.Tensor:
        """[T] int32: positions each token attends to (its own included): context_len + j + 1."""
        lens = [c + j + 1 for c, n in zip(self.context_lens, self.query_lens) for j in range(n)]
        return upload(lens, torch.int32, self.device)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    # layer index -> that layer's cache tensors (KV blocks or state pool)
    caches: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context is set: layers run only inside set_forward_context()")
    return _CONTEXT


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    state_slots: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
    state_out_slots: list[int] | None = None,
    per_token_state_seqs: tuple[int, ...] = (),
) -> AttentionMetadata:
    """Flat step metadata from per-sequence counters (the runner's only job here)."""
    starts = [0, *itertools.accumulate(query_lens)]
    for b, (n, ctx_len, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        if n and (ctx_len + n - 1) // block_size >= len(table):
            raise IndexError(f"sequence {b}: position {ctx_len + n - 1} is past its {len(table)} blocks")
    width = max((len(t) for t in block_tables), default=0) or 1
    tables = np.array([t + [0] * (width - len(t)) for t in block_tables], np.int64).reshape(len(block_tables), width)
    # Each token's cache slot: its sequence's block for its position, then the offset in the block.
    lens = np.asarray(query_lens, np.int64)
    seq = np.repeat(np.arange(len(lens)), lens)
    # the step's token i, the j-th of sequence b, sits at position context_lens[b] + j = i + context_lens[b] - starts[b]
    shift = np.asarray(context_lens, np.int64) - np.asarray(starts[:-1], np.int64)
    positions = np.arange(starts[-1]) + np.repeat(shift, lens)
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(
        query_start_loc=starts,
        context_lens=list(context_lens),
        seq_lens=[c + n for c, n in zip(context_lens, query_lens)],
        block_tables=upload(tables, torch.long, device),
        slot_mapping=upload(slots, torch.long, device),
        state_slots=upload(state_slots, torch.long, device),
        block_size=block_size,
        state_out_slots=None if state_out_slots is None else upload(state_out_slots, torch.long, device),
        per_token_state_seqs=tuple(per_token_state_seqs),
        positions=upload(positions, torch.long, device),
    )
