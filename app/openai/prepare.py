"""The OpenAI layer's entry: a request body → a `GenerationJob` (engine requests + renderer),
or an `APIError`. No HTTP: the routes of `app/openai_server.py` and a batch runner (one JSONL
line per call) share it.

    layer = OpenAILayer(endpoints, classifier, max_n=16)
    job = await layer.prepare("/v1/chat/completions", body, headers={}, request_id="line-7")
    response = await complete(job)          # app.openai.complete: the response dict

`prepare` does all the refusing before any engine work, cheapest checks first: body shape
(`app.openai.body`), unimplemented fields, schema, `n`, the model, how many engine requests
the call would create (`ModelEndpoint.max_requests`), the request class, every sampling field
through `SamplingParams.validate()`, and only then tokenization (bounded and off the event
loop, `app.openai.prompts`) and the context length. An output grammar (`response_format`,
`guided_*`, a forced `tool_choice`) is compiled for the model's vocabulary before the
prompt is tokenized. Every refusal is an `APIError` (400 for
bad input, 404 for an unknown model); nothing is sent to an engine until all passed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from app.endpoint import Endpoints, ModelEndpoint
from app.openai.body import check_body
from app.openai.errors import (
    Refused,
    bad_request,
    from_invalid,
    from_validation_errors,
    to_api_error,
)
from app.openai.prompts import encode_chat, encode_text
from app.openai.render import ChatRenderer, CompletionRenderer, Renderer
from app.openai.schemas import ChatCompletionRequest, CompletionRequest
from app.openai.structured import output_grammar
from app.openai.tools import ToolUse, parse_tools
from app.openai.unsupported import check_unsupported, unsupported
from engine.errors import InvalidRequest, QueueFull
from engine.request import Request, RequestClass, SamplingParams
from policies.request_class import RequestClassPolicy

M = TypeVar("M", bound=BaseModel)
SEED_SPACE = 2**63  # derived seeds of choices 1.. stay in [0, 2**63): every sampler takes them


class Route(StrEnum):
    """The generation endpoints, by the URL a client (or a batch line's `url`) names."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@dataclass(slots=True)
class GenerationJob:
    """Everything decided about one call; `requests[i]` produces choice `i`."""

    request_id: str
    endpoint: ModelEndpoint
    requests: list[Request]
    renderer: Renderer
    stream: bool
    request_class: RequestClass
    tags: dict[str, str]


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: distinct and reproducible per choice, never out of range."""
    return seed if index == 0 else (seed + index) % SEED_SPACE


@dataclass(slots=True)
class OpenAILayer:
    endpoints: Endpoints
    classifier: RequestClassPolicy
    max_n: int = 16

    async def prepare(
        self,
        route: Route | str,
        body: Mapping[str, Any],
        *,
        headers: Mapping[str, str],
        request_id: str,
    ) -> GenerationJob:
        """`body` (a parsed JSON object) as a job; `headers` (lower-case names, e.g. `{}` for
        a batch line) feed the request-class policy. Raises `APIError` only."""
        try:
            kind = Route(route)
        except ValueError:
            raise bad_request(f"url must be one of: {', '.join(Route)}", "url") from None
        check_body(body)
        check_unsupported(body)
        try:
            if kind is Route.CHAT:
                return await self._chat(body, headers, request_id)
            return await self._completion(body, headers, request_id)
        except InvalidRequest as exc:
            raise from_invalid(exc) from None

    async def _chat(
        self, body: Mapping[str, Any], headers: Mapping[str, str], request_id: str
    ) -> GenerationJob:
        params = _parse(ChatCompletionRequest, body)
        tools = parse_tools(body)
        grammar = output_grammar(body)
        forced = tools.grammar() if tools is not None else None
        if forced is not None:
            if grammar is not None:
                raise bad_request(
                    "response_format cannot constrain a reply that tool_choice forces to be "
                    "tool calls",
                    grammar.param,
                )
            grammar = forced
        endpoint, request_class, base = self._admit(params, body, headers, 1, None)
        with _released_on_failure(endpoint, params.n):
            if grammar is not None:
                await endpoint.check_grammar(grammar)
                base = dataclasses.replace(base, grammar=grammar)
            tokenizer = endpoint.tokenizer
            prompt = await encode_chat(
                tokenizer, params.messages, endpoint.prompt_byte_limit, endpoint.max_model_len,
                tools.template_tools() if tools is not None else None,
            )  # fmt: skip
            return _job(params, endpoint, request_class, base, [prompt], request_id,
                        ChatRenderer, default_max_tokens=None, prompt_param="messages",
                        tools=tools)  # fmt: skip

    async def _completion(
        self, body: Mapping[str, Any], headers: Mapping[str, str], request_id: str
    ) -> GenerationJob:
        params = _parse(CompletionRequest, body)
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none", "auto"):
                raise unsupported(name)  # tools are a chat feature
        grammar = output_grammar(body)
        if params.echo:
            raise bad_request("echo is not supported", "echo")
        if params.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if params.best_of is not None and params.best_of != params.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        endpoint, request_class, base = self._admit(params, body, headers, len(params.prompt), 16)
        with _released_on_failure(endpoint, len(params.prompt) * params.n):
            if grammar is not None:
                await endpoint.check_grammar(grammar)
                base = dataclasses.replace(base, grammar=grammar)
            prompts = [await _completion_prompt(endpoint, p) for p in params.prompt]
            return _job(params, endpoint, request_class, base, prompts, request_id,
                        CompletionRenderer, default_max_tokens=16,
                        prompt_param="prompt")  # fmt: skip

    def _admit(
        self,
        params: ChatCompletionRequest | CompletionRequest,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        num_prompts: int,
        default_max_tokens: int | None,
    ) -> tuple[ModelEndpoint, RequestClass, SamplingParams]:
        """Every check that needs no tokens; the sampling params with a provisional budget."""
        if params.n > self.max_n:
            raise bad_request(f"n must be at most {self.max_n}", "n")
        endpoint = self.endpoints.resolve(params.model)
        limit = endpoint.max_requests
        wanted = num_prompts * params.n
        if limit is not None and wanted > limit:
            raise bad_request(
                f"this request asks for {wanted} generations ({num_prompts} prompt(s) × "
                f"n={params.n}); this server runs at most {limit} per request",
                "n" if params.n > 1 else "prompt",
            )
        request_class = self.classifier.classify(headers, body)
        requested = params.requested_max_tokens()
        provisional = requested if requested is not None else default_max_tokens
        base = params.sampling_params(
            max_tokens=provisional or endpoint.max_model_len,
            logprobs=params.logprobs_k(),
            seed=params.seed,
        )
        if base.seed is not None:  # each choice's derived seed must pass too
            for i in range(1, params.n):
                dataclasses.replace(base, seed=choice_seed(base.seed, i)).validate()
        try:  # last, before any tokenizing: an overloaded server refuses at once
            endpoint.client.check_admission(request_class, wanted)
        except QueueFull as exc:
            error = to_api_error(exc)
            raise Refused(error, endpoint.name, request_class.value, params.tags()) from None
        return endpoint, request_class, base


@contextlib.contextmanager
def _released_on_failure(endpoint: ModelEndpoint, count: int) -> Iterator[None]:
    """The places `check_admission` took for `count` requests go back if they will not start
    (a bad prompt, grammar or tool call found after the check)."""
    try:
        yield
    except BaseException:
        endpoint.client.release_admission(count)
        raise


def _parse(model: type[M], body: Mapping[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_url=False)) from None


async def _completion_prompt(endpoint: ModelEndpoint, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return await encode_text(
            endpoint.tokenizer, prompt, endpoint.prompt_byte_limit, endpoint.max_model_len,
            "prompt",
        )  # fmt: skip
    too_long = len(prompt) >= endpoint.max_model_len  # refused by `_max_tokens`, unscanned
    if not too_long and any(t < 0 or t >= endpoint.vocab_size for t in prompt):
        raise bad_request(f"token ids must be in [0, {endpoint.vocab_size})", "prompt")
    return prompt


def _max_tokens(
    endpoint: ModelEndpoint,
    prompt_len: int,
    requested: int | None,
    default: int | None,
    prompt_param: str,
) -> int:
    """Completion budget within the context: 400 when the prompt or the request overflows it."""
    limit = endpoint.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", prompt_param)
    if prompt_len >= limit:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this model's maximum context length is "
            f"{limit} tokens (prompt + completion)",
            prompt_param,
            "context_length_exceeded",
        )
    room = limit - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, but {prompt_len + requested}"
            f" were requested ({prompt_len} in the prompt, {requested} for the completion)",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested


def _job(
    params: ChatCompletionRequest | CompletionRequest,
    endpoint: ModelEndpoint,
    request_class: RequestClass,
    base: SamplingParams,
    prompts: Sequence[list[int]],
    request_id: str,
    renderer: type[Renderer],
    *,
    default_max_tokens: int | None,
    prompt_param: str,
    tools: ToolUse | None = None,
) -> GenerationJob:
    tags = params.tags()
    requests: list[Request] = []
    for prompt in prompts:
        max_tokens = _max_tokens(
            endpoint, len(prompt), params.requested_max_tokens(), default_max_tokens, prompt_param
        )
        sampling = dataclasses.replace(base, max_tokens=max_tokens)
        sampling.validate()  # min_tokens against the real budget
        for i in range(params.n):
            seed = None if base.seed is None else choice_seed(base.seed, i)
            requests.append(Request(
                request_id=f"{request_id}-{len(requests)}",
                prompt_token_ids=prompt,
                sampling=dataclasses.replace(sampling, seed=seed),
                request_class=request_class,
                tags=tags,
                whole_output=not params.stream,  # read once complete: one delta, at the end
            ))  # fmt: skip
    extra: dict[str, Any] = {"tools": tools} if tools is not None else {}
    return GenerationJob(
        request_id=request_id,
        endpoint=endpoint,
        requests=requests,
        renderer=renderer(
            **extra,
            response_id=f"{renderer.id_prefix}{request_id}",
            created=int(time.time()),
            model=endpoint.name,
            prompt_lens=[len(p) for p in prompts],
            n=params.n,
            include_usage=params.stream and params.include_usage,
            logprobs=base.logprobs is not None,
            token_text=endpoint.token_text,
        ),
        stream=params.stream,
        request_class=request_class,
        tags=tags,
    )
