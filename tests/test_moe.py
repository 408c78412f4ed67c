"""The routed experts' execution paths (loop, gemv, grouped, dense, all experts) agree.

The loop is the reference; the others are what GPUs run (gemv for a few
tokens, bf16 grouped matmuls; dense for other dtypes), here exercised on the CPU in
fp32, where torch's grouped matmul has a fallback, so the bookkeeping
(sorting pairs by expert, group ends, unsorting, summing picks) is checked
without a GPU. tests/test_gpu_engine.py covers them on the device.
"""

from __future__ import annotations

import pytest
import torch

from atom.layers import moe
from atom.layers.moe import RoutedExperts
from atom.ops.cuda import fused

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> RoutedExperts:
    torch.manual_seed(seed)
    experts = RoutedExperts(num_experts, hidden, inter, torch.float32)
    for p in experts.parameters():
        p.data.normal_(0, hidden**-0.5)
    experts.fuse()
    return experts


def _routing(tokens: int, num_experts: int, top_k: int, gen: torch.Generator, skew: bool):
    scores = torch.rand(tokens, num_experts, generator=gen)
    if skew:  # most tokens pick the same few experts; some experts get no token at all
        scores[:, : num_experts // 2] += 1.0
    ids = scores.topk(top_k, dim=-1, sorted=False).indices
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights, ids


@pytest.mark.parametrize("tokens", [1, 3, 16, 64])
@pytest.mark.parametrize("skew", [False, True])
def test_gemv_grouped_dense_and_all_experts_match_the_expert_loop(tokens: int, skew: bool) -> None:
    experts = _experts(num_experts=8, hidden=48, inter=24, seed=tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 48, generator=gen)
    weights, ids = _routing(tokens, 8, 3, gen, skew)
    with torch.no_grad():
        ref = experts(x, weights, ids)  # CPU: the loop
        grouped = experts.forward_grouped(x, weights, ids)
        dense = experts._forward_dense(x, weights, ids)
        shared = torch.randn(tokens, 48, generator=gen)
        all_experts = experts.forward_all_experts(x, weights, ids, addend=shared)
        gemv = experts.forward_gemv(x, weights, ids, addend=shared)  # CPU: fused.moe_gemv_ref
    assert ref.abs().max() > 0
    torch.testing.assert_close(gemv, ref + shared, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(all_experts, ref + shared, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense, ref, rtol=1e-5, atol=1e-6)


def test_choose_path_follows_the_measured_crossovers() -> None:
    """The path for each batch size at the three routings bench/kernels_gpu.py --only moe_paths measured
    (GPU_NOTES.md, session 17): gemv up to 1.5 pairs per expert, then every expert while a batch is
    expected to pick 2/3 of the experts and has at most 128 tokens, grouped beyond; other dtypes dense."""
    def paths(experts: int, top_k: int, grouped_mm: bool = True) -> dict[str, list[int]]:
        chosen: dict[str, list[int]] = {}
        for tokens in range(1, 301):
            chosen.setdefault(moe.choose_path(tokens, top_k, experts, True, grouped_mm), []).append(tokens)
        return {path: [min(t), max(t)] for path, t in chosen.items()}

    assert paths(256, 8) == {"gemv": [1, 48], "all": [49, 128], "grouped": [129, 300]}  # Kimi-Linear
    assert paths(64, 6) == {"gemv": [1, 16], "all": [17, 128], "grouped": [129, 300]}
    assert paths(16, 4) == {"gemv": [1, 6], "all": [7, 128], "grouped": [129, 300]}  # bench/decode_gpu.py
    assert paths(16, 4, grouped_mm=False) == {"gemv": [1, 6], "dense": [7, 128], "loop": [129, 300]}
    assert moe.choose_path(1, 4, 16, on_gpu=False, grouped_mm=False) == "loop"
    # beyond the gemv limit a batch that picks under 2/3 of the experts runs grouped (E=384, top-8, Kimi-K2)
    assert moe.choose_path(49, 8, 384, True, True) == "grouped" and moe.choose_path(60, 8, 384, True, True) == "all"


def test_grouped_path_reads_only_the_picked_experts() -> None:
    """Poisoning an expert no token picked changes nothing; poisoning a picked one does."""
    experts = _experts(num_experts=8, hidden=32, inter=16, seed=0)
    x = torch.randn(5, 32)
    ids = torch.tensor([[0, 2], [2, 5], [5, 0], [0, 2], [7, 5]])
    weights = torch.rand(5, 2) + 0.1
    with torch.no_grad():
        before = experts.forward_grouped(x, weights, ids)
        experts.gate_up_proj[3].fill_(float("nan"))  # expert 3: unpicked
        experts.down_proj[3].fill_(float("nan"))
        assert torch.equal(experts.forward_grouped(x, weights, ids), before)
        experts.down_proj[7].fill_(float("nan"))  # expert 7: picked by token 4 only
        after = experts.forward_grouped(x, weights, ids)
    assert torch.isnan(after[4]).all() and not torch.isnan(after[:4]).any()


def test_fused_op_references_on_cpu():
    """The references of csrc/fused.cu (what the layers run on a CPU) compute what they say."""
    from atom.layers.norm import RMSNorm

    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, 64)
    xf = x.float()
    expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), expected)
    src, pos, ends = fused.moe_align(torch.tensor([[2, 0], [0, 1], [2, 1]]), 4)
    assert ends.tolist() == [2, 4, 6, 6] and src.tolist() == [0, 1, 1, 2, 0, 2] and pos.tolist() == [4, 0, 1, 2, 5, 3]


def test_gemv_path_with_the_shared_experts_weights_equals_experts_plus_the_shared_mlp() -> None:
    """SparseMoE's gemv path (the shared expert's weights handed to moe_gemv) equals experts(x) + shared(x),
    through the references on the CPU; the GPU kernels are checked against the same references in
    tests/test_fused_kernels_gpu.py and, in the engine, in tests/test_gpu_engine.py."""
    from atom.layers.moe import SparseMoE, TopkRouter

    torch.manual_seed(0)
    router = TopkRouter(48, 8, 3, num_groups=1, topk_groups=1, norm_topk_prob=True, routed_scaling_factor=2.0)
    moe = SparseMoE(48, 24, 8, num_shared_experts=2, router=router, dtype=torch.float32)
    for p in moe.parameters():
        p.data.normal_(0, 48**-0.5)
    moe.experts.fuse()
    assert moe.shared_experts.stacked_weights() is None  # not stacked yet: the kernels cannot take it
    moe.shared_experts.gate_up.stack()
    x = torch.randn(5, 48)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        expected = moe.experts(x, weights, ids) + moe.shared_experts(x)
        fused_path = moe.experts.forward_gemv(x, weights, ids, shared=moe.shared_experts.stacked_weights())
    torch.testing.assert_close(fused_path, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        moe.experts.forward_gemv(x, weights, ids, addend=x, shared=moe.shared_experts.stacked_weights())


def _sparse_moe(num_shared_experts: int):
    from atom.layers.moe import SparseMoE, TopkRouter

    torch.manual_seed(num_shared_experts)
    router = TopkRouter(48, 8, 3, num_groups=1, topk_groups=1, norm_topk_prob=True, routed_scaling_factor=2.0)
    layer = SparseMoE(48, 24, 8, num_shared_experts=num_shared_experts, router=router, dtype=torch.float32)
    for p in layer.parameters():
        p.data.normal_(0, 48**-0.5)
    return layer


def test_a_shared_expert_of_an_experts_size_is_stacked_after_the_routed_ones(monkeypatch) -> None:
    """SparseMoE.fuse() puts a one-expert shared MLP after the routed experts in their stacks, every weight a
    view with its loaded values; the every-expert path with it in the matmuls equals experts(x) + shared(x),
    and so does SparseMoE's forward on that path, folded or not. Two shared experts (twice an expert's
    size) stay a separate, stacked MLP."""
    layer = _sparse_moe(1)
    loaded = {name: p.detach().clone() for name, p in layer.named_parameters()}
    layer.fuse()
    experts, shared = layer.experts, layer.shared_experts
    assert experts.holds_shared
    assert experts.gate_up_with_shared.shape == (9, 48, 48) and experts.down_with_shared.shape == (9, 48, 24)
    assert experts.gate_up_proj.data_ptr() == experts.gate_up_with_shared.data_ptr()
    assert experts.gate_up_proj.shape == (8, 48, 48) and experts.down_proj.shape == (8, 48, 24)
    assert shared.gate_up.weight.data_ptr() == experts.gate_up_with_shared[8].data_ptr()
    assert shared.up_proj.weight.data_ptr() == experts.gate_up_with_shared[8, 24:].data_ptr()
    assert shared.down_proj.weight.data_ptr() == experts.down_with_shared[8].data_ptr()
    assert experts[3].w3.weight.data_ptr() == experts.gate_up_with_shared[3, 24:].data_ptr()
    for name, p in layer.named_parameters():
        assert torch.equal(p, loaded[name]), name
    x = torch.randn(6, 48)
    with torch.no_grad():
        weights, ids = layer.gate(x)
        expected = experts(x, weights, ids) + shared(x)
        folded = experts.forward_all_experts(x, weights, ids, with_shared=True)
        torch.testing.assert_close(folded, expected, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="not both"):
            experts.forward_all_experts(x, weights, ids, addend=x, with_shared=True)
        monkeypatch.setattr(moe, "routed_path", lambda *args: "all")
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
        monkeypatch.setattr(moe, "FOLD_SHARED", False)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)

    two = _sparse_moe(2)
    two.fuse()
    assert not hasattr(two.experts, "gate_up_with_shared") and two.experts.gate_up_proj.shape == (8, 48, 48)
    assert not two.experts.holds_shared
    assert two.shared_experts.stacked_weights() is not None

