"""What the engine hands back to users, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    # Only what is new since the previous output for this request (streaming).
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # P/D producer: what the consumer needs to pull
    error: str | None = None  # set when finish_reason is "error"
