"""The fused sampling kernel (``csrc/sampling.cu``) against its torch reference (``atom.ops.sampling``).

GPU tests (skipped without CUDA and a built ``atom._C``). Both sides get the
same logits and the same Exp(1) draws, so they must pick the same token in
every row: the kernel's sums are exact integers where the reference's are
float, and they can differ only where a top-p boundary or the race's top two
sit within rounding of each other, which random inputs of these sizes do not
hit. Rows mix greedy and sampled, every filter on and off, filters at their
edges (top_k 1, V - 1, V, above V; top_p tiny and near 1; min_p 1), and
logits rounded to bf16 (many equal values, which the index order breaks).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from atom.ops._C_loader import get_C
from atom.ops.cuda import keyed_draws_, sample_residual, sample_tokens
from atom.ops.sampling import keyed_draws_ref, sample_ref, sample_residual_ref, seed_state
from atom.sampling_params import SamplingParams
from atom.worker.sampler import Sampler, SamplingBatch, SeedStream, exponential_draws

HAS_KERNELS = torch.cuda.is_available() and get_C() is not None and hasattr(get_C(), "sample_tokens")
pytestmark = pytest.mark.skipif(not HAS_KERNELS, reason="needs a CUDA GPU and a built atom._C with sample_tokens")

TEMPERATURES = [0.0, 0.3, 0.8, 1.0, 1.7]
TOP_P = [1.0, 0.95, 0.5, 0.01, 0.9999]
MIN_P = [0.0, 0.0, 0.05, 0.5, 1.0]


def _top_ks(vocab: int) -> list[int]:
    return [0, -1, 1, 2, 50, vocab - 1, vocab, vocab + 5]


def _params(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Per-row parameters cycling through every combination's values, offset per seed."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda values: [values[i] for i in torch.randint(len(values), (rows,), generator=g).tolist()]  # noqa: E731
    temperature = torch.tensor(pick(TEMPERATURES))
    top_k = torch.tensor(pick(_top_ks(vocab)), dtype=torch.int64)
    top_p = torch.tensor(pick(TOP_P))
    min_p = torch.tensor(pick(MIN_P))
    return temperature, top_k, top_p, min_p


def _logits(rows: int, vocab: int, scale: float, bf16: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    return x.bfloat16().float() if bf16 else x


def _compare(logits: torch.Tensor, temperature, top_k, top_p, min_p, draws=None) -> torch.Tensor:
    cuda = [t.cuda() for t in (logits, temperature, top_k, top_p, min_p)]
    if draws is None:
        draws = exponential_draws(logits.shape, "cuda", [SeedStream(r) for r in range(len(logits))])
    draws = draws.cuda()
    tokens = sample_tokens(cuda[0], draws, *cuda[1:])
    expected = sample_ref(cuda[0], draws, *cuda[1:])
    assert tokens.dtype == torch.int64 and tokens.shape == (logits.shape[0],)
    mismatched = (tokens != expected).nonzero().flatten().tolist()
    assert not mismatched, [(r, tokens[r].item(), expected[r].item(), temperature[r].item(), top_k[r].item(),
                             top_p[r].item(), min_p[r].item()) for r in mismatched]  # fmt: skip
    return tokens


@pytest.mark.parametrize("vocab", [1, 7, 1000, 32000, 50257, 163840])
@pytest.mark.parametrize("scale,bf16", [(1.0, False), (4.0, False), (4.0, True), (20.0, True)])
def test_sample_tokens_matches_reference(vocab, scale, bf16):
    for seed, rows in ((0, 1), (1, 5), (2, 64)):
        _compare(_logits(rows, vocab, scale, bf16, seed), *_params(rows, vocab, seed))


def test_sample_tokens_every_parameter_combination():
    """All 5 x 8 x 5 x 5 combinations, one row each, over one vocabulary."""
    vocab = 4099
    combos = list(itertools.product(TEMPERATURES, _top_ks(vocab), TOP_P, MIN_P))
    temperature, top_k, top_p, min_p = (torch.tensor(c) for c in zip(*combos))
    logits = _logits(len(combos), vocab, 3.0, True, 7)
    _compare(logits, temperature.float(), top_k.long(), top_p.float(), min_p.float())


def test_sample_tokens_filters_keep_what_the_reference_keeps():
    """Draws that make the race pick the least likely token still kept (draw = w^1.5, so the race's
    w / draw falls as w rises): a kept set one token too large or too small picks another token."""
    vocab, rows = 5000, 48
    logits = _logits(rows, vocab, 2.0, False, 11).cuda()
    for seed in range(3):
        temperature, top_k, top_p, min_p = (t.cuda() for t in _params(rows, vocab, 20 + seed))
        temperature, top_k = temperature.clamp_min(0.5), torch.where(top_k == 1, 0, top_k)  # no greedy rows
        top_p = torch.rand(rows, device="cuda") * 0.99 + 0.01
        scaled = logits / temperature.unsqueeze(1)
        draws = torch.exp(scaled - scaled.amax(dim=1, keepdim=True)) ** 1.5
        tokens = sample_tokens(logits, draws, temperature, top_k, top_p, min_p)
        assert torch.equal(tokens, sample_ref(logits, draws, temperature, top_k, top_p, min_p))
        # the race did go down the list (rows with top_p or min_p small keep the top token alone)
        assert (tokens != logits.argmax(dim=1)).sum() >= rows // 4


def test_sample_tokens_when_the_boundary_bucket_overflows_shared_memory():
    """Most of the vocabulary in one histogram bucket (more tokens than the kernel keeps in shared
    memory, so it reads them from the row): equal logits under top-k (the index order decides), close
    ones under top-p. The draws favour high indices, so the race lands at the end of the kept set."""
    vocab, rows = 50000, 4
    temperature, min_p = torch.tensor([1.0, 0.7, 1.3, 1.0]), torch.zeros(rows)
    draws = (vocab - torch.arange(vocab, dtype=torch.float32)).expand(rows, -1).clone()
    ties = torch.zeros(rows, vocab)
    close = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(0)) * 1e-3
    for logits, top_k, top_p in ((ties, [100, 4000, 30000, vocab - 1], [1.0] * rows),
                                 (close, [0] * rows, [0.5, 0.9, 0.3, 0.99])):  # fmt: skip
        logits[:, 7] = 5.0
        draws[:, 7] = 1e30  # the top token's race is ~0
        tokens = _compare(logits, temperature, torch.tensor(top_k), torch.tensor(top_p), min_p, draws)
        if logits is ties:
            assert tokens.tolist() == [k - 1 for k in top_k]  # kept: 7 and the k - 1 lowest other indices


def test_sample_tokens_is_deterministic_and_leaves_its_inputs():
    vocab, rows = 32000, 64
    logits = _logits(rows, vocab, 4.0, True, 3).cuda()
    params = [t.cuda() for t in _params(rows, vocab, 3)]
    draws = exponential_draws(logits.shape, "cuda", [None] * rows)
    before = logits.clone(), draws.clone()
    first = sample_tokens(logits, draws, *params)
    assert all(torch.equal(sample_tokens(logits, draws, *params), first) for _ in range(5))
    assert torch.equal(logits, before[0]) and torch.equal(draws, before[1])


def test_sample_tokens_on_strided_rows():
    """Logits that are a slice of a wider buffer (row stride > vocab)."""
    vocab, rows = 3001, 9
    wide = _logits(rows, vocab + 37, 3.0, False, 5).cuda()
    logits = wide[:, 5 : 5 + vocab]
    params = [t.cuda() for t in _params(rows, vocab, 5)]
    draws = exponential_draws(logits.shape, "cuda", [None] * rows)
    assert torch.equal(sample_tokens(logits, draws, *params), sample_ref(logits.contiguous(), draws, *params))


def _drafts(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """Per row: none (-1), the argmax, the second token, or a random one (often filtered out)."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = logits.shape
    ranked = logits.topk(min(2, vocab), dim=1).indices.cpu()
    options = torch.stack([torch.full((rows,), -1), ranked[:, 0], ranked[:, -1], torch.randint(vocab, (rows,),
                                                                                              generator=g)], 1)
    return options[torch.arange(rows), torch.randint(4, (rows,), generator=g)].to(logits.device)


@pytest.mark.parametrize("vocab", [1, 7, 1000, 32000, 163840])
@pytest.mark.parametrize("scale,bf16", [(1.0, False), (4.0, True), (20.0, True)])
def test_sample_residual_matches_reference(vocab, scale, bf16):
    """The kernel with a draft per row against sample_residual_ref: the same tokens from the same draws, and the
    drafts' probabilities within float rounding; with drafts of -1, the same tokens as sample_tokens."""
    for seed, rows in ((0, 1), (1, 5), (2, 64), (3, 300)):
        logits = _logits(rows, vocab, scale, bf16, seed).cuda()
        params = [t.cuda() for t in _params(rows, vocab, seed)]
        drafts = _drafts(logits, seed)
        draws = exponential_draws(logits.shape, "cuda", [SeedStream(r) for r in range(rows)])
        tokens, probs = sample_residual(logits, draws, *params, drafts)
        want_tokens, want_probs = sample_residual_ref(logits, draws, *params, drafts)
        mismatched = (tokens != want_tokens).nonzero().flatten().tolist()
        assert not mismatched, [(r, tokens[r].item(), want_tokens[r].item(), drafts[r].item()) for r in mismatched]
        torch.testing.assert_close(probs, want_probs, rtol=1e-4, atol=1e-6)
        plain = drafts < 0
        assert torch.equal(tokens[plain], sample_tokens(logits, draws, *params)[plain])


def test_sample_residual_edges():
    """The draft as the only token kept (tiny top_p): the draft, probability 1. A draft top-k filters out:
    probability 0, and the token sample_tokens draws. Greedy rows: the argmax, and 1 or 0. A top_p of 0 in
    float32 (1e-300 upstream): the top token."""
    vocab = 5000
    logits = _logits(6, vocab, 3.0, False, 12).cuda()
    ranked = logits.argsort(dim=1, descending=True)
    temperature = torch.tensor([1.0, 0.7, 0.0, 0.0, 1.0, 1.1], device="cuda")
    top_k = torch.tensor([0, 10, 0, 1, 0, 0], device="cuda")
    top_p = torch.tensor([1e-7, 1.0, 1.0, 1.0, 0.0, 0.0], device="cuda")
    min_p = torch.zeros(6, device="cuda")
    drafts = torch.stack([ranked[0, 0], ranked[1, 500], ranked[2, 0], ranked[3, 1], ranked[4, 1], torch.tensor(
        -1, device="cuda")])  # fmt: skip
    params = (temperature, top_k, top_p, min_p)
    for seed in range(5):
        draws = exponential_draws(logits.shape, "cuda", [SeedStream(seed + 10 * r) for r in range(6)])
        tokens, probs = sample_residual(logits, draws, *params, drafts)
        argmax = logits.argmax(dim=1)
        assert tokens[0] == drafts[0] and probs[0] == 1.0
        assert probs[1] == 0.0 and tokens[1] == sample_tokens(logits, draws, *params)[1]
        assert tokens[2] == argmax[2] and probs[2] == 1.0 and tokens[3] == argmax[3] and probs[3] == 0.0
        assert tokens[4] == argmax[4] and probs[4] == 0.0 and tokens[5] == argmax[5]


def test_sampler_draws_the_same_tokens_with_the_kernel_and_with_the_reference(monkeypatch):
    """The whole Sampler on the GPU (penalties, seeded streams, logprobs) with the kernel, and with
    ATOM_FORCE_REFERENCE=1: the same seeds give the same tokens."""
    vocab = 32000
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=40, seed=2), SamplingParams(temperature=0.7, min_p=0.1, seed=3),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=4, logprobs=3),
              SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05, seed=5)]  # fmt: skip
    logits = _logits(len(params), vocab, 4.0, True, 9).cuda()
    prompts, outputs = [[1, 2, 3]] * len(params), [[4, 5], [], [6], [], [7, 8, 9], []]

    def run() -> tuple[list[int], list]:
        streams = [SeedStream(p.seed) if p.seed is not None else None for p in params]
        batch = SamplingBatch.from_params(params, streams, prompts, outputs, device="cuda")
        out = Sampler()(logits, batch)
        return out.sampled_token_ids.tolist(), out.logprobs

    for _ in range(3):
        kernel = run()
        monkeypatch.setenv("ATOM_FORCE_REFERENCE", "1")
        reference = run()
        monkeypatch.delenv("ATOM_FORCE_REFERENCE")
        assert kernel == reference
        logits = logits.roll(1, dims=1)


@pytest.mark.parametrize("width", [1, 7, 1000, 32001, 163841])
def test_keyed_draws_match_reference(width):
    """Seeded rows' draws: the kernel writes the rows it is given (up to 300: three launches of 128 rows), from
    their seed states and counters, as keyed_draws_ref does (the same floats); rows not given keep their poison."""
    g = torch.Generator().manual_seed(width)
    for n, total in ((1, 1), (5, 9), (300, 301)):
        rows = torch.randperm(total, generator=g)[:n].tolist()
        seeds = [seed_state(int(s)) for s in torch.randint(-(2**62), 2**62, (n,), generator=g)]
        counters = [int(c) for c in torch.randint(1, 2**62, (n,), generator=g)]
        out = keyed_draws_(torch.full((total, width + 3), float("nan"), device="cuda")[:, 2 : 2 + width], rows,
                           seeds, counters)  # fmt: skip
        want = keyed_draws_ref(torch.full((total, width), float("nan")), rows, seeds, counters)
        torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=0, equal_nan=True)
        assert out[rows].isfinite().all() and out[rows].min() >= 0
        untouched = [r for r in range(total) if r not in set(rows)]
        assert out[untouched].isnan().all()
    with pytest.raises(ValueError, match="rows must be in"):  # the kernel would write past the tensor
        keyed_draws_(torch.empty(2, width, device="cuda"), [2], [1], [1])
