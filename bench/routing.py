"""What prefix-affinity routing buys over load-only routing, in one run.

    python bench/routing.py [--prefixes 12] [--prefix-tokens 768] [--requests 120]

Starts (and stops) its own Ray on 127.0.0.1 with the application of `serve_config.yaml` at
two ModelReplicas, each with a KV pool too small to hold every shared prefix of the workload
(`--kv-mib`), and measures the same request sequence twice: routed by `least_loaded` (the
baseline: where a request goes depends only on load, like Serve's default router) and by
`prefix_affinity`. Each request is one of `--prefixes` long shared prompts (a system prompt,
a document, a conversation's history) plus a short unique question, answered with one token,
one at a time, so its latency is queue + prefill: what TTFT is made of.

  ttft_mean_ratio   mean TTFT, prefix_affinity / least_loaded (lower is better)
  ttft_p90_ratio    the same at p90
  hit_rate_*        prompt tokens served from the prefix cache / prompt tokens looked up

Progress goes to stderr; the LAST stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
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


def workload(opts: argparse.Namespace) -> list[list[int]]:
    """Token-id prompts: a shared prefix each, then a unique 16-token question."""
    rng = random.Random(0)
    prefixes = [
        [rng.randrange(10, 1000) for _ in range(opts.prefix_tokens)] for _ in range(opts.prefixes)
    ]
    return [
        prefixes[rng.randrange(opts.prefixes)] + [rng.randrange(10, 1000) for _ in range(16)]
        for _ in range(opts.requests)
    ]


async def prefix_counters(client: httpx.AsyncClient) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    totals = {"firstlight_prefix_cache_queries": 0.0, "firstlight_prefix_cache_hits": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["firstlight_prefix_cache_queries"], totals["firstlight_prefix_cache_hits"]


async def run_policy(url: str, prompts: list[list[int]], warm: list[list[int]]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(prompt: list[int]) -> float:
            body = {"model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            response = await client.post("/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            return 1000 * (time.perf_counter() - start)

        for prompt in warm:  # every prefix once, so both policies start from warm caches
            await one(prompt)
        await asyncio.sleep(1.5)  # replica stats reach /metrics
        queries0, hits0 = await prefix_counters(client)
        ttft = [await one(prompt) for prompt in prompts]
        await asyncio.sleep(1.5)
        queries1, hits1 = await prefix_counters(client)
    return {
        "ttft_mean_ms": statistics.fmean(ttft),
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p90_ms": percentile(ttft, 0.9),
        "hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefixes", type=int, default=12)
    p.add_argument("--prefix-tokens", type=int, default=768)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--kv-mib", type=int, default=24, help="KV pool per replica")
    opts = p.parse_args()

    from ray import serve

    from actors.builder import application, load_config

    prompts = workload(opts)
    seen: dict[int, list[int]] = {}
    for prompt in prompts:
        seen.setdefault(hash(tuple(prompt[: opts.prefix_tokens])), prompt)
    warm = list(seen.values())

    temp_dir = tempfile.mkdtemp(prefix="fl-bench-routing-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    results: dict[str, dict[str, Any]] = {}
    try:
        start_ray_serve(
            "firstlight-bench-routing",
            port,
            serve_config().get("controller_options"),
            temp_dir,
            num_cpus=2,
        )
        for policy in ("least_loaded", "prefix_affinity"):
            args = app_args()
            engine = args["engine"]
            args["engine"] = {
                **engine,
                "cache": {**engine["cache"], "kv_cache_bytes": opts.kv_mib << 20},
            }
            args["replica"] = {
                **args["replica"],
                "autoscaling": {"min_replicas": 2, "max_replicas": 2},
                "stats_interval_s": 0.2,
            }
            args["ingress"] = {**args["ingress"], "sync_interval_s": 0.2}
            args["policies"] = {**args.get("policies", {}), "routing": policy}
            log(f"{policy}: starting 2 replicas")
            serve.run(application(load_config(args)), name="firstlight", route_prefix="/")
            wait_ready(url)
            log(f"{policy}: {len(warm)} warm-up + {len(prompts)} measured requests")
            results[policy] = asyncio.run(run_policy(url, prompts, warm))
            log(f"{policy}: {results[policy]}")
            serve.delete("firstlight")
    finally:
        stop_serve()
        shutil.rmtree(temp_dir, ignore_errors=True)

    base, ours = results["least_loaded"], results["prefix_affinity"]
    out = {
        "ttft_mean_ratio": ours["ttft_mean_ms"] / base["ttft_mean_ms"],
        "ttft_p90_ratio": ours["ttft_p90_ms"] / base["ttft_p90_ms"],
        "hit_rate_prefix_affinity": ours["hit_rate"],
        "hit_rate_least_loaded": base["hit_rate"],
        "ttft_mean_ms_prefix_affinity": ours["ttft_mean_ms"],
        "ttft_mean_ms_least_loaded": base["ttft_mean_ms"],
        "ttft_p50_ms_prefix_affinity": ours["ttft_p50_ms"],
        "ttft_p50_ms_least_loaded": base["ttft_p50_ms"],
        "requests": opts.requests,
        "prefixes": opts.prefixes,
        "prefix_tokens": opts.prefix_tokens,
        "kv_mib_per_replica": opts.kv_mib,
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
