"""Speculative decoding: greedy output never changes, every accept/reject path is
exercised deterministically, and rejection sampling keeps the target distribution."""

from __future__ import annotations

import pytest
import torch

from atom import SamplingParams
from atom.config import EngineConfig, SpeculativeConfig
from atom.engine.engine_core import EngineCore
from atom.layers.cache_spec import RecurrentStateSpec
from atom.worker.drafters import Drafter
from atom.worker.sampler import SamplingBatch
from atom.worker.spec_decode import target_probs, verify
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
    assert llm.engine.scheduler.num_draft_tokens > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_llama_greedy_unchanged_by_ngram(llama_ckpt, make_llm, overlap):
    reference = _tokens(make_llm(llama_ckpt).generate(_inputs(), GREEDY))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    llm = make_llm(llama_ckpt, speculative_config=spec, async_scheduling=overlap, max_num_batched_tokens=16)
    assert _tokens(llm.generate(_inputs(), GREEDY)) == reference
    sched = llm.engine.scheduler
    assert sched.num_accepted_tokens > 0  # repetitive prompts give real acceptance


def test_plain_greedy_rows_verify_through_one_lm_head(kimi_mtp_ckpt, make_llm):
    """A step's plain greedy rows with drafts are verified from one lm_head call over all their positions (one
    argmax, one copy to the host); a row with a repetition penalty is verified on its own. The tokens are those
    of plain decoding with the same parameters."""
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
    assert all(lm_heads == (greedy > 0) + (drafted - greedy) for greedy, drafted, lm_heads in calls)
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


# -- rejection sampling keeps the target distribution -----------------------------------

def test_rejection_sampling_matches_target_distribution():
    from scipy.stats import chisquare

    torch.manual_seed(0)
    vocab, k, trials = 6, 2, 12000
    logits = torch.randn(k + 1, vocab) * 1.5
    drafts = [2, 4]  # draft 2 has moderate probability at row 0
    params = SamplingParams(temperature=0.8, top_p=1.0, seed=5)
    batch = SamplingBatch.from_params([params] * (k + 1), [None] * (k + 1), [[0]] * (k + 1),
                                      [[], [drafts[0]], drafts], device="cpu")
    _, probs = target_probs(logits, batch)
    gen = torch.Generator().manual_seed(123)
    first = torch.zeros(vocab)
    second_given_accept = torch.zeros(vocab)
    for _ in range(trials):
        out = verify(logits, batch, drafts, greedy=False, generator=gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second_given_accept[out[1]] += 1
    # the first token is distributed as p_0; given d1 was emitted, the next as p_1
    assert chisquare(first, probs[0] * trials).pvalue > 1e-3
    n = second_given_accept.sum()
    assert n > 500
    assert chisquare(second_given_accept, probs[1] * n).pvalue > 1e-3


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
            assert NgramDrafter(k, min_n, max_n).lookup(tokens) == _most_recent_continuation(tokens, k, min_n, max_n)
