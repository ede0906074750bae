"""CPU per delivered token chunk, per process, at concurrency 8: Serve mode and bare mode.

    python bench/process_cpu.py [--seconds 15]

Starts what `bench/overhead.py` starts (the app of `serve_config.yaml` on its own Ray on
127.0.0.1, and the bare server), drives each with 8 concurrent streamed chats in rounds, and
divides each process's CPU time (user + system, from /proc via psutil) by the chunks the
client received. Tells where the per-token cost of Serve mode goes (replica, ingress; the
proxy is off the path since clients reach the Ingress's own server, so it reads ~0).
Progress goes to stderr; the LAST stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.overhead import (  # noqa: E402
    app_args,
    chat_body,
    free_ports,
    log,
    serve_config,
    start_bare,
    start_serve,
    stop_serve,
    stream_times,
)

PROCESSES = {  # a substring of the command line → the name reported
    "ServeReplica:firstlight:ModelReplica": "replica",
    "ServeReplica:firstlight:Ingress": "ingress",
    "ProxyActor": "proxy",
    "--bare-server": "bare",
    "ServeController": "controller",
    "gcs_server": "gcs",
    "raylet": "raylet",
}


def watched() -> dict[int, tuple[str, psutil.Process]]:
    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        for key, name in PROCESSES.items():
            if key in cmd and proc.pid != os.getpid():
                out[proc.pid] = (name, proc)
                break
    return out


def cpu_seconds(procs: dict[int, tuple[str, psutil.Process]]) -> dict[int, float]:
    out = {}
    for pid, (_, proc) in procs.items():
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        out[pid] = times.user + times.system
    return out


async def load(url: str, seconds: float, model: str) -> int:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    chunks = 0
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            body = chat_body(model, 64)
            runs = await asyncio.gather(
                *(stream_times(client, url + "/v1/chat/completions", body) for _ in range(8))
            )
            chunks += sum(len(times) - 1 for times in runs)
    return chunks


def measure(url: str, seconds: float, model: str) -> dict[str, Any]:
    procs = watched()
    before, client0, t0 = cpu_seconds(procs), time.process_time(), time.monotonic()
    chunks = asyncio.run(load(url, seconds, model))
    after, client1, wall = cpu_seconds(procs), time.process_time(), time.monotonic() - t0
    per_process: dict[str, float] = {"client": client1 - client0}
    for pid, used in after.items():
        if pid in before:
            name = procs[pid][0]
            per_process[name] = per_process.get(name, 0.0) + used - before[pid]
    server = sum(v for k, v in per_process.items() if k != "client")
    return {
        "chunks_per_s": round(chunks / wall),
        "us_per_chunk": {k: round(1e6 * v / chunks) for k, v in per_process.items() if v > 0},
        "server_us_per_chunk": round(1e6 * server / chunks),
        "server_cores": round(server / wall, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=15.0)
    opts = p.parse_args()
    args = app_args()
    model = args.get("served_model_name", "demo")
    port = free_ports(2)  # the app's, then the floor's (`start_serve`)
    temp_dir = tempfile.mkdtemp(prefix="fl-bench-cpu-")
    bare = None
    try:
        log("starting bare server and Ray Serve")
        bare, bare_url = start_bare(args, "1")
        start_serve(args, port, serve_config().get("controller_options"), temp_dir)
        serve_url = f"http://127.0.0.1:{port}"
        for url in (serve_url, bare_url):
            asyncio.run(load(url, 3, model))  # warm-up
        result = {}
        for name, url in (("serve", serve_url), ("bare", bare_url)):
            log(f"{name}: {opts.seconds:.0f} s at c=8")
            result[name] = measure(url, opts.seconds, model)
            log(f"{name}: {result[name]}")
    finally:
        if bare is not None:
            bare.terminate()
            bare.wait(timeout=10)
        stop_serve()
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
