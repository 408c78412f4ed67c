"""Continuous batching over counters.

Each request has ``num_computed_tokens`` catching up to ``num_tokens``
(prompt + outputs). A step gives each request some of its uncomputed tokens,
within a token budget (``max_num_batched_tokens``) and a request cap
(``max_num_seqs``). Prefill, chunked prefill and decode are the same thing
seen from here::

    prompt  |p p p p p p p p p p|        chunk budget 4, three steps:
    step 1   [0..4)   context 0   no sample
    step 2   [4..8)   context 4   no sample
    step 3   [8..10)  context 8   sample -> first output token
    step 4   [10..11) context 10  sample (decode)

Running requests go first (oldest first); waiting ones are admitted while
budget, blocks and state slots last. When blocks run out, the newest running
request is preempted: its blocks and slot are freed and it recomputes from
scratch later (prefix caching makes that cheap for attention-only models).
"""

from __future__ import annotations

from collections import deque

from atom.config import EngineConfig
from atom.engine.kv_cache_manager import KVCacheManager
from atom.engine.request import Request, RequestStatus
from atom.engine.scheduler_output import (
    PLACEHOLDER,
    NewRequestData,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._sent_to_runner: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0  # totals, for metrics and tests
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_rows_after_inflight = 0  # speculation with overlap: rows planned while their step ran
        # Called after each appended token: the stop string it completed, or None (set by EngineCore).
        self.text_stop = None
        # P/D: the connector's scheduler half (see atom/kv_transfer/base.py), and the
        # requests whose prompt KV is arriving from a producer (WAITING_FOR_REMOTE_KV).
        self.connector = None
        self.loading: dict[str, Request] = {}

    # -- admission and removal ---------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Abort or stop a request wherever it is; frees its blocks and slots at once, except
        while a remote load may still write into them, or when a connector holds them for a
        consumer to pull (both freed later, by apply_connector_output)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._sent_to_runner.discard(request_id)
        self._finished_since_last_step.add(request_id)
        if request_id in self.loading:
            self.connector.cancel_load(request_id)
            return request
        delay_free = False
        if self.connector is not None:
            delay_free, request.kv_transfer_params_out = self.connector.request_finished(request)
        if not delay_free:
            self.kv.free(request)
        return request

    # -- P/D: remote prompt KV ---------------------------------------------------
    def _start_remote_load(self, request: Request) -> bool:
        """Consumer: allocate for a prompt computed elsewhere and wait for it. False: no room yet."""
        if not self.kv.allocate_state(request):
            return False
        if self.kv.allocate_slots(request, request.num_prompt_tokens) is None:
            self.kv.free(request)
            return False
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[request.request_id] = request
        self.connector.after_alloc(request)
        return True

    def apply_connector_output(self, output) -> list[Request]:
        """Finished loads start decoding from the handed-off token; failed ones end or recompute;
        released producer holds are freed. Returns requests with new output."""
        loaded, failed, released = self.connector.update(output)
        for request in released:
            self.kv.free(request)
        changed = []
        for request_id in loaded | set(failed):
            request = self.loading.pop(request_id)
            if request.status.is_finished:  # aborted while loading: now nothing writes into it
                self.kv.free(request)
            elif request_id in failed:
                self._remote_load_failed(request, failed[request_id])
                if request.is_finished:
                    changed.append(request)  # the front end must hear it ended
            else:
                self._remote_load_done(request)
                changed.append(request)
        return changed

    def _remote_load_done(self, request: Request) -> None:
        """The blocks hold the prompt's KV and the slot the state after exactly the prompt, so
        the first sampled token is the next input: it is applied to the state once, here."""
        params = request.kv_transfer_params
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._append_tokens(request, [int(params["first_token"])], None)
        if request.status == RequestStatus.RUNNING:  # its drafts, as many as this engine verifies (maybe none)
            drafts = params.get("draft_token_ids") or []
            request.spec_token_ids = [int(t) for t in drafts[: self.config.num_speculative_tokens]]

    def _remote_load_failed(self, request: Request, error: str) -> None:
        if self.config.kv_transfer_config.kv_load_failure_policy == "recompute":  # compute it here instead
            self.kv.free(request)
            request.kv_transfer_params = None
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            return
        request.error = f"remote KV load failed: {error}"
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_connector_work(self) -> bool:
        """Loads in flight or blocks held for a consumer: the step loop must keep polling."""
        return bool(self.loading) or bool(self.connector is not None and self.connector.held_requests)

    # -- planning --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        out.num_steps = self._decode_steps()
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids and out.num_steps == 1:
            self._schedule_waiting(out, budget)
        return out

    def _decode_steps(self) -> int:
        """Multi-step decoding: how many decode steps this round runs (1: an ordinary step).

        More than one only when every running request is a plain decode, nobody
        waits who could be admitted, no request would pass its max_tokens or
        max_model_len within the steps, and the blocks for all of them are free
        (so nobody is preempted for them). Requests that stop early (EOS, stop
        strings) just have the tokens after their stop dropped by update(). With
        async scheduling the round in flight's tokens count as known (pending):
        the next round starts from its last token, which only the runner has.
        """
        steps = self.config.num_scheduler_steps
        if steps == 1 or not self.running:
            return 1
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return 1  # admit first: a prefill mixes with ordinary decode steps
        for request in self.running:
            if request.status != RequestStatus.RUNNING or request.spec_token_ids:
                return 1
            # with async scheduling a round may still be in flight: its tokens count as known
            known = request.num_tokens + request.num_pending_tokens
            if known - request.num_computed_tokens != 1:
                return 1  # still prefilling
            steps = min(steps, self.config.max_model_len - known)
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                steps = min(steps, max_tokens - request.num_output_tokens - request.num_pending_tokens)
            if steps <= 1:
                return 1
        needed = sum(self.kv.num_new_blocks(request, steps) for request in self.running)
        return steps if needed <= self.kv.num_free_blocks else 1

    def _reaches_length(self, request: Request, ahead: int = 0) -> bool:
        """Whether the request, with ``ahead`` more tokens, is at its max_tokens or max_model_len:
        finished (FINISHED_LENGTH) whatever those tokens are."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and request.num_output_tokens + ahead >= max_tokens:
            return True
        return request.num_tokens + ahead >= self.config.max_model_len

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        known = request.num_tokens + request.num_pending_tokens
        return min(known - request.num_computed_tokens, budget)

    def _drafts_for(self, request: Request, n: int, budget: int) -> list[int]:
        """Drafts to verify this step: only for a decode (one known token left), and only
        as many as the budget, max_model_len and max_tokens leave room for."""
        drafts = request.spec_token_ids
        request.spec_token_ids = []
        if not drafts or n != 1 or request.num_pending_tokens:
            return []
        room = min(budget - 1, self.config.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return drafts[: max(room, 0)]

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        lookahead = self.config.num_speculative_tokens  # room for chained draft positions
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or budget == 0:
                continue
            if request.num_pending_tokens and request.kv_transfer_params:
                continue  # P/D: a producer's state must stay at the prompt boundary for the handoff
            if request.num_pending_tokens and lookahead:
                budget = self._schedule_after_inflight(request, out, budget)
                continue
            if request.num_pending_tokens and self._reaches_length(request, request.num_pending_tokens):
                continue  # the step in flight samples its last token: a step now would be thrown away
            n = self._num_new_tokens(request, budget)
            if n <= 0:
                continue
            drafts = self._drafts_for(request, n, budget)
            ahead = lookahead + out.num_steps - 1  # positions written before the next round
            while self.kv.allocate_slots(request, n + len(drafts) + ahead) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            self._emit(request, n, out, drafts)
            budget -= n + len(drafts)
        return budget

    def _schedule_after_inflight(self, request: Request, out: SchedulerOutput, budget: int) -> int:
        """Speculation with overlap: the request's next verification, planned while the step that samples its
        next token runs. That step emits 1 to 1 + its drafts tokens, so the next input (the token it emits last,
        then the drafts proposed after it) and where it starts are unknown here: the row holds placeholders and
        assumes every draft in flight is accepted (``ScheduledRequest.after_inflight``; the runner moves it back
        by the drafts rejected), and blocks are reserved for that most.

        Planned only where k drafts fit however many tokens the step in flight emits (max_tokens,
        max_model_len, the budget): elsewhere the request waits for that step, and its next step is planned
        as without overlap, so a row verifies the same drafts either way (and a seeded row draws the same)."""
        lookahead = self.config.num_speculative_tokens
        emits = 1 + request.num_inflight_drafts  # the most tokens the step in flight emits
        if (request.num_pending_tokens != 1 or budget < 1 + lookahead
                or self._reaches_length(request, emits + lookahead)):
            return budget
        while self.kv.allocate_slots(request, 1 + 2 * lookahead) is None:  # the drafts and the chain past them
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return budget
        self._emit(request, 1, out, [PLACEHOLDER] * lookahead, after_inflight=True)
        self.num_rows_after_inflight += 1
        return budget - 1 - lookahead

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.connector is not None and request.num_computed_tokens == 0 and \
                    self.connector.num_remote_tokens(request):
                if self._start_remote_load(request):
                    continue
                break
            cached_blocks, num_cached = self.kv.get_computed_blocks(request)
            n = request.num_tokens - num_cached
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_state(request):
                break
            lookahead = self.config.num_speculative_tokens
            if self.kv.allocate_slots(request, n + lookahead, cached_blocks) is None:
                self.kv.free(request)
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._emit(request, n, out)
            budget -= n

    def _emit(self, request: Request, n: int, out: SchedulerOutput, drafts: list[int] = (),
              after_inflight: bool = False) -> None:  # fmt: skip
        start = request.num_computed_tokens
        if request.request_id not in self._sent_to_runner or start == 0:
            # First schedule, or resuming after preemption: (re)send the request in full.
            self._sent_to_runner.add(request.request_id)
            out.new_requests.append(
                NewRequestData(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                               list(request.output_token_ids))
            )
        tokens = request.token_ids_between(start, start + n)
        tokens += [PLACEHOLDER] * (n - len(tokens))  # sampled by the step in flight
        sample = after_inflight or start + n == request.num_tokens + request.num_pending_tokens
        base = -1 if request.state_slot is None else request.state_slot
        # after the step in flight with every draft accepted, the state sits at its last draft's offset
        offset = request.num_inflight_drafts if after_inflight else request.state_offset
        out.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=tokens + list(drafts),
                context_len=start,
                block_ids=list(request.block_ids),
                state_slot=base if base < 0 else base + offset,
                sample=sample,
                prompt_logprobs=request.wants_prompt_logprobs and start < request.num_prompt_tokens,
                draft_token_ids=list(drafts),
                state_out_slot=base,
                after_inflight=after_inflight,
            )
        )
        # Drafts count as computed now; update() takes back the rejected ones. A multi-step
        # round computes its num_steps - 1 further tokens too (the last one sampled is not).
        request.num_computed_tokens += n + len(drafts) + out.num_steps - 1
        request.num_pending_tokens += out.num_steps if sample else 0  # tokens the step in flight will sample
        request.num_inflight_drafts = len(drafts)
        request.state_offset = 0

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        if request.num_pending_tokens:  # an in-flight sample for it is discarded
            out.discarded_req_ids.add(request.request_id)
        request.num_pending_tokens = 0
        request.spec_token_ids = []
        request.state_offset = 0
        request.num_inflight_drafts = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        out.preempted_req_ids.add(request.request_id)

    # -- results ---------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Append sampled tokens and apply token-level stops; the requests that changed."""
        changed = []
        for s in sched.scheduled:
            request = self.requests.get(s.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if s.request_id in result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs[s.request_id])
            tokens = result.sampled.get(s.request_id) if s.sample else None
            if tokens is None:
                self.kv.cache_full_blocks(request)
                continue
            request.num_pending_tokens -= sched.num_steps
            if s.draft_token_ids:
                self._account_verification(request, s, len(tokens) - 1, result.num_drafts.get(s.request_id))
            self.kv.cache_full_blocks(request)
            changed.append(request)
            self._append_tokens(request, tokens, result.logprobs.get(s.request_id))
            if request.status == RequestStatus.RUNNING and not request.num_pending_tokens:
                # (with a step after this one in flight, the runner has already given it these drafts)
                request.spec_token_ids = result.draft_token_ids.get(s.request_id, [])
        return changed

    def _account_verification(self, request: Request, s: ScheduledRequest, accepted: int,
                              verified: int | None = None) -> None:  # fmt: skip
        """Rejected drafts were never really computed; the state after the last accepted
        token sits at offset ``accepted`` of the request's slot group. ``verified``: the drafts
        the runner had for a row planned with placeholder drafts (``after_inflight``), which may
        be fewer than the positions planned; the positions past them were not computed either."""
        verified = len(s.draft_token_ids) if verified is None else verified
        request.num_computed_tokens -= len(s.draft_token_ids) - accepted
        request.state_offset = accepted
        if not verified:
            return
        request.num_draft_tokens += verified
        request.num_accepted_tokens += accepted
        request.num_verify_steps += 1
        self.num_draft_tokens += verified
        self.num_accepted_tokens += accepted

    def _append_tokens(self, request: Request, tokens: list[int], logprobs) -> None:
        """Append one token at a time, so a stop inside an accepted draft run cuts exactly
        where plain decoding would."""
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            if logprobs is not None:
                request.logprobs.append(logprobs[i])
            stop_str = self.text_stop(request) if self.text_stop is not None else None
            status = self._check_stop(request, token)
            if status is None and stop_str is not None:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop_str
            if status is not None:
                self.finish_request(request.request_id, status)
                return

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self._reaches_length(request):
            return RequestStatus.FINISHED_LENGTH
        return None
