"""Speculative decoding: greedy output never changes, every accept/reject path is
exercised deterministically, and rejection sampling keeps the target distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atom import SamplingParams
from atom.config import EngineConfig, SpeculativeConfig
from atom.engine.engine_core import EngineCore
from atom.layers.cache_spec import RecurrentStateSpec
from atom.worker.drafters import Drafter
from atom.worker.sampler import SamplingBatch, SeedStream, apply_penalties
from atom.worker.spec_decode import accept_greedy, target_probs, verify_rows
from tests import checkpoints

REPETITIVE = [5, 6, 7, 8, 9, 10] * 4
PROMPTS = [[3, 4, 5], REPETITIVE, list(range(20, 45)), [7] * 8, list(range(60, 71))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def kimi_mtp_ckpt(tmp_path_factory) -> str:
    path = checkpoints.make_kimi_checkpoint(str(tmp_path_factory.mktemp("kimi_mtp")), "kda_mla")
    return checkpoints.add_mtp_weights(path)


def _inputs(prompts=PROMPTS):
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def kimi_reference(kimi_mtp_ckpt):
    from atom import LLM

    return _tokens(LLM(kimi_mtp_ckpt, dtype="float32").generate(_inputs(), GREEDY))


@pytest.mark.parametrize("spec", [
    {"method": "mtp", "num_speculative_tokens": 1},
    {"method": "mtp", "num_speculative_tokens": 2},
    {"method": "mtp", "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
])
@pytest.mark.parametrize("overlap,budget", [(False, 4096), (True, 4096), (False, 7), (True, 7)])
def test_kimi_greedy_unchanged_by_speculation(kimi_mtp_ckpt, kimi_reference, make_llm, spec, overlap, budget):
    llm = make_llm(kimi_mtp_ckpt, speculative_config=spec, async_scheduling=overlap, max_num_batched_tokens=budget)
    assert _tokens(llm.generate(_inputs(), GREEDY)) == kimi_reference
    sched = llm.engine.scheduler
    assert sched.num_draft_tokens > 0
    # with overlap, rows are planned while their step before runs, and drafts are verified there too
    assert (sched.num_rows_after_inflight > 0) == overlap
    assert llm.engine.all_resources_free()


def _history_drafted(llm, k: int, runs: list[list[int]]):
    """``llm`` drafting the known runs, with drafts made wrong by each row's own history (batch-independent)."""
    from tests.test_cuda_graph_buffers import ContinuationDrafter

    llm.engine.runner.drafter = ContinuationDrafter(k, runs, by_history=True)
    return llm


@pytest.mark.parametrize("blocks", [None, 6], ids=["roomy", "preempting"])
def test_overlap_verifies_rows_planned_while_the_step_before_ran(kimi_mtp_ckpt, make_llm, blocks):
    """Speculation with overlap: a row's next verification is planned while its step before runs, with its
    input, start and state slot filled in by the runner from that step's accepted count. With drafts accepted
    0 .. k at a time, rows stopping on a token inside an accepted run, at max_tokens, with logprobs, a seeded
    sampled row, and (with few blocks) preemptions: the tokens and logprobs are those of speculation without
    overlap, and the greedy rows' those of plain decoding."""
    k = 2
    want_plain = _tokens(make_llm(kimi_mtp_ckpt).generate(_inputs(), GREEDY))
    runs = [p + t for p, t in zip(PROMPTS, want_plain)]
    params = [GREEDY,
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[want_plain[2][9]], logprobs=2),
              SamplingParams(temperature=0.001, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)]  # fmt: skip
    spec = {"method": "mtp", "num_speculative_tokens": k}
    runs_by = {}
    for overlap in (False, True):
        llm = _history_drafted(make_llm(kimi_mtp_ckpt, speculative_config=spec, async_scheduling=overlap,
                                        num_gpu_blocks=blocks, max_model_len=64), k, runs)  # fmt: skip
        runs_by[overlap] = llm.generate(_inputs(), params)
        sched = llm.engine.scheduler
        assert sched.num_accepted_tokens > 20
        assert (sched.num_rows_after_inflight > 10) == overlap
        assert (sched.num_preemptions > 0) == (blocks is not None)
    sync, chained = runs_by[False], runs_by[True]
    # (a seeded row recomputed after a preemption draws for different steps where it was preempted at a
    # different token: without a preemption its tokens do not depend on the timing)
    compared = [i for i in range(len(params)) if blocks is None or params[i].seed is None]
    assert [_tokens(chained)[i] for i in compared] == [_tokens(sync)[i] for i in compared]
    for i in (0, 1, 4):
        assert _tokens(chained)[i] == want_plain[i][: params[i].max_tokens]
    assert _tokens(chained)[2] == want_plain[2][:10] and chained[2].outputs[0].finish_reason == "stop"
    for g, w in zip(chained, sync):
        for g_entry, w_entry in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert g_entry.keys() == w_entry.keys()
            for token, value in w_entry.items():
                assert g_entry[token] == pytest.approx(value, abs=1e-5)


def test_overlap_runs_rows_to_max_model_len(kimi_mtp_ckpt, make_llm):
    """Rows that end at max_model_len (no max_tokens), with drafts accepted 0 .. k at a time: with overlap no row
    is planned past it (the rows near it wait for their step in flight), and the tokens are plain decoding's."""
    k, limit = 3, 40
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    want = make_llm(kimi_mtp_ckpt, max_model_len=limit).generate(_inputs(), params)
    runs = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, want)]
    spec = {"method": "mtp", "num_speculative_tokens": k}
    llm = _history_drafted(make_llm(kimi_mtp_ckpt, max_model_len=limit, async_scheduling=True,
                                    speculative_config=spec), k, runs)  # fmt: skip
    got = llm.generate(_inputs(), params)
    assert _tokens(got) == _tokens(want)
    assert all(len(p) + len(o.outputs[0].token_ids) == limit and o.outputs[0].finish_reason == "length"
               for p, o in zip(PROMPTS, got))  # fmt: skip
    sched = llm.engine.scheduler
    assert sched.num_rows_after_inflight > 10 and sched.num_accepted_tokens > 20


def test_rows_with_penalties_and_logprobs_match_plain_decoding(kimi_mtp_ckpt, make_llm):
    """Greedy rows with logprobs and penalties verify by verify_rows, with the plain argmax rows beside them: the
    tokens are plain decoding's, and so are the logprobs of each emitted token (from its verification position)."""
    params = [GREEDY,
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1, frequency_penalty=0.6),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.9),
              GREEDY]  # fmt: skip
    want = make_llm(kimi_mtp_ckpt).generate(_inputs(), params)
    runs = [p + t for p, t in zip(PROMPTS, _tokens(want))]
    llm = _history_drafted(make_llm(kimi_mtp_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
                           2, runs)  # fmt: skip
    got = llm.generate(_inputs(), params)
    assert _tokens(got) == _tokens(want)
    assert llm.engine.scheduler.num_accepted_tokens > 20
    for g, w in zip(got, want):
        assert (g.outputs[0].logprobs is None) == (w.outputs[0].logprobs is None)
        for g_entry, w_entry in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert g_entry.keys() == w_entry.keys()
            for token, value in w_entry.items():
                assert g_entry[token] == pytest.approx(value, abs=1e-4)


def test_seeded_sampled_rows_with_drafts_ignore_the_batch(kimi_mtp_ckpt, make_llm):
    """A seeded request that samples gets the same tokens through speculation whether it runs alone or beside
    greedy, unseeded and other seeded requests: its verification draws are keyed by its own seed."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    runs = [p + t for p, t in zip(PROMPTS, _tokens(make_llm(kimi_mtp_ckpt).generate(_inputs(), GREEDY)))]
    # The small random model's top logits are ~0.005 apart: at these temperatures the sampled rows mostly follow
    # the greedy run the drafter proposes, so their drafts are accepted as well as rejected.
    seeded = [SamplingParams(temperature=0.001, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.002, top_k=20, seed=8, max_tokens=20, ignore_eos=True)]  # fmt: skip
    prompts = _inputs()
    alone = []
    for i, p in zip((1, 3), seeded):
        llm = _history_drafted(make_llm(kimi_mtp_ckpt, speculative_config=spec), 2, runs)
        alone.append(_tokens(llm.generate([prompts[i]], [p]))[0])
        assert llm.engine.scheduler.num_accepted_tokens > 0
    mixed = [GREEDY, seeded[0], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), seeded[1], GREEDY]
    llm = _history_drafted(make_llm(kimi_mtp_ckpt, speculative_config=spec), 2, runs)
    together = _tokens(llm.generate(prompts, mixed))
    assert [together[1], together[3]] == alone
    assert llm.engine.scheduler.num_accepted_tokens > 0 and llm.engine.all_resources_free()


@pytest.mark.parametrize("overlap", [False, True])
def test_llama_greedy_unchanged_by_ngram(llama_ckpt, make_llm, overlap):
    reference = _tokens(make_llm(llama_ckpt).generate(_inputs(), GREEDY))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    llm = make_llm(llama_ckpt, speculative_config=spec, async_scheduling=overlap, max_num_batched_tokens=16)
    assert _tokens(llm.generate(_inputs(), GREEDY)) == reference
    sched = llm.engine.scheduler
    assert sched.num_accepted_tokens > 0  # repetitive prompts give real acceptance
    assert (sched.num_rows_after_inflight > 0) == overlap



def test_ngram_rows_with_penalties_and_seeds_same_with_overlap(llama_ckpt, make_llm):
    """N-gram drafting reads each request's history from the array the penalties count too
    (``CachedRequestState.token_array``): greedy rows with penalties give plain decoding's tokens, and seeded
    sampled rows with penalties the same tokens with overlap as without."""
    penalised = dict(max_tokens=24, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.3)
    params = [SamplingParams(temperature=0.0, **penalised), SamplingParams(temperature=0.0, max_tokens=24,
                                                                           ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0.8, seed=3, **penalised), GREEDY,
              SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)]  # fmt: skip
    want = _tokens(make_llm(llama_ckpt).generate(_inputs(), params))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    got = []
    for overlap in (False, True):
        llm = make_llm(llama_ckpt, speculative_config=spec, async_scheduling=overlap)
        got.append(_tokens(llm.generate(_inputs(), params)))
        assert llm.engine.scheduler.num_accepted_tokens > 0 and llm.engine.all_resources_free()
    assert got[0] == got[1]
    assert [got[0][i] for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]  # the greedy rows

def test_plain_greedy_rows_verify_through_one_lm_head(kimi_mtp_ckpt, make_llm):
    """A step's plain greedy rows with drafts are verified from one lm_head call over all their positions (one
    argmax); the rows with a repetition penalty share a second (verify_rows). The tokens are those of plain
    decoding with the same parameters."""
    penalised = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    params = [GREEDY] * (len(PROMPTS) - 1) + [penalised]
    want = _tokens(make_llm(kimi_mtp_ckpt).generate(_inputs(), params))
    llm = make_llm(kimi_mtp_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    runner = llm.engine.runner
    inner_verify, inner_logits = runner._verify, runner.model.compute_logits
    calls, count = [], [0]  # calls: (plain greedy rows with drafts, rows with drafts, lm_head calls) per _verify

    def counted_logits(*args, **kwargs):
        count[0] += 1
        return inner_logits(*args, **kwargs)

    def counted_verify(rows, *rest):
        count[0] = 0
        drafted = [s for s in rows if s.draft_token_ids]
        greedy = sum(runner.requests[s.request_id].plain_greedy for s in drafted)
        inner_verify(rows, *rest)
        calls.append((greedy, len(drafted), count[0]))

    runner.model.compute_logits, runner._verify = counted_logits, counted_verify
    assert _tokens(llm.generate(_inputs(), params)) == want
    assert any(greedy >= 2 for greedy, _, _ in calls)
    assert all(lm_heads == (greedy > 0) + (drafted > greedy) for greedy, drafted, lm_heads in calls)
    assert any(drafted > greedy > 0 for greedy, drafted, _ in calls)  # a step with both kinds of rows


def test_plain_greedy_rows_without_drafts_join_the_verification(llama_ckpt, make_llm):
    """In a step where some plain greedy rows have drafts and others found none (n-gram), all of them get their
    tokens from one lm_head, one argmax and one copy to the host. The tokens are plain decoding's."""
    want = _tokens(make_llm(llama_ckpt).generate(_inputs(), GREEDY))
    llm = make_llm(llama_ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_max": 3})  # fmt: skip
    runner = llm.engine.runner
    inner_execute, inner_logits = runner.execute_model, runner.model.compute_logits
    steps, count = [], [0]  # (lm_head calls, rows without drafts) per step with drafts

    def counted_logits(*args, **kwargs):
        count[0] += 1
        return inner_logits(*args, **kwargs)

    def counted_execute(sched):
        count[0] = 0
        result = inner_execute(sched)
        if any(s.draft_token_ids for s in sched.scheduled):
            steps.append((count[0], sum(s.sample and not s.draft_token_ids for s in sched.scheduled)))
        return result

    runner.model.compute_logits, runner.execute_model = counted_logits, counted_execute
    assert _tokens(llm.generate(_inputs(), GREEDY)) == want
    assert any(undrafted for _, undrafted in steps)  # rows with and without drafts in one step
    assert all(calls == 1 for calls, _ in steps)


def test_mtp_without_weights_is_a_clear_error(llama_ckpt):
    from atom import LLM

    with pytest.raises(ValueError, match="needs MTP weights"):
        LLM(llama_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


# -- a scripted drafter: the reference continuation with chosen errors -----------------

class ScriptedDrafter(Drafter):
    """Proposes the known greedy continuation, corrupting draft index ``wrong`` (None: none)."""

    def __init__(self, k: int, continuation: dict[str, list[int]], wrong: int | None, vocab: int) -> None:
        self.k, self.continuation, self.wrong, self.vocab = k, continuation, wrong, vocab
        self.proposed = 0

    def propose(self, ctx):
        out = {}
        for rid in ctx.emitted:
            pos = len(ctx.token_history[rid])
            drafts = list(self.continuation[rid][pos : pos + self.k])
            if self.wrong is not None and self.wrong < len(drafts):
                drafts[self.wrong] = (drafts[self.wrong] + 1) % self.vocab
            self.proposed += len(drafts)
            out[rid] = drafts
        return out


def _kda_states(core: EngineCore, slot: int) -> list[torch.Tensor]:
    runner = core.runner
    return [t[slot].clone() for layer, spec in runner.cache_specs.items()
            if isinstance(spec, RecurrentStateSpec) for t in runner.caches[layer]]


def _run_recording(core: EngineCore, prompts, params) -> tuple[dict, dict]:
    """Run to completion; record each decoding request's KDA state by token count."""
    for i, p in enumerate(prompts):
        core.add_request(core.make_request({"prompt_token_ids": p}, params, request_id=f"r{i}"))
    states, outputs = {}, {}
    core.verifications = []  # (drafts scheduled, drafts accepted) per verification
    while core.has_unfinished_requests():
        sched = core.schedule()
        result = core.execute(sched)
        for s in sched.scheduled:
            if s.draft_token_ids:
                core.verifications.append((len(s.draft_token_ids), len(result.sampled[s.request_id]) - 1))
        for out in core.update(sched, result):
            outputs[out.request_id] = out.outputs[0].token_ids
        for r in core.scheduler.running:
            if not r.is_prefilling and r.num_pending_tokens == 0:
                states[(r.request_id, r.num_computed_tokens)] = _kda_states(core, r.state_slot + r.state_offset)
    assert core.all_resources_free()
    return outputs, states


@pytest.fixture(scope="module")
def plain_run(kimi_mtp_ckpt):
    core = EngineCore(EngineConfig(model=kimi_mtp_ckpt, dtype="float32"))
    return _run_recording(core, PROMPTS, GREEDY)


@pytest.mark.parametrize("wrong", [None, 0, 1, 2], ids=["accept_all", "reject_first", "reject_middle", "reject_last"])
def test_scripted_drafts_accept_and_reject_exactly(kimi_mtp_ckpt, plain_run, wrong):
    ref_outputs, ref_states = plain_run
    k = 3
    config = EngineConfig(model=kimi_mtp_ckpt, dtype="float32",
                          speculative_config=SpeculativeConfig("mtp", num_speculative_tokens=k))
    core = EngineCore(config)
    continuation = {f"r{i}": p + ref_outputs[f"r{i}"] for i, p in enumerate(PROMPTS)}
    core.runner.drafter = ScriptedDrafter(k, continuation, wrong, config.hf_config["vocab_size"])
    outputs, states = _run_recording(core, PROMPTS, GREEDY)
    assert outputs == ref_outputs
    # drafts before the wrong one are accepted, the wrong one and everything after it are not
    assert core.verifications and any(n > (wrong or 0) for n, _ in core.verifications)
    for n, accepted in core.verifications:
        assert accepted == (n if wrong is None else min(wrong, n))
    # the slot a request resumes from holds exactly the plain run's state for that token count
    assert states
    for key, tensors in states.items():
        for got, want in zip(tensors, ref_states[key]):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("stop_kind", ["stop_token", "eos", "max_tokens", "stop_string"])
def test_stops_inside_accepted_drafts(kimi_mtp_ckpt, plain_run, stop_kind):
    ref_outputs, _ = plain_run
    ref = ref_outputs["r2"]
    k = 3
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    if stop_kind == "stop_token":
        base["stop_token_ids"] = [ref[7]]
    elif stop_kind == "eos":
        base["ignore_eos"] = False
    elif stop_kind == "max_tokens":
        base["max_tokens"] = 6
    params = SamplingParams(**base)

    def run(spec: bool) -> list[int]:
        config = EngineConfig(model=kimi_mtp_ckpt, dtype="float32",
                              speculative_config=SpeculativeConfig("mtp", k) if spec else None)
        core = EngineCore(config)
        prompt = PROMPTS[2]
        if spec:
            core.runner.drafter = ScriptedDrafter(k, {"x": prompt + ref}, None, config.hf_config["vocab_size"])
        p = params
        if stop_kind == "stop_string":
            text = core.tokenizer.decode(ref[:12])
            p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[text[-3:]])
        request = core.make_request({"prompt_token_ids": prompt}, p, request_id="x")
        if stop_kind == "eos":
            request.eos_token_ids = (ref[9],)
        core.add_request(request)
        final = None
        while core.has_unfinished_requests():
            for out in core.step():
                final = out
        assert core.all_resources_free()
        return final.outputs[0].token_ids, final.outputs[0].text, final.outputs[0].finish_reason

    assert run(spec=True) == run(spec=False)


# -- verify_rows: every row of a step at once --------------------------------------------

def _rows_batch(logits_rows: int, params: list[SamplingParams], drafts: list[list[int]],
                outputs: list[list[int]], device: str = "cpu") -> SamplingBatch:  # fmt: skip
    """The per-logits-row batch the runner builds: row i's params, its outputs plus drafts[i][:j] at its j-th."""
    per = [(p, out + d[:j]) for p, d, out in zip(params, drafts, outputs) for j in range(len(d) + 1)]
    assert len(per) == logits_rows
    return SamplingBatch.from_params([p for p, _ in per], [None] * len(per), [[1, 2]] * len(per),
                                     [h for _, h in per], device=device)  # fmt: skip


def _run_of_matches(drafts: list[int], targets: list[int]) -> int:
    return next((j for j, d in enumerate(drafts) if d != targets[j]), len(drafts))


@pytest.mark.parametrize("beside_a_sampled_row", [False, True])
def test_verify_rows_greedy_rows_take_the_penalised_argmax_run(beside_a_sampled_row):
    """Greedy rows (some penalised, one without drafts) accept the drafts that equal the argmax of their penalised
    logits, then emit its token; their targets read back as the same run. Beside a sampled row, they go through
    the sampling kernel's greedy rows (sample_residual) instead of the all-greedy argmax."""
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.7)
    params, drafts, outputs = [], [], []
    for trial in range(40):
        params.append(penalised if trial % 3 == 0 else plain)
        drafts.append(torch.randint(0, vocab, (trial % 4,), generator=gen).tolist())
        outputs.append(torch.randint(0, vocab, (3,), generator=gen).tolist())
    if beside_a_sampled_row:
        params.append(SamplingParams(temperature=0.9))
        drafts.append([1, 2])
        outputs.append([])
    logits = torch.randn(sum(1 + len(d) for d in drafts), vocab, generator=gen) * 2
    for r, d in enumerate(drafts):  # make most drafts the plain argmax, so that runs are long
        first = sum(1 + len(x) for x in drafts[:r])
        for j, token in enumerate(d):
            if (r + j) % 5:
                logits[first + j, token] += 6
    batch = _rows_batch(len(logits), params, drafts, outputs)
    assert batch.all_greedy != beside_a_sampled_row
    verdict = verify_rows(logits, batch, drafts, [None] * len(drafts))
    argmax = apply_penalties(logits, batch).argmax(dim=-1).tolist()
    lengths = [0] * 40
    first = 0
    for r, d in enumerate(drafts[:40]):
        want = accept_greedy(d, argmax[first : first + len(d) + 1])
        first += len(d) + 1
        got = d[: verdict.accepted[r]] + [int(verdict.final[r])]
        assert got == want, r
        targets = verdict.targets[r].tolist()
        assert _run_of_matches(d, targets) == verdict.accepted[r] and targets[int(verdict.accepted[r])] == got[-1]
        lengths[r] = len(got) - 1
    assert len(set(lengths)) == 4  # 0 .. 3 drafts accepted


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=5),
                                    SamplingParams(temperature=1.3, top_p=0.85, top_k=5, min_p=0.05)])
def test_rejection_sampling_matches_target_distribution(params, device):
    """Many rows of the same logits and drafts in one call: the first token is distributed as p_0; given d1, the
    second as p_1; given d1 d2, the bonus token as p_2. Each row's targets read back as its tokens."""
    from scipy.stats import chisquare

    torch.manual_seed(0)
    vocab, k, n = 6, 2, 12000
    logits = torch.tensor([[0.2, 0.6, 1.0, -0.5, 0.1, 0.4], [0.3, -0.2, 0.5, 0.0, 0.9, -1.0],
                           [0.5, 0.1, -0.3, 0.8, 0.2, 0.0]]) * 1.5  # fmt: skip
    drafts = [2, 4]
    one = _rows_batch(k + 1, [params], [drafts], [[0]])
    _, probs = target_probs(logits, one)
    assert 0.2 < probs[0, 2] < 0.8 and 0.2 < probs[1, 4] < 0.8  # both outcomes common
    batch = _rows_batch(n * (k + 1), [params] * n, [drafts] * n, [[0]] * n, device)
    verdict = verify_rows(logits.repeat(n, 1).to(device), batch, [drafts] * n, [None] * n)
    accepted, final = verdict.accepted.tolist(), verdict.final.tolist()
    tokens = [drafts[:a] + [t] for a, t in zip(accepted, final)]
    for got, a, targets in zip(tokens[:500], accepted, verdict.targets.tolist()):
        assert _run_of_matches(drafts, targets) == a and targets[a] == got[-1]
        assert a == k or got[-1] != drafts[a]  # the rejected draft is never the token emitted in its place
    for depth in range(k + 1):
        emitted = torch.zeros(vocab)
        for got in tokens:
            if got[:depth] == drafts[:depth]:
                emitted[got[depth]] += 1
        assert emitted.sum() > 500, depth
        expected = probs[depth] * emitted.sum()
        keep = expected > 0  # filtered-out tokens: never emitted
        assert emitted[~keep].sum() == 0
        assert chisquare(emitted[keep], expected[keep]).pvalue > 1e-3, depth


def test_seeded_rows_verify_the_same_in_any_batch():
    """A seeded row's accepted drafts and token depend only on its seed and logits, not on the rows beside it
    (seeded or not, greedy or not, with more or fewer drafts)."""
    gen = torch.Generator().manual_seed(1)
    vocab = 30
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    row_logits = torch.randn(4, vocab, generator=gen)
    row_drafts = torch.randint(0, vocab, (3,), generator=gen).tolist()

    def run(before: int, after: int) -> list[tuple[int, int]]:
        params, drafts = [], []
        for i in range(before + 1 + after):
            mine = i == before
            params.append(seeded if mine else SamplingParams(temperature=(0.0, 0.7, 1.1)[i % 3],
                                                             seed=100 + i if i % 2 else None))  # fmt: skip
            drafts.append(row_drafts if mine else torch.randint(0, vocab, (i % 4,), generator=gen).tolist())
        logits = torch.cat([row_logits if i == before else torch.randn(1 + len(d), vocab, generator=gen)
                            for i, d in enumerate(drafts)])  # fmt: skip
        streams = [SeedStream(p.seed) if p.seed is not None else None for p in params]
        verdict = verify_rows(logits, _rows_batch(len(logits), params, drafts, [[]] * len(params)), drafts,
                              streams)
        return [(int(verdict.accepted[before]), int(verdict.final[before]))]

    alone = run(0, 0)
    assert all(run(before, after) == alone for before, after in [(3, 0), (0, 5), (4, 2), (7, 7)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
def test_verify_rows_reads_drafts_from_the_device_as_from_the_host(device):
    """Drafts handed over on the device (``proposed``, [n, >= k], junk past a row's own; the host knows only their
    number: rows filled in on the device by the runner's overlap) verify exactly as the same drafts from the host:
    greedy, sampled and seeded rows with 0 .. k drafts."""
    gen = torch.Generator().manual_seed(3)
    vocab, k = 40, 3
    params, drafts = [], []
    for i in range(24):
        params.append(SamplingParams(temperature=(0.0, 0.7, 1.2)[i % 3], top_p=0.9 if i % 4 == 1 else 1.0,
                                     seed=i if i % 2 else None))  # fmt: skip
        drafts.append(torch.randint(0, vocab, (i % (k + 1),), generator=gen).tolist())
    logits = torch.randn(sum(1 + len(d) for d in drafts), vocab, generator=gen).to(device)
    for r, d in enumerate(drafts):  # most drafts likely, so that runs of every length come
        first = sum(1 + len(x) for x in drafts[:r])
        for j, token in enumerate(d):
            logits[first + j, token] += 10.0 if (r + j) % 5 else 0.0
    batch = _rows_batch(len(logits), params, drafts, [[]] * len(params), device)
    proposed = torch.randint(0, vocab, (len(drafts), k + 2), generator=gen)
    for r, d in enumerate(drafts):
        proposed[r, : len(d)] = torch.tensor(d, dtype=torch.long)
    verdicts = []
    for on_device in (False, True):
        streams = [SeedStream(p.seed) if p.seed is not None else None for p in params]
        torch.manual_seed(9)  # the unseeded rows' draws
        verdicts.append(verify_rows(logits, batch, [[0] * len(d) for d in drafts] if on_device else drafts,
                                    streams, proposed.to(device) if on_device else None))  # fmt: skip
    host, dev = verdicts
    for field in ("accepted", "final", "targets"):
        assert torch.equal(getattr(host, field), getattr(dev, field)), field
    assert len(set(host.accepted.tolist())) == k + 1  # 0 .. k drafts accepted


def test_speculation_metrics_reach_outputs(llama_ckpt, make_llm):
    llm = make_llm(llama_ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = llm.generate(_inputs([REPETITIVE]), GREEDY)[0]
    assert out.metrics["num_draft_tokens"] > 0
    assert 0 < out.metrics["num_accepted_tokens"] <= out.metrics["num_draft_tokens"]


def _most_recent_continuation(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by its definition: for n from max_n down to min_n, the latest earlier occurrence of the last
    n tokens that has a token after it; the (up to) k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


def test_ngram_lookup_finds_the_most_recent_longest_match():
    from atom.worker.drafters.ngram import NgramDrafter

    assert NgramDrafter(3, 1, 3).lookup([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2]
    assert NgramDrafter(3, 1, 3).lookup([4, 2, 3, 8, 5, 2, 3, 7, 2, 3]) == [7, 2, 3]  # the latest of two matches
    assert NgramDrafter(2, 2, 3).lookup([5, 6, 7, 5, 6]) == [7, 5]  # n = 2: the 3-gram never occurred before
    assert NgramDrafter(2, 2, 2).lookup([5, 6, 7, 8]) == []
    gen = torch.Generator().manual_seed(0)
    for trial in range(2000):
        vocab = (2, 3, 5, 40)[trial % 4]
        tokens = torch.randint(0, vocab, (int(torch.randint(1, 80, (), generator=gen)),), generator=gen).tolist()
        for k, min_n, max_n in ((3, 1, 3), (4, 2, 4), (1, 1, 1), (2, 3, 5)):
            want = _most_recent_continuation(tokens, k, min_n, max_n)
            drafter = NgramDrafter(k, min_n, max_n)
            assert drafter.lookup(tokens) == want and drafter.lookup(np.asarray(tokens, np.int64)) == want


@pytest.mark.parametrize("lookup", [{"prompt_lookup_min": 0}, {"prompt_lookup_min": 3, "prompt_lookup_max": 2}])
def test_ngram_lookup_lengths_are_checked(lookup):
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, **lookup)
