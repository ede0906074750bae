"""Engine deltas → OpenAI response objects (plain dicts), for chat and text completions.

One renderer per HTTP request. Streaming calls `chunk(index, delta)` per coalesced delta and
gets a chunk dict (or None when the delta carries nothing a client can see); non-streaming
calls `absorb` for every delta and `response()` at the end. Invariants of the stream:
the same `id`/`created` on every chunk; the chat `role` rides in a choice's first chunk,
together with its first text; `finish_reason` is set on the choice's last chunk; with
`include_usage` every chunk carries `usage: null` and `usage_chunk()` is the final one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from app.openai.errors import EngineRequestError
from app.openai.logprobs import TokenText, chat_logprobs, completion_logprobs
from app.openai.tools import ToolCallStream, ToolUse, split_tool_calls
from engine.request import FinishReason, Timings, TokenDelta, TokenLogprob


@dataclass(slots=True)
class ChoiceState:
    text: list[str] = field(default_factory=list)  # non-streaming only
    logprobs: list[TokenLogprob] = field(default_factory=list)  # non-streaming only
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative drafts verified
    num_accepted_tokens: int = 0  # of those, accepted
    started: bool = False  # a chunk of this choice was emitted
    text_offset: int = 0  # completions logprobs
    tool_stream: ToolCallStream | None = None  # chat with tools, streaming


def client_finish_reason(delta: TokenDelta) -> str | None:
    """ "stop"/"length" pass through; an error or abort finish raises `EngineRequestError`."""
    reason = delta.finish_reason
    if reason is None:
        return None
    if reason is FinishReason.STOP or reason is FinishReason.LENGTH:
        return reason.value
    if reason is FinishReason.ABORT:
        raise EngineRequestError(delta.error or "the engine aborted the request", status=503)
    raise EngineRequestError(delta.error or "the engine failed on this request")


class Renderer(ABC):
    """Shared bookkeeping; subclasses shape choices. Choice `i` answers prompt `i // n`."""

    id_prefix = ""
    chunk_object = ""
    full_object = ""

    def __init__(
        self,
        *,
        response_id: str,
        created: int,
        model: str,
        prompt_lens: list[int],
        n: int,
        include_usage: bool,
        logprobs: bool,
        token_text: TokenText,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.prompt_lens = prompt_lens
        self.n = n
        self.include_usage = include_usage
        self.want_logprobs = logprobs
        self.token_text = token_text
        self.states = [ChoiceState() for _ in range(n * len(prompt_lens))]
        self.timings: Timings | None = None  # of the choice that finished last
        self._head = {
            "id": response_id,
            "object": self.chunk_object,
            "created": created,
            "model": model,
        }

    def _update(self, state: ChoiceState, delta: TokenDelta) -> str | None:
        finish = client_finish_reason(delta)
        state.num_output_tokens = delta.num_output_tokens
        state.num_cached_tokens = delta.num_cached_tokens
        state.num_draft_tokens = delta.num_draft_tokens
        state.num_accepted_tokens = delta.num_accepted_tokens
        if finish is not None:
            state.finish_reason = finish
            self.timings = delta.timings or self.timings
        return finish

    # -- streaming ---------------------------------------------------------------------
    def chunk(self, index: int, delta: TokenDelta) -> dict[str, Any] | None:
        state = self.states[index]
        finish = self._update(state, delta)
        has_logprobs = self.want_logprobs and bool(delta.logprobs)
        if not delta.text and finish is None and not has_logprobs:
            return None
        choice = self._stream_choice(index, state, delta, finish, has_logprobs)
        state.started = True
        chunk = {**self._head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": self.usage(), "firstlight": self.latency()}

    # -- non-streaming -----------------------------------------------------------------
    def absorb(self, index: int, delta: TokenDelta) -> None:
        state = self.states[index]
        self._update(state, delta)
        if delta.text:
            state.text.append(delta.text)
        if self.want_logprobs and delta.logprobs:
            state.logprobs.extend(delta.logprobs)

    def response(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self.full_object,
            "created": self._head["created"],
            "model": self.model,
            "choices": [self._full_choice(i, s) for i, s in enumerate(self.states)],
            "usage": self.usage(),
            "firstlight": self.latency(),
        }

    # -- shared ------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_lens)
        completion = sum(s.num_output_tokens for s in self.states)
        cached = sum(
            self.states[p * self.n].num_cached_tokens for p in range(len(self.prompt_lens))
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def latency(self) -> dict[str, float | int | None]:
        """queue_s, prefill_s, ttft_s, decode_s, e2e_s as the engine measured them, and the
        speculative drafts verified (draft_tokens) and accepted (accepted_tokens)."""
        out: dict[str, float | int | None] = (
            dict.fromkeys(("queue_s", "prefill_s", "ttft_s", "decode_s", "e2e_s"))
            if self.timings is None
            else dict(self.timings.as_dict())
        )
        out["draft_tokens"] = sum(s.num_draft_tokens for s in self.states)
        out["accepted_tokens"] = sum(s.num_accepted_tokens for s in self.states)
        return out

    @abstractmethod
    def _stream_choice(
        self, index: int, state: ChoiceState, delta: TokenDelta, finish: str | None, lp: bool
    ) -> dict[str, Any]: ...

    @abstractmethod
    def _full_choice(self, index: int, state: ChoiceState) -> dict[str, Any]: ...


class ChatRenderer(Renderer):
    """With `tools` (whose choice parses calls), `<tool_call>` blocks of the reply become
    `tool_calls` (`app.openai.tools`), and a reply with calls finishes with "tool_calls"."""

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    full_object = "chat.completion"

    def __init__(self, *, tools: ToolUse | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tools = tools if tools is not None and tools.parses_calls else None
        if self.tools is not None:
            for state in self.states:
                state.tool_stream = ToolCallStream(self.tools.names)

    def chunk(self, index: int, delta: TokenDelta) -> dict[str, Any] | None:
        if self.tools is None:
            return super().chunk(index, delta)
        state = self.states[index]
        finish = self._update(state, delta)
        assert state.tool_stream is not None
        content, calls = state.tool_stream.feed(delta.text, final=finish is not None)
        has_logprobs = self.want_logprobs and bool(delta.logprobs)
        if not content and not calls and finish is None and not has_logprobs:
            return None
        if finish == "stop" and state.tool_stream.num_calls:
            finish = state.finish_reason = "tool_calls"
        message: dict[str, Any] = {} if state.started else {"role": "assistant"}
        if content or not calls:
            message["content"] = content
        if calls:
            message["tool_calls"] = calls
        choice = {
            "index": index,
            "delta": message,
            "logprobs": {"content": chat_logprobs(self.token_text, delta.logprobs or ())}
            if has_logprobs
            else None,
            "finish_reason": finish,
        }
        state.started = True
        chunk = {**self._head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _stream_choice(
        self, index: int, state: ChoiceState, delta: TokenDelta, finish: str | None, lp: bool
    ) -> dict[str, Any]:
        message = (
            {"content": delta.text}
            if state.started
            else {"role": "assistant", "content": delta.text}
        )
        return {
            "index": index,
            "delta": message,
            "logprobs": {"content": chat_logprobs(self.token_text, delta.logprobs or ())}
            if lp
            else None,
            "finish_reason": finish,
        }

    def _full_choice(self, index: int, state: ChoiceState) -> dict[str, Any]:
        text = "".join(state.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = state.finish_reason
        if self.tools is not None:
            content, calls = split_tool_calls(text, self.tools.names)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                if finish == "stop":
                    finish = "tool_calls"
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": chat_logprobs(self.token_text, state.logprobs)}
            if self.want_logprobs
            else None,
            "finish_reason": finish,
        }


class CompletionRenderer(Renderer):
    id_prefix = "cmpl-"
    chunk_object = "text_completion"
    full_object = "text_completion"

    def _stream_choice(
        self, index: int, state: ChoiceState, delta: TokenDelta, finish: str | None, lp: bool
    ) -> dict[str, Any]:
        logprobs = None
        if lp:
            logprobs, _ = completion_logprobs(
                self.token_text, delta.logprobs or (), state.text_offset
            )
        # Offsets follow the text actually emitted (a special token such as EOS adds none).
        state.text_offset += len(delta.text)
        return {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}

    def _full_choice(self, index: int, state: ChoiceState) -> dict[str, Any]:
        logprobs = None
        if self.want_logprobs:
            logprobs, _ = completion_logprobs(self.token_text, state.logprobs, 0)
        return {
            "index": index,
            "text": "".join(state.text),
            "logprobs": logprobs,
            "finish_reason": state.finish_reason,
        }
