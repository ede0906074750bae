"""Overload through the real application: how fast refusals arrive, and who gets refused.

    python bench/admission.py [--burst 600] [--bulk 300] [--interactive 16]

Starts (and stops) its own Ray on 127.0.0.1 with the application of `serve_config.yaml`
(one model replica, so the queue bounds are reached), then, with a raw streaming HTTP
client:

  burst        `--burst` streamed chats sent at once; for every response the time from send
               to its status line. A 429 must arrive at once (not after queueing behind the
               work that is admitted), with a `Retry-After` header.
  bulk flood   `--bulk` streamed bulk chats (`service_tier: flex`) sent at once, then, while
               they are queued, `--interactive` interactive chats: how many interactive ones
               are refused (must be 0 while interactive room remains).

Progress goes to stderr; the LAST stdout line is one JSON object:
`refusal_p50_ms` / `refusal_p95_ms` (send → 429 status), `admitted_ttft_p50_ms`,
`refused`, `admitted`, `retry_after_values`, `interactive_refused_under_bulk_flood`,
`bulk_refused`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "Can I pause my annual subscription?"

from bench.overhead import (  # noqa: E402
    free_port,
    log,
    percentile,
    start_ray_serve,
    stop_serve,
    wait_ready,
)


def start_serve(args: dict[str, Any], port: int, temp_dir: str) -> None:
    from ray import serve

    from actors.builder import application, load_config

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    start_ray_serve("firstlight-bench-admission", port, config.get("controller_options"), temp_dir)
    serve.run(application(load_config(args)), name="firstlight", route_prefix="/")
    wait_ready(f"http://127.0.0.1:{port}")


def body(max_tokens: int, tier: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if tier is not None:
        out["service_tier"] = tier
    return out


async def one(base: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Status, time to the status line, time to the first token chunk (admitted only).

    A raw HTTP/1.1 client on asyncio streams: with hundreds of streams at once, a full HTTP
    client's own per-chunk work on this one loop would delay the status lines it times."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps(payload).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (host.encode(), len(body))
            + body
        )
        await writer.drain()
        status_line = await reader.readline()
        status_s = time.perf_counter() - start
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        out: dict[str, Any] = {"status": int(status_line.split()[1]), "status_s": status_s}
        headers = dict(line.split(": ", 1) for line in head.split("\r\n") if ": " in line)
        out["retry_after"] = headers.get("retry-after")
        if out["status"] != 200:
            raw = await reader.read()
            with contextlib.suppress(ValueError, KeyError, TypeError):
                out["message"] = json.loads(raw)["error"]["message"]
            return out
        while chunk := await reader.read(65536):
            if b'"content"' in chunk and "ttft_s" not in out:
                out["ttft_s"] = time.perf_counter() - start
        return out
    finally:
        writer.close()


async def measure(base: str, opts: argparse.Namespace) -> dict[str, Any]:
    log("warm-up")
    for _ in range(3):
        await one(base, body(4))

    log(f"burst: {opts.burst} streams at once")
    results = await asyncio.gather(*(one(base, body(opts.tokens)) for _ in range(opts.burst)))
    refused = [r for r in results if r["status"] == 429]
    admitted = [r for r in results if r["status"] == 200]
    other = sorted({r["status"] for r in results} - {200, 429})

    log(f"bulk flood: {opts.bulk} flex streams, then {opts.interactive} interactive")
    bulk = [asyncio.ensure_future(one(base, body(opts.tokens, "flex"))) for _ in range(opts.bulk)]
    await asyncio.sleep(opts.settle_s)  # let the flood fill the queues
    interactive = await asyncio.gather(*(one(base, body(8)) for _ in range(opts.interactive)))
    bulk_results = await asyncio.gather(*bulk)

    return {
        "refusal_p50_ms": round(1e3 * statistics.median([r["status_s"] for r in refused]), 1)
        if refused
        else None,
        "refusal_p95_ms": round(1e3 * percentile([r["status_s"] for r in refused], 0.95), 1)
        if refused
        else None,
        "admitted_ttft_p50_ms": round(
            1e3 * statistics.median([r["ttft_s"] for r in admitted if "ttft_s" in r]), 1
        )
        if admitted
        else None,
        "refused": len(refused),
        "admitted": len(admitted),
        "other_statuses": other,
        "retry_after_values": sorted({r["retry_after"] for r in refused if r["retry_after"]}),
        "refusals_by_message": _by_message(refused),
        "interactive_refused_under_bulk_flood": sum(r["status"] != 200 for r in interactive),
        "bulk_refused": sum(r["status"] == 429 for r in bulk_results),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _by_message(refused: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Refusals grouped by the layer's message (digits dropped): count and p50 latency."""
    groups: dict[str, list[float]] = {}
    for r in refused:
        key = "".join(c for c in r.get("message", "?") if not c.isdigit())[:60]
        groups.setdefault(key, []).append(r["status_s"])
    return {
        k: {"count": len(v), "p50_ms": round(1e3 * statistics.median(v), 1)}
        for k, v in groups.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--burst", type=int, default=600)
    p.add_argument("--bulk", type=int, default=300)
    p.add_argument("--interactive", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--settle-s", type=float, default=3.0)
    opts = p.parse_args()
    args = dict(yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"])
    args["ingress"] = {**args.get("ingress", {}), "channel_tcp_host": "127.0.0.1"}
    args["replica"] = {
        **args.get("replica", {}),
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
    }
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="fl-bench-ray-")
    try:
        log("starting Ray Serve")
        start_serve(args, port, temp_dir)
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", opts))
    finally:
        stop_serve()
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
