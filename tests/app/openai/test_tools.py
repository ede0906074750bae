"""Tools and output grammars in the OpenAI layer (no HTTP, a scripted engine): what is
refused and how, what reaches the engine, and how replies become `tool_calls`."""

from __future__ import annotations

import json

import pytest

from app.feed import DeltaFeed
from app.openai.complete import complete
from app.openai.errors import APIError
from app.openai.prepare import Route
from app.openai.tools import ToolCallStream, split_tool_calls
from tests.app.fakes import FakeEngine, Script
from tests.app.openai.layer import chat, make_layer

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Look up an order.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
    },
}
CANCEL = {
    "type": "function",
    "function": {"name": "cancel_order", "parameters": {"type": "object"}},
}


async def refused(layer, body, route=Route.CHAT) -> APIError:
    with pytest.raises(APIError) as err:
        await layer.prepare(route, body, headers={}, request_id="r1")
    assert err.value.status == 400, err.value.payload()
    return err.value


def _fn(**function) -> dict:
    return {"type": "function", "function": function}


def _fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


NAMED_NOPE = {"type": "function", "function": {"name": "nope"}}
JSON_MODE = {"type": "json_object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [LOOKUP], "tool_choice": NAMED_NOPE}, "tool_choice"),
        ({"tools": [LOOKUP], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [_fn(name="bad name!")]}, "tools[0].function.name"),
        ({"tools": [_fn(name="f", parameters={"type": 7})]}, "tools[0].function.parameters"),
        ({"tools": [LOOKUP, LOOKUP]}, "tools"),
        ({"tools": [LOOKUP], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": _fmt({"type": "strin"})}, "response_format.json_schema.schema"),
        ({"response_format": _fmt({"minLength": "3"})}, "response_format.json_schema.schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"response_format": JSON_MODE, "guided_regex": "a+"}, "guided_regex"),
        ({"tools": [LOOKUP], "tool_choice": "required", "response_format": JSON_MODE},
         "response_format"),
    ],
)  # fmt: skip
async def test_bad_tools_and_grammars_are_400_naming_the_parameter_before_engine_work(body, param):
    layer, engine = make_layer()
    error = await refused(layer, chat(**body))
    assert error.param == param, error.payload()
    assert engine.requests == []


async def test_grammars_reach_the_engine_only_when_asked_for():
    layer, _ = make_layer()
    plain = await layer.prepare(Route.CHAT, chat(tools=[LOOKUP]), headers={}, request_id="a")
    assert plain.requests[0].sampling.grammar is None  # "auto": free text, parsed after
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    job = await layer.prepare(Route.CHAT, chat(response_format=fmt), headers={}, request_id="b")
    grammar = job.requests[0].sampling.grammar
    assert grammar is not None and grammar.kind == "json_schema"
    assert json.loads(grammar.source) == schema
    named = {"type": "function", "function": {"name": "cancel_order"}}
    job = await layer.prepare(
        Route.CHAT, chat(tools=[LOOKUP, CANCEL], tool_choice=named), headers={}, request_id="c"
    )
    grammar = job.requests[0].sampling.grammar
    assert grammar is not None and grammar.kind == "lark" and "cancel_order" in grammar.source
    assert "lookup_order" not in grammar.source  # a named choice allows that function only
    text = await layer.prepare(
        Route.COMPLETIONS, {"prompt": "x", "guided_choice": ["a", "b"]}, headers={}, request_id="d"
    )
    assert text.requests[0].sampling.grammar.kind == "choice"


def reply_engine(*pieces: str) -> FakeEngine:
    return FakeEngine(script=Script(pieces=pieces))


CALL = '<tool_call>{"name": "lookup_order", "arguments": {"order_id": "A12"}}</tool_call>'


async def test_a_reply_with_calls_becomes_tool_calls():
    layer, _ = make_layer(reply_engine("Let me check. ", CALL[:20], CALL[20:]))
    job = await layer.prepare(Route.CHAT, chat(tools=[LOOKUP]), headers={}, request_id="t")
    choice = (await complete(job))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "lookup_order"
    assert json.loads(call["function"]["arguments"]) == {"order_id": "A12"}


async def test_tool_choice_none_leaves_the_text_alone():
    layer, _ = make_layer(reply_engine(CALL))
    job = await layer.prepare(
        Route.CHAT, chat(tools=[LOOKUP], tool_choice="none"), headers={}, request_id="n"
    )
    choice = (await complete(job))["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]


async def test_streamed_calls_arrive_as_delta_tool_calls():
    pieces = [CALL[i : i + 3] for i in range(0, len(CALL), 3)] + [CALL.replace("A12", "B7")]
    layer, _ = make_layer(reply_engine(*pieces))
    job = await layer.prepare(
        Route.CHAT, chat(tools=[LOOKUP], stream=True), headers={}, request_id="s"
    )
    feed = DeltaFeed(job.endpoint.client, job.requests)
    chunks = []
    while not feed.finished:
        for index, delta in await feed.next_batch(None):
            chunk = job.renderer.chunk(index, delta)
            if chunk is not None:
                chunks.append(chunk)
    await feed.close()
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert deltas[0]["role"] == "assistant"
    assert not any(d.get("content") for d in deltas)  # the calls are not content
    calls: dict[int, dict] = {}
    for d in deltas:
        for part in d.get("tool_calls", ()):
            entry = calls.setdefault(part["index"], {"arguments": ""})
            if "id" in part:  # the first part of a call: id, type and name
                assert "name" not in entry and part["type"] == "function"
                entry.update(id=part["id"], name=part["function"]["name"])
            entry["arguments"] += part["function"]["arguments"]
    assert [c["name"] for c in calls.values()] == ["lookup_order", "lookup_order"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [
        {"order_id": "A12"},
        {"order_id": "B7"},
    ]
    assert len({c["id"] for c in calls.values()}) == 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_stream_parser_holds_back_only_what_may_open_a_call():
    stream = ToolCallStream()
    out = [stream.feed(ch) for ch in "a < b <tool"]
    assert "".join(t for t, _ in out) == "a < b "
    text, calls = stream.feed("", final=True)
    assert text == "<tool" and calls == []


def test_arguments_are_cut_where_their_json_ends_even_with_braces_in_strings():
    args = '{"q": "a}b{\\"c", "n": [1, {"d": 2}]}'
    body = '<tool_call>{"name": "f", "arguments": ' + args + "}</tool_call>"
    stream = ToolCallStream()
    parts = [p for ch in body for p in stream.feed(ch)[1]]
    assert parts[0]["function"] == {"name": "f", "arguments": ""}
    assert "".join(p["function"]["arguments"] for p in parts) == args


def test_blocks_that_are_not_calls_stay_text():
    text = "x <tool_call>not json</tool_call> y"
    assert split_tool_calls(text) == (text, [])
    content, calls = split_tool_calls('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": "{}"}
