"""Stop conditions, and bad inputs that must raise ValueError and leave the engine usable."""

from __future__ import annotations

import pytest

from atom import SamplingParams

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


def _reference(llm, n=24):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    return out.outputs[0]


def test_max_tokens_and_stop_token_ids(kimi_ckpt, make_llm):
    llm = make_llm(kimi_ckpt)
    ref = _reference(llm)
    assert len(ref.token_ids) == 24 and ref.finish_reason == "length"
    stop_tok = ref.token_ids[6]
    first = ref.token_ids.index(stop_tok)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok],
                                              ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_eos_stops_unless_ignored(llama_ckpt, make_llm):
    llm = make_llm(llama_ckpt)
    ref = _reference(llm)
    eos = ref.token_ids[4]
    req = llm.engine.make_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=24))
    req.eos_token_ids = (eos,)
    llm.engine.add_request(req)
    while llm.engine.has_unfinished_requests():
        outs = llm.engine.step()
    out = outs[-1].outputs[0]
    assert out.token_ids == ref.token_ids[: ref.token_ids.index(eos) + 1]
    assert out.finish_reason == "stop"


def test_stop_string_is_cut_from_text(kimi_ckpt, make_llm):
    llm = make_llm(kimi_ckpt)
    ref = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    text = ref.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=30, stop=[stop],
                                                     ignore_eos=True))[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 30


def test_max_model_len_ends_generation(llama_ckpt, make_llm):
    llm = make_llm(llama_ckpt, max_model_len=12)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12 - 5 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "make_bad, match",
    [
        (lambda: ({"prompt_token_ids": []}, SamplingParams()), "empty"),
        (lambda: ({"prompt_token_ids": list(range(3, 40))}, SamplingParams()), "max_model_len"),
        (lambda: (PROMPT, SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda: (PROMPT, SamplingParams(top_p=0.0)), "top_p"),
        (lambda: (PROMPT, SamplingParams(top_p=1.5)), "top_p"),
        (lambda: ({"prompt_token_ids": [10**9]}, SamplingParams()), "token ids"),
    ],
)
def test_bad_inputs_raise_and_engine_stays_usable(llama_ckpt, make_llm, make_bad, match):
    llm = make_llm(llama_ckpt, max_model_len=32)
    before = _reference(llm, 6).token_ids
    with pytest.raises(ValueError, match=match):
        prompt, params = make_bad()
        llm.generate([PROMPT, prompt], params)
    assert _reference(llm, 6).token_ids == before


def test_unknown_model_folder(tmp_path):
    from atom import LLM

    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unknown_architecture(tmp_path):
    import json

    from atom import LLM

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path))


def test_kv_cache_too_small_is_refused(llama_ckpt):
    from atom import LLM

    with pytest.raises(ValueError, match="--kv-cache-memory"):
        LLM(llama_ckpt, kv_cache_memory=4096, max_model_len=256)


def test_engine_seed_makes_unseeded_sampling_repeatable(llama_ckpt, make_llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = [make_llm(llama_ckpt, seed=7).generate(PROMPT, params)[0].outputs[0].token_ids for _ in range(2)]
    other = make_llm(llama_ckpt, seed=8).generate(PROMPT, params)[0].outputs[0].token_ids
    assert runs[0] == runs[1]
    assert other != runs[0]


def test_llm_refuses_pd_config(llama_ckpt):
    from atom import LLM

    with pytest.raises(ValueError, match="AsyncEngine"):
        LLM(llama_ckpt, kv_transfer_config={"kv_connector": "mooncake", "kv_role": "kv_producer"})


def test_cache_larger_than_memory_is_refused(llama_ckpt):
    from atom import LLM

    with pytest.raises(ValueError, match="free on cpu"):
        LLM(llama_ckpt, kv_cache_memory=1 << 50)  # a petabyte
