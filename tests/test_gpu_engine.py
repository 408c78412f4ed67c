"""The engine on a GPU with the ``atom._C`` kernels gives the CPU reference path's greedy tokens.

Skipped without CUDA and a built ``atom._C``. Both sides run the same small
random Kimi-Linear checkpoint (or a dense Llama / Qwen3 one) in fp32; the GPU side must actually go through
the kernels (KDA prefill and decode groups, MLA decode) and MLA's GPU prefill form (``mla_prefill``),
which the call counts check.
"""

from __future__ import annotations

import copy

import pytest
import torch

from atom import SamplingParams
from atom.ops._C_loader import get_C, use_kernels
from tests import checkpoints

HAS_KERNELS = torch.cuda.is_available() and get_C() is not None and use_kernels()
pytestmark = pytest.mark.skipif(not HAS_KERNELS, reason="needs a CUDA GPU and a built atom._C")

# Different lengths, so that with a small token budget some steps mix prefill
# chunks (torch reference) with decode rows (kernels).
PROMPTS = [[3, 4, 5], [5, 6, 7, 8, 9, 10] * 4, list(range(20, 45)), [7] * 8, list(range(60, 71)), [11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _generate(path: str, **kwargs) -> list[list[int]]:
    from atom import LLM

    llm = LLM(path, dtype="float32", **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert llm.engine.all_resources_free()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the layers' calls into the kernel wrappers."""
    import atom.layers.kda as kda_layer
    import atom.layers.mla as mla_layer
    import atom.ops.cuda as kernels

    counts = {"kda_decode": 0, "kda_prefill": 0, "mla_decode": 0, "mla_prefill": 0}

    def counting(module, name):
        inner = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counting(kda_layer, "kda_decode")
    counting(kda_layer, "kda_prefill")
    counting(kernels, "mla_decode")
    counting(mla_layer, "mla_prefill")
    return counts


@pytest.mark.parametrize("variant", ["kda_mla", "mla_first_qlora"])
@pytest.mark.parametrize("budget", [2048, 16])
def test_gpu_kernels_match_cpu_reference(tmp_path, kernel_calls, variant, budget):
    path = checkpoints.make_kimi_checkpoint(str(tmp_path), variant, tokenizer=False)
    cpu = _generate(path, max_num_batched_tokens=budget)
    gpu = _generate(path, device="cuda", max_num_batched_tokens=budget)
    assert kernel_calls["kda_decode"] > 0 and kernel_calls["mla_decode"] > 0
    assert kernel_calls["kda_prefill"] > 0  # the 24- and 25-token prompts span more than one 16-token chunk
    assert kernel_calls["mla_prefill"] > 0
    assert gpu == cpu


@pytest.mark.parametrize("spec", [{"method": "mtp", "num_speculative_tokens": 2},
                                  {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}])
def test_gpu_speculative_matches_cpu_reference(tmp_path, kernel_calls, spec):
    path = checkpoints.add_mtp_weights(checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False))
    cpu = _generate(path)
    gpu = _generate(path, device="cuda", speculative_config=spec)
    assert kernel_calls["kda_decode"] > 0 and kernel_calls["mla_decode"] > 0
    assert gpu == cpu


@pytest.mark.parametrize("kind, spec", [
    ("kimi", {"method": "mtp", "num_speculative_tokens": 2}),
    ("kimi", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    ("llama", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}),
], ids=["kimi_mtp", "kimi_ngram", "llama_ngram"])
def test_gpu_verification_steps_on_graphs_match_cpu_reference_and_eager(tmp_path, monkeypatch, kind, spec):
    """Steps with drafts replay the verification graphs (rows of 1 + k tokens, fewer drafts padded): in fp32 the
    CPU reference path's tokens; in bf16 the tokens of the same engine with its verification steps eager."""
    from atom import LLM
    from atom.worker.cuda_graph import DecodeGraphs

    verifications = []
    inner = DecodeGraphs.replay_verification
    monkeypatch.setattr(DecodeGraphs, "replay_verification",
                        lambda self, ids, rows, *rest: verifications.append(len(rows)) or inner(self, ids, rows, *rest))
    if kind == "kimi":
        path = checkpoints.add_mtp_weights(checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla",
                                                                            tokenizer=False))  # fmt: skip
    else:
        path = checkpoints.make_llama_checkpoint(str(tmp_path), "llama", tokenizer=False)
    cpu = _generate(path)
    gpu = _generate(path, device="cuda", max_num_seqs=4, speculative_config=spec)
    assert len(verifications) >= 5 and max(verifications) > 1
    assert gpu == cpu
    runs = []
    for verify_on_graphs in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=4, speculative_config=spec)
        if not verify_on_graphs:
            llm.engine.runner.decode_graphs.verify_sizes = ()
        verifications.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert bool(verifications) == verify_on_graphs and llm.engine.all_resources_free()
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


@pytest.fixture
def mtp_launches(monkeypatch) -> list[bool]:
    """Each replay of an MTP drafting graph: True for one drafting right behind a verification graph."""
    from atom.worker.drafters.mtp_graphs import MTPGraphs

    launches, inner = [], MTPGraphs._launch

    def counted(self, size: int, bound: int, after: bool = False) -> torch.Tensor:
        launches.append(after)
        return inner(self, size, bound, after)

    monkeypatch.setattr(MTPGraphs, "_launch", counted)
    return launches


@pytest.mark.parametrize("k", [1, 3])
def test_gpu_mtp_drafting_on_graphs_matches_cpu_reference_and_eager(tmp_path, mtp_launches, k):
    """After decode and verification steps on the graphs, MTP drafting replays its own graphs (right behind a
    greedy verification's): in fp32 the tokens are the CPU reference path's, and every step's drafts those of
    the same engine drafting eagerly."""
    from atom import LLM

    path = checkpoints.add_mtp_weights(checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False))
    cpu = _generate(path)
    runs = []
    for on_graphs in (True, False):
        # one step at a time, so each step's drafts are in its output when it returns (test_gpu_overlap_*: overlap)
        llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=4, async_scheduling=False,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k})  # fmt: skip
        runner, proposals = llm.engine.runner, []
        assert runner.drafter.graphs is not None
        if not on_graphs:
            runner.drafter.graphs = None
        execute = runner.execute_model
        runner.execute_model = lambda sched: proposals.append(execute(sched)) or proposals[-1]
        mtp_launches.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        if on_graphs:
            assert mtp_launches.count(True) >= 20 and mtp_launches.count(False) >= 1
        assert not mtp_launches or on_graphs
        assert llm.engine.all_resources_free()
        runs.append(([o.outputs[0].token_ids for o in outs], [dict(out.draft_token_ids) for out in proposals]))
    assert runs[0][0] == cpu
    assert runs[0] == runs[1]


def test_gpu_sampled_rows_draft_behind_the_verification_like_eagerly(tmp_path, mtp_launches):
    """Seeded sampled rows and a greedy row with a penalty and logprobs, beside plain greedy ones, verify on the
    device (verify_rows), and MTP drafts right behind their verification graph: every token, logprob and draft
    equals the same engine's drafting eagerly after the host's acceptance."""
    from atom import LLM

    path = checkpoints.add_mtp_weights(checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False))
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.4, logprobs=2, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.1, top_k=40, min_p=0.02, seed=4, max_tokens=24, ignore_eos=True),
              GREEDY]  # fmt: skip
    runs = []
    for on_graphs in (True, False):
        # one step at a time, so each step's drafts are in its output when it returns (test_gpu_overlap_*: overlap)
        llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=4, async_scheduling=False,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
        runner, proposals = llm.engine.runner, []
        if not on_graphs:
            runner.drafter.graphs = None
        execute = runner.execute_model
        runner.execute_model = lambda sched: proposals.append(execute(sched)) or proposals[-1]
        mtp_launches.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
        if on_graphs:
            assert mtp_launches.count(True) >= 15
        assert llm.engine.all_resources_free()
        runs.append(([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
                     [dict(out.draft_token_ids) for out in proposals]))  # fmt: skip
    assert runs[0] == runs[1]


@pytest.mark.parametrize("k", [2, 3])
def test_gpu_overlap_chains_verification_steps(tmp_path, k):
    """Speculation with overlap on the GPU: verification steps on the graphs (drafting behind them) return with
    their outcome on the device, and the next step's rows, planned meanwhile, are filled in there from it. With
    drafts accepted 0 .. k at a time (scripted: tests/test_mtp_graphs.py), a seeded sampled row and a row at
    max_tokens: the tokens equal the same engine's without overlap, and the greedy rows the CPU reference's."""
    from atom import LLM
    from tests.test_mtp_graphs import scripted_drafts

    path = checkpoints.add_mtp_weights(checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False))
    cpu = _generate(path)
    runs = [p + t for p, t in zip(PROMPTS, cpu)]
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True),
              GREEDY, SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True), GREEDY, GREEDY]  # fmt: skip
    got = []
    for overlap in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=8, async_scheduling=overlap,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k})  # fmt: skip
        runner = llm.engine.runner
        assert runner.drafter.graphs is not None and runner.defers_verification == overlap
        scripted_drafts(runner, k, runs)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        got.append([o.outputs[0].token_ids for o in outs])
        assert llm.engine.scheduler.num_accepted_tokens > 40 and llm.engine.all_resources_free()
        if overlap:
            assert runner.num_deferred_steps >= 10 and runner.num_rows_settled_on_device >= 20
    assert got[1] == got[0]
    assert [got[1][i] for i in (0, 2, 4, 5)] == [cpu[i] for i in (0, 2, 4, 5)] and got[1][3] == cpu[3][:13]


@pytest.fixture
def graph_replays(monkeypatch):
    """Counts pure-decode steps run by replaying a captured CUDA graph, per padded size."""
    from atom.worker.cuda_graph import DecodeGraphs

    sizes: list[int] = []
    inner = DecodeGraphs.replay

    def counting(self, input_ids, rows, *rest):
        sizes.append(next(s for s in self.sizes if s >= len(rows)))
        return inner(self, input_ids, rows, *rest)

    monkeypatch.setattr(DecodeGraphs, "replay", counting)
    return sizes


@pytest.mark.parametrize("variant", ["kda_mla", "mla_first_qlora"])
def test_gpu_cuda_graphs_match_eager_and_cpu_reference(tmp_path, graph_replays, variant):
    path = checkpoints.make_kimi_checkpoint(str(tmp_path), variant, tokenizer=False)
    cpu = _generate(path)
    eager = _generate(path, device="cuda", enforce_eager=True)
    assert not graph_replays
    # 6 prompts over 4 sequences: decode batches of 4, 3 (padded to 4), 2 and 1; a budget of
    # 16 tokens also mixes prefill chunks into some steps (those run eagerly)
    graphs = _generate(path, device="cuda", max_num_seqs=4, max_num_batched_tokens=16)  # overlapped: the default
    assert graph_replays and max(graph_replays) == 4
    sync = _generate(path, device="cuda", max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=False)
    assert graphs == sync == eager == cpu


@pytest.mark.parametrize("kind", ["kimi", "llama"])
def test_gpu_graphs_for_short_and_long_rows_match_cpu_reference(tmp_path, monkeypatch, kind):
    """With max_model_len past SHORT_CONTEXT each batch size has a graph for short rows (attention's splits sized
    for SHORT_CONTEXT positions) and one for long rows; steps move from the first to the second as their rows
    grow, and the tokens are the CPU reference path's."""
    from atom.worker import cuda_graph

    monkeypatch.setattr(cuda_graph, "SHORT_CONTEXT", 32)
    launches = []
    inner = cuda_graph.DecodeGraphs._launch
    monkeypatch.setattr(cuda_graph.DecodeGraphs, "_launch", lambda self, size, bound=None, width=1:
                        launches.append(bound) or inner(self, size, bound, width))  # fmt: skip
    if kind == "kimi":
        path = checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False)
    else:
        path = checkpoints.make_llama_checkpoint(str(tmp_path), "llama", tokenizer=False)
    cpu = _generate(path, max_model_len=128)
    graphs = _generate(path, device="cuda", max_num_seqs=4, max_model_len=128)
    assert set(launches) == {32, 128}  # prompts of 1-25 tokens, 40 new each
    assert graphs == cpu


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_gpu_dense_model_decodes_in_graphs_like_the_cpu(tmp_path, monkeypatch, graph_replays, kind):
    """A dense model's GQA attention decodes with paged_decode_attention, eagerly and in CUDA graphs, and
    gives the CPU reference path's greedy tokens; so do n-gram speculation's verification rows. Every step
    rotates and writes the cache with rotary_write_kv; steps that mix prefill chunks with decode rows (the
    16-token budget) attend the decode rows with the kernel and the prefills with paged_prefill_attention (SDPA's
    kernels in fp32)."""
    import atom.ops.cuda as kernels

    calls = {"paged_decode_attention": 0, "rotary_write_kv": 0}
    for name in calls:
        inner = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _inner=inner, _name=name, **kw: (
            calls.__setitem__(_name, calls[_name] + 1), _inner(*a, **kw))[1])  # fmt: skip
    mixed = []  # per prefill call on the GPU: whether its step also had decode rows
    prefill = kernels.paged_prefill_attention

    def counting_prefill(q, k_cache, v_cache, tables, starts, seq_lens, seqs, scale, out):
        assert all(starts[b + 1] - starts[b] > 1 for b in seqs)
        mixed.append(len(seqs) < len(seq_lens))
        return prefill(q, k_cache, v_cache, tables, starts, seq_lens, seqs, scale, out)

    monkeypatch.setattr(kernels, "paged_prefill_attention", counting_prefill)
    path = checkpoints.make_llama_checkpoint(str(tmp_path), kind, tokenizer=False)
    cpu = _generate(path)
    eager = _generate(path, device="cuda", enforce_eager=True)
    assert calls["paged_decode_attention"] and calls["rotary_write_kv"] and not graph_replays
    graphs = _generate(path, device="cuda", max_num_seqs=4, max_num_batched_tokens=16)
    assert graph_replays and max(graph_replays) == 4
    assert any(mixed)
    spec = _generate(path, device="cuda", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_max": 3})
    assert graphs == eager == spec == cpu


# 200 prompts of 1-9 tokens, 8 new tokens each: decode steps of 200 rows (one prefill step before them)
MANY_PROMPTS = [[3 + (7 * i + j) % 250 for j in range(1 + i % 9)] for i in range(200)]


def _generate_many(path: str, dtype: str, **kwargs):
    """MANY_PROMPTS' greedy tokens and the engine. max_model_len 32: every MLA row in one split, eagerly and in
    the graphs, so that bf16 runs of the two compute the same sums."""
    from atom import LLM

    llm = LLM(path, dtype=dtype, max_num_seqs=200, max_num_batched_tokens=2048, max_model_len=32, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in MANY_PROMPTS], params, use_tqdm=False)
    assert llm.engine.all_resources_free()
    return [o.outputs[0].token_ids for o in outs], llm


def test_gpu_graphs_past_128_rows(tmp_path, graph_replays):
    """Steps of 200 rows replay the graph of 256 where the model's decode path makes no host sync at 256 rows: a
    dense Llama in fp32 (the CPU reference path's tokens) and Kimi-Linear in bf16 (its MoE's grouped matmuls; the
    tokens of the same engine run eagerly). Kimi-Linear in fp32, whose MoE past 128 tokens loops over the experts,
    captures up to 128 and decodes its 200 rows eagerly, with the CPU reference path's tokens."""
    llama = checkpoints.make_llama_checkpoint(str(tmp_path / "llama"), "llama", tokenizer=False)
    cpu, _ = _generate_many(llama, "float32")
    gpu, llm = _generate_many(llama, "float32", device="cuda")
    assert llm.engine.runner.decode_graphs.sizes[-1] == 256 and set(graph_replays) == {256}
    assert gpu == cpu
    kimi = checkpoints.make_kimi_checkpoint(str(tmp_path / "kimi"), "kda_mla", tokenizer=False)
    graph_replays.clear()
    eager, _ = _generate_many(kimi, "bfloat16", device="cuda", enforce_eager=True)
    assert not graph_replays
    gpu, llm = _generate_many(kimi, "bfloat16", device="cuda")
    assert llm.engine.runner.decode_graphs.sizes[-1] == 256 and set(graph_replays) == {256}
    assert gpu == eager
    cpu, _ = _generate_many(kimi, "float32")
    replays = len(graph_replays)
    gpu, llm = _generate_many(kimi, "float32", device="cuda")
    assert llm.engine.runner.decode_graphs.sizes[-1] == 128 and len(graph_replays) == replays
    assert gpu == cpu


# bf16 prefill tests: chunks after cached context (a 64-token budget), one step mixing several prompts.
BF16_PROMPTS = [list(range(3, 140)), [5, 6, 7, 8] * 20, list(range(200, 237)), [9, 10], list(range(40, 104))]


@pytest.fixture
def prefill_launches(monkeypatch):
    """The prefill kernel's launches (``atom._C.paged_prefill_attention`` as the wrappers call it), counted."""
    import atom.ops.cuda.paged_attention as paged

    launches = []
    inner = paged.C

    class Counting:
        def __getattr__(self, name):
            if name == "paged_prefill_attention":
                launches.append(name)
            return getattr(inner(), name)

    monkeypatch.setattr(paged, "C", Counting)
    return launches


def _bf16_prefill_run(path: str, max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """BF16_PROMPTS' greedy tokens and their prompt tokens' logprobs, on a bf16 GPU engine; all resources free."""
    from atom import LLM

    llm = LLM(path, dtype="bfloat16", device="cuda", max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in BF16_PROMPTS], params, use_tqdm=False)
    assert llm.engine.all_resources_free()
    logprobs = [[o.prompt_logprobs[i][p[i]] for i in range(1, len(p))] for o, p in zip(outs, BF16_PROMPTS)]
    return [o.outputs[0].token_ids for o in outs], logprobs


def _largest_gap(logprobs: list[list[float]], others: list[list[float]]) -> float:
    return max(abs(a - b) for mine, theirs in zip(logprobs, others) for a, b in zip(mine, theirs))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_gpu_dense_prefill_kernel_in_bf16_agrees_with_sdpa(tmp_path, monkeypatch, prefill_launches, kind):
    """In bf16 with head_dim 64, a dense model's prefill chunks go through paged_prefill_attention's kernel (one
    launch a layer for a step's chunks, each after its cached context under a 64-token budget). Its prompt
    logprobs stay within bf16's rounding of the SDPA path's (one sequence at a time), and its greedy tokens equal
    that path's. Every block and slot is free after each run."""
    import atom.ops.cuda.paged_attention as paged

    path = checkpoints.make_llama_checkpoint(str(tmp_path), kind, tokenizer=False, head_dim=64)
    tokens, logprobs = _bf16_prefill_run(path, max_tokens=16)
    assert prefill_launches
    monkeypatch.setattr(paged, "prefill_kernel_applies", lambda q, k_cache: False)
    prefill_launches.clear()
    sdpa_tokens, sdpa_logprobs = _bf16_prefill_run(path, max_tokens=16)
    assert not prefill_launches
    worst = _largest_gap(logprobs, sdpa_logprobs)
    assert worst < 0.05, worst
    assert tokens == sdpa_tokens


def test_gpu_kimi_mla_prefill_kernel_in_bf16_agrees_with_sdpa(tmp_path, monkeypatch, prefill_launches):
    """In bf16 with Kimi-Linear's MLA head sizes (nope 128 + rope 64, v 128), the MLA layer's prefill chunks go
    through expanded_prefill_attention's kernel (one launch a layer for a step's chunks, each after its cached
    context under a 64-token budget). Its prompt logprobs stay within bf16's rounding of the SDPA path's (one
    sequence at a time), and the first token after each prompt, which the prefill decides, is the same. Every block
    and slot is free after each run."""
    import atom.ops.mla as mla_ops

    path = checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False, qk_nope_head_dim=128,
                                            qk_rope_head_dim=64, v_head_dim=128)  # fmt: skip
    tokens, logprobs = _bf16_prefill_run(path, max_tokens=4)
    assert prefill_launches
    monkeypatch.setattr(mla_ops, "expanded_kernel_applies", lambda q, v_dim: False)
    prefill_launches.clear()
    sdpa_tokens, sdpa_logprobs = _bf16_prefill_run(path, max_tokens=4)
    assert not prefill_launches
    worst = _largest_gap(logprobs, sdpa_logprobs)
    assert worst < 0.05, worst
    assert [t[0] for t in tokens] == [t[0] for t in sdpa_tokens]


def test_gpu_programmatic_launch_changes_no_token(tmp_path, graph_replays):
    """Kernels launch with programmatic dependent launch on sm_90+ unless ATOM_PDL=0; eager steps and graph
    replays give the same tokens with it on and off, and the CPU's."""
    import os

    C = get_C()
    expected = torch.cuda.get_device_capability()[0] >= 9 and os.environ.get("ATOM_PDL") != "0"
    assert C.programmatic_launch() == expected
    path = checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False)
    runs = {}
    try:
        for on in (True, False):
            C.set_programmatic_launch(on)
            assert C.programmatic_launch() == (on and torch.cuda.get_device_capability()[0] >= 9)
            runs[on] = (_generate(path, device="cuda", enforce_eager=True),
                        _generate(path, device="cuda", max_num_seqs=4, max_num_batched_tokens=16))  # fmt: skip
    finally:
        C.set_programmatic_launch(expected)
    assert graph_replays
    assert runs[True][0] == runs[True][1] == runs[False][0] == runs[False][1] == _generate(path)


def test_gpu_real_shape_layers_match_reference(tmp_path, monkeypatch, kernel_calls, graph_replays):
    """Kimi-Linear-48B-A3B's first four layers at full size (three KDA and an MLA layer, 256 experts top-8,
    vocab 163840; random weights from config.json alone, ~25 GB in fp32): the kernels, eager and in CUDA
    graphs, give the torch reference path's greedy tokens on the same weights."""
    import gc
    import json

    from atom import LLM

    config = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
              "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 4,
              "num_attention_heads": 32, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "q_lora_rank": None, "num_experts": 256, "num_experts_per_token": 8,
              "num_shared_experts": 1, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
              "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 32,
                                     "head_dim": 128, "short_conv_kernel_size": 4},
              "max_position_embeddings": 4096, "eos_token_id": 163586}  # fmt: skip
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate(**kwargs) -> list[list[int]]:
        llm = LLM(str(tmp_path), dtype="float32", device="cuda", load_format="dummy", max_model_len=256,
                  max_num_seqs=8, **kwargs)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.all_resources_free()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return outs

    graphs = generate()
    eager = generate(enforce_eager=True)
    assert graph_replays and kernel_calls["kda_decode"] > 0 and kernel_calls["mla_decode"] > 0
    monkeypatch.setenv("ATOM_FORCE_REFERENCE", "1")
    reference = generate()
    assert graphs == eager == reference


def test_gpu_overlap_is_the_default_on_cuda(tmp_path):
    from atom.config import EngineConfig

    path = checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False)
    assert EngineConfig(model=path, device="cuda").async_scheduling is True
    assert EngineConfig(model=path, device="cuda", async_scheduling=False).async_scheduling is False
    assert EngineConfig(model=path).async_scheduling is False  # the CPU
    mtp, ngram = ({"method": method, "num_speculative_tokens": 2} for method in ("mtp", "ngram"))
    assert EngineConfig(model=path, device="cuda", speculative_config=mtp).async_scheduling is True
    assert EngineConfig(model=path, device="cuda", speculative_config=ngram).async_scheduling is False


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_gpu_multi_step_rounds_in_graphs_match_cpu_reference(tmp_path, monkeypatch, overlap):
    """--num-scheduler-steps on the GPU: rounds of graph replays chained on the device (with
    async scheduling too: round N+1 planned and queued while round N runs)."""
    from atom.worker.cuda_graph import DecodeGraphs

    path = checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False)
    cpu = _generate(path)
    rounds: list[int] = []
    inner = DecodeGraphs.replay_steps

    def counting(self, *args):  # input_ids, rows, num_steps, next_tokens[, patch]
        rounds.append(args[2])
        return inner(self, *args)

    monkeypatch.setattr(DecodeGraphs, "replay_steps", counting)
    multi = _generate(path, device="cuda", max_num_seqs=4, max_num_batched_tokens=16, num_scheduler_steps=4,
                      async_scheduling=overlap)  # fmt: skip
    assert rounds and max(rounds) == 4
    assert multi == cpu


@pytest.fixture
def patched(monkeypatch):
    """Per graph replay's buffer fill: whether some of its input ids were taken from the device (a chained
    step's placeholders, atom/worker/deferred.py)."""
    from atom.worker.cuda_graph import DecodeGraphs

    fills: list[bool] = []
    inner = DecodeGraphs._fill

    def counting(self, input_ids, rows, patch):
        fills.append(patch is not None)
        return inner(self, input_ids, rows, patch)

    monkeypatch.setattr(DecodeGraphs, "_fill", counting)
    return fills


def test_gpu_async_single_steps_chained_on_the_device_match_cpu_reference(tmp_path, patched):
    """Async scheduling on the graphs: each greedy step returns with its tokens on the device and the
    next one takes its inputs from there (atom/worker/deferred.py)."""
    path = checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False)
    cpu = _generate(path)
    chained = _generate(path, device="cuda", max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=True)
    assert sum(patched) >= 3
    assert chained == cpu


def test_gpu_sampled_steps_chain_on_the_device_like_greedy_ones(tmp_path, patched):
    """Overlap chains sampled steps too (the sampler runs on the device): seeded requests draw the same
    tokens chained as one step at a time. Not chained: rows with penalties (they need the host)."""
    from atom import LLM

    path = checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False)

    def run(prompts, overlap: bool, seqs: int, **sampling) -> tuple[list[list[int]], int]:
        llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=seqs, async_scheduling=overlap)
        params = [SamplingParams(seed=i, max_tokens=30, ignore_eos=True, **sampling) for i in range(len(prompts))]
        patched.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.all_resources_free()
        return [o.outputs[0].token_ids for o in outs], sum(patched)

    cases = [(PROMPTS, 4, {"temperature": 0.9}, True),  # temperature only: chained at any batch size
             (PROMPTS[:2], 1, {"temperature": 0.9}, True),
             (PROMPTS[:2], 1, {"temperature": 0.9, "top_p": 0.9}, True),  # one request at a time with top-p
             (PROMPTS, 4, {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.05}, True),
             (PROMPTS, 4, {"temperature": 0.9, "repetition_penalty": 1.3}, False)]  # fmt: skip
    for prompts, seqs, sampling, chains in cases:
        sync, none = run(prompts, False, seqs, **sampling)
        overlapped, chained = run(prompts, True, seqs, **sampling)
        assert none == 0 and (chained >= 3) == chains, (sampling, chained)
        assert overlapped == sync, sampling
    greedy = _generate(path, device="cuda", max_num_seqs=4)
    assert sum(s != g[:30] for s, g in zip(run(PROMPTS, True, 4, temperature=0.9)[0], greedy)) >= 3  # sampled


def test_gpu_decode_inputs_are_written_without_waiting_for_the_stream():
    """With async scheduling the next step's inputs are written while the step before still runs on
    the GPU. The uploads must not wait for the stream (a copy from pageable memory would), and must
    write the same values as on the CPU."""
    from atom.engine.scheduler_output import ScheduledRequest
    from atom.worker.cuda_graph import HostBlockTables, as_index, fill_decode_buffers

    rows = [ScheduledRequest(f"r{i}", [10 + i], 5 * i + 3, [7 * i + j for j in range(i + 1)], i, True,
                             state_out_slot=i) for i in range(5)]  # fmt: skip
    written = []
    for device in ("cpu", "cuda"):
        buffers = torch.zeros(7, 8, dtype=torch.long, device=device)
        tables = torch.zeros(8, 12, dtype=torch.long, device=device)
        if device == "cuda":
            torch.cuda._sleep(1_000_000_000)  # about half a second of a busy stream
        fill_decode_buffers(buffers, tables, HostBlockTables(8, 12), [s.token_ids[0] for s in rows], rows,
                            (1, 2, 4, 8), 16)  # fmt: skip
        index = as_index([0, 2, 5], torch.device(device))
        if device == "cuda":
            assert not torch.cuda.current_stream().query(), "an upload waited for the kernels before it"
            torch.cuda.synchronize()
        written.append((buffers.cpu(), tables.cpu(), index.cpu()))
    (cpu_buffers, cpu_tables, cpu_index), (gpu_buffers, gpu_tables, gpu_index) = written
    assert torch.equal(cpu_buffers, gpu_buffers) and torch.equal(cpu_tables, gpu_tables)
    assert gpu_index.tolist() == cpu_index.tolist() == [0, 2, 5]


def test_gpu_prefill_chunk_steps_do_not_wait_for_the_stream(tmp_path):
    """A prefill chunk that samples nothing returns with its kernels still queued: its input ids, positions
    and metadata go up without waiting for the stream (a copy from pageable memory would), so the host can
    plan and launch the next chunk while this one runs. The chunked tokens still match the CPU's."""
    from atom import LLM

    path = checkpoints.make_kimi_checkpoint(str(tmp_path), tokenizer=False)
    prompt = list(range(3, 43))  # 40 tokens: chunks of 16, 16 and 8 at a 16-token budget
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cpu = LLM(path, dtype="float32", max_num_batched_tokens=16).generate([prompt], params, use_tqdm=False)
    llm = LLM(path, dtype="float32", device="cuda", max_num_batched_tokens=16, async_scheduling=False)
    # A first request launches every kernel of these steps once. Run early in a process, without it, the first
    # chunk below waited for the stream every time (GPU_NOTES, session 38: likely CUDA's lazy loading of a kernel's
    # module at its first launch); after it, the chunks show only what the step itself waits for.
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == cpu[0].outputs[0].token_ids
    core = llm.engine
    core.add_request(core.make_request(prompt, params, request_id="1"))
    for chunk in range(2):  # the two chunks before the last, which sample nothing
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # about half a second of a busy stream
        assert core.step() == []
        assert not torch.cuda.current_stream().query(), f"prefill chunk {chunk} waited for the kernels before it"
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    assert outputs[-1].outputs[0].token_ids == cpu[0].outputs[0].token_ids
    assert core.all_resources_free()


@pytest.mark.parametrize("tokens", [16, 100])
def test_gpu_shared_expert_in_the_every_expert_matmuls_matches_its_own_mlp(tokens, monkeypatch):
    """bf16, on the every-expert path: the shared expert stacked after the routed ones (one pair of batched
    matmuls for both) against the shared MLP run on its own, and both against fp32 on the CPU."""
    from atom.layers import moe as moe_mod
    from atom.layers.moe import SparseMoE, TopkRouter, routed_path

    torch.manual_seed(tokens)
    router = TopkRouter(256, 16, 4, num_groups=1, topk_groups=1, norm_topk_prob=True, routed_scaling_factor=2.0)
    layer = SparseMoE(256, 128, 16, num_shared_experts=1, router=router, dtype=torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(0, 256**-0.5)
    reference = copy.deepcopy(layer).float()
    reference.fuse()
    layer.cuda().fuse()
    x = torch.randn(tokens, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert routed_path(x.cuda(), layer.gate(x.cuda())[1], 16) == "all"
        folded = layer(x.cuda())
        monkeypatch.setattr(moe_mod, "FOLD_SHARED", False)
        separate = layer(x.cuda())
        expected = reference(x.float())  # the CPU: the expert loop plus the shared MLP
    for out in (folded, separate):
        assert ((out.float().cpu() - expected).norm() / expected.norm()).item() < 1e-2
    assert ((folded.float() - separate.float()).norm() / separate.float().norm()).item() < 1e-2


@pytest.mark.parametrize("path", ["dispatch", "grouped", "all_experts"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_gpu_grouped_moe_matches_expert_loop_in_bf16(tokens, path):
    """What bf16 MoE layers run on the GPU (grouped matmuls, or every expert in batched matmuls)
    against the expert loop, on the same GPU."""
    from atom.layers.moe import RoutedExperts, grouped_mm_applies

    torch.manual_seed(tokens)
    experts = RoutedExperts(16, 256, 128, torch.bfloat16).cuda()
    for p in experts.parameters():
        p.data.normal_(0, 256**-0.5)
    experts.fuse()
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    scores = torch.rand(tokens, 16, device="cuda")
    scores[:, :4] += 0.5  # skewed: some experts get no token
    ids = scores.topk(4, dim=-1, sorted=False).indices
    weights = torch.rand(tokens, 4, device="cuda") + 0.1
    if not grouped_mm_applies(x):
        pytest.skip("no bf16 grouped matmul on this GPU")
    with torch.no_grad():
        if path == "dispatch":
            grouped = experts(x, weights, ids)  # grouped or all-experts by the batch size
        else:
            grouped = getattr(experts, f"forward_{path}")(x, weights, ids)
        loop = torch.zeros_like(x)
        for e in range(16):  # the reference loop, written out
            token, slot = torch.where(ids == e)
            if len(token):
                gate, up = torch.nn.functional.linear(x[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
                y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, experts.down_proj[e])
                loop.index_put_((token,), (y.float() * weights[token, slot, None]).to(x.dtype), accumulate=True)
    err = ((grouped.float() - loop.float()).norm() / loop.float().norm()).item()
    assert err < 1e-2, err
