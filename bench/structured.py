"""Structured output benchmark on the demo model, every figure from the same run.

    python bench/structured.py [--requests 48] [--rounds 3]

Prints progress, then as its LAST line one JSON object:
  schema_valid_rate     constrained outputs that parse and validate against their JSON
                        schema / all constrained outputs                        (target 1.0)
  tpot_ratio_vs_free    TPOT p50 of requests with a JSON schema / unconstrained requests,
                        8 in flight at all times (a closed loop)                (target <= 1.15)
  ttft_first_schema_ms  TTFT of the first request with a schema the engine has never seen
                        (the grammar compiled on its way in), on a warm engine
  ttft_free_ms          TTFT of an unconstrained request on the same engine, for scale
  tpot_ratio_no_jump_forward  the same with `jump_forward` off (one forward pass per
                        token: what the masks alone cost)
  mask_ms_per_row       grammar mask time per constrained logits row (on the worker
                        thread, overlapped with the forward pass)

TPOT is per token (first token to last over the tokens after the first delta): with
jump-forward a step may bring several grammar-forced tokens at once.

Requests sample (temperature 1, seeded) from the demo's showcase questions; the constrained
runs draw from a dozen schemas (objects, enums, bounded integers and strings, arrays,
nesting). Each constrained run is mirrored at once by a free run of the same prompts and
the same output lengths (EOS ignored until then): JSON answers are shorter than free ones,
and shorter outputs mean more prefills per generated token, which would otherwise be
counted against the grammar. Runs alternate, so drift of the machine's speed hits both
alike. The engine is driven in-process (`LLMEngine.step`), as a model replica drives it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo.corpus import SHOWCASE_PROMPTS
from demo.evaluate import chat_prompt
from demo.paths import resolve_model
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams
from engine.structured.grammar import Grammar

CONCURRENCY = 8
MAX_TOKENS = 96
_S = {"type": "string", "maxLength": 16}
_I = {"type": "integer", "minimum": 0, "maximum": 9999}


def _obj(**props: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


SCHEMAS: tuple[dict[str, Any], ...] = (
    _obj(answer=_S),
    _obj(name=_S, age=_I),
    _obj(plan={"enum": ["free", "pro", "team"]}, seats=_I, annual={"type": "boolean"}),
    _obj(order_id=_S, status={"enum": ["shipped", "processing", "delivered"]}),
    _obj(tags={"type": "array", "items": _S, "maxItems": 3}),
    _obj(user=_obj(id=_I, email=_S), active={"type": "boolean"}),
    _obj(score={"type": "integer", "minimum": 1, "maximum": 5}, comment=_S),
    _obj(items={"type": "array", "items": _obj(sku=_S, qty=_I), "maxItems": 2}),
    _obj(refund={"type": "boolean"}, amount=_I, currency={"enum": ["EUR", "USD", "GBP"]}),
    _obj(steps={"type": "array", "items": _S, "minItems": 1, "maxItems": 3}),
    _obj(city=_S, zip={"type": "string", "pattern": "^[0-9]{5}$"}),
    _obj(reply=_S, escalate={"type": "boolean"}, priority={"enum": ["low", "high"]}),
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(slots=True)
class Stream:
    index: int  # submission order within its run
    started: float
    schema: dict[str, Any] | None
    tokens: int = 0
    first_tokens: int = 0  # in the first delta (jump-forward may bring several at once)
    stamps: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish: str | None = None


class ClosedLoop:
    """Keeps `CONCURRENCY` requests in flight on one engine until `total` have finished.
    The k-th request of every run has the same prompt. A constrained run draws schemas; a
    free run given `lengths` makes its k-th request exactly `lengths[k]` tokens long (EOS
    ignored until then), so it has the same shape as the constrained run it mirrors: the
    same prompts, output lengths and prefill arrivals, only the grammar differs."""

    def __init__(self, eng: LLMEngine, prompts: list[list[int]]) -> None:
        self.eng = eng
        self.prompts = prompts
        self.ids = itertools.count()

    def run(self, total: int, constrained: bool, lengths: list[int] | None = None) -> list[Stream]:
        streams: dict[str, Stream] = {}
        done: list[Stream] = []
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            i, k = next(self.ids), submitted
            schema = SCHEMAS[k % len(SCHEMAS)] if constrained else None
            grammar = Grammar.json_schema(schema) if schema is not None else None
            n = MAX_TOKENS if lengths is None else lengths[k]
            params = SamplingParams(
                max_tokens=n,
                min_tokens=0 if lengths is None else n,
                temperature=1.0,
                seed=i,
                grammar=grammar,
            )
            rid = f"r{i}"
            streams[rid] = Stream(k, time.perf_counter(), schema)
            self.eng.add_request(Request(rid, self.prompts[k % len(self.prompts)], params))
            submitted += 1

        while submitted < min(CONCURRENCY, total):
            submit()
        while streams:
            deltas = self.eng.step()
            now = time.perf_counter()
            for d in deltas:
                s = streams[d.request_id]
                if d.token_ids:
                    s.stamps.append(now)
                    s.tokens += len(d.token_ids)
                    s.first_tokens = s.first_tokens or len(d.token_ids)
                s.text.append(d.text)
                if d.finished:
                    s.finish = d.finish_reason.value if d.finish_reason else None
                    done.append(streams.pop(d.request_id))
                    if submitted < total:
                        submit()
        return done


def tpot_ms(streams: list[Stream]) -> list[float]:
    """Per stream: time from the first token to the last over the tokens after the first
    delta (per token, not per delta: a delta may carry several)."""
    return [
        1000 * (s.stamps[-1] - s.stamps[0]) / (s.tokens - s.first_tokens)
        for s in streams
        if len(s.stamps) > 2
    ]


def valid(stream: Stream) -> bool:
    if stream.schema is None or stream.finish != "stop":
        return False
    try:
        jsonschema.validate(json.loads("".join(stream.text)), stream.schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def first_token_ms(eng: LLMEngine, prompt: list[int], grammar: Grammar | None, rid: str) -> float:
    params = SamplingParams(max_tokens=4, temperature=0.0, grammar=grammar)
    start = time.perf_counter()
    eng.add_request(Request(rid, prompt, params))
    first = None
    while eng.has_unfinished():
        for d in eng.step():
            if first is None and d.token_ids:
                first = time.perf_counter()
    assert first is not None
    return 1000 * (first - start)


def mirrored_round(loop: ClosedLoop, requests: int) -> tuple[list[Stream], list[Stream]]:
    """(constrained streams, free streams of the same prompts and lengths)."""
    json_run = loop.run(requests, constrained=True)
    lengths = [s.tokens for s in sorted(json_run, key=lambda s: s.index)]
    return json_run, loop.run(requests, constrained=False, lengths=lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48, help="per round and kind")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    engines = {
        jump: LLMEngine(
            EngineConfig(
                model="demo", cache=CacheConfig(kv_cache_bytes=64 << 20), jump_forward=jump
            ),
            resolve_model=resolve_model,
        )
        for jump in (True, False)
    }
    eng = engines[True]
    prompts = [chat_prompt(eng.tokenizer, text) for text in SHOWCASE_PROMPTS]
    loops = {jump: ClosedLoop(e, prompts) for jump, e in engines.items()}
    for loop in loops.values():
        loop.run(CONCURRENCY, constrained=False)  # warm-up
    ttft_free = statistics.median(first_token_ms(eng, prompts[0], None, f"f{i}") for i in range(5))
    fresh = Grammar.json_schema(_obj(first={"type": "string", "maxLength": 8}, n=_I))
    ttft_schema = first_token_ms(eng, prompts[0], fresh, "first-schema")
    log(
        f"TTFT: first request with a new schema {ttft_schema:.1f} ms, "
        f"unconstrained {ttft_free:.1f} ms"
    )

    runs: dict[bool, tuple[list[Stream], list[Stream]]] = {j: ([], []) for j in engines}
    for r in range(args.rounds):
        for jump, loop in loops.items():  # alternating, so drift hits both alike
            started = time.perf_counter()
            constrained, free = mirrored_round(loop, args.requests)
            runs[jump][0].extend(constrained)
            runs[jump][1].extend(free)
            log(
                f"round {r + 1}/{args.rounds}, jump-forward {'on' if jump else 'off'}: "
                f"{time.perf_counter() - started:.1f} s (constrained, then free of the same "
                "prompts and lengths)"
            )
    tpot = {
        jump: (statistics.median(tpot_ms(c)), statistics.median(tpot_ms(f)))
        for jump, (c, f) in runs.items()
    }
    constrained = runs[True][0] + runs[False][0]
    rate = sum(valid(s) for s in constrained) / len(constrained)
    bad = [("".join(s.text), s.finish) for s in constrained if not valid(s)]
    for text, finish in bad[:5]:
        log(f"invalid ({finish}): {text!r}")
    masks = [e.grammars() for e in engines.values()]
    mask_s = sum(m.mask_seconds for m in masks)
    masked_rows = max(1, sum(m.masked_rows for m in masks))
    for jump, (json_ms, free_ms) in tpot.items():
        log(
            f"TPOT p50, jump-forward {'on' if jump else 'off'}: schema {json_ms:.2f} ms, "
            f"free {free_ms:.2f} ms"
        )
    log(
        f"{len(constrained)} constrained outputs, {len(bad)} invalid; mean constrained output "
        f"{statistics.mean(s.tokens for s in constrained):.1f} tokens; steps per constrained "
        f"token with jump-forward {steps_per_token(runs[True][0]):.2f}"
    )
    print(
        json.dumps(
            {
                "schema_valid_rate": round(rate, 4),
                "tpot_ratio_vs_free": round(tpot[True][0] / tpot[True][1], 3),
                "ttft_first_schema_ms": round(ttft_schema, 1),
                "ttft_free_ms": round(ttft_free, 1),
                "tpot_ratio_no_jump_forward": round(tpot[False][0] / tpot[False][1], 3),
                "mask_ms_per_row": round(1000 * mask_s / masked_rows, 4),
                "tpot_p50_schema_ms": round(tpot[True][0], 2),
                "tpot_p50_free_ms": round(tpot[True][1], 2),
                "constrained_requests": len(constrained),
            }
        )
    )


def steps_per_token(streams: list[Stream]) -> float:
    """Deltas (one per engine step) per token generated."""
    return sum(len(s.stamps) for s in streams) / max(1, sum(s.tokens for s in streams))


if __name__ == "__main__":
    main()
