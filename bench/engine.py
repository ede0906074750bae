"""Engine benchmark: firstlight's engine vs HF transformers `generate`, same model, same run.

    python bench/engine.py [--model demo] [--quick]

Prints progress, then as its LAST line one JSON object:
  decode_tpot_ratio_vs_hf   batch-1 time per output token, ours / HF           (target <= 1.0)
  mixed_wall_ratio_vs_hf    64 mixed requests all at once, ours / HF padded
                            batches of 16                                      (target <= 0.5)
  prefix_ttft_speedup       TTFT uncached / TTFT with a cached 1024-token prefix (target >= 5)
  oversubscribed_errors     errors with a KV pool sized for half the load      (target 0)
  oversubscribed_preemptions                                                    (target > 0)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo.paths import resolve_model
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.request import Request, SamplingParams


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_prompt(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


# -- HF transformers baseline ------------------------------------------------------------------


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Greedy generation of exactly `new_tokens` for a left-padded batch; returns seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return time.perf_counter() - start


def hf_decode_tpot(model, prompt: list[int], n: int, pad_id: int) -> float:
    hf_generate(model, [prompt], 8, pad_id)  # warm-up
    t1 = statistics.median(hf_generate(model, [prompt], 1, pad_id) for _ in range(3))
    tn = statistics.median(hf_generate(model, [prompt], n, pad_id) for _ in range(3))
    return (tn - t1) / (n - 1)


# -- firstlight ---------------------------------------------------------------------------------


async def run_one(engine: AsyncEngine, rid: str, prompt: list[int], n: int) -> dict:
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first = last = None
    count = 0
    async for delta in engine.generate(Request(rid, prompt, params)):
        now = time.perf_counter()
        if delta.token_ids and first is None:
            first = now
        count += len(delta.token_ids)
        last = now
    assert first is not None and last is not None
    return {"ttft": first - start, "total": last - start, "decode": last - first, "n": count}


async def our_decode_tpot(engine: AsyncEngine, prompt: list[int], n: int) -> float:
    await run_one(engine, "warm", prompt, 8)
    runs = [await run_one(engine, f"tpot-{i}", prompt, n) for i in range(3)]
    return statistics.median(r["decode"] / (r["n"] - 1) for r in runs)


async def our_mixed(engine: AsyncEngine, work: list[tuple[list[int], int]]) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(run_one(engine, f"mix-{i}", p, n) for i, (p, n) in enumerate(work)))
    return time.perf_counter() - start


async def prefix_ttft(engine: AsyncEngine, rng: random.Random, lo: int, hi: int) -> float:
    uncached, cached = [], []
    for i in range(5):
        prefix = random_prompt(rng, 1024, lo, hi)
        cold = await run_one(engine, f"cold-{i}", prefix + random_prompt(rng, 16, lo, hi), 1)
        warm = await run_one(engine, f"warm-{i}", prefix + random_prompt(rng, 16, lo, hi), 1)
        uncached.append(cold["ttft"])
        cached.append(warm["ttft"])
    return statistics.median(uncached) / statistics.median(cached)


async def oversubscribed(config: EngineConfig, rng: random.Random, lo: int, hi: int) -> dict:
    n_req, prompt_len, out_len = 32, 256, 256
    blocks_per_req = (prompt_len + out_len) // 16
    cfg = replace(
        config,
        cache=replace(config.cache, num_blocks=n_req * blocks_per_req // 2),
        scheduler=replace(config.scheduler, max_num_seqs=n_req),
    )
    engine = AsyncEngine.from_config(cfg, resolve_model=resolve_model)
    await engine.start()
    try:
        work = [random_prompt(rng, prompt_len, lo, hi) for _ in range(n_req)]
        results = await asyncio.gather(
            *(run_one(engine, f"over-{i}", p, out_len) for i, p in enumerate(work)),
            return_exceptions=True,
        )
        errors = sum(1 for r in results if isinstance(r, BaseException) or r["n"] != out_len)
        return {"errors": errors, "preemptions": engine.stats().num_preemptions}
    finally:
        await engine.shutdown()


async def main_async(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    path = resolve_model(args.model)
    config = EngineConfig(
        model=args.model,
        cache=CacheConfig(kv_cache_bytes=512 * 1024 * 1024),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64),
    )
    engine = AsyncEngine.from_config(config, resolve_model=resolve_model)
    await engine.start()
    tok = engine.tokenizer
    lo, hi = 16, len(tok) - 16  # plain tokens, away from the specials
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    hf = load_hf(path)
    n_decode = 64 if args.quick else 128
    prompt = random_prompt(rng, 32, lo, hi)

    log("batch-1 decode: firstlight ...")
    ours_tpot = await our_decode_tpot(engine, prompt, n_decode)
    log(f"  {1000 * ours_tpot:.2f} ms/token; HF generate ...")
    hf_tpot = hf_decode_tpot(hf, prompt, n_decode, pad_id)
    log(f"  {1000 * hf_tpot:.2f} ms/token")

    n_mixed = 32 if args.quick else 64
    work = [
        (random_prompt(rng, rng.randint(32, 512), lo, hi), rng.randint(16, 256))
        for _ in range(n_mixed)
    ]
    log(f"mixed: {n_mixed} requests at once, firstlight ...")
    ours_mixed = await our_mixed(engine, work)
    log(f"  {ours_mixed:.2f} s; HF generate in padded batches of 16 ...")
    hf_mixed = 0.0
    for b in range(0, n_mixed, 16):
        batch = work[b : b + 16]
        hf_mixed += hf_generate(hf, [p for p, _ in batch], max(n for _, n in batch), pad_id)
    log(f"  {hf_mixed:.2f} s")

    log("prefix cache: TTFT with a cached 1024-token prefix ...")
    speedup = await prefix_ttft(engine, rng, lo, hi)
    log(f"  speedup {speedup:.1f}x")
    await engine.shutdown()

    log("oversubscribed: 32 x (256 + 256) tokens on a pool for half of them ...")
    over = await oversubscribed(config, rng, lo, hi)
    log(f"  {over}")
    return {
        "model": str(path.name),
        "threads": args.threads,
        "ours_decode_tpot_ms": round(1000 * ours_tpot, 3),
        "hf_decode_tpot_ms": round(1000 * hf_tpot, 3),
        "decode_tpot_ratio_vs_hf": round(ours_tpot / hf_tpot, 3),
        "ours_mixed_wall_s": round(ours_mixed, 2),
        "hf_mixed_wall_s": round(hf_mixed, 2),
        "mixed_wall_ratio_vs_hf": round(ours_mixed / hf_mixed, 3),
        "prefix_ttft_speedup": round(speedup, 2),
        "oversubscribed_errors": over["errors"],
        "oversubscribed_preemptions": over["preemptions"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="fewer requests (for smoke tests)")
    result = asyncio.run(main_async(p.parse_args()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
