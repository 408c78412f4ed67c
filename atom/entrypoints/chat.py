"""Chat messages -> prompt token ids.

With a ``chat_template`` in the checkpoint's tokenizer, the template renders
the conversation (``add_generation_prompt=True``) and the text is tokenized
without adding special tokens again: the template already writes the ones the
model was trained with (BOS, role markers).

Without one, a documented fallback is used, one block per message and an
open assistant turn at the end::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

The fallback text is tokenized with the tokenizer's usual special tokens
(e.g. a BOS), since it writes none itself.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as one string; text parts are joined with newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content part type {part.get('type')!r} is not supported; send "
                             "{'type': 'text', 'text': ...} parts or a plain string")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    if not messages:
        raise ValueError("messages is empty; send at least one message")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        out.append({"role": role, "content": message_text(message.get("content"))})
    return out


def fallback_chat_text(messages: list[dict[str, str]]) -> str:
    body = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return body + "<|assistant|>\n"


def render_chat_prompt(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of the conversation, ready for the assistant's turn; ValueError on bad messages."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat messages cannot be rendered; "
                         "use /v1/completions with prompt token ids")
    messages = normalize_messages(messages)
    if not tokenizer.chat_template:
        return tokenizer.encode(fallback_chat_text(messages))
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template rejected this conversation (e.g. roles out of order)
        raise ValueError(f"the chat template could not render these messages: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=False)
