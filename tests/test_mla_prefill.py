"""MLA's expanded prefill form (``mla_prefill``, what a GPU runs for prefills) against the absorbed
torch reference (``mla_attention`` then W_UV): fresh prompts, chunks after a context (causal from
the bottom right), several sequences in one step over a shuffled paged cache. On the CPU in fp32 and
fp64, and on a GPU in bf16 at Kimi-Linear's sizes (the fused attention kernels torch picks there)."""

from __future__ import annotations

import pytest
import torch

from atom.forward_context import AttentionMetadata
from atom.ops import split_decode_prefill
from atom.ops.mla import mla_attention, mla_prefill

HEADS, RANK, ROPE, NOPE, V = 4, 32, 8, 16, 12
BLOCK = 4


def _step(contexts: list[int], new: list[int], dtype: torch.dtype, seed: int, device: str = "cpu",
          heads: int = HEADS, rank: int = RANK, rope: int = ROPE, nope: int = NOPE, v: int = V):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(contexts, new)]
    per_seq = [-(-s // BLOCK) for s in seq_lens]
    blocks = torch.randperm(sum(per_seq) + 3, generator=gen)  # shuffled, some never used
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.long)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = blocks[used : used + n]
        used += n
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    md = AttentionMetadata(query_start_loc=starts, context_lens=contexts, seq_lens=seq_lens,
                           block_tables=tables.to(device),
                           slot_mapping=torch.zeros(starts[-1], dtype=torch.long, device=device),
                           state_slots=torch.zeros(len(seq_lens), dtype=torch.long, device=device),
                           block_size=BLOCK)  # fmt: skip
    cache = torch.randn(len(blocks), BLOCK, rank + rope, generator=gen).to(device, dtype)
    q = torch.randn(starts[-1], heads, nope + rope, generator=gen).to(device, dtype)
    kv_b = (torch.randn(heads * (nope + v), rank, generator=gen) * rank**-0.5).to(device, dtype)
    return md, cache, q, kv_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "contexts, new",
    [([0], [9]), ([0, 0, 0], [2, 17, 5]), ([6], [3]), ([0, 13, 1, 40], [7, 2, 11, 5])],
)
def test_mla_prefill_equals_the_absorbed_reference(contexts, new, dtype):
    md, cache, q, kv_b = _step(contexts, new, dtype, seed=len(new) + sum(contexts))
    scale = (NOPE + ROPE) ** -0.5
    (layout,) = split_decode_prefill(md.query_start_loc, q.device)  # every sequence brings >= 2 tokens
    w_uk, w_uv = kv_b.view(HEADS, NOPE + V, RANK).split([NOPE, V], dim=1)
    q_latent = torch.einsum("thn,hnr->thr", q[..., :NOPE], w_uk)
    latent = mla_attention(q_latent, q[..., NOPE:], cache, md, layout, scale)  # fp32 inside
    expected = torch.einsum("thr,hvr->thv", latent.to(dtype), w_uv)

    out = torch.full((q.shape[0], HEADS, V), float("nan"), dtype=dtype)
    mla_prefill(q, cache, kv_b, md, layout.seqs, scale, out)
    assert not out.isnan().any()
    torch.testing.assert_close(out[layout.token_ids], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])  # fmt: skip
def test_gather_seqs_is_each_sequences_gather_one_after_another(device):
    """One gather for a step's sequences (any order, a subset, lengths across and inside blocks) gives what a
    gather a sequence then a concatenation gives."""
    from atom.ops.paged_attention import gather_seq, gather_seqs

    md, cache, _, _ = _step([0, 13, 1, 40, 2], [7, 2, 11, 5, 1], torch.float32, seed=11, device=device)
    seqs = [3, 0, 2, 4]  # seq_lens 45, 7, 12, 3
    lens = [md.seq_lens[b] for b in seqs]
    expected = torch.cat([gather_seq(cache, md.block_tables[b], n) for b, n in zip(seqs, lens)])
    assert torch.equal(gather_seqs(cache, md.block_tables, seqs, lens), expected)
    assert torch.equal(gather_seqs(cache, md.block_tables, [1], [md.seq_lens[1]]),
                       gather_seq(cache, md.block_tables[1], md.seq_lens[1]))  # fmt: skip


def test_mla_prefill_writes_only_its_sequences_rows():
    """A step's prefills are written, its other rows (decode rows, handled elsewhere) left alone."""
    md, cache, q, kv_b = _step([0, 5, 3], [6, 1, 4], torch.float32, seed=7)
    out = torch.full((q.shape[0], HEADS, V), float("nan"))
    decode, prefill = split_decode_prefill(md.query_start_loc, q.device)
    mla_prefill(q, cache, kv_b, md, prefill.seqs, (NOPE + ROPE) ** -0.5, out)
    assert out[decode.token_ids].isnan().all() and not out[prefill.token_ids].isnan().any()


def test_mla_prefill_hands_the_shorter_sequences_to_the_kernel(monkeypatch):
    """Where the kernel applies, mla_prefill hands it the sequences of fewer than SDPA_PAIRS causal pairs, with the
    rows it reads (a head's [v | k_nope | k_rot], sequence b's from firsts[b]), and runs the others through SDPA.
    Here the kernel's part is done in torch from exactly what it is handed (the kernel itself runs in the GPU test
    below); every row must equal the absorbed reference's."""
    import torch.nn.functional as F

    import atom.ops.mla as mla_ops

    handed = []

    def kernel_in_torch(q, rows, firsts, starts, seq_lens, seqs, scale, out):
        handed.append(list(seqs))
        v_dim = out.shape[2]
        for b in seqs:
            n, start, stop = seq_lens[b], starts[b], starts[b + 1]
            keys_values = rows[firsts[b] : firsts[b] + n].transpose(0, 1)  # [H, n, v + nope + rope]
            mask = torch.ones(stop - start, n, dtype=torch.bool).tril(n - (stop - start))
            out[start:stop] = F.scaled_dot_product_attention(
                q[start:stop].transpose(0, 1), keys_values[..., v_dim:], keys_values[..., :v_dim], attn_mask=mask,
                scale=scale).transpose(0, 1)  # fmt: skip

    monkeypatch.setattr(mla_ops, "expanded_kernel_applies", lambda q, v_dim: True)
    monkeypatch.setattr(mla_ops, "expanded_prefill_attention", kernel_in_torch)
    contexts, new = [3, 0, 1000, 0], [9, 1449, 60, 2]  # the second: 1.05M causal pairs, SDPA's
    md, cache, q, kv_b = _step(contexts, new, torch.float32, seed=11)
    scale = (NOPE + ROPE) ** -0.5
    (layout,) = split_decode_prefill(md.query_start_loc, q.device)
    w_uk, w_uv = kv_b.view(HEADS, NOPE + V, RANK).split([NOPE, V], dim=1)
    latent = mla_attention(torch.einsum("thn,hnr->thr", q[..., :NOPE], w_uk), q[..., NOPE:], cache, md, layout, scale)
    expected = torch.einsum("thr,hvr->thv", latent, w_uv)
    out = torch.full((q.shape[0], HEADS, V), float("nan"))
    mla_prefill(q, cache, kv_b, md, layout.seqs, scale, out)
    assert handed == [[0, 2, 3]]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "contexts, new, on_the_kernel",
    [
        ([0], [300], (0,)),
        ([0, 37, 0, 300], [33, 70, 5, 129], (0, 1, 2, 3)),
        ([2700, 5, 0], [400, 64, 1500], (1,)),  # 1.16M and 1.13M causal pairs: SDPA; the middle one: the kernel
    ],
)
@pytest.mark.parametrize("block_rows", [64, 128])
def test_mla_prefill_on_a_gpu_in_bf16(contexts, new, on_the_kernel, block_rows, monkeypatch):
    """At Kimi-Linear's sizes the kernel attends the step's sequences of fewer than SDPA_PAIRS causal pairs in one
    launch (in blocks of 64 or 128 rows) and torch's fused attention the others; both give the absorbed
    reference's values."""
    import atom.ops.cuda.paged_attention as paged
    import atom.ops.mla as mla_ops
    from atom.ops.cuda._launch import kernels_apply

    monkeypatch.setattr(paged, "BLOCK_ROWS", block_rows)
    sent = []
    kernel = mla_ops.expanded_prefill_attention
    monkeypatch.setattr(mla_ops, "expanded_prefill_attention", lambda *a: (sent.append(tuple(a[5])), kernel(*a))[1])
    heads, rank, rope, nope, v = 32, 512, 64, 128, 128
    md, cache, q, kv_b = _step(contexts, new, torch.bfloat16, seed=3, device="cuda", heads=heads, rank=rank,
                               rope=rope, nope=nope, v=v)  # fmt: skip
    scale = (nope + rope) ** -0.5
    (layout,) = split_decode_prefill(md.query_start_loc, q.device)
    w_uk, w_uv = kv_b.view(heads, nope + v, rank).split([nope, v], dim=1)
    latent = mla_attention(torch.einsum("thn,hnr->thr", q[..., :nope], w_uk), q[..., nope:], cache, md, layout, scale)
    expected = torch.einsum("thr,hvr->thv", latent.to(torch.bfloat16), w_uv).float()
    out = torch.full((q.shape[0], heads, v), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_prefill(q, cache, kv_b, md, layout.seqs, scale, out)
    err = ((out.float() - expected).norm() / expected.norm()).item()
    assert err < 1e-2, err
    if kernels_apply(q):  # a built atom._C: the kernel ran on the shorter sequences, leaving none to SDPA
        assert sent == [on_the_kernel]


def test_the_prefill_form_switch(monkeypatch):
    from atom.layers.mla import prefill_form

    assert prefill_form() == "expanded"
    monkeypatch.setenv("ATOM_MLA_PREFILL", "reference")
    assert prefill_form() == "reference"
    monkeypatch.setenv("ATOM_MLA_PREFILL", "absorbed")
    with pytest.raises(ValueError, match="ATOM_MLA_PREFILL must be one of expanded, reference"):
        prefill_form()
