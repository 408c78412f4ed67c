"""RequestOutput -> OpenAI response bodies and stream chunks.

One formatter object per request holds what streaming needs between chunks:
how much text was sent and the running text offset for logprobs. Streamed
text holds back ``len(longest stop string) - 1`` characters until the
request ends, because a stop string that completes later cuts text that
would otherwise already be on the wire; so streamed chunks always
concatenate to the non-streamed text.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(out: RequestOutput) -> dict[str, int]:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Formatter:
    id_prefix = ""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, model: str, params: SamplingParams, tokenizer, return_token_ids: bool) -> None:
        self.request_id = random_id(self.id_prefix)
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.return_token_ids = return_token_ids
        self.want_logprobs = params.logprobs is not None
        self.num_top_logprobs = params.logprobs or 0
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._sent_chars = 0
        self._first = True

    # -- shared pieces ---------------------------------------------------------------------
    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def _next_text(self, out: RequestOutput) -> str:
        text = out.outputs[0].text
        end = len(text) if out.finished else len(text) - self._holdback
        if end <= self._sent_chars:
            return ""
        delta, self._sent_chars = text[self._sent_chars:end], end
        return delta

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _new_logprobs(self, out: RequestOutput, token_ids: list[int]) -> list[tuple[int, dict[int, float]]]:
        entries = out.outputs[0].logprobs or []
        end = len(out.outputs[0].token_ids)
        start = end - len(token_ids)
        return list(zip(token_ids, entries[start:end]))

    def _extras(self, choice: dict[str, Any], out: RequestOutput, token_ids: list[int]) -> dict[str, Any]:
        completion = out.outputs[0]
        choice["finish_reason"] = completion.finish_reason if out.finished else None
        choice["stop_reason"] = completion.stop_reason if out.finished else None
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _with_prompt_ids(self, body: dict[str, Any], out: RequestOutput) -> dict[str, Any]:
        if self.return_token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body

    # -- what the server calls -------------------------------------------------------------------
    def response(self, out: RequestOutput) -> dict[str, Any]:
        token_ids = list(out.outputs[0].token_ids)
        choice = self._extras(self._full_choice(out, token_ids), out, token_ids)
        body = self._envelope(self.object_name, [choice])
        body["usage"] = usage(out)
        body["kv_transfer_params"] = out.kv_transfer_params  # a P/D producer's, as in vLLM
        return self._with_prompt_ids(body, out)

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """Stream chunks for this output (possibly none while text is held back)."""
        token_ids = list(out.new_token_ids)
        text = self._next_text(out)
        chunks = self._start_chunks(out) if self._first else []
        # A token whose text is held back (a partial character, a possible stop string) still gets a
        # chunk when the client asked for token ids or logprobs, so those chunks cover every token.
        if text or out.finished or (token_ids and (self.return_token_ids or self.want_logprobs)):
            choice = self._extras(self._delta_choice(out, text, token_ids), out, token_ids)
            chunks.append(self._envelope(self.chunk_object_name, [choice]))
        if self._first and chunks:
            self._first = False
            self._with_prompt_ids(chunks[0], out)
        if out.finished:  # a finished output always yields a chunk (see the condition above)
            chunks[-1]["kv_transfer_params"] = out.kv_transfer_params
        return chunks

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage(out)
        return body

    def _start_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        return []

    def _full_choice(self, out: RequestOutput, token_ids: list[int]) -> dict[str, Any]:
        raise NotImplementedError

    def _delta_choice(self, out: RequestOutput, text: str, token_ids: list[int]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._text_offset = 0

    def _with_prompt_ids(self, body: dict[str, Any], out: RequestOutput) -> dict[str, Any]:
        # vLLM's completions put prompt_token_ids on the choice; keep that and the top-level copy.
        if self.return_token_ids and body["choices"]:
            body["choices"][0]["prompt_token_ids"] = list(out.prompt_token_ids)
        return super()._with_prompt_ids(body, out)

    def _full_choice(self, out: RequestOutput, token_ids: list[int]) -> dict[str, Any]:
        return {"index": 0, "text": out.outputs[0].text, "logprobs": self._logprobs(out, token_ids)}

    def _delta_choice(self, out: RequestOutput, text: str, token_ids: list[int]) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(out, token_ids)}

    def _logprobs(self, out: RequestOutput, token_ids: list[int]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in self._new_logprobs(out, token_ids):
            text = self.token_text(token_id)
            result["tokens"].append(text)
            result["token_logprobs"].append(entry.get(token_id))
            result["top_logprobs"].append({self.token_text(t): lp for t, lp in entry.items()})
            result["text_offset"].append(self._text_offset)
            self._text_offset += len(text)
        return result


class ChatFormatter(Formatter):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _start_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self._envelope(self.chunk_object_name, [choice])]

    def _full_choice(self, out: RequestOutput, token_ids: list[int]) -> dict[str, Any]:
        message = {"role": "assistant", "content": out.outputs[0].text}
        return {"index": 0, "message": message, "logprobs": self._logprobs(out, token_ids)}

    def _delta_choice(self, out: RequestOutput, text: str, token_ids: list[int]) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text}, "logprobs": self._logprobs(out, token_ids)}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, out: RequestOutput, token_ids: list[int]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        content = []
        for token_id, entry in self._new_logprobs(out, token_ids):
            item = self._entry(token_id, entry.get(token_id))
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[: self.num_top_logprobs]
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in top]
            content.append(item)
        return {"content": content}
