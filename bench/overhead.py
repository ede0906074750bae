"""What Ray Serve adds over bare mode, against Ray's own floor, in one run.

    python bench/overhead.py [--ttft-requests 40] [--itl-rounds 10]
    python bench/overhead.py --config serve_config.gpu.yaml    # on a GPU host

Starts (and stops) its own Ray on 127.0.0.1 with the application of `serve_config.yaml`
(or `--config`; with a GPU config the bare server and the Serve replica share the GPU, each
sizing its KV pool from 0.4 of its memory)
(same args, same engine settings, speculative decoding off in both: see `main`), a bare
server (`app.standalone` built from the same args, under uvicorn, in a subprocess) and a
no-op two-deployment Serve stream, then measures with a raw streaming HTTP client:

  ray_floor_ms              TTFB p50 of the no-op stream: HTTP → ingress deployment → a
                            second deployment that yields one item, streamed back (the
                            ingress serves HTTP itself and calls with the handle transport
                            options of the app, as serve_config.yaml's Ingress does)
  ttft_serve_minus_bare_ms  TTFT p50 at concurrency 1 (streamed chat), Serve − bare
                            (target <= ray_floor_ms + 3)
  itl_p99_ratio_c8          ITL p99 (gaps between token chunks) at concurrency 8, Serve / bare
                            (target <= 1.25)

Serve and bare requests alternate, so load from anything else on the machine hits both
alike. Progress goes to stderr; the LAST stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "Can I pause my annual subscription?"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1 (several ingresses' ports)."""
    for _ in range(100):
        first = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


CONFIG = ROOT / "serve_config.yaml"  # the default of `--config`
GPU_SHARE = 0.4  # of the GPU's memory, for each of the two engines when they share one


def serve_config(path: Path = CONFIG) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def app_args(path: Path = CONFIG) -> dict[str, Any]:
    """The `args` of the firstlight application in the config (with the token channel's TCP
    listener, used only by replicas on other nodes, kept on loopback). An engine on a GPU
    gets `GPU_SHARE` of its memory: the bare server's engine shares the GPU."""
    args = dict(serve_config(path)["applications"][0].get("args") or {})
    args["ingress"] = {**args.get("ingress", {}), "channel_tcp_host": "127.0.0.1"}
    engine = dict(args.get("engine") or {})
    if engine.get("device", "cpu") != "cpu":
        engine["cache"] = {**engine.get("cache", {}), "gpu_memory_utilization": GPU_SHARE}
        args["engine"] = engine
    return args


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- the bare server (subprocess) --------------------------------------------------------------


def serve_bare(port: int, args: dict[str, Any]) -> None:
    """Bare mode (`app.standalone`'s own code path) with the same `args` as the Serve app."""
    import uvicorn

    from app.settings import StandaloneSettings
    from app.standalone import bare_args, build_standalone

    app = build_standalone(StandaloneSettings.layered(bare_args(args), {}))  # env over args
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start_bare(args: dict[str, Any], threads: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--bare-server", str(port), "--args", json.dumps(args)]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bare server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("bare server did not start")


# -- Ray Serve ---------------------------------------------------------------------------------


def start_serve(args: dict[str, Any], port: int, controller: dict | None, temp_dir: str) -> None:
    from fastapi import FastAPI
    from ray import serve
    from starlette.responses import StreamingResponse

    from actors.builder import application, load_config

    @serve.deployment(name="FloorLeaf", ray_actor_options={"num_cpus": 0})
    class FloorLeaf:
        async def generate(self) -> Any:
            yield b"data: {}\n\n"

    config = load_config(args)
    transport = config.ingress.handle_options()  # the floor's hop travels like the app's

    @serve.deployment(name="FloorIngress", ray_actor_options={"num_cpus": 0})
    @serve.ingress()
    class FloorIngress:
        def __init__(self, leaf: Any) -> None:
            self.leaf = leaf.options(stream=True, **transport)

        def __serve_build_asgi_app__(self) -> FastAPI:
            app = FastAPI()
            leaf = self.leaf

            @app.get("/")
            async def stream() -> StreamingResponse:
                return StreamingResponse(leaf.generate.remote(), media_type="text/event-stream")

            @app.get("/health")
            async def health() -> dict[str, str]:
                return {"status": "ok"}

            return app

    # the floor's ingress serves HTTP itself too, on the port after the app's
    start_ray_serve("firstlight-bench-overhead", port, controller, temp_dir, ingresses=2)
    serve.run(application(config), name="firstlight", route_prefix="/")
    wait_ready(f"http://127.0.0.1:{port}")
    serve.run(FloorIngress.bind(FloorLeaf.bind()), name="floor", route_prefix="/floor")
    wait_ready(f"http://127.0.0.1:{port + 1}/floor")


def start_ray_serve(
    namespace: str,
    port: int,
    controller: dict | None,
    temp_dir: str,
    ingresses: int = 1,
    num_cpus: int | None = None,
) -> None:
    """A private Ray on this machine (`num_cpus` logical CPUs, default all of them and at
    least 2) whose applications serve HTTP on 127.0.0.1:`port` (the first ingress deployed;
    the next `ingresses - 1` take the following ports), as serve_config.yaml does on 8000
    (Serve's direct ingress); Serve's own proxy, the fallback, on a free port."""
    import ray
    from ray import serve

    from actors.serve_internals import with_ingress_port

    os.environ["PYTHONPATH"] = str(ROOT)  # replicas import actors/, app/, engine/
    # Ray starts workers at nice 15 by default; the bare server runs at 0. Serving processes
    # should not yield to every other process on the box (`make serve` does the same).
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(
        address="local",
        namespace=namespace,
        num_cpus=num_cpus or max(2, os.cpu_count() or 2),
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=temp_dir,
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": free_port()},
        controller_options=with_ingress_port(controller, port, ingresses),
    )


def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    """Until the application at `url` answers `/health` (its HTTP server starts listening
    just after `serve.run` returns)."""
    from app.playground.announce import wait_until_up

    if not wait_until_up(url, timeout_s):
        raise RuntimeError(f"{url}/health did not answer within {timeout_s:.0f} s")


def stop_serve() -> None:
    import ray
    from ray import serve

    with contextlib.suppress(Exception):
        serve.shutdown()
    ray.shutdown()


# -- measurements ------------------------------------------------------------------------------


def chat_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def stream_times(client: httpx.AsyncClient, url: str, body: dict | None) -> list[float]:
    """Arrival times (perf_counter) of the body chunks that carry data, request start first."""
    start = time.perf_counter()
    times = [start]
    method = "POST" if body is not None else "GET"
    async with client.stream(method, url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code} {await response.aread()!r}")
        async for chunk in response.aiter_raw():
            if b'"content"' in chunk or body is None:
                times.append(time.perf_counter())
    return times


async def ttfb_ms(client: httpx.AsyncClient, url: str, body: dict | None, n: int) -> list[float]:
    out = []
    for _ in range(n):
        times = await stream_times(client, url, body)
        out.append(1000 * (times[1] - times[0]))
    return out


async def itl_gaps_ms(client: httpx.AsyncClient, url: str, body: dict, c: int) -> list[float]:
    runs = await asyncio.gather(*(stream_times(client, url, body) for _ in range(c)))
    return [1000 * (b - a) for times in runs for a, b in itertools.pairwise(times[1:])]


async def measure(
    serve_url: str, floor_url: str, bare_url: str, model: str, opts: argparse.Namespace
) -> dict[str, float]:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        chat = "/v1/chat/completions"
        log("warm-up")
        for base in (serve_url, bare_url):
            await ttfb_ms(client, base + chat, chat_body(model, 4), 5)
            await itl_gaps_ms(client, base + chat, chat_body(model, 16), 8)
        await ttfb_ms(client, floor_url, None, 5)

        log(f"ray floor: {opts.ttft_requests} no-op streams")
        floor = await ttfb_ms(client, floor_url, None, opts.ttft_requests)

        log(f"TTFT at c=1: {opts.ttft_requests} streamed chats each, alternating")
        ttft: dict[str, list[float]] = {"serve": [], "bare": []}
        for _ in range(opts.ttft_requests):
            for name, base in (("serve", serve_url), ("bare", bare_url)):
                ttft[name] += await ttfb_ms(
                    client, base + chat, chat_body(model, opts.ttft_tokens), 1
                )

        log(f"ITL at c=8: {opts.itl_rounds} rounds of 8 x {opts.itl_tokens} tokens, alternating")
        itl: dict[str, list[float]] = {"serve": [], "bare": []}
        for _ in range(opts.itl_rounds):
            for name, base in (("serve", serve_url), ("bare", bare_url)):
                itl[name] += await itl_gaps_ms(
                    client, base + chat, chat_body(model, opts.itl_tokens), 8
                )

    med = statistics.median
    result = {
        "ray_floor_ms": med(floor),
        "ttft_serve_minus_bare_ms": med(ttft["serve"]) - med(ttft["bare"]),
        "itl_p99_ratio_c8": percentile(itl["serve"], 0.99) / percentile(itl["bare"], 0.99),
        "ttft_p50_serve_ms": med(ttft["serve"]),
        "ttft_p50_bare_ms": med(ttft["bare"]),
        "itl_p50_serve_ms": med(itl["serve"]),
        "itl_p50_bare_ms": med(itl["bare"]),
        "itl_p99_serve_ms": percentile(itl["serve"], 0.99),
        "itl_p99_bare_ms": percentile(itl["bare"], 0.99),
        "itl_chunks_serve": len(itl["serve"]),
        "itl_chunks_bare": len(itl["bare"]),
        "loadavg_1m": os.getloadavg()[0],  # other work on the machine inflates tails
    }
    return {k: round(v, 3) for k, v in result.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ttft-requests", type=int, default=40)
    p.add_argument("--ttft-tokens", type=int, default=4)
    p.add_argument("--itl-rounds", type=int, default=10)
    p.add_argument("--itl-tokens", type=int, default=64)
    p.add_argument("--config", type=Path, default=CONFIG, help="the config to measure")
    p.add_argument("--bare-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--args", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.bare_server:
        serve_bare(opts.bare_server, json.loads(opts.args))
        return

    args = app_args(opts.config)
    # Speculation off in both: bare mode drafts in its own process, Serve through the
    # DraftReplica, so with it on the two would emit different tokens per chunk and the ITL
    # comparison would be between two decoders, not about what Serve adds (bench-spec
    # measures speculation through Serve).
    engine = args.get("engine", {})
    args["engine"] = {**engine, "speculative": {**engine.get("speculative", {}), "method": "off"}}
    # Ray gives each replica OMP_NUM_THREADS = max(1, int(num_cpus)); bare mode gets the same.
    threads = os.environ.get("OMP_NUM_THREADS") or str(
        max(1, int(args.get("replica", {}).get("num_cpus", 1)))
    )
    port = free_ports(2)  # the app's, then the floor's
    temp_dir = tempfile.mkdtemp(prefix="fl-bench-ray-")
    bare = None
    try:
        log("starting bare server and Ray Serve")
        bare, bare_url = start_bare(args, threads)
        start_serve(args, port, serve_config(opts.config).get("controller_options"), temp_dir)
        model = args.get("served_model_name", "demo")
        serve_url, floor_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}/floor/"
        result = asyncio.run(measure(serve_url, floor_url, bare_url, model, opts))
    finally:
        if bare is not None:
            bare.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                bare.wait(timeout=10)
            if bare.poll() is None:
                bare.kill()
        stop_serve()
        shutil.rmtree(temp_dir, ignore_errors=True)
    log(
        f"ray floor p50 {result['ray_floor_ms']} ms; TTFT p50 serve {result['ttft_p50_serve_ms']}"
        f" / bare {result['ttft_p50_bare_ms']} ms; ITL p99 serve {result['itl_p99_serve_ms']}"
        f" / bare {result['itl_p99_bare_ms']} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
