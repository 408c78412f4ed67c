"""Greedy output must not change with how the same requests are run."""

from __future__ import annotations

import pytest

from atom import SamplingParams

PROMPTS = [list(range(3, 3 + n)) for n in (4, 19, 9, 33, 1, 12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(params=["kimi", "llama"])
def ckpt(request, kimi_ckpt, llama_ckpt):
    return kimi_ckpt if request.param == "kimi" else llama_ckpt


def _inputs():
    return [{"prompt_token_ids": p} for p in PROMPTS]


def test_batch_equals_one_at_a_time(ckpt, make_llm):
    llm = make_llm(ckpt)
    batched = _tokens(llm.generate(_inputs(), GREEDY))
    single = [_tokens(llm.generate([p], GREEDY))[0] for p in _inputs()]
    assert batched == single


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(ckpt, budget, make_llm):
    reference = _tokens(make_llm(ckpt, max_num_batched_tokens=4096).generate(_inputs(), GREEDY))
    chunked = _tokens(make_llm(ckpt, max_num_batched_tokens=budget).generate(_inputs(), GREEDY))
    assert chunked == reference


def test_preemption_equals_no_preemption(ckpt, make_llm):
    reference = _tokens(make_llm(ckpt).generate(_inputs(), GREEDY))
    # 16 blocks of 4 tokens: one request of max_model_len 64 fits, six at once (~200 tokens) do not.
    llm = make_llm(ckpt, block_size=4, num_gpu_blocks=16, max_model_len=64)
    outs = llm.generate(_inputs(), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == reference


def test_few_state_slots_equals_many(kimi_ckpt, make_llm):
    reference = _tokens(make_llm(kimi_ckpt).generate(_inputs(), GREEDY))
    assert _tokens(make_llm(kimi_ckpt, num_state_slots=2).generate(_inputs(), GREEDY)) == reference


def test_prefix_cache_hit_equals_miss(llama_ckpt, make_llm):
    shared = list(range(40, 80))
    prompts = [{"prompt_token_ids": shared + [i, i + 1]} for i in (3, 5, 7)]
    miss = _tokens(make_llm(llama_ckpt, enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = make_llm(llama_ckpt, enable_prefix_caching=True, block_size=8)
    first = llm.generate(prompts[:1], GREEDY)
    hits = llm.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens >= 40 for o in hits)
    assert _tokens(first) == miss[:1]
    assert _tokens(hits) == miss


def test_hybrid_model_keeps_prefix_caching_off(kimi_ckpt, make_llm):
    llm = make_llm(kimi_ckpt, enable_prefix_caching=True)
    assert not llm.engine.kv.enable_prefix_caching
    llm.generate([PROMPTS[3], PROMPTS[3]], GREEDY)


def test_seeded_sampling_is_independent_of_batch(ckpt, make_llm):
    llm = make_llm(ckpt)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = _tokens(llm.generate([{"prompt_token_ids": PROMPTS[1]}], seeded))[0]
    mixed = llm.generate(_inputs(), [other, seeded, other, other, other, other])
    assert mixed[1].outputs[0].token_ids == alone
    again = llm.generate(_inputs()[::-1], [other, other, other, other, seeded, other])
    assert again[4].outputs[0].token_ids == alone


@pytest.mark.parametrize("budget", [7, 4096])
def test_overlap_equals_no_overlap(ckpt, budget, make_llm):
    stops = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = _tokens(make_llm(ckpt, max_num_batched_tokens=budget).generate(_inputs(), stops))
    llm = make_llm(ckpt, max_num_batched_tokens=budget, async_scheduling=True)
    assert _tokens(llm.generate(_inputs(), stops)) == reference


def _forward_threads(llm) -> list:
    """The thread of each step the engine executes from now on."""
    import threading

    execute, threads = llm.engine.execute, []
    llm.engine.execute = lambda sched: threads.append(threading.current_thread()) or execute(sched)
    return threads


def test_overlap_keeps_one_forward_thread_across_calls(llama_ckpt, make_llm):
    """Every generate() call runs its forward passes on the same thread, started by the first call:
    a fresh thread per call cost tens of ms a call on the H200 (GPU_NOTES, session 29)."""
    import threading

    llm = make_llm(llama_ckpt, async_scheduling=True)
    threads = _forward_threads(llm)
    first = _tokens(llm.generate(_inputs(), GREEDY))
    assert _tokens(llm.generate(_inputs(), GREEDY)) == first
    assert len(set(threads)) == 1 and threads[0] is not threading.main_thread()
    assert threads[0].is_alive()  # kept for the next call


def test_overlap_error_waits_for_the_steps_queued(llama_ckpt, make_llm):
    """An error while a step is queued behind the one being applied: generate() raises only after both
    have run (none still touches the engine while its requests are aborted), and the engine is usable."""
    import threading
    import time

    llm = make_llm(llama_ckpt, async_scheduling=True)
    reference = _tokens(llm.generate(_inputs(), GREEDY))
    execute, update, running, calls = llm.engine.execute, llm.engine.update, [], []

    def slow(sched):
        running.append(threading.current_thread())
        time.sleep(0.05)  # still running when the update before it fails
        result = execute(sched)
        running.pop()
        return result

    def failing(sched, result):
        calls.append(sched)
        if len(calls) == 3:
            raise RuntimeError("update failed")
        return update(sched, result)

    llm.engine.execute, llm.engine.update = slow, failing
    with pytest.raises(RuntimeError, match="update failed"):
        llm.generate(_inputs(), GREEDY)
    assert not running  # every step queued had finished when generate() raised
    llm.engine.execute, llm.engine.update = execute, update
    assert _tokens(llm.generate(_inputs(), GREEDY)) == reference


def test_overlap_forward_thread_ends_with_its_llm(llama_ckpt):
    import gc

    from atom import LLM

    llm = LLM(llama_ckpt, dtype="float32", async_scheduling=True)
    threads = _forward_threads(llm)
    llm.generate(_inputs()[:2], GREEDY)
    assert llm.engine.all_resources_free()
    del llm
    gc.collect()
    threads[0].join(timeout=10)
    assert not threads[0].is_alive()


def test_overlap_with_preemption_and_stops(ckpt, make_llm):
    ref_llm = make_llm(ckpt)
    reference = ref_llm.generate(_inputs(), GREEDY)
    # A stop token found one step late must not leak the extra token the next step computed.
    stop_ids = [reference[1].outputs[0].token_ids[5]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=stop_ids)
    want = _tokens(ref_llm.generate(_inputs(), params))
    llm = make_llm(ckpt, block_size=4, num_gpu_blocks=16, max_model_len=64, async_scheduling=True)
    got = llm.generate(_inputs(), params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(got) == want


def test_seeded_rows_preempted_with_a_step_in_flight_keep_their_tokens(ckpt, make_llm):
    """With overlap, a request preempted while its step runs has that step's sample thrown away; its seeded
    draws are wound back to before it, so its tokens are those of a run without overlap (where nothing is
    in flight when a request is preempted)."""
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=30, ignore_eos=True) for seed in range(6)]
    runs = []
    for overlap in (False, True):
        llm = make_llm(ckpt, num_gpu_blocks=6, max_model_len=64, async_scheduling=overlap)
        runs.append(_tokens(llm.generate(_inputs(), params)))
        assert llm.engine.scheduler.num_preemptions > 0
    assert runs[1] == runs[0]


def test_bfloat16_engine_runs_and_follows_auto_dtype(ckpt, make_llm):
    import torch

    llm = make_llm(ckpt, dtype="bfloat16")
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    outs = llm.generate(_inputs(), GREEDY)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    # dtype="auto" follows config.json (the test checkpoints were saved in float32)
    auto = make_llm(ckpt, dtype="auto")
    assert auto.config.torch_dtype == torch.float32


# Settings that each have their own test above, stacked: the paths they take must also compose.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
STACKED = [
    pytest.param("kimi", dict(max_num_batched_tokens=7, num_state_slots=2, async_scheduling=True,
                              num_scheduler_steps=4), False, id="kimi-multi"),
    pytest.param("kimi", dict(max_num_batched_tokens=7, async_scheduling=True, speculative_config=NGRAM), False,
                 id="kimi-ngram"),
    pytest.param("llama", dict(max_num_batched_tokens=3, enable_prefix_caching=True, async_scheduling=True,
                               num_scheduler_steps=4), True, id="llama-multi"),
    pytest.param("llama", dict(enable_prefix_caching=True, speculative_config=NGRAM), True, id="llama-ngram"),
]


@pytest.mark.parametrize("ckpt,settings,prefix_hits", STACKED, indirect=["ckpt"])
def test_stacked_settings_with_preemption_equal_the_default(ckpt, settings, prefix_hits, make_llm):
    shared = list(range(40, 64))  # a common prefix, for the runs with prefix caching
    prompts = [{"prompt_token_ids": shared + p} for p in PROMPTS[:4]] + _inputs()[4:]
    reference = _tokens(make_llm(ckpt).generate(prompts, GREEDY))
    # 24 blocks of 4 tokens: each request fits alone (at most 57 + 20 tokens), all six at once do not.
    llm = make_llm(ckpt, block_size=4, num_gpu_blocks=24, max_model_len=80, **settings)
    assert _tokens(llm.generate(prompts, GREEDY)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(prompts, GREEDY)
    assert _tokens(again) == reference
    if prefix_hits:  # (the hybrid model keeps prefix caching off: test_hybrid_model_keeps_prefix_caching_off)
        assert any(o.num_cached_tokens >= len(shared) for o in again)
