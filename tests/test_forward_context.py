"""A step's flat metadata (``build_attention_metadata``) against its definition, token by token."""

from __future__ import annotations

import random

import pytest
import torch

from atom.forward_context import build_attention_metadata, upload


def test_metadata_matches_its_definition_token_by_token():
    rng = random.Random(0)
    for _ in range(200):
        batch, block_size = rng.randint(0, 6), rng.choice([1, 4, 16])
        query_lens = [rng.randint(0, 40) for _ in range(batch)]
        context_lens = [rng.randint(0, 60) for _ in range(batch)]
        tables = [rng.sample(range(5000), (c + n + block_size - 1) // block_size + rng.randint(0, 2))
                  for c, n in zip(context_lens, query_lens)]  # fmt: skip
        slots = [rng.randint(-1, 9) for _ in range(batch)]
        md = build_attention_metadata(query_lens, context_lens, tables, slots, block_size)

        expected_slots, seq_ids, seq_lens, positions = [], [], [], []
        for b, (n, c, table) in enumerate(zip(query_lens, context_lens, tables)):
            for j in range(n):
                pos = c + j
                expected_slots.append(table[pos // block_size] * block_size + pos % block_size)
                seq_ids.append(b)
                seq_lens.append(pos + 1)
                positions.append(pos)
        assert md.slot_mapping.tolist() == expected_slots and md.positions.tolist() == positions
        assert md.slot_mapping.dtype == md.block_tables.dtype == torch.int64
        assert md.token_seq_ids.tolist() == seq_ids and md.token_seq_lens.tolist() == seq_lens
        assert md.query_start_loc == [0, *torch.tensor(query_lens, dtype=torch.long).cumsum(0).tolist()]
        width = max((len(t) for t in tables), default=0) or 1
        assert md.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
        assert md.state_slots.tolist() == slots == md.state_out_slots.tolist()
        assert md.has_initial_state.tolist() == [c > 0 for c in context_lens]


def test_a_position_past_the_block_table_is_an_error():
    with pytest.raises(IndexError, match="sequence 1: position 8 is past its 2 blocks"):
        build_attention_metadata([1, 5], [0, 4], [[7], [3, 5]], [0, 1], 4)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32, torch.float64])
def test_upload_keeps_values_and_dtype(dtype):
    values = [0, 1, 1, 0, 3] if dtype != torch.bool else [True, False, True]
    out = upload(values, dtype, "cpu")
    assert out.dtype == dtype and out.tolist() == torch.tensor(values, dtype=dtype).tolist()
    assert upload([[1, 2], [3, 4]], dtype, "cpu").shape == (2, 2)
