"""Fields the server does not implement are refused, never silently ignored.

A field counts as absent when it is missing, null, or holds the value that asks for nothing
(what OpenAI itself does without the field): `functions: []`, `function_call` "none" or
"auto", `logit_bias: {}`. Several client libraries send those defaults explicitly, and
refusing them would break plain chat for no reason. Any other value is a 400 naming the
field, code `unsupported_parameter`. (`tools`, `tool_choice` and `response_format` are
served: `app.openai.tools`, `app.openai.structured`; the legacy `functions` are not.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from app.openai.errors import APIError, bad_request

_NO_CHOICE = ("none", "auto")

ASKS_FOR_NOTHING: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v in _NO_CHOICE,
    "logit_bias": lambda v: v == {},
}


def check_unsupported(body: Mapping[str, Any]) -> None:
    """Raise `APIError` 400 for the first unimplemented field that asks for something."""
    for name, asks_for_nothing in ASKS_FOR_NOTHING.items():
        value = body.get(name)
        if value is not None and not asks_for_nothing(value):
            raise unsupported(name)


def unsupported(name: str) -> APIError:
    return bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
