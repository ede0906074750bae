"""What the HTTP app serves: one `ModelEndpoint` per model, wherever its engine runs.

Bare mode wraps an in-process `AsyncEngine`; Ray Serve mode wraps a client that streams from
replica handles. The app never looks past `client` (an `engine.protocol.EngineClient`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from app.openai.errors import APIError
from app.openai.prompts import prompt_byte_limit
from engine.errors import InvalidRequest
from engine.protocol import EngineClient
from engine.structured.compiler import GrammarCompiler, start_compiler
from engine.structured.grammar import Grammar


@dataclass(slots=True)
class ModelEndpoint:
    """One served model.

    `name` is what clients send as `model` (plus any `aliases`); `tokenizer` is a
    transformers tokenizer (its `chat_template` renders chat requests); `max_model_len`
    bounds prompt + completion tokens; `root` is the underlying model (path or name).
    `max_requests` is the most engine requests one call may create (prompts × `n`): more
    could never be admitted together, so such a call is a 400 stating the limit (None: no
    limit). `prompt_byte_limit` (derived once) is the UTF-8 size past which a prompt cannot
    fit in the context (`app.openai.prompts`).
    """

    name: str
    tokenizer: Any
    max_model_len: int
    client: EngineClient
    aliases: tuple[str, ...] = ()
    root: str | None = None
    max_requests: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    vocab_size: int = field(init=False)
    prompt_byte_limit: int | None = field(init=False)
    _token_texts: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _grammars: Future[GrammarCompiler] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.vocab_size = len(self.tokenizer)
        self.prompt_byte_limit = prompt_byte_limit(self.tokenizer, self.max_model_len)
        eos = self.tokenizer.eos_token_id
        eos_ids = () if eos is None else (int(eos),)
        self._grammars = start_compiler(self.tokenizer, self.vocab_size, eos_ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs), cached: at most vocab entries."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    async def check_grammar(self, grammar: Grammar) -> None:
        """Compile `grammar` for this model's vocabulary (cached per grammar, off the event
        loop); InvalidRequest naming its parameter when it cannot be compiled. The engine
        compiles it again where it runs; this check answers a bad grammar before any
        engine work."""
        await asyncio.to_thread(self._check_grammar, grammar)

    def _check_grammar(self, grammar: Grammar) -> None:
        try:
            compiler = self._grammars.result()
        except Exception as exc:
            raise InvalidRequest(
                grammar.param,
                f"structured output is not available for this model's tokenizer: {exc}",
            ) from exc
        compiler.check(grammar)

    def card(self) -> dict[str, Any]:
        """The `/v1/models` entry."""
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "firstlight",
            "root": self.root or self.name,
            "max_model_len": self.max_model_len,
        }


class Endpoints:
    """Served models by name. A request without `model` goes to the first endpoint."""

    def __init__(self, endpoints: Iterable[ModelEndpoint]) -> None:
        self.all = list(endpoints)
        self._by_name: dict[str, ModelEndpoint] = {}
        for endpoint in self.all:
            for name in (endpoint.name, *endpoint.aliases):
                if name in self._by_name:
                    raise ValueError(f"served model name {name!r} used twice")
                self._by_name[name] = endpoint

    def resolve(self, model: str | None) -> ModelEndpoint:
        """The endpoint for `model`; 404 `model_not_found` when nothing serves it."""
        if model is None and self.all:
            return self.all[0]
        endpoint = self._by_name.get(model or "")
        if endpoint is None:
            served = ", ".join(e.name for e in self.all) or "none"
            raise APIError(
                404,
                f"The model `{model}` does not exist (served: {served}).",
                param="model",
                code="model_not_found",
            )
        return endpoint
