import math

import numpy as np
import pytest
import torch

from atom.sampling_params import SamplingParams
from atom.worker.sampler import (
    Sampler,
    SamplingBatch,
    SeedStream,
    apply_penalties,
    compute_prompt_logprobs,
    exponential_draws,
)


def make_batch(params, streams=None, prompts=None, outputs=None):
    n = len(params)
    return SamplingBatch.from_params(
        params,
        streams if streams is not None else [None] * n,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
    )


def seeded(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- params


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 2},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"max_tokens": 0},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.5},
        {"repetition_penalty": 0.0},
        {"temperature": float("nan")},
        {"repetition_penalty": float("nan")},
        # float32 would hold these as inf or 0: NaN probabilities (token 0) at the sampler
        {"temperature": float("inf")},
        {"temperature": 1e308},
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 1e300},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
        {"seed": 1.5},
        {"logprobs": -1},
        {"prompt_logprobs": -1},
    ],
)
def test_invalid_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_seeds_at_the_ends_of_the_64_bit_range_are_taken():
    for seed in (-(2**63), 2**63 - 1):
        assert SamplingParams(seed=seed).seed == seed
        stream = SeedStream(seed)  # what the runner does with it
        assert 0 <= stream.state < 2**64 and stream.take(3) == [1, 2, 3] and stream.take(1) == [(1 << 16) + 1]


def test_n_error_names_the_field():
    with pytest.raises(ValueError, match="n=1"):
        SamplingParams(n=3)


def test_params_normalisation_and_greedy():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams().greedy and not SamplingParams(temperature=1e-5).greedy


# ---------------------------------------------------------------- filtering


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=seeded(0))
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0)] * 6))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs == [None] * 6


def test_top_k_one_equals_greedy_in_mixed_batch():
    logits = torch.randn(4, 50, generator=seeded(1))
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_k=1, temperature=2.0),
              SamplingParams(temperature=0)]
    batch = make_batch(params)
    assert not batch.all_greedy
    out = Sampler()(logits, batch)
    for row in (0, 2, 3):
        assert out.sampled_token_ids[row] == logits[row].argmax()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])  # fmt: skip
@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-45])
def test_tiny_temperatures_sample_greedily_in_a_mixed_batch(temperature, device):
    """Below 1e-5 a row samples greedily. At 1e-40, logits / temperature overflowed to inf and the row's token
    came out of NaN probabilities: token 0, every time. (On a GPU: the fused sampling kernel.)"""
    logits = (torch.randn(3, 50, generator=seeded(2)) * 4).to(device)
    params = [SamplingParams(temperature=temperature, seed=1), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=temperature, min_p=0.1)]
    batch = SamplingBatch.from_params(params, [SeedStream(1), None, None], [[]] * 3,
                                      [[]] * 3, device=device)  # fmt: skip
    assert not batch.all_greedy
    out = Sampler()(logits, batch)
    for row in (0, 2):
        assert out.sampled_token_ids[row] == logits[row].argmax()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])  # fmt: skip
@pytest.mark.parametrize("top_p", [1e-30, 1e-300])
def test_a_top_p_that_float32_holds_as_0_keeps_the_top_token(top_p, device):
    """1e-300 reaches the sampler as 0.0: the nucleus test dropped every token, the top one too, and the row's
    token came out of NaN probabilities (token 0). (On a GPU: the fused sampling kernel.)"""
    logits = (torch.randn(4, 50, generator=seeded(4)) * 3).to(device)
    params = [SamplingParams(top_p=top_p, temperature=1.2, seed=1), SamplingParams(temperature=0.9),
              SamplingParams(top_p=top_p, temperature=0.7, top_k=9), SamplingParams(top_p=top_p, min_p=0.2)]
    batch = SamplingBatch.from_params(params, [None] * 4, [[]] * 4, [[]] * 4, device=device)
    for _ in range(5):
        out = Sampler()(logits, batch).sampled_token_ids
        assert all(out[row] == logits[row].argmax() for row in (0, 2, 3)), out


def test_extreme_float_parameters_that_fit_float32_still_sample():
    """The edges of the accepted ranges: every token a real one, greedy where the parameters leave one choice."""
    logits = torch.randn(4, 40, generator=seeded(5)) * 3
    params = [SamplingParams(temperature=3e38), SamplingParams(temperature=1e-5, repetition_penalty=1e-6),
              SamplingParams(temperature=0.5, repetition_penalty=1e6), SamplingParams(temperature=1e-5, top_k=3)]
    outputs = [[], [7], [int(logits[2].argmax())], []]
    batch = SamplingBatch.from_params(params, [None] * 4, [[]] * 4, outputs)
    for _ in range(10):
        out = Sampler()(logits, batch).sampled_token_ids.tolist()
        assert out[1] == 7 or logits[1, 7] <= 0  # a seen token with a positive logit, divided by 1e-6, wins
        assert out[2] != int(logits[2].argmax())  # the top token, seen, multiplied down by 1e6 (or divided)
        assert out[3] == int(logits[3].argmax())
        assert all(0 <= t < 40 for t in out)


def test_tiny_top_p_keeps_only_the_max():
    logits = torch.randn(8, 100, generator=seeded(2))
    batch = make_batch([SamplingParams(top_p=1e-6, temperature=1.5)] * 8)
    for _ in range(20):
        assert torch.equal(Sampler()(logits, batch).sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])  # fmt: skip
def test_sample_residual_leaves_the_draft_out_and_gives_its_probability(device):
    """Per row with a draft (the verification of speculative drafts): the draft's probability under the row's
    filtered distribution, and a token from the rest. Where the draft is the only token kept, the draft; a
    greedy row gives its argmax and 1 or 0; with no draft (-1) the row samples as sample_tokens does."""
    from atom.ops.cuda import sample_residual, sample_tokens
    from atom.ops.sampling import filtered_probs

    vocab = 40
    logits = (torch.randn(1, vocab, generator=seeded(6)) * 2).expand(7, -1).contiguous().to(device)
    ranked = logits[0].argsort(descending=True).tolist()
    top, second, last = ranked[0], ranked[1], ranked[-1]
    temperature = torch.tensor([1.0, 1.0, 0.8, 1.0, 0.0, 0.0, 1.3], device=device)
    top_k = torch.tensor([0, 0, 3, 0, 0, 0, 0], device=device)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1e-9, 1.0, 1.0, 0.9], device=device)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05], device=device)
    # a likely draft, an unlikely one, one top-k filters out, the only token kept, greedy hit and miss, none
    drafts = torch.tensor([top, second, last, top, top, second, -1], device=device)
    params = (temperature, top_k, top_p, min_p)
    probs = filtered_probs(logits, *params)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    expected = [probs[0, top], probs[1, second], 0.0, 1.0, 1.0, 0.0, 0.0]
    kept = [None, None, set(ranked[:3]) - {last}, None, None, None, None]
    seen = [set() for _ in range(7)]
    for trial in range(200):
        draws = exponential_draws(logits.shape, device, [SeedStream(trial)] * 7)
        tokens, draft_probs = sample_residual(logits, draws, *params, drafts)
        torch.testing.assert_close(draft_probs.cpu(), torch.tensor(expected), rtol=1e-5, atol=1e-7)
        tokens = tokens.tolist()
        for row in (0, 1, 2, 6):
            assert tokens[row] != drafts[row] and probs[row, tokens[row]] > 0, (row, tokens[row])
            seen[row].add(tokens[row])
        assert tokens[3] == top and tokens[4] == top and tokens[5] == top
        assert tokens[6] == sample_tokens(logits, draws, *params)[6]
    assert all(len(seen[row]) > 3 for row in (0, 1, 6)) and seen[2] == kept[2]


def test_top_k_restricts_to_k_largest():
    logits = torch.randn(1, 30, generator=seeded(3))
    allowed = set(logits[0].topk(3).indices.tolist())
    batch = make_batch([SamplingParams(top_k=3, temperature=5.0)] * 64)
    tokens = Sampler()(logits.expand(64, -1), batch).sampled_token_ids.tolist()
    assert set(tokens) <= allowed and len(set(tokens)) > 1


def test_min_p_filters_low_probability_tokens():
    # probs ~ [0.5, 0.3, 0.15, 0.05]; min_p=0.35 -> threshold 0.175 keeps tokens 0 and 1.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(400, -1)
    batch = make_batch([SamplingParams(min_p=0.35)] * 400)
    tokens = set(Sampler()(logits, batch).sampled_token_ids.tolist())
    assert tokens == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs [0.5, 0.3, 0.15, 0.05]; top_p=0.8 -> {0, 1} (0.5 + 0.3 reaches 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(400, -1)
    batch = make_batch([SamplingParams(top_p=0.8)] * 400)
    assert set(Sampler()(logits, batch).sampled_token_ids.tolist()) == {0, 1}


def test_sample_tokens_rejects_mismatched_shapes():
    from atom.ops.cuda import sample_tokens

    logits = torch.randn(3, 10)
    params = [torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3)]
    with pytest.raises(ValueError, match=r"draws must be \(3, 10\)"):
        sample_tokens(logits, torch.ones(3, 9), *params)
    with pytest.raises(ValueError, match=r"parameters \[3\]"):
        sample_tokens(logits, torch.ones(3, 10), params[0][:2], *params[1:])
    tokens = sample_tokens(logits, torch.ones(3, 10), *params)  # temperature 1, no filters, equal draws: argmax
    assert torch.equal(tokens, logits.argmax(-1))


# ---------------------------------------------------------------- penalties


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = make_batch([params], prompts=[[0]], outputs=[[1, 2, 2]])
    # repetition (seen 0, 1, 2): [1.0, -2.0, 0.25, 3.0]
    # frequency (counts 1:1, 2:2): [1.0, -2.5, -0.75, 3.0]
    # presence (1, 2 present):     [1.0, -2.75, -1.0, 3.0]
    expected = torch.tensor([[1.0, -2.75, -1.0, 3.0]])
    assert torch.allclose(apply_penalties(logits, batch), expected)


def test_frequency_and_presence_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    batch = make_batch([params], prompts=[[0, 0, 1]], outputs=[[3]])
    assert torch.equal(apply_penalties(logits, batch), torch.tensor([[0.0, 0.0, 0.0, -2.0]]))


def test_penalties_change_greedy_choice_and_rows_stay_independent():
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=0, presence_penalty=2.0), SamplingParams(temperature=0)]
    batch = make_batch(params, outputs=[[0], [0]])
    assert Sampler()(logits, batch).sampled_token_ids.tolist() == [1, 0]


def test_penalties_over_a_batch_of_mixed_rows_match_each_row_alone():
    """Rows of every kind side by side (prompts as lists and as int64 arrays, long and empty, rows with only a
    repetition penalty, only frequency / presence, none): each row's penalised logits are those of its batch of
    one, and a row without penalties keeps its logits exactly."""
    gen = seeded(8)
    vocab = 50
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(frequency_penalty=0.4, presence_penalty=0.3),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5),
              SamplingParams(presence_penalty=1.1)]  # fmt: skip
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (300, 0, 40, 7, 1)]
    prompts = [np.asarray(p, np.int64) if i % 2 else p for i, p in enumerate(prompts)]
    outputs = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (0, 25, 9, 3, 60)]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    together = apply_penalties(logits, make_batch(params, prompts=prompts, outputs=outputs))
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        alone = apply_penalties(logits[row : row + 1], make_batch([p], prompts=[list(prompt)], outputs=[output]))
        assert torch.equal(together[row], alone[0]), row
        seen = set(list(prompt) if p.repetition_penalty != 1 else []) | set(output if p.has_penalties else [])
        changed = set((together[row] != logits[row]).nonzero().flatten().tolist())
        assert changed <= seen and (changed or not p.has_penalties), row


def test_a_requests_token_array_follows_its_token_lists():
    """Prompt and outputs as one array (what the penalties count, what the n-gram drafter searches): the runner
    converts only the tokens appended since the last call; arrays handed out before stay as they were while the
    list grows past the buffer."""
    from atom.worker.model_runner import CachedRequestState

    state = CachedRequestState([1, 2], SamplingParams(), None, [4, 5])
    handed = []
    for step in range(60):
        state.output_token_ids.extend(range(step % 7))
        got = state.token_array()
        assert got.dtype == np.int64 and got.tolist() == [1, 2, *state.output_token_ids]
        handed.append((got, [1, 2, *state.output_token_ids]))
    assert len(state.output_token_ids) > 128  # grown more than once
    assert all(array.tolist() == tokens for array, tokens in handed)


# ---------------------------------------------------------------- randomness


def _run_seeded_steps(step_logits, rows, make_streams):
    """Sample len(step_logits) steps; return the token of batch row `rows` index 0 each step."""
    sampler, tokens = Sampler(), []
    streams = make_streams()
    for logits in step_logits:
        batch = make_batch(rows, streams=streams)
        tokens.append(sampler(logits, batch).sampled_token_ids.tolist())
    return tokens


def test_keyed_draws_are_splitmix64_and_exponential():
    """A seeded row's draws: element i of the key of (seed state s, counter c) is -log(1 - v), v the top 53 bits
    of SplitMix64's i-th output from mix64(s + c * GAMMA) (computed here with Python ints, exactly), and they are
    Exp(1): mean, variance and a KS test."""
    from scipy.stats import kstest

    from atom.ops.sampling import GAMMA, MASK64, keyed_draws_ref, mix64, seed_state

    seeds = [seed_state(seed) for seed in (0, -(2**63), 2**63 - 1)]
    counters = [1, (5 << 16) + 4, (1 << 56) + 10]
    draws = keyed_draws_ref(torch.full((4, 5000), -1.0), [3, 0, 2], seeds, counters)
    assert (draws[1] == -1).all()  # a row not given stays as it was
    for row, seed, counter in zip((3, 0, 2), seeds, counters):
        key = mix64((seed + counter * GAMMA) & MASK64)
        for i in (0, 1, 4999):
            v = (mix64((key + (i + 1) * GAMMA) & MASK64) >> 11) * 2.0**-53
            assert draws[row, i].item() == np.float32(-math.log1p(-v))
    many = keyed_draws_ref(torch.empty(8, 100_000), range(8), [seed_state(7)] * 8, range(1, 9)).flatten()
    assert abs(many.mean().item() - 1) < 0.01 and abs(many.var().item() - 1) < 0.02
    assert kstest(many[:20000].double().numpy(), "expon").pvalue > 1e-3


def test_seed_stream_draws_follow_seed_and_draw_and_can_be_wound_back():
    """The n-th draw depends on the seed and n only: two streams of one seed agree draw for draw, setting
    ``draws`` back repeats a draw, and other seeds, draws and rows draw otherwise."""
    def draws(stream: SeedStream, rows: int = 3) -> list[tuple[float, ...]]:
        return [tuple(row.tolist()) for row in exponential_draws((rows, 16), "cpu", [stream], [0, rows])]

    a, b = SeedStream(42), SeedStream(42)
    first = draws(a)
    assert draws(b) == first and a.draws == 1
    second = draws(a)
    a.draws = 1
    assert draws(a) == second
    assert len({*first, *second, *draws(SeedStream(43))}) == 9


def test_a_batch_of_repeated_rows_is_the_batch_of_their_params_repeated():
    """``from_params(..., repeats=...)`` (a verification's 1 + k logits rows per request) reads each request's
    parameters once and gives the batch that repeating them row by row gives."""
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=3), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.2, top_k=5, min_p=0.1, presence_penalty=0.5)]  # fmt: skip
    streams, repeats = [SeedStream(3), None, None], [4, 1, 2]
    rows = sum(repeats)
    prompts, outputs = [[1, 2]] * rows, [[3], [3, 4], [5], [], [6], [], [6, 7]]
    got = SamplingBatch.from_params(params, streams, prompts, outputs, repeats=repeats)
    want = SamplingBatch.from_params([p for p, r in zip(params, repeats) for _ in range(r)],
                                     [s for s, r in zip(streams, repeats) for _ in range(r)], prompts, outputs)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):  # fmt: skip
        assert torch.equal(getattr(got, name), getattr(want, name)) and getattr(got, name).shape == (rows,), name
    for name in ("streams", "num_logprobs", "all_greedy", "any_penalties", "any_top_k_top_p", "any_min_p"):
        assert getattr(got, name) == getattr(want, name), name


def test_seeded_sampling_is_independent_of_batch():
    steps, vocab = 40, 64
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    others = [SamplingParams(temperature=1.3), SamplingParams(seed=7, min_p=0.05)]
    g = seeded(99)
    alone_logits = [torch.randn(1, vocab, generator=g) for _ in range(steps)]
    batch_logits = [torch.cat([torch.randn(1, vocab, generator=g), x, torch.randn(1, vocab, generator=g)])
                    for x in alone_logits]

    torch.manual_seed(0)
    alone = _run_seeded_steps(alone_logits, [target], lambda: [SeedStream(1234)])
    torch.manual_seed(1)
    mixed = _run_seeded_steps(batch_logits, [others[0], target, others[1]],
                              lambda: [None, SeedStream(1234), SeedStream(7)])
    assert [t[0] for t in alone] == [t[1] for t in mixed]
    assert len({t[0] for t in alone}) > 5  # actually random, not collapsed to argmax


def test_unseeded_sampling_follows_global_seed():
    logits = torch.randn(16, 64, generator=seeded(5))
    batch = make_batch([SamplingParams()] * 16)
    torch.manual_seed(3)
    a = Sampler()(logits, batch).sampled_token_ids
    torch.manual_seed(3)
    b = Sampler()(logits, batch).sampled_token_ids
    assert torch.equal(a, b)


@pytest.mark.parametrize("filters", [{}, {"top_k": 1 << 30}, {"min_p": 0.05}, {"top_p": 0.9}, {"top_k": 7}])
def test_unused_filters_are_skipped_without_changing_a_token(filters):
    """The sampler skips top-k/top-p (a sort) and min-p when no row asks for them; forcing every stage
    on draws the same tokens, and a top_k past the vocabulary filters nothing."""
    import dataclasses

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(temperature=0.7, seed=i, **(filters if i % 2 else {})) for i in range(6)]
    batch = make_batch(params, [SeedStream(i) for i in range(6)])
    assert batch.any_top_k_top_p == any(k in filters for k in ("top_p", "top_k"))
    assert batch.any_min_p == ("min_p" in filters)
    assert batch.top_k.dtype == torch.int64 and batch.top_k.tolist()[1] == min(filters.get("top_k", 0), 1 << 24)
    every = dataclasses.replace(batch, streams=[SeedStream(i) for i in range(6)], any_top_k_top_p=True,
                                any_min_p=True)  # fmt: skip
    for _ in range(20):
        assert Sampler()(logits, batch).sampled_token_ids.tolist() == \
            Sampler()(logits, every).sampled_token_ids.tolist()  # fmt: skip


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    temperature, rows, steps = 0.7, 2000, 10
    batch = make_batch([SamplingParams(temperature=temperature)] * rows)
    torch.manual_seed(2024)
    counts = torch.zeros(5)
    for _ in range(steps):
        tokens = Sampler()(logits.expand(rows, -1), batch).sampled_token_ids
        counts += torch.bincount(tokens, minlength=5).float()
    expected = torch.softmax(logits / temperature, dim=-1) * rows * steps
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    try:
        from scipy.stats import chi2 as chi2_dist

        assert chi2_dist.sf(chi2, df=4) > 1e-4, chi2
    except ImportError:
        assert chi2 < 30.0, chi2  # df=4: p(chi2 > 30) ~ 5e-6


# ---------------------------------------------------------------- logprobs


def test_logprobs_report_raw_top_n_and_sampled_token():
    logits = torch.tensor([[4.0, 3.0, 2.5, 1.0], [0.0, 1.0, 2.0, 3.0]])
    # Row 0: the penalty makes token 2 the greedy choice, outside the raw top-1.
    params = [SamplingParams(temperature=0, presence_penalty=2.0, logprobs=1),
              SamplingParams(temperature=0)]
    out = Sampler()(logits, make_batch(params, outputs=[[0, 1], []]))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.sampled_token_ids.tolist() == [2, 3]
    assert set(out.logprobs[0]) == {0, 2}
    assert math.isclose(out.logprobs[0][0], raw[0, 0].item(), rel_tol=1e-6)
    assert math.isclose(out.logprobs[0][2], raw[0, 2].item(), rel_tol=1e-6)
    assert out.logprobs[1] is None


def test_logprobs_zero_and_top_n_containing_sampled():
    logits = torch.randn(2, 10, generator=seeded(8))
    params = [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0, logprobs=3)]
    out = Sampler()(logits, make_batch(params))
    raw = torch.log_softmax(logits, dim=-1)
    assert list(out.logprobs[0]) == [int(logits[0].argmax())]
    assert set(out.logprobs[1]) == set(raw[1].topk(3).indices.tolist())
    for token, value in out.logprobs[1].items():
        assert math.isclose(value, raw[1, token].item(), rel_tol=1e-6)


def test_compute_prompt_logprobs():
    logits = torch.randn(3, 12, generator=seeded(9))
    next_ids = torch.tensor([5, 0, 11])
    result = compute_prompt_logprobs(logits, next_ids, num=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(result) == 3
    for i, entry in enumerate(result):
        expected_ids = set(raw[i].topk(2).indices.tolist()) | {int(next_ids[i])}
        assert set(entry) == expected_ids
        for token, value in entry.items():
            assert math.isclose(value, raw[i, token].item(), rel_tol=1e-6)
