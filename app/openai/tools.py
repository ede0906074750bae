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

A reply is read the same way streamed or not (`ToolCallStream`; `split_tool_calls` feeds it
the whole text), so both give the same calls and content. A block's end is found by reading
its JSON, never by searching for `</tool_call>`, which may sit inside a string. A reply with
at least one call finishes with `"tool_calls"`. Streamed, a call is sent once its block has
closed and parsed, as one `delta.tool_calls` entry `{index, id, type, function: {name,
arguments}}` with the whole arguments: a call is never announced and then found malformed.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.openai.errors import bad_request
from app.openai.structured import checked_schema
from engine.structured.grammar import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A forced call is JSON laid out as chat templates write calls (`tojson`, Python's
# `json.dumps`): ", " and ": " between tokens, no other whitespace. Tool-use models learned
# that layout; forced into the compact one they leave it (the demo model, made to write
# `{"order_id":"`, went on with `}}</tool_call>` inside the string).
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


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

    @property
    def names(self) -> frozenset[str]:
        """The functions a reply may call: a block naming another is content."""
        return frozenset(f["name"] for f in self.functions)

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
        schema = {**schema, "x-guidance": _CALL_JSON}
        # Qwen's and Hermes' templates put a newline inside the tags and between calls; the
        # grammar allows one there, so each model keeps the form it learned
        calls = 'call ("\\n"? call)*' if self.parallel and self.choice == "required" else "call"
        lark = (
            f"start: {calls}\n"
            f'call: {json.dumps(OPEN)} "\\n"? %json {json.dumps(schema)} "\\n"? '
            f"{json.dumps(CLOSE)}\n"
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
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
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


def split_tool_calls(
    text: str, names: frozenset[str] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply → (the content left, the tool calls): exactly what `ToolCallStream`
    streams for the same text, so a streamed and a whole reply agree. Without calls the
    content is `text` unchanged. `names`: the tools offered (None: any valid name)."""
    stream = ToolCallStream(names)
    content, deltas = stream.feed(text, final=True)
    if not deltas:
        return text, []
    calls = [{"id": d["id"], "type": "function", "function": d["function"]} for d in deltas]
    return content or None, calls


@dataclass(slots=True)
class ToolCallStream:
    """One choice's text, fed as it arrives → (content to emit now, `delta.tool_calls`).

    A block is `<tool_call>`, whitespace, a JSON object, whitespace, `</tool_call>`; its end
    is found by scanning the JSON (strings, escapes, nesting), so a `</tool_call>` inside a
    string does not end it. A block is a call when its object has a function `name` and
    object `arguments` (or a JSON string of one; none means `{}`), and the name is one of
    `names` when those are given (the tools the request offered). Only then is it emitted,
    as one entry with the id, the name and the whole arguments, and counted in `num_calls`;
    anything else (malformed JSON, no closing tag, a reply that ends inside the block) is
    content, verbatim up to where it failed, and reading goes on from there. The content is
    the text with its calls taken out, and the whitespace next to them; where calls stood
    between two pieces of text one run of whitespace stays (the one before the calls, else
    the one after), so `up <call> and` reads `up and`. Held back until
    decided: an open block, text that may begin `<tool_call>`, and trailing whitespace (a call
    may follow it)."""

    names: frozenset[str] | None = None  # the functions a call may name (None: any)
    pending: str = ""  # undecided text; an open block's from its `<tool_call>` on
    num_calls: int = 0  # calls emitted
    held: str = ""  # trailing whitespace of the content so far
    after_call: bool = False  # calls were taken out since the last piece of content
    gap: str = ""  # the whitespace that will separate the content around those calls
    emitted: bool = False  # content other than whitespace was emitted
    scan: _BlockScan | None = None  # the open block (`pending` starts with it)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self.pending:
            if self.scan is None:
                at = self.pending.find(OPEN)
                if at < 0:
                    at = len(self.pending) - (0 if final else _partial_suffix(self.pending))
                self._content(content, self.pending[:at])
                self.pending = self.pending[at:]
                if not self.pending.startswith(OPEN):
                    break  # nothing left, or what may begin a block
                self.scan = _BlockScan()
            end = self.scan.read(self.pending, final)
            if end is None:
                break  # the block goes on past the text so far
            call = self.scan.call(self.pending, self.names) if self.scan.closed else None
            if call is None:  # not a call: content up to where that was decided
                self._content(content, self.pending[:end])
            else:
                entry = {"index": self.num_calls, "id": new_call_id(), "type": "function"}
                deltas.append({**entry, "function": call})
                self.num_calls += 1
                self.gap = (self.gap or self.held) if self.emitted else ""
                self.held, self.after_call = "", True
            self.pending, self.scan = self.pending[end:], None
        if final:
            if not self.num_calls:  # no call: the text as it came
                content.append(self.held)
            self.held = ""
        return "".join(content), deltas

    def _content(self, out: list[str], text: str) -> None:
        """Adds `text` to the content, holding back its trailing whitespace."""
        if self.after_call:
            stripped = text.lstrip()
            if not stripped:  # whitespace after the calls: the gap if none came before
                if self.emitted and not self.gap:
                    self.gap = text
                return
            lead = text[: len(text) - len(stripped)]
            text = ((self.gap or lead) if self.emitted else "") + stripped
            self.after_call, self.gap = False, ""
        text = self.held + text
        kept = text.rstrip()
        self.held = text[len(kept) :]
        if kept:
            out.append(kept)
            self.emitted = True


@dataclass(slots=True)
class _BlockScan:
    """Reads one block as its text grows: where its JSON object starts and ends (brackets
    matched outside strings) and whether `</tool_call>` follows."""

    at: int = len(OPEN)  # offset up to which the block was read
    start: int = -1  # offset of the object's `{`
    end: int = -1  # offset just past the object
    brackets: str = ""  # the open ones, innermost last
    in_string: bool = False
    escaped: bool = False
    closed: bool = False  # `</tool_call>` followed the object

    def read(self, block: str, final: bool) -> int | None:
        """`block` (the text of the last call, maybe longer) → where the block is decided:
        just past `</tool_call>` (then `closed`), or where it fails to be a block; None
        while the text so far may still become one."""
        while self.at < len(block):
            ch = block[self.at]
            if self.end >= 0:  # after the object: whitespace, then the closing tag
                if ch.isspace():
                    self.at += 1
                    continue
                rest = block[self.at : self.at + len(CLOSE)]
                if rest == CLOSE:
                    self.closed = True
                    return self.at + len(CLOSE)
                if not final and CLOSE.startswith(rest):
                    return None
                return self.end
            self.at += 1
            if self.start < 0:  # before the object: whitespace, then `{`
                if ch == "{":
                    self.start, self.brackets = self.at - 1, "{"
                elif not ch.isspace():
                    return self.at - 1
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.brackets += ch
            elif ch in "}]":
                if _PAIRS[ch] != self.brackets[-1]:
                    return self.at  # mismatched: the JSON is broken here
                self.brackets = self.brackets[:-1]
                if not self.brackets:
                    self.end = self.at
        return len(block) if final else None

    def call(self, block: str, names: frozenset[str] | None) -> dict[str, str] | None:
        """The call of a whole block: {"name", "arguments" (JSON text)}; None if none (or
        it names a function outside `names`)."""
        value = _json(block[self.start : self.end])
        if not isinstance(value, dict):
            return None
        name, arguments = value.get("name"), value.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json(arguments)
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            return None
        if names is not None and name not in names:
            return None
        if not isinstance(arguments, dict):
            return None
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


_PAIRS = {"}": "{", "]": "["}


def _json(text: str) -> Any:
    """`text` parsed as JSON (control characters allowed in strings; NaN and Infinity not,
    as a client's parser refuses them); None when it is not JSON."""
    try:
        return json.loads(text, strict=False, parse_constant=_no_constant)
    except ValueError:
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _partial_suffix(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
