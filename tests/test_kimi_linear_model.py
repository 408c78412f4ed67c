"""Kimi-Linear against transformers' implementation, through the real loader and a tiny cache harness.

Each config variant is a random transformers model saved with save_pretrained
and loaded with ``atom.models.loader.load_model``. The harness below plays the
model runner: it hands out KV blocks and state slots, builds the step
metadata and runs steps inside ``set_forward_context``.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import KimiLinearConfig
from transformers import KimiLinearForCausalLM as HFKimiLinear

import atom.ops.mla
from atom.config import EngineConfig
from atom.forward_context import ForwardContext, build_attention_metadata, set_forward_context
from atom.layers.cache_spec import MLASpec, RecurrentStateSpec
from atom.layers.kda import KimiDeltaAttention
from atom.models.loader import load_model
from atom.ops.kda import CHUNKED_MIN_LEN, kda_chunked, kda_recurrent, l2norm

VOCAB = 160
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_head_dim=16,
    linear_num_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,  # greedy generation never stops early
)

VARIANTS = {
    # layer_types spelling; MLA in the middle; dense first layer (first_k_dense_replace default 1)
    "layer_types": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    ),
    # the release's spelling: 1-based kda_layers/full_attn_layers, MLA first, two dense layers
    "checkpoint_spelling": dict(
        num_hidden_layers=3,
        first_k_dense_replace=2,
        linear_attn_config={
            "kda_layers": [2, 3],
            "full_attn_layers": [1],
            "head_dim": 32,
            "num_heads": 3,
            "short_conv_kernel_size": 3,
        },
    ),
    # q_lora, more heads and experts, group-limited routing, two shared experts, no renormalisation
    "q_lora": dict(
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "full_attention"],
        q_lora_rank=24,
        num_attention_heads=4,
        num_key_value_heads=4,
        qk_rope_head_dim=16,
        linear_num_heads=4,
        num_local_experts=8,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        norm_topk_prob=False,
        first_k_dense_replace=0,
    ),
    # attention biases, head_dim 32, default layer pattern (MLA at layer 4)
    "bias_default_pattern": dict(
        num_hidden_layers=5, attention_bias=True, linear_head_dim=32, qk_nope_head_dim=32, v_head_dim=24
    ),
}


def _save_checkpoint(folder, overrides: dict, seed: int = 0) -> HFKimiLinear:
    config = KimiLinearConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    hf = HFKimiLinear(config).eval()
    with torch.no_grad():  # non-zero correction bias so routing exercises it
        for module in hf.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(-0.05, 0.05)
    hf.save_pretrained(folder)
    if "linear_attn_config" in overrides:  # keep only the release's spelling in config.json
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            raw = json.load(f)
        for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
            raw.pop(key, None)
        with open(path, "w") as f:
            json.dump(raw, f)
    return hf


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add sync overhead (and stall badly on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _save_checkpoint(str(folder), VARIANTS[request.param])
    model = load_model(EngineConfig(model=str(folder), dtype="float32"))
    return hf, model, str(folder)


class Harness:
    """A minimal model runner: block tables, state slots, one forward per step."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 4, num_slots: int = 4) -> None:
        self.model, self.block_size = model, block_size
        self.caches = {
            i: spec.allocate(num_blocks, block_size, "cpu")
            if isinstance(spec, MLASpec)
            else spec.allocate(num_slots, "cpu")
            for i, spec in model.cache_specs().items()
        }
        self.free_blocks = list(range(num_blocks))
        random.Random(0).shuffle(self.free_blocks)  # block tables are not contiguous runs
        self.seqs: dict[str, dict] = {}

    def add(self, name: str, slot: int) -> None:
        self.seqs[name] = {"computed": 0, "blocks": [], "slot": slot}

    def step(self, feeds: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one step; feeds maps sequence -> its new tokens. Returns logits [n, vocab] per sequence."""
        names = list(feeds)
        for name in names:
            seq = self.seqs[name]
            while len(seq["blocks"]) * self.block_size < seq["computed"] + len(feeds[name]):
                seq["blocks"].append(self.free_blocks.pop())
        md = build_attention_metadata(
            query_lens=[len(feeds[n]) for n in names],
            context_lens=[self.seqs[n]["computed"] for n in names],
            block_tables=[self.seqs[n]["blocks"] for n in names],
            state_slots=[self.seqs[n]["slot"] for n in names],
            block_size=self.block_size,
        )
        ids = torch.tensor([t for n in names for t in feeds[n]])
        pos = torch.tensor([self.seqs[n]["computed"] + j for n in names for j in range(len(feeds[n]))])
        with torch.no_grad(), set_forward_context(ForwardContext(md, self.caches)):
            logits = self.model.compute_logits(self.model(ids, pos))
        for name in names:
            self.seqs[name]["computed"] += len(feeds[name])
        return dict(zip(names, logits.split(md.query_lens)))


def _prompts(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _hf_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def test_batched_prefill_then_decode_matches_transformers(variant):
    hf, model, _ = variant
    prompts = _prompts([5, 11, 17])
    harness = Harness(model)
    for i in range(3):
        harness.add(f"s{i}", slot=i)
    out = harness.step({f"s{i}": p for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        torch.testing.assert_close(out[f"s{i}"], _hf_logits(hf, p), atol=1e-5, rtol=1e-5)

    new_tokens = 12
    generated = {f"s{i}": [int(out[f"s{i}"][-1].argmax())] for i in range(3)}
    for _ in range(new_tokens - 1):  # all three sequences decode together, one token each
        out = harness.step({name: toks[-1:] for name, toks in generated.items()})
        for name, logits in out.items():
            generated[name].append(int(logits[-1].argmax()))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new_tokens, do_sample=False)
        assert generated[f"s{i}"] == ref[0, len(p):].tolist()


def test_chunked_prefill_matches_single_shot(variant):
    """One prompt in chunks of 1, 3 and 7 tokens, all three in flight in the same steps, on dirty slots."""
    hf, model, _ = variant
    (prompt,) = _prompts([17], seed=2)
    expected = _hf_logits(hf, prompt)
    harness = Harness(model)
    harness.add("dirty", slot=1)
    harness.step({"dirty": _prompts([9], seed=3)[0]})  # leaves state in slot 1, reused below
    chunk = {"c1": 1, "c3": 3, "c7": 7}
    for slot, name in enumerate(chunk):
        harness.add(name, slot=slot)
    got = {name: [] for name in chunk}
    while any(harness.seqs[n]["computed"] < len(prompt) for n in chunk):
        feeds = {}
        for name, size in chunk.items():
            start = harness.seqs[name]["computed"]
            if start < len(prompt):
                feeds[name] = prompt[start : start + size]
        for name, logits in harness.step(feeds).items():
            got[name].append(logits)
    for name in chunk:
        torch.testing.assert_close(torch.cat(got[name]), expected, atol=1e-5, rtol=1e-5)


def test_long_prefill_uses_chunked_kda_and_matches(variant, monkeypatch):
    """70 tokens take the chunked KDA form; MLA scores run in query blocks of 16."""
    monkeypatch.setattr(atom.ops.mla, "QUERY_CHUNK", 16)
    hf, model, _ = variant
    prompts = _prompts([CHUNKED_MIN_LEN + 6, 4], seed=4)
    harness = Harness(model, num_blocks=64, block_size=4)
    harness.add("long", slot=0)
    harness.add("short", slot=1)
    out = harness.step({"long": prompts[0], "short": prompts[1]})
    torch.testing.assert_close(out["long"], _hf_logits(hf, prompts[0]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["short"], _hf_logits(hf, prompts[1]), atol=1e-5, rtol=1e-5)


def test_cache_specs_follow_layer_types(variant):
    hf, model, _ = variant
    kinds = {"full_attention": MLASpec, "linear_attention": RecurrentStateSpec}
    specs = model.cache_specs()
    assert [type(specs[i]) for i in range(len(specs))] == [kinds[t] for t in hf.config.layer_types]
    kda = next(s for s in specs.values() if isinstance(s, RecurrentStateSpec))
    heads, dim, width = hf.config.linear_num_heads, hf.config.linear_head_dim, hf.config.linear_conv_kernel_dim
    assert kda.shapes == ((3 * heads * dim, width - 1), (heads, dim, dim))
    assert kda.dtypes == (torch.float32, torch.float32)


def test_projections_of_x_are_one_matmul_after_loading(variant):
    """After loading, each KDA layer's six projections of x, and each MLA layer's query (or q_a) and kv_a
    projections, are views into one stacked weight (one matmul a layer); MLA keeps them apart when only one
    of the two has a bias (the bias variant's q_proj has none, its kv_a has one)."""
    hf, model, _ = variant
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            stacked, parts = attn.in_proj.weight, (attn.q_proj, attn.b_proj)
        else:
            q_in = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
            if (q_in.bias is None) != (attn.kv_a_proj_with_mqa.bias is None):
                assert attn.x_proj is None and hf.config.attention_bias
                continue
            stacked, parts = attn.x_proj.weight, (q_in, attn.kv_a_proj_with_mqa)
        assert stacked is not None
        for lin in parts:
            assert lin.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()


def test_bfloat16_loads_and_runs(variant):
    hf, _, folder = variant
    model = load_model(EngineConfig(model=folder, dtype="bfloat16"))
    for name, param in model.named_parameters():
        kept_fp32 = name.endswith(("gate.weight", "e_score_correction_bias", "dt_bias"))
        assert param.dtype == (torch.float32 if kept_fp32 else torch.bfloat16), name
    harness = Harness(model)
    prompts = _prompts([6, 13])
    harness.add("a", slot=0)
    harness.add("b", slot=1)
    out = harness.step({"a": prompts[0], "b": prompts[1]})
    for name, prompt in zip("ab", prompts):  # close to fp32 (a routing flip may move a few logits)
        cosine = torch.nn.functional.cosine_similarity(out[name], _hf_logits(hf, prompt), dim=-1)
        assert cosine.min() > 0.99
    for _ in range(3):
        out = harness.step({n: [int(l[-1].argmax())] for n, l in out.items()})
    assert all(torch.isfinite(l).all() for l in out.values())


def test_chunked_kda_agrees_with_recurrence():
    torch.manual_seed(0)
    b, length, h, k, v = 3, 150, 2, 16, 8
    q = l2norm(torch.randn(b, length, h, k)) * k**-0.5
    key = l2norm(torch.randn(b, length, h, k))
    val = torch.randn(b, length, h, v)
    g = -torch.rand(b, length, h, k) * torch.exp(torch.randn(b, length, h, k))
    beta = torch.rand(b, length, h)
    g[1, 90:], beta[1, 90:] = 0, 0  # padding: state must pass through untouched
    state = torch.randn(b, h, k, v)
    o_ref, s_ref = kda_recurrent(q, key, val, g, beta, state)
    o_chunk, s_chunk = kda_chunked(q, key, val, g, beta, state)
    torch.testing.assert_close(o_chunk, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_chunk, s_ref, atol=1e-5, rtol=1e-5)
    _, s_short = kda_recurrent(q[1:2, :90], key[1:2, :90], val[1:2, :90], g[1:2, :90], beta[1:2, :90], state[1:2])
    torch.testing.assert_close(s_ref[1:2], s_short)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loader")
    _save_checkpoint(str(folder), VARIANTS["layer_types"])
    return str(folder)


def _rewrite_weights(folder, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(small_checkpoint, tmp_path):
    shutil.copytree(small_checkpoint, tmp_path, dirs_exist_ok=True)
    name = "model.layers.0.self_attn.q_conv1d.weight"
    _rewrite_weights(str(tmp_path), lambda t: t.pop(name))
    with pytest.raises(ValueError, match="q_conv1d"):
        load_model(EngineConfig(model=str(tmp_path), dtype="float32"))


def test_wrong_shape_is_named(small_checkpoint, tmp_path):
    shutil.copytree(small_checkpoint, tmp_path, dirs_exist_ok=True)
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    _rewrite_weights(str(tmp_path), lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight"):
        load_model(EngineConfig(model=str(tmp_path), dtype="float32"))
