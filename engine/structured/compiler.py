"""`GrammarCompiler`: grammars → llguidance matchers, compiled once per grammar.

A compiled grammar is kept as a pristine matcher in a bounded LRU cache keyed by the
`Grammar` itself; every request gets a deep copy (microseconds), so the second request with
a schema pays no compile. `check` runs at admission (on the caller's thread, before any
engine work) and `matcher` when the engine takes the request; both raise `InvalidRequest`
naming the grammar's parameter. Thread-safe: the cache is read and filled under a lock,
and a pristine matcher is never advanced.

The token vocabulary is the model's (`vocab_size` columns of logits, which may exceed the
tokenizer's own size: padded LM heads); every EOS id ends a grammar.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from engine.errors import InvalidRequest
from engine.structured.grammar import Grammar

CACHE_SIZE = 512


def start_compiler(
    tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> Future[GrammarCompiler]:
    """Build a `GrammarCompiler` on a daemon thread, started now: wrapping a vocabulary
    takes about 10 ms for the demo's and 1 s for a 128k one, which the first constrained
    request would otherwise wait for. The future holds the error if it cannot be built."""
    future: Future[GrammarCompiler] = Future()

    def build() -> None:
        try:
            future.set_result(GrammarCompiler(tokenizer, vocab_size, eos_token_ids))
        except BaseException as exc:  # kept for the first request that needs it
            future.set_exception(exc)

    threading.Thread(target=build, name="grammar-compiler", daemon=True).start()
    return future


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.mask_words = (vocab_size + 31) // 32
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._cache: OrderedDict[Grammar, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses)

    def check(self, grammar: Grammar) -> None:
        """Compile `grammar` (or find it compiled); InvalidRequest when it cannot be."""
        self._pristine(grammar)

    def matcher(self, grammar: Grammar) -> Any:
        """A fresh matcher for one request (a copy of the compiled grammar)."""
        return self._pristine(grammar).deep_copy()

    def _pristine(self, grammar: Grammar) -> Any:
        with self._lock:
            found = self._cache.get(grammar)
            if found is not None:
                self._cache.move_to_end(grammar)
                return found
        found = self._compile(grammar)
        with self._lock:
            self._cache[grammar] = found
            self.compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return found

    def _compile(self, grammar: Grammar) -> Any:
        from llguidance import LLMatcher

        grammar.validate()
        text = grammar.to_llguidance()
        try:
            matcher = LLMatcher(self._tokenizer, text, log_level=0)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise _refused(grammar, str(exc)) from exc
        if matcher.is_error():
            raise _refused(grammar, matcher.get_error())
        return matcher


def _refused(grammar: Grammar, reason: str) -> InvalidRequest:
    reason = reason.strip().splitlines()[0] if reason.strip() else "unknown error"
    return InvalidRequest(grammar.param, f"{grammar.param} cannot be compiled: {reason}")
