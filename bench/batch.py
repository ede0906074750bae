"""Batch jobs benchmark: a 2,000-line batch through the `serve_config.yaml` application (one
model replica of the demo model), against interactive chat and against the engine alone.

    python bench/batch.py [--lines 2000] [--chat-s 20] [--rounds 3]

Prints progress, then as its LAST line one JSON object, from one run:
  interactive_ttft_p95_ratio  chat TTFT p95 while the batch runs / with no batch, the same
                              steady chat load (4 requests/s), each pooled over `rounds`
                              alternating rounds of `chat_s` seconds             (target <= 1.2)
  batch_tokens_per_s_ratio    output tokens/s of the batch with no chat load / the same
                              lines sent straight to an in-process engine of the same
                              config at its best concurrency (all seats), as bulk requests;
                              engine and batch runs alternate (E B E B E)      (target >= 0.8)
  batch_lines_ok              lines answered with status 200        (must equal the line count)
  duplicate_lines             custom_ids answered more than once                  (must be 0)

The engine-alone runs happen in this process while Serve sits idle, each after 64 untimed
lines (a warm engine, as the replica is); they alternate with the batch-alone runs, so a drift
of the machine's speed (this VM's engine-alone rate has moved by half within ten minutes)
weighs on both sides alike. The batch-alone runs start once the bulk throttle's `hold_s` has
passed after the chat load, and so does each quiet round after a busy one. Quiet and busy
chat rounds alternate for the same reason.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.overhead import (
    app_args,
    free_port,
    log,
    percentile,
    serve_config,
    start_ray_serve,
    stop_serve,
    wait_ready,
)
from demo.corpus import SHOWCASE_PROMPTS

MAX_TOKENS = 24
BULK = {"x-firstlight-class": "bulk"}  # the class a batch's lines run as


def batch_lines(n: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "demo",
                "messages": [{"role": "user", "content": SHOWCASE_PROMPTS[i % 8] + f" ({i})"}],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]


def app_settings(directory: str) -> dict[str, Any]:
    args = app_args()
    args["replica"] = {**args.get("replica", {}), "autoscaling": {"max_replicas": 1}}
    args["batch"] = {**args.get("batch", {}), "directory": directory}
    return args


async def engine_alone(lines: list[dict[str, Any]], args: dict[str, Any], warm: int = 64) -> float:
    """Output tokens/s of the lines sent straight to an in-process engine as bulk requests,
    all seats busy, after `warm` lines untimed."""
    from actors.builder import load_config
    from app.endpoint import Endpoints, ModelEndpoint
    from app.openai.complete import complete
    from app.openai.prepare import OpenAILayer
    from demo.paths import resolve_model
    from engine.async_engine import AsyncEngine
    from policies.base import create
    from policies.request_class import RequestClassPolicy

    config = load_config(args)
    # The threads Ray gives the replica (OMP_NUM_THREADS = max(1, int(num_cpus))).
    torch.set_num_threads(max(1, int(config.replica.num_cpus)))
    engine = AsyncEngine.from_config(config.engine, resolve_model=resolve_model)
    await engine.warmup()
    await engine.start()
    endpoint = ModelEndpoint(
        name="demo", tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
        client=engine, root="demo",
    )  # fmt: skip
    layer = OpenAILayer(Endpoints([endpoint]), create(RequestClassPolicy, "header"), max_n=1)
    seats = asyncio.Semaphore(config.engine.scheduler.max_num_seqs)
    tokens = 0

    async def one(line: dict[str, Any]) -> None:
        nonlocal tokens
        async with seats:
            rid = line["custom_id"]
            job = await layer.prepare(line["url"], line["body"], headers=BULK, request_id=rid)
            response = await complete(job)
        tokens += response["usage"]["completion_tokens"]  # after the await: no lost update

    await asyncio.gather(*(one(line) for line in lines[:warm]))
    tokens = 0
    start = time.perf_counter()
    await asyncio.gather(*(one(line) for line in lines))
    seconds = time.perf_counter() - start
    await engine.shutdown()
    return tokens / seconds


async def chat_ttfts(base: str, seconds: float, rate: float = 4.0) -> list[float]:
    """TTFT of streamed chats sent at `rate` per second for `seconds`."""
    out: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": SHOWCASE_PROMPTS[i % 8]}],
            "max_tokens": 16,
            "stream": True,
            "temperature": 0,
        }
        start = time.perf_counter()
        first = None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if first is None and '"content"' in line:
                    first = time.perf_counter() - start
        if first is not None:
            out.append(first)

    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        tasks = []
        for i in range(int(seconds * rate)):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
    return out


def submit(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 900) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise RuntimeError(f"batch {batch_id} did not finish")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--chat-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    lines = batch_lines(opts.lines)
    with tempfile.TemporaryDirectory(prefix="fl-bench-batch-") as directory:
        args = app_settings(directory)
        from ray import serve

        from actors.builder import application, load_config

        port = free_port()
        temp_dir = tempfile.mkdtemp(prefix="fl-bench-batch-ray-")
        start_ray_serve("firstlight-bench-batch", port, serve_config().get("controller_options"),
                        temp_dir)  # fmt: skip
        try:
            config = load_config(args)
            serve.run(application(config), name="firstlight", route_prefix="/")
            base = f"http://127.0.0.1:{port}"
            wait_ready(base)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=2)
            asyncio.run(chat_ttfts(base, 3))  # warm-up
            quiet = asyncio.run(chat_ttfts(base, opts.chat_s))
            log(f"chat TTFT p95 without a batch: {percentile(quiet, 0.95) * 1e3:.1f} ms")

            # "With no chat load": the bulk throttle lends the replica all its seats once it
            # has seen no chat for `hold_s` (it cannot tell a pause from the end of the load).
            hold_s = float(config.policies.options("bulk_throttle").get("hold_s", 0.0))
            settle_s = hold_s + 2 * config.replica.stats_interval_s
            direct = [asyncio.run(engine_alone(lines, args))]  # meanwhile the throttle settles
            log(f"engine alone: {direct[-1]:.0f} output tokens/s")
            time.sleep(settle_s)
            alone: list[float] = []
            ok, dupes = opts.lines, 0
            for _ in range(2):
                started = time.perf_counter()
                batch = wait_done(client, submit(client, lines))
                seconds = time.perf_counter() - started
                text = client.files.content(batch.output_file_id).text
                out = [json.loads(x) for x in text.splitlines()]
                tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
                alone.append(tokens / seconds)
                ok = min(ok, sum(1 for o in out if o["response"]["status_code"] == 200))
                counts = Counter(o["custom_id"] for o in out)
                dupes += sum(n - 1 for n in counts.values() if n > 1)
                log(f"batch alone: {alone[-1]:.0f} output tokens/s, {len(out)} lines in "
                    f"{seconds:.0f} s")  # fmt: skip
                direct.append(asyncio.run(engine_alone(lines, args)))
                log(f"engine alone: {direct[-1]:.0f} output tokens/s")

            busy: list[float] = []
            for round_ in range(opts.rounds):
                if round_:  # another quiet round, once the last batch is gone
                    time.sleep(settle_s)
                    quiet += asyncio.run(chat_ttfts(base, opts.chat_s))
                busy_id = submit(client, lines)
                while client.batches.retrieve(busy_id).request_counts.completed < 50:
                    time.sleep(0.2)
                busy += asyncio.run(chat_ttfts(base, opts.chat_s))
                progress = client.batches.retrieve(busy_id).request_counts.completed
                client.batches.cancel(busy_id)
                wait_done(client, busy_id)
                log(f"round {round_ + 1}: the batch did {progress} lines during the chats")
            log(
                f"chat TTFT p95 without / with a batch running: "
                f"{percentile(quiet, 0.95) * 1e3:.1f} / {percentile(busy, 0.95) * 1e3:.1f} ms "
                f"({len(quiet)} / {len(busy)} chats; median "
                f"{statistics.median(quiet) * 1e3:.1f} / {statistics.median(busy) * 1e3:.1f} ms)"
            )
        finally:
            stop_serve()
    result = {
        "interactive_ttft_p95_ratio": round(percentile(busy, 0.95) / percentile(quiet, 0.95), 3),
        "batch_tokens_per_s_ratio": round(statistics.mean(alone) / statistics.mean(direct), 3),
        "batch_lines_ok": ok,
        "duplicate_lines": dupes,
        "lines": opts.lines,
        "batch_tokens_per_s": [round(x) for x in alone],
        "engine_tokens_per_s": [round(x) for x in direct],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
