"""Incremental detokenization and stop strings.

Text is decoded over a sliding window of tokens so each step costs O(window),
and a trailing replacement character (an incomplete UTF-8 sequence) is held
back until the next token completes it. Stop strings are matched on the
detokenized text; the matched stop string and anything after it never reach
the user.
"""

from __future__ import annotations

from atom.engine.request import Request

_WINDOW = 6  # tokens of left context used to decode the next piece correctly


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._offsets: dict[str, tuple[int, int]] = {}  # request id -> (prefix_offset, read_offset)

    def update(self, request: Request) -> str | None:
        """Append new text to ``request.output_text``; the stop string hit, if any."""
        if self.tokenizer is None or not request.sampling_params.detokenize:
            return None
        new_text = self._decode_new(request)
        if not new_text:
            return None
        params = request.sampling_params
        before = len(request.output_text)
        request.output_text += new_text
        for stop in params.stop or ():
            # Search only where the new text could complete a match.
            start = max(0, before - len(stop) + 1)
            idx = request.output_text.find(stop, start)
            if idx >= 0:
                cut = idx + len(stop) if params.include_stop_str_in_output else idx
                request.output_text = request.output_text[:cut]
                return stop
        return None

    def _decode_new(self, request: Request) -> str:
        tokens = request.all_token_ids
        skip = request.sampling_params.skip_special_tokens
        prefix, read = self._offsets.get(request.request_id, (max(request.num_prompt_tokens - _WINDOW, 0),
                                                              request.num_prompt_tokens))
        prefix_text = self.tokenizer.decode(tokens[prefix:read], skip_special_tokens=skip)
        full_text = self.tokenizer.decode(tokens[prefix:], skip_special_tokens=skip)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # wait for the rest of a multi-byte character
        self._offsets[request.request_id] = (read, len(tokens))
        return full_text[len(prefix_text):]

    def flush(self, request: Request) -> None:
        self._offsets.pop(request.request_id, None)
