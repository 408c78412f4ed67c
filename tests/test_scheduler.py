"""The scheduler and cache manager on their own: real classes, no model."""

from __future__ import annotations

from atom.config import EngineConfig
from atom.engine.kv_cache_manager import KVCacheManager
from atom.engine.request import Request, RequestStatus
from atom.engine.scheduler import Scheduler
from atom.engine.scheduler_output import RunnerOutput
from atom.sampling_params import SamplingParams

HF = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256, "vocab_size": 100}


def _make(num_blocks=64, block_size=4, states=0, prefix=True, **kw):
    config = EngineConfig(model="unused", hf_config=HF, block_size=block_size, **kw)
    kv = KVCacheManager(num_blocks, block_size, num_state_groups=states, enable_prefix_caching=prefix)
    return Scheduler(config, kv), kv


def _req(i, n, max_tokens=4):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(f"r{i}", list(range(1, n + 1)), params)


def _fake_step(sched):
    out = sched.schedule()
    result = RunnerOutput(sampled={s.request_id: [7] for s in out.scheduled if s.sample})
    sched.update(out, result)
    return out


def test_budget_and_chunking_mix_prefill_with_decode():
    sched, _ = _make(max_num_batched_tokens=8)
    sched.add_request(_req(0, 3))
    first = _fake_step(sched)
    assert [len(s.token_ids) for s in first.scheduled] == [3]
    sched.add_request(_req(1, 20))
    step = _fake_step(sched)
    # the decode of r0 (1 token) and a 7-token chunk of r1 share one step
    assert [(s.request_id, len(s.token_ids), s.sample) for s in step.scheduled] == [("r0", 1, True), ("r1", 7, False)]
    assert step.num_scheduled_tokens <= 8


def test_max_num_seqs_caps_running():
    sched, _ = _make(max_num_seqs=2)
    for i in range(4):
        sched.add_request(_req(i, 2))
    out = _fake_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preemption_frees_and_recomputes():
    sched, kv = _make(num_blocks=4, block_size=4, max_model_len=16)
    sched.add_request(_req(0, 7, max_tokens=8))
    sched.add_request(_req(1, 7, max_tokens=8))
    for _ in range(40):
        if not sched.num_unfinished:
            break
        _fake_step(sched)
    assert sched.num_preemptions >= 1
    assert sched.num_unfinished == 0 and kv.all_free()


def test_state_slots_are_taken_and_returned():
    sched, kv = _make(states=2)
    for i in range(3):
        sched.add_request(_req(i, 5))
    out = _fake_step(sched)
    assert len(out.scheduled) == 2  # only two state groups
    assert sorted(s.state_slot for s in out.scheduled) == [0, 1]
    sched.finish_request("r0", RequestStatus.FINISHED_ABORTED)
    assert kv.states.num_free == 1
    while sched.num_unfinished:
        _fake_step(sched)
    assert kv.all_free()


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    sched, kv = _make(block_size=4)
    sched.add_request(_req(0, 8))
    while sched.num_unfinished:
        _fake_step(sched)
    sched.add_request(_req(1, 8))
    out = sched.schedule()
    # 8 prompt tokens = 2 full blocks, but one token must be computed: 1 block hit
    assert out.scheduled[0].context_len == 4 and len(out.scheduled[0].token_ids) == 4
    sched.finish_request("r1", RequestStatus.FINISHED_ABORTED)
    assert kv.all_free()


def test_each_full_block_is_offered_to_the_prefix_cache_once():
    """A block's hash is registered when the block fills, not again on each later step (that cost grew with
    the context); blocks filled while decoding are found by a later request; a preempted request offers its
    new blocks afresh."""
    sched, kv = _make(block_size=4)
    offered, register = [], kv.blocks.register
    kv.blocks.register = lambda block, block_hash: (offered.append(block), register(block, block_hash))[-1]
    first = _req(0, 6, max_tokens=11)  # 17 tokens, 16 of them computed: 4 full blocks, 2 filled while decoding
    sched.add_request(first)
    while sched.num_unfinished:
        _fake_step(sched)
    assert len(offered) == 4 and len(set(offered)) == 4
    second = Request("r1", first.all_token_ids, first.sampling_params)
    sched.add_request(second)
    out = sched.schedule()
    assert out.scheduled[0].context_len == 16 and out.scheduled[0].block_ids[:4] == offered
    sched.finish_request("r1", RequestStatus.FINISHED_ABORTED)
    assert kv.all_free()

    sched, kv = _make(num_blocks=4, block_size=4, max_model_len=16)
    requests = [_req(0, 7, max_tokens=8), _req(1, 7, max_tokens=8)]
    for request in requests:
        sched.add_request(request)
    preempted = []
    while sched.num_unfinished:
        _fake_step(sched)
        preempted += [r for r in requests if r.status == RequestStatus.PREEMPTED and r not in preempted]
        for r in preempted:
            if r.status == RequestStatus.PREEMPTED:
                assert r.num_offered_blocks == 0 and r.block_ids == []
    assert preempted and kv.all_free()


def test_abort_while_waiting_and_running():
    sched, kv = _make()
    sched.add_request(_req(0, 5))
    sched.add_request(_req(1, 5))
    _fake_step(sched)
    sched.add_request(_req(2, 5))
    for rid in ("r0", "r2", "r1"):
        assert sched.finish_request(rid, RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert sched.finish_request("r0", RequestStatus.FINISHED_ABORTED) is None
    assert kv.all_free() and not sched.running and not sched.waiting


def _overlapped(sched, rounds=40):
    """Run the scheduler as async scheduling does: step N+1 is planned before step N's tokens
    are applied. Returns each planned step's (request id, token count) rows."""
    steps, inflight = [], None
    for _ in range(rounds):
        if inflight is None and not sched.num_unfinished:
            break
        nxt = None
        if sched.num_unfinished:
            nxt = sched.schedule()
            steps.append([(s.request_id, len(s.token_ids)) for s in nxt.scheduled])
        if inflight is not None:
            sched.update(inflight, RunnerOutput(sampled={s.request_id: [7] for s in inflight.scheduled if s.sample}))
        inflight = nxt
    return steps


def test_overlap_plans_no_step_past_the_last_token():
    """With a step in flight, a request whose in-flight token is its last (max_tokens, or
    max_model_len) is not planned again: that step's token would only be thrown away."""
    sched, kv = _make(max_model_len=12)
    requests = [_req(0, 5, max_tokens=1), _req(1, 5, max_tokens=3), _req(2, 9, max_tokens=10)]
    for request in requests:  # r0 finishes with the prefill's token; max_model_len stops r2 after 3
        sched.add_request(request)
    steps = _overlapped(sched)
    rows = {r.request_id: [n for step in steps for rid, n in step if rid == r.request_id] for r in requests}
    assert rows == {"r0": [5], "r1": [5, 1, 1], "r2": [9, 1, 1]}
    assert [(r.num_output_tokens, r.status) for r in requests] == [(1, RequestStatus.FINISHED_LENGTH),
                                                                   (3, RequestStatus.FINISHED_LENGTH),
                                                                   (3, RequestStatus.FINISHED_LENGTH)]
    assert not sched.num_unfinished and kv.all_free()
