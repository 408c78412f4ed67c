"""MTP drafting on the decode graphs' static buffers (atom/worker/drafters/mtp_graphs.py), checked on the CPU.

As in test_cuda_graph_buffers.py, a "graph" here is the captured forward run
eagerly over the static buffers, and the layers take their kernel-shaped decode
path with the kernel wrappers' torch references. The drafts must equal the
eager drafter's, and so must what it writes into the MTP layer's cache.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom import LLM, SamplingParams
from atom.engine.scheduler_output import ScheduledRequest
from atom.worker.drafters import DraftContext, TokenHistories
from atom.ops.cuda.fused import INPUT_IDS, POSITIONS, SEQ_LENS, leading_matches
from atom.worker.cuda_graph import DecodeOutput, fill_decode_buffers
from atom.worker.drafters.mtp_graphs import MTPGraphs
from atom.worker.spec_decode import accept_greedy
from tests import checkpoints
from tests.test_cuda_graph_buffers import EagerDecodeGraphs


class EagerMTPGraphs(MTPGraphs):
    """Runs the captured drafting eagerly over the static buffers instead of replaying a graph."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.launched: list[int] = []  # sizes, drafting from the static buffers
        self.launched_after: list[int] = []  # sizes, drafting from a verification's outputs

    def _launch(self, size: int, bound: int, after: bool = False) -> torch.Tensor:
        (self.launched_after if after else self.launched).append(size)
        return self._forward(size, bound, self.decode.outputs if after else None)

    def _verification(self, size: int, bound: int) -> DecodeOutput:
        return self.decode.outputs  # the latest launch's


@pytest.fixture(scope="module")
def kimi_mtp_ckpt(tmp_path_factory) -> str:
    path = checkpoints.make_kimi_checkpoint(str(tmp_path_factory.mktemp("kimi_mtp")), "kda_mla")
    return checkpoints.add_mtp_weights(path)


def _mtp_llm(path: str, k: int, graphs: bool, **kwargs) -> LLM:
    """An fp32 engine with MTP speculation, its decode and verification steps on the (eager) graphs, and its
    drafting on them too where ``graphs``."""
    llm = LLM(path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kwargs)  # fmt: skip
    runner = llm.engine.runner
    runner.decode_graphs = EagerDecodeGraphs(llm.config, runner.model, runner.caches, runner.device)
    if graphs:
        runner.drafter.graphs = EagerMTPGraphs(runner.model, runner.decode_graphs, k)
    return llm


def test_token_histories_join_only_what_is_asked():
    rng = random.Random(0)
    parts = {f"r{i}": ([rng.randrange(100) for _ in range(rng.randrange(1, 9))],
                       [rng.randrange(100) for _ in range(rng.randrange(0, 9))]) for i in range(20)}  # fmt: skip
    histories = TokenHistories(parts)
    assert sorted(histories) == sorted(parts) and len(histories) == len(parts)
    for rid, (prompt, outputs) in parts.items():
        assert histories[rid] == prompt + outputs
        for start in range(len(prompt) + len(outputs) + 1):
            for stop in range(start, len(prompt) + len(outputs) + 2):
                assert histories.span(rid, start, stop) == (prompt + outputs)[start:stop], (rid, start, stop)


# (context_len, drafts scheduled, drafts accepted): a row verified with some drafts accepted, a decode row, a row
# that accepted all, a row with fewer drafts than k, a row that accepted none
ROWS = [(20, 3, 2), (7, 0, 0), (33, 3, 3), (12, 1, 0), (5, 3, 0)]


def _draft_context(runner, k: int, layout: str, seed: int) -> tuple[DraftContext, list[list[int]]]:
    """A step's rows as ROWS (k = 3) after greedy verification, with random tokens, hidden states and block
    tables, and each row's argmax at its 1 + k columns (its accepted drafts, then its own token, then more).
    ``layout`` "flat": the rows' tokens back to back (an eager step), "padded": row r's at r * (1 + k)."""
    gen = torch.Generator().manual_seed(seed)
    block_size, blocks = runner.config.block_size, torch.randperm(runner.layout.num_blocks, generator=gen).tolist()
    rows, emitted, parts, flat, argmax = [], {}, {}, [], []
    for i, (context, drafts, accepted) in enumerate(ROWS):
        rid = f"r{i}"
        drafts = torch.randint(3, 200, (drafts,), generator=gen).tolist()
        need = -(-(context + 1 + k + k) // block_size)
        rows.append(ScheduledRequest(rid, [7 + i] + drafts, context, [blocks.pop() for _ in range(need)], -1, True,
                                     draft_token_ids=drafts))  # fmt: skip
        # its own token (0 for the row without drafts: the id its padding columns hold), then the drafts after the
        # rejected one (matches that must not count), then 0s
        own = int(torch.randint(3, 200, (1,), generator=gen)) if drafts else 0
        if accepted < len(drafts) and own == drafts[accepted]:  # rejects that draft
            own += 1
        argmax.append((drafts[:accepted] + [own] + drafts[accepted + 1 :] + [0] * k)[: 1 + k])
        emitted[rid] = drafts[:accepted] + [own]
        assert accept_greedy(drafts, argmax[-1][: len(drafts) + 1]) == emitted[rid]
        prompt = torch.randint(3, 200, (context,), generator=gen).tolist()
        parts[rid] = (prompt, [7 + i] + emitted[rid])
        flat.append(1 + len(drafts))
    width = 1 + k
    hidden_size = runner.model.lm_head.in_features
    tokens = torch.randn(sum(flat), hidden_size, generator=gen)
    if layout == "flat":
        starts = [sum(flat[:i]) for i in range(len(rows) + 1)]
        hidden = tokens
    else:
        starts = list(range(0, len(rows) * width + 1, width))
        hidden = torch.randn(len(rows) * width, hidden_size, generator=gen)  # padding columns: anything
        for r, n in enumerate(flat):
            hidden[r * width : r * width + n] = tokens[sum(flat[:r]) : sum(flat[:r]) + n]
    ctx = DraftContext(rows=rows, query_start_loc=starts, hidden_states=hidden, emitted=emitted,
                       token_history=TokenHistories(parts), caches=runner.caches, block_size=block_size)  # fmt: skip
    return ctx, argmax


def _draft_after_verification(runner, ctx: DraftContext, argmax: list[list[int]],
                              via_targets: bool = False) -> dict[str, list[int]]:  # fmt: skip
    """The drafts of ``ctx``'s rows drafted from a verification's outputs (its buffers as the verification graph
    left them, its argmax ``argmax``) before anything reached the host. ``via_targets``: rows 0, 2 and 3 instead
    pass theirs as targets (rows verified by verify_rows), their argmax in the graph's output being junk."""
    decode, k = runner.decode_graphs, runner.drafter.k
    width, rows = 1 + k, ctx.rows
    size = fill_decode_buffers(decode.rows, decode.tables, decode.host_tables, [t for s in rows for t in s.token_ids],
                               rows, decode.verify_sizes, decode.block_size, width)  # fmt: skip
    hidden = torch.randn(size * width, ctx.hidden_states.shape[1])  # padding rows: anything
    hidden[: len(rows) * width] = ctx.hidden_states
    greedy = torch.randint(3, 200, (size * width,))
    greedy[: len(rows) * width] = torch.tensor([t for row in argmax for t in row])
    targets = None
    if via_targets:
        index = [0, 2, 3]  # targets as Verdict.targets has them: the accepted drafts, then the emitted token
        emitted = [ctx.emitted[rows[i].request_id] for i in index]
        targets = (torch.tensor(index), torch.tensor([e + e[-1:] * (width - len(e)) for e in emitted]))
        greedy.view(size, width)[index] = torch.randint(3, 200, (len(index), width))
    decode.outputs = DecodeOutput(hidden, None, greedy)
    drafts = runner.drafter.draft_after_verification(rows, targets)
    return {s.request_id: column for s, column in zip(rows, drafts.T.tolist())}


@pytest.mark.parametrize("source", ["flat", "padded", "verification", "verification_targets"])
def test_graph_drafting_matches_eager_for_every_accepted_count(kimi_mtp_ckpt, kernel_shaped_layers, source):
    """Rows that accepted 0 .. k drafts (and rows with fewer drafts, or none) get the eager drafter's drafts, and
    the MTP layer's cache ends the same: drafting from the static buffers with the step's hidden states back to
    back or padded per row, and drafting from a greedy verification's outputs (its own acceptance), some rows
    with their targets passed in (rows verify_rows verified)."""
    k = 3
    llm = _mtp_llm(kimi_mtp_ckpt, k, graphs=True)
    runner = llm.engine.runner
    drafter, graphs = runner.drafter, runner.drafter.graphs
    mtp_layer = runner.model.args.num_hidden_layers
    (cache,) = runner.caches[mtp_layer]
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(1)))  # earlier positions: anything
    before = cache.clone()
    results = []
    for on_graphs in (False, True):
        cache.copy_(before)
        drafter.graphs = graphs if on_graphs else None
        ctx, argmax = _draft_context(runner, k, "flat" if source == "flat" else "padded", seed=2)
        with torch.inference_mode():
            if on_graphs and source.startswith("verification"):
                drafts = _draft_after_verification(runner, ctx, argmax, source == "verification_targets")
            else:
                drafts = drafter.propose(ctx)
        results.append((drafts, cache.clone()))
    (eager, eager_cache), (graph, graph_cache) = results
    assert (graphs.launched, graphs.launched_after) == (([], [8]) if source.startswith("verification") else ([8], []))
    assert set(graph) == {f"r{i}" for i in range(len(ROWS))} and all(len(d) == k for d in graph.values())
    assert graph == eager
    assert not torch.equal(eager_cache, before)
    torch.testing.assert_close(graph_cache, eager_cache, rtol=1e-5, atol=1e-5)


ODD_ROWS = {  # one row of the batch with these parameters: it verifies by verify_rows, not the plain argmax
    "sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=14, ignore_eos=True),
    "penalised_logprobs": SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2, max_tokens=14,
                                         ignore_eos=True),  # fmt: skip
}


@pytest.mark.parametrize("k, odd", [(1, None), (2, None), (3, None), (2, "sampled"), (3, "penalised_logprobs")])
def test_engine_drafting_on_the_graphs_matches_eager(kimi_mtp_ckpt, kernel_shaped_layers, k, odd):
    """Through the engine: steps after decode and verification steps draft on the graphs, right behind the
    verification (with a row that samples, or has a penalty and logprobs, among greedy ones too), every other
    step eagerly; each step's drafts and every token and logprob equal the engine's with eager drafting, and all
    is freed."""
    prompts = [[3, 4, 5], [5, 6, 7, 8, 9, 10] * 4, list(range(20, 45)), [7] * 8, [11]]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True) for _ in prompts]
    if odd is not None:
        params[2] = ODD_ROWS[odd]
    runs = []
    for graphs in (False, True):
        llm = _mtp_llm(kimi_mtp_ckpt, k, graphs)
        proposals = _record_drafts(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append(([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], proposals))
        assert llm.engine.all_resources_free()
    assert runs[1] == runs[0]
    if odd == "penalised_logprobs":
        assert len(runs[1][0][2][1]) == 14 and all(len(entry) >= 2 for entry in runs[1][0][2][1])
    graphs = llm.engine.runner.drafter.graphs
    # from the static buffers after the first decode steps only
    assert len(graphs.launched_after) >= 8 and len(graphs.launched) >= 1
    assert len(graphs.launched_after) + len(graphs.launched) < len(proposals)  # steps with a prefill chunk: eager


def scripted_drafts(runner, k: int, runs: list[list[int]]) -> None:
    """Every drafting path of ``runner`` (eager, on its graphs, right behind a verification graph) runs as it does (its
    cache writes), but proposes the next k tokens of the request's known run after a history of n tokens, the
    one at n % (k + 1) made wrong: steps accept 0 .. k drafts, the same whichever path drafted. Behind a
    verification, where each row's accepted run ends is read from the verification's buffers (as the host has not
    seen the step); on a GPU that read waits for the device."""
    drafter, graphs = runner.drafter, runner.drafter.graphs

    def scripted(request_id: str, length: int) -> list[int]:
        prompt = runner.requests[request_id].prompt_token_ids
        run = next(r for r in runs if r[: len(prompt)] == prompt)
        drafts = (run[length : length + k] + [0] * k)[:k]
        if length % (k + 1) < k:
            drafts[length % (k + 1)] += 1
        return drafts

    propose, behind = drafter.propose, graphs.draft_after_verification

    def proposing(ctx):
        return {rid: scripted(rid, len(ctx.token_history[rid])) for rid in propose(ctx)}

    def drafting_behind(rows, targets=None) -> torch.Tensor | None:
        drafts = behind(rows, targets)
        if drafts is None:
            return None
        n, w = len(rows), graphs.width
        size = next(s for s in graphs.sizes if s >= n)
        bound = graphs.decode.bound(max(s.context_len + len(s.token_ids) for s in rows))
        cols = graphs.decode.rows[:, : n * w]
        inputs, verified = cols[INPUT_IDS].view(n, w), graphs._verification(size, bound).greedy[: n * w].view(n, w)
        accepted = leading_matches(inputs, verified, (cols[SEQ_LENS].view(n, w) > 0).sum(dim=1) - 1)
        # the history ends with the token emitted last, one position past the last accepted column
        lengths = cols[POSITIONS].view(n, w).gather(1, accepted.unsqueeze(1)).squeeze(1) + 2
        for r, (s, length) in enumerate(zip(rows, lengths.tolist())):
            drafts[:, r] = torch.tensor(scripted(s.request_id, length), device=drafts.device)
        return drafts

    drafter.propose, graphs.draft_after_verification = proposing, drafting_behind


@pytest.mark.parametrize("k, odd", [(2, None), (3, None), (2, "sampled")])
def test_overlap_chains_verification_steps_on_the_graphs(kimi_mtp_ckpt, kernel_shaped_layers, k, odd):
    """Speculation with overlap on the (eager) graphs: a verification step whose rows all verify on the device
    returns with its outcome still there (``deferred.DeferredVerification``), and the next step's rows, planned
    meanwhile, are filled in on the device from it (``fused.settle_verification``: inputs, positions, slots and
    the state slot of each row's accepted count). With drafts accepted 0 .. k at a time, rows ending at
    max_tokens and on a stop token, and a seeded sampled row: every token equals the same engine's without
    overlap, and the greedy rows' those of plain decoding; all is freed."""
    prompts = [[3, 4, 5], [5, 6, 7, 8, 9, 10] * 4, list(range(20, 45)), [7] * 8, [11]]
    plain = LLM(kimi_mtp_ckpt, dtype="float32").generate([{"prompt_token_ids": p} for p in prompts],
                                                         SamplingParams(temperature=0.0, max_tokens=30,
                                                                        ignore_eos=True), use_tqdm=False)  # fmt: skip
    runs = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 9, 20, 17, 20)]
    params[4] = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[runs[4][1 + 11]])
    if odd is not None:
        params[2] = ODD_ROWS[odd]
    got = []
    for overlap in (False, True):
        llm = _mtp_llm(kimi_mtp_ckpt, k, True, async_scheduling=overlap)
        runner = llm.engine.runner
        scripted_drafts(runner, k, runs)
        runner.can_defer_verification = True  # (set at start-up where the drafter captured graphs: a GPU's)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got.append([o.outputs[0].token_ids for o in outs])
        sched = llm.engine.scheduler
        assert sched.num_accepted_tokens > 10 and llm.engine.all_resources_free()
        if overlap:
            assert runner.num_deferred_steps >= 5 and runner.num_rows_settled_on_device >= 10
    assert got[1] == got[0]
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert got[1][i] == runs[i][len(prompts[i]) :][: len(got[1][i])]
    stop = runs[4][1:].index(runs[4][1 + 11]) + 1  # where the stop token first comes
    assert got[1][4] == runs[4][1 : 1 + stop] and stop < 20


def test_async_engine_overlap_streams_abandoned_mid_flight(kimi_mtp_ckpt, kernel_shaped_layers):
    """AsyncEngine with MTP speculation and overlap on the (eager) graphs: clients that walk away after a few tokens
    abort while their verification's outcome is still on the device and a row planned after it is queued; the
    others get plain decoding's tokens; every block and slot is freed."""
    import asyncio

    from atom import AsyncEngine
    from tests.streams import assert_walked_away, stream_and_walk_away

    k = 2
    prompts = [{"prompt_token_ids": p} for p in ([3, 4, 5], [5, 6, 7, 8, 9, 10] * 4, list(range(20, 45)), [7] * 8,
                                                 [11], list(range(60, 71)))]  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    plain = LLM(kimi_mtp_ckpt, dtype="float32").generate(prompts, greedy, use_tqdm=False)
    reference = [o.outputs[0].token_ids for o in plain]
    runs = [p["prompt_token_ids"] + t for p, t in zip(prompts, reference)]

    async def run():
        async with AsyncEngine.from_config(model=kimi_mtp_ckpt, dtype="float32", max_num_seqs=8,
                                           max_num_batched_tokens=64, async_scheduling=True,
                                           speculative_config={"method": "mtp", "num_speculative_tokens": k}) as engine:
            runner = engine.core.runner
            runner.decode_graphs = EagerDecodeGraphs(engine.config, runner.model, runner.caches, runner.device)
            runner.drafter.graphs = EagerMTPGraphs(runner.model, runner.decode_graphs, k)
            runner.can_defer_verification = True
            scripted_drafts(runner, k, runs)
            got = await stream_and_walk_away(engine, prompts, greedy, lambda i, tokens: i % 2 == 1 and len(tokens) > 3)
            assert runner.num_rows_settled_on_device >= 5 and engine.core.scheduler.num_accepted_tokens > 10
            return got

    got = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert_walked_away(got, reference, lambda i: i % 2 == 1)


def _record_drafts(llm: LLM) -> list[dict[str, list[int]]]:
    """Each step's drafts, as the runner returns them."""
    runner, proposals = llm.engine.runner, []
    execute = runner.execute_model

    def recording(sched):
        out = execute(sched)
        proposals.append(dict(out.draft_token_ids))
        return out

    runner.execute_model = recording
    return proposals


def test_graph_drafting_covers_only_rows_that_produced_at_most_1_plus_k_valid_tokens(kimi_mtp_ckpt):
    """Drafting goes to the graphs when every row emitted tokens from at most 1 + k valid positions, within the
    largest size, its block tables and its positions; anything else drafts eagerly."""
    from atom.worker.drafters.mtp import Fill

    llm = _mtp_llm(kimi_mtp_ckpt, 2, graphs=True, max_model_len=64)
    graphs = llm.engine.runner.drafter.graphs
    assert graphs.sizes == (1, 2, 4, 8)

    def fill(i: int, valid: int, context: int = 10, blocks: int = 2) -> Fill:
        row = ScheduledRequest(f"r{i}", [3] * valid, context, list(range(blocks)), -1, True)
        return Fill(row, 0, context, [4] * valid)

    class Ctx:
        emitted = {f"r{i}": [1] for i in range(10)}

    assert graphs.covers(Ctx, [fill(0, 3), fill(1, 1)])
    assert not graphs.covers(Ctx, [fill(0, 4)])  # more valid positions than 1 + k
    assert not graphs.covers(Ctx, [fill(i, 1) for i in range(9)])  # more rows than the largest size
    chunk = Fill(ScheduledRequest("x", [3], 0, [0], -1, False), 0, 0, [4])  # a prefill chunk: no tokens emitted
    assert not graphs.covers(Ctx, [fill(0, 1), chunk])
    assert not graphs.covers(Ctx, [fill(0, 1, blocks=graphs.decode.max_blocks + 1)])
    assert not graphs.covers(Ctx, [fill(0, 2, context=63)])  # its drafts would pass max_model_len's bound
