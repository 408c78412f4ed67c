"""The decode-graph path's static buffers and padding, checked on the CPU.

A CUDA graph replays the forward it captured over ``DecodeGraphs``' static
buffers. Here the "graph" is that same forward run eagerly over the same
buffers (``_launch``), and the layers take their kernel-shaped decode path
with the kernel wrappers' torch references (which honour the padding
contract: state slot -1, slot_mapping -1, seq_len 0). Greedy tokens must match
the plain runner's, with batches padded up to the captured sizes.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.worker import cuda_graph
from atom.worker.cuda_graph import DecodeGraphs, capture_sizes
from atom.worker.drafters import Drafter
from tests import checkpoints

PROMPTS = [[3, 4, 5], [5, 6, 7, 8, 9, 10] * 4, list(range(20, 45)), [7] * 8, list(range(60, 71)), [11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class EagerDecodeGraphs(DecodeGraphs):
    """Runs the captured forward eagerly over the static buffers instead of replaying a graph."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.launched: list[int] = []
        self.widths: list[int] = []  # tokens a row: 1 a decode launch, 1 + k a verification launch
        self.launches: list[tuple[int, int]] = []  # (bound, the longest row's positions) of each launch

    def _launch(self, size: int, bound: int | None = None, width: int = 1) -> torch.Tensor:
        bound = self.bounds[0] if bound is None else bound
        self.launched.append(size)
        self.widths.append(width)
        self.launches.append((bound, int(self.rows[cuda_graph.SEQ_LENS, :size * width].max())))
        self.outputs = self._forward(size, bound, width)  # (what a graph's static outputs would hold now)
        return self.outputs


def _generate(llm: LLM) -> list[list[int]]:
    return _tokens(llm, GREEDY)


def _tokens(llm: LLM, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _greedy_but(index: int, params: SamplingParams) -> list[SamplingParams]:
    """Greedy params for each of PROMPTS (10 tokens), but ``params`` for prompt ``index``."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [params if i == index else greedy for i in range(len(PROMPTS))]


def test_capture_sizes():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 4)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert capture_sizes(200) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert capture_sizes(10_000) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # larger steps run eagerly
    assert capture_sizes(10_000, lambda size: size <= 128) == (1, 2, 4, 8, 16, 32, 64, 128)  # syncs past 128
    assert capture_sizes(4, lambda size: False) == ()


def test_graph_sizes_stop_where_the_decode_path_syncs(kimi_ckpt, llama_ckpt):
    """Kimi-Linear's MoE runs up to 128 tokens without a host sync off Hopper's bf16 grouped matmuls (its dense
    path), then loops over the experts; a dense Llama has no such bound."""
    kimi = LLM(kimi_ckpt, dtype="float32", max_num_seqs=300)
    model = kimi.engine.runner.model
    assert model.graph_capturable(128) and not model.graph_capturable(129)
    assert _graphs_on(kimi).sizes == (1, 2, 4, 8, 16, 32, 64, 128)
    assert _graphs_on(LLM(llama_ckpt, dtype="float32", max_num_seqs=300)).sizes[-1] == 512


def test_every_graph_writes_its_logits_into_one_buffer(kimi_ckpt, kernel_shaped_layers, monkeypatch):
    """Each (size, bound) graph's logits are rows [:size] of the one fp32 buffer, and equal the runner's own."""
    monkeypatch.setattr(cuda_graph, "SHORT_CONTEXT", 12)
    llm = LLM(kimi_ckpt, dtype="float32", max_num_seqs=8, max_model_len=64)
    graphs = _graphs_on(llm)
    assert graphs.logits.shape[0] == 8 and len(graphs.bounds) == 2
    for bound in graphs.bounds:
        for size in graphs.sizes:
            out = graphs._forward(size, bound)
            assert out.logits.data_ptr() == graphs.logits.data_ptr() and out.logits.shape[0] == size
            torch.testing.assert_close(out.logits, llm.engine.runner.model.compute_logits(out.hidden), rtol=0, atol=0)
            assert torch.equal(out.greedy, out.logits.argmax(dim=-1))


def test_cpu_never_captures(kimi_ckpt):
    assert LLM(kimi_ckpt, max_num_seqs=2).engine.runner.decode_graphs is None


@pytest.mark.parametrize("variant", ["kda_mla", "mla_first_qlora"])
def test_static_buffer_forward_matches_eager(tmp_path, kernel_shaped_layers, variant):
    path = checkpoints.make_kimi_checkpoint(str(tmp_path), variant, tokenizer=False)
    kwargs = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16}
    eager = _generate(LLM(path, **kwargs))
    llm = LLM(path, **kwargs)
    runner = llm.engine.runner
    graphs = EagerDecodeGraphs(llm.config, runner.model, runner.caches, runner.device)
    runner.decode_graphs = graphs
    assert _generate(llm) == eager
    assert graphs.launched and max(graphs.launched) == 4
    assert llm.engine.all_resources_free()


@pytest.mark.parametrize("steps", [1, 4])
def test_steps_replay_the_graphs_of_the_shortest_bound_over_their_rows(kimi_ckpt, kernel_shaped_layers, monkeypatch,
                                                                       steps):  # fmt: skip
    """Over SHORT_CONTEXT positions of max_model_len, each size has a graph for short rows and one for long ones;
    a step (a multi-step round: its last step) replays the short one while its rows fit, and gives the tokens the
    plain runner gives."""
    monkeypatch.setattr(cuda_graph, "SHORT_CONTEXT", 12)
    kwargs = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64}
    prompts = [{"prompt_token_ids": p} for p in ([3, 4, 5], [7] * 4, [11])]  # 12 new tokens: 13-16 positions
    want = [o.outputs[0].token_ids for o in LLM(kimi_ckpt, **kwargs).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(kimi_ckpt, num_scheduler_steps=steps, **kwargs)
    graphs = _graphs_on(llm)
    assert graphs.bounds == (12, 64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert all(longest <= bound for bound, longest in graphs.launches)
    assert {bound for bound, _ in graphs.launches} == {12, 64}
    shortest = min(longest for bound, longest in graphs.launches if bound == 64)
    assert shortest > 12 - steps + 1  # long graphs only once a row (in the round) passes 12
    assert llm.engine.all_resources_free()


@pytest.mark.parametrize("max_model_len, bounds", [(64, (64,)), (65, (64, 65)), (32, (32,))])
def test_a_second_set_of_graphs_only_past_short_context(kimi_ckpt, monkeypatch, max_model_len, bounds):
    monkeypatch.setattr(cuda_graph, "SHORT_CONTEXT", 64)
    llm = LLM(kimi_ckpt, dtype="float32", max_num_seqs=2, max_model_len=max_model_len)
    runner = llm.engine.runner
    assert EagerDecodeGraphs(llm.config, runner.model, runner.caches, runner.device).bounds == bounds


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_device_side_multi_step_rounds_match_single_steps(kimi_ckpt, kernel_shaped_layers, overlap):
    """Multi-step rounds through the static buffers, advanced between steps by tensor ops alone
    (``advance_decode``, as on the GPU), give the single-step tokens; with async
    scheduling too (a round's first input then is the last token of the round before)."""
    kwargs = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64}
    eager = _generate(LLM(kimi_ckpt, **kwargs))
    llm = LLM(kimi_ckpt, num_scheduler_steps=4, async_scheduling=overlap, **kwargs)
    runner = llm.engine.runner
    graphs = EagerDecodeGraphs(llm.config, runner.model, runner.caches, runner.device)
    runner.decode_graphs = graphs
    rounds = []
    inner = graphs.replay_steps
    graphs.replay_steps = lambda *args: rounds.append(args[2]) or inner(*args)
    assert _generate(llm) == eager
    assert rounds and max(rounds) == 4  # the device-side path ran, with full rounds
    assert llm.engine.all_resources_free()


def test_advance_equals_refilling_the_buffers(kimi_ckpt):
    """One step on, in place (advance_decode) == filling the buffers for the next step."""
    from dataclasses import replace

    from atom.engine.scheduler_output import ScheduledRequest
    from atom.ops.cuda.fused import advance_decode
    from atom.worker.cuda_graph import HostBlockTables, fill_decode_buffers

    gen = torch.Generator().manual_seed(0)
    sizes, block_size = (1, 2, 4, 8), 4
    rows = []
    for i in range(5):
        context = int(torch.randint(0, 30, (), generator=gen))
        blocks = torch.randperm(64, generator=gen)[: context // block_size + 2].tolist()
        slot = -1 if i == 3 else 2 * i  # row 3: a model without recurrent state
        rows.append(ScheduledRequest(f"r{i}", [int(torch.randint(3, 99, (), generator=gen))], context, blocks,
                                     slot + (i % 2 if slot >= 0 else 0), True, state_out_slot=slot))
    buffers, tables = torch.zeros(7, 8, dtype=torch.long), torch.zeros(8, 12, dtype=torch.long)
    fill_decode_buffers(buffers, tables, HostBlockTables(8, 12), [s.token_ids[0] for s in rows], rows, sizes,
                        block_size)  # fmt: skip
    next_ids = torch.tensor([11, 12, 13, 14, 15])
    advance_decode(buffers, tables, next_ids, block_size)
    moved = [replace(s, token_ids=[int(t)], context_len=s.context_len + 1, state_slot=s.state_out_slot)
             for s, t in zip(rows, next_ids)]
    want_buffers, want_tables = torch.zeros(7, 8, dtype=torch.long), torch.zeros(8, 12, dtype=torch.long)
    fill_decode_buffers(want_buffers, want_tables, HostBlockTables(8, 12), next_ids.tolist(), moved, sizes,
                        block_size)  # fmt: skip
    assert torch.equal(buffers, want_buffers) and torch.equal(tables, want_tables)


@pytest.mark.parametrize("max_blocks", [12, 6000], ids=["whole_table_rows", "first_columns"])
def test_fill_writes_each_row_padding_and_block_tables(max_blocks):
    """The static buffers after a fill: each step row's values, padding in every other column (up to the
    graph size and past it), and each row's block table followed by zeros, whether the tables go up as
    whole rows (small) or as their first columns (more than WHOLE_TABLE_ROWS_MAX_IDS ids)."""
    from atom.engine.scheduler_output import ScheduledRequest
    from atom.worker.cuda_graph import _PADDING, WHOLE_TABLE_ROWS_MAX_IDS, HostBlockTables, fill_decode_buffers

    block_size, sizes, n = 4, (1, 2, 4, 8), 3
    assert (n * max_blocks <= WHOLE_TABLE_ROWS_MAX_IDS) == (max_blocks == 12)
    rows = [ScheduledRequest("a", [5], 0, [7], -1, True, state_out_slot=-1),
            ScheduledRequest("b", [6], 9, [3, 8, 2], 4, True, state_out_slot=5),
            ScheduledRequest("c", [9], 5, [11, 1], 6, True, state_out_slot=6)]
    buffers, tables = torch.full((7, 8), 99, dtype=torch.long), torch.full((8, max_blocks), 99, dtype=torch.long)
    size = fill_decode_buffers(buffers, tables, HostBlockTables(8, max_blocks), [5, 6, 9], rows, sizes, block_size)
    assert size == 4
    want = [[5, 6, 9], [0, 9, 5], [7 * 4 + 0, 2 * 4 + 1, 1 * 4 + 1], [-1, 4, 6], [-1, 5, 6], [0, 1, 1], [1, 10, 6]]
    for r, values in enumerate(want):
        assert buffers[r].tolist() == values + [_PADDING[r]] * (8 - n), r
    for i, s in enumerate(rows):
        assert tables[i, :3].tolist() == s.block_ids + [0] * (3 - len(s.block_ids)), i


def test_host_block_tables_match_full_tables():
    """Incremental host tables == each step's tables built in full, through appends, frees and
    resends (forget), row reuse, and more live requests than rows (eviction)."""
    from atom.engine.scheduler_output import ScheduledRequest
    from atom.worker.cuda_graph import HostBlockTables

    gen = torch.Generator().manual_seed(0)
    host = HostBlockTables(rows=4, max_blocks=20)
    lists: dict[str, list[int]] = {}
    for step in range(300):
        rid = f"r{int(torch.randint(0, 7, (), generator=gen))}"
        action = int(torch.randint(0, 10, (), generator=gen))
        if action == 0 and rid in lists:  # freed (finish / preemption), then sent afresh
            del lists[rid]
            host.forget([rid])
        blocks = lists.setdefault(rid, [])
        grow = min(int(torch.randint(0, 3, (), generator=gen)), 20 - len(blocks))  # the scheduler appends
        blocks.extend(torch.randint(0, 500, (grow,), generator=gen).tolist())
        live = [r for r in lists if lists[r]]
        chosen = live[: int(torch.randint(1, 5, (), generator=gen))]
        if not chosen:
            continue
        rows = [ScheduledRequest(r, [1], 0, list(lists[r]), -1, True) for r in chosen]
        width = max(len(lists[r]) for r in chosen)
        want = torch.tensor([lists[r] + [0] * (width - len(lists[r])) for r in chosen])
        assert torch.equal(host.gather(rows, width), want), step


def test_static_buffers_with_preemption_match_eager(tmp_path, kernel_shaped_layers):
    """Requests preempted (their block lists freed and rebuilt) and resumed through the static
    buffers' host tables give the plain runner's tokens."""
    path = checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla", tokenizer=False)
    kwargs = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 4,
              "num_gpu_blocks": 20, "max_model_len": 64}
    eager = _generate(LLM(path, dtype="float32", max_num_seqs=4))
    llm = LLM(path, **kwargs)
    runner = llm.engine.runner
    graphs = EagerDecodeGraphs(llm.config, runner.model, runner.caches, runner.device)
    runner.decode_graphs = graphs
    assert _generate(llm) == eager
    assert llm.engine.scheduler.num_preemptions > 0 and graphs.launched
    assert llm.engine.all_resources_free()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_graph_steps_take_their_logits_from_the_graph(kimi_ckpt, kernel_shaped_layers, overlap):
    """A decode step on the graphs runs the lm_head (and the greedy argmax) inside the graph: the runner
    computes no logits of its own for it. Steps the graphs do not cover (prefill) still do. Greedy and
    seeded sampled requests get the plain runner's tokens."""
    params = _greedy_but(1, SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True))
    kwargs = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64}
    want = _tokens(LLM(kimi_ckpt, **kwargs), params)
    llm = LLM(kimi_ckpt, async_scheduling=overlap, **kwargs)
    graphs, outside = _on_graphs_counting_logits(llm, lambda graphs, rows: graphs.covers(rows))
    assert _tokens(llm, params) == want
    assert len(graphs.launched) >= 5 and outside  # decode steps ran on the graphs, prefill steps eagerly
    assert not any(outside), "a step on the graphs computed its logits outside the graph"
    assert llm.engine.all_resources_free()


def _on_graphs_counting_logits(llm: LLM, covered) -> tuple[EagerDecodeGraphs, list[bool]]:
    """The graphs on llm's runner, and for each lm_head call outside a launch whether its step was one that
    ``covered(graphs, rows)`` says the graphs run."""
    graphs, runner = _graphs_on(llm), llm.engine.runner
    in_graph, on_graphs, outside = [False], [False], []
    compute_logits, launch, execute = runner.model.compute_logits, graphs._launch, runner.execute_model

    def counted_logits(hidden, out=None):
        if not in_graph[0]:
            outside.append(on_graphs[0])
        return compute_logits(hidden, out=out)

    def flagged_launch(size, bound=None, width=1):
        in_graph[0] = True
        try:
            return launch(size, bound, width)
        finally:
            in_graph[0] = False

    def flagged_execute(sched):
        on_graphs[0] = bool(sched.scheduled) and covered(graphs, sched.scheduled)
        return execute(sched)

    runner.model.compute_logits, graphs._launch, runner.execute_model = counted_logits, flagged_launch, flagged_execute
    return graphs, outside


def _graphs_on(llm: LLM) -> EagerDecodeGraphs:
    runner = llm.engine.runner
    runner.decode_graphs = EagerDecodeGraphs(llm.config, runner.model, runner.caches, runner.device)
    return runner.decode_graphs


def _count_patches(graphs: EagerDecodeGraphs) -> list[bool]:
    """Records, for each fill of the static buffers, whether input ids were patched from the device."""
    seen: list[bool] = []
    fill = graphs._fill
    graphs._fill = lambda ids, rows, patch: seen.append(patch is not None) or fill(ids, rows, patch)
    return seen


@pytest.mark.parametrize("steps", [1, 4])
def test_async_steps_chain_on_the_device(kimi_ckpt, kernel_shaped_layers, steps):
    """With async scheduling, greedy decode steps (and rounds) on the graphs return with their tokens
    still on the device; the next step takes its placeholders from there. The engine's update waits
    for them. Tokens equal synchronous single steps; everything is freed."""
    kwargs = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64}
    eager = _generate(LLM(kimi_ckpt, **kwargs))
    llm = LLM(kimi_ckpt, async_scheduling=True, num_scheduler_steps=steps, **kwargs)
    graphs = _graphs_on(llm)
    patched = _count_patches(graphs)
    core = llm.engine
    waited = []
    update = core.update
    core.update = lambda sched, result: waited.append(result.wait is not None) or update(sched, result)
    assert _generate(llm) == eager
    assert sum(patched) >= 3  # steps whose inputs came from the device
    assert sum(waited) >= 3  # steps whose tokens reached the host after execute returned
    assert not core.runner._deferred or all(d.resolved for d in core.runner._deferred)
    assert core.all_resources_free()


def test_async_chain_as_requests_end_at_different_lengths(kimi_ckpt, kernel_shaped_layers):
    """Requests leave a chained batch while their last token is still in flight (no step is planned
    past it): each is sampled exactly max_tokens times, and the tokens equal synchronous steps'."""
    lengths = (3, 12, 5, 1, 9, 7)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    kwargs = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64}
    want = _tokens(LLM(kimi_ckpt, **kwargs), params)
    llm = LLM(kimi_ckpt, async_scheduling=True, **kwargs)
    patched = _count_patches(_graphs_on(llm))
    sampled: dict[str, int] = {}
    execute = llm.engine.execute

    def counting(sched):
        for s in sched.scheduled:
            sampled[s.request_id] = sampled.get(s.request_id, 0) + s.sample
        return execute(sched)

    llm.engine.execute = counting
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [sampled[o.request_id] for o in outs] == list(lengths)
    assert sum(patched) >= 3
    assert llm.engine.all_resources_free()


def test_async_mixed_sampling_brings_tokens_home_first(kimi_ckpt, kernel_shaped_layers):
    """A step that must read token histories on the host (penalties, seeded sampling) is not chained:
    the runner resolves the steps in flight first. Same tokens as synchronous steps."""
    params = _greedy_but(2, SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.3, max_tokens=10,
                                           ignore_eos=True))
    kwargs = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64}
    want = _tokens(LLM(kimi_ckpt, **kwargs), params)
    llm = LLM(kimi_ckpt, async_scheduling=True, **kwargs)
    _graphs_on(llm)
    assert _tokens(llm, params) == want
    assert llm.engine.all_resources_free()


def test_async_chained_streams_abandoned_mid_flight(kimi_ckpt, kernel_shaped_layers):
    """AsyncEngine with chained steps: clients that walk away after their first chunk abort while their
    next tokens are still on the device; the others keep the synchronous tokens; all is freed."""
    import asyncio

    from atom import AsyncEngine
    from tests.streams import assert_walked_away, stream_and_walk_away

    greedy = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    plain = LLM(kimi_ckpt, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    reference = [o.outputs[0].token_ids
                 for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]

    async def run():
        async with AsyncEngine.from_config(model=kimi_ckpt, dtype="float32", max_num_seqs=8,
                                           max_num_batched_tokens=64, async_scheduling=True) as engine:
            runner = engine.core.runner
            runner.decode_graphs = EagerDecodeGraphs(engine.config, runner.model, runner.caches, runner.device)
            patched = _count_patches(runner.decode_graphs)
            got = await stream_and_walk_away(engine, [{"prompt_token_ids": p} for p in PROMPTS], greedy,
                                             lambda i, tokens: i % 2 == 1 and len(tokens) > 2)
            assert sum(patched) >= 3
            return got

    got = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert_walked_away(got, reference, lambda i: i % 2 == 1)


# -- speculative verification steps on the graphs ---------------------------------------

REPETITIVE = [5, 6, 7, 8, 9, 10] * 4


def test_verification_graph_sizes_hold_at_most_the_largest_decode_graphs_tokens(kimi_ckpt, llama_ckpt):
    """Verification graphs take rows of 1 + k tokens; a graph's tokens stay within the largest decode size and
    the MoE's capture bound, so the one logits buffer and the static rows need no more columns than that."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    llama = _graphs_on(LLM(llama_ckpt, dtype="float32", max_num_seqs=300, speculative_config=ngram))
    assert llama.num_drafts == 3 and llama.verify_sizes == (1, 2, 4, 8, 16, 32, 64, 128)  # 128 * 4 = 512 tokens
    assert llama.rows.shape[1] == llama.logits.shape[0] == 512
    kimi = _graphs_on(LLM(kimi_ckpt, dtype="float32", max_num_seqs=300, speculative_config=ngram))
    assert kimi.sizes[-1] == 128 and kimi.verify_sizes == (1, 2, 4, 8, 16, 32)  # 32 * 4 = 128 tokens (fp32)
    small = _graphs_on(LLM(llama_ckpt, dtype="float32", max_num_seqs=3, speculative_config=ngram))
    assert small.sizes == small.verify_sizes == (1, 2, 4) and small.logits.shape[0] == 16  # 4 rows of 4 tokens
    assert small.tables.shape[0] == 4
    too_long = {"method": "ngram", "num_speculative_tokens": cuda_graph.VERIFY_MAX_TOKENS}  # 1 + k past the kernels
    assert _graphs_on(LLM(llama_ckpt, dtype="float32", max_num_seqs=3, speculative_config=too_long)).verify_sizes == ()
    assert _graphs_on(LLM(llama_ckpt, dtype="float32", max_num_seqs=3)).verify_sizes == ()


def test_verification_fill_pads_each_row_to_its_width():
    """A verification step's buffers: row r's tokens in columns r * width + i (ids, positions, slots, seq_lens),
    its columns past them and every column past the rows padding, its state slots in column r."""
    from atom.engine.scheduler_output import ScheduledRequest
    from atom.worker.cuda_graph import _PADDING, INPUT_IDS, POSITIONS, SEQ_LENS, SLOT_MAPPING, HostBlockTables, \
        fill_decode_buffers  # fmt: skip

    block_size, width = 4, 3
    rows = [ScheduledRequest("a", [5, 50, 51], 6, [7, 9, 2], 1, True, draft_token_ids=[50, 51], state_out_slot=0),
            ScheduledRequest("b", [6], 0, [3, 8], 4, True, state_out_slot=3),
            ScheduledRequest("c", [9, 90], 3, [11, 1], 8, True, draft_token_ids=[90], state_out_slot=6)]
    buffers, tables = torch.full((7, 12), 99, dtype=torch.long), torch.full((4, 6), 99, dtype=torch.long)
    ids = [t for s in rows for t in s.token_ids]
    size = fill_decode_buffers(buffers, tables, HostBlockTables(4, 6), ids, rows, (1, 2, 4), block_size, width)
    assert size == 4
    pad = dict(enumerate(_PADDING))
    want = {  # columns 0-2 row a, 3-5 row b, 6-8 row c, 9-11 padding
        INPUT_IDS: [5, 50, 51, 6, pad[0], pad[0], 9, 90] + [pad[0]] * 4,
        POSITIONS: [6, 7, 8, 0, pad[1], pad[1], 3, 4] + [pad[1]] * 4,
        SLOT_MAPPING: [9 * 4 + 2, 9 * 4 + 3, 2 * 4 + 0, 3 * 4 + 0, -1, -1, 11 * 4 + 3, 1 * 4 + 0] + [-1] * 4,
        SEQ_LENS: [7, 8, 9, 1, 0, 0, 4, 5] + [0] * 4,
    }
    for r, values in want.items():
        assert buffers[r].tolist() == values, r
    for r, values in {cuda_graph.STATE_SLOTS: [1, 4, 8], cuda_graph.STATE_OUT_SLOTS: [0, 3, 6],
                      cuda_graph.HAS_INITIAL_STATE: [1, 0, 1]}.items():  # fmt: skip
        assert buffers[r].tolist() == values + [pad[r]] * 9, r
    for i, s in enumerate(rows):
        assert tables[i, :3].tolist() == s.block_ids + [0] * (3 - len(s.block_ids)), i


class ContinuationDrafter(Drafter):
    """Proposes the next k tokens of a known run of each prompt, one of them made wrong in turn (so steps
    accept 0 .. k drafts), fewer where the run ends (so rows of one step have different numbers of drafts).
    ``by_history``: the draft made wrong is ``len(history) % (k + 1)``, so a row's drafts depend on its own history
    only, whatever the batch (else it turns with every row drafted)."""

    def __init__(self, k: int, runs: list[list[int]], by_history: bool = False) -> None:
        self.k, self.runs, self.calls, self.by_history = k, runs, 0, by_history

    def propose(self, ctx) -> dict[str, list[int]]:
        out = {}
        for rid in ctx.emitted:
            history = ctx.token_history[rid]
            run = next((r for r in self.runs if r[: len(history)] == history), None)
            # a run left (a sampled row's tokens differ from the plain run's): its last k tokens again
            drafts = history[-self.k :] if run is None else run[len(history) : len(history) + self.k]
            self.calls += 1
            wrong = (len(history) if self.by_history else self.calls) % (self.k + 1)
            if wrong < len(drafts):
                drafts[wrong] += 1
            out[rid] = drafts
        return out


@pytest.mark.parametrize("kind, spec", [
    ("kimi", {"method": "mtp", "num_speculative_tokens": 2}),
    ("kimi", {"method": "mtp", "num_speculative_tokens": 3, "scripted": True}),
    ("llama", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}),
], ids=["kimi_mtp", "kimi_scripted", "llama_ngram"])
def test_verification_steps_on_the_graphs_match_eager(tmp_path, kernel_shaped_layers, kind, spec):
    """Steps with drafts replay verification graphs (rows padded to 1 + k tokens: rows with fewer drafts, or
    none, too) and take every logit from the graph. Greedy rows, a seeded sampled row and a penalised row
    get the tokens of the same engine run eagerly; greedy rows those of plain decoding."""
    if kind == "kimi":
        path = checkpoints.add_mtp_weights(checkpoints.make_kimi_checkpoint(str(tmp_path), "kda_mla"))
    else:
        path = checkpoints.make_llama_checkpoint(str(tmp_path), "llama", tokenizer=False)
    spec = dict(spec)
    scripted = spec.pop("scripted", False)
    prompts = [[3, 4, 5], REPETITIVE, list(range(20, 45)), [7] * 8, [11]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
              greedy, SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)]
    kwargs = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64, "speculative_config": spec}

    def run(llm: LLM) -> list[list[int]]:
        if scripted and llm.engine.runner.drafter is not None:
            llm.engine.runner.drafter = ContinuationDrafter(spec["num_speculative_tokens"], runs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    plain = run(LLM(path, dtype="float32", max_num_seqs=8))
    runs = [p + out for p, out in zip(prompts, plain)]
    eager_llm = LLM(path, **kwargs)
    eager = run(eager_llm)
    assert [eager[i] for i in (0, 1, 3, 4)] == [plain[i] for i in (0, 1, 3, 4)]
    llm = LLM(path, **kwargs)
    graphs, outside = _on_graphs_counting_logits(llm, lambda graphs, rows: graphs.covers_verification(rows))
    assert run(llm) == eager
    width = 1 + spec["num_speculative_tokens"]
    assert graphs.widths.count(width) >= 3 and 1 in graphs.widths  # verification steps and plain decode steps
    assert outside and not any(outside), "a verification step on the graphs computed logits outside the graph"
    sched = llm.engine.scheduler
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (eager_llm.engine.scheduler.num_draft_tokens,
                                                                   eager_llm.engine.scheduler.num_accepted_tokens)
    assert sched.num_accepted_tokens > 0 or spec["method"] == "mtp" and not scripted  # random MTP weights
    assert llm.engine.all_resources_free()


def test_verification_graphs_cover_only_steps_of_one_token_and_up_to_k_drafts_a_row(llama_ckpt):
    """A step replays a verification graph when some row has drafts and every row brings one token and at most
    k drafts, without prompt logprobs, within the largest verification size; anything else runs eagerly."""
    from dataclasses import replace

    from atom.engine.scheduler_output import ScheduledRequest

    graphs = _graphs_on(LLM(llama_ckpt, dtype="float32", max_num_seqs=4,
                            speculative_config={"method": "ngram", "num_speculative_tokens": 2}))  # fmt: skip

    def row(i: int, drafts: list[int], tokens: int = 1) -> ScheduledRequest:
        return ScheduledRequest(f"r{i}", [3] * tokens + drafts, 10, [1, 2], -1, True, draft_token_ids=drafts)

    drafted, plain = row(0, [5, 6]), row(1, [])
    assert graphs.covers_verification([drafted, plain, row(2, [7])])
    assert not graphs.covers_verification([plain, row(2, [])])  # no drafts: a decode step (graphs.covers)
    assert not graphs.covers_verification([drafted, row(1, [5, 6, 7])])  # more than k drafts
    assert not graphs.covers_verification([drafted, row(1, [], tokens=4)])  # a prefill chunk
    assert not graphs.covers_verification([drafted, replace(plain, prompt_logprobs=True)])
    assert not graphs.covers_verification([row(i, [5]) for i in range(5)])  # more rows than the largest size
    assert graphs.verify_sizes == (1, 2, 4)
