"""`/v1/completions`: prompt forms, batching into choices, logprobs shape."""

from __future__ import annotations

from tests.app.fakes import FakeEngine, Script, chat_tokenizer, completion_tokens
from tests.app.helpers import make_app, make_client, parse_sse

SLOW = Script(pieces=("Hello", " there", "!"), delay_s=0.003)


async def post_completion(engine: FakeEngine | None = None, **body):
    app, engine = make_app(engine)
    async with make_client(app) as client:
        response = await client.post("/v1/completions", json={"model": "demo", **body},
                                     headers={"x-request-id": "c1"})  # fmt: skip
    return response, engine


async def test_string_prompt_non_streamed():
    response, engine = await post_completion(prompt="Hello there")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "cmpl-c1" and body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "Hello there!", "logprobs": None, "finish_reason": "stop"}
    ]
    request = engine.requests[0]
    assert request.prompt_token_ids == chat_tokenizer().encode("Hello there")
    assert request.sampling.max_tokens == 16  # the completions default
    assert body["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    assert "server-timing" in response.headers


async def test_prompt_list_becomes_choices_and_n_multiplies_them():
    response, engine = await post_completion(prompt=["Hello", "Thanks for waiting"], n=2)
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [r.request_id for r in engine.requests] == ["c1-0", "c1-1", "c1-2", "c1-3"]
    prompts = [r.prompt_token_ids for r in engine.requests]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    assert body["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[2])
    assert body["usage"]["completion_tokens"] == 4 * completion_tokens(Script())


async def test_token_id_prompts_pass_unchanged_and_are_range_checked():
    _, engine = await post_completion(prompt=[7, 8, 9])
    assert engine.requests[0].prompt_token_ids == [7, 8, 9]
    _, engine = await post_completion(prompt=[[7, 8], [9]])
    assert [r.prompt_token_ids for r in engine.requests] == [[7, 8], [9]]

    response, engine = await post_completion(prompt=[7, 100_000])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert engine.requests == []


async def test_streamed_logprobs_have_running_text_offsets():
    response, _ = await post_completion(FakeEngine(script=SLOW), prompt="Hi", stream=True,
                                        logprobs=2)  # fmt: skip
    chunks = parse_sse(response.content)
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", " there", "!"]
    tokens, offsets = [], []
    for chunk in chunks:
        lp = chunk["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        assert all(isinstance(t, dict) and len(t) <= 2 for t in lp["top_logprobs"])
        tokens += lp["tokens"]
        offsets += lp["text_offset"]
    text = "".join(tokens)
    assert text == "Hello there!"
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_unsupported_options_are_clear_400s():
    for field, value in (("echo", True), ("suffix", "tail"), ("best_of", 3)):
        response, engine = await post_completion(prompt="Hi", **{field: value})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == field and field in error["message"]
        assert engine.requests == []


async def test_bad_prompt_shapes_are_400_with_param():
    for prompt in ("", [], [1, "a"], [[]], None, 5):
        response, _ = await post_completion(prompt=prompt)
        assert response.status_code == 400, prompt
        assert response.json()["error"]["param"] == "prompt", prompt
