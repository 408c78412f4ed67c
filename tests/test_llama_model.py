"""Llama / Qwen3 on the paged KV cache match transformers token for token.

Each test saves a small random HF model, loads it through ``load_model`` and
drives it with a minimal block-table harness (no scheduler): batched prefill,
greedy decode, chunked prefill mixed across sequences, and bf16.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from atom.config import EngineConfig
from atom.forward_context import ForwardContext, build_attention_metadata, set_forward_context
from atom.models.loader import load_model

VOCAB = 256
PROMPT_LENS = (5, 11, 17)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger logits: fewer near-ties in greedy decoding
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _llama_config():
    return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def _qwen3_config():
    # head_dim 32 != 64 / 4; llama3 scaling with a short original context covers
    # all three frequency bands (kept, interpolated, stretched).
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return Qwen3Config(**COMMON, head_dim=32, attention_bias=True, tie_word_embeddings=False, rope_parameters=rope)


CONFIGS = {"llama": (_llama_config, LlamaForCausalLM), "qwen3": (_qwen3_config, Qwen3ForCausalLM)}


class PagedHarness:
    """Owns caches and per-sequence block tables; runs one flat step at a time."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 4):
        self.model = model
        self.block_size = block_size
        self.caches = {i: s.allocate(num_blocks, block_size, "cpu") for i, s in model.cache_specs().items()}
        # Shuffled free list: block tables are non-contiguous, as after churn.
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def _reserve(self, seq: int, total_len: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < total_len:
            table.append(self.free.pop())
        return table

    @torch.no_grad()
    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed each sequence its new tokens; return their logits [n, vocab] per sequence."""
        seqs = list(new_tokens)
        ctx = [self.num_computed.get(s, 0) for s in seqs]
        lens = [len(new_tokens[s]) for s in seqs]
        tables = [self._reserve(s, c + n) for s, c, n in zip(seqs, ctx, lens)]
        meta = build_attention_metadata(lens, ctx, tables, [-1] * len(seqs), self.block_size)
        ids = torch.tensor([t for s in seqs for t in new_tokens[s]])
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, lens)])
        with set_forward_context(ForwardContext(attn_metadata=meta, caches=self.caches)):
            logits = self.model.compute_logits(self.model(ids, positions))
        for s, n in zip(seqs, lens):
            self.num_computed[s] = self.num_computed.get(s, 0) + n
        return dict(zip(seqs, logits.split(lens)))


def _save(kind: str, tmp_path):
    make_config, hf_cls = CONFIGS[kind]
    torch.manual_seed(0)
    hf = hf_cls(make_config()).eval()
    hf.save_pretrained(tmp_path)
    return hf


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save(request.param, path)
    model = load_model(EngineConfig(model=str(path), dtype="float32"))
    return hf, model, path


def test_batched_prefill_matches_hf(checkpoint):
    hf, model, _ = checkpoint
    prompts = _prompts()
    out = PagedHarness(model).step(dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(out[i], _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_greedy_decode_matches_hf_generate(checkpoint):
    hf, model, _ = checkpoint
    prompts, steps = _prompts(), 12
    harness = PagedHarness(model)
    logits = harness.step(dict(enumerate(prompts)))
    generated = {i: [] for i in range(len(prompts))}
    for _ in range(steps):
        nxt = {i: [int(logits[i][-1].argmax())] for i in generated}
        for i, tok in nxt.items():
            generated[i] += tok
        logits = harness.step(nxt)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, do_sample=False, max_new_tokens=steps, pad_token_id=0)[0, len(prompt) :]
        assert generated[i] == ref.tolist()


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_matches_full(checkpoint, chunk):
    # All three prompts advance together, `chunk` tokens per step; shorter ones
    # drop out of the batch once done, so late steps mix fresh and deep contexts.
    hf, model, _ = checkpoint
    prompts = _prompts()
    harness = PagedHarness(model)
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    for start in range(0, max(PROMPT_LENS), chunk):
        batch = {i: p[start : start + chunk] for i, p in enumerate(prompts) if start < len(p)}
        for i, logits in harness.step(batch).items():
            pieces[i].append(logits)
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(torch.cat(pieces[i]), _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_bf16_runs_finite_and_close(checkpoint):
    hf, _, path = checkpoint
    model = load_model(EngineConfig(model=str(path), dtype="bfloat16"))
    assert model.lm_head.weight.dtype == torch.bfloat16
    prompts = _prompts()
    harness = PagedHarness(model)
    out = harness.step(dict(enumerate(prompts)))
    decode = harness.step({i: [int(out[i][-1].argmax())] for i in out})
    for i, prompt in enumerate(prompts):
        assert out[i].dtype == torch.float32
        assert torch.isfinite(out[i]).all() and torch.isfinite(decode[i]).all()
        ref = _hf_logits(hf, prompt)
        assert (out[i] - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


def test_weight_tying_and_specs(checkpoint):
    hf, model, _ = checkpoint
    tied = hf.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    spec = model.cache_specs()[1]
    assert (spec.num_kv_heads, spec.head_dim) == (2, hf.config.head_dim)
    assert set(model.cache_specs()) == {0, 1}
