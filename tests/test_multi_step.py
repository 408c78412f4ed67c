"""Multi-step decoding (``num_scheduler_steps``) gives exactly the tokens of single steps.

A round of K steps runs only when every running request is a plain decode;
the runner feeds each sampled token back in K times before the scheduler
sees any of them. Whatever the round length, the stop rules must cut where
single steps cut, sampling must draw the same numbers, and every block and
slot must be free afterwards (the ``make_llm`` fixture checks that). Each
case also runs with async scheduling (``overlap``): round N+1 is planned
while round N runs, its first input the token round N has not returned yet.
"""

from __future__ import annotations

import pytest

from atom import SamplingParams
from atom.config import EngineConfig

PROMPTS = [list(range(3, 3 + n)) for n in (4, 19, 9, 33, 1, 12)]


def _inputs():
    return [{"prompt_token_ids": p} for p in PROMPTS]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(params=["kimi", "llama"])
def ckpt(request, kimi_ckpt, llama_ckpt):
    return kimi_ckpt if request.param == "kimi" else llama_ckpt


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def overlap(request) -> bool:
    return request.param


@pytest.fixture
def round_lengths(monkeypatch):
    """Records num_steps of every step the runner executes."""
    from atom.worker.model_runner import ModelRunner

    seen: list[int] = []
    inner = ModelRunner.execute_model

    def recording(self, sched):
        if sched.scheduled:
            seen.append(sched.num_steps)
        return inner(self, sched)

    monkeypatch.setattr(ModelRunner, "execute_model", recording)
    return seen


@pytest.fixture
def rounds_planned_in_flight(monkeypatch):
    """Counts multi-step rounds planned while another round's tokens were still pending."""
    from atom.engine.scheduler import Scheduler

    count = [0]
    inner = Scheduler.schedule

    def recording(self):
        pending = any(r.num_pending_tokens > 1 for r in self.running)  # a round (not a single step) in flight
        out = inner(self)
        count[0] += int(pending and out.num_steps > 1)
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    return count


@pytest.mark.parametrize("steps", [2, 4, 7])
def test_greedy_multi_step_equals_single_step(ckpt, steps, make_llm, round_lengths, overlap,
                                              rounds_planned_in_flight):  # fmt: skip
    # max_tokens 23 is no multiple of the round length: the last round is shorter
    greedy = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    reference = _tokens(make_llm(ckpt).generate(_inputs(), greedy))
    round_lengths.clear()
    out = _tokens(make_llm(ckpt, num_scheduler_steps=steps, async_scheduling=overlap).generate(_inputs(), greedy))
    assert out == reference
    assert max(round_lengths) == steps and len(round_lengths) < 23  # rounds really ran several steps
    assert (rounds_planned_in_flight[0] > 0) == overlap  # with overlap, round N+1 planned while N ran


def test_requests_arriving_over_time_and_few_seats(kimi_ckpt, make_llm, round_lengths, overlap):
    """max_num_seqs 2 for 6 requests: rounds alternate with admissions and prefills."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 17, 5, 12, 20, 3)]
    reference = _tokens(make_llm(kimi_ckpt, max_num_seqs=2).generate(_inputs(), params))
    round_lengths.clear()
    llm = make_llm(kimi_ckpt, max_num_seqs=2, num_scheduler_steps=4, async_scheduling=overlap)
    out = _tokens(llm.generate(_inputs(), params))
    assert out == reference
    assert 4 in round_lengths and 1 in round_lengths


def test_seeded_sampling_with_penalties_and_logprobs(ckpt, make_llm, overlap):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=15, presence_penalty=0.5,
                             repetition_penalty=1.2, logprobs=2, ignore_eos=True) for i in range(len(PROMPTS))]
    ref = make_llm(ckpt).generate(_inputs(), params)
    out = make_llm(ckpt, num_scheduler_steps=5, async_scheduling=overlap).generate(_inputs(), params)
    assert _tokens(out) == _tokens(ref)
    for a, b in zip(out, ref):
        assert len(a.outputs[0].logprobs) == 15
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-5 for t in la)


def test_stop_token_inside_a_round_cuts_where_single_steps_cut(ckpt, make_llm, overlap):
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free_run = _tokens(make_llm(ckpt).generate(_inputs(), greedy))
    # each request stops at its own 6th token (first occurrence), inside a round of 4
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[toks[5]])
              for toks in free_run]
    reference = make_llm(ckpt).generate(_inputs(), params)
    out = make_llm(ckpt, num_scheduler_steps=4, async_scheduling=overlap).generate(_inputs(), params)
    assert _tokens(out) == _tokens(reference)
    assert [o.outputs[0].finish_reason for o in out] == [o.outputs[0].finish_reason for o in reference]
    assert all(len(t) <= 6 for t in _tokens(out))


def test_stop_string_and_max_model_len(kimi_ckpt, make_llm, overlap):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = make_llm(kimi_ckpt, max_model_len=48)
    texts = [o.outputs[0].text for o in llm.generate(_inputs(), greedy)]
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]  # a string from the middle of each output
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[s]) if s else greedy
              for s in stops]
    reference = llm.generate(_inputs(), params)
    out = make_llm(kimi_ckpt, max_model_len=48, num_scheduler_steps=6, async_scheduling=overlap).generate(_inputs(),
                                                                                                 params)
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in reference]
    assert _tokens(out) == _tokens(reference)
    assert [o.outputs[0].finish_reason for o in out] == [o.outputs[0].finish_reason for o in reference]


def test_no_room_for_a_round_falls_back_to_single_steps(ckpt, make_llm, round_lengths, overlap):
    """16 blocks of 4 tokens for 6 requests: rounds only when their blocks are free; preemptions
    still happen (the single steps) and the tokens stay the same."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = _tokens(make_llm(ckpt).generate(_inputs(), greedy))
    round_lengths.clear()
    llm = make_llm(ckpt, block_size=4, num_gpu_blocks=16, max_model_len=64, num_scheduler_steps=4,
                   async_scheduling=overlap)
    assert _tokens(llm.generate(_inputs(), greedy)) == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_bad_combinations_are_refused(kimi_ckpt):
    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1"):
        EngineConfig(model=kimi_ckpt, num_scheduler_steps=0)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model=kimi_ckpt, num_scheduler_steps=4,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="P/D"):
        EngineConfig(model=kimi_ckpt, num_scheduler_steps=4, kv_transfer_config={"kv_connector": "mooncake",
                                                                                  "kv_role": "kv_producer"})
    assert EngineConfig(model=kimi_ckpt, num_scheduler_steps=4, async_scheduling=True).async_scheduling


def test_streaming_through_async_engine(kimi_ckpt, make_llm, overlap):
    """AsyncEngine streams a round's tokens together; concatenated, they are the single-step tokens."""
    import asyncio

    from atom import AsyncEngine

    greedy = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    reference = _tokens(make_llm(kimi_ckpt).generate(_inputs(), greedy))

    async def stream_all() -> tuple[list[list[int]], int]:
        async with AsyncEngine.from_config(model=kimi_ckpt, dtype="float32", num_scheduler_steps=4,
                                           async_scheduling=overlap) as engine:
            async def one(prompt) -> list[list[int]]:
                return [out.new_token_ids async for out in engine.generate(prompt, greedy)]

            chunks = await asyncio.gather(*(one(p) for p in _inputs()))
            assert engine.all_resources_free()
            return chunks

    chunks = asyncio.run(asyncio.wait_for(stream_all(), timeout=120))
    assert [[t for c in per_request for t in c] for per_request in chunks] == reference
    assert max(len(c) for per_request in chunks for c in per_request) == 4  # a round arrives as one chunk


def test_abandoned_streams_mid_round_free_everything(kimi_ckpt, make_llm, overlap):
    """Clients that stop reading after their first chunk abort their requests while rounds are in
    flight (with overlap, also while the next round is already queued); the others still get the
    single-step tokens, and every block and slot is free at the end."""
    import asyncio

    from atom import AsyncEngine
    from tests.streams import stream_and_walk_away

    greedy = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    reference = _tokens(make_llm(kimi_ckpt).generate(_inputs(), greedy))

    async def run() -> list[list[int] | None]:
        async with AsyncEngine.from_config(model=kimi_ckpt, dtype="float32", num_scheduler_steps=4,
                                           async_scheduling=overlap) as engine:
            return await stream_and_walk_away(engine, _inputs(), greedy,
                                              lambda i, tokens: i % 2 == 0 and len(tokens) > 1)

    got = asyncio.run(asyncio.wait_for(run(), timeout=120))
    for i, tokens in enumerate(got):
        assert (tokens is None) == (i % 2 == 0)
        if tokens is not None:
            assert tokens == reference[i]
