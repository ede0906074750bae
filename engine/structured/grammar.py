"""`Grammar`: what a request's output must match, as plain data that crosses processes.

Kinds, and what they take as `source`:

    json_object   ""                      any JSON object (OpenAI's JSON mode)
    json_schema   the schema, JSON text   an instance of the schema
    regex         a regular expression    a full match
    choice        a JSON list of strings  exactly one of them
    lark          a Lark grammar          llguidance's Lark dialect (`%json {...}` embeds a
                                          schema); the tool-call grammars are built this way

JSON is written compactly (no whitespace between tokens): a flexible-whitespace grammar lets
a model emit newlines forever, and no client parses JSON by its layout. (The tool-call
grammars of `app.openai.tools` fix another layout, the one chat templates write calls in.)
`param` names the request parameter the grammar came from, so a grammar that fails to
compile is refused with a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine.errors import InvalidRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "lark"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "lark")
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class Grammar:
    kind: GrammarKind
    source: str = ""
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str = "response_format") -> Grammar:
        return cls("json_schema", json.dumps(schema, sort_keys=True), param)

    @classmethod
    def choice(cls, options: list[str], param: str = "guided_choice") -> Grammar:
        return cls("choice", json.dumps(options), param)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(self.param, f"unknown grammar kind {self.kind!r}")
        if not isinstance(self.source, str):
            raise InvalidRequest(self.param, "a grammar's source must be text")

    def to_llguidance(self) -> str:
        """The llguidance grammar (JSON text) of this grammar; InvalidRequest naming `param`
        when the source is malformed. Whether it compiles is `GrammarCompiler`'s check."""
        from llguidance import LLMatcher

        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(json.loads(self.source), JSON_OPTIONS)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.source)
            if self.kind == "choice":
                options = json.loads(self.source)
                if not options or not all(isinstance(o, str) and o for o in options):
                    raise InvalidRequest(self.param, f"{self.param} must be non-empty strings")
                alternatives = " | ".join(json.dumps(o) for o in options)
                return LLMatcher.grammar_from_lark(f"start: {alternatives}")
            return LLMatcher.grammar_from_lark(self.source)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(self.param, f"{self.param} is not a valid grammar: {exc}") from exc
