"""A request body as the OpenAI layer accepts it: a JSON object, shallow enough to walk, whose
every string is valid Unicode.

Python's JSON parser recurses per nesting level (thousands of levels raise RecursionError)
and accepts lone surrogate escapes (`"\\ud800"`), which no tokenizer or UTF-8 encoder takes
later. Both are refused here as 400s before any other work; a surrogate names its field
(`messages[0].content`). The walk is iterative, so it cannot itself run out of stack.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from app.openai.errors import bad_request, param_from_loc

MAX_DEPTH = 32  # OpenAI bodies nest a handful of levels (tools' JSON schemas a few more)


def parse_body(raw: bytes | str) -> dict[str, Any]:
    """The JSON object in `raw`; 400 for anything else. `OpenAILayer.prepare` then applies
    `check_body` (to every body, however it arrived)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"request body is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def check_body(body: Mapping[str, Any]) -> None:
    """400 when `body` nests deeper than `MAX_DEPTH` or holds a string (value or key) that is
    not valid Unicode (a lone surrogate)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, str):
            _check_text(value, loc)
            continue
        if len(loc) >= MAX_DEPTH and isinstance(value, (dict, list)):
            raise bad_request(
                f"request body is nested more than {MAX_DEPTH} levels deep", param_from_loc(loc)
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(str(key), loc)
                stack.append((item, (*loc, key)))
        elif isinstance(value, list):
            stack.extend((item, (*loc, i)) for i, item in enumerate(value))


def _check_text(text: str, loc: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        param = param_from_loc(loc)
        where = f"{param} holds" if param else "the request body holds"
        raise bad_request(
            f"{where} a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
            "valid Unicode",
            param,
        ) from None
