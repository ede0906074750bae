"""`/v1/chat/completions` through the ASGI app with a scripted engine."""

from __future__ import annotations

import re

from app.openai.chat import chat_prompt_ids
from app.openai.schemas import ChatMessage
from engine.request import RequestClass
from tests.app.fakes import FakeEngine, Script, chat_tokenizer, completion_tokens
from tests.app.helpers import MAX_MODEL_LEN, chat_body, make_app, make_client, parse_sse

SLOW = Script(pieces=("Hello", " there", "!"), delay_s=0.003)  # one chunk per piece


async def post_chat(engine: FakeEngine | None = None, headers=None, **body):
    app, engine = make_app(engine)
    async with make_client(app) as client:
        response = await client.post("/v1/chat/completions", json=chat_body(**body),
                                     headers=headers)  # fmt: skip
    return response, engine


async def test_non_streamed_response_shape_and_latency_breakdown():
    response, engine = await post_chat(headers={"x-request-id": "req-42"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-42"
    body = response.json()
    assert body["id"] == "chatcmpl-req-42"
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == "demo"
    assert body["choices"] == [{
        "index": 0,
        "message": {"role": "assistant", "content": "Hello there!"},
        "logprobs": None,
        "finish_reason": "stop",
    }]  # fmt: skip
    prompt_len = len(engine.requests[0].prompt_token_ids)
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt_len
    assert usage["completion_tokens"] == completion_tokens(Script())
    assert usage["total_tokens"] == prompt_len + usage["completion_tokens"]
    assert set(body["firstlight"]) == {
        *("queue_s", "prefill_s", "ttft_s", "decode_s", "e2e_s"),
        *("draft_tokens", "accepted_tokens"),
    }
    assert body["firstlight"]["draft_tokens"] == body["firstlight"]["accepted_tokens"] == 0
    assert all(v is not None and v >= 0 for v in body["firstlight"].values())
    timing = response.headers["server-timing"]
    for name in ("queue", "prefill", "ttft", "decode"):
        assert re.search(rf"\b{name};dur=\d+\.\d+", timing), timing
    assert [r.request_id for r in engine.requests] == ["req-42-0"]


async def test_request_id_is_generated_when_absent_or_unsafe():
    response, engine = await post_chat(headers={"x-request-id": "bad id\twith spaces"})
    rid = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert engine.requests[0].request_id == f"{rid}-0"


async def test_stream_framing_role_in_first_chunk_and_finish_in_last():
    response, _ = await post_chat(FakeEngine(script=SLOW), stream=True)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    chunks = parse_sse(response.content)  # exact `data: <json>\n\n` ... `data: [DONE]\n\n`
    assert len(chunks) == 3 and all(isinstance(c, dict) for c in chunks)  # no keepalives
    assert {(c["id"], c["created"], c["object"], c["model"]) for c in chunks} == {
        (chunks[0]["id"], chunks[0]["created"], "chat.completion.chunk", "demo")
    }
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "Hello"}  # role rides with text
    assert deltas[1:] == [{"content": " there"}, {"content": "!"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all("usage" not in c for c in chunks)


async def test_include_usage_adds_null_usage_and_a_final_usage_chunk():
    response, engine = await post_chat(
        FakeEngine(script=SLOW), stream=True, stream_options={"include_usage": True}
    )
    chunks = parse_sse(response.content)
    *content, last = chunks
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in content)
    assert last["choices"] == [] and last["id"] == content[0]["id"]
    prompt_len = len(engine.requests[0].prompt_token_ids)
    completion = completion_tokens(SLOW)
    assert last["usage"]["prompt_tokens"] == prompt_len
    assert last["usage"]["completion_tokens"] == completion
    assert last["usage"]["total_tokens"] == prompt_len + completion
    assert last["firstlight"]["ttft_s"] >= 0 and last["firstlight"]["e2e_s"] >= 0


async def test_n2_fans_out_and_merges_by_choice_index():
    response, engine = await post_chat(
        FakeEngine(script=SLOW), headers={"x-request-id": "fan"}, stream=True, n=2, seed=7
    )
    chunks = parse_sse(response.content)
    assert sorted(r.request_id for r in engine.requests) == ["fan-0", "fan-1"]
    assert [r.sampling.seed for r in engine.requests] == [7, 8]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(m["delta"]["content"] for m in mine) == "Hello there!"
        assert ["role" in m["delta"] for m in mine] == [True] + [False] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == "stop"

    response, engine = await post_chat(n=2)
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 2 * completion_tokens(Script())
    assert body["usage"]["prompt_tokens"] == len(engine.requests[0].prompt_token_ids)


async def test_sampling_fields_reach_the_engine():
    _, engine = await post_chat(
        stop="###", temperature=0.5, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, min_tokens=2, ignore_eos=True,
        stop_token_ids=[5, 6], max_tokens=40, max_completion_tokens=30, seed=3,
    )  # fmt: skip
    s = engine.requests[0].sampling
    assert s.stop == ("###",)
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, 20, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (s.min_tokens, s.ignore_eos, s.stop_token_ids, s.seed) == (2, True, (5, 6), 3)
    assert s.max_tokens == 30  # max_completion_tokens wins
    assert s.logprobs is None

    _, engine = await post_chat(stop=["a", "b"])
    assert engine.requests[0].sampling.stop == ("a", "b")


async def test_default_max_tokens_fill_the_context():
    _, engine = await post_chat()
    request = engine.requests[0]
    assert request.sampling.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)


async def test_fields_other_tools_send_are_accepted_and_tags_recorded():
    response, engine = await post_chat(
        stop=None, logprobs=None, service_tier="default", user="u-1",
        metadata={"feature": "search", "prompt_version": "v3", "other": "x"},
        stream_options={"include_usage": False, "continuous_usage_stats": True},
        parallel_tool_calls=False, response_format={"type": "text"}, store=False,
        some_future_field={"nested": [1, 2]},
    )  # fmt: skip
    assert response.status_code == 200, response.text
    request = engine.requests[0]
    assert request.tags == {"user": "u-1", "feature": "search", "prompt_version": "v3"}
    assert request.request_class is RequestClass.INTERACTIVE


async def test_request_class_from_header_or_service_tier():
    _, engine = await post_chat(headers={"x-firstlight-class": "bulk"})
    assert engine.requests[0].request_class is RequestClass.BULK
    _, engine = await post_chat(service_tier="flex")
    assert engine.requests[0].request_class is RequestClass.BULK
    response, engine = await post_chat(headers={"x-firstlight-class": "urgent"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-firstlight-class"
    assert engine.requests == []


async def test_content_parts_are_joined_text():
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    _, engine = await post_chat(messages=[{"role": "user", "content": parts}])
    expected = chat_prompt_ids(chat_tokenizer(), [ChatMessage(role="user", content="Hello\nworld")])
    assert engine.requests[0].prompt_token_ids == expected

    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    response, _ = await post_chat(messages=[{"role": "user", "content": [parts[0], image]}])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content[1]"


async def test_chat_logprobs_shape():
    response, _ = await post_chat(logprobs=True, top_logprobs=2)
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == "Hello there!"
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}

    response, _ = await post_chat(FakeEngine(script=SLOW), stream=True, logprobs=True)
    chunks = parse_sse(response.content)
    streamed = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert "".join(e["token"] for e in streamed) == "Hello there!"
    assert all(e["top_logprobs"] == [] for e in streamed)  # top_logprobs 0

    response, _ = await post_chat(top_logprobs=2)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_logprobs"
