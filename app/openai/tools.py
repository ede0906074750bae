"""`tools`, `tool_choice` and `parallel_tool_calls` on chat completions.

Tools reach the model through its chat template (`tools=` of `apply_chat_template`); the
model calls one by writing the Hermes/Qwen form, which is what most open tool-use models
and their templates speak::

    <tool_call>{"name": "lookup_order", "arguments": {"order_id": "A1234"}}</tool_call>

`tool_choice`:

* `"auto"` (the default with tools): free generation; the reply's `<tool_call>` blocks become
  `tool_calls` (a block that does not parse as a call stays text).
* `"none"`: the tools are left out of the prompt and nothing is parsed.
* `"required"` / `{"type": "function", "function": {"name": ...}}`: a grammar forces the reply
  to be tool calls (one or more, or exactly one when `parallel_tool_calls` is false or a
  function is named), each naming a given tool with arguments valid for its `parameters`.

A reply with calls finishes with `"tool_calls"`. Streamed, each call arrives as OpenAI's
`delta.tool_calls` chunks: first `{index, id, type, function: {name, arguments: ""}}`, then
the arguments' JSON text in fragments as the model writes it (`ToolCallStream`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.openai.errors import bad_request
from app.openai.structured import checked_schema
from engine.structured.grammar import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request asked of tools (None from `parse_tools` when nothing)."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description"?, "parameters"}
    choice: str  # "auto" | "required" | "none" | a function name
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` argument of the chat template (None with `tool_choice: "none"`)."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def grammar(self) -> Grammar | None:
        """The grammar of a forced choice; None for "auto" and "none"."""
        if not self.forced:
            return None
        named = [f for f in self.functions if self.choice in ("required", f["name"])]
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in named
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        repeat = "+" if self.parallel and self.choice == "required" else ""
        lark = (
            f"start: call{repeat}\n"
            f"call: {json.dumps(OPEN)} %json {json.dumps(schema)} {json.dumps(CLOSE)}\n"
        )
        param = "tool_choice" if self.choice != "required" else "tools"
        return Grammar("lark", lark, param)


def parse_tools(body: Mapping[str, Any]) -> ToolUse | None:
    """`tools`/`tool_choice`/`parallel_tool_calls` checked; 400 naming the bad one."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    return ToolUse(functions, _choice(choice, names), parallel is not False)


def _function(tool: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request("a tool must be {'type': 'function', 'function': {...}}", param)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request("a tool needs a 'function' object", f"{param}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise bad_request(
            "a function name must be 1-64 letters, digits, underscores or dashes",
            f"{param}.function.name",
        )
    out: dict[str, Any] = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise bad_request("description must be a string", f"{param}.function.description")
        out["description"] = description
    parameters = fn.get("parameters")
    if parameters is not None:
        out["parameters"] = checked_schema(parameters, f"{param}.function.parameters")
    return out


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request("tool_choice.function.name must be a string", "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names an unknown function {name!r}", "tool_choice")
        return name
    raise bad_request(
        "tool_choice must be 'auto', 'none', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply → (the content left, the tool calls). Blocks that do not parse as a
    call with a string name and object arguments stay in the content."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        content.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    content.append(text[last:])
    left = "".join(content)
    if calls:
        left = left.strip()
    return (left or None) if calls else text, calls


def _call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        arguments_text = arguments
    else:
        arguments_text = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": value["name"], "arguments": arguments_text},
    }


@dataclass(slots=True)
class _Call:
    index: int
    body: str = ""
    announced: bool = False
    args_at: int = -1  # offset in `body` where the arguments' JSON starts
    scanned: int = 0  # offset in `body` up to which the arguments were emitted
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    done: bool = False  # the arguments' JSON value ended


@dataclass(slots=True)
class ToolCallStream:
    """One streamed choice's text → (content to emit now, `delta.tool_calls` entries).

    Text that might be the start of `<tool_call>` is held back until it is known not to be;
    inside a block, the call is announced once its name is read and its arguments are
    emitted as they arrive (a JSON scanner finds where they end)."""

    pending: str = ""
    call: _Call | None = None
    num_calls: int = 0
    content_seen: bool = False
    _ids: list[str] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self.pending:
            if self.call is None:
                at = self.pending.find(OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.pending, OPEN)
                    content.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                content.append(self.pending[:at])
                self.pending = self.pending[at + len(OPEN) :]
                self.call = _Call(self.num_calls)
                self.num_calls += 1
                continue
            end = self.pending.find(CLOSE)
            piece = self.pending if end < 0 else self.pending[:end]
            if end < 0 and not final:
                keep = _partial_suffix(piece, CLOSE)
                piece = piece[: len(piece) - keep]
                self.pending = self.pending[len(piece) :]
            else:
                self.pending = "" if end < 0 else self.pending[end + len(CLOSE) :]
            self.call.body += piece
            deltas.extend(self._advance(self.call))
            if end >= 0 or final:
                self.call = None
            else:
                break
        text_out = "".join(content)
        if self.num_calls and not self.content_seen:
            text_out = text_out.strip()  # whitespace around calls is not content
        if text_out.strip():
            self.content_seen = True
        return text_out, deltas

    def _advance(self, call: _Call) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not call.announced:
            name = _NAME.search(call.body)
            if name is None:
                return out
            call.announced = True
            self._ids.append(new_call_id())
            out.append({
                "index": call.index,
                "id": self._ids[-1],
                "type": "function",
                "function": {"name": json.loads(f'"{name.group(1)}"'), "arguments": ""},
            })  # fmt: skip
        if call.args_at < 0:
            found = _ARGS.search(call.body)
            if found is None:
                return out
            call.args_at = call.scanned = found.end()
        if call.done:
            return out
        start = call.scanned
        for i in range(start, len(call.body)):
            ch = call.body[i]
            call.scanned = i + 1
            if start == i and call.depth == 0 and not call.in_string and ch.isspace():
                start = i + 1  # whitespace before the value is not part of the arguments
                continue
            if call.in_string:
                if call.escaped:
                    call.escaped = False
                elif ch == "\\":
                    call.escaped = True
                elif ch == '"':
                    call.in_string = False
                    if call.depth == 0:  # the arguments were a bare string
                        call.done = True
                        break
            elif ch == '"':
                call.in_string = True
            elif ch in "{[":
                call.depth += 1
            elif ch in "}]":
                call.depth -= 1
                if call.depth <= 0:
                    call.done = True
                    break
        fragment = call.body[start : call.scanned]
        if fragment:
            out.append({"index": call.index, "function": {"arguments": fragment}})
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
