"""A scripted stand-in for the engine, and a small chat tokenizer, for HTTP-layer tests.

`FakeEngine` satisfies `engine.protocol.EngineClient`: `generate` is an async generator that
yields one `TokenDelta` per scripted text piece (token ids from the test tokenizer), records
every `Request` it receives, and records a request as aborted when its iterator is closed or
cancelled before the last delta. The real engine and Ray Serve are tested elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.errors import QueueFull, Unavailable
from engine.request import FinishReason, Request, RequestClass, Timings, TokenDelta, TokenLogprob
from engine.stats import AdmissionStats, ClassCounts, EngineStats, KVStats

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
SPECIALS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CORPUS = [
    "Hello there! How can I help you today?",
    "Your subscription renews every year; you can pause it at any time.",
    "The invoice was sent to your email address. Thanks for waiting.",
    "café résumé 你好 世界 🙂",
] * 4


@functools.cache
def chat_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained in-process (no hub) with a chat template; built once."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )


@dataclass
class Script:
    """How the fake answers one request."""

    pieces: tuple[str, ...] = ("Hello", " there", "!")
    finish: FinishReason = FinishReason.STOP
    error: str | None = None  # message carried by an ERROR/ABORT finish
    delay_s: float = 0.0  # before each delta
    gate: asyncio.Event | None = None  # awaited before the first delta
    raise_after: int | None = None  # raise RuntimeError before delta k
    raise_first: BaseException | None = None  # raised on the first iteration


@dataclass
class FakeEngine:
    tokenizer: Any = field(default_factory=chat_tokenizer)
    script: Script | Callable[[Request], Script] = field(default_factory=Script)
    requests: list[Request] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    released: int = 0  # places given back by `release_admission`

    def _script_for(self, request: Request) -> Script:
        return self.script(request) if callable(self.script) else self.script

    def check_admission(self, request_class: RequestClass, count: int) -> None:
        """The fake admits everything up front; its scripts refuse in `generate`."""

    def release_admission(self, count: int) -> None:
        self.released += count

    async def generate(self, request: Request) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        script = self._script_for(request)
        if script.raise_first is not None:
            raise script.raise_first
        timings = Timings(arrival=time.monotonic())
        done = False
        out = 0
        try:
            if script.gate is not None:
                await script.gate.wait()
            timings.first_scheduled = time.monotonic()
            for k, piece in enumerate(script.pieces):
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                if script.raise_after == k:
                    raise RuntimeError("engine exploded\nTraceback (most recent call last): ...")
                ids = self.tokenizer.encode(piece, add_special_tokens=False)
                out += len(ids)
                last = k == len(script.pieces) - 1
                now = time.monotonic()
                if timings.first_token is None:
                    timings.first_token = now
                if last:
                    timings.finished = now
                yield TokenDelta(
                    request_id=request.request_id,
                    token_ids=ids,
                    text=piece,
                    finish_reason=script.finish if last else None,
                    logprobs=_logprobs(ids, request.sampling.logprobs),
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_output_tokens=out,
                    num_cached_tokens=1,
                    timings=dataclasses.replace(timings),
                    error=script.error if last else None,
                )
            done = True
            self.completed.append(request.request_id)
        finally:
            if not done:
                self.aborted.append(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            model="fake",
            running=ClassCounts(interactive=1, bulk=0),
            waiting=ClassCounts(interactive=0, bulk=2),
            kv=KVStats(
                num_blocks=64,
                num_free_blocks=48,
                usage=0.25,
                prefix_cache_queries=100,
                prefix_cache_hits=40,
            ),
            admission=AdmissionStats(max_waiting=8, interactive_reserve=2, drain_rate_per_s=None),
            num_preemptions=3,
            num_interrupted_steps=5,
            generation_tokens=999,  # an engine counter with no metric family: never rendered
        )


def completion_tokens(script: Script) -> int:
    """How many tokens the fake reports for one request answered by `script`."""
    return sum(len(chat_tokenizer().encode(p, add_special_tokens=False)) for p in script.pieces)


def _logprobs(ids: list[int], k: int | None) -> list[TokenLogprob] | None:
    if k is None:
        return None
    return [
        TokenLogprob(t, -0.25, [(t, -0.25), ((t + 1) % 300, -2.0), ((t + 2) % 300, -3.0)][:k])
        for t in ids
    ]


def queue_full() -> Script:
    return Script(raise_first=QueueFull("server overloaded", retry_after_s=2.5))


def unavailable() -> Script:
    return Script(raise_first=Unavailable("no replica is ready"))
