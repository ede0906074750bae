"""The OpenAI layer called the way a batch runner calls it: body dicts in, no HTTP."""

from __future__ import annotations

import pytest

from app.openai.chat import chat_prompt_ids
from app.openai.complete import complete
from app.openai.errors import APIError
from app.openai.prepare import SEED_SPACE, Route, choice_seed
from app.openai.schemas import ChatMessage
from engine.request import RequestClass
from tests.app.fakes import FakeEngine, Script, chat_tokenizer
from tests.app.openai.layer import CountingTokenizer, chat, make_layer


async def refused(layer, body, route=Route.CHAT, status=400) -> APIError:
    with pytest.raises(APIError) as err:
        await layer.prepare(route, body, headers={}, request_id="r1")
    assert err.value.status == status, err.value.payload()
    assert set(err.value.payload()["error"]) == {"message", "type", "param", "code"}
    return err.value


async def test_chat_body_becomes_engine_requests_and_a_rendered_response():
    layer, engine = make_layer(FakeEngine(script=Script(pieces=("Hi", " you"))))
    job = await layer.prepare(
        "/v1/chat/completions", chat(n=2, temperature=0.5, max_tokens=7, user="ann"),
        headers={"x-firstlight-class": "bulk"}, request_id="line-7",
    )  # fmt: skip
    expected = chat_prompt_ids(chat_tokenizer(), [ChatMessage(role="user", content="Hello")])
    assert [r.request_id for r in job.requests] == ["line-7-0", "line-7-1"]
    assert all(r.prompt_token_ids == expected for r in job.requests)
    assert all(r.request_class is RequestClass.BULK for r in job.requests)
    assert job.requests[0].sampling.max_tokens == 7 and job.requests[0].sampling.temperature == 0.5
    assert job.tags == {"user": "ann"} and not job.stream

    response = await complete(job)
    assert response["object"] == "chat.completion" and response["id"] == "chatcmpl-line-7"
    assert [c["message"]["content"] for c in response["choices"]] == ["Hi you", "Hi you"]
    assert response["usage"]["prompt_tokens"] == len(expected)
    assert [r.request_id for r in engine.requests] == ["line-7-0", "line-7-1"]


async def test_completion_body_renders_text_completion():
    layer, _ = make_layer()
    job = await layer.prepare(
        Route.COMPLETIONS, {"prompt": ["Hello", "Thanks"], "max_tokens": 3}, headers={},
        request_id="b",
    )  # fmt: skip
    response = await complete(job)
    assert response["object"] == "text_completion"
    assert [c["text"] for c in response["choices"]] == ["Hello there!", "Hello there!"]


async def test_unknown_url_model_and_bad_fields_are_typed_errors():
    layer, engine = make_layer()
    assert (await refused(layer, chat(), route="/v1/embeddings")).param == "url"
    error = await refused(layer, chat(model="gpt-17"), status=404)
    assert error.code == "model_not_found"
    assert (await refused(layer, chat(top_p=5))).param == "top_p"
    assert (await refused(layer, {"model": "demo"})).param == "messages"
    assert (await refused(layer, chat(n=17))).param == "n"
    assert engine.requests == []


async def test_sampling_is_validated_before_any_tokenization():
    tokenizer = CountingTokenizer()
    layer, _ = make_layer(tokenizer=tokenizer)
    for field, value in (("top_p", 5), ("temperature", -1), ("min_tokens", 500)):
        error = await refused(layer, chat(**{field: value}))
        assert error.param == field
    for top in (50, -1):  # named as sent, not as the engine's `logprobs`
        assert (await refused(layer, chat(logprobs=True, top_logprobs=top))).param == "top_logprobs"
    error = await refused(layer, chat(max_completion_tokens=-3))
    assert error.param == "max_completion_tokens" and "max_completion_tokens" in error.message
    assert tokenizer.encoded == []


def test_choice_seeds_stay_in_range_and_distinct():
    assert choice_seed(7, 0) == 7 and choice_seed(7, 3) == 10
    top = SEED_SPACE - 1
    seeds = [choice_seed(top, i) for i in range(16)]
    assert len(set(seeds)) == 16 and all(0 <= s < SEED_SPACE for s in seeds)


async def test_n_with_a_seed_gives_each_choice_its_own_in_range_seed():
    layer, _ = make_layer()
    job = await layer.prepare(
        Route.CHAT, chat(n=3, seed=SEED_SPACE - 2), headers={}, request_id="s"
    )
    seeds = [r.sampling.seed for r in job.requests]
    assert seeds == [SEED_SPACE - 2, SEED_SPACE - 1, 0]


async def test_more_engine_requests_than_the_endpoint_admits_is_400_stating_the_limit():
    layer, engine = make_layer(max_requests=8)
    error = await refused(layer, {"prompt": ["a"] * 5, "n": 2}, route=Route.COMPLETIONS)
    assert error.param == "n" and "10" in error.message and "at most 8" in error.message
    error = await refused(layer, {"prompt": ["a"] * 9}, route=Route.COMPLETIONS)
    assert error.param == "prompt"
    job = await layer.prepare(
        Route.COMPLETIONS, {"prompt": ["a"] * 4, "n": 2}, headers={}, request_id="ok"
    )
    assert len(job.requests) == 8 and engine.requests == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("logit_bias", {"50256": -100}),
    ],
)
async def test_unimplemented_fields_asking_for_something_are_400(field, value):
    layer, _ = make_layer()
    error = await refused(layer, chat(**{field: value}))
    assert (error.param, error.code) == (field, "unsupported_parameter")


async def test_unimplemented_fields_at_their_defaults_are_accepted():
    layer, _ = make_layer()
    body = chat(tools=[], tool_choice="none", functions=None, function_call="auto",
                response_format={"type": "text"}, logit_bias={})  # fmt: skip
    job = await layer.prepare(Route.CHAT, body, headers={}, request_id="d")
    assert len(job.requests) == 1


async def test_developer_role_is_a_system_message():
    layer, _ = make_layer()
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    job = await layer.prepare(Route.CHAT, chat(messages=messages), headers={}, request_id="dev")
    prompt = chat_tokenizer().decode(job.requests[0].prompt_token_ids)
    assert "<|system|>Be brief.<|end|><|user|>Hi" in prompt and "developer" not in prompt


async def test_body_dicts_are_checked_like_http_bodies():
    layer, _ = make_layer()
    nested: object = "x"
    for _ in range(100):
        nested = [nested]
    assert "nested" in (await refused(layer, chat(metadata={"deep": nested}))).message
    error = await refused(layer, chat(messages=[{"role": "user", "content": "a\ud800b"}]))
    assert error.param == "messages[0].content"


async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing():
    tokenizer = CountingTokenizer()
    layer, _ = make_layer(tokenizer=tokenizer)
    huge = "Hello there! " * 300_000  # 3.9 MB
    error = await refused(layer, {"prompt": huge}, route=Route.COMPLETIONS)
    assert (error.param, error.code) == ("prompt", "context_length_exceeded")
    error = await refused(layer, chat(messages=[{"role": "user", "content": huge}]))
    assert (error.param, error.code) == ("messages", "context_length_exceeded")
    assert tokenizer.encoded == []


async def test_places_the_early_check_took_go_back_when_a_request_fails_after_it():
    """The check holds a place per engine request until it starts: a body refused after the
    check (here, prompts that cannot fit) gives every one of them back; a good one keeps
    them for its engine requests."""
    layer, engine = make_layer()
    huge = "Hello there! " * 300_000
    await refused(layer, {"prompt": ["ok", huge], "n": 3}, route=Route.COMPLETIONS)
    assert engine.released == 6  # 2 prompts × n=3
    await refused(layer, chat(messages=[{"role": "user", "content": huge}], n=2))
    assert engine.released == 8
    await layer.prepare(Route.CHAT, chat(n=2), headers={}, request_id="r2")
    assert engine.released == 8
