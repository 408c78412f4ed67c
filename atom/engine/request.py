"""A request's token history and its place in the lifecycle.

Phase is derived from counters, never stored: a request is prefilling while
``num_computed_tokens < num_prompt_tokens``. ``all_token_ids`` is the prompt
followed by every output token; the scheduler advances
``num_computed_tokens`` towards ``num_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from atom.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens being sampled by a step still in flight (overlap): known to exist, not yet known.
    num_pending_tokens: int = 0
    # Speculative decoding: drafts proposed for the next step, and which slot of the
    # request's state group holds the state valid for num_computed_tokens.
    spec_token_ids: list[int] = field(default_factory=list)
    state_offset: int = 0
    num_inflight_drafts: int = 0  # drafts (or placeholders for them) in its newest step: it emits up to 1 + these
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # first slot of this request's recurrent-state group
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Prefix-cache bookkeeping: hashes of the full blocks of all_token_ids, and how many of the request's
    # blocks have been offered to the cache (KVCacheManager.cache_full_blocks).
    block_hashes: list[int] = field(default_factory=list)
    num_offered_blocks: int = 0
    num_cached_tokens: int = 0
    # Output bookkeeping for the front end.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    output_text: str = ""
    num_sent_tokens: int = 0  # output tokens already streamed to the user
    num_sent_chars: int = 0
    first_token_time: float | None = None
    # P/D: params from the client (a consumer's producer handoff, or a producer's
    # {"do_remote_decode": true}), and the params a producer hands back.
    kv_transfer_params: dict | None = None
    kv_transfer_params_out: dict | None = None
    error: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(end - p, 0)]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None
