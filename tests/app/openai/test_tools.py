"""Tools and output grammars in the OpenAI layer (no HTTP, a scripted engine): what is
refused and how, what reaches the engine, and how replies become `tool_calls`."""

from __future__ import annotations

import json

import pytest

from app.feed import DeltaFeed
from app.openai.complete import complete
from app.openai.errors import APIError
from app.openai.prepare import Route
from app.openai.tools import ToolCallStream, parse_tools, split_tool_calls
from demo.tools import call_text
from engine.request import FinishReason
from engine.structured.compiler import GrammarCompiler
from tests.app.fakes import FakeEngine, Script, chat_tokenizer
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


async def _streamed(job) -> list[dict]:
    feed = DeltaFeed(job.endpoint.client, job.requests)
    chunks = []
    while not feed.finished:
        for index, delta in await feed.next_batch(None):
            chunk = job.renderer.chunk(index, delta)
            if chunk is not None:
                chunks.append(chunk)
    await feed.close()
    return chunks


async def test_streamed_calls_arrive_as_delta_tool_calls():
    pieces = [CALL[i : i + 3] for i in range(0, len(CALL), 3)] + [CALL.replace("A12", "B7")]
    layer, _ = make_layer(reply_engine(*pieces))
    job = await layer.prepare(
        Route.CHAT, chat(tools=[LOOKUP], stream=True), headers={}, request_id="s"
    )
    chunks = await _streamed(job)
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


def _assembled(chunks: list[dict]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """Streamed chunks → (finish_reason, content, [(name, arguments)]), as a client adds
    them up: a call's first part brings id and name, arguments concatenate."""
    content, finish, calls = "", None, {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        finish = choice["finish_reason"] or finish
        content += choice["delta"].get("content") or ""
        for part in choice["delta"].get("tool_calls", ()):
            entry = calls.setdefault(part["index"], {"name": None, "arguments": ""})
            if "id" in part:
                assert part["id"].startswith("call_") and part["type"] == "function"
                entry["name"] = part["function"]["name"]
            entry["arguments"] += part["function"]["arguments"]
    return finish, content or None, [(c["name"], c["arguments"]) for c in calls.values()]


def _whole(choice: dict) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    message = choice["message"]
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())
    ]
    return choice["finish_reason"], message["content"], calls


ORDER_CALL = [("lookup_order", '{"order_id": "A12"}')]
BROKEN = '<tool_call>{"name": "lookup_order", "arguments": {"order_id"]}}</tool_call>'
CUT = '<tool_call>{"name": "lookup_order", "arguments": {"order_id": "K4'
# What the demo model wrote when forced into compact JSON: a `</tool_call>` inside a string.
FORCED_PROBE = (
    '<tool_call>{"name":"lookup_order","arguments":{"order_id":"}}</tool_call>{"}}</tool_call>'
)
TAG_IN_STRING = (  # a call whose argument is the text of another call
    '<tool_call>{"name": "f", "arguments": '
    + json.dumps({"s": '<tool_call>{"x": 1}</tool_call>'})
    + "}</tool_call>"
)


@pytest.mark.parametrize(
    ("pieces", "finish", "expected"),
    [
        ((CALL,), FinishReason.STOP, ("tool_calls", None, ORDER_CALL)),
        (("Let me check. ", CALL, " \n"), FinishReason.STOP,
         ("tool_calls", "Let me check.", ORDER_CALL)),
        ((FORCED_PROBE,), FinishReason.STOP,
         ("tool_calls", None, [("lookup_order", '{"order_id": "}}</tool_call>{"}')])),
        # Replies the probe saw streamed with finish_reason "tool_calls" and no valid call:
        (("<tool_call>",), FinishReason.STOP, ("stop", "<tool_call>", [])),
        ((BROKEN,), FinishReason.STOP, ("stop", BROKEN, [])),
        ((CUT,), FinishReason.LENGTH, ("length", CUT, [])),
        ((CALL, CUT), FinishReason.LENGTH, ("length", CUT, ORDER_CALL)),
        (('<tool_call>{"order": 1}</tool_call>',), FinishReason.STOP,
         ("stop", '<tool_call>{"order": 1}</tool_call>', [])),
        (("x <tool_call>not json</tool_call> ", CALL), FinishReason.STOP,
         ("tool_calls", "x <tool_call>not json</tool_call>", ORDER_CALL)),
        (("<tool_call>\n", '{"name": "cancel_order", "arguments": "{\\"a\\": [1]}"}',
          "\n</tool_call>"),
         FinishReason.STOP, ("tool_calls", None, [("cancel_order", '{"a": [1]}')])),
        # a function the request did not offer: content, not a call a client would dispatch
        (("<tool_call>", '{"name": "rm_rf", "arguments": {}}', "</tool_call>"), FinishReason.STOP,
         ("stop", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [])),
        (("a < b <tool", "s> <b>"), FinishReason.STOP, ("stop", "a < b <tools> <b>", [])),
    ],
)  # fmt: skip
async def test_streamed_and_whole_replies_give_the_same_calls_content_and_finish(
    pieces, finish, expected
):
    pieces = tuple(p[i : i + 3] for p in pieces for i in range(0, len(p), 3))
    layer, _ = make_layer(FakeEngine(script=Script(pieces=pieces, finish=finish)))
    body = chat(tools=[LOOKUP, CANCEL])
    whole = await layer.prepare(Route.CHAT, body, headers={}, request_id="w")
    assert _whole((await complete(whole))["choices"][0]) == expected
    streamed = await layer.prepare(Route.CHAT, {**body, "stream": True}, headers={}, request_id="s")
    assert _assembled(await _streamed(streamed)) == expected


TEXTS = [
    "I will look that up " + CALL + " and then summarise.",
    "Checking.\n\n" + CALL + "\n" + CALL + "  done \n",
    CALL, FORCED_PROBE, BROKEN, CUT, "<tool_call>", "plain text, no call",
    "Checking.\n\n" + CALL + "\n" + CALL.replace("A12", 'B"7') + " done",
    TAG_IN_STRING,
    '<tool_call> {"name": "f", "arguments": {"n": NaN}}</tool_call>',
    '<tool_call>{"name": "f"} </tool_call  <tool_call>{"name": "g"}</tool_call>',
]  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_the_stream_parser_agrees_with_the_whole_text_however_it_is_split(text):
    content, calls = split_tool_calls(text)
    expected = (content or "", [c["function"] for c in calls])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        stream = ToolCallStream()
        outs = [stream.feed(p) for p in pieces] + [stream.feed("", final=True)]
        got = ("".join(t for t, _ in outs), [d["function"] for _, ds in outs for d in ds])
        assert got == expected, pieces
        assert stream.num_calls == len(calls)


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("I look that up " + CALL + " and then summarise.", "I look that up and then summarise."),
        ("Checking.\n\n" + CALL + "\n" + CALL + " done", "Checking.\n\ndone"),
        ("Checking." + CALL + "\n" + CALL + " done", "Checking.\ndone"),
        ("Checking." + CALL + "done", "Checking.done"),
        ("\n" + CALL + "\n\nDone.  ", "Done."),
        ("Hi " + CALL + "\n", "Hi"),
        (CALL + CALL, None),
        ("  no calls here  ", "  no calls here  "),
    ],
)  # fmt: skip
def test_the_content_is_the_text_without_its_calls_and_one_gap_where_they_stood(text, content):
    got, calls = split_tool_calls(text)
    assert got == content and len(calls) == text.count("<tool_call>")


def test_a_tool_call_tag_inside_a_string_does_not_end_the_block():
    content, [call] = split_tool_calls(TAG_IN_STRING)
    assert content is None
    assert json.loads(call["function"]["arguments"]) == {"s": '<tool_call>{"x": 1}</tool_call>'}


def test_the_stream_parser_holds_back_only_what_may_open_a_call_or_precede_one():
    stream = ToolCallStream()
    out = [stream.feed(ch) for ch in "a < b <tool"]
    assert "".join(t for t, _ in out) == "a < b"  # the space may sit before a call
    text, calls = stream.feed("", final=True)
    assert text == " <tool" and calls == []


def test_a_call_is_sent_once_whole_with_its_arguments():
    args = '{"q": "a}b{\\"c", "n": [1, {"d": 2}]}'
    body = '<tool_call>{"name": "f", "arguments": ' + args + "}</tool_call>"
    stream = ToolCallStream()
    parts = [p for ch in body[:-1] for p in stream.feed(ch)[1]]
    assert parts == []  # not before the block has closed and parsed
    [part] = stream.feed(body[-1])[1]
    assert part["index"] == 0 and part["type"] == "function"
    assert part["function"] == {"name": "f", "arguments": args}


def test_blocks_that_are_not_calls_stay_text():
    for text in (
        "x <tool_call>not json</tool_call> y",
        '<tool_call>{"name": "no spaces allowed", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    ):
        assert split_tool_calls(text) == (text, [])
    content, calls = split_tool_calls('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": "{}"}
    content, calls = split_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}


def _forced_matcher(body: dict):
    tokenizer = chat_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    grammar = parse_tools(body).grammar()
    return tokenizer, lambda: compiler.matcher(grammar)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "lookup_order"}}]
)
def test_a_forced_call_is_written_as_chat_templates_write_calls(choice):
    """The grammar takes the layout the model learned (the template's `tojson`: ", " and
    ": "), not compact JSON, and only arguments valid for the tool's `parameters`."""
    tokenizer, matcher = _forced_matcher({"tools": [LOOKUP, CANCEL], "tool_choice": choice})

    def accepts(text: str) -> bool:
        m = matcher()
        return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and (
            m.is_accepting()
        )

    assert accepts(call_text("lookup_order", {"order_id": "K4821"}))
    assert not accepts(
        '<tool_call>{"name":"lookup_order","arguments":{"order_id":"K4821"}}</tool_call>'
    )
    assert not accepts(call_text("lookup_order", {"order_id": 4821}))
    assert not accepts(call_text("lookup_order", {}))
    assert accepts(call_text("cancel_order", {"x": 1})) == (choice == "required")
    # Qwen's and Hermes' form: a newline inside the tags, and between parallel calls
    hermes = (
        '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "K4821"}}\n</tool_call>'
    )
    assert accepts(hermes)
    assert accepts(hermes + "\n" + hermes) == (choice == "required")
    assert accepts(hermes + hermes) == (choice == "required")
    assert not accepts(hermes.replace("\n", "\n\n", 1))  # one newline, not a run of them
