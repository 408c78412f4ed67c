"""SchedulerOutput -> flat batch tensors -> model -> sampled tokens.

The runner owns the device side: the model, the cache tensors, each live
request's sampling state (params, seeded draws, tokens for penalties).
It never decides policy and never touches scheduler objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate

import numpy as np
import torch

from atom.config import EngineConfig
from atom.engine.scheduler_output import PLACEHOLDER, NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from atom.forward_context import ForwardContext, build_attention_metadata, set_forward_context, upload
from atom.layers.cache_spec import RecurrentStateSpec
from atom.models.loader import load_model
from atom.ops.cuda.fused import INPUT_IDS, pack_verification
from atom.sampling_params import SamplingParams
from atom.worker.cache_memory import CacheLayout, check_room, plan_cache
from atom.worker.cuda_graph import DecodeOutput, InputPatch, as_index, capture_decode_graphs
from atom.worker.deferred import Deferred, DeferredTokens, DeferredVerification, HostCopy, PinnedRing
from atom.worker.drafters import DraftContext, TokenHistories, make_drafter
from atom.worker.sampler import Sampler, SamplingBatch, SeedStream, compute_prompt_logprobs
from atom.worker.spec_decode import Verdict, accept_greedy, emitted_logprobs, verify_rows


def defers_tokens(config: EngineConfig, has_drafter: bool) -> bool:
    """Whether a step on the decode graphs may return before its tokens reach the host: with async
    scheduling and no drafter. With a KV connector only on a consumer whose transfers go through the host
    buffer. Its loads go out after the update of the step beside them, and an update waits for that step's
    tokens, so the step has ended on the device; its scatters also wait for the steps queued on the stream
    (staging.BlockMover). A producer's gathers, and Mooncake's own reads and writes of registered caches,
    do not follow the stream's order: there a step has finished on the device when it returns."""
    kv = config.kv_transfer_config
    if not config.async_scheduling or has_drafter:
        return False
    return kv is None or (not kv.is_producer and kv.uses_host_buffer(config.device))


@dataclass
class CachedRequestState:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stream: SeedStream | None  # a seeded request's draws
    output_token_ids: list[int] = field(default_factory=list)  # only ever appended to
    # its last step's drafts as planned, less those accepted; and the drafts proposed after it
    # (for a row planned while that step ran: ScheduledRequest.after_inflight)
    num_rejected: int = 0
    next_drafts: list[int] = field(default_factory=list)
    # with overlap, the seeded stream's draw count before its newest step: restored where the scheduler
    # throws that step's sample away (a preemption while it ran)
    draws_before: int | None = None
    _tokens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), repr=False)
    _tokens_len: int = 0

    def penalty_tokens(self) -> tuple[np.ndarray | tuple, np.ndarray | tuple]:
        """What the penalties count (``SamplingBatch``): the prompt (a repetition penalty's) and the outputs, as
        int64 arrays; empty where the request has no such penalty."""
        p = self.sampling_params
        if not p.has_penalties:
            return (), ()
        tokens, prompt = self.token_array(), len(self.prompt_token_ids)
        return tokens[:prompt] if p.repetition_penalty != 1 else (), tokens[prompt:]

    def token_array(self) -> np.ndarray:
        """The prompt and ``output_token_ids`` as one int64 array, for the penalties to count and the n-gram
        drafter to search: only the tokens appended since the last call are converted (converting a long
        history every step costs milliseconds at batch 64)."""
        prompt = len(self.prompt_token_ids)
        n, have = prompt + len(self.output_token_ids), self._tokens_len
        if n > len(self._tokens):
            grown = np.empty(max(n, 2 * len(self._tokens), 64), np.int64)
            grown[:have] = self._tokens[:have]
            self._tokens = grown
        if have < prompt:
            self._tokens[have:prompt] = self.prompt_token_ids[have:]
            have = prompt
        self._tokens[have:n] = self.output_token_ids[have - prompt :]
        self._tokens_len = n
        return self._tokens[:n]

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits: greedy, no penalties, no logprobs (the sampler's fast path)."""
        return self.sampling_params.greedy and self.chainable

    @property
    def chainable(self) -> bool:
        """Its sampled token may stay on the device: no penalties (they count the token history on the
        host) and no logprobs (they go to the host with the token). Greedy or random, seeded or not."""
        p = self.sampling_params
        return p.logprobs is None and not p.has_penalties


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        # Unseeded requests draw from the global generator: seed it, so a run is repeatable.
        torch.manual_seed(config.seed)
        self.model = model if model is not None else load_model(config)
        self.cache_specs = self.model.cache_specs()
        self.layout: CacheLayout = plan_cache(config, self.cache_specs)
        check_room(self.layout, self.device)
        self.caches = self._allocate_caches()
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.drafter = make_drafter(config, self.model)
        # captured pure-decode forwards (CUDA only; None: every step runs eagerly)
        self.decode_graphs = capture_decode_graphs(config, self.model, self.caches)
        if self.drafter is not None:
            self.drafter.capture_graphs(self.decode_graphs)
        # Async scheduling: greedy steps on the graphs return before their tokens reach the host
        # (atom/worker/deferred.py); these are the ones not yet known to be there, oldest first.
        self.defer_tokens = defers_tokens(config, self.drafter is not None)
        # speculation with overlap: verification steps on the graphs, drafted behind on the graphs too, may return
        # before their outcome reaches the host (``_verification_chains``; with async scheduling)
        self.can_defer_verification = bool(config.kv_transfer_config is None and self.drafter is not None
                                           and self.drafter.drafts_behind_graphs)
        self._deferred: list[Deferred] = []
        self.num_deferred_steps = 0  # steps that returned before their tokens reached the host
        self.num_rows_settled_on_device = 0  # rows planned after a deferred verification, filled in from it
        self._ring = PinnedRing()  # host landing buffers for sampled ids

    @property
    def defers_verification(self) -> bool:
        return self.can_defer_verification and bool(self.config.async_scheduling)

    @property
    def has_recurrent_state(self) -> bool:
        return any(isinstance(s, RecurrentStateSpec) for s in self.cache_specs.values())

    def _allocate_caches(self) -> dict[int, tuple[torch.Tensor, ...]]:
        num_slots = self.layout.num_state_groups * self.config.slots_per_request
        caches = {}
        for layer, spec in self.cache_specs.items():
            if isinstance(spec, RecurrentStateSpec):
                caches[layer] = spec.allocate(num_slots, self.device)
            else:
                caches[layer] = spec.allocate(self.layout.num_blocks, self.config.block_size, self.device)
        return caches

    # -- per-request state ---------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        if self.decode_graphs is not None:  # their block lists were freed, or are sent afresh
            self.decode_graphs.forget([*sched.finished_req_ids, *sched.preempted_req_ids,
                                       *(new.request_id for new in sched.new_requests)])  # fmt: skip
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in sched.discarded_req_ids:
            st = self.requests.get(req_id)
            if st is not None and st.draws_before is not None:
                st.stream.draws = st.draws_before
        for new in sched.new_requests:
            self.requests[new.request_id] = self._new_state(new)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        old = self.requests.get(new.request_id)
        if old is not None:  # resumed after preemption: keep the stream's position
            stream = old.stream
        elif new.sampling_params.seed is not None:
            # one draw per token it arrives with (a P/D consumer's request: the producer drew its first token), so
            # its draws go on as in one engine
            stream = SeedStream(new.sampling_params.seed, draws=len(new.output_token_ids))
        else:
            stream = None
        return CachedRequestState(new.prompt_token_ids, new.sampling_params, stream,
                                  output_token_ids=list(new.output_token_ids))

    # -- one step ----------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return RunnerOutput()
        out = RunnerOutput()
        planned = {s.request_id: len(s.draft_token_ids) for s in sched.scheduled if s.after_inflight}
        settle = self._settle_on_device(sched.scheduled, out) if planned else None
        if settle is not None:
            sched = replace(sched, scheduled=settle[0])
        elif planned:
            sched = replace(sched, scheduled=self._settle(sched.scheduled, out))
        if self.config.async_scheduling:
            self._mark_streams(sched.scheduled)
        chained = self._chains(sched)
        defer_verification = settle is not None or (self.defers_verification and self._verification_chains(sched))
        if not chained and not defer_verification:  # this step reads the host's histories: bring in the rest
            self._resolve_deferred()
        if sched.num_steps > 1:
            return self._execute_steps(sched, chained)
        rows = sched.scheduled
        hidden, starts, graph = self._forward(rows, chained, None if settle is None else settle[1])
        self._prompt_logprobs(rows, starts, hidden, out)
        together = self._greedy_together(rows)
        self._sample(rows, starts, hidden, out, defer=chained, graph=graph, skip=together)
        if defer_verification:
            self._defer_verification(rows, starts, hidden, out, graph, together, planned)
            return out
        self._verify(rows, starts, hidden, out, graph, together)
        if self.drafter is not None and out.sampled and not out.draft_token_ids:  # (drafted in _verify: none left)
            self._propose(rows, starts, hidden, out)
        if self.drafter is not None:
            self._keep_for_next_step(rows, out, planned)
        return out

    def _verification_chains(self, sched: SchedulerOutput) -> bool:
        """Whether this verification step runs ahead of the host (speculation with overlap): on a verification
        graph, every row verifying on the device (plain greedy, or with drafts and neither penalties nor
        logprobs), its next drafts drafted right behind it on the graphs. Its outcome stays on the device
        (``deferred.DeferredVerification``) for the next step, planned meanwhile, to read there."""
        rows, graphs = sched.scheduled, self.decode_graphs
        if sched.num_steps > 1 or graphs is None or not graphs.covers_verification(rows):
            return False
        for s in rows:
            st = self.requests[s.request_id]
            if not (st.plain_greedy or (s.draft_token_ids and st.chainable)):
                return False
        return self.drafter.drafts_behind(rows)

    def _settle_on_device(self, rows: list[ScheduledRequest], out: RunnerOutput):
        """Rows planned while the step before ran (``ScheduledRequest.after_inflight``) that the device can make
        right (``fused.settle_verification``): where that step's outcome is still on its way to the host and this
        step chains too (``_verification_chains``). The rows with their placeholders as zeros and the settle's
        arguments, or None (``_settle`` makes them right on the host)."""
        newest = self._deferred[-1] if self.defers_verification and self._deferred else None
        if not isinstance(newest, DeferredVerification):
            return None
        zeros, settled = [], []
        for i, s in enumerate(rows):
            if s.after_inflight:
                column = newest.columns.get(s.request_id)
                if column is None or len(s.draft_token_ids) != newest.width - 1:
                    return None
                settled.append((i, column))
                s = replace(s, token_ids=[0] * len(s.token_ids), draft_token_ids=[0] * len(s.draft_token_ids),
                            after_inflight=False)  # fmt: skip
            zeros.append(s)
        if not self._verification_chains(SchedulerOutput(scheduled=zeros)):
            return None
        for s in rows:
            if s.after_inflight:
                out.num_drafts[s.request_id] = len(s.draft_token_ids)
        self.num_rows_settled_on_device += len(settled)
        return zeros, (settled, newest)

    def _defer_verification(self, rows, starts: list[int], hidden: torch.Tensor, out: RunnerOutput, graph: DecodeOutput,
                            together: frozenset[int], planned: dict[str, int]) -> None:  # fmt: skip
        """A chained verification step (``_verification_chains``): the rows that sample verify by ``verify_rows``
        (their drafts read from the graph's inputs: some were filled in on the device), the next drafts are
        drafted behind, and each row's accepted count is found on the device as the drafter finds it. The
        outcome goes to the host without waiting (``deferred.DeferredVerification``)."""
        others = [(i, s, self.requests[s.request_id]) for i, s in enumerate(rows)
                  if s.draft_token_ids and i not in together]  # fmt: skip
        n, width = len(rows), 1 + self.decode_graphs.num_drafts
        inputs = self.decode_graphs.rows[INPUT_IDS, : n * width].view(n, width)
        targets = None
        if others:
            index = as_index([i for i, _, _ in others], self.device)
            verdict, _ = self._verify_others(others, starts, hidden, graph, proposed=inputs[index, 1:])
            targets = verdict.targets
        drafts = self._draft_behind(rows, graph, others, targets)
        # (the sampled rows' targets are written over their argmax)
        packed = pack_verification(self.decode_graphs.rows, graph.greedy, drafts, width)
        slot, host = self._ring.take(packed.numel(), pin=packed.device.type == "cuda")
        states = [self.requests[s.request_id] for s in rows]
        deferred = DeferredVerification(packed, width, [s.request_id for s in rows], states,
                                        [planned.get(s.request_id, len(s.draft_token_ids)) for s in rows], out,
                                        host)  # fmt: skip
        self._ring.lend(slot, deferred)
        self._deferred = [d for d in self._deferred if not d.resolved] + [deferred]
        self.num_deferred_steps += 1
        out.wait = deferred.resolve

    def _mark_streams(self, rows: list[ScheduledRequest]) -> None:
        """Each seeded row's draw count before this step draws (``CachedRequestState.draws_before``)."""
        for s in rows:
            st = self.requests[s.request_id]
            if s.sample and st.stream is not None:
                st.draws_before = st.stream.draws

    def _settle(self, rows: list[ScheduledRequest], out: RunnerOutput) -> list[ScheduledRequest]:
        """Rows planned while their request's step before this one ran (``ScheduledRequest.after_inflight``),
        made concrete from what that step left (``_keep_for_next_step``): input its last token and the drafts
        proposed after it (at most the planned number), context and state slot moved back by the drafts it
        rejected. ``out.num_drafts`` tells the scheduler how many drafts each verifies."""
        self._resolve_deferred()
        settled = []
        for s in rows:
            if s.after_inflight:
                st = self.requests[s.request_id]
                drafts = st.next_drafts[: len(s.draft_token_ids)]
                back = st.num_rejected
                s = replace(s, token_ids=[st.output_token_ids[-1], *drafts], draft_token_ids=drafts,
                            context_len=s.context_len - back, state_slot=s.state_slot - back if s.state_slot >= 0
                            else -1, after_inflight=False)  # fmt: skip
                out.num_drafts[s.request_id] = len(drafts)
            settled.append(s)
        return settled

    def _keep_for_next_step(self, rows: list[ScheduledRequest], out: RunnerOutput, planned: dict[str, int]) -> None:
        """What a row planned while this step ran needs of it (``_settle``): per row that sampled, its drafts
        as planned (``planned``: the placeholders of rows planned after a step in flight, which may be more than
        it verified) less those accepted, and its next drafts."""
        for s in rows:
            tokens = out.sampled.get(s.request_id)
            if tokens is None:
                continue
            st = self.requests[s.request_id]
            st.num_rejected = planned.get(s.request_id, len(s.draft_token_ids)) - (len(tokens) - 1)
            st.next_drafts = out.draft_token_ids.get(s.request_id, [])

    def _chains(self, sched: SchedulerOutput) -> bool:
        """Whether this step runs ahead of the host (deferred tokens): pure decode on the graphs, every
        row sampling without penalties or logprobs, with async scheduling and no drafter. A round of
        several steps chains greedy rows only (``_execute_steps`` samples the others on the host)."""
        rows, graphs = sched.scheduled, self.decode_graphs
        if not (self.defer_tokens and graphs is not None and graphs.covers(rows) and all(s.sample for s in rows)):
            return False
        states = [self.requests[s.request_id] for s in rows]
        if all(st.plain_greedy for st in states):
            return True
        # Sampled rows chain too: the fused sampling kernel keeps their sampler's host work small. (Graphs, and
        # so chaining, need the atom._C kernels; before that kernel, a lone top-p request ran slower chained.)
        return sched.num_steps == 1 and all(st.chainable for st in states)

    def _resolve_deferred(self) -> None:
        """Every step's tokens on the host (waits for the copies still in flight)."""
        for deferred in self._deferred:
            deferred.resolve()
        self._deferred.clear()

    def _defer(self, tokens: torch.Tensor, rows: list[ScheduledRequest], out: RunnerOutput) -> None:
        """Leave a step's tokens [k, n] on the device, their copy to the host queued behind them."""
        slot, host = self._ring.take(tokens.numel(), pin=tokens.device.type == "cuda")
        histories = [self.requests[s.request_id].output_token_ids for s in rows]
        deferred = DeferredTokens(tokens, [s.request_id for s in rows], histories, out, host)
        self._ring.lend(slot, deferred)
        self._deferred = [d for d in self._deferred if not d.resolved] + [deferred]
        self.num_deferred_steps += 1
        out.wait = deferred.resolve

    def _execute_steps(self, sched: SchedulerOutput, chained: bool) -> RunnerOutput:
        """Multi-step decoding: ``sched.num_steps`` decode steps, each row's next input being the
        token it just sampled (its blocks are allocated for all of them). Sampling runs per
        step exactly as in single steps (seeds, penalties, logprobs), so the tokens are the same."""
        rows = sched.scheduled
        out = RunnerOutput()
        states = [self.requests[s.request_id] for s in rows]
        graphs = self.decode_graphs
        if graphs is not None and graphs.covers(rows) and all(st.plain_greedy for st in states):
            # greedy on the device end to end: the steps run back to back, one copy to the host at the end
            ids, patch = self._token_ids(rows, on_device=chained)
            tokens = graphs.replay_steps(ids, rows, sched.num_steps, patch)
            if chained:
                self._defer(tokens, rows, out)
                return out
            flat, n = self._to_host(tokens.flatten()), len(rows)  # step-major
            for i, (s, st) in enumerate(zip(rows, states)):
                out.sampled[s.request_id] = flat[i::n]
                st.output_token_ids.extend(flat[i::n])
            return out
        for _ in range(sched.num_steps):
            hidden, starts, graph = self._forward(rows)
            step = RunnerOutput()
            self._sample(rows, starts, hidden, step, graph=graph)
            for s in rows:
                out.sampled.setdefault(s.request_id, []).extend(step.sampled[s.request_id])
                if s.request_id in step.logprobs:
                    out.logprobs.setdefault(s.request_id, []).extend(step.logprobs[s.request_id])
            # the state after this token now sits in the out slot
            rows = [replace(s, token_ids=step.sampled[s.request_id], context_len=s.context_len + 1,
                            state_slot=s.state_out_slot) for s in rows]  # fmt: skip
        return out

    def _forward(self, rows: list[ScheduledRequest], chained: bool = False,
                 settle=None) -> tuple[torch.Tensor, list[int], DecodeOutput | None]:  # fmt: skip
        """Hidden states [T, D] of the step's flat batch, where each row's tokens start (row i's at
        starts[i]), and on the graphs their outputs (with each token's logits and greedy token).
        A verification step on the graphs pads its rows to 1 + k tokens: starts[i] = i * (1 + k).
        ``settle``: rows the device makes right before the verification graph runs (``_settle_on_device``)."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.covers(rows):
            ids, patch = self._token_ids(rows, on_device=chained)
            graph = graphs.replay(ids, rows, patch)
            return graph.hidden, list(range(len(rows) + 1)), graph
        if graphs is not None and graphs.covers_verification(rows):
            graph = graphs.replay_verification(self._token_ids(rows)[0], rows, settle)
            width = 1 + graphs.num_drafts
            return graph.hidden, list(range(0, len(rows) * width + 1, width)), graph
        ids, _ = self._token_ids(rows)
        meta = build_attention_metadata(
            query_lens=[len(s.token_ids) for s in rows],
            context_lens=[s.context_len for s in rows],
            block_tables=[s.block_ids for s in rows],
            state_slots=[s.state_slot for s in rows],
            block_size=self.config.block_size,
            device=self.device,
            state_out_slots=[s.state_out_slot for s in rows],
            per_token_state_seqs=tuple(i for i, s in enumerate(rows) if s.draft_token_ids),
        )
        with set_forward_context(ForwardContext(meta, self.caches)):
            return self.model(upload(ids, torch.long, self.device), meta.positions), meta.query_start_loc, None

    def _token_ids(self, rows: list[ScheduledRequest], on_device: bool = False) -> tuple[list[int], InputPatch | None]:
        """The step's input ids, placeholders filled in with the token each request sampled last.

        Without ``on_device`` those tokens are on the host (``execute_model`` resolved every
        deferred step first). With it (a chained decode step: one token a row), a token of the
        newest deferred step is taken from the device, whether or not its copy has reached the
        host yet (so the path does not depend on the engine thread's timing): its id here is 0,
        and the patch (positions, device tokens) says what to write over them on the device.
        """
        newest = self._deferred[-1] if on_device and self._deferred else None
        ids: list[int] = []
        positions, columns = [], []
        for s in rows:
            if PLACEHOLDER not in s.token_ids:
                ids.extend(s.token_ids)
                continue
            column = newest.columns.get(s.request_id) if newest is not None else None  # resolved or not
            if column is not None:
                positions.append(len(ids))
                columns.append(column)
                ids.append(0)
                continue
            if newest is not None and not newest.resolved:  # not a row of the newest step: bring all home
                self._resolve_deferred()
            last = self.requests[s.request_id].output_token_ids[-1]  # its step has reached the host
            ids.extend(last if t == PLACEHOLDER else t for t in s.token_ids)
        if not positions:
            return ids, None
        last_tokens = newest.tokens[-1]
        return ids, (positions, last_tokens[as_index(columns, last_tokens.device)])

    def _sample(self, rows, starts: list[int], hidden: torch.Tensor, out: RunnerOutput, defer: bool = False,
                graph: DecodeOutput | None = None, skip: frozenset[int] = frozenset()) -> None:  # fmt: skip
        """Plain sampling: one token from the last position of each row that samples without drafts (but
        the rows in ``skip``). ``defer`` (a chained step, see ``_chains``): the tokens stay on the device.
        ``graph``: the graph's outputs, whose logits (and their argmax) were computed in the graph."""
        picked = [(i, s) for i, s in enumerate(rows) if s.sample and not s.draft_token_ids and i not in skip]
        if not picked:
            return
        last = as_index([starts[i] + len(s.token_ids) - 1 for i, s in picked], self.device)
        if graph is not None:  # a decode step's rows all picked: a slice, so views
            logits, argmax = graph.logits[last], graph.greedy[last]
        else:
            logits, argmax = self.model.compute_logits(hidden[last]), None
        states = [self.requests[s.request_id] for _, s in picked]
        greedy = all(st.plain_greedy for st in states)  # no per-row parameters to upload
        if greedy and argmax is None:
            argmax = logits.argmax(dim=-1)
        if defer:  # every row chainable: the sampler reads no token history and nothing goes to the host
            tokens = argmax if greedy else self.sampler(logits, self._batch(states)).sampled_token_ids
            self._defer(tokens.unsqueeze(0), [s for _, s in picked], out)
            return
        if greedy:
            for (_, s), st, token in zip(picked, states, self._to_host(argmax)):
                st.output_token_ids.append(token)
                out.sampled[s.request_id] = [token]
            return
        result = self.sampler(logits, self._batch(states))
        tokens = result.sampled_token_ids.tolist()
        for (_, s), st, token, lp in zip(picked, states, tokens, result.logprobs):
            st.output_token_ids.append(token)
            out.sampled[s.request_id] = [token]
            if lp is not None:
                out.logprobs[s.request_id] = [lp]

    def _batch(self, states: list[CachedRequestState]) -> SamplingBatch:
        counted = [st.penalty_tokens() for st in states]
        return SamplingBatch.from_params(
            [st.sampling_params for st in states],
            [st.stream for st in states],
            [prompt for prompt, _ in counted],
            [outputs for _, outputs in counted],
            device=self.device,
        )

    def _to_host(self, ids: torch.Tensor) -> list[int]:
        """A small int64 device tensor as a list. On a GPU it goes through a pinned buffer and
        the wait is an event's, which lets other Python threads run meanwhile (with async
        scheduling the next step is planned during it)."""
        if ids.device.type != "cuda":
            return ids.tolist()
        _, host = self._ring.take(ids.numel(), pin=True)
        return HostCopy(ids, host).wait()

    def _greedy_together(self, rows: list[ScheduledRequest]) -> frozenset[int]:
        """The rows ``_verify`` takes as one group: the plain greedy rows (no penalties, no logprobs) with
        drafts and, where there are any, the plain greedy rows that sample without drafts too (a row of
        no drafts accepts none: its token is the argmax, as ``_sample`` would give it)."""
        if not any(s.draft_token_ids for s in rows):  # (a plain decode step: nothing to look up)
            return frozenset()
        plain = [i for i, s in enumerate(rows) if (s.draft_token_ids or s.sample)
                 and self.requests[s.request_id].plain_greedy]  # fmt: skip
        return frozenset(plain) if any(rows[i].draft_token_ids for i in plain) else frozenset()

    def _verify(self, rows, starts: list[int], hidden: torch.Tensor, out: RunnerOutput,
                graph: DecodeOutput | None = None, together: frozenset[int] = frozenset()) -> None:  # fmt: skip
        """Rows with drafts: logits at their 1 + k positions (from ``graph`` where the step ran on the graphs),
        then accept/reject. The rows ``together`` (``_greedy_together``) take the argmax of one lm_head over
        their positions; the other rows with drafts (sampling, penalties, logprobs) share a second lm_head and
        ``spec_decode.verify_rows``. Everything the host needs comes back in one copy, with the next drafts
        where the drafter drafts right behind the verification (``_draft_behind``)."""
        greedy = [(i, rows[i], self.requests[rows[i].request_id]) for i in sorted(together)]
        others = [(i, s, self.requests[s.request_id]) for i, s in enumerate(rows)
                  if s.draft_token_ids and i not in together]  # fmt: skip
        if not greedy and not others:
            return
        parts = []  # int64 device tensors, copied to the host together
        if greedy:
            # each row's last 1 + k tokens: [t, d1 .. dk] (a row without drafts: its last token)
            positions = as_index(self._verified_positions(greedy, starts), self.device)
            parts.append(graph.greedy[positions] if graph is not None else
                         self.model.compute_logits(hidden[positions]).argmax(dim=-1))  # fmt: skip
        if others:
            verdict, logits = self._verify_others(others, starts, hidden, graph)
            parts += [verdict.accepted, verdict.final]
        drafts = self._draft_behind(rows, graph, others, verdict.targets if others else None) \
            if len(greedy) + len(others) == len(rows) else None  # fmt: skip
        if drafts is not None:
            parts.append(drafts.flatten())
        host = self._to_host(torch.cat(parts))
        at = 0
        for _, s, st in greedy:
            k = len(s.draft_token_ids)
            tokens = accept_greedy(s.draft_token_ids, host[at : at + k + 1])
            at += k + 1
            st.output_token_ids.extend(tokens)
            out.sampled[s.request_id] = tokens
        if others:
            n = len(others)
            accepted, final = host[at : at + n], host[at + n : at + 2 * n]
            at += 2 * n
            for (_, s, st), a, token in zip(others, accepted, final):
                out.sampled[s.request_id] = tokens = s.draft_token_ids[:a] + [token]
                st.output_token_ids.extend(tokens)
            self._emitted_logprobs(others, logits, out)
        if drafts is not None:  # depth-major: row i's at i::n
            flat, n = host[at:], len(rows)
            out.draft_token_ids = {s.request_id: flat[i::n] for i, s in enumerate(rows)}

    @staticmethod
    def _verified_positions(group, starts: list[int]) -> list[int]:
        """Each row's last 1 + k positions in the step's flat batch: ``[t, d1 .. dk]``."""
        return [p for i, s, _ in group for p in range(starts[i] + len(s.token_ids) - len(s.draft_token_ids) - 1,
                                                      starts[i] + len(s.token_ids))]  # fmt: skip

    def _verify_others(self, others, starts: list[int], hidden: torch.Tensor, graph: DecodeOutput | None,
                       proposed: torch.Tensor | None = None) -> tuple[Verdict, torch.Tensor]:  # fmt: skip
        """``verify_rows`` over the rows that do not verify by the plain argmax; also their raw logits.
        ``proposed``: their drafts on the device (``verify_rows``)."""
        positions = as_index(self._verified_positions(others, starts), self.device)
        logits = graph.logits[positions] if graph is not None else self.model.compute_logits(hidden[positions])
        params, repeats, prompts, histories = [], [], [], []
        for _, s, st in others:  # position j is sampled as if d1..dj were already outputs (penalties see them)
            k = len(s.draft_token_ids)
            params.append(st.sampling_params)
            repeats.append(k + 1)
            prompt, outputs = st.penalty_tokens()
            prompts += [prompt] * (k + 1)
            if st.sampling_params.has_penalties:
                drafts = np.asarray(s.draft_token_ids, np.int64)
                histories += [np.concatenate((outputs, drafts[:j])) for j in range(k + 1)]
            else:
                histories += [outputs] * (k + 1)  # (nothing)
        batch = SamplingBatch.from_params(params, [None] * len(params), prompts, histories, self.device, repeats)
        verdict = verify_rows(logits, batch, [s.draft_token_ids for _, s, _ in others],
                              [st.stream for _, _, st in others], proposed)
        return verdict, logits

    def _emitted_logprobs(self, others, logits: torch.Tensor, out: RunnerOutput) -> None:
        """The raw logprobs of the tokens the rows that asked for them emitted this step."""
        firsts = list(accumulate((len(s.draft_token_ids) + 1 for _, s, _ in others), initial=0))
        asked = [(first, s.request_id, st.sampling_params.logprobs)
                 for first, (_, s, st) in zip(firsts, others) if st.sampling_params.logprobs is not None]  # fmt: skip
        if not asked:
            return
        tokens = [out.sampled[request_id] for _, request_id, _ in asked]
        entries = emitted_logprobs(logits, [first for first, _, _ in asked], tokens, [num for _, _, num in asked])
        for (_, request_id, _), logprobs in zip(asked, entries):
            out.logprobs[request_id] = logprobs

    def _draft_behind(self, rows, graph: DecodeOutput | None, others, targets: torch.Tensor | None):
        """The next drafts [k, n] on the device, drafted right behind a verification graph whose rows all verify
        on the device (``Drafter.draft_after_verification``); None where the drafter does not. The rows
        ``others`` pass their targets (``Verdict.targets``), as their tokens are not the argmax's."""
        if graph is None or self.drafter is None:
            return None
        index = as_index([i for i, _, _ in others], self.device) if others else None
        return self.drafter.draft_after_verification(rows, None if index is None else (index, targets))

    def _propose(self, rows, starts: list[int], hidden: torch.Tensor, out: RunnerOutput) -> None:
        ctx = DraftContext(
            rows=rows,
            query_start_loc=starts,
            hidden_states=hidden,
            emitted=out.sampled,
            token_history=TokenHistories({s.request_id: (self.requests[s.request_id].prompt_token_ids,
                                                         self.requests[s.request_id].output_token_ids) for s in rows},
                                         lambda request_id: self.requests[request_id].token_array()),
            caches=self.caches,
            block_size=self.config.block_size,
        )
        with torch.inference_mode():
            out.draft_token_ids = self.drafter.propose(ctx)

    def _prompt_logprobs(self, rows, starts, hidden, out: RunnerOutput) -> None:
        """Logprob of prompt token p+1 from the logits at p, for the prompt positions in this chunk."""
        for i, s in enumerate(rows):
            if not s.prompt_logprobs:
                continue
            st = self.requests[s.request_id]
            prompt = st.prompt_token_ids
            first, n = s.context_len, len(s.token_ids)
            end = min(first + n, len(prompt) - 1)  # positions whose next token is a prompt token
            entries: list[dict[int, float] | None] = [None] if first == 0 else []
            if end > first:
                logits = self.model.compute_logits(hidden[starts[i] : starts[i] + end - first])
                targets = upload(prompt[first + 1 : end + 1], torch.long, self.device)
                entries.extend(compute_prompt_logprobs(logits, targets, st.sampling_params.prompt_logprobs))
            out.prompt_logprobs[s.request_id] = entries
