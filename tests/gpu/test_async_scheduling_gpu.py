"""Async scheduling on a GPU (`EngineConfig.async_scheduling`, on by default for CUDA
engines): steps are really launched while the previous one runs, so the pinned staging
copies, the token read-back events and the device feed are exercised for real. Skipped
without CUDA.

Run on a GPU host: `pytest -m gpu tests/gpu/test_async_scheduling_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams, TokenDelta
from tests.engine.engine_fixture import greedy, make_request, prompt_ids
from tests.gpu.helpers import warm_gpu_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def make_engine(async_scheduling: bool | None, dtype: str = "float32") -> LLMEngine:
    return warm_gpu_engine(dtype, 256, async_scheduling=async_scheduling)


def requests() -> list[Request]:
    """Long and short, chunked prompts, EOS on and off, seeded draws with every filter."""
    out = []
    for i, (prompt, new) in enumerate([(5, 300), (40, 200), (300, 150), (17, 90), (3, 40)]):
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=i % 2 == 0)
        out.append(make_request(f"g{i}", prompt_ids(i, prompt), sp))
    for i in range(4):
        sp = SamplingParams(
            max_tokens=120, temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, seed=i,
            ignore_eos=True,
        )  # fmt: skip
        out.append(make_request(f"s{i}", prompt_ids(20 + i, 30), sp))
    return out


def run(engine: LLMEngine, reqs: list[Request]) -> dict[str, list[TokenDelta]]:
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list[TokenDelta]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            out.setdefault(delta.request_id, []).append(delta)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return out


def tokens(out: dict[str, list[TokenDelta]]) -> dict[str, list[int]]:
    return {rid: [t for d in ds for t in d.token_ids] for rid, ds in out.items()}


def test_on_by_default_and_outputs_equal_the_synchronous_engine() -> None:
    sync = make_engine(False)
    ahead = make_engine(None)
    assert ahead.async_scheduling and not sync.async_scheduling
    want, got = run(sync, requests()), run(ahead, requests())
    assert tokens(got) == tokens(want)
    assert {r: d[-1].finish_reason for r, d in got.items()} == {
        r: d[-1].finish_reason for r, d in want.items()
    }
    assert ahead.counters.launched_steps == ahead.counters.steps
    assert ahead.runner.graphs is not None and ahead.runner.graphs.num_replays > 300


def test_a_launched_step_never_waits_for_the_device() -> None:
    """Under torch's sync debug mode "error", any operation that makes the host wait for the
    device (`.item()`, `.tolist()` of a device tensor, a copy from pageable memory, a
    data-dependent shape) raises; inside `step` it would fail the step's requests or make
    picking fall back to the host. Landing waits on an event only, which is allowed."""
    engine = make_engine(True)
    for r in requests():
        engine.add_request(r)
    for _ in range(3):  # first allocations and generator creation outside the check
        engine.step()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    counters = engine.counters
    steps, launched = counters.steps, counters.launched_steps
    try:
        out = run(engine, [make_request("late", prompt_ids(99, 50), greedy(60))])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert len(tokens(out)["late"]) == 60  # and no delta carried an error (`run`)
    assert counters.steps - steps > 100
    assert counters.launched_steps - launched == counters.steps - steps  # none fell back


def test_bfloat16_runs_launched() -> None:
    engine = make_engine(None, "bfloat16")
    got = tokens(run(engine, requests()))
    assert len(got["g0"]) == 300 and len(got["s3"]) == 120
    assert engine.counters.launched_steps == engine.counters.steps
