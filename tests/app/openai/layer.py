"""Builders for tests of the HTTP-free OpenAI layer: a layer over a `FakeEngine`, and a
tokenizer that records what it was asked to encode."""

from __future__ import annotations

from typing import Any

from app.endpoint import Endpoints, ModelEndpoint
from app.openai.prepare import OpenAILayer
from policies.base import create
from policies.request_class import RequestClassPolicy
from tests.app.fakes import FakeEngine, chat_tokenizer


class CountingTokenizer:
    """`chat_tokenizer()` that records the length of every text it encodes."""

    def __init__(self) -> None:
        self.inner = chat_tokenizer()
        self.encoded: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(len(text))
        return self.inner.encode(text, **kwargs)


def make_layer(
    engine: FakeEngine | None = None,
    *,
    tokenizer: Any = None,
    max_model_len: int = 128,
    max_requests: int | None = None,
    max_n: int = 16,
) -> tuple[OpenAILayer, FakeEngine]:
    engine = engine or FakeEngine()
    endpoint = ModelEndpoint(
        name="demo",
        tokenizer=tokenizer or engine.tokenizer,
        max_model_len=max_model_len,
        client=engine,
        max_requests=max_requests,
    )
    classifier = create(RequestClassPolicy, "header")
    return OpenAILayer(Endpoints([endpoint]), classifier, max_n=max_n), engine


def chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], **overrides}
