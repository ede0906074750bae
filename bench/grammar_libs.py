"""xgrammar vs llguidance on the demo model's vocabulary and on a 128k-token one: the
measurement behind firstlight's choice of grammar library (`engine/structured`).

    python bench/grammar_libs.py          (xgrammar must be importable: pip install xgrammar)

For each library and vocabulary: the one-off vocabulary preparation, then per schema (the
structured-output bench's dozen) the compile time (cold, the grammar's first mask included:
llguidance builds lazily) and the mask time per token while walking a valid instance token
by token (mask, then advance). Prints a table, then as its LAST line one JSON object.

The 128k vocabulary is byte-level BPE trained here on the demo corpus plus generated words,
numbers and JSON (no hub): real vocabularies of that size (Llama 3, 128,256) have the same
structure, many multi-character pieces of words, spaces, digits and punctuation, which is
what mask computation walks.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.structured import SCHEMAS
from demo.paths import firstlight_home, resolve_model

LARGE_VOCAB = 128_000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def large_tokenizer() -> Any:
    """A 128k-token byte-level BPE (built once, cached under FIRSTLIGHT_HOME/bench)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = firstlight_home() / "bench" / "tokenizer-128k"
    if (directory / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(directory))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from demo.corpus import build_corpus

    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    weights = [26 - i for i in range(26)]

    def words(n: int) -> list[str]:
        return ["".join(rng.choices(letters, weights, k=rng.randint(2, 11))) for _ in range(n)]

    texts = [t.content for c in build_corpus(1, 4000) for t in c.turns]
    for _ in range(4000):
        texts.append(" ".join(words(60)))
        texts.append(" ".join(w.capitalize() for w in words(20)))
        texts.append(json.dumps({w: rng.randint(0, 10**6) for w in words(8)}))
        texts.append(" ".join(str(rng.randint(0, 10**9)) for _ in range(20)))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=LARGE_VOCAB,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>")
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    return tok


def instance(schema: dict[str, Any]) -> Any:
    """A small valid instance of one of the bench schemas."""
    if "enum" in schema:
        return schema["enum"][-1]
    kind = schema.get("type")
    if kind == "object":
        return {k: instance(v) for k, v in schema["properties"].items()}
    if kind == "array":
        return [instance(schema["items"]) for _ in range(min(2, schema.get("maxItems", 2)))]
    if kind == "integer":
        return min(schema.get("minimum", 0) + 17, schema.get("maximum", 10**6))
    if kind == "boolean":
        return True
    if "pattern" in schema:
        return "12345"
    return "order shipped"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any) -> None:
        import llguidance.hf

        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
        self.words = (len(tok) + 31) // 32

    def compile(self, schema: dict[str, Any]) -> Any:
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False})
        return LLMatcher(self.tok, grammar)

    def walk(self, matcher: Any, tokens: list[int]) -> list[float]:
        import torch

        mask = torch.zeros(self.words, dtype=torch.int32)
        times = []
        for t in tokens:
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), self.words * 4)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(t), matcher.get_error()
        return times


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        import xgrammar as xgr

        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        return xgr.GrammarMatcher(compiled)

    def walk(self, matcher: Any, tokens: list[int]) -> list[float]:
        times = []
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(self.mask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(t)
        return times


def measure(lib_class: type, tok: Any) -> dict[str, float]:
    start = time.perf_counter()
    lib = lib_class(tok)
    prepare = time.perf_counter() - start
    compiles, masks = [], []
    for schema in SCHEMAS:
        text = json.dumps(instance(schema), separators=(",", ":"))
        tokens = tok.encode(text, add_special_tokens=False)
        start = time.perf_counter()
        matcher = lib.compile(schema)
        lib.walk(matcher, tokens[:1])  # the first mask belongs to the compile
        compiles.append(time.perf_counter() - start)
        masks += lib.walk(lib.compile(schema), tokens)[1:]
    return {
        "prepare_ms": round(1000 * prepare, 1),
        "compile_ms_p50": round(1000 * statistics.median(compiles), 2),
        "compile_ms_max": round(1000 * max(compiles), 2),
        "mask_us_p50": round(1e6 * statistics.median(masks), 1),
        "mask_us_p99": round(1e6 * sorted(masks)[int(0.99 * (len(masks) - 1))], 1),
    }


def main() -> None:
    from transformers import AutoTokenizer

    vocabularies = {
        "demo": AutoTokenizer.from_pretrained(str(resolve_model("demo"))),
        "128k": large_tokenizer(),
    }
    results: dict[str, Any] = {}
    for vocab_name, tok in vocabularies.items():
        for lib in (LLGuidance, XGrammar):
            try:
                row = measure(lib, tok)
            except ImportError as exc:
                log(f"{lib.name}: not installed ({exc})")
                continue
            results[f"{lib.name}/{vocab_name}"] = row
            log(f"{lib.name:10s} {vocab_name:5s} vocab {len(tok):6d}  {row}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
