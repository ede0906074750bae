"""Speculative decoding benchmark on the demo target and draft, every pair from the same run.

    python bench/spec.py [--rounds 2] [--skip-serve]

Prints progress, then as its LAST line one JSON object:
  batch1_speedup_local     greedy tokens/s at batch 1, in-process draft model (adaptive policy)
                           / speculation off; outputs identical                 (target >= 2.0)
  batch1_speedup_replica   the same with drafts from a DraftReplica (Ray Serve deployment, the
                           direct TCP channel) / off                             (target >= 1.6)
  serve_tpot_p50_ratio_c1  TPOT p50 through the serve_config.yaml application, DraftReplica on
                           / speculation off, one stream at a time               (target <= 0.65)
  c16_throughput_ratio     output tokens/s of 16 concurrent requests, adaptive policy / off
                                                                                 (target >= 0.95)
  prompt_lookup_speedup    batch 1, a conversation whose answer quotes its prompt (the user asks
                           again): prompt lookup / off                           (target >= 1.5)
  acceptance_rate          accepted / verified drafts of the local draft model runs
  outputs_identical        every greedy output of every speculative run equals plain decoding

Greedy requests on the demo's showcase questions (chat template, up to 128 tokens, ending at
the model's own end of answer); runs with and without speculation alternate per request, so
drift of the machine's speed hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.overhead import (
    app_args,
    free_port,
    log,
    serve_config,
    start_ray_serve,
    stop_serve,
    wait_ready,
)
from demo.corpus import SHOWCASE_PROMPTS
from demo.evaluate import chat_prompt
from demo.paths import resolve_model
from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams
from engine.spec.proposer import Proposer

MAX_TOKENS = 128
BASE = EngineConfig(model="demo", cache=CacheConfig(kv_cache_bytes=64 << 20))


def engine(method: str = "off", proposer: Proposer | None = None) -> LLMEngine:
    spec = SpeculativeConfig(method=method, draft_model="demo-draft")  # type: ignore[arg-type]
    return LLMEngine(
        replace(BASE, speculative=spec), resolve_model=resolve_model, proposer=proposer
    )


class Runner:
    """Runs requests to completion on one engine, counting tokens and wall time."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng = eng
        self.seconds = 0.0
        self.tokens = 0
        self.ids = 0

    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        for prompt in prompts:
            self.ids += 1
            sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
            self.eng.add_request(Request(f"r{self.ids}-{len(prompts)}", prompt, sampling))
        out: dict[str, list[int]] = {}
        start = time.perf_counter()
        while self.eng.has_unfinished():
            for delta in self.eng.step():
                out.setdefault(delta.request_id, []).extend(delta.token_ids)
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(t) for t in out.values())
        return [out[k] for k in sorted(out, key=lambda r: int(r[1:].split("-")[0]))]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def paired(
    plain: Runner, spec: Runner, workload: list[list[list[int]]], rounds: int
) -> tuple[float, bool]:
    """(spec tokens/s / plain tokens/s, outputs identical), the two alternating per batch."""
    for batch in workload[:2]:  # warm-up, not counted
        plain.run(batch)
        spec.run(batch)
    plain.seconds = spec.seconds = 0.0
    plain.tokens = spec.tokens = 0
    identical = True
    for _ in range(rounds):
        for batch in workload:
            identical &= plain.run(batch) == spec.run(batch)
    return spec.tokens_per_s / plain.tokens_per_s, identical


def showcase(tokenizer: Any) -> list[list[int]]:
    return [chat_prompt(tokenizer, text) for text in SHOWCASE_PROMPTS]


def quoting(tokenizer: Any, answer_of: Runner) -> list[list[int]]:
    """Conversations where the user asks again: the answer quotes the earlier one."""
    out = []
    for text in SHOWCASE_PROMPTS:
        first = answer_of.run([chat_prompt(tokenizer, text)])[0]
        answer = tokenizer.decode(first, skip_special_tokens=True)
        messages = [
            {"role": "user", "content": text},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": text},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append([int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])])
    return out


# -- Ray Serve parts ---------------------------------------------------------------------------


def replica_speedup(rounds: int, prompts: list[list[int]]) -> tuple[float, bool]:
    """Batch-1 tokens/s with drafts from a DraftReplica deployment / without."""
    from ray import serve

    from actors.builder import load_config
    from actors.draft_channel import RemoteDraftProposer
    from actors.draft_replica import DraftReplica

    config = load_config(app_args())
    serve.run(
        DraftReplica.options(ray_actor_options={"num_cpus": 0}).bind(config),
        name="draft-bench",
        route_prefix=None,
    )
    handle = serve.get_deployment_handle("DraftReplica", app_name="draft-bench")
    remote = RemoteDraftProposer(timeout_s=1.0)
    remote.set_address(tuple(handle.address.remote().result()))
    spec = Runner(engine("draft_model", proposer=remote))
    ratio, identical = paired(Runner(engine()), spec, [[p] for p in prompts], rounds)
    remote.close()
    serve.delete("draft-bench")
    return ratio, identical


async def tpot_p50(base: str, n: int, speculating: bool) -> float:
    """Median time per output token after the first, one stream at a time (once the replica
    speculates, when it should: it finds the DraftReplica within about a second)."""
    tpots = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        deadline = time.monotonic() + 60
        while speculating and time.monotonic() < deadline:
            body = {"model": "demo", "prompt": "hi", "max_tokens": 32, "temperature": 0}
            reply = (await client.post("/v1/completions", json=body)).json()
            if reply["firstlight"]["draft_tokens"] > 0:
                break
            await asyncio.sleep(0.5)
        for i in range(n + 2):
            text = SHOWCASE_PROMPTS[i % len(SHOWCASE_PROMPTS)]
            body = {
                "model": "demo",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            first = last = None
            tokens = 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        last = time.perf_counter()
                        first = first or last
            if i >= 2 and first is not None and last is not None and tokens > 1:
                tpots.append((last - first) / (tokens - 1))
    return statistics.median(tpots)


def serve_tpot_ratio(port: int, n: int) -> float:
    """TPOT p50 of the serve_config.yaml app with its DraftReplica / with speculation off,
    from the app's HTTP server on `port` (the Ingress's own, as serve_config.yaml serves it)."""
    from ray import serve

    from actors.builder import application, load_config

    results = {}
    for label, method in (("on", "draft_model"), ("off", "off")):
        args = app_args()
        engine_args = dict(args.get("engine", {}))
        engine_args["speculative"] = {**engine_args.get("speculative", {}), "method": method}
        args["engine"] = engine_args
        args["replica"] = {**args.get("replica", {}), "autoscaling": {"max_replicas": 1}}
        serve.run(application(load_config(args)), name="firstlight", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        results[label] = asyncio.run(tpot_p50(base, n, speculating=method != "off"))
        log(f"serve TPOT p50 speculation {label}: {results[label] * 1e3:.2f} ms")
        serve.delete("firstlight")
    return results["on"] / results["off"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve-requests", type=int, default=16)
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    plain = Runner(engine())
    prompts = showcase(plain.eng.tokenizer)
    local = Runner(engine("draft_model"))
    batch1, same_local = paired(plain, local, [[p] for p in prompts], args.rounds)
    counters = local.eng.counters
    acceptance = counters.accepted_tokens / max(1, counters.draft_tokens)
    log(f"batch 1: local draft {local.tokens_per_s:.0f} tok/s vs off {plain.tokens_per_s:.0f}")

    c16_plain, c16_spec = Runner(engine()), Runner(engine("draft_model"))
    wide = [(prompts * 2)[i : i + 16] for i in range(0, 16, 16)]
    c16, same_c16 = paired(c16_plain, c16_spec, wide * 3, args.rounds)
    log(f"c16: adaptive {c16_spec.tokens_per_s:.0f} tok/s vs off {c16_plain.tokens_per_s:.0f}")

    lookup_plain, lookup = Runner(engine()), Runner(engine("prompt_lookup"))
    quotes = quoting(plain.eng.tokenizer, lookup_plain)
    lookup_ratio, same_lookup = paired(lookup_plain, lookup, [[p] for p in quotes], args.rounds)
    log(f"prompt lookup: {lookup.tokens_per_s:.0f} tok/s vs off {lookup_plain.tokens_per_s:.0f}")

    result: dict[str, Any] = {}
    same_replica = True
    if not args.skip_serve:
        temp_dir = tempfile.mkdtemp(prefix="fl-bench-spec-")
        port = free_port()
        controller = serve_config().get("controller_options")
        start_ray_serve("firstlight-bench-spec", port, controller, temp_dir)
        try:
            replica, same_replica = replica_speedup(args.rounds, prompts)
            log(f"batch 1: DraftReplica speedup {replica:.2f}")
            result["batch1_speedup_replica"] = round(replica, 3)
            tpot = serve_tpot_ratio(port, args.serve_requests)
            result["serve_tpot_p50_ratio_c1"] = round(tpot, 3)
        finally:
            stop_serve()
    result = {
        "batch1_speedup_local": round(batch1, 3),
        **result,
        "c16_throughput_ratio": round(c16, 3),
        "prompt_lookup_speedup": round(lookup_ratio, 3),
        "acceptance_rate": round(acceptance, 3),
        "outputs_identical": same_local and same_c16 and same_lookup and same_replica,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
