"""Chat messages → prompt token ids, through the tokenizer's own chat template.

The template is rendered to text and then encoded without adding special tokens again: the
template already writes BOS and the role markers, and doubling them changes the model's
input. Content given as a list of parts is joined with newlines (text parts only). The
`developer` role (OpenAI's newer name for instructions) is given to templates as `system`.
Tools go to the template as its `tools` argument; an assistant message's `tool_calls` keep
their arguments as a JSON string on the wire, but templates index into them, so they are
given as objects (when they parse).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from app.openai.errors import bad_request
from app.openai.schemas import ChatMessage


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the template, with `content` always a string."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        if item["role"] == "developer":
            item["role"] = "system"
        content = message.content
        if isinstance(content, list):
            item["content"] = "\n".join(
                _part_text(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)
            )
        elif content is None:
            item["content"] = ""
        if isinstance(item.get("tool_calls"), list):
            item["tool_calls"] = [_template_call(c) for c in item["tool_calls"]]
        out.append(item)
    return out


def _template_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def _part_text(part: dict[str, Any], param: str) -> str:
    kind = part.get("type")
    if kind != "text":
        raise bad_request(f"content part type {kind!r} is not supported (only 'text')", param)
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request("a text content part needs a string 'text'", f"{param}.text")
    return text


def chat_prompt_ids(
    tokenizer: Any, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Render `messages` with the tokenizer's chat template (generation prompt added)."""
    text = render_chat(tokenizer, messages, tools)
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat(
    tokenizer: Any, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None
) -> str:
    """The prompt text of `messages` by the tokenizer's chat template (generation prompt
    added); 400 naming `messages` when there is no template or it refuses them."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    conversation = template_messages(messages)
    try:
        text: str = tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # template errors (e.g. "roles must alternate") are the caller's
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from exc
    return text
