"""LLM.generate greedy tokens equal transformers' greedy generate; prompt logprobs agree."""

from __future__ import annotations

import pytest

from atom import SamplingParams
from tests import checkpoints

PROMPTS = [[5, 17, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 99, 3], list(range(30, 53))]
NEW_TOKENS = 32


def _check_against_hf(path: str, make_llm) -> None:
    llm = make_llm(path, max_num_batched_tokens=64, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    expected = checkpoints.hf_greedy(path, PROMPTS, NEW_TOKENS)
    for out, want in zip(outs, expected):
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    # Prompt logprobs: entry i is the logprob of prompt token i given tokens < i.
    for prompt, out in zip(PROMPTS, outs):
        ref = checkpoints.hf_prompt_logprobs(path, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            got = out.prompt_logprobs[i][prompt[i]]
            assert abs(got - ref[i - 1, prompt[i]].item()) < 1e-4


@pytest.mark.parametrize("variant", list(checkpoints.KIMI_VARIANTS))
def test_kimi_linear_matches_transformers(variant, tmp_path, make_llm):
    path = checkpoints.make_kimi_checkpoint(str(tmp_path), variant, tokenizer=False)
    _check_against_hf(path, make_llm)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_dense_matches_transformers(kind, tmp_path, make_llm):
    path = checkpoints.make_llama_checkpoint(str(tmp_path), kind, tokenizer=False)
    _check_against_hf(path, make_llm)


@pytest.mark.parametrize("speculation", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}])
def test_repetition_penalty_matches_transformers(speculation, llama_ckpt, make_llm):
    """Greedy with a repetition penalty over prompt and output, 150 tokens (past the runner's output arrays'
    first growths), batched: transformers' RepetitionPenaltyLogitsProcessor gives the same tokens. With n-gram
    speculation the drafts' positions are penalised as if the drafts before them were outputs."""
    llm = make_llm(llama_ckpt, max_num_batched_tokens=64, block_size=8, speculative_config=speculation)
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True, repetition_penalty=1.3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    expected = checkpoints.hf_greedy(llama_ckpt, PROMPTS, 150, repetition_penalty=1.3)
    assert [o.outputs[0].token_ids for o in outs] == expected
    plain = checkpoints.hf_greedy(llama_ckpt, PROMPTS[:1], 150)
    assert plain[0] != expected[0]  # the penalty changed the tokens
    if speculation:
        assert sum(o.metrics["num_draft_tokens"] for o in outs) > 20
        assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 5
