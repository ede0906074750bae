"""What the cluster policies buy, each figure against its baseline in the same run.

    python bench/policies.py [--duration 40] [--chat-rate 2]

Starts (and stops) its own Ray on 127.0.0.1 and deploys the application of
`serve_config.yaml` several times on two ModelReplicas of the demo model:

1. Interactive vs bulk. Streamed chats (short answers) arrive at `--chat-rate` per second and
   `service_tier: flex` requests (long answers, more than the replicas can serve) at twice
   that, open loop, for `--duration` seconds. Once with the default policies (step order
   `priority`, routing `class_pools`, bulk throttle `spare_capacity`), once with FCFS step
   order, round-robin routing and no throttle; and the bulk load alone with the defaults.
     interactive_ttft_p95_ratio   chat TTFT p95, defaults / FCFS + round robin (<= 0.5)
     bulk_throughput_ratio        bulk tokens/s under the mixed load / bulk alone (>= 0.5)
   A chat still waiting for its first token when the run is cut counts with the time it
   waited (so the baseline's p95 is a lower bound).
2. Prefix-heavy load. `--sessions` users, each with a long context of its own (a document,
   a conversation), take turns asking follow-ups (every round each user once, in a random
   order), one request at a time; each replica's KV pool holds a little more than half the
   contexts. Default routing (class_pools over prefix affinity, by what replicas report
   holding) vs round robin:
     prefix_hit_ratio_vs_rr       prefix-cache hit rate, defaults / round robin (>= 2)
     prefix_ttft_p50_ratio_vs_rr  TTFT p50, defaults / round robin (<= 0.6)
3. Autoscaling. One replica (at most two), streamed chats from a step load of closed-loop
   users: few, many until a second replica serves, few until it is gone again.
     autoscale_failed_requests    requests that did not end with [DONE] and a finish (= 0)
     cold_start_s                 scale-up decision to the new replica's first token
                                  (firstlight_cold_start_seconds, from /metrics)

A plot (chat TTFT over time in both runs of 1; replicas and users over time in 3) goes to
`--plot` as SVG. Progress goes to stderr; the LAST stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.overhead import (  # noqa: E402
    app_args,
    free_port,
    log,
    percentile,
    serve_config,
    start_ray_serve,
    stop_serve,
    wait_ready,
)
from bench.routing import run_policy  # noqa: E402
from locustfiles.prompts import QUESTIONS  # noqa: E402
from locustfiles.svg import Series, line_chart  # noqa: E402

BASELINE = {"step_order": "fcfs", "routing": "round_robin", "bulk_throttle": "unlimited"}


# -- configs -----------------------------------------------------------------------------------


def config_args(
    *,
    replicas: tuple[int, int] = (2, 2),
    baseline: bool = False,
    routing: str | None = None,
    kv_mib: int | None = None,
    autoscaling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """serve_config.yaml's args with the replica count, the policies under test and fast
    stats pushes."""
    args = app_args()
    engine = dict(args["engine"])
    scheduler = dict(engine.get("scheduler", {}))
    policies = dict(args.get("policies", {}))
    if baseline:
        scheduler["policy"] = BASELINE["step_order"]
        policies["routing"] = BASELINE["routing"]
        policies["bulk_throttle"] = BASELINE["bulk_throttle"]
    if routing is not None:
        policies["routing"] = routing
    if kv_mib is not None:
        engine["cache"] = {**engine.get("cache", {}), "kv_cache_bytes": kv_mib << 20}
    engine["scheduler"] = scheduler
    args["engine"] = engine
    args["policies"] = policies
    low, high = replicas
    scaling = {**args["replica"].get("autoscaling", {}), "min_replicas": low, "max_replicas": high}
    args["replica"] = {
        **args["replica"],
        "autoscaling": {**scaling, **(autoscaling or {})},
        "stats_interval_s": 0.25,
    }
    args["ingress"] = {**args["ingress"], "sync_interval_s": 0.25}
    return args


def deploy(args: dict[str, Any], what: str, url: str) -> None:
    from ray import serve

    from actors.builder import application, load_config

    log(f"{what}: deploying")
    serve.run(application(load_config(args)), name="firstlight", route_prefix="/")
    wait_ready(url)


def undeploy() -> None:
    from ray import serve

    serve.delete("firstlight")


def running_replicas() -> int:
    from ray import serve

    status = serve.status().applications.get("firstlight")
    if status is None:
        return 0
    states = status.deployments["ModelReplica"].replica_states
    return sum(n for state, n in states.items() if str(state) == "RUNNING")


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """/metrics as {sample name: total over labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


# -- one request -------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    started: float  # seconds since the phase began
    status: int = 0
    ttft_s: float | None = None
    tokens: int = 0
    done: bool = False
    finish: str | None = None
    error: str | None = None
    ended: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finish is not None and not self.error


async def stream_chat(
    client: httpx.AsyncClient, body: dict[str, Any], t0: float, outcome: Outcome | None = None
) -> Outcome:
    """A streamed request; its TTFT is the first chunk with content."""
    start = time.perf_counter()
    out = outcome or Outcome(start - t0)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        out.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            out.ended = time.perf_counter() - t0
            return out
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"].get("message"))
                for choice in event.get("choices", []):
                    if choice.get("delta", {}).get("content") and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - start
                    out.finish = choice.get("finish_reason") or out.finish
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
    out.ended = time.perf_counter() - t0
    return out


async def complete(client: httpx.AsyncClient, body: dict[str, Any], t0: float) -> Outcome:
    start = time.perf_counter()
    out = Outcome(start - t0)
    response = await client.post("/v1/chat/completions", json=body)
    out.status = response.status_code
    out.ended = time.perf_counter() - t0
    if response.status_code == 200:
        data = response.json()
        out.tokens = data["usage"]["completion_tokens"]
        out.finish = data["choices"][0]["finish_reason"]
        out.done = True
    return out


def chat_body(question: str, max_tokens: int, flex: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    if flex:
        body["service_tier"] = "flex"
    else:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


# -- 1. interactive vs bulk --------------------------------------------------------------------


@dataclass(slots=True)
class MixedRun:
    chats: list[Outcome] = field(default_factory=list)
    bulk: list[Outcome] = field(default_factory=list)
    elapsed_s: float = 0.0

    def ttft_samples(self, cutoff_s: float) -> list[tuple[float, float]]:
        """(arrival, TTFT) per chat that was admitted; one still waiting at the cut counts
        with the time it waited."""
        out = []
        for chat in self.chats:
            if chat.status not in (0, 200):
                continue
            ttft = chat.ttft_s if chat.ttft_s is not None else cutoff_s - chat.started
            out.append((chat.started, ttft))
        return out

    def bulk_tokens_per_s(self) -> float:
        tokens = sum(b.tokens for b in self.bulk if b.ok)
        return tokens / self.elapsed_s if self.elapsed_s else 0.0


async def open_loop(
    rate: float, duration: float, launch: Callable[[], Awaitable[Any]], rng: random.Random
) -> list[asyncio.Task]:
    """Start `launch()` at Poisson arrivals of `rate` per second for `duration` seconds."""
    tasks: list[asyncio.Task] = []
    end = time.perf_counter() + duration
    while (now := time.perf_counter()) < end:
        tasks.append(asyncio.create_task(launch()))
        await asyncio.sleep(min(rng.expovariate(rate), max(0.0, end - now)))
    return tasks


async def mixed_load(url: str, opts: argparse.Namespace, chat_rate: float) -> MixedRun:
    run = MixedRun()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        rng = random.Random(0)
        t0 = time.perf_counter()

        async def chat() -> None:
            outcome = Outcome(time.perf_counter() - t0)
            run.chats.append(outcome)
            question = QUESTIONS[rng.randrange(len(QUESTIONS))]
            await stream_chat(client, chat_body(question, opts.chat_tokens), t0, outcome)

        async def bulk() -> None:
            question = QUESTIONS[rng.randrange(len(QUESTIONS))]
            run.bulk.append(await complete(client, chat_body(question, opts.bulk_tokens, True), t0))

        loads = [open_loop(2 * opts.chat_rate, opts.duration, bulk, random.Random(1))]
        if chat_rate > 0:
            loads.append(open_loop(chat_rate, opts.duration, chat, random.Random(2)))
        tasks = [t for started in await asyncio.gather(*loads) for t in started]
        cutoff = opts.duration + opts.drain
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True),
                max(1.0, cutoff - (time.perf_counter() - t0)),
            )
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ends = [o.ended for o in run.bulk if o.ok and o.ended is not None]
        run.elapsed_s = max([opts.duration, *ends])
    return run


# -- 2. prefix-heavy ---------------------------------------------------------------------------


def sessions(opts: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """Each session's long context, and the request sequence: a warm-up round, then rounds
    in which every session asks once, in a random order (context + a new question)."""
    rng = random.Random(0)
    contexts = [
        [rng.randrange(10, 1000) for _ in range(opts.context_tokens)] for _ in range(opts.sessions)
    ]

    def ask(s: int) -> list[int]:
        return contexts[s] + [rng.randrange(10, 1000) for _ in range(16)]

    warm = [ask(s) for s in range(opts.sessions)]
    order: list[int] = []
    for _ in range(opts.rounds):
        turn = list(range(opts.sessions))
        rng.shuffle(turn)
        order += turn
    return warm, [ask(s) for s in order]


# -- 3. autoscaling ----------------------------------------------------------------------------


@dataclass(slots=True)
class ScaleRun:
    outcomes: list[Outcome] = field(default_factory=list)
    replicas: list[tuple[float, float]] = field(default_factory=list)
    users: list[tuple[float, float]] = field(default_factory=list)
    cold_start_s: float | None = None
    peak_replicas: int = 0


async def step_load(url: str, opts: argparse.Namespace) -> ScaleRun:
    run = ScaleRun()
    t0 = time.perf_counter()
    seen = {"replicas": 1}
    stop_watch = threading.Event()

    def watch() -> None:  # serve.status() blocks: its own thread
        while not stop_watch.is_set():
            with contextlib.suppress(Exception):
                seen["replicas"] = running_replicas()
                run.replicas.append((time.perf_counter() - t0, float(seen["replicas"])))
            stop_watch.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    limits = httpx.Limits(max_connections=500)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        before = await scrape(client)
        users: list[tuple[asyncio.Task, asyncio.Event]] = []
        every_user: list[asyncio.Task] = []

        async def user(stop: asyncio.Event) -> None:
            rng = random.Random(len(every_user))
            while not stop.is_set():
                question = QUESTIONS[rng.randrange(len(QUESTIONS))]
                outcome = await stream_chat(client, chat_body(question, opts.scale_tokens), t0)
                run.outcomes.append(outcome)

        def set_users(n: int) -> None:
            while len(users) < n:
                stop = asyncio.Event()
                users.append((asyncio.create_task(user(stop)), stop))
                every_user.append(users[-1][0])
            for _, stop in users[n:]:
                stop.set()
            del users[n:]
            run.users.append((time.perf_counter() - t0, float(n)))

        async def until(check: Callable[[], bool], timeout: float) -> bool:
            deadline = time.perf_counter() + timeout
            while not check() and time.perf_counter() < deadline:
                await asyncio.sleep(0.5)
            return check()

        low, high = opts.scale_users
        set_users(low)
        await asyncio.sleep(10)
        set_users(high)
        scaled = await until(lambda: seen["replicas"] >= 2, opts.scale_timeout)
        log(f"autoscale: {'two replicas' if scaled else 'no second replica'} after the step up")
        run.peak_replicas = max((int(r) for _, r in run.replicas), default=0)
        await asyncio.sleep(15)
        set_users(low)
        back = await until(lambda: seen["replicas"] <= 1, opts.scale_timeout)
        log(f"autoscale: {'back to one replica' if back else 'still two replicas'}")
        await asyncio.sleep(5)
        set_users(0)
        await asyncio.gather(*every_user, return_exceptions=True)
        await asyncio.sleep(1.0)
        after = await scrape(client)
    stop_watch.set()
    watcher.join(timeout=5)
    name = "firstlight_cold_start_seconds"
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    if count:
        run.cold_start_s = (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / count
    return run


# -- main --------------------------------------------------------------------------------------


def write_plot(path: Path, runs: dict[str, MixedRun], scale: ScaleRun, cutoff: float) -> None:
    """One SVG: chat TTFT over time in both mixed runs, above replicas and users over time
    in the autoscaled step load."""
    ttft = line_chart(
        "Chat TTFT while flex bulk arrives at twice the chat rate (2 replicas, demo model)",
        [
            Series(name, [(t, 1000 * v) for t, v in run.ttft_samples(cutoff)])
            for name, run in runs.items()
        ],
        x_label="chat request arrival (s)",
        y_label="TTFT (ms)",
    )
    users: list[tuple[float, float | None]] = []
    for t, n in scale.users:  # a step: the previous count until the change
        if users:
            users.append((t, users[-1][1]))
        users.append((t, n / 10))
    replicas = line_chart(
        "Autoscaled step load: replicas follow the users (policies.autoscaling: slo)",
        [Series("replicas running", scale.replicas), Series("users ÷ 10", users, dashed=True)],
        x_label="time (s)",
        y_label="count",
    )
    lower = replicas.replace("<svg ", '<svg y="280" ', 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="560">{ttft}{lower}</svg>'
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=40.0, help="seconds of mixed load")
    p.add_argument("--drain", type=float, default=20.0, help="seconds allowed after the load")
    p.add_argument("--chat-rate", type=float, default=2.0, help="chats per second")
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument("--bulk-tokens", type=int, default=768)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--context-tokens", type=int, default=768)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--kv-mib", type=int, default=28, help="KV pool per replica (prefix runs)")
    p.add_argument("--scale-users", type=int, nargs=2, default=(2, 24))
    p.add_argument("--scale-tokens", type=int, default=96)
    p.add_argument("--scale-timeout", type=float, default=90.0)
    p.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "policies.svg")
    p.add_argument("--skip", nargs="*", default=(), choices=("mixed", "prefix", "autoscale"))
    opts = p.parse_args()

    temp_dir = tempfile.mkdtemp(prefix="fl-bench-policies-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {}
    mixed: dict[str, MixedRun] = {}
    scale = ScaleRun()
    try:
        start_ray_serve(
            "firstlight-bench-policies", port, serve_config().get("controller_options"), temp_dir
        )
        if "mixed" not in opts.skip:
            for name, baseline in (("defaults", False), ("fcfs + round robin", True)):
                deploy(config_args(baseline=baseline), f"mixed load, {name}", url)
                mixed[name] = asyncio.run(mixed_load(url, opts, opts.chat_rate))
                undeploy()
            deploy(config_args(), "bulk alone, defaults", url)
            alone = asyncio.run(mixed_load(url, opts, 0.0))
            undeploy()
            cutoff = opts.duration + opts.drain
            ttft = {k: [v for _, v in run.ttft_samples(cutoff)] for k, run in mixed.items()}
            ours, base = ttft["defaults"], ttft["fcfs + round robin"]
            out |= {
                "interactive_ttft_p95_ratio": percentile(ours, 0.95) / percentile(base, 0.95),
                "bulk_throughput_ratio": mixed["defaults"].bulk_tokens_per_s()
                / alone.bulk_tokens_per_s(),
                "chat_ttft_p95_ms_defaults": 1000 * percentile(ours, 0.95),
                "chat_ttft_p95_ms_fcfs_rr": 1000 * percentile(base, 0.95),
                "chat_ttft_p50_ms_defaults": 1000 * percentile(ours, 0.5),
                "chat_ttft_p50_ms_fcfs_rr": 1000 * percentile(base, 0.5),
                "chats_refused_defaults": sum(
                    c.status not in (0, 200) for c in mixed["defaults"].chats
                ),
                "chats_refused_fcfs_rr": sum(
                    c.status not in (0, 200) for c in mixed["fcfs + round robin"].chats
                ),
                "bulk_tokens_per_s_mixed": mixed["defaults"].bulk_tokens_per_s(),
                "bulk_tokens_per_s_alone": alone.bulk_tokens_per_s(),
                "bulk_refused_mixed": sum(b.status == 429 for b in mixed["defaults"].bulk),
            }
            log(json.dumps(out))
        if "prefix" not in opts.skip:
            warm, prompts = sessions(opts)
            prefix: dict[str, dict] = {}
            for name, routing in (("defaults", None), ("round_robin", "round_robin")):
                deploy(
                    config_args(routing=routing, kv_mib=opts.kv_mib), f"prefix-heavy, {name}", url
                )
                prefix[name] = asyncio.run(run_policy(url, prompts, warm))
                log(f"prefix-heavy, {name}: {prefix[name]}")
                undeploy()
            ours_p, rr = prefix["defaults"], prefix["round_robin"]
            out |= {
                "prefix_hit_ratio_vs_rr": ours_p["hit_rate"] / max(rr["hit_rate"], 1e-9),
                "prefix_ttft_p50_ratio_vs_rr": ours_p["ttft_p50_ms"] / rr["ttft_p50_ms"],
                "prefix_hit_rate_defaults": ours_p["hit_rate"],
                "prefix_hit_rate_rr": rr["hit_rate"],
                "prefix_ttft_p50_ms_defaults": ours_p["ttft_p50_ms"],
                "prefix_ttft_p50_ms_rr": rr["ttft_p50_ms"],
            }
        if "autoscale" not in opts.skip:
            scaling = {
                "target_ongoing_requests": 4,
                "upscale_delay_s": 2,
                "downscale_delay_s": 8,
                "look_back_period_s": 4,
            }
            deploy(config_args(replicas=(1, 2), autoscaling=scaling), "autoscale step load", url)
            scale = asyncio.run(step_load(url, opts))
            undeploy()
            out |= {
                "autoscale_failed_requests": sum(not o.ok for o in scale.outcomes),
                "cold_start_s": scale.cold_start_s,
                "autoscale_requests": len(scale.outcomes),
                "autoscale_peak_replicas": scale.peak_replicas,
            }
    finally:
        stop_serve()
        shutil.rmtree(temp_dir, ignore_errors=True)
    if mixed or scale.replicas:
        write_plot(opts.plot, mixed, scale, opts.duration + opts.drain)
        log(f"plot: {opts.plot}")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
