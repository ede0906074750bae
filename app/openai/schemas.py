"""Request bodies of the OpenAI-compatible routes (pydantic, at the edge only).

Unknown fields are ignored, never rejected: tools send many (`service_tier`, `user`,
`parallel_tool_calls`, `stream_options.continuous_usage_stats`, ...). The exception is a
field the server does not implement that asks for something (`logit_bias`, `functions`):
`app.openai.unsupported` refuses it before these models see the body. `response_format`,
`guided_*` and `tools`/`tool_choice` are read from the raw body by `app.openai.structured`
and `app.openai.tools`.
Values whose shape OpenAI allows in several forms (`stop`, `prompt`, message `content`) are
normalized here so the rest of the app sees one form. Responses are plain dicts built in
`app/openai/render.py` (faster than pydantic per chunk).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from engine.errors import InvalidRequest
from engine.request import SamplingParams

MAX_STOP = 32  # stop strings a request may give (OpenAI: 4); each is matched at every token
MAX_STOP_CHARS = 1024
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "batch")  # flex, batch: bulk


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise PydanticCustomError("stop_type", "must be a string, a list of strings or null")
    if len(value) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in value):
        raise PydanticCustomError(
            "stop_size",
            f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters each",
        )
    return value


def _whole_number(value: Any) -> Any:
    """`100.0` → `100`: a count computed in floating point (`json.dumps` writes `1000.0` for
    `1e3`) is taken, as vLLM takes it; any other float, a string or a bool stays refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]


def _service_tier(value: Any) -> Any:
    if value is None or (isinstance(value, str) and value.lower() in SERVICE_TIERS):
        return value
    raise PydanticCustomError("service_tier", f"must be one of {', '.join(SERVICE_TIERS)}")


def _content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        return value
    raise PydanticCustomError(
        "content_type", "must be a string or a list of content parts ({'type': 'text', ...})"
    )


def _prompt(value: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] → a non-empty list of prompts."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return value
        if all(type(t) is int for t in value):
            return [value]
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in value):
            return value
    raise PydanticCustomError(
        "prompt_type",
        "must be a string, a list of strings, a list of token ids or a list of token id lists "
        "(none empty)",
    )


Stop = Annotated[list[str], BeforeValidator(_stop)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted, ignored


class ChatMessage(BaseModel):
    """Extra keys (`name`, `tool_calls`, ...) are kept and handed to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Role
    content: Annotated[str | list[dict[str, Any]] | None, BeforeValidator(_content)] = Field(
        None,
        validate_default=True,  # a message without the key is checked as null
    )

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: Any, info: ValidationInfo) -> Any:
        """Only an assistant turn (tool calls instead) or a tool/function result may be
        null."""
        if content is None and info.data.get("role") in ("system", "developer", "user"):
            raise PydanticCustomError("content_missing", "a message of this role needs content")
        return content


class _GenerationRequest(BaseModel):
    """Fields shared by chat and text completions."""

    # strict: "n": "2" or "stream": "yes" is a 400, as OpenAI answers (an int passes as a float)
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(1, ge=1)
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop: Stop = Field(default_factory=list)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Annotated[str | None, BeforeValidator(_service_tier)] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(
        self, *, max_tokens: int, logprobs: int | None, seed: int | None
    ) -> SamplingParams:
        """Map to engine params and validate; `InvalidRequest(param, message)` on a bad value."""
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=0 if self.top_k is None else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(self.stop),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )
        params.validate()
        return params

    def tags(self) -> dict[str, str]:
        """`user`, `metadata.feature`, `metadata.prompt_version` (as strings, when given)."""
        tags: dict[str, str] = {}
        if self.user:
            tags["user"] = self.user
        for key in ("feature", "prompt_version"):
            value = (self.metadata or {}).get(key)
            if value is not None:
                tags[key] = str(value)
        return tags


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        """Engine `logprobs`: None for none, else the number of alternatives (may be 0)."""
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs", "top_logprobs must be in [0, 20]")
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequest("top_logprobs", "top_logprobs requires logprobs: true")
            return None
        return self.top_logprobs or 0

    def sampling_params(
        self, *, max_tokens: int, logprobs: int | None, seed: int | None
    ) -> SamplingParams:
        """As for completions; a bad token limit names `max_completion_tokens` when that is
        the field the client set."""
        try:
            return super().sampling_params(max_tokens=max_tokens, logprobs=logprobs, seed=seed)
        except InvalidRequest as exc:
            if exc.param == "max_tokens" and self.max_completion_tokens is not None:
                message = exc.message.replace("max_tokens", "max_completion_tokens")
                raise InvalidRequest("max_completion_tokens", message) from None
            raise


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompt)]
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None

    def logprobs_k(self) -> int | None:
        return self.logprobs
