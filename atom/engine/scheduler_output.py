"""Plain data passed between the scheduler and the model runner.

The runner never sees a ``Request``: it gets copies of what one step needs,
and answers with sampled tokens and logprobs keyed by request id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from atom.sampling_params import SamplingParams


PLACEHOLDER = -1  # a token sampled by the step still in flight (overlap); the runner fills it in


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled; the runner keeps it until the request finishes."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Outputs so far: non-empty when a preempted request resumes, so the runner's copy
    # (used for penalties and placeholders) matches the scheduler's exactly.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step; PLACEHOLDER = "the token you sampled last"
    context_len: int  # tokens already in the cache (num_computed_tokens before this step)
    block_ids: list[int]  # the request's whole block table
    state_slot: int  # slot holding its recurrent state before this step, -1 if the model has none
    sample: bool  # this step reaches the end of the known tokens: sample the next one
    prompt_logprobs: bool = False  # return logprobs for the prompt positions in this chunk
    # Speculative verification: token_ids ends with these drafts; the state after each
    # token j is kept in slot state_out_slot + j. Otherwise the final state goes to state_out_slot.
    draft_token_ids: list[int] = field(default_factory=list)
    state_out_slot: int = -1
    # Speculation with overlap: planned while the step that samples this row's first token ran, so
    # token_ids (that token, then the drafts proposed after it) are all PLACEHOLDER, and context_len and
    # state_slot assume that step accepted every one of its drafts. The runner fills in the tokens and moves
    # both back by the drafts that step rejected; it verifies at most len(draft_token_ids) drafts.
    after_inflight: bool = False


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # runner may drop their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # the preempted requests with a step still in flight (overlap): its sample is thrown away, so the
    # runner winds their seeded draws back to before it (their tokens do not depend on the timing)
    discarded_req_ids: set[str] = field(default_factory=set)
    # Multi-step decoding: every scheduled row is one decode token, and the runner runs this
    # many steps, feeding each sampled token back in; blocks for all of them are allocated.
    num_steps: int = 1

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    # request id -> tokens produced this step (requests scheduled with sample=True): one
    # sampled token, or with drafts the accepted drafts followed by one more sampled token
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # one entry per produced token
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # proposals for the next step
    # request id -> logprobs of the prompt positions covered this step (entry per token, None for position 0)
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)
    # rows planned ``after_inflight``: how many drafts they verified (the drafter may propose fewer)
    num_drafts: dict[str, int] = field(default_factory=dict)
    # Set when the sampled tokens are still on their way to the host (async scheduling,
    # atom/worker/deferred.py): call it before reading ``sampled``.
    wait: Callable[[], None] | None = None
