"""OpenAI request schemas (msgspec) and their translation into ``SamplingParams``.

Decoding with msgspec gives a typed request or a precise error ("Expected
`int | null`, got `str` - at `$.max_tokens`"); everything a user can get
wrong becomes an ``APIError`` that the server turns into an OpenAI-style
``{"error": {"message", "type", "param", "code"}}`` body.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from atom.sampling_params import SamplingParams


class APIError(Exception):
    """An error the client caused (4xx) or we report deliberately (5xx), shown as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints: OpenAI's plus vLLM's extensions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    # P/D disaggregation, as in vLLM: {"do_remote_decode": true} asks a producer to keep the prompt's KV
    # and return where it is; a consumer gets the producer's returned params and loads from there.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None


# -- decoding -------------------------------------------------------------------------------

_PATH_RE = re.compile(r"at `\$\.(\w+)")  # the top-level field of a nested error path
_FIELD_RE = re.compile(r"field `(\w+)`")  # a missing top-level field


def decode(raw: bytes, schema: type[msgspec.Struct]) -> Any:
    """Decode a request body into ``schema``; malformed or mistyped bodies raise a 400 APIError."""
    try:
        return msgspec.json.decode(raw, type=schema)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.startswith("Expected `object`") and "at `$" not in message:
            raise APIError(400, "the request body must be a JSON object") from None
        match = _PATH_RE.search(message) or _FIELD_RE.search(message)
        param = match.group(1) if match else None
        raise APIError(400, f"invalid request: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(400, f"the model {requested!r} is not served here; use {served!r} (GET /v1/models lists it)",
                       param="model", code="model_not_found")


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """One prompt: a string, a list of token ids, or a one-element list of either."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_token_id(prompt[0]):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "the prompt is empty; pass at least one token", param="prompt")
        if all(_is_token_id(t) for t in prompt):
            return prompt
        if all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(400, f"a batch of {len(prompt)} prompts is not supported; send one prompt per request",
                           param="prompt")
    raise APIError(400, "prompt must be a string, a list of token ids, or a list holding one of those",
                   param="prompt")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- sampling parameters ------------------------------------------------------------------

def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    _reject_unsupported(req)
    if req.echo:
        raise APIError(400, "echo=true is not supported; drop it and prepend the prompt yourself", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported (no fill-in-the-middle); drop it", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError(400, f"best_of={req.best_of} is not supported; use best_of=1", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, f"logprobs={req.logprobs} must be in [0, 20]", param="logprobs")
    return _sampling_params(req, req.max_tokens, req.logprobs)


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    _reject_unsupported(req)
    if req.tools:
        raise APIError(400, "tools are not supported by this server; drop 'tools'", param="tools")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs={req.top_logprobs} must be in [0, 20]", param="top_logprobs")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return _sampling_params(req, max_tokens, num_logprobs)


def _reject_unsupported(req: SamplingFields) -> None:
    if req.n != 1:
        raise APIError(400, f"n={req.n} is not supported; this server returns one choice per request, use n=1",
                       param="n")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported; drop it", param="logit_bias")


_DEFAULTS = SamplingParams()
_PARAM_NAME_RE = re.compile(r"^(\w+)=")


def _sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    def pick(value, default):
        return default if value is None else value

    if req.stop is not None and "" in ([req.stop] if isinstance(req.stop, str) else req.stop):
        raise APIError(400, "stop strings must not be empty", param="stop")
    try:
        return SamplingParams(
            temperature=pick(req.temperature, _DEFAULTS.temperature),
            top_p=pick(req.top_p, _DEFAULTS.top_p),
            top_k=pick(req.top_k, _DEFAULTS.top_k),
            min_p=pick(req.min_p, _DEFAULTS.min_p),
            seed=req.seed,
            presence_penalty=pick(req.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as exc:
        match = _PARAM_NAME_RE.match(str(exc))
        raise APIError(400, str(exc), param=match.group(1) if match else None) from None
