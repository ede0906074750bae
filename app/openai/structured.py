"""`response_format` (and the `guided_*` fields benchmark tools send) → an engine `Grammar`.

    {"type": "text"}                                   no grammar
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                       an instance of `schema` (a missing
                                                       schema means any JSON object)
    guided_json (schema) | guided_regex | guided_choice (list of strings) | guided_grammar
    (llguidance Lark)                                  vLLM's extra fields, same grammars

At most one of them may ask for a grammar. A schema is checked against the JSON Schema
meta-schema here (400 naming `response_format`); whether it compiles for this model's
vocabulary is checked next, before any engine work (`ModelEndpoint.check_grammar`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.openai.errors import bad_request
from engine.structured.grammar import Grammar

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def output_grammar(body: Mapping[str, Any]) -> Grammar | None:
    """The grammar the request's output must match, or None; `APIError` 400 when the
    fields are malformed."""
    found: list[Grammar] = []
    fmt = body.get("response_format")
    if fmt is not None:
        grammar = _response_format(fmt)
        if grammar is not None:
            found.append(grammar)
    for name in GUIDED_FIELDS:
        value = body.get(name)
        if value is not None:
            found.append(_guided(name, value))
    if len(found) > 1:
        raise bad_request(
            "only one of response_format, "
            + ", ".join(GUIDED_FIELDS)
            + " may constrain the output",
            found[1].param,
        )
    return found[0] if found else None


def _response_format(fmt: Any) -> Grammar | None:
    param = "response_format"
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object with a 'type'", param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object", "", param)
    if kind != "json_schema":
        raise bad_request(
            "response_format.type must be one of 'text', 'json_object', 'json_schema'",
            f"{param}.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema must be an object with 'name' and 'schema'",
            f"{param}.json_schema",
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(
            "response_format.json_schema.name must be a string", f"{param}.json_schema.name"
        )
    schema = spec.get("schema")
    if schema is None:
        return Grammar("json_object", "", param)
    return Grammar.json_schema(checked_schema(schema, f"{param}.json_schema.schema"), param)


def _guided(name: str, value: Any) -> Grammar:
    if name == "guided_json":
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request("guided_json must be a JSON schema", name) from None
        return Grammar.json_schema(checked_schema(value, name), name)
    if name == "guided_choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, str) and v for v in value)
        ):
            raise bad_request("guided_choice must be a non-empty list of non-empty strings", name)
        return Grammar.choice(value, name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string", name)
    return Grammar("regex" if name == "guided_regex" else "lark", value, name)


def checked_schema(schema: Any, param: str) -> dict[str, Any]:
    """`schema` when it is a valid JSON Schema object; 400 naming `param` otherwise."""
    import jsonschema

    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise bad_request(
            f"{param} is not a valid JSON Schema: {exc.message}"
            + (f" (at {where})" if where else ""),
            param,
        ) from None
    return schema
